// Scale formulas and rounding shared by the quantization kernels, the attention kernels and
// the CPU simulator. Every multiply and divide here is a single IEEE fp32 operation
// (round to nearest even), written so that host and device compute the same bits:
// nothing here may be fused into an FMA differently on the two sides.
#pragma once

#include <cmath>
#include <cstdint>

#include "sage/config.h"
#include "sage/formats.h"
#include "sage/recipe.h"

namespace sage::rules {

constexpr float kLog2e = 1.4426950408889634f;

// Largest magnitude a symmetric integer format may take.
constexpr int kInt8Max = 127;
constexpr int kInt4Max = 7;

// A group's scale: amax / qmax, so that dequantized = code * scale. A zero group gets
// scale 0 and codes 0 (never NaN).
SAGE_HD float symmetric_scale(float amax, float qmax) { return amax / qmax; }
// The multiplier applied before rounding: qmax / amax (0 for an all-zero group).
SAGE_HD float symmetric_inverse(float amax, float qmax) { return amax > 0.f ? qmax / amax : 0.f; }

// Round to nearest even and clamp to [-qmax, qmax]. (The GPU's Q path gets the same codes
// without the clamp, which never acts there: docs/numerics.md step 3.)
SAGE_HD int32_t round_clamp(float x, int qmax) {
  float r = rintf(x);
  r = fminf(fmaxf(r, -static_cast<float>(qmax)), static_cast<float>(qmax));
  return static_cast<int32_t>(r);  // NaN inputs are excluded by the callers' amax
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
// Static P scaling (the softmax numerator P~ is in [0, 1]): P~ * p_static_max is quantized;
// the recipe's narrowed p_range (SageAttention2++) when set, else the format max.
inline float p_static_max(const Recipe& r) { return r.p_range > 0.f ? r.p_range : pv_format_max(r.pv_format); }
// V per-channel / per-tensor scaling maps max|V'_c| to v_range when set, else the format max.
inline float v_static_max(const Recipe& r) { return r.v_range > 0.f ? r.v_range : pv_format_max(r.pv_format); }

}  // namespace sage::rules
