// The online softmax over KV tiles, in base 2, as the kernel runs it. See docs/numerics.md,
// step 6.
#pragma once

#include <cstdint>
#include <limits>

namespace sage::reference::sim {

// Running max (base-2 logits) and denominator of one query row.
struct RowState {
  float m = -std::numeric_limits<float>::infinity();
  float l = 0.f;
  bool seen = false;  // some unmasked key has been visited
};

// Enters one tile whose first `count` logits are unmasked (masked keys lie past them and
// contribute nothing). Raises the running max, writes P~ = exp2(s2 - m) and returns the
// factor alpha = exp2(m_old - m_new) that the output and l must be rescaled by.
// Call only with count > 0: a tile with nothing unmasked for a row is skipped entirely.
float softmax_enter_tile(RowState& st, const float* s2, int64_t count, float* p);

// l = l * alpha + row_sum, with row_sum the float sum of P~ (or of the quantized P).
void softmax_add_row_sum(RowState& st, float alpha, float row_sum);

// The float sum of P~ in token order.
float softmax_row_sum(const float* p, int64_t count);

}  // namespace sage::reference::sim
