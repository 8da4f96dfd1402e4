// Bit-exact encoders and decoders of the narrow formats the kernels use.
//
// The CPU simulator must produce the very bits the GPU conversion instructions produce, so
// every conversion here is integer manipulation of the float32 bit pattern (plus float
// multiplies by exact powers of two). No rounding mode, FMA contraction, flush-to-zero or
// library call can change a result, and host and device compile the same code.
//
// Rounding is round-to-nearest, ties to even, of the exact float32 input (one rounding; no
// detour through fp16). The narrow encoders saturate as the PTX `.satfinite` conversions do.
//
// Checked on an H100 (src/formats/hw_convert_check.cu): the e4m3, e5m2, fp16 (rn and
// satfinite) and bf16 encoders equal the cvt instructions on all 2^32 float32 inputs, NaNs
// included, and the e4m3, e5m2 and fp16 decoders on every code. E2M1 and E8M0 conversions
// exist only on sm_100, so those two follow the PTX manual and the OCP spec unverified.
#pragma once

#include <cstdint>

#include "numerics/config.h"

namespace sage::fmt {

namespace detail {

SAGE_HD uint32_t f32_bits(float x) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(x);
#else
  uint32_t u;
  __builtin_memcpy(&u, &x, sizeof u);
  return u;
#endif
}

SAGE_HD float f32_from_bits(uint32_t u) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(u);
#else
  float x;
  __builtin_memcpy(&x, &u, sizeof x);
  return x;
#endif
}

constexpr uint32_t kAbsMask = 0x7FFFFFFFu;
constexpr uint32_t kInfBits = 0x7F800000u;
constexpr uint32_t kQuietNaNBits = 0x7FC00000u;

// 2^e for e in [-126, 127]: a normal float32, built exactly from its exponent field.
SAGE_HD float pow2(int e) { return f32_from_bits(static_cast<uint32_t>(e + 127) << 23); }

// Rounds the magnitude of a finite float32 (its bits without the sign) to a format with M
// explicit mantissa bits whose smallest normal exponent is EMIN, and returns the format's
// magnitude code: exponent field << M | mantissa. The code is not clamped: callers saturate
// or overflow to infinity. Writing the result as ((e - EMIN) << M) + n, where n already holds
// the implicit bit, lets a mantissa carry bump the exponent and lets the subnormal range
// (e == EMIN, n < 2^M) come out with exponent field 0, so there are no special cases.
//
// Float32 subnormals and zero return 0: every format routed here has its smallest
// subnormal far above 2^-126 (fp16's is 2^-24), so they are below half of it.
template <int M, int EMIN>
SAGE_HD uint32_t round_magnitude(uint32_t abs_bits) {
  static_assert(EMIN - M > -100, "float32 subnormals would need exact handling");
  if (abs_bits < 0x00800000u) return 0;
  const int e32 = static_cast<int>(abs_bits >> 23) - 127;
  const uint32_t sig = (abs_bits & 0x007FFFFFu) | 0x00800000u;  // value = sig * 2^(e32-23)
  const int e = e32 > EMIN ? e32 : EMIN;                          // exponent of the target ulp
  const int shift = 23 + e - M - e32;                              // >= 23 - M > 0
  // sig < 2^24, so beyond a shift of 24 the value is below half the target ulp.
  if (shift > 24) return 0;
  uint32_t n = sig >> shift;
  const uint32_t rem = sig & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1);
  if (rem > half || (rem == half && (n & 1u))) ++n;
  return (static_cast<uint32_t>(e - EMIN) << M) + n;
}

// Decodes a magnitude code of a format with M mantissa bits and exponent bias BIAS whose
// all-ones exponent is an ordinary number (callers handle their special codes first).
template <int M, int BIAS>
SAGE_HD float decode_magnitude(uint32_t mag) {
  const uint32_t exp_field = mag >> M;
  const uint32_t mant = mag & ((1u << M) - 1u);
  if (exp_field == 0) {
    // Subnormal: mant * 2^(1 - BIAS - M); an integer below 2^M times a power of two, exact.
    return static_cast<float>(mant) * pow2(1 - BIAS - M);
  }
  const uint32_t e32 = exp_field - BIAS + 127;
  return f32_from_bits((e32 << 23) | (mant << (23 - M)));
}

