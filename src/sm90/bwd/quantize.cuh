// Steps 6-7 of the backward: P and dS to INT8 in registers, straight into the operand layouts
// of the MMAs that read them (no pass reads them again).
//   P per key (bwd_p_granularity per_token): one group per key over the tile's 64 rows; a
//   key's values are the thread's 16 of its accumulator row and its quad's (lanes 4g .. 4g + 3).
//   dS per block (bwd_ds_granularity per_block): one group over the whole 64 x 128 tile, both
//   consumer warpgroups (a named barrier).
// Scales rules::symmetric_scale, codes rules::round_clamp(x * symmetric_inverse), as the
// simulator's quantize_block; entries a row does not see are 0 and stay 0.
//
// Where the codes go:
//   P^T and dS^T: A operands of dV's and dK's wgmma from registers, k = the tile's rows in
//   kp_row order (kernel_traits.h): slice ks's a[0] packs accumulator values 16ks + {0, 1, 4, 5}
//   (key g), a[1] 16ks + {2, 3, 6, 7} (key g + 8), a[2], a[3] the same + 8.
//   dS: dQ's A in shared memory, [row][key position] (kp_key order), 16-bit pairs (keys g and
//   g + 8 of the warp's 16 at positions 2g, 2g + 1), 128B swizzle.
#pragma once

#include <cstdint>

#include "common/ptx.cuh"
#include "numerics/quant_rules.h"
#include "sm90/bwd/recompute.cuh"
#include "sm90/bwd/smem.cuh"
#include "sm90/mma/fragment.cuh"

namespace sage::sm90::bwd {

// rules::symmetric_inverse(amax, 127) without a call: the IEEE division's slow path is a
// subroutine, and a call inside the Q loop made ptxas spill the live dV and dK registers
// around it. For amax in [2^-100, 2^100] (anything a P or dS tile holds in practice) the
// sequence below (one Newton step on the approximate reciprocal, then the quotient's FMA
// correction) is the correctly rounded 127 / amax, as the division's own fast path computes
// it; outside, the division itself.
__device__ __forceinline__ float inverse_127(float amax) {
  if (!(amax > 0.f)) return 0.f;  // symmetric_inverse: 0 for an all-zero group (NaN: 0 too)
  if (amax < 0x1p-100f || amax > 0x1p100f) return rules::symmetric_inverse(amax, float(rules::kInt8Max));
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(amax));
  y = __fmaf_rn(__fmaf_rn(-amax, y, 1.f), y, y);
  const float a = float(rules::kInt8Max);
  const float q = __fmul_rn(a, y);
  return __fmaf_rn(__fmaf_rn(-q, amax, a), y, q);
}

// The code's byte, rules::round_clamp(x * inv, 127) & 0xff: clamping first (to the integer
// bounds, NaN to -127 as round_clamp's fmaxf does) and rounding after gives the same integer,
// and the rounding is one FADD (round_to_low_bits) instead of two quarter-rate conversions.
__device__ __forceinline__ uint32_t code_byte(float x, float inv) {
  const float q = float(rules::kInt8Max);
  const float c = fminf(fmaxf(__fmul_rn(x, inv), -q), q);
  return round_to_low_bits(c) & 0xffu;
}

// The A registers of the two k32 slices from 32 accumulator-layout values; inv[r] for the
// thread's key row r (0: g, 1: g + 8).
__device__ __forceinline__ void pack_a(uint32_t (&a)[2][4], const float (&v)[kTileAcc], const float (&inv)[2]) {
#pragma unroll
  for (int ks = 0; ks < 2; ++ks)
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int base = 16 * ks + 8 * (r / 2) + 2 * (r % 2);  // a[r]: + {0, 1, 4, 5}
      const float f = inv[r % 2];
      a[ks][r] = code_byte(v[base], f) | (code_byte(v[base + 1], f) << 8) | (code_byte(v[base + 4], f) << 16) |
                 (code_byte(v[base + 5], f) << 24);
    }
}

// P's codes (pa) and scales per key row (p_scale[r]).
__device__ __forceinline__ void quantize_p(const float (&pv)[kTileAcc], uint32_t (&pa)[2][4], float (&p_scale)[2]) {
  const float fq = float(rules::kInt8Max);
  float pmax[2] = {0.f, 0.f};
#pragma unroll
  for (int x = 0; x < kTileAcc; ++x) pmax[(x % 4) / 2] = fmaxf(pmax[(x % 4) / 2], fabsf(pv[x]));
  float inv[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    pmax[r] = frag::quad_max(pmax[r]);
    inv[r] = inverse_127(pmax[r]);
    p_scale[r] = rules::symmetric_scale(pmax[r], fq);
  }
  pack_a(pa, pv, inv);
}

// dS's amax over the tile (both warpgroups), its codes as dK's A (dsa) and into the dS tile
// for dQ; returns the dS scale. `parity`: the tile's index & 1 (the amax slots alternate, so
// that a fast warpgroup never overwrites what the other still reads).
template <int D>
__device__ __forceinline__ float quantize_ds(const Smem<D>& s, const ConsumerThread& th, int parity,
                                             const float (&ds)[kTileAcc], uint32_t (&dsa)[2][4]) {
  const float fq = float(rules::kInt8Max);
  float m = 0.f;
#pragma unroll
  for (int x = 0; x < kTileAcc; ++x) m = fmaxf(m, fabsf(ds[x]));
  m = frag::warp_max(m);
  float* red = s.red() + 8 * parity;
  if (th.lane == 0) red[4 * th.c + th.w] = m;
  // Also orders this tile's dS stores after the other warpgroup's dQ MMA of the last tile
  // (which it waited for before arriving here).
  named_barrier_sync(kDsAmax, 128 * kConsumers);
  float all = red[0];
#pragma unroll
  for (int w = 1; w < 4 * kConsumers; ++w) all = fmaxf(all, red[w]);
  const float inv = inverse_127(all);
  const float inv2[2] = {inv, inv};
  pack_a(dsa, ds, inv2);
  // The [row][key position] tile: row 8j + 2t + (e & 1), positions 64c + 16w + 2g (key g,
  // e < 2) and + 1 (key g + 8, e >= 2).
  const int kp = 64 * th.c + 16 * th.w + 2 * th.g;
  const uint32_t ds_base = smem_addr(s.ds8());
#pragma unroll
  for (int j = 0; j < kTileAcc / 4; ++j)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int row = 8 * j + 2 * th.t + e;
      const uint32_t pair = code_byte(ds[4 * j + e], inv) | (code_byte(ds[4 * j + e + 2], inv) << 8);
      const uint32_t addr = ds_base + swizzled_offset(row, kp, 128);
      asm volatile("st.shared.u16 [%0], %1;" ::"r"(addr), "h"(uint16_t(pair)) : "memory");
    }
  // The tile is read by dQ's MMA through the async proxy.
  fence_proxy_async();
  return rules::symmetric_scale(all, fq);
}

}  // namespace sage::sm90::bwd
