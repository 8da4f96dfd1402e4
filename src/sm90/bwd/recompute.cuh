// Steps 3-5 of the backward (docs/numerics.md, "The backward", "Steps") for one warp's 16 keys
// against the Q tile's 64 rows, in the transposed orientation (keys are the MMA's m):
//   S^T = K' Q^T with the INT8 codes (exact s32),
//   P   = exp2f(fmaf(float(acc), mult, -L2_i))  (0 where the row does not see the key, or has
//         no keys: L2 = -inf),
//   dP^T = V dO^T with 16-bit operands and an fp32 accumulator,
//   dS  = P * (dP - D_i).
// The results stay in the C layout: [n8 block j][c], key 16w + g (+8 for c >= 2), row 8j + 2t
// (+1 for odd c).
#pragma once

#include <cmath>
#include <cstdint>

#include "numerics/quant_rules.h"
#include "sm90/bwd/kernel_traits.h"
#include "sm90/bwd/mma_sync.cuh"

namespace sage::sm90::bwd {

constexpr int kRowBlocks = kBlockQ / 8;  // n8 blocks over the Q tile's rows

// The keys [0, visible) that row i sees (bottom-right causal, as the forward).
__device__ __forceinline__ int visible_keys(int i, int n_q, int n_kv, bool causal) {
  if (!causal) return n_kv;
  return min(max(i + n_kv - n_q + 1, 0), n_kv);
}

template <int D, class T>
__device__ __forceinline__ void recompute_p_ds(const uint8_t* smem, int warp, int lane, int i0,
                                               int j0, int n_q, int n_kv, bool causal, float mult,
                                               float (&pv)[kRowBlocks][4], float (&ds)[kRowBlocks][4]) {
  constexpr SmemLayout L = smem_layout(D);
  const int m0 = 16 * warp;
  int32_t s[kRowBlocks][4];
  float dp[kRowBlocks][4];
#pragma unroll
  for (int j = 0; j < kRowBlocks; ++j)
#pragma unroll
    for (int c = 0; c < 4; ++c) s[j][c] = 0, dp[j][c] = 0.f;
#pragma unroll
  for (int k0 = 0; k0 < D; k0 += 32) {
    uint32_t a[4];
    load_a8(a, smem + L.k8, D, m0, k0, lane);
#pragma unroll
    for (int j = 0; j < kRowBlocks; ++j) {
      uint32_t bf[2];
      load_b8(bf, smem + L.q8, D, 8 * j, k0, lane);
      mma_s8(s[j], a, bf);
    }
  }
#pragma unroll
  for (int k0 = 0; k0 < D; k0 += 16) {
    uint32_t a[4];
    load_a16(a, smem + L.v, D, m0, k0, lane);
#pragma unroll
    for (int j = 0; j < kRowBlocks; ++j) {
      uint32_t bf[2];
      load_b16(bf, smem + L.dout, D, 8 * j, k0, lane);
      mma_16bit<T>(dp[j], a, bf);
    }
  }
  const float* l2 = reinterpret_cast<const float*>(smem + L.l2);
  const float* delta = reinterpret_cast<const float*>(smem + L.delta);
  const int g = lane / 4, t = lane % 4;
#pragma unroll
  for (int j = 0; j < kRowBlocks; ++j)
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int key = j0 + m0 + g + (c >= 2 ? 8 : 0);
      const int a = 8 * j + 2 * t + (c & 1);
      const int i = i0 + a;
      const float row_l2 = l2[a];
      const bool seen = i < n_q && key < visible_keys(i, n_q, n_kv, causal) && row_l2 != -INFINITY;
      float p = 0.f, d = 0.f;
      if (seen) {
        p = exp2f(__fmaf_rn(float(s[j][c]), mult, -row_l2));
        d = __fmul_rn(p, __fsub_rn(dp[j][c], delta[a]));
      }
      pv[j][c] = p;
      ds[j][c] = d;
    }
}

}  // namespace sage::sm90::bwd