SAGE_HD float with_sign(float magnitude, bool negative) {
  return f32_from_bits(f32_bits(magnitude) | (negative ? 0x80000000u : 0u));
}

}  // namespace detail

// ---- FP8 E4M3 (OCP "fn"): bias 7, no infinities, S.1111.111 is NaN, max 448 ---------------
//
// Encoding follows cvt.rn.satfinite.e4m3x2.f32 (the only E4M3 conversion Hopper has):
// round to nearest even; finite values that round past 448, and +-inf, saturate to +-448;
// zero and values that round to zero keep their sign (-0 is 0x80). Every NaN, whatever its
// sign, becomes 0x7F: .satfinite documents "NaN in, NaN out", and the NaN the hardware
// writes is always the positive one (observed on H100).
SAGE_HD uint8_t e4m3_encode(float x) {
  const uint32_t b = detail::f32_bits(x);
  const uint32_t a = b & detail::kAbsMask;
  if (a > detail::kInfBits) return 0x7F;
  const uint8_t sign = static_cast<uint8_t>((b >> 24) & 0x80u);
  uint32_t mag = a == detail::kInfBits ? 0x7Eu : detail::round_magnitude<3, -6>(a);
  if (mag > 0x7Eu) mag = 0x7Eu;  // 0x7F would be NaN: satfinite stops at 448
  return static_cast<uint8_t>(sign | mag);
}

SAGE_HD float e4m3_decode(uint8_t c) {
  const bool neg = (c & 0x80u) != 0;
  const uint32_t mag = c & 0x7Fu;
  if (mag == 0x7Fu) return detail::f32_from_bits(detail::kQuietNaNBits | (neg ? 0x80000000u : 0u));
  return detail::with_sign(detail::decode_magnitude<3, 7>(mag), neg);
}

// ---- FP8 E5M2: bias 15, IEEE-like (S.11111.00 is inf, S.11111.xx NaN), max 57344 ----------
//
// Encoding follows cvt.rn.satfinite.e5m2x2.f32: round to nearest even; .satfinite turns
// overflow and +-inf into +-57344 (so the encoder never writes an infinity); NaN -> 0x7F.
SAGE_HD uint8_t e5m2_encode(float x) {
  const uint32_t b = detail::f32_bits(x);
  const uint32_t a = b & detail::kAbsMask;
  if (a > detail::kInfBits) return 0x7F;
  const uint8_t sign = static_cast<uint8_t>((b >> 24) & 0x80u);
  uint32_t mag = a == detail::kInfBits ? 0x7Bu : detail::round_magnitude<2, -14>(a);
  if (mag > 0x7Bu) mag = 0x7Bu;
  return static_cast<uint8_t>(sign | mag);
}

SAGE_HD float e5m2_decode(uint8_t c) {
  const bool neg = (c & 0x80u) != 0;
  const uint32_t mag = c & 0x7Fu;
  if (mag >= 0x7Cu) {
    const uint32_t special = mag == 0x7Cu ? detail::kInfBits : detail::kQuietNaNBits;
    return detail::f32_from_bits(special | (neg ? 0x80000000u : 0u));
  }
  return detail::with_sign(detail::decode_magnitude<2, 15>(mag), neg);
}

// ---- FP4 E2M1 (low nibble): bias 1, values 0, 0.5, 1, 1.5, 2, 3, 4, 6 and negatives ------
//
// Encoding follows cvt.rn.satfinite.e2m1x2.f32 (sm_100+): round to nearest even (a tie goes
// to the code with an even mantissa bit, e.g. 2.5 -> 2, 5 -> 4), saturate overflow and +-inf
// to +-6, keep the sign of zero (-0 is 0x8). E2M1 has no NaN code and PTX does not document
// what a NaN input gives, so we choose 0x7 (+6): a NaN stays visibly large instead of
// silently vanishing as a zero would. Quantizers should not feed NaN here in the first place.
SAGE_HD uint8_t e2m1_encode(float x) {
  const uint32_t b = detail::f32_bits(x);
  const uint32_t a = b & detail::kAbsMask;
  if (a > detail::kInfBits) return 0x7;
  const uint8_t sign = static_cast<uint8_t>((b >> 28) & 0x8u);
  uint32_t mag = a == detail::kInfBits ? 0x7u : detail::round_magnitude<1, 0>(a);
  if (mag > 0x7u) mag = 0x7u;
  return static_cast<uint8_t>(sign | mag);
}

