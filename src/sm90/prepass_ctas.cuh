// The K/V pre-pass inside the attention launch: the first p.prepass_ctas CTAs of the grid
// quantize K and V head by head (statistics, then every tile), and the attention CTAs'
// producers wait for a head's flag before streaming its tiles.
//
// Why: the pre-pass is memory-bound and the attention kernel compute-bound, and as two launches
// before it the pre-pass's ~0.27 ms (d = 128) is the whole call's largest fixed cost at short
// N (docs/performance.md). Here it runs beside the attention on a few SMs, a head or more
// ahead of the heads the attention CTAs reach (the strided work order takes heads in order).
//
// The results are the two-launch pre-pass's bits: the same tile functions (quant/kv_tiles.cuh)
// quantize every tile, and K's sampled mean is summed in the statistics kernel's order, which
// is one CTA's when a head's statistics give K a single CTA (the dispatch's condition, with V
// not smoothed, so that V's statistics are extremes only, exact in any order).
#pragma once

#include <cfloat>
#include <cstdint>

#include "quant/kv_tiles.cuh"
#include "sm90/kernel_params.h"
#include "sm90/ptx.cuh"

namespace sage::sm90 {

// The pre-pass CTA's kTileThreads working threads meet at named barrier 1 (these CTAs run
// none of the attention's barriers).
struct PrepassBarrier {
  __device__ __forceinline__ static void sync() { named_barrier_sync(1, quant::kTileThreads); }
};

template <int D>
struct PrepassShared {
  float red[quant::kStatsRows][quant::kWarps][D];
  float cta_stats[2][quant::kStatsRows][D];  // [0] K's sampled keys, [1] V
  float warp_amax[2][D / 32];
  quant::KTileShared<D> k;
  quant::VTileShared<D> v;
  alignas(16) uint8_t vt[D * quant::kVtPitch8];
};

// Rows in flight per thread in the statistics loops: one CTA per SM here, where the statistics
// kernel has four with 8 each (d = 64: 8, within the 128 registers of that launch).
template <int D>
constexpr int kPrepassStatsUnroll = D == 64 ? 8 : 16;

__device__ __forceinline__ int load_acquire_gpu(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void store_release_gpu(int* p, int v) {
  asm volatile("st.release.gpu.global.b32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
// Orders generic-proxy accesses to global memory with later async-proxy ones (TMA).
__device__ __forceinline__ void fence_proxy_async_global() {
  asm volatile("fence.proxy.async.global;" ::: "memory");
}

// Waits until the pre-pass CTAs have published head `head` (the producer, before its first
// TMA load of the head's tiles). The head's K/V and scales were written by other SMs through
// the generic proxy; the TMA reads them through the async proxy.
__device__ __forceinline__ void wait_head_quantized(const int* head_ready, int head) {
  while (load_acquire_gpu(head_ready + head) == 0) __nanosleep(64);
  fence_proxy_async_global();
}

// Accumulates rows t = r0, r0 + kRowsPerIter, ... below `rows` of one tensor, in that order
// (the statistics kernel's order for one CTA), with kPrepassStatsUnroll loads in flight.
template <int D, class T, bool kSums>
__device__ __forceinline__ void accumulate_rows(const T* base, int64_t pitch, int rows, int r0,
                                                quant::ChannelStats<T>& st) {
  constexpr int kRowsPerIter = quant::kTileThreads / (D / 8);
  constexpr int U = kPrepassStatsUnroll<D>;
  for (int t = r0; t < rows; t += U * kRowsPerIter) {
    uint4 raw[U];
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (t + u * kRowsPerIter < rows)
        raw[u] = *reinterpret_cast<const uint4*>(base + int64_t(t + u * kRowsPerIter) * pitch);
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (t + u * kRowsPerIter < rows) {
        if constexpr (kSums) st.add(raw[u]);
        else st.add_extremes(raw[u]);
      }
  }
}

// Head (b, h)'s statistics and finals, as kv_stats_kernel writes them.
template <int D, class T>
__device__ __forceinline__ void prepass_statistics(const KVQuantParams& p, int b, int h,
                                                   PrepassShared<D>& sh) {
  constexpr int kLanesPerRow = D / 8;
  const int lane_c = threadIdx.x % kLanesPerRow, r0 = threadIdx.x / kLanesPerRow;
  quant::ChannelStats<T> k_stats, v_stats;
  k_stats.init();
  v_stats.init();
  const T* k_base = static_cast<const T*>(p.k) + b * p.k_stride_b + h * p.k_stride_h + lane_c * 8;
  const T* v_base = static_cast<const T*>(p.v) + b * p.v_stride_b + h * p.v_stride_h + lane_c * 8;
  accumulate_rows<D, T, true>(k_base, p.k_stride_n * p.k_mean_stride, p.k_mean_samples, r0, k_stats);
  accumulate_rows<D, T, false>(v_base, p.v_stride_n, p.n_kv, r0, v_stats);
  quant::combine_cta_stats<D, T, PrepassBarrier>(k_stats, lane_c, sh.red, sh.cta_stats[0]);
  quant::combine_cta_stats<D, T, PrepassBarrier>(v_stats, lane_c, sh.red, sh.cta_stats[1]);
  // Rank 0's combination in kv_stats_kernel, with one CTA per tensor.
  float sum[2] = {0.f, 0.f}, mx[2] = {-FLT_MAX, -FLT_MAX}, mn[2] = {FLT_MAX, FLT_MAX};
  const int c = threadIdx.x;
  if (c < D)
#pragma unroll
    for (int x = 0; x < 2; ++x) {
      sum[x] += sh.cta_stats[x][quant::kSum][c];
      mx[x] = fmaxf(mx[x], sh.cta_stats[x][quant::kMax][c]);
      mn[x] = fminf(mn[x], sh.cta_stats[x][quant::kMin][c]);
    }
  quant::write_head_finals<D, PrepassBarrier>(p, int64_t(b) * p.heads_kv + h, sum, mx, mn,
                                              sh.warp_amax);
}

// The pre-pass CTA `cta` of `ctas`: kv heads cta, cta + ctas, ... (the order the attention
// CTAs reach them), each published in head_ready once all of it is in the workspace.
// Threads kTileThreads and up of the CTA have returned.
template <int D, class T>
__device__ __forceinline__ void run_prepass_cta(const KVQuantParams& p, int* head_ready, int cta,
                                                int ctas, PrepassShared<D>& sh) {
  const int heads = p.batch * p.heads_kv;
  const int tiles = p.n_pad / kBlockKV;
  const bool full = p.n_kv % kBlockKV == 0;
  for (int head = cta; head < heads; head += ctas) {
    const int b = head / p.heads_kv, h = head % p.heads_kv;
    prepass_statistics<D, T>(p, b, h, sh);
    // The finals (global, written by threads < D) are read back by every thread below.
    PrepassBarrier::sync();
    for (int tile = 0; tile < tiles; ++tile) {
      if (full) {
        quant::quantize_k_tile<D, T, true, PrepassBarrier>(p, tile, h, b, sh.k);
        quant::quantize_v_tile<D, T, quant::VFormat::e4m3, true, PrepassBarrier>(p, tile, h, b, sh.vt, sh.v);
      } else {
        quant::quantize_k_tile<D, T, false, PrepassBarrier>(p, tile, h, b, sh.k);
        quant::quantize_v_tile<D, T, quant::VFormat::e4m3, false, PrepassBarrier>(p, tile, h, b, sh.vt, sh.v);
      }
    }
    // Every thread's stores before the flag: a gpu-scope fence each, then one release.
    __threadfence();
    fence_proxy_async_global();
    PrepassBarrier::sync();
    if (threadIdx.x == 0) store_release_gpu(head_ready + head, 1);
  }
}

}  // namespace sage::sm90
