// Steps 6-7 of the backward: P and dS to INT8 in registers, straight into the operand layouts
// of the MMAs that read them (no pass reads them again).
//   Per key (P, bwd_p_granularity per_token; dS for dK, bwd_ds_granularity per_token): one
//   group per key over the tile's 64 rows; a key's values are the thread's 16 of its
//   accumulator row and its quad's (lanes 4g .. 4g + 3).
//   dS per block (per_block): one group over the whole 64 x 128 tile, both consumer
//   warpgroups (a named barrier); dK and dQ take the same codes.
//   dS per query row for dQ (per_token): one group per row over the tile's 128 keys, held by
//   both warpgroups: a row's values are 2 of the thread's, those of the 8 lanes of its t
//   (shuffles) and those of the other 7 warps (shared-memory maxima, the named barrier).
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

// The code's byte, rules::round_clamp(x * inv, 127) & 0xff, in two instructions beside the
// byte merge: the rounding is one FADD (round_to_low_bits) instead of two quarter-rate
// conversions, and of the clamp only the lower bound is kept, for NaN (-127, as round_clamp's
// fmaxf gives it). The upper bound never acts: every value is at most its group's amax in
// magnitude, so |x * inv| <= 127 (1 + 2^-23)^2 rounds into [-127, 127] (the forward's Q codes
// drop both bounds on that ground, q_operand.cuh), and an infinite amax makes inv 0, x * inv
// 0 or NaN.
__device__ __forceinline__ uint32_t code_byte(float x, float inv) {
  const float c = fmaxf(__fmul_rn(x, inv), -float(rules::kInt8Max));
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

// Codes (a) and scales per key row (scale[r], r = 0: key g, 1: key g + 8) of a tile's values
// in the accumulator layout, one group per key: P for dV, and dS for dK per token.
__device__ __forceinline__ void quantize_per_key(const float (&v)[kTileAcc], uint32_t (&a)[2][4], float (&scale)[2]) {
  float amax[2] = {0.f, 0.f};
#pragma unroll
  for (int x = 0; x < kTileAcc; ++x) amax[(x % 4) / 2] = fmaxf(amax[(x % 4) / 2], fabsf(v[x]));
  float inv[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    amax[r] = frag::quad_max(amax[r]);
    inv[r] = inverse_127(amax[r]);
    scale[r] = rules::symmetric_scale(amax[r], float(rules::kInt8Max));
  }
  pack_a(a, v, inv);
}

// The dS codes into the [row][key position] tile, dQ's A: row 8j + 2t + e (value 4j + e: key g,
// 4j + e + 2: key g + 8) at positions 64c + 16w + 2g and + 1. row_inv(j): the inverses of rows
// 8j + 2t and + 1.
template <int D, class RowInv>
__device__ __forceinline__ void store_ds_tile(const Smem<D>& s, const ConsumerThread& th, const float (&ds)[kTileAcc],
                                              RowInv row_inv) {
  const int kp = 64 * th.c + 16 * th.w + 2 * th.g;
  const uint32_t ds_base = smem_addr(s.ds8());
#pragma unroll
  for (int j = 0; j < kTileAcc / 4; ++j) {
    const float2 inv = row_inv(j);
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const float f = e == 0 ? inv.x : inv.y;
      const uint32_t pair = code_byte(ds[4 * j + e], f) | (code_byte(ds[4 * j + e + 2], f) << 8);
      const uint32_t addr = ds_base + swizzled_offset(8 * j + 2 * th.t + e, kp, 128);
      asm volatile("st.shared.u16 [%0], %1;" ::"r"(addr), "h"(uint16_t(pair)) : "memory");
    }
  }
  // The tile is read by dQ's MMA through the async proxy.
  fence_proxy_async();
}

// dS per block: the tile's amax (both warpgroups), its codes as dK's A (dsa) and into the dS
// tile for dQ; returns the dS scale.
template <int D>
__device__ __forceinline__ float quantize_ds_per_block(const Smem<D>& s, const ConsumerThread& th, int parity,
                                                       const float (&ds)[kTileAcc], uint32_t (&dsa)[2][4]) {
  float m = 0.f;
#pragma unroll
  for (int x = 0; x < kTileAcc; ++x) m = fmaxf(m, fabsf(ds[x]));
  m = frag::warp_max(m);
  float* red = s.red(parity);
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
  store_ds_tile(s, th, ds, [&](int) { return make_float2(inv, inv); });
  return rules::symmetric_scale(all, float(rules::kInt8Max));
}

// One step of a butterfly maximum that halves the values: the lane whose lane_mask bit is set
// keeps the upper half of `in` (and takes its partner's upper half), the other the lower.
template <int N>
__device__ __forceinline__ void max_halve(const float (&in)[2 * N], float (&out)[N], bool upper, int lane_mask) {
#pragma unroll
  for (int k = 0; k < N; ++k) {
    const float keep = upper ? in[N + k] : in[k], give = upper ? in[k] : in[N + k];
    out[k] = fmaxf(keep, __shfl_xor_sync(0xffffffffu, give, lane_mask));
  }
}

