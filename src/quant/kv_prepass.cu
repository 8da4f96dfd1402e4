#include "quant/kv_prepass.cuh"

#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cfloat>
#include <type_traits>

#include "common/vec_io.cuh"
#include "sage/error.h"
#include "numerics/quant_rules.h"
#include "numerics/tile.h"
#include "built_kernels.h"
#include "common/ptx.cuh"
#include "common/cuda_check.h"
#include "sm90/mma/fragment.cuh"

namespace sage::quant {
namespace {

constexpr int kThreads = 256;

// ---- pass 1: statistics --------------------------------------------------------------------
// One cluster of stats_ctas CTAs per (batch, kv head): the first stats_k_ctas read K (its keys
// 0, k_mean_stride, ...: recipe.k_mean_stride), the others V, each CTA a stride of the rows.
// Rank 0 combines the CTAs' sums and extremes through distributed shared memory in rank order
// (deterministic, no atomics) and writes the head's finals, so that a quantize CTA reads a few
// floats per channel instead of reducing partials.
// (v8's per-chunk partials, reduced again by every quantize CTA of the head, grew the L2
// reads as N^2: docs/design.md, the K/V pre-pass.)
constexpr int kStatsCtas = 8;  // the most CTAs per head (the portable cluster size)
// Heads of at most this many tokens get half as many CTAs (a second instantiation): at N = 1K,
// 8 per head made 15 waves of short CTAs (v30, docs/history/README.md).
constexpr int kStatsHalfClusterMaxN = 2048;
int stats_ctas(int n_kv) { return n_kv <= kStatsHalfClusterMaxN ? kStatsCtas / 2 : kStatsCtas; }
// The CTAs of a cluster that read K: a share of the cluster as K's sampled rows are of the
// rows read, so that K's and V's CTAs finish together (4 of 8 for every key, 1 of 8 for
// every 8th key, where 4 left the V CTAs reading twice as long).
int stats_k_ctas(int k_mean_stride, int ctas) {
  const int k = (2 * ctas + k_mean_stride + 1) / (2 * (k_mean_stride + 1));
  return k < 1 ? 1 : k > ctas / 2 ? ctas / 2 : k;
}

// Rows in flight per thread: 8 (60 registers, still four CTAs per SM) rather than 4 (v20b,
// docs/history/README.md).
constexpr int kStatsUnroll = 8;
enum StatsRow : int { kSum = 0, kMax, kMin, kStatsRows };

template <class T>
struct ChannelStats {
  // The extremes stay packed in the input type (exact, and one max or min per two values);
  // the sums are fp32.
  using Pair = std::conditional_t<std::is_same_v<T, __half>, __half2, __nv_bfloat162>;
  static constexpr uint32_t kMinusInf = std::is_same_v<T, __half> ? 0xFC00FC00u : 0xFF80FF80u;
  static constexpr uint32_t kPlusInf = kMinusInf & 0x7FFF7FFFu;
  float sum[8];
  Pair max2[4], min2[4];
  __device__ __forceinline__ static Pair as_pair(uint32_t w) {
    return *reinterpret_cast<const Pair*>(&w);
  }
  __device__ __forceinline__ void init() {
#pragma unroll
    for (int i = 0; i < 8; ++i) sum[i] = 0.f;
#pragma unroll
    for (int j = 0; j < 4; ++j) max2[j] = as_pair(kMinusInf), min2[j] = as_pair(kPlusInf);
  }
  __device__ __forceinline__ void add(const uint4& raw) {
    const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 f = gpu::word_to_float2<T>(w[j]);
      sum[2 * j] += f.x;
      sum[2 * j + 1] += f.y;
    }
    add_extremes(raw);
  }
  __device__ __forceinline__ void add_extremes(const uint4& raw) {
    const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      max2[j] = __hmax2_nan(max2[j], as_pair(w[j]));
      min2[j] = __hmin2_nan(min2[j], as_pair(w[j]));
    }
  }
  // Value i of the max (or min) as a float.
  __device__ __forceinline__ float max(int i) const { return half_of(max2[i / 2], i % 2); }
  __device__ __forceinline__ float min(int i) const { return half_of(min2[i / 2], i % 2); }

 private:
  __device__ __forceinline__ static float half_of(Pair p, int hi) {
    const uint32_t w = *reinterpret_cast<const uint32_t*>(&p);
    const float2 f = gpu::word_to_float2<T>(w);
    return hi ? f.y : f.x;
  }
};

// The CTA's per-thread statistics combined in a fixed order, so that repeated calls are
// bit-identical: cta_stats[s][c] for s in StatsRow. The lanes of a warp that hold the same
// channels combine by shuffles first, then thread c < D takes the warps' rows from `red`: one
// round of shared memory for the three statistics, not a chain of dependent shared loads per
// statistic (v20b). Every thread calls it.
constexpr int kWarps = kThreads / 32;
template <int D, class T>
__device__ __forceinline__ void combine_cta_stats(const ChannelStats<T>& st, int lane_c,
                                                  float (*red)[kWarps][D], float (*cta_stats)[D]) {
  constexpr int kLanesPerRow = D / 8;
  float v[kStatsRows][8];
#pragma unroll
  for (int i = 0; i < 8; ++i) v[kSum][i] = st.sum[i], v[kMax][i] = st.max(i), v[kMin][i] = st.min(i);
#pragma unroll
  for (int off = kLanesPerRow; off < 32; off *= 2)
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      v[kSum][i] += __shfl_xor_sync(0xffffffffu, v[kSum][i], off);
      v[kMax][i] = rules::max_nan(v[kMax][i], __shfl_xor_sync(0xffffffffu, v[kMax][i], off));
      v[kMin][i] = rules::min_nan(v[kMin][i], __shfl_xor_sync(0xffffffffu, v[kMin][i], off));
    }
  const int warp = threadIdx.x / 32;
  if (threadIdx.x % 32 < kLanesPerRow)
