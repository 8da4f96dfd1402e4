// Scale formulas and rounding shared by the quantization kernels, the attention kernels and
// the CPU simulator. Every multiply and divide here is a single IEEE fp32 operation
// (round to nearest even), written so that host and device compute the same bits:
// nothing here may be fused into an FMA differently on the two sides.
#pragma once

#include <cmath>
#include <cstdint>

#include "numerics/config.h"
#include "numerics/formats.h"
#include "numerics/tile.h"
#include "sage/recipe.h"

namespace sage::rules {

constexpr float kLog2e = 1.4426950408889634f;

// Largest magnitude a symmetric integer format may take.
constexpr int kInt8Max = 127;
constexpr int kInt4Max = 7;

// Non-finite inputs (docs/numerics.md, "Non-finite inputs"): a NaN or an infinity in a scale
// group makes the group's scale NaN, and so every score or output it multiplies. The group
// maxima are taken with these NaN-propagating max / min (fmaxf drops a NaN); for finite
// values they are fmaxf / fminf, bit for bit.
SAGE_HD float max_nan(float a, float b) {
#ifdef __CUDA_ARCH__
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
#else
  return a != a || b != b ? a + b : fmaxf(a, b);
#endif
}
SAGE_HD float min_nan(float a, float b) {
#ifdef __CUDA_ARCH__
  float r;
  asm("min.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
#else
  return a != a || b != b ? a + b : fminf(a, b);
#endif
}

// qk_channel_balance (docs/numerics.md, step 2): channel c's power-of-two scale s_c, from
// qa = max |Q[.][c]| over the KV head's query heads and ka = max |K'[.][c]| over the keys K's
// statistics sample. L = floor(log2(qa / ka)), the quotient correctly rounded in double; a
// channel whose ranges differ by less than 4x (qa / ka in [1/4, 4): -2 <= L < 2) keeps
// s_c = 1, any other takes
// s_c = 2^floor((L + 1) / 2), clamped to 2^+-kMaxBalanceExponent; 1 also where qa or ka is 0
// or not finite. K' takes * s_c and Q / s_c: exact for a power of two, so only the quantizers
// see it. Why the 4x: ranges of Q and K' drawn from one distribution differ by up to ~2x by
// chance alone, and balancing those changed the bits (not the accuracy) of inputs that need
// nothing; the offsets the balance is for are 10-50x. Host and device compute it with the
// same double division and integer steps.
constexpr int kMaxBalanceExponent = 30;
constexpr int kMinBalanceLog2Ratio = 2;
SAGE_HD float qk_balance_scale(float qa, float ka) {
  const float kFltMax = 3.402823466e38f;
  if (!(qa > 0.f && ka > 0.f && qa <= kFltMax && ka <= kFltMax)) return 1.f;
  const int l = ilogb(static_cast<double>(qa) / static_cast<double>(ka));
  if (l >= -kMinBalanceLog2Ratio && l < kMinBalanceLog2Ratio) return 1.f;
  int e = l >= -1 ? (l + 1) / 2 : -((-l) / 2);  // floor((l + 1) / 2) for either sign
  e = e < -kMaxBalanceExponent ? -kMaxBalanceExponent : e > kMaxBalanceExponent ? kMaxBalanceExponent : e;
  return fmt::detail::pow2(e);
}

// 1 / s for a balance scale s = 2^e (|e| <= kMaxBalanceExponent): exact, by the exponent
// field alone (the kernels' IEEE reciprocal has a slow path that a call would reach).
SAGE_HD float reciprocal_pow2(float s) {
  return fmt::detail::f32_from_bits(0x7F000000u - fmt::detail::f32_bits(s));
}

// A group's scale: amax / qmax, so that dequantized = code * scale. A zero group gets
// scale 0 and codes 0. A non-finite amax (a NaN or an infinity in the group) gives NaN:
// (amax - amax) is +0 for every finite amax and NaN otherwise.
SAGE_HD float symmetric_scale(float amax, float qmax) { return amax / qmax + (amax - amax); }
// The multiplier applied before rounding: qmax / amax (0 for an all-zero group).
SAGE_HD float symmetric_inverse(float amax, float qmax) { return amax > 0.f ? qmax / amax : 0.f; }

// Round to nearest even and clamp to [-qmax, qmax]. (The GPU's Q path gets the same codes
// without the clamp, which never acts there: docs/numerics.md step 3.)
SAGE_HD int32_t round_clamp(float x, int qmax) {
  float r = rintf(x);
  r = fminf(fmaxf(r, -static_cast<float>(qmax)), static_cast<float>(qmax));
  return static_cast<int32_t>(r);  // NaN: fmaxf took the clamp's bound (the scale is NaN anyway)
}

// The per-score multiplier of the INT8 QK path: converts the int32 accumulator straight
// into the base-2 logit domain. Order fixed: (q_scale * k_scale) * (sm_scale * log2e).
SAGE_HD float score_multiplier(float q_scale, float k_scale, float sm_scale_log2) {
  return (q_scale * k_scale) * sm_scale_log2;
}
SAGE_HD float sm_scale_log2(float sm_scale) { return sm_scale * kLog2e; }

// "Integer row max" (docs/numerics.md, steps 4 and 6): the recipes whose softmax takes the
// row max on the int32 QK accumulators and forms the exponent argument with one FMA from a
// biased integer, so that the kernel converts no score from int to float (a quarter-rate
// conversion, like the ex2 beside it). It needs integer Q/K codes and, within one KV tile,
// one multiplier for all keys a GPU thread holds (per_thread / per_warp / per_block /
// per_tensor K, a Q scale per row); Q smoothing's float bias dS and per-token K scales would
// give every key its own offset or multiplier, and prequantized inputs (codes down to -128,
// per-token scales) keep the per-score conversion.
inline bool integer_row_max(const Recipe& r) {
  return (r.qk_format == QKFormat::int8 || r.qk_format == QKFormat::int4) &&
         r.inputs != Inputs::prequantized_int8 && r.qk_granularity != Granularity::per_token &&
         !r.smooth_q;
}
// The bias of the integer row max path: the exponent's FMA takes float(kIntRowMaxBias +
// (acc - amax)), an integer in [2^23, 2^24] for head_dim <= 256 (|acc - amax| <= 2 d 127^2 <
// 2^23), so the float is exact and its bit pattern is that integer plus 0x4A800000 (one
// integer add on the GPU, no conversion).
constexpr int32_t kIntRowMaxBias = int32_t{1} << 24;

// P's scale in the exponent (docs/numerics.md, step 6, "P's scale in the exponent"): on the
// two-level E4M3 path (sage2_8b's), the integer row max yields P~ * p_scale straight from
// exp2, with k = log2(p_scale) added to the exponent rather than a multiply per score. The
// other integer row max recipes keep the multiply: SageAttention2++'s fp16x2 path lost at
// d = 64 with the add (v25c, docs/history/README.md); fp16 and INT8 P were not measured.
inline bool p_scale_in_exponent(const Recipe& r) {
  return integer_row_max(r) && r.pv_format == PVFormat::e4m3 && r.pv_accum == PVAccum::two_level;
}
// Where it is (p_scale_fold(p_scale, head_dim)), a thread group whose multiplier is below
// mult_limit adds k to its offset once per tile (c' = fl(c + k)); any other adds it to each
// exponent. mult_limit = 2^tz(k) for p_scale = 2^k, k >= 1 an integer (8 for sage2_8b's
// 256): there c + k is exact for the group holding the row max (c = -2^24 mult, a multiple
// of ulp(c) <= 2^tz(k), from mult >= k 2^-24 up), so its max key keeps P~ = 1 exactly. +inf for
// k = 0 (fp16 P: adding 0), 0 (never) for a p_scale that is no power of two (k rounded) and
// below head dim 128 (the kernel's, tile.h kernel_head_dim): there the fold's extra live values made ptxas spill, while the add
// alone gained (v25, v25b in docs/history/README.md).
struct PScaleFold {
  float k = 0.f;           // log2(p_scale) as a float (exact for a power of two)
  float mult_limit = 0.f;  // a group folds k into its offset iff mult < mult_limit
};
constexpr int kPScaleFoldMinHeadDim = 128;
inline PScaleFold p_scale_fold(float p_scale, int head_dim) {
  int e = 0;
  if (!(p_scale >= 1.f) || std::frexp(p_scale, &e) != 0.5f ||
      kernel_head_dim(head_dim) < kPScaleFoldMinHeadDim)
    return {std::log2(p_scale), 0.f};
  const int k = e - 1;
  if (k == 0) return {0.f, INFINITY};
  int tz = 0;
  while (((k >> tz) & 1) == 0) ++tz;
  return {static_cast<float>(k), std::ldexp(1.f, tz)};
}
SAGE_HD bool p_scale_folds(float mult, float mult_limit) { return mult < mult_limit; }

// The row sum from the PV MMA (RowSum::pv_mma, docs/numerics.md step 6): from head dim 128
// the PV MMA multiplies P with one more V channel of ones, so the row sum is the quantized P
// accumulated as the output is (step 9's FP8 k32 steps, then two-level) and the softmax's
// float sum of P~ (one FADD per score, the issue slots that bind the kernel) goes away (v26,
// docs/history/README.md). Below, the recipe sums the unquantized P~ as float_p does: at
// d = 64 the n = 72 MMA's extra registers made ptxas spill (v19d). Only E4M3 P with two-level
// accumulation has such a kernel. The threshold is on the kernel's head dim (tile.h,
// kernel_head_dim): d = 97..127 runs on the 128 kernel and takes its MMA's sum; 96 does not.
constexpr int kRowSumMmaMinHeadDim = 128;
inline bool row_sum_in_pv_mma(const Recipe& r, int head_dim) {
  return r.row_sum == RowSum::pv_mma && r.pv_format == PVFormat::e4m3 &&
         r.pv_accum == PVAccum::two_level && kernel_head_dim(head_dim) >= kRowSumMmaMinHeadDim;
}

// The largest value of a P/V format: what a static scale maps a maximum to.
inline float pv_format_max(PVFormat f) {
  switch (f) {
    case PVFormat::e4m3: return 448.f;
    case PVFormat::e5m2: return 57344.f;
    case PVFormat::int8: return static_cast<float>(kInt8Max);
    case PVFormat::nvfp4:
    case PVFormat::mxfp4: return 6.f;
    case PVFormat::fp16: return 65504.f;
  }
  return 0.f;
}
// The ranges validate_recipe allows (recipe.h says why): p_range / v_range are 0 (the
// format's default) or in [kMinRange, pv_format_max]; with fp16x2_fp32 accumulation the
// product of the P and V ranges in use is at most 65504 / 64, so that one FP16 accumulation
// (two k32 steps, 64 products) stays finite.
constexpr float kMinRange = 1.f;
constexpr double kFp16x2MaxRangeProduct = 65504.0 / 64.0;
// K smoothing's stride: from 2^20 up every stride takes key 0 alone for any sequence the
// kernels are run on, and the GPU's launch arithmetic on the stride stays far from overflow.
constexpr int kMaxKMeanStride = 1 << 20;
// The static P scale a recipe gets without p_range: the format max, except E4M3's 256 (not
// the paper's 448). A power of two quantizes P~ on the same relative grid as 448 (equally
// accurate on the simulator: docs/numerics.md, step 7) and, with the integer row max,
// enters the exponent exactly (p_scale_fold: no multiply per score).
inline float p_default_max(PVFormat f) { return f == PVFormat::e4m3 ? 256.f : pv_format_max(f); }
// Static P scaling (the softmax numerator P~ is in [0, 1]): P~ * p_static_max is quantized;
// the recipe's narrowed p_range (SageAttention2++) when set, else the format's default.
inline float p_static_max(const Recipe& r) { return r.p_range > 0.f ? r.p_range : p_default_max(r.pv_format); }
// V per-channel / per-tensor scaling maps max|V'_c| to v_range when set, else the format max.
inline float v_static_max(const Recipe& r) { return r.v_range > 0.f ? r.v_range : pv_format_max(r.pv_format); }

// The keys K smoothing's mean is taken over with a stride: 0, stride, ..., at least one while
// n > 0.
SAGE_HD int64_t k_mean_samples(int64_t n, int stride) { return (n + stride - 1) / stride; }

}  // namespace sage::rules
