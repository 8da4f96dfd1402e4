// The simulator's backward pass for one query head (docs/numerics.md, "The backward"), on
// operands prepared as the kernels would hold them. backward.cpp's simulate_backward prepares
// them from a forward run and sums dK, dV over the heads of a GQA group.
#pragma once

#include <cstdint>
#include <vector>

#include "reference/qk_quantize.h"
#include "sage/backward.h"
#include "sage/recipe.h"

namespace sage::reference::sim {

// A matrix quantized to INT8 with one scale per block of `rows` consecutive rows (all
// columns): dO per backward Q tile, V per backward K/V tile.
struct Int8Rows {
  int64_t rows = 0;             // rows per block
  std::vector<int8_t> codes;    // [n][cols]
  std::vector<float> scale;     // one per block
};
Int8Rows quantize_row_blocks(const float* x, int64_t n, int64_t cols, int64_t rows_per_block);

// One query head's backward inputs. Every 16-bit operand is given already rounded to the
// backward's 16-bit format (the inputs' dtype; fp16 for f32 inputs).
struct BackwardHeadInputs {
  int64_t n_q = 0, n_kv = 0, d = 0;
  bool causal = false;
  bool bf16 = false;  // the 16-bit format is bf16 (bf16 inputs), else fp16
  float sm_scale = 0.f;
  float sm_scale_log2 = 0.f;
  const QKOperand* q = nullptr;  // the forward's quantized Q of this head
  const QKOperand* k = nullptr;  // the forward's quantized K' of its KV head
  const float* q16 = nullptr;    // [n_q][d] Q, 16-bit (fp16 dK)
  const float* k16 = nullptr;    // [n_kv][d] K' (smoothed K), 16-bit (fp16 dQ)
  const float* v16 = nullptr;    // [n_kv][d] V (not smoothed), 16-bit (fp16 dP)
  const Int8Rows* v8 = nullptr;  // V per backward K/V tile (int8 dP)
  const float* o16 = nullptr;    // [n_q][d] the forward's output as saved, 16-bit
  const float* do16 = nullptr;   // [n_q][d] dO, 16-bit
  const float* lse2 = nullptr;   // [n_q] the forward's m + log2 l (-inf: a row without keys)
};

// dQ of the head (sm_scale applied) and this head's dK, dV of its KV head (sm_scale applied
// to dK), each dense [tokens][d] in float.
struct HeadGradients {
  std::vector<float> dq, dk, dv;
};
HeadGradients backward_head(const Recipe& r, const BackwardHeadInputs& in, BackwardTileConfig bt);

// x rounded to the backward's 16-bit format: bf16, or fp16 saturating at its largest finite
// value (as the forward's fp16 operands, docs/numerics.md step 3).
float round16(float x, bool bf16);

}  // namespace sage::reference::sim