#pragma unroll
    for (int s = 0; s < kStatsRows; ++s)
#pragma unroll
      for (int i = 0; i < 8; ++i) red[s][warp][lane_c * 8 + i] = v[s][i];
  __syncthreads();
  if (threadIdx.x < D) {
    const int c = threadIdx.x;
    float sum = red[kSum][0][c], mx = red[kMax][0][c], mn = red[kMin][0][c];
#pragma unroll
    for (int w = 1; w < kWarps; ++w) {
      sum += red[kSum][w][c];
      mx = rules::max_nan(mx, red[kMax][w][c]);
      mn = rules::min_nan(mn, red[kMin][w][c]);
    }
    cta_stats[kSum][c] = sum, cta_stats[kMax][c] = mx, cta_stats[kMin][c] = mn;
  }
  __syncthreads();
}

// A packed variable-length batch's entry b as the dense pre-pass sees it (KVQuantParams::
// cu_seqlens_k): k and v at the sequence's first key, n_kv its length and the K statistics'
// samples of that length, so that every pass below reads, measures and pads that sequence
// only. The length is clamped to [0, max_seqlen_k] (p.n_kv): offsets that break the call's
// contract cannot index past the sequence's workspace entry. Dense batches: p unchanged.
template <class T>
__device__ __forceinline__ KVQuantParams sequence_params(const KVQuantParams& p, int b) {
  if (p.cu_seqlens_k == nullptr) return p;
  KVQuantParams s = p;
  const int first = p.cu_seqlens_k[b];
  const int n = min(max(p.cu_seqlens_k[b + 1] - first, 0), p.n_kv);
  s.k = static_cast<const T*>(p.k) + int64_t(first) * p.k_stride_n;
  s.v = static_cast<const T*>(p.v) + int64_t(first) * p.v_stride_n;
  s.n_kv = n;
  s.k_mean_samples = int(rules::k_mean_samples(n, p.k_mean_stride));
  return s;
}

// Packed batches only: a K/V tile wholly past its sequence's keys is never read by the
// attention kernel (its items visit the sequence's tiles only), so its CTA does nothing.
__device__ __forceinline__ bool past_sequence(const KVQuantParams& p, int tile) {
  return p.cu_seqlens_k != nullptr && tile * kKVTile >= p.n_kv;
}

// Four CTAs per SM: at d = 128, N = 16K the grid (8 CTAs for each of 64 heads) is one wave.
// Ctas (stats_ctas) CTAs per cluster, a compile-time size: as a launch attribute with a
// run-time loop bound it slowed the pre-pass (v30, docs/history/README.md).
template <int D, class T, int Ctas>
__global__ void __cluster_dims__(Ctas, 1, 1) __launch_bounds__(kThreads, 4)
    kv_stats_kernel(const KVQuantParams p_in) {
  namespace cg = cooperative_groups;
  const KVQuantParams p = sequence_params<T>(p_in, blockIdx.z);
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
  // too (as a loop of single loads, a thread waited for one round trip per row, one after
  // another: v29).
  const int first = (is_v ? rank - k_ctas : rank) * kRowsPerIter + r0;
  // Channels past the caller's head dim (the workspace's padding, kv_layout.h) count as zeros.
  const bool lane_in = lane_c * 8 < (is_v ? p.head_dim_v : p.head_dim);
  for (int t = first; t < rows; t += kStatsUnroll * step) {
    uint4 raw[kStatsUnroll];
#pragma unroll
    for (int u = 0; u < kStatsUnroll; ++u)
      if (t + u * step < rows)
        raw[u] = lane_in ? *reinterpret_cast<const uint4*>(base + int64_t(t + u * step) * row_pitch)
                         : make_uint4(0, 0, 0, 0);
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
        sum[0] += s, mx[0] = rules::max_nan(mx[0], x), mn[0] = rules::min_nan(mn[0], n);
      } else {
        sum[1] += s, mx[1] = rules::max_nan(mx[1], x), mn[1] = rules::min_nan(mn[1], n);
      }
    }
  sm90::cluster_arrive_release();  // done with the other CTAs' shared memory
  __shared__ float s_warp_amax[2][D / 32];
  float kamax = 0.f, vamax = 0.f;
  bool balance_moves = false;  // this thread's channel has s_c != 1
  if (c < D) {
    // A packed batch's sequence without keys: no key is ever read (its items visit no tile),
    // so its statistics are zeros rather than 0 / 0 and the extremes' +-FLT_MAX.
    if (p.n_kv == 0) sum[0] = sum[1] = mx[0] = mx[1] = mn[0] = mn[1] = 0.f;
    const float km = p.smooth_k && p.n_kv > 0 ? sum[0] / p.k_mean_samples : 0.f;
    const float vm = p.smooth_v && p.n_kv > 0 ? sum[1] / p.n_kv : 0.f;
    // Rounding is monotonic, so the extreme of |x - mean| is reached at the channel's max
    // or min: the same value a pass over every token would find. (K's over its sampled keys
    // only: kamax serves per_tensor K scales, which have no sm_90 kernel, and the balance,
    // whose ranges the simulator takes over the same keys.)
    kamax = rules::max_nan(mx[0] - km, km - mn[0]);
    vamax = rules::max_nan(mx[1] - vm, vm - mn[1]);
    p.out.k_mean[head * D + c] = km;
    p.out.v_mean[head * D + c] = vm;
    if (p.q_amax != nullptr) {
      const float s = rules::qk_balance_scale(p.q_amax[head * D + c], kamax);
      p.out.qk_balance[head * D + c] = s;
      balance_moves = s != 1.f;
    }
    // The largest over the channels (per-tensor scales) by a shuffle tree: max is exact in
    // any order, and one thread looping over D shared values kept the cluster waiting ~D
    // dependent loads (v20b).
    float mk = kamax, mv = vamax;
#pragma unroll
    for (int off = 16; off > 0; off /= 2) {
      mk = rules::max_nan(mk, __shfl_xor_sync(0xffffffffu, mk, off));
      mv = rules::max_nan(mv, __shfl_xor_sync(0xffffffffu, mv, off));
    }
    if (c % 32 == 0) s_warp_amax[0][c / 32] = mk, s_warp_amax[1][c / 32] = mv;
  }
  // A head whose scales are all 1 is quantized as without the balance: the attention kernel
  // then skips the division (qk_balance_active).
  const bool head_moves = __syncthreads_or(balance_moves);
  if (p.q_amax != nullptr && c == 0) p.out.qk_balance_active[head] = head_moves;
  if (c < D) {
    float all_k = s_warp_amax[0][0], all_v = s_warp_amax[1][0];
#pragma unroll
    for (int w = 1; w < D / 32; ++w)
      all_k = rules::max_nan(all_k, s_warp_amax[0][w]), all_v = rules::max_nan(all_v, s_warp_amax[1][w]);
    if (p.v_per_tensor) vamax = all_v;  // INT-FlashAttention: one scale over all channels
    // fp16 V is not scaled: the kernel's epilogue multiplies by 1.
    // Per-block V (SageBwd) is scaled per tile by the quantize pass (quantize_v_tile), so the
    // epilogue's channel scale is 1 there too.
    const bool v_unit = p.v_format == VFormat::fp16 || p.v_per_block;
    p.out.v_scale[head * D + c] = v_unit ? 1.f : rules::symmetric_scale(vamax, p.v_max);
    p.out.v_inv[head * D + c] = v_unit ? 1.f : rules::symmetric_inverse(vamax, p.v_max);
    if (c == 0) p.out.k_amax[head] = all_k;
  }
  sm90::cluster_wait_acquire();
}

