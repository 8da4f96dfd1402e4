// Steps 6-7 of the backward: P and dS to INT8, fused in the kernel (no pass reads them again).
//   P per key (bwd_p_granularity per_token): one group per key over the tile's rows; the key's
//   values are the thread's row blocks and its quad's (lanes 4g .. 4g + 3 hold key g's rows).
//   dS per block (bwd_ds_granularity per_block): one group over the whole 64 x 128 tile; its
//   codes serve dV's neighbours dK (as dS^T, [key][row]) and dQ (as dS, [row][key]).
// Scales rules::symmetric_scale, codes rules::round_clamp(x * symmetric_inverse), as the
// simulator's quantize_block; entries a row does not see are 0 and stay 0.
#pragma once

#include <cstdint>

#include "numerics/quant_rules.h"
#include "sm90/bwd/kernel_traits.h"
#include "sm90/bwd/recompute.cuh"

namespace sage::sm90::bwd {

// Writes P's codes [key][row] and scales per key, dS's codes in both orientations; returns the
// dS scale. Ends with __syncthreads (the codes are read by every warp next).
template <int D>
__device__ __forceinline__ float quantize_p_ds(uint8_t* smem, int warp, int lane,
                                               const float (&pv)[kRowBlocks][4],
                                               const float (&ds)[kRowBlocks][4]) {
  constexpr SmemLayout L = smem_layout(D);
  const int g = lane / 4, t = lane % 4, m0 = 16 * warp;
  const float fq = float(rules::kInt8Max);
  // P: amax per key (rows g: c < 2, g + 8: c >= 2), over the quad.
  float pmax[2] = {0.f, 0.f}, dmax = 0.f;
#pragma unroll
  for (int j = 0; j < kRowBlocks; ++j)
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      pmax[c / 2] = fmaxf(pmax[c / 2], fabsf(pv[j][c]));
      dmax = fmaxf(dmax, fabsf(ds[j][c]));
    }
  float p_inv[2];
  float* p_scale = reinterpret_cast<float*>(smem + L.p_scale);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    pmax[r] = fmaxf(pmax[r], __shfl_xor_sync(0xffffffffu, pmax[r], 1));
    pmax[r] = fmaxf(pmax[r], __shfl_xor_sync(0xffffffffu, pmax[r], 2));
    p_inv[r] = rules::symmetric_inverse(pmax[r], fq);
    if (t == 0) p_scale[m0 + g + 8 * r] = rules::symmetric_scale(pmax[r], fq);
  }
  // dS: amax over the CTA.
#pragma unroll
  for (int off = 16; off > 0; off /= 2) dmax = fmaxf(dmax, __shfl_xor_sync(0xffffffffu, dmax, off));
  float* red = reinterpret_cast<float*>(smem + L.red);
  if (lane == 0) red[warp] = dmax;
  __syncthreads();
  float all = red[0];
#pragma unroll
  for (int w = 1; w < kWarps; ++w) all = fmaxf(all, red[w]);
  const float ds_inv = rules::symmetric_inverse(all, fq);
  int8_t* pt8 = reinterpret_cast<int8_t*>(smem + L.pt8);
  int8_t* dst8 = reinterpret_cast<int8_t*>(smem + L.dst8);
  int8_t* ds8 = reinterpret_cast<int8_t*>(smem + L.ds8);
#pragma unroll
  for (int j = 0; j < kRowBlocks; ++j)
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int key = m0 + g + (c >= 2 ? 8 : 0), a = 8 * j + 2 * t + (c & 1);
      pt8[key * kBlockQ + a] = int8_t(rules::round_clamp(__fmul_rn(pv[j][c], p_inv[c / 2]), rules::kInt8Max));
      const int8_t d = int8_t(rules::round_clamp(__fmul_rn(ds[j][c], ds_inv), rules::kInt8Max));
      dst8[key * kBlockQ + a] = d;
      ds8[a * kBlockKV + key] = d;
    }
  __syncthreads();
  return rules::symmetric_scale(all, fq);
}

}  // namespace sage::sm90::bwd
