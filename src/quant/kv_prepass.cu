#include "quant/kv_prepass.cuh"

#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cfloat>
#include <type_traits>

#include "common/vec_io.cuh"
#include "quant/kv_tiles.cuh"
#include "sage/error.h"
#include "sage/quant_rules.h"
#include "sage/tile.h"
#include "sm90/head_dims.h"
#include "sm90/ptx.cuh"
#include "sm90/tma_maps.h"

namespace sage::quant {
namespace {

constexpr int kThreads = kTileThreads;

// ---- pass 1: statistics --------------------------------------------------------------------
// One cluster of stats_ctas CTAs per (batch, kv head): the first stats_k_ctas read K (its keys
// 0, k_mean_stride, ...: recipe.k_mean_stride), the others V, each CTA a stride of the rows.
// Rank 0 combines the CTAs' sums and extremes through distributed shared memory in rank order
// (deterministic, no atomics) and writes the head's finals, so that a quantize CTA reads a few
// floats per channel instead of reducing partials.
// (v8 wrote per-chunk partials that every quantize CTA of the head reduced again: L2 reads
// growing as N^2, 1.4 ms of pre-pass at d = 128, N = 16K on the H100 against 0.86 ms at 1K.)
constexpr int kStatsCtas = 8;  // the most CTAs per head (the portable cluster size)
// Heads of at most this many tokens get half as many CTAs (a second instantiation): at N = 1K,
// 8 per head made 15 waves of short CTAs, and 4 took 6% off the pre-pass at N = 1K (both head
// dims) and at d = 64, 2K (docs/performance.md, v30).
constexpr int kStatsHalfClusterMaxN = 2048;
int stats_ctas(int n_kv) { return n_kv <= kStatsHalfClusterMaxN ? kStatsCtas / 2 : kStatsCtas; }
// The CTAs of a cluster that read K: a share of the cluster as K's sampled rows are of the
// rows read, so that K's and V's CTAs finish together (4 of 8 for every key, 1 of 8 for
// every 8th key, where 4 left the V CTAs reading twice as long).
int stats_k_ctas(int k_mean_stride, int ctas) {
  const int k = (2 * ctas + k_mean_stride + 1) / (2 * (k_mean_stride + 1));
  return k < 1 ? 1 : k > ctas / 2 ? ctas / 2 : k;
}

// Rows in flight per thread: 8 (60 registers, still four CTAs per SM) against 4 took the
// pre-pass from 0.371 to 0.358 ms at d = 128, N = 1K (H200, v20, same-run A/B).
constexpr int kStatsUnroll = 8;

// Four CTAs per SM: at d = 128, N = 16K the grid (8 CTAs for each of 64 heads) is one wave.
// Ctas (stats_ctas) CTAs per cluster, a compile-time size: as a launch attribute with a
// run-time loop bound, the 8-CTA form cost 1-3% of the pre-pass (v30's first form).
template <int D, class T, int Ctas>
__global__ void __cluster_dims__(Ctas, 1, 1) __launch_bounds__(kThreads, 4)
    kv_stats_kernel(const sm90::KVQuantParams p) {
  namespace cg = cooperative_groups;
  constexpr int kLanesPerRow = D / 8;
  constexpr int kRowsPerIter = kThreads / kLanesPerRow;
  // The quantize kernel may launch once every statistics CTA has started: its CTAs load
  // their K/V rows on the SMs this grid's last wave leaves free, then wait for its finals.
  sm90::launch_dependent_grids();
  cg::cluster_group cluster = cg::this_cluster();
  const int rank = int(cluster.block_rank());
  const int k_ctas = p.stats_k_ctas;
  const bool is_v = rank >= k_ctas;
  const int h = blockIdx.y, b = blockIdx.z;
  const int lane_c = threadIdx.x % kLanesPerRow, r0 = threadIdx.x / kLanesPerRow;
  const T* base = (is_v ? static_cast<const T*>(p.v) + b * p.v_stride_b + h * p.v_stride_h
                        : static_cast<const T*>(p.k) + b * p.k_stride_b + h * p.k_stride_h) +
                  lane_c * 8;
  // Row i of the tensor's statistics is token i (V) or key i * k_mean_stride (K).
  const int64_t row_pitch = is_v ? p.v_stride_n : p.k_stride_n * p.k_mean_stride;
  const int rows = is_v ? p.n_kv : p.k_mean_samples;
  const int step = kRowsPerIter * (is_v ? Ctas - k_ctas : k_ctas);  // between a thread's rows
  ChannelStats<T> st;
  st.init();
  // The CTAs of one tensor interleave by kRowsPerIter rows, so that they stream neighbouring
  // memory at the same time; each thread keeps kStatsUnroll loads in flight, the last round's
  // too (as a loop of single loads, a thread with 5 rows waited for 5 round trips in a row:
  // d = 64, N = 1K, 7 V CTAs).
  const int first = (is_v ? rank - k_ctas : rank) * kRowsPerIter + r0;
  for (int t = first; t < rows; t += kStatsUnroll * step) {
    uint4 raw[kStatsUnroll];
#pragma unroll
    for (int u = 0; u < kStatsUnroll; ++u)
      if (t + u * step < rows)
        raw[u] = *reinterpret_cast<const uint4*>(base + int64_t(t + u * step) * row_pitch);
#pragma unroll
    for (int u = 0; u < kStatsUnroll; ++u)
      if (t + u * step < rows) st.add(raw[u]);
  }

  __shared__ float red[kStatsRows][kWarps][D];
  __shared__ float cta_stats[kStatsRows][D];
  combine_cta_stats<D, T>(st, lane_c, red, cta_stats);
  cluster.sync();  // every CTA's cta_stats is written
  if (rank != 0) {
    // Resident until rank 0 has read cta_stats, not until it has written the finals.
    sm90::cluster_arrive_release();
    sm90::cluster_wait_acquire();
    return;
  }
  const int64_t head = (int64_t)b * p.heads_kv + h;
  const int c = threadIdx.x;
  // [0]: K, [1]: V. Indexed only by constants: a run-time index (k_ctas decides which ranks
  // are K's) put the arrays in local memory.
  float sum[2] = {0.f, 0.f}, mx[2] = {-FLT_MAX, -FLT_MAX}, mn[2] = {FLT_MAX, FLT_MAX};
  if (c < D)
#pragma unroll
    for (int r = 0; r < Ctas; ++r) {
      const float* other = cluster.map_shared_rank(&cta_stats[0][0], r);
      const float s = other[kSum * D + c], x = other[kMax * D + c], n = other[kMin * D + c];
      if (r < k_ctas) {
        sum[0] += s, mx[0] = fmaxf(mx[0], x), mn[0] = fminf(mn[0], n);
      } else {
        sum[1] += s, mx[1] = fmaxf(mx[1], x), mn[1] = fminf(mn[1], n);
      }
    }
  sm90::cluster_arrive_release();  // done with the other CTAs' shared memory
  __shared__ float s_warp_amax[2][D / 32];
  write_head_finals<D>(p, head, sum, mx, mn, s_warp_amax);
  sm90::cluster_wait_acquire();
}

// kFull: n_kv is a multiple of kBlockKV (chosen per launch: as a branch per CTA between the
// two instantiations, ptxas took the bf16 d = 128 kernel from 80 to 124 registers). Occupancy:
// six CTAs per SM at d = 64 (40 registers, no spills), four at d = 128 (64; it needs ~60).
template <int D, class T, bool kFull>
__global__ void __launch_bounds__(kThreads, D == 64 ? 6 : 4)
    kv_quantize_kernel(const sm90::KVQuantParams p) {
  // The transposed V tile: dynamic, sized by the launch for the path's element size, so that
  // 8-bit V does not pay fp16's shared memory in occupancy.
  extern __shared__ __align__(16) uint8_t s_vt[];
  __shared__ KTileShared<D> k_shared;
  __shared__ VTileShared<D> v_shared;
  const int tile = blockIdx.x / 2, h = blockIdx.y, b = blockIdx.z;
  if (blockIdx.x % 2 == 0)
    quantize_k_tile<D, T, kFull>(p, tile, h, b, k_shared);
  else if (p.pv_path == sm90::PVPath::fp16)
    quantize_v_tile<D, T, VFormat::fp16, kFull>(p, tile, h, b, s_vt, v_shared);
  else if (p.pv_path == sm90::PVPath::int8)
    quantize_v_tile<D, T, VFormat::int8, kFull>(p, tile, h, b, s_vt, v_shared);
  else
    quantize_v_tile<D, T, VFormat::e4m3, kFull>(p, tile, h, b, s_vt, v_shared);
}

// Pass for prequantized INT8 inputs (INT-FlashAttention): nothing to measure or quantize, so
// one launch copies K with its per-token scales into the workspace layout, transposes V with
// the P-layout permutation, and broadcasts V's scales to one per channel.
template <int D>
__global__ void __launch_bounds__(kThreads) kv_copy_prequantized_kernel(const sm90::KVQuantParams p) {
  constexpr int kLanesPerRow = D / 8;
  constexpr int kRowsPerIter = kThreads / kLanesPerRow;
  constexpr int kRows = sm90::kBlockKV / kRowsPerIter;
  const int tile = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int lane_c = threadIdx.x % kLanesPerRow, r0 = threadIdx.x / kLanesPerRow;
  __shared__ __align__(16) uint8_t s_vt[D * kVtPitch8];

  const int64_t head = (int64_t)b * p.heads_kv + h;
  if (tile == 0 && threadIdx.x < D) {
    const int c = threadIdx.x;
    const float* vs = p.v_scale_in + b * p.vs_stride_b + h * p.vs_stride_h;
    p.out.v_scale[head * D + c] = p.v_per_tensor ? vs[0] : vs[c * p.vs_stride_c];
    p.out.k_mean[head * D + c] = 0.f;
    p.out.v_mean[head * D + c] = 0.f;
  }
  if (threadIdx.x < sm90::kBlockKV) {
    const int t = tile * sm90::kBlockKV + threadIdx.x;
    p.out.k_scale[head * p.n_pad + t] =
        t < p.n_kv ? p.k_scale_in[b * p.ks_stride_b + h * p.ks_stride_h + t * p.ks_stride_n] : 0.f;
  }
  const int8_t* kb = static_cast<const int8_t*>(p.k) + b * p.k_stride_b + h * p.k_stride_h + lane_c * 8;
  const int8_t* vb = static_cast<const int8_t*>(p.v) + b * p.v_stride_b + h * p.v_stride_h + lane_c * 8;
  int8_t* kq = p.out.k + (head * p.n_pad + tile * sm90::kBlockKV) * D + lane_c * 8;
#pragma unroll
  for (int i = 0; i < kRows; ++i) {
    const int r = r0 + i * kRowsPerIter;
    const int t = tile * sm90::kBlockKV + r;
    uint2 kw = make_uint2(0, 0), vw = make_uint2(0, 0);
    if (t < p.n_kv) {
      kw = *reinterpret_cast<const uint2*>(kb + (int64_t)t * p.k_stride_n);
      vw = *reinterpret_cast<const uint2*>(vb + (int64_t)t * p.v_stride_n);
    }
    *reinterpret_cast<uint2*>(kq + (int64_t)r * D) = kw;
    const int pos = 32 * (r / 32) + pv_position_of_token(r % 32);
#pragma unroll
    for (int j = 0; j < 8; ++j)
      s_vt[(lane_c * 8 + j) * kVtPitch8 + pos] = uint8_t(((j < 4 ? vw.x : vw.y) >> (8 * (j % 4))) & 0xFF);
  }
  __syncthreads();
  store_vt_tile<D, 1>(p, b, h, tile, s_vt);
}

}  // namespace

void plan_kv_statistics(sm90::KVQuantParams& p) {
  // Set here, not in the kernel: the first form divided in every CTA before its first load
  // and, with a loop of single loads for the last round, cost the pre-pass 2-6% at stride 1
  // (docs/performance.md, v29).
  p.k_mean_samples = int(rules::k_mean_samples(p.n_kv, p.k_mean_stride));
  p.stats_k_ctas = stats_k_ctas(p.k_mean_stride, stats_ctas(p.n_kv));
}

template <int D, class T>
void launch_kv_prepass(const sm90::KVQuantParams& p, cudaStream_t stream) {
  if (p.k_scale_in != nullptr) {
    const dim3 grid(p.n_pad / sm90::kBlockKV, p.heads_kv, p.batch);
    kv_copy_prequantized_kernel<D><<<grid, kThreads, 0, stream>>>(p);
    return;
  }
  sm90::KVQuantParams q = p;
  plan_kv_statistics(q);
  const int ctas = stats_ctas(p.n_kv);
  const dim3 stats_grid(ctas, p.heads_kv, p.batch);  // one cluster per head
  if (ctas == kStatsCtas)
    kv_stats_kernel<D, T, kStatsCtas><<<stats_grid, kThreads, 0, stream>>>(q);
  else
    kv_stats_kernel<D, T, kStatsCtas / 2><<<stats_grid, kThreads, 0, stream>>>(q);
  // Programmatic dependent launch: see launch_dependent_grids in kv_stats_kernel.
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(2 * (p.n_pad / sm90::kBlockKV), p.heads_kv, p.batch);
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = size_t(D) * sm90::v_bytes(p.pv_path) * kVtPitch8;  // < 48 KiB
  cfg.stream = stream;
  cudaLaunchAttribute pdl{};
  pdl.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  pdl.val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = &pdl;
  cfg.numAttrs = 1;
  const bool full_tiles = p.n_kv % sm90::kBlockKV == 0;
  const cudaError_t err = full_tiles ? cudaLaunchKernelEx(&cfg, kv_quantize_kernel<D, T, true>, q)
                                     : cudaLaunchKernelEx(&cfg, kv_quantize_kernel<D, T, false>, q);
  if (err != cudaSuccess) sm90::throw_cuda("K/V quantize launch", err);
}

#define SAGE_INSTANTIATE_PREPASS(D)                                                        \
  template void launch_kv_prepass<D, __half>(const sm90::KVQuantParams&, cudaStream_t);   \
  template void launch_kv_prepass<D, __nv_bfloat16>(const sm90::KVQuantParams&, cudaStream_t);
SAGE_FOR_EACH_HEAD_DIM(SAGE_INSTANTIATE_PREPASS)

}  // namespace sage::quant