// Bytes per transposed V row in shared memory: a tile's tokens plus 4 bytes of padding per
// byte of element, which breaks the transpose's bank conflicts.
constexpr int kVtPitch8 = kKVTile + 4;

// Two V values (already smoothed and scaled) in the format, `lo` in the low bits: E4M3 or
// INT8 bytes, or fp16 halves as the simulator's round_fp16_saturate_overflow (a finite value
// past 65504 saturates, an infinity or a NaN stays). A template parameter: as a run-time
// switch it cost a compare and two branches per pair inside the tile loop (SASS).
// x clamped to fp16's finite range when finite; an infinity or a NaN unchanged.
__device__ __forceinline__ float saturate_finite_fp16(float x) {
  return fabsf(x) == INFINITY ? x : rules::min_nan(rules::max_nan(x, -65504.f), 65504.f);
}

template <VFormat F>
__device__ __forceinline__ uint32_t encode_v_pair(float lo, float hi) {
  if constexpr (F == VFormat::int8) {
    return (uint32_t(rules::round_clamp(lo, rules::kInt8Max)) & 0xFFu) |
           ((uint32_t(rules::round_clamp(hi, rules::kInt8Max)) & 0xFFu) << 8);
  } else if constexpr (F == VFormat::fp16) {
    const __half2 h = __floats2half2_rn(saturate_finite_fp16(lo), saturate_finite_fp16(hi));
    return *reinterpret_cast<const uint32_t*>(&h);
  } else {
    return sm90::pack_e4m3x2(lo, hi);
  }
}

// Writes the transposed tile (D rows of kBlockKV * VBytes bytes, VBytes * kVtPitch8 apart in
// shared memory) to its place in the workspace's [B, Hkv, D, n_pad] V. The element size is a
// template parameter: as a run-time value, each 32-bit word's row and column took an integer
// division and a remainder (v21b, docs/history/README.md).
template <int D, int VBytes>
__device__ __forceinline__ void store_vt_tile(const KVQuantParams& p, int b, int h, int tile,
                                              const uint8_t* s_vt) {
  constexpr int kWordsPerRow = kKVTile * VBytes / 4, kPitch = VBytes * kVtPitch8;
  static_assert(D * kWordsPerRow % kThreads == 0, "whole rounds of words");
  const int64_t row_bytes = int64_t(p.n_pad) * VBytes;
  uint8_t* vt = p.out.vt + ((int64_t)b * p.heads_kv + h) * D * row_bytes +
                int64_t(tile) * kKVTile * VBytes + 4 * (threadIdx.x % kWordsPerRow);
  const uint8_t* src = s_vt + 4 * (threadIdx.x % kWordsPerRow);
#pragma unroll 4
  for (int round = 0; round < D * kWordsPerRow / kThreads; ++round) {
    const int c = (threadIdx.x + round * kThreads) / kWordsPerRow;
    *reinterpret_cast<uint32_t*>(vt + c * row_bytes) =
        *reinterpret_cast<const uint32_t*>(src + c * kPitch);
  }
}

