// Steps 3-5 of the backward (docs/numerics.md, "The backward", "Steps") for a consumer
// warpgroup's 64 keys against the Q tile's 64 rows, in the transposed orientation (keys are
// the warpgroup MMA's m, rows its n):
//   S^T  = K' Q^T with the INT8 codes (exact s32; wgmma m64n64k32, both operands in shared),
//   dP^T = V dO^T with 16-bit operands and an fp32 accumulator (wgmma m64n64k16),
//   P    = exp2f(fmaf(float(acc), mult, -L2_i))  (0 where the row does not see the key, or
//          has no keys: L2 = -inf),
//   dS   = P * (dP - D_i).
// The results stay in the accumulator layout (fragment.cuh): index 4j + e is key
// 16 warp + g (+8 for e >= 2) of the warpgroup's 64 and row 8j + 2t + (e & 1) of the tile.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "common/ptx.cuh"
#include "sm90/bwd/kernel_traits.h"
#include "sm90/bwd/smem.cuh"
#include "sm90/mma/wgmma_ops.cuh"

namespace sage::sm90::bwd {

constexpr int kTileAcc = kBlockQ / 2;  // accumulator values per thread of a 64 x 64 product

// The keys [0, visible) that row i sees (bottom-right causal, as the forward).
__device__ __forceinline__ int visible_keys(int i, int n_q, int n_kv, bool causal) {
  if (!causal) return n_kv;
  return min(max(i + n_kv - n_q + 1, 0), n_kv);
}

// Where a consumer thread sits: warpgroup c (0, 1), warp w of it, g and t of its lane.
struct ConsumerThread {
  int c, w, g, t, lane;
};

// Issues S^T (one commit group).
template <int D>
__device__ __forceinline__ void issue_s(const Smem<D>& s, int c, int st, int32_t (&sacc)[kTileAcc]) {
  reg_fence(sacc);
  wgmma_fence();
#pragma unroll
  for (int kc = 0; kc < D / 32; ++kc) {
    if (kc == 0) mma_s8_ss<64, false>(sacc, s.k_desc(c, kc), s.q_desc(st, kc));
    else mma_s8_ss<64, true>(sacc, s.k_desc(c, kc), s.q_desc(st, kc));
  }
  wgmma_commit();
}

// Issues dP^T (one commit group). At d = 128 after S^T's wait (kDpWithS): S^T's 32 s32
// registers become P's before dP^T's 32 are taken (beside dV and dK's 2 x D/2, S^T, P and dP^T
// all live at once spilled there), and P's quantization runs under this MMA; at d = 64 right
// after S^T.
template <int D, class T>
__device__ __forceinline__ void issue_dp(const Smem<D>& s, int c, int st, float (&dp)[kTileAcc]) {
  reg_fence(dp);
  wgmma_fence();
#pragma unroll
  for (int kc = 0; kc < D / 16; ++kc) {
    if constexpr (std::is_same_v<T, __half>) {
      if (kc == 0) mma_f16_f32acc_ss<64, false>(dp, s.v_desc(c, kc), s.dout_desc(st, kc));
      else mma_f16_f32acc_ss<64, true>(dp, s.v_desc(c, kc), s.dout_desc(st, kc));
    } else {
      if (kc == 0) mma_bf16_f32acc_ss<64, false>(dp, s.v_desc(c, kc), s.dout_desc(st, kc));
      else mma_bf16_f32acc_ss<64, true>(dp, s.v_desc(c, kc), s.dout_desc(st, kc));
    }
  }
  wgmma_commit();
}

// Whether dP^T is issued right after S^T (in flight while P is made): at d = 64, where the
// registers allow S^T, P and dP^T at once beside dV and dK. At d = 128 dP^T waits for P.
template <int D>
constexpr bool kDpWithS = D < 128;

// Waits for S^T (with dP^T still in flight where kDpWithS) and makes P (as floats in pv).
template <int D>
__device__ __forceinline__ void recompute_p(const Smem<D>& s, const ConsumerThread& th, int st, int i0, int key0,
                                            int n_q, int n_kv, bool causal, float mult,
                                            int32_t (&sacc)[kTileAcc], float (&pv)[kTileAcc]) {
  if constexpr (kDpWithS<D>) wgmma_wait<1>();
  else wgmma_wait<0>();
  reg_fence(sacc);
  const float* l2 = s.l2(st);
  // Key k of row i is seen iff k < visible_keys(i): k - i < n_kv - n_q + 1 under the causal
  // mask, and k < n_kv.
  const int key_w = key0 + 16 * th.w + th.g;
  const int diag = causal ? n_kv - n_q + 1 : n_kv + kBlockQ;  // k - i below this is seen
  // Where the warpgroup's 64 keys are all below n_kv and the tile's first row sees its last
  // key, only the rows without keys are unseen (L2 = -inf, as the pre-pass also pads the rows
  // past n_q): an L2 of +inf in their place makes exp2 0 with the same per-score instructions
  // as the seen ones, and the per-score mask tests go (the same values either way).
  if (key0 + kKeysPerWarpgroup <= n_kv && key0 + kKeysPerWarpgroup - 1 - i0 < diag) {
#pragma unroll
    for (int x = 0; x < kTileAcc; ++x) {
      const float row_l2 = l2[8 * (x / 4) + 2 * th.t + (x & 1)];
      const float l2_or_inf = row_l2 == -INFINITY ? INFINITY : row_l2;
      pv[x] = exp2f(__fmaf_rn(small_int_to_float(sacc[x]), mult, -l2_or_inf));
    }
    return;
  }
#pragma unroll
  for (int x = 0; x < kTileAcc; ++x) {
    const int e = x % 4;
    const int key = key_w + (e >= 2 ? 8 : 0);
    const int a = 8 * (x / 4) + 2 * th.t + (e & 1);
    const float row_l2 = l2[a];
    const bool seen = i0 + a < n_q && key < n_kv && key - (i0 + a) < diag && row_l2 != -INFINITY;
    pv[x] = seen ? exp2f(__fmaf_rn(small_int_to_float(sacc[x]), mult, -row_l2)) : 0.f;
  }
}

// Waits for dP^T and makes dS in place of dp.
template <int D>
__device__ __forceinline__ void recompute_ds(const Smem<D>& s, const ConsumerThread& th, int st,
                                             const float (&pv)[kTileAcc], float (&dp)[kTileAcc]) {
  wgmma_wait<0>();
  reg_fence(dp);
  const float* delta = s.delta(st);
#pragma unroll
  for (int x = 0; x < kTileAcc; ++x) {
    const int a = 8 * (x / 4) + 2 * th.t + (x & 1);
    // pv is 0 where the row does not see the key: dS is 0 there too.
    dp[x] = pv[x] == 0.f ? 0.f : __fmul_rn(pv[x], __fsub_rn(dp[x], delta[a]));
  }
}

}  // namespace sage::sm90::bwd
