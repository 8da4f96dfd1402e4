// The operands of the PV stage: V quantized once per KV head, and the softmax numerator P~
// quantized tile by tile as the kernel does it. See docs/numerics.md, steps 7-8.
#pragma once

#include <cstdint>
#include <vector>

#include "sage/recipe.h"

namespace sage::reference::sim {

// V of one KV head as the PV matmul consumes it.
struct VOperand {
  PVFormat format = PVFormat::fp16;
  int64_t n = 0, d = 0;
  std::vector<float> values;         // [n][d]: fp8 / int8 decoded codes (unscaled), fp4
                                     // dequantized values, or fp16-rounded V
  std::vector<int8_t> int_codes;     // int8: the codes (the integer MMA path)
  std::vector<float> channel_scale;  // [d] per_channel / per_tensor (repeated): dequantized
                                     // V = code * channel_scale[c]; empty when `values` is V
                                     // or (per_block) carries its scale in block_scale
  int64_t block = 0;                 // per_block: tokens per block (the KV tile)
  std::vector<float> block_scale;    // per_block: dequantized V = code * block_scale[t / block]
  // fp16 V only: some value is an infinity or a NaN. Then a P of 0 times it is NaN, as in the
  // kernel's MMA (docs/numerics.md, "Non-finite inputs"), where otherwise a zero P is skipped.
  bool nonfinite = false;

  // The scale a KV tile starting at token j0 applies inside its PV accumulation: per_block
  // V's, 1 otherwise.
  float tile_scale(int64_t j0) const { return block_scale.empty() ? 1.f : block_scale[j0 / block]; }
};

// Quantizes n tokens of a (smoothed) V per the recipe's v_scale. v_range narrows the
// per-channel / per-tensor / per-block target range. block_kv: tokens per block of per_block
// V (the forward's KV tile); unused otherwise.
VOperand quantize_v(const float* v, int64_t n, int64_t d, const Recipe& r, int64_t block_kv = 0);

// Already-quantized INT8 V with a scale per tensor (one value) or per channel (d values).
VOperand prequantized_v(const float* codes, int64_t n, int64_t d, const double* scale,
                        bool per_channel);

// One KV tile of one row of P~, quantized.
struct PTile {
  std::vector<float> values;     // what enters the MMA, decoded: fp8 / int8 codes (P~ * p_max
                                 // units), fp16-rounded P~, or fp4 dequantized values (times
                                 // row_scale gives P~ units)
  std::vector<int8_t> int_codes; // int8 P: the codes
  float row_scale = 1.f;         // two-level: the per-row factor sr applied after the MMA;
                                 // per_token int8 P: s_P (codes * s_P = P~)
  float dequantized_sum = 0.f;   // sum of the quantized P in P~ units (RowSum::quantized_p)
};

// Quantizes the first `count` tokens of a tile (the unmasked ones; the tile starts at a
// multiple of the KV block, so the 16/32-token microscale groups start at token 0 here).
// scaled: P~ * p_max already formed (the integer row max's exp2; static fp8 / int8 P only),
// encoded as given instead of p * p_max. row_peak (per_token P only): the P~ the online
// softmax's maxima give this row's largest logit of the tile, exp2f(tile max - m).
void quantize_p(const Recipe& r, const float* p, int64_t count, PTile& out,
                const float* scaled = nullptr, float row_peak = 0.f);

}  // namespace sage::reference::sim