// ---- pass 2: quantize ----------------------------------------------------------------------
// Two CTAs per 128-token tile, one for K and one for V (blockIdx.x = 2 * tile + is_v). Each
// holds only its own tensor's rows in registers, all loads issued first: 64 registers per
// thread at d = 128 where one CTA for both took 126 and fit fewer CTAs per SM (v9,
// docs/design.md).
// kFull: n_kv is a multiple of kBlockKV, so no token of the tile is padding and the
// per-element padding tests go (kv_quantize_kernel). kBalance: qk_channel_balance, K' =
// fl(K - mean) * s_c (exact, s_c a power of two); a template parameter so that the other
// recipes' pass keeps its instructions.
template <int D, class T, bool kFull, bool kBalance>
__device__ __forceinline__ void quantize_k_tile(const KVQuantParams& p, int tile, int h,
                                                int b) {
  constexpr int kLanesPerRow = D / 8;
  constexpr int kRowsPerIter = kThreads / kLanesPerRow;
  constexpr int kRows = kKVTile / kRowsPerIter;  // rows per thread
  const int lane_c = threadIdx.x % kLanesPerRow, r0 = threadIdx.x / kLanesPerRow;
  const int64_t head = (int64_t)b * p.heads_kv + h;
  __shared__ __align__(16) float s_kmean[D];
  __shared__ __align__(16) float s_kbalance[kBalance ? D : 1];
  __shared__ float s_row_amax[kKVTile];
  __shared__ float s_kinv[kKVTile];  // per token, or the tile's per-thread groups

  const T* kb = static_cast<const T*>(p.k) + b * p.k_stride_b + h * p.k_stride_h + lane_c * 8;
  const bool lane_in = lane_c * 8 < p.head_dim;  // else the workspace's zero channels
  uint4 raw[kRows];
#pragma unroll
  for (int i = 0; i < kRows; ++i) {
    const int t = tile * kKVTile + r0 + i * kRowsPerIter;
    // Zeros past n_kv: padding never counts toward a scale.
    raw[i] = (kFull || t < p.n_kv) && lane_in
                 ? *reinterpret_cast<const uint4*>(kb + (int64_t)t * p.k_stride_n)
                 : make_uint4(0, 0, 0, 0);
  }
  sm90::grid_dependency_wait();  // the statistics kernel's finals (launched with PDL)
  if (threadIdx.x < D) {
    s_kmean[threadIdx.x] = p.out.k_mean[head * D + threadIdx.x];
    if constexpr (kBalance) s_kbalance[threadIdx.x] = p.out.qk_balance[head * D + threadIdx.x];
  }
  __syncthreads();
  // The thread's eight channel means, as two 16-byte loads where they are used: read one float
  // at a time, they were 16 shared loads per row with four-way bank conflicts (v18b).
  auto kmean8 = [&](float (&km)[8]) {
    const float4 a = *reinterpret_cast<const float4*>(&s_kmean[lane_c * 8]);
    const float4 c = *reinterpret_cast<const float4*>(&s_kmean[lane_c * 8 + 4]);
    km[0] = a.x, km[1] = a.y, km[2] = a.z, km[3] = a.w, km[4] = c.x, km[5] = c.y, km[6] = c.z,
    km[7] = c.w;
  };
  // The thread's eight balance scales (1 without the balance: never read).
  auto kbalance8 = [&](float (&ks)[8]) {
    if constexpr (kBalance) {
      const float4 a = *reinterpret_cast<const float4*>(&s_kbalance[lane_c * 8]);
      const float4 c = *reinterpret_cast<const float4*>(&s_kbalance[lane_c * 8 + 4]);
      ks[0] = a.x, ks[1] = a.y, ks[2] = a.z, ks[3] = a.w, ks[4] = c.x, ks[5] = c.y, ks[6] = c.z,
      ks[7] = c.w;
    }
  };
  // K' of a value: smoothed, and balanced where the recipe says.
  auto k_prime = [](float x, float km, float ks) {
    const float smoothed = __fsub_rn(x, km);
    if constexpr (kBalance) return __fmul_rn(smoothed, ks);
    return smoothed;
  };

  // s_row_amax: per token, each row's amax (a shuffle across the row's lanes for every row).
  // Otherwise only the thread groups' maxima are needed, and a thread's rows r0 + i *
  // kRowsPerIter all lie in thread group (r0 % 8) / 2: entry r0 holds the maximum over those
  // rows, one shuffle round per thread instead of one per row (v20c).
  const bool per_token = p.k_granularity == Granularity::per_token;
  if (per_token) {
    // Each 16-bit value is converted twice (here for the amax, below for the codes) rather
    // than kept as floats: 32 fewer live registers per thread.
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      const int r = r0 + i * kRowsPerIter;
      float x[8];
      gpu::unpack8<T>(raw[i], x);
      float km[8], ks[8];
      kmean8(km);
      kbalance8(ks);
      float amax = 0.f;
      if (kFull || tile * kKVTile + r < p.n_kv)
#pragma unroll
        for (int j = 0; j < 8; ++j) amax = rules::max_nan(amax, fabsf(k_prime(x[j], km[j], ks[j])));
#pragma unroll
      for (int off = 1; off < kLanesPerRow; off *= 2)
        amax = rules::max_nan(amax, __shfl_xor_sync(0xffffffffu, amax, off));
      if (lane_c == 0) s_row_amax[r] = amax;
    }
  } else {
    // The thread's largest |K - mean| from its channels' extremes over its rows, as the
    // statistics kernel finds the per-tensor one: rounding is monotonic and fl(a - b) =
    // -fl(b - a), so max_r |fl(x_r - m)| = max(fl(max_r x_r - m), fl(m - min_r x_r)), the same
    // value. The extremes are packed comparisons in the input type (exact): per thread 16 of
    // them, 16 conversions and subtractions, where each of 64 values took a conversion, a
    // subtraction and a maximum (v21c).
    ChannelStats<T> ext;
    ext.init();
#pragma unroll
    for (int i = 0; i < kRows; ++i)
      if (kFull || tile * kKVTile + r0 + i * kRowsPerIter < p.n_kv)
        ext.add_extremes(raw[i]);
    float km[8], ks[8];
    kmean8(km);
    kbalance8(ks);
    float thread_amax = 0.f;  // also where the thread has no row below n_kv
    // (A balance scale is positive: the extremes of K' are still at the channel's max and
    // min, and fl(m - min) * s = -K'(min) exactly.)
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      float below = __fsub_rn(km[j], ext.min(j));
      if constexpr (kBalance) below = __fmul_rn(below, ks[j]);
      thread_amax = rules::max_nan(thread_amax, rules::max_nan(k_prime(ext.max(j), km[j], ks[j]), below));
    }