// Reads the low nibble only, so both halves of an e2m1x2 byte decode as c and c >> 4.
SAGE_HD float e2m1_decode(uint8_t c) {
  return detail::with_sign(detail::decode_magnitude<1, 1>(c & 0x7u), (c & 0x8u) != 0);
}

// ---- E8M0: unsigned power-of-two scale 2^(c - 127), 0xFF is NaN ---------------------------
//
// A scale is stored by rounding its exponent down (floor(log2 x), as the sm_100 instruction
// cvt.rz.satfinite.ue8m0x2.f32 is documented to), which is exact for the powers of two the MX rule produces. The result is clamped
// to [2^-127, 2^127]: +inf -> 0xFE, positive float32 subnormals -> 0x00. A scale cannot be
// negative or zero; x <= 0 (including -0 and -inf) gives 0x00, the smallest scale, so that a
// zero group still dequantizes to zeros and never to NaN. NaN -> 0xFF.
SAGE_HD uint8_t e8m0_encode(float x) {
  const uint32_t b = detail::f32_bits(x);
  if ((b & detail::kAbsMask) > detail::kInfBits) return 0xFF;
  if ((b & 0x80000000u) != 0 || b == 0) return 0x00;
  if (b == detail::kInfBits) return 0xFE;
  // The biased float32 exponent is floor(log2 x) + 127 for normals and 0 for subnormals,
  // whose floor(log2) is <= -127 and clamps to code 0 anyway.
  return static_cast<uint8_t>(b >> 23);
}

SAGE_HD float e8m0_decode(uint8_t c) {
  if (c == 0xFF) return detail::f32_from_bits(detail::kQuietNaNBits);
  if (c == 0x00) return detail::f32_from_bits(0x00400000u);  // 2^-127 is a float32 subnormal
  return detail::f32_from_bits(static_cast<uint32_t>(c) << 23);
}

// The OCP MX shared scale of a block whose largest magnitude is amax, for elements whose
// largest power of two is 2^elem_emax (E2M1: 2, E4M3: 8, E5M2: 15; must be >= 0):
//   X = 2^(floor(log2(amax)) - elem_emax), clamped to the E8M0 range [2^-127, 2^127].
// amax <= 0 (an all-zero block) gives code 0x00: every element is 0 under any scale, and the
// smallest one keeps the dequantized values 0 instead of risking 0 * large or NaN. NaN gives
// 0xFF, as the MX spec propagates NaN into the scale; so does amax = +inf, where the shared
// exponent exceeds the scale's range (the spec's reference marks that NaN, too).
SAGE_HD uint8_t e8m0_mx_scale(float amax, int elem_emax) {
  const uint32_t b = detail::f32_bits(amax);
  if ((b & detail::kAbsMask) > detail::kInfBits) return 0xFF;
  if ((b & 0x80000000u) != 0 || b == 0) return 0x00;  // includes -0 and -inf
  if (b == detail::kInfBits) return 0xFF;
  // floor(log2(amax)) + 127 is the float32 exponent field. A subnormal amax reads as 0
  // although its true value is lower; both clamp to code 0 for every elem_emax >= 0.
  int code = static_cast<int>(b >> 23) - elem_emax;
  if (code < 0) code = 0;
  if (code > 254) code = 254;
  return static_cast<uint8_t>(code);
}

// ---- binary16 / bfloat16 -------------------------------------------------------------------

