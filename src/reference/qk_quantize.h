// The QK^T stage of the simulator: smoothing of Q and K, their quantization with the
// kernel's group maps (tile.h), and the base-2 logits the kernel's QK MMA and dequantization
// produce. See docs/numerics.md, steps 2-4.
#pragma once

#include <cstdint>
#include <vector>

#include "sage/recipe.h"
#include "numerics/tile.h"

namespace sage::reference::sim {

// Q or K of one head as the QK matmul consumes it, one row of head_dim per token.
struct QKOperand {
  QKFormat format = QKFormat::fp16;
  int64_t n = 0, d = 0;
  std::vector<int8_t> codes;  // int8 / int4: the integer codes
  std::vector<float> values;  // e4m3: decoded codes; nvfp4/mxfp4: dequantized values;
                              // fp16: the operand rounded to fp16
  std::vector<float> scale;   // int8 / int4 / e4m3: the scale of each token's group
};

// Mean over tokens 0, stride, 2 stride, ... below n of each channel: summed in double, divided,
// rounded once to float.
std::vector<float> channel_mean(const float* x, int64_t n, int64_t d, int stride = 1);
// x[t][c] -= mean[c] in float, for tokens [0, n).
void subtract_channel_mean(float* x, int64_t n, int64_t d, const float* mean);

// qk_channel_balance (docs/numerics.md, step 2): amax[c] = max(amax[c], |x[t][c]|) over
// tokens 0, stride, 2 stride, ... below n, with a NaN-propagating max (a NaN range leaves the
// channel unbalanced, as on the GPU), to gather one channel range over several heads.
void accumulate_channel_abs_max(const float* x, int64_t n, int64_t d, float* amax, int stride = 1);
// rules::qk_balance_scale for every channel.
std::vector<float> qk_balance_scales(const float* q_amax, const float* k_amax, int64_t d);
// x[t][c] *= s[c] (or /= s[c] where divide): exact in float, the s[c] being powers of two,
// unless a value leaves float's normal range.
void scale_channels(float* x, int64_t n, int64_t d, const float* s, bool divide);

// Quantizes n tokens of a smoothed Q (is_q) or K. int8/int4/e4m3 use the group map of
// `granularity` (q_group_of / k_group_of); nvfp4/mxfp4 scale 16/32 channels of one token.
QKOperand quantize_qk(const float* x, int64_t n, int64_t d, QKFormat format,
                      Granularity granularity, bool is_q, TileConfig tc);

// Already-quantized INT8 tokens with one scale per token (Inputs::prequantized_int8).
QKOperand prequantized_qk(const float* codes, const double* token_scale, int64_t n, int64_t d);

// Base-2 logits of query row i against keys [j0, j0 + count) of k, without the Q-smoothing
// term: s2[j - j0].
void qk_logits(const QKOperand& q, int64_t i, const QKOperand& k, int64_t j0, int64_t count,
               float sm_scale_log2, float* s2);

// The integer row max path (rules::integer_row_max; docs/numerics.md, steps 4 and 6), int8 /
// int4 only: the exact int32 accumulators acc[j - j0] = qcode_i . kcode_j of query row i
// against keys [j0, j0 + count) and their multipliers mult[j - j0] =
// rules::score_multiplier(q_scale_i, k_scale_j, sm_scale_log2). No logit is formed here:
// qk_logits' S2 would be float(acc) * mult; softmax_enter_tile_integer_max takes these instead.
void qk_int_accumulators(const QKOperand& q, int64_t i, const QKOperand& k, int64_t j0,
                         int64_t count, float sm_scale_log2, int32_t* acc, float* mult);

// The Q-smoothing compensation dS for every key, given the mean qm of one Q tile:
// (k_scale_j * sum_c qm[c] * kcode_j[c]) * sm_scale_log2, the sum in float in channel order.
// Defined for int8 / int4 K only (validate_recipe rejects smooth_q otherwise).
// Q smoothing's logit bias dS_j = (k_scale_j * sum_c qm[c] * kcode_j[c]) * sl2 for every key
// j, the sum in kSmoothQPartials interleaved float partial sums (docs/numerics.md, step 4).
constexpr int kSmoothQPartials = 8;
std::vector<float> smooth_q_logit_bias(const float* qm, const QKOperand& k, float sm_scale_log2);

}  // namespace sage::reference::sim