#pragma unroll
    for (int off = 1; off < kLanesPerRow; off *= 2)
      thread_amax = rules::max_nan(thread_amax, __shfl_xor_sync(0xffffffffu, thread_amax, off));
    if (lane_c == 0) s_row_amax[r0] = thread_amax;
  }
  __syncthreads();
  const float k_max = float(p.k_max);
  if (per_token) {
    if (threadIdx.x < kKVTile) {
      const int r = threadIdx.x;
      s_kinv[r] = rules::symmetric_inverse(s_row_amax[r], k_max);
      p.out.k_scale[head * p.n_pad + tile * kKVTile + r] =
          rules::symmetric_scale(s_row_amax[r], k_max);
    }
  } else if (threadIdx.x < 32) {
    // One warp reduces the kRowsPerIter (16 or 32) entries (max is exact in any order): lane
    // l takes entry l, whose rows lie in thread group (l % 8) / 2, as do lanes l ^ 1, l ^ 8 and
    // l ^ 16, where a few threads scanning all 128 rows kept the CTA waiting (v12).
    static_assert(kKVTile == 128 && kKScalesPerTile == 4 && kRowsPerIter <= 32 &&
                      kRowsPerIter % 8 == 0, "lane map");
    const int lane = threadIdx.x;
    float amax = lane < kRowsPerIter ? s_row_amax[lane] : 0.f;
    for (int off : {1, 8, 16}) amax = rules::max_nan(amax, __shfl_xor_sync(0xffffffffu, amax, off));
    const float tile_amax = rules::max_nan(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
    const int g = lane;  // lanes 0..3 write group g, whose maximum lane 2g holds
    const float group_amax = __shfl_sync(0xffffffffu, amax, 2 * (g % kKScalesPerTile));
    const float both_groups = __shfl_sync(0xffffffffu, tile_amax, 4);
    if (g < kKScalesPerTile) {
      float a;
      switch (p.k_granularity) {
        case Granularity::per_thread: a = group_amax; break;
        case Granularity::per_tensor: a = p.out.k_amax[head]; break;
        default:  // per_block and per_warp: every warp reads the whole K tile
          a = rules::max_nan(tile_amax, both_groups);
          break;
      }
      s_kinv[g] = rules::symmetric_inverse(a, k_max);
      p.out.k_scale[(head * (p.n_pad / kKVTile) + tile) * kKScalesPerTile + g] =
          rules::symmetric_scale(a, k_max);
    }
  }
  __syncthreads();
  int8_t* kq = p.out.k + (head * p.n_pad + tile * kKVTile) * D + lane_c * 8;
  // The codes of rules::round_clamp, as the Q path gets them (q_operand.cuh, docs/numerics.md
  // step 3): the low byte of the product plus 1.5 * 2^23, and no clamp, which never acts since
  // each smoothed value is at most its group's amax in magnitude (the amax above, or per
  // tensor the statistics pass's max(max - mean, mean - min), which rounding's monotonicity
  // makes the same bound). Per value an FMUL and an FADD, and three byte permutes per four
  // values, where rintf, the two-sided clamp, the float-to-int conversion and the shifts into
  // place took about seven in a kernel bound by issue, not DRAM (v18b, docs/history/README.md).
#pragma unroll
  for (int i = 0; i < kRows; ++i) {
    const int r = r0 + i * kRowsPerIter;
    const float inv = s_kinv[p.k_granularity == Granularity::per_token    ? r
                             : p.k_granularity == Granularity::per_thread ? (r % 8) / 2
                                                                          : 0];
    const bool valid = kFull || tile * kKVTile + r < p.n_kv;
    float x[8], km[8], ks[8];
    gpu::unpack8<T>(raw[i], x);
    kmean8(km);
    kbalance8(ks);
    uint32_t c[8];
#pragma unroll
    for (int j = 0; j < 8; ++j)
      c[j] = sm90::round_to_low_bits(__fmul_rn(valid ? k_prime(x[j], km[j], ks[j]) : 0.f, inv));
    uint32_t w[2];
#pragma unroll
    for (int h4 = 0; h4 < 2; ++h4)
      w[h4] = __byte_perm(__byte_perm(c[4 * h4], c[4 * h4 + 1], 0x0040),
                          __byte_perm(c[4 * h4 + 2], c[4 * h4 + 3], 0x0040), 0x5410);
    *reinterpret_cast<uint2*>(kq + (int64_t)r * D) = make_uint2(w[0], w[1]);
  }
}

// The first token of stored quad `quad` (positions 4 quad .. 4 quad + 3) of an 8-bit V tile;
// its four tokens are this plus 0, 1, 8, 9.
__host__ __device__ constexpr int quad_token_base(int quad) {
  return 32 * (quad / 8) + 16 * ((quad / 4) % 2) + 2 * (quad % 4);
}
constexpr bool quad_tokens_match() {
  for (int pos = 0; pos < kKVTile; ++pos) {
    const int i = pos % 4;
    const int token = 32 * (pos / 32) + pv_token_at_position(pos % 32);
    if (quad_token_base(pos / 4) + (i < 2 ? i : 6 + i) != token) return false;
  }
  return true;
}
static_assert(quad_tokens_match(), "quad_token_base agrees with pv_token_at_position");

