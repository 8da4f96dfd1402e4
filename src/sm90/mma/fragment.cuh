// Where a thread's registers sit in the tiles of a warpgroup MMA (m64nNk32), in one place.
//
// Accumulator of m64nN: thread (warp w, lane l), g = l / 4, t = l % 4, holds for each 8-column
// chunk j the four values acc[4j + e]:
//     e = 0, 1 -> row 16w + g,     column 8j + 2t + e
//     e = 2, 3 -> row 16w + g + 8, column 8j + 2t + e - 2
// A operand (8-bit, registers) for one k32 slice: four 32-bit registers of 4 bytes each:
//     a[0] row g,   k 4t..4t+3      a[1] row g+8, k 4t..4t+3
//     a[2] row g,   k 16+4t..+3     a[3] row g+8, k 16+4t..+3
#pragma once

#include <cstdint>

#include "numerics/quant_rules.h"

namespace sage::sm90::frag {

__device__ __forceinline__ int group_of_lane(int lane) { return lane / 4; }
__device__ __forceinline__ int quad_of_lane(int lane) { return lane % 4; }

// Accumulator index -> which of the thread's two rows (0: g, 1: g+8).
__device__ __forceinline__ constexpr int acc_row(int idx) { return (idx % 4) / 2; }
// Accumulator index -> column inside the tile.
__device__ __forceinline__ int acc_col(int idx, int t) { return 8 * (idx / 4) + 2 * t + (idx % 2); }

// Reductions over the four threads that share a row (a quad).
__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}
// The same with a NaN-propagating max (rules::max_nan), for quantization group maxima.
__device__ __forceinline__ float quad_max_nan(float x) {
  x = rules::max_nan(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return rules::max_nan(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float warp_max_nan(float x) {
#pragma unroll
  for (int off = 1; off < 32; off *= 2) x = rules::max_nan(x, __shfl_xor_sync(0xffffffffu, x, off));
  return x;
}
__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int off = 1; off < 32; off *= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, off));
  return x;
}

}  // namespace sage::sm90::frag
