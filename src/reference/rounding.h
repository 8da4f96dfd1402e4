// Roundings from double that the simulator's accumulator models and the writers share.
// Inline because the accumulator models call them once per channel per MMA k-step.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "numerics/formats.h"

namespace sage::reference {

inline uint32_t float_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}
inline float float_from_bits(uint32_t u) {
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
}

// x truncated toward zero to float32 (an overflow stops at the largest finite float).
inline float double_to_float_rz(double x) {
  float f = static_cast<float>(x);
  if (std::isnan(x)) return f;
  if (std::isinf(f) && !std::isinf(x)) return std::copysign(std::numeric_limits<float>::max(), f);
  // Float bits are sign-magnitude: one less is the next value toward zero.
  if (std::fabs(static_cast<double>(f)) > std::fabs(x)) f = float_from_bits(float_bits(f) - 1u);
  return f;
}

// Round-to-odd keeps a sticky bit in the float's last place, so that a following
// round-to-nearest into a format at least two bits shorter (fp16, bf16) equals rounding the
// double directly: no double-rounding error.
inline float double_to_float_odd(double x) {
  const float f = static_cast<float>(x);
  if (static_cast<double>(f) == x || std::isnan(x) || std::isinf(x)) return f;
  return float_from_bits(float_bits(double_to_float_rz(x)) | 1u);
}

// x rounded to nearest even fp16 / bf16 (overflow to inf), in one rounding.
inline float round_double_to_fp16_reference(double x) { return fmt::round_fp16(double_to_float_odd(x)); }
inline float round_double_to_bf16(double x) { return fmt::round_bf16(double_to_float_odd(x)); }

inline uint64_t double_bits(double x) {
  uint64_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}
inline double double_from_bits(uint64_t u) {
  double x;
  std::memcpy(&x, &u, sizeof x);
  return x;
}

// The accumulator models round once per channel per k-step, so this is the simulator's hot
// path. For fp16-normal magnitudes, adding and subtracting 1.5 * 2^(e - 10 + 52) rounds x to
// a multiple of its fp16 ulp 2^(e - 10) in one IEEE round-to-nearest-even (valid while
// |x| < 2^(e + 41), always true here); everything else takes the two-step path above.
// tests/cpu/test_simulator.cpp checks both paths agree.
inline float round_double_to_fp16(double x) {
  const int e = static_cast<int>((double_bits(x) >> 52) & 0x7FF) - 1023;
  if (e < -14 || e > 15) return round_double_to_fp16_reference(x);
  const double magic = double_from_bits((static_cast<uint64_t>(e - 10 + 52 + 1023) << 52) | (1ull << 51));
  const double r = (x + magic) - magic;
  if (std::fabs(r) > 65504.0) return std::copysign(std::numeric_limits<float>::infinity(), static_cast<float>(x));
  return static_cast<float>(r);
}

// FP22 (the FP8 MMA accumulator): x truncated toward zero to 13 explicit mantissa bits.
inline float truncate_double_to_fp22_reference(double x) { return fmt::truncate_fp22(double_to_float_rz(x)); }

// Truncating a double to float and then to 13 bits is truncating it to 13 bits at once,
// which for float-normal magnitudes is clearing the double's 39 low mantissa bits.
inline float truncate_double_to_fp22(double x) {
  const uint64_t b = double_bits(x);
  const uint64_t mag = b & 0x7FFFFFFFFFFFFFFFull;
  if (mag < 0x3810000000000000ull || mag > 0x47EFFFFFE0000000ull)  // outside [2^-126, FLT_MAX]
    return truncate_double_to_fp22_reference(x);
  return static_cast<float>(double_from_bits(b & ~((1ull << 39) - 1)));
}

}  // namespace sage::reference