// V: smooth, scale, encode (E4M3, INT8 or fp16), transpose through s_vt (D rows of `pitch`
// bytes). 8-bit V takes the P-layout token permutation; fp16 V stays in token order
// (pv_operand.cuh).
//
// A thread works on units of four consecutive stored positions ("quads") x eight channels:
// it loads the four tokens stored there (one 16-byte row piece each) and writes each channel's
// four codes as one 32-bit word (fp16: 64 bits). At d = 128 a warp takes 8 quads x 4 channel
// chunks, so with the 33-word pitch the 32 words of one store land in 32 banks (bank =
// channel + quad); at d = 64 it takes 4 quads x all 8 chunks (2-way conflicts), so that each
// load reads whole 128-byte rows (half rows were slower there). Single bytes per token took
// 4x the shared-memory stores, with 4-way bank conflicts (v12, docs/history/README.md).
template <int D, class T, VFormat F, bool kFull>
__device__ __forceinline__ void quantize_v_tile(const KVQuantParams& p, int tile, int h,
                                                int b, uint8_t* s_vt) {
  constexpr int kChunks = D / 8;                 // 8-channel pieces of a token's row
  constexpr int kQuads = kKVTile / 4;     // groups of four stored positions per tile
  constexpr int kChunksPerWarp = kChunks == 8 ? 8 : 4, kQuadsPerWarp = 32 / kChunksPerWarp;
  constexpr int kUnits = kQuads * kChunks / kThreads;  // (quad, chunk) units per thread
  static_assert(kQuads * kChunks % kThreads == 0 && kQuads % kQuadsPerWarp == 0 &&
                kChunks % kChunksPerWarp == 0, "unit map");
  const int64_t head = (int64_t)b * p.heads_kv + h;
  constexpr bool v_fp16 = F == VFormat::fp16;
  __shared__ float s_vmean[D], s_vinv[D];

  auto unit_quad = [](int k) {
    const int u = threadIdx.x + k * kThreads, w = u / 32, lane = u % 32;
    return (w % (kQuads / kQuadsPerWarp)) * kQuadsPerWarp + lane % kQuadsPerWarp;
  };
  auto unit_chunk = [](int k) {
    const int u = threadIdx.x + k * kThreads, w = u / 32, lane = u % 32;
    return (w / (kQuads / kQuadsPerWarp)) * kChunksPerWarp + lane / kQuadsPerWarp;
  };
  // The tile token stored at position 4 * quad + i. 8-bit V: positions 4t .. 4t + 3 of a
  // 16-token half slice hold tokens 2t, 2t + 1, 2t + 8, 2t + 9 (pv_token_at_position), so a
  // quad's tokens are one base plus constants once i is unrolled (checked below).
  auto token_at = [&](int quad, int i) {
    if constexpr (v_fp16) return 4 * quad + i;
    return quad_token_base(quad) + (i < 2 ? i : 6 + i);
  };

  const T* vb = static_cast<const T*>(p.v) + b * p.v_stride_b + h * p.v_stride_h;
  uint4 raw[kUnits][4];
#pragma unroll
  for (int k = 0; k < kUnits; ++k)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int t = tile * kKVTile + token_at(unit_quad(k), i);
      // Zeros past n_kv (padding never counts toward a scale) and past the head dim.
      raw[k][i] = (kFull || t < p.n_kv) && unit_chunk(k) * 8 < p.head_dim_v ? *reinterpret_cast<const uint4*>(
                                            vb + (int64_t)t * p.v_stride_n + unit_chunk(k) * 8)
                                      : make_uint4(0, 0, 0, 0);
    }
  sm90::grid_dependency_wait();  // the statistics kernel's finals (launched with PDL)
  if (threadIdx.x < D) {
    s_vmean[threadIdx.x] = p.out.v_mean[head * D + threadIdx.x];
    s_vinv[threadIdx.x] = p.out.v_inv[head * D + threadIdx.x];
  }
  __syncthreads();
  if constexpr (F == VFormat::int8) {
    // Per-block V (SageBwd): the tile's one multiplier (v_block_amax_kernel) for every channel.
    if (p.v_per_block) {
      __syncthreads();  // s_vinv's channel values are replaced
      if (threadIdx.x < D) s_vinv[threadIdx.x] = p.out.v_block_inv[head * (p.n_pad / kKVTile) + tile];
      __syncthreads();
    }
  }

  constexpr int pitch = (v_fp16 ? 2 : 1) * kVtPitch8;
#pragma unroll
  for (int k = 0; k < kUnits; ++k) {
    const int quad = unit_quad(k), c0 = unit_chunk(k) * 8;
    bool valid[4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
      valid[i] = kFull || tile * kKVTile + token_at(quad, i) < p.n_kv;
    // One 32-bit word (two channels) of the four tokens at a time: 8 floats live, not 32 (with
    // all 32 the fp16 d = 128 kernel took 80 registers, three CTAs per SM instead of four).
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      float2 y[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const uint4& r = raw[k][i];
        y[i] = gpu::word_to_float2<T>(w == 0 ? r.x : w == 1 ? r.y : w == 2 ? r.z : r.w);
      }
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int c = c0 + 2 * w + half;
        // Read once for the four tokens (under the valid test, the compiler loaded them once
        // per token).
        const float vmean = s_vmean[c], vinv = s_vinv[c];
        float v[4];
#pragma unroll
        for (int i = 0; i < 4; ++i)
          v[i] = valid[i] ? __fmul_rn(__fsub_rn(half ? y[i].y : y[i].x, vmean), vinv) : 0.f;
        const uint32_t lo = encode_v_pair<F>(v[0], v[1]);
        const uint32_t hi = encode_v_pair<F>(v[2], v[3]);
        if constexpr (v_fp16)
          *reinterpret_cast<uint2*>(&s_vt[c * pitch + 8 * quad]) = make_uint2(lo, hi);
        else
          *reinterpret_cast<uint32_t*>(&s_vt[c * pitch + 4 * quad]) = (lo & 0xFFFFu) | (hi << 16);
      }
    }
  }
  __syncthreads();
  store_vt_tile<D, v_fp16 ? 2 : 1>(p, b, h, tile, s_vt);
}

