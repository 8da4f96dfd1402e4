// The online softmax over KV tiles, in base 2, as the kernel runs it. See docs/numerics.md,
// step 6.
#pragma once

#include <cstdint>
#include <limits>

#include "numerics/quant_rules.h"

namespace sage::reference::sim {

// Running max (base-2 logits) and denominator of one query row.
struct RowState {
  float m = -std::numeric_limits<float>::infinity();
  float l = 0.f;
  bool seen = false;  // some unmasked key has been visited
  // The largest base-2 logit of the tile entered last (before m takes it in): SageBwd's P
  // scale exp2f(tile_max - m) comes from it, with no reduction of its own.
  float tile_max = -std::numeric_limits<float>::infinity();
};

// Enters one tile's first `count` logits (keys past them are masked and contribute nothing;
// masked keys among them, before a sliding window's first key, have logit -inf). Raises the
// running max, writes P~ = exp2(s2 - m) (0 for a masked key) and returns the factor
// alpha = exp2(m_old - m_new) that the output and l must be rescaled by.
// Call only with some key unmasked: a tile with nothing unmasked for a row is skipped entirely.
float softmax_enter_tile(RowState& st, const float* s2, int64_t count, float* p);

// The integer row max variant of softmax_enter_tile (rules::integer_row_max; docs/numerics.md,
// step 6), from the tile's int32 accumulators acc and multipliers mult (qk_int_accumulators)
// of its first `count` keys, of which keys 0 .. first - 1 are masked (a sliding window's
// keys before its first: they join no group and get ps_j = 0, as the kernel's INT32_MIN
// entries do). The tile must start at a multiple of 8 tokens (KV tiles do):
// key j of the tile belongs to the GPU thread group g = (j % 8) / 2, whose keys share one
// multiplier mult_g. Per group: amax_g = max acc, tmax_g = float(amax_g) * mult_g;
// m_new = fmaxf(m, max_g tmax_g) (the value softmax_enter_tile gets from S2 = float(acc) *
// mult); c_g = ((tmax_g - m_new) - 2^24 mult_g); x_j = fmaf(float(2^24 + acc_j - amax_g),
// mult_g, c_g). With fold = rules::p_scale_fold(p_scale) (p_scale: what P~ is quantized
// after multiplying by), writes ps_j = P~_j * p_scale = exp2f(x_j'), where x_j' takes k in
// c_g (c_g + k, for groups that rules::p_scale_folds(mult_g)) or adds it after (x_j + k). Returns
// alpha as softmax_enter_tile does. Call only with first < count.
float softmax_enter_tile_integer_max(RowState& st, const int32_t* acc, const float* mult,
                                     int64_t count, const rules::PScaleFold& fold, float* ps,
                                     int64_t first = 0);

// l = l * alpha + row_sum, with row_sum the float sum of P~ (or of the quantized P).
void softmax_add_row_sum(RowState& st, float alpha, float row_sum);

// The float sum of P~ in token order.
float softmax_row_sum(const float* p, int64_t count);

}  // namespace sage::reference::sim