// Bits of x rounded to binary16, nearest even, as cvt.rn.f16.f32: magnitudes from 65520 up
// (the midpoint between 65504 and 2^16) become inf. Every NaN becomes 0x7FFF, the canonical
// NaN NVIDIA GPUs write. Float32 values below 2^-25 flush to a signed zero (rounding, not
// FTZ: that is below half the smallest fp16 subnormal).
SAGE_HD uint16_t fp16_bits(float x) {
  const uint32_t b = detail::f32_bits(x);
  const uint32_t a = b & detail::kAbsMask;
  if (a > detail::kInfBits) return 0x7FFF;
  const uint16_t sign = static_cast<uint16_t>((b >> 16) & 0x8000u);
  uint32_t mag = a == detail::kInfBits ? 0x7C00u : detail::round_magnitude<10, -14>(a);
  if (mag > 0x7C00u) mag = 0x7C00u;
  return static_cast<uint16_t>(sign | mag);
}

SAGE_HD float fp16_from_bits(uint16_t h) {
  const bool neg = (h & 0x8000u) != 0;
  const uint32_t mag = h & 0x7FFFu;
  if (mag >= 0x7C00u) {
    // Inf keeps its sign; a NaN keeps its payload in the top mantissa bits (quieted).
    const uint32_t payload = (mag & 0x3FFu) << 13;
    const uint32_t bits = mag == 0x7C00u ? detail::kInfBits : (detail::kQuietNaNBits | payload);
    return detail::f32_from_bits(bits | (neg ? 0x80000000u : 0u));
  }
  return detail::with_sign(detail::decode_magnitude<10, 15>(mag), neg);
}

// Bits of x rounded to bfloat16, nearest even (cvt.rn.bf16.f32). Same exponent range as
// float32, so float32 subnormals round into bfloat16 subnormals and overflow gives inf.
// Any NaN becomes the canonical 0x7FFF (adding the rounding bias to a NaN could otherwise
// carry it into an infinity).
SAGE_HD uint16_t bf16_bits(float x) {
  const uint32_t b = detail::f32_bits(x);
  if ((b & detail::kAbsMask) > detail::kInfBits) return 0x7FFF;
  // Adding 0x7FFF plus the lowest kept bit rounds to nearest even in the integer domain;
  // a carry out of the mantissa correctly bumps the exponent (up to inf).
  const uint32_t rounded = b + 0x7FFFu + ((b >> 16) & 1u);
  return static_cast<uint16_t>(rounded >> 16);
}

SAGE_HD float bf16_from_bits(uint16_t h) {
  return detail::f32_from_bits(static_cast<uint32_t>(h) << 16);
}

// x rounded to binary16 and back (what storing to fp16 does; overflow gives inf).
SAGE_HD float round_fp16(float x) { return fp16_from_bits(fp16_bits(x)); }

// As round_fp16, but overflow and +-inf saturate to +-65504 (cvt.rn.satfinite.f16.f32).
// NaN stays NaN.
SAGE_HD float round_fp16_satfinite(float x) {
  const uint16_t h = fp16_bits(x);
  if ((h & 0x7FFFu) == 0x7C00u) return fp16_from_bits(static_cast<uint16_t>((h & 0x8000u) | 0x7BFFu));
  return fp16_from_bits(h);
}

// As round_fp16_satfinite for finite x (a value out of fp16's range, such as a bf16 input or
// a smoothed V, saturates), but an infinity stays an infinity: non-finite inputs propagate
// (docs/numerics.md, "Non-finite inputs").
SAGE_HD float round_fp16_saturate_overflow(float x) {
  if ((detail::f32_bits(x) & detail::kAbsMask) == detail::kInfBits) return x;
  return round_fp16_satfinite(x);
}

// x rounded to bfloat16 and back; NaN stays NaN.
SAGE_HD float round_bf16(float x) { return bf16_from_bits(bf16_bits(x)); }

// The FP8 tensor-core accumulator keeps 13 explicit mantissa bits ("FP22": 1 + 8 + 13) and
// drops the rest of each partial sum without rounding. Modelled as float32 with its 10
// lowest mantissa bits cleared: round toward zero, exponent range unchanged. Inf stays inf;
// NaN is returned unchanged (clearing its payload bits could turn it into an infinity).
SAGE_HD float truncate_fp22(float x) {
  const uint32_t b = detail::f32_bits(x);
  if ((b & detail::kAbsMask) > detail::kInfBits) return x;
  return detail::f32_from_bits(b & ~0x3FFu);
}

}  // namespace sage::fmt