// kFull: n_kv is a multiple of kBlockKV (chosen per launch: as a branch per CTA between the
// two instantiations, ptxas took the bf16 d = 128 kernel from 80 to 124 registers). Occupancy:
// six CTAs per SM at d = 64 (40 registers, no spills), four at d = 128 (64; it needs ~60);
// four for the balance at d = 64 too (its scales spilled in 40 registers). Two at d = 256,
// whose K rows are 16 loads of 16 bytes per thread: they spilled ~800 bytes in 64 registers
// (four CTAs), ~250 in 80 (three).
template <int D, class T, bool kFull, bool kBalance>
__global__ void __launch_bounds__(kThreads, D == 64 && !kBalance ? 6 : D > 128 ? 2 : 4)
    kv_quantize_kernel(const KVQuantParams p_in) {
  // The transposed V tile: dynamic, sized by the launch for the path's element size, so that
  // 8-bit V does not pay fp16's shared memory in occupancy.
  extern __shared__ __align__(16) uint8_t s_vt[];
  const int tile = blockIdx.x / 2, h = blockIdx.y, b = blockIdx.z;
  const KVQuantParams p = sequence_params<T>(p_in, b);
  if (past_sequence(p, tile)) return;
  if (blockIdx.x % 2 == 0)
    quantize_k_tile<D, T, kFull, kBalance>(p, tile, h, b);
  else if (p.v_format == VFormat::fp16)
    quantize_v_tile<D, T, VFormat::fp16, kFull>(p, tile, h, b, s_vt);
  else if (p.v_format == VFormat::int8)
    quantize_v_tile<D, T, VFormat::int8, kFull>(p, tile, h, b, s_vt);
  else
    quantize_v_tile<D, T, VFormat::e4m3, kFull>(p, tile, h, b, s_vt);
}

// Pass for prequantized INT8 inputs (INT-FlashAttention): nothing to measure or quantize, so
// one launch copies K with its per-token scales into the workspace layout, transposes V with
// the P-layout permutation, and broadcasts V's scales to one per channel.
template <int D>
__global__ void __launch_bounds__(kThreads) kv_copy_prequantized_kernel(const KVQuantParams p) {
  constexpr int kLanesPerRow = D / 8;
  constexpr int kRowsPerIter = kThreads / kLanesPerRow;
  constexpr int kRows = kKVTile / kRowsPerIter;
  const int tile = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int lane_c = threadIdx.x % kLanesPerRow, r0 = threadIdx.x / kLanesPerRow;
  __shared__ __align__(16) uint8_t s_vt[D * kVtPitch8];

  const int64_t head = (int64_t)b * p.heads_kv + h;
  if (tile == 0 && threadIdx.x < D) {
    const int c = threadIdx.x;
    const float* vs = p.v_scale_in + b * p.vs_stride_b + h * p.vs_stride_h;
    p.out.v_scale[head * D + c] = c >= p.head_dim_v ? 0.f : p.v_per_tensor ? vs[0] : vs[c * p.vs_stride_c];
    p.out.k_mean[head * D + c] = 0.f;
    p.out.v_mean[head * D + c] = 0.f;
  }
  if (threadIdx.x < kKVTile) {
    const int t = tile * kKVTile + threadIdx.x;
    p.out.k_scale[head * p.n_pad + t] =
        t < p.n_kv ? p.k_scale_in[b * p.ks_stride_b + h * p.ks_stride_h + t * p.ks_stride_n] : 0.f;
  }
  const int8_t* kb = static_cast<const int8_t*>(p.k) + b * p.k_stride_b + h * p.k_stride_h + lane_c * 8;
  const int8_t* vb = static_cast<const int8_t*>(p.v) + b * p.v_stride_b + h * p.v_stride_h + lane_c * 8;
  int8_t* kq = p.out.k + (head * p.n_pad + tile * kKVTile) * D + lane_c * 8;
#pragma unroll
  for (int i = 0; i < kRows; ++i) {
    const int r = r0 + i * kRowsPerIter;
    const int t = tile * kKVTile + r;
    uint2 kw = make_uint2(0, 0), vw = make_uint2(0, 0);
    if (t < p.n_kv && lane_c * 8 < p.head_dim) kw = *reinterpret_cast<const uint2*>(kb + (int64_t)t * p.k_stride_n);
    if (t < p.n_kv && lane_c * 8 < p.head_dim_v) vw = *reinterpret_cast<const uint2*>(vb + (int64_t)t * p.v_stride_n);
    *reinterpret_cast<uint2*>(kq + (int64_t)r * D) = kw;
    const int pos = 32 * (r / 32) + pv_position_of_token(r % 32);
#pragma unroll
    for (int j = 0; j < 8; ++j)
      s_vt[(lane_c * 8 + j) * kVtPitch8 + pos] = uint8_t(((j < 4 ? vw.x : vw.y) >> (8 * (j % 4))) & 0xFF);
  }
  __syncthreads();
  store_vt_tile<D, 1>(p, b, h, tile, s_vt);
}