// |dS| maxima of the thread's 16 rows over the warp's 16 keys: 14 shuffles where one
// reduction per row would take 48. Lane g ends with rows 8g + 2t and 8g + 2t + 1.
__device__ __forceinline__ float2 row_max_over_warp(const float (&ds)[kTileAcc], int g) {
  float m16[16], m8[8], m4[4], m2[2];  // m16[2j + e]: row 8j + 2t + e
#pragma unroll
  for (int j = 0; j < kTileAcc / 4; ++j)
#pragma unroll
    for (int e = 0; e < 2; ++e) m16[2 * j + e] = fmaxf(fmaxf(0.f, fabsf(ds[4 * j + e])), fabsf(ds[4 * j + e + 2]));
  // Lane bits 4, 3, 2 are g's bits 2, 1, 0, which pick j's.
  max_halve<8>(m16, m8, (g & 4) != 0, 16);
  max_halve<4>(m8, m4, (g & 2) != 0, 8);
  max_halve<2>(m4, m2, (g & 1) != 0, 4);
  return make_float2(m2[0], m2[1]);
}

// dS per token: codes per key as dK's A (dsa, scales key_scale as quantize_per_key's) and per
// query row into the dS tile for dQ (its scales: dq_row_scales, after the kDsStored barrier).
// The rows' maxima over the 8 warps meet in s.red(parity) by integer atomics (non-negative
// floats order as their bits), from zero: the kernel zeroes both parities before the loop, and
// each tile those of the other parity, whose last readers (the previous tile's) have passed
// this tile's kDsAmax barrier and whose next writers (the next tile's) wait for its kDsStored.
template <int D>
__device__ __forceinline__ void quantize_ds_per_token(const Smem<D>& s, const ConsumerThread& th, int parity,
                                                      const float (&ds)[kTileAcc], uint32_t (&dsa)[2][4],
                                                      float (&key_scale)[2]) {
  const float2 m = row_max_over_warp(ds, th.g);
  unsigned* rows = reinterpret_cast<unsigned*>(s.red(parity));
  atomicMax(rows + 8 * th.g + 2 * th.t, __float_as_uint(m.x));
  atomicMax(rows + 8 * th.g + 2 * th.t + 1, __float_as_uint(m.y));
  quantize_per_key(ds, dsa, key_scale);  // while the other warps arrive
  // Also orders this tile's dS stores after the other warpgroup's dQ MMA of the last tile.
  named_barrier_sync(kDsAmax, 128 * kConsumers);
  if (th.c == 0 && th.w < 2) s.red(parity ^ 1)[32 * th.w + th.lane] = 0.f;
  // The 8 lanes of a t need the same 16 rows' inverses (rows 8j + 2t, + 1 for j = 0 .. 7):
  // lane (g, t) takes rows 8g + 2t and + 1 and the others fetch them by shuffle, 2 inverses a
  // thread instead of 16.
  const float2 a = *reinterpret_cast<const float2*>(s.red(parity) + 8 * th.g + 2 * th.t);
  const float inv_even = inverse_127(a.x), inv_odd = inverse_127(a.y);
  store_ds_tile(s, th, ds, [&](int j) {
    return make_float2(__shfl_sync(0xffffffffu, inv_even, 4 * j + th.t),
                       __shfl_sync(0xffffffffu, inv_odd, 4 * j + th.t));
  });
}

// dS's codes for dK (dsa) and dQ (the dS tile); key_scale[r]: dS's scale of the thread's key
// row r (0: key g, 1: key g + 8), the tile's twice per block. `parity`: the tile's index & 1.
template <DsGranularity G, int D>
__device__ __forceinline__ void quantize_ds(const Smem<D>& s, const ConsumerThread& th, int parity,
                                            const float (&ds)[kTileAcc], uint32_t (&dsa)[2][4],
                                            float (&key_scale)[2]) {
  if constexpr (G == DsGranularity::per_block) {
    key_scale[0] = key_scale[1] = quantize_ds_per_block(s, th, parity, ds, dsa);
  } else {
    quantize_ds_per_token(s, th, parity, ds, dsa, key_scale);
  }
}

// dQ's scales of the thread's accumulator rows (r = 0: row 16w + g, 1: + 8), s_dS,row *
// k_scale as the contract multiplies them; tile_scale: per_block's. After the kDsStored barrier.
template <DsGranularity G, int D>
__device__ __forceinline__ void dq_row_scales(const Smem<D>& s, const ConsumerThread& th, int parity,
                                              float tile_scale, float k_scale, float (&scale)[2]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float ds_scale = tile_scale;
    if constexpr (G == DsGranularity::per_token)
      ds_scale = rules::symmetric_scale(s.red(parity)[16 * th.w + th.g + 8 * r], float(rules::kInt8Max));
    scale[r] = __fmul_rn(ds_scale, k_scale);
  }
}

}  // namespace sage::sm90::bwd
