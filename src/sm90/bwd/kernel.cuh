// The SageBwd backward kernel (docs/numerics.md, "The backward"), FlashAttention-3's
// structure: one CTA per (128-key K/V tile, query head), looping over the 64-row Q tiles in
// increasing order (step 1). Per tile: load (load.cuh), recompute P and dS (recompute.cuh),
// quantize them (quantize.cuh), then the INT8 MMAs of dV, dK (registers) and dQ (fp32
// atomics) (accumulate.cuh). At the end dK * sm_scale and dV go into the KV head's fp32
// accumulators, summed over the group's query heads by atomics (GQA; finalize.cuh converts).
#pragma once

#include <cstdint>

#include "numerics/quant_rules.h"
#include "sm90/bwd/accumulate.cuh"
#include "sm90/bwd/kernel_traits.h"
#include "sm90/bwd/load.cuh"
#include "sm90/bwd/params.h"
#include "sm90/bwd/quantize.cuh"
#include "sm90/bwd/recompute.cuh"

namespace sage::sm90::bwd {

template <int D, class T>
__global__ void __launch_bounds__(kThreads, 1) backward_kernel(const BackwardParams p) {
  extern __shared__ __align__(128) uint8_t smem[];
  const int kv_tile = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int hk = h / (p.heads_q / p.heads_kv);
  const int64_t kvh = (int64_t)b * p.heads_kv + hk, bh = (int64_t)b * p.heads_q + h;
  const int j0 = kv_tile * kBlockKV;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  load_kv_tile<D, T>(p, smem, kvh, hk, b, j0);
  // per_block K: one scale per K/V tile (its four per-thread slots hold the same value).
  const float k_scale = p.k_scale[(kvh * (p.n_pad / kBlockKV) + kv_tile) * 4];
  float dv[D / 8][4];
  DkAccumulator<D> dk;
  dk.shared = reinterpret_cast<float*>(smem + smem_layout(D).dk) + warp * (D / 8) * 4 * 32;
#pragma unroll
  for (int n = 0; n < D / 8; ++n)
#pragma unroll
    for (int c = 0; c < 4; ++c) dv[n][c] = 0.f, dk.at(n, c, lane) = 0.f;
  const int q_tiles = (p.n_q + kBlockQ - 1) / kBlockQ, pad_tiles = p.n_q_pad / kBlockQ;
  for (int tile = 0; tile < q_tiles; ++tile) {
    const int i0 = tile * kBlockQ, rows = min(kBlockQ, p.n_q - i0);
    // A tile whose last row sees none of the keys is skipped (causal: the rows' visible keys
    // grow with the row).
    if (visible_keys(i0 + rows - 1, p.n_q, p.n_kv, p.causal) <= j0) continue;
    __syncthreads();  // the previous tile's operands are read
    load_q_tile<D, T>(p, smem, bh, h, b, i0);
    __syncthreads();
    const float q_scale = p.q_scale[bh * pad_tiles + tile];
    const float do_scale = p.do_scale[bh * pad_tiles + tile];
    const float mult = rules::score_multiplier(q_scale, k_scale, p.sm_scale_log2);
    float pv[kRowBlocks][4], ds[kRowBlocks][4];
    recompute_p_ds<D, T>(smem, warp, lane, i0, j0, p.n_q, p.n_kv, p.causal, mult, pv, ds);
    const float ds_scale = quantize_p_ds<D>(smem, warp, lane, pv, ds);
    accumulate_dv_dk<D>(smem, warp, lane, do_scale, __fmul_rn(ds_scale, q_scale), dv, dk);
    accumulate_dq<D>(smem, warp, lane, __fmul_rn(ds_scale, k_scale), p.dq_acc + (bh * p.n_q + i0) * D,
                     rows);
  }
  // Step 9 for dK (per query head, as the simulator scales before the group's sum) and step
  // 10's sum over the group.
  const int g = lane / 4, t = lane % 4;
#pragma unroll
  for (int n = 0; n < D / 8; ++n)
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int key = j0 + 16 * warp + g + (c >= 2 ? 8 : 0), ch = 8 * n + 2 * t + (c & 1);
      if (key >= p.n_kv) continue;
      const int64_t at = (kvh * p.n_kv + key) * D + ch;
      atomicAdd(p.dk_acc + at, __fmul_rn(dk.at(n, c, lane), p.sm_scale));
      atomicAdd(p.dv_acc + at, dv[n][c]);
    }
}

}  // namespace sage::sm90::bwd
