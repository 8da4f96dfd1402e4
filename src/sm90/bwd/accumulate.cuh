// Step 8 of the backward and step 6's product: the INT8 MMAs of one tile.
//   dV[key] += fmaf(float(sum_rows c(P) c(dO)), s_P,key * s_dO, dV)   (registers, per warp)
//   dK[key] += fmaf(float(sum_rows c(dS) qcode), s_dS * q_scale, dK)   (registers, per warp)
//   dQ[row] += float(sum_keys c(dS) kcode) * (s_dS * k_scale)          (fp32 atomics: the
//              other K/V tiles' CTAs add into the same rows)
// dV and dK: warp w's keys 16w .. 16w + 15 by D channels, C layout [n8 block][c].
// dQ: warp w takes rows 16 (w % 4) .. + 15 and the channel half w / 4.
#pragma once

#include <cstdint>

#include "sm90/bwd/kernel_traits.h"
#include "sm90/bwd/mma_sync.cuh"

namespace sage::sm90::bwd {

// One product of the tile, sum over the 64 rows of A[key][row] B[channel][row], for the
// warp's 16 keys and the channels of half `half` (D / 2 at a time: with all D channels' s32
// accumulators beside dV and dK, ptxas spilled at d = 128); fold(n8 block, c, acc) takes each
// s32 sum.
template <int D, class Fold>
__device__ __forceinline__ void rows_product_half(const uint8_t* a_mat, const uint8_t* b_mat, int m0,
                                                  int half, int lane, Fold fold) {
  constexpr int kN = D / 16;
  int32_t acc[kN][4];
#pragma unroll
  for (int n = 0; n < kN; ++n)
#pragma unroll
    for (int c = 0; c < 4; ++c) acc[n][c] = 0;
#pragma unroll
  for (int k0 = 0; k0 < kBlockQ; k0 += 32) {
    uint32_t a[4];
    load_a8(a, a_mat, kBlockQ, m0, k0, lane);
#pragma unroll
    for (int n = 0; n < kN; ++n) {
      uint32_t b[2];
      load_b8(b, b_mat, kBlockQ, half * (D / 2) + 8 * n, k0, lane);
      mma_s8(acc[n], a, b);
    }
  }
#pragma unroll
  for (int n = 0; n < kN; ++n)
#pragma unroll
    for (int c = 0; c < 4; ++c) fold(half * kN + n, c, acc[n][c]);
}

// Where a warp keeps its dK accumulator: registers at d = 64; shared memory from d = 128,
// where dV, dK, P, dS and the tile's products in registers made ptxas spill (255 registers).
// In shared memory each thread owns its elements, stored in register order with the lane
// fastest ([warp][n8 block][c][lane]: no bank conflicts, no synchronization).
template <int D>
struct DkAccumulator {
  static constexpr bool kShared = D >= 128;
  float reg[kShared ? 1 : D / 8][4];
  float* shared;  // kShared: this warp's [D / 8][4][32] floats
  __device__ __forceinline__ float& at(int n, int c, int lane) {
    if constexpr (kShared) return shared[(n * 4 + c) * 32 + lane];
    else return reg[n][c];
  }
};

template <int D>
__device__ __forceinline__ void accumulate_dv_dk(const uint8_t* smem, int warp, int lane,
                                                 float do_scale, float ds_q_scale,
                                                 float (&dv)[D / 8][4], DkAccumulator<D>& dk) {
  constexpr SmemLayout L = smem_layout(D);
  const int m0 = 16 * warp, g = lane / 4;
  const float* p_scale = reinterpret_cast<const float*>(smem + L.p_scale);
  // s_P,key * s_dO (the contract's order), per row g and g + 8 of the C layout.
  const float pv_scale[2] = {__fmul_rn(p_scale[m0 + g], do_scale), __fmul_rn(p_scale[m0 + g + 8], do_scale)};
#pragma unroll
  for (int half = 0; half < 2; ++half)
    rows_product_half<D>(smem + L.pt8, smem + L.dot8, m0, half, lane, [&](int n, int c, int32_t x) {
      dv[n][c] = __fmaf_rn(float(x), pv_scale[c / 2], dv[n][c]);
    });
#pragma unroll
  for (int half = 0; half < 2; ++half)
    rows_product_half<D>(smem + L.dst8, smem + L.qt8, m0, half, lane, [&](int n, int c, int32_t x) {
      float& y = dk.at(n, c, lane);
      y = __fmaf_rn(float(x), ds_q_scale, y);
    });
}

// dQ of the tile into the fp32 accumulator rows of (bh, i0 ..).
template <int D>
__device__ __forceinline__ void accumulate_dq(const uint8_t* smem, int warp, int lane, float ds_k_scale,
                                              float* dq_rows, int rows) {
  constexpr SmemLayout L = smem_layout(D);
  constexpr int kN = D / 2 / 8;  // n8 blocks of the warp's channel half
  const int m0 = 16 * (warp % 4), c0 = (warp / 4) * (D / 2);
  const int g = lane / 4, t = lane % 4;
  int32_t acc[kN][4];
#pragma unroll
  for (int n = 0; n < kN; ++n)
#pragma unroll
    for (int c = 0; c < 4; ++c) acc[n][c] = 0;
#pragma unroll
  for (int k0 = 0; k0 < kBlockKV; k0 += 32) {
    uint32_t a[4];
    load_a8(a, smem + L.ds8, kBlockKV, m0, k0, lane);
#pragma unroll
    for (int n = 0; n < kN; ++n) {
      uint32_t b[2];
      load_b8(b, smem + L.kt8, kBlockKV, c0 + 8 * n, k0, lane);
      mma_s8(acc[n], a, b);
    }
  }
#pragma unroll
  for (int n = 0; n < kN; ++n)
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int a = m0 + g + (c >= 2 ? 8 : 0), ch = c0 + 8 * n + 2 * t + (c & 1);
      if (a < rows && acc[n][c] != 0) atomicAdd(dq_rows + (int64_t)a * D + ch, __fmul_rn(float(acc[n][c]), ds_k_scale));
    }
}

}  // namespace sage::sm90::bwd