// SageBwd's per-block V (VScale::per_block, docs/numerics.md step 8): one CTA per K/V tile
// takes the tile's largest |V'| over its tokens below n_kv and all channels, and writes the
// tile's scale (read by the attention kernel) and multiplier (read by kv_quantize_kernel).
// A pass of its own, between the statistics (V' needs V's mean) and the quantize pass: inside
// kv_quantize_kernel the reduction made its other paths spill under their launch bounds.
template <int D, class T>
__global__ void __launch_bounds__(kThreads) v_block_amax_kernel(const KVQuantParams p_in) {
  __shared__ float s_warp[kThreads / 32];
  const int tile = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const KVQuantParams p = sequence_params<T>(p_in, b);
  if (past_sequence(p, tile)) return;
  const int64_t head = (int64_t)b * p.heads_kv + h;
  const T* vb = static_cast<const T*>(p.v) + b * p.v_stride_b + h * p.v_stride_h;
  const float* vmean = p.out.v_mean + head * D;
  float amax = 0.f;
  for (int e = threadIdx.x; e < kKVTile * D / 8; e += kThreads) {
    const int r = e / (D / 8), c0 = 8 * (e % (D / 8));
    const int t = tile * kKVTile + r;
    // The caller's channels only: past V's head dim the workspace's channels are zeros (the
    // padded head dims), and the tensor's row may end there.
    if (t >= p.n_kv || c0 >= p.head_dim_v) continue;
    float x[8];
    gpu::unpack8<T>(*reinterpret_cast<const uint4*>(vb + (int64_t)t * p.v_stride_n + c0), x);
#pragma unroll
    for (int j = 0; j < 8; ++j) amax = rules::max_nan(amax, fabsf(__fsub_rn(x[j], vmean[c0 + j])));
  }
  amax = sm90::frag::warp_max_nan(amax);
  if (threadIdx.x % 32 == 0) s_warp[threadIdx.x / 32] = amax;
  __syncthreads();
  if (threadIdx.x == 0) {
    float all = s_warp[0];
    for (int w = 1; w < kThreads / 32; ++w) all = rules::max_nan(all, s_warp[w]);
    const int64_t at = head * (p.n_pad / kKVTile) + tile;
    p.out.v_block_scale[at] = rules::symmetric_scale(all, p.v_max);
    p.out.v_block_inv[at] = rules::symmetric_inverse(all, p.v_max);
  }
}

}  // namespace

template <int D, class T>
void launch_kv_prepass(const KVQuantParams& p, cudaStream_t stream) {
  if (p.k_scale_in != nullptr) {
    const dim3 grid(p.n_pad / kKVTile, p.heads_kv, p.batch);
    kv_copy_prequantized_kernel<D><<<grid, kThreads, 0, stream>>>(p);
    return;
  }
  KVQuantParams q = p;
  // Set here, not in the kernel: a division in every CTA before its first load slowed the
  // pre-pass (v29, docs/history/README.md).
  q.k_mean_samples = int(rules::k_mean_samples(p.n_kv, p.k_mean_stride));
  // A packed batch always takes the full cluster: its size decides how a head's rows are split
  // and summed, and it must not follow max_seqlen_k (the longest neighbour), or a sequence's
  // statistics, hence its output bits, would depend on what it is packed with.
  const int ctas = p.cu_seqlens_k != nullptr ? kStatsCtas : stats_ctas(p.n_kv);
  q.stats_k_ctas = stats_k_ctas(p.k_mean_stride, ctas);
  const dim3 stats_grid(ctas, p.heads_kv, p.batch);  // one cluster per head
  if (ctas == kStatsCtas)
    kv_stats_kernel<D, T, kStatsCtas><<<stats_grid, kThreads, 0, stream>>>(q);
  else
    kv_stats_kernel<D, T, kStatsCtas / 2><<<stats_grid, kThreads, 0, stream>>>(q);
  if (p.v_per_block) {
    // After the statistics (V's mean), before the quantize pass, in stream order.
    v_block_amax_kernel<D, T><<<dim3(p.n_pad / kKVTile, p.heads_kv, p.batch), kThreads, 0, stream>>>(q);
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) throw_cuda("V block amax launch", e);
  }
  // Programmatic dependent launch: see launch_dependent_grids in kv_stats_kernel.
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(2 * (p.n_pad / kKVTile), p.heads_kv, p.batch);
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = size_t(D) * v_format_bytes(p.v_format) * kVtPitch8;  // < 48 KiB
  cfg.stream = stream;
  cudaLaunchAttribute pdl{};
  pdl.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  pdl.val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = &pdl;
  cfg.numAttrs = 1;
  // A packed batch's sequences end anywhere: never the kernel without padding tests.
  const bool full_tiles = p.n_kv % kKVTile == 0 && p.cu_seqlens_k == nullptr, balance = p.q_amax != nullptr;
  auto kernel = full_tiles ? (balance ? kv_quantize_kernel<D, T, true, true> : kv_quantize_kernel<D, T, true, false>)
                           : (balance ? kv_quantize_kernel<D, T, false, true> : kv_quantize_kernel<D, T, false, false>);
  const cudaError_t err = cudaLaunchKernelEx(&cfg, kernel, q);
  if (err != cudaSuccess) throw_cuda("K/V quantize launch", err);
}

#define SAGE_INSTANTIATE_PREPASS(D)                                                        \
  template void launch_kv_prepass<D, __half>(const KVQuantParams&, cudaStream_t);   \
  template void launch_kv_prepass<D, __nv_bfloat16>(const KVQuantParams&, cudaStream_t);
SAGE_FOR_EACH_KV_LAYOUT_DIM(SAGE_INSTANTIATE_PREPASS)

}  // namespace sage::quant
