// The K/V pre-pass: two launches that turn fp16/bf16 K and V into what the attention kernel
// streams with TMA.
//
//   1. kv_stats: one cluster of CTAs per head reads K and V once and writes the head's
//      channel statistics (K mean, V mean, V scale and its inverse, K's largest |K - mean|),
//      combined on chip in a fixed order, so repeated calls are bit-identical.
//   2. kv_quantize: two CTAs per 128-token tile, one for K and one for V. K smoothed and INT8
//      with the group map of tile.h; V smoothed, scaled per channel, E4M3, transposed to
//      [D, tokens] with the token permutation the P register layout needs (see
//      pv_position_of_token below).
#pragma once

#include <cstdint>

#include "quant/kv_layout.h"

namespace sage::quant {

// Position, inside a 32-token slice of the transposed V tile, of token `tok`.
// The QK accumulator gives a thread the score columns {2t, 2t+1, 8+2t, 9+2t} (+16) of each
// 32-column slice, while an FP8 A operand must hold K positions {4t..4t+3} (+16). Packing
// the accumulator in place as the A operand therefore feeds the MMA a permuted token order;
// storing V with the same permutation makes the product exact with no register shuffles.
__host__ __device__ constexpr int pv_position_of_token(int tok) {
  const int half = tok / 16, u = tok % 16;
  const int t = u < 8 ? u / 2 : (u - 8) / 2;
  const int i = u < 8 ? u % 2 : 2 + (u - 8) % 2;
  return 16 * half + 4 * t + i;
}

// The token stored at position `pos` of a 32-token slice: the inverse of
// pv_position_of_token. Positions 4t..4t+3 (+16) hold tokens 2t, 2t+1, 2t+8, 2t+9 (+16).
__host__ __device__ constexpr int pv_token_at_position(int pos) {
  const int half = pos / 16, t = (pos % 16) / 4, i = pos % 4;
  return 16 * half + (i < 2 ? 2 * t + i : 8 + 2 * t + (i - 2));
}
constexpr bool pv_positions_invert() {
  for (int tok = 0; tok < 32; ++tok)
    if (pv_token_at_position(pv_position_of_token(tok)) != tok) return false;
  return true;
}
static_assert(pv_positions_invert(), "pv_token_at_position inverts pv_position_of_token");

template <int D, class T>
void launch_kv_prepass(const KVQuantParams& p, cudaStream_t stream);

}  // namespace sage::quant
