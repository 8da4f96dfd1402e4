// Exhaustive tests of the bit-exact encoders in numerics/formats.h and the rounding rules in
// numerics/quant_rules.h.
//
// Every expectation comes from a second, independent model of the format: values are built
// from the bit fields with std::ldexp in double, and encoding is a brute-force search for the
// nearest table value (ties to the even code) in double. Nothing here reuses the library's
// bit tricks, so a shared mistake cannot make both sides agree.
#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "numerics/formats.h"
#include "numerics/quant_rules.h"

namespace {

using namespace sage;

uint32_t bits_of(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}
float float_of(uint32_t u) {
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
}
std::string hex(uint32_t v) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "0x%X", v);
  return buf;
}
std::string describe(float x) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.9g (bits 0x%08X)", static_cast<double>(x), bits_of(x));
  return buf;
}

// Every float32 whose 12 low mantissa bits are zero: 2^20 values covering every exponent,
// both signs, zeros, subnormals, infinities and NaNs, with 11 mantissa bits each — more than
// any narrow format's mantissa plus its rounding bit.
std::vector<float> dense_sweep() {
  std::vector<float> v;
  v.reserve(1u << 20);
  for (uint32_t hi = 0; hi < (1u << 20); ++hi) v.push_back(float_of(hi << 12));
  return v;
}
// Uniformly random bit patterns: these exercise the sticky bits below the sweep's 11.
std::vector<float> random_sweep(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<float> v(n);
  for (auto& x : v) x = float_of(static_cast<uint32_t>(rng()));
  return v;
}
const std::vector<float>& all_sweeps() {
  static const std::vector<float> v = [] {
    std::vector<float> a = dense_sweep();
    std::vector<float> b = random_sweep(1u << 20, 12345u);
    a.insert(a.end(), b.begin(), b.end());
    return a;
  }();
  return v;
}

// ---- an independent model of a sign/exponent/mantissa format -------------------------------

enum class Specials { fn_nan, ieee, none };  // e4m3 "fn", IEEE-like, no special codes (e2m1)
enum class Overflow { satfinite, to_inf };

struct Spec {
  std::string name;
  int E, M, bias;
  Specials specials;
  Overflow overflow;
  uint32_t canonical_nan;  // what encoding a NaN must give
  std::function<uint32_t(float)> enc;
  std::function<float(uint32_t)> dec;  // nullptr: the spec only tests an encoder

  uint32_t sign_bit() const { return 1u << (E + M); }
  uint32_t mag_codes() const { return 1u << (E + M); }
  uint32_t all_codes() const { return 2u << (E + M); }
};

std::ostream& operator<<(std::ostream& os, const Spec& s) { return os << s.name; }

// Value of a code straight from its fields; NaN for NaN codes, +-inf for infinity codes.
double model_decode(const Spec& s, uint32_t code) {
  const bool neg = (code & s.sign_bit()) != 0;
  const uint32_t e = (code >> s.M) & ((1u << s.E) - 1u);
  const uint32_t m = code & ((1u << s.M) - 1u);
  const uint32_t e_max = (1u << s.E) - 1u, m_max = (1u << s.M) - 1u;
  double mag;
  if (s.specials == Specials::ieee && e == e_max) {
    mag = m == 0 ? std::numeric_limits<double>::infinity() : std::numeric_limits<double>::quiet_NaN();
  } else if (s.specials == Specials::fn_nan && e == e_max && m == m_max) {
    mag = std::numeric_limits<double>::quiet_NaN();
  } else if (e == 0) {
    mag = std::ldexp(static_cast<double>(m), 1 - s.bias - s.M);
  } else {
    mag = std::ldexp(static_cast<double>((1u << s.M) + m), static_cast<int>(e) - s.bias - s.M);
  }
  return neg ? -mag : mag;
}

struct Entry {
  double value;
  uint32_t code;
};

// Finite non-negative values in increasing order, then one virtual entry: the value the
// next code would have if the format's top binade went on (where rounding overflows).
std::vector<Entry> model_table(const Spec& s) {
  std::vector<Entry> t;
  for (uint32_t c = 0; c < s.mag_codes(); ++c) {
    const double v = model_decode(s, c);
    if (std::isfinite(v)) t.push_back({v, c});
  }
  for (size_t i = 1; i < t.size(); ++i)
    if (!(t[i].value > t[i - 1].value) || t[i].code != t[i - 1].code + 1)
      ADD_FAILURE() << s.name << ": the model's finite codes are not monotonic";
  const size_t n = t.size();
  t.push_back({2 * t[n - 1].value - t[n - 2].value, t[n - 1].code + 1});
  return t;
}

uint32_t max_code(const Spec& s) { return model_table(s).end()[-2].code; }

// Applies the format's overflow rule to a magnitude code from the extended table.
uint32_t finish(const Spec& s, const std::vector<Entry>& t, uint32_t mag, bool neg) {
  const uint32_t top = t.end()[-2].code;
  if (mag > top) mag = s.overflow == Overflow::satfinite ? top : top + 1;  // top + 1 is inf
  return (neg ? s.sign_bit() : 0u) | mag;
}

// Brute-force nearest: the expected code for x.
uint32_t model_encode(const Spec& s, const std::vector<Entry>& t, float x) {
  if (std::isnan(x)) return s.canonical_nan;
  const bool neg = std::signbit(x);
  const double a = std::fabs(static_cast<double>(x));
  if (a >= t.back().value) return finish(s, t, t.back().code, neg);
  const auto it = std::lower_bound(t.begin(), t.end(), a,
                                   [](const Entry& e, double v) { return e.value < v; });
  if (it->value == a) return finish(s, t, it->code, neg);
  const Entry& hi = *it;
  const Entry& lo = *(it - 1);
  const double dlo = a - lo.value, dhi = hi.value - a;
  uint32_t pick;
  if (dlo < dhi) pick = lo.code;
  else if (dhi < dlo) pick = hi.code;
  else pick = (lo.code % 2 == 0) ? lo.code : hi.code;
  return finish(s, t, pick, neg);
}

uint32_t inf_code(const Spec& s) { return max_code(s) + 1; }

std::vector<Spec> specs() {
  using namespace sage::fmt;
  std::vector<Spec> v;
  v.push_back({"e4m3", 4, 3, 7, Specials::fn_nan, Overflow::satfinite, 0x7F,
               [](float x) { return uint32_t{e4m3_encode(x)}; },
               [](uint32_t c) { return e4m3_decode(static_cast<uint8_t>(c)); }});
  v.push_back({"e5m2", 5, 2, 15, Specials::ieee, Overflow::satfinite, 0x7F,
               [](float x) { return uint32_t{e5m2_encode(x)}; },
               [](uint32_t c) { return e5m2_decode(static_cast<uint8_t>(c)); }});
  v.push_back({"e2m1", 2, 1, 1, Specials::none, Overflow::satfinite, 0x7,
               [](float x) { return uint32_t{e2m1_encode(x)}; },
               [](uint32_t c) { return e2m1_decode(static_cast<uint8_t>(c)); }});
  v.push_back({"fp16_bits", 5, 10, 15, Specials::ieee, Overflow::to_inf, 0x7FFF,
               [](float x) { return uint32_t{fp16_bits(x)}; },
               [](uint32_t c) { return fp16_from_bits(static_cast<uint16_t>(c)); }});
  // The float-returning helpers are checked through the bits of what they return (their
  // results are fp16/bf16 values, so fp16_bits/bf16_bits read them back exactly).
  v.push_back({"round_fp16", 5, 10, 15, Specials::ieee, Overflow::to_inf, 0x7FFF,
               [](float x) { return uint32_t{fp16_bits(round_fp16(x))}; }, nullptr});
  v.push_back({"round_fp16_satfinite", 5, 10, 15, Specials::ieee, Overflow::satfinite, 0x7FFF,
               [](float x) { return uint32_t{fp16_bits(round_fp16_satfinite(x))}; }, nullptr});
  v.push_back({"bf16_bits", 8, 7, 127, Specials::ieee, Overflow::to_inf, 0x7FFF,
               [](float x) { return uint32_t{bf16_bits(x)}; },
               [](uint32_t c) { return bf16_from_bits(static_cast<uint16_t>(c)); }});
  v.push_back({"round_bf16", 8, 7, 127, Specials::ieee, Overflow::to_inf, 0x7FFF,
               [](float x) { return uint32_t{bf16_bits(round_bf16(x))}; }, nullptr});
  return v;
}

std::vector<Spec> specs_with_decoder() {
  std::vector<Spec> v;
  for (const Spec& s : specs())
    if (s.dec) v.push_back(s);
  return v;
}

class FormatTest : public ::testing::TestWithParam<Spec> {};
class DecoderTest : public ::testing::TestWithParam<Spec> {};

// Decoding every code gives the value the bit fields define (and the sign of zero).
TEST_P(DecoderTest, DecodeEveryCodeMatchesBitFields) {
  const Spec& s = GetParam();
  for (uint32_t c = 0; c < s.all_codes(); ++c) {
    const double want = model_decode(s, c);
    const float got = s.dec(c);
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << s.name << " code " << hex(c);
      continue;
    }
    EXPECT_EQ(static_cast<double>(got), want) << s.name << " code " << hex(c);
    EXPECT_EQ(std::signbit(got), (c & s.sign_bit()) != 0) << s.name << " code " << hex(c);
  }
}

// Encoding a decoded code gives the code back; NaN codes give the canonical NaN and, with
// satfinite, infinity codes give the largest finite code.
TEST_P(FormatTest, EveryCodeRoundTrips) {
  const Spec& s = GetParam();
  const uint32_t top = max_code(s);
  for (uint32_t c = 0; c < s.all_codes(); ++c) {
    const double v = model_decode(s, c);
    const float x = static_cast<float>(v);
    uint32_t want = c;
    if (std::isnan(v)) want = s.canonical_nan;
    else if (std::isinf(v) && s.overflow == Overflow::satfinite) want = (c & s.sign_bit()) | top;
    EXPECT_EQ(s.enc(x), want) << s.name << " code " << hex(c);
    if (s.dec) {
      const float back = s.dec(c);
      if (!std::isnan(v)) {
        EXPECT_EQ(s.enc(back), want) << s.name << " decode then encode, code " << hex(c);
      } else {
        EXPECT_EQ(s.enc(back), s.canonical_nan) << s.name << " NaN code " << hex(c);
      }
    }
  }
}

// For every pair of adjacent values (including the virtual one past the maximum, where
// rounding overflows): the exact midpoint goes to the even code, one float ulp either side
// goes to the nearer value.
TEST_P(FormatTest, EveryMidpointTiesToEven) {
  const Spec& s = GetParam();
  const std::vector<Entry> t = model_table(s);
  size_t checked = 0;
  for (size_t i = 0; i + 1 < t.size(); ++i) {
    const double mid_d = 0.5 * (t[i].value + t[i + 1].value);
    const float mid = static_cast<float>(mid_d);
    ASSERT_EQ(static_cast<double>(mid), mid_d) << s.name << ": midpoint not a float";
    const uint32_t even = t[i].code % 2 == 0 ? t[i].code : t[i + 1].code;
    for (bool neg : {false, true}) {
      const float sg = neg ? -1.f : 1.f;
      EXPECT_EQ(s.enc(sg * mid), finish(s, t, even, neg)) << s.name << " midpoint " << describe(sg * mid);
      const float above = std::nextafter(mid, std::numeric_limits<float>::infinity());
      const float below = std::nextafter(mid, 0.f);
      EXPECT_EQ(s.enc(sg * above), finish(s, t, t[i + 1].code, neg)) << s.name << " above midpoint " << describe(sg * above);
      EXPECT_EQ(s.enc(sg * below), finish(s, t, t[i].code, neg)) << s.name << " below midpoint " << describe(sg * below);
      // Each value itself, and one float ulp around it, stays on its code.
      const float v = static_cast<float>(t[i].value);
      EXPECT_EQ(s.enc(sg * v), finish(s, t, t[i].code, neg)) << s.name << " value " << describe(sg * v);
      if (t[i].value > 0) {
        EXPECT_EQ(s.enc(sg * std::nextafter(v, 0.f)), finish(s, t, t[i].code, neg)) << s.name;
        EXPECT_EQ(s.enc(sg * std::nextafter(v, 1e30f)), finish(s, t, t[i].code, neg)) << s.name;
      }
      checked += 6;
    }
  }
  EXPECT_GE(checked, 6 * (t.size() - 1));
}

TEST_P(FormatTest, InfinityNaNZeroAndOverflow) {
  const Spec& s = GetParam();
  const std::vector<Entry> t = model_table(s);
  const uint32_t top = max_code(s), sb = s.sign_bit();
  const uint32_t over = s.overflow == Overflow::satfinite ? top : inf_code(s);
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(s.enc(inf), over) << s.name;
  EXPECT_EQ(s.enc(-inf), sb | over) << s.name;
  EXPECT_EQ(s.enc(FLT_MAX), over) << s.name;
  EXPECT_EQ(s.enc(-FLT_MAX), sb | over) << s.name;
  const float maxv = static_cast<float>(t.end()[-2].value);
  // bf16's virtual next value is 2^128, past float32: infinity stands in for it.
  const float virt = t.back().value > FLT_MAX ? inf : static_cast<float>(t.back().value);
  EXPECT_EQ(s.enc(std::nextafter(maxv, inf)), top) << s.name << " just above max rounds to max";
  EXPECT_EQ(s.enc(-std::nextafter(maxv, inf)), sb | top) << s.name;
  EXPECT_EQ(s.enc(virt), over) << s.name << " one step past max";
  EXPECT_EQ(s.enc(2 * virt), over) << s.name;
  // NaNs of both signs, quiet and signalling, with payloads: one canonical code.
  for (uint32_t nb : {0x7FC00000u, 0xFFC00000u, 0x7F800001u, 0xFF800001u, 0x7FBFFFFFu, 0x7FFFFFFFu,
                      0xFFFFFFFFu, 0x7FC00001u, 0x7F801000u})
    EXPECT_EQ(s.enc(float_of(nb)), s.canonical_nan) << s.name << " NaN bits " << hex(nb);
  EXPECT_EQ(s.enc(0.f), 0u) << s.name;
  EXPECT_EQ(s.enc(-0.f), sb) << s.name << " -0 keeps its sign";
}

TEST_P(FormatTest, SubnormalsAndUnderflow) {
  const Spec& s = GetParam();
  const std::vector<Entry> t = model_table(s);
  const uint32_t sb = s.sign_bit();
  const float min_sub = static_cast<float>(t[1].value);
  ASSERT_EQ(t[1].code, 1u);
  EXPECT_EQ(s.enc(min_sub), 1u) << s.name;
  EXPECT_EQ(s.enc(-min_sub), sb | 1u) << s.name;
  EXPECT_EQ(s.enc(min_sub / 2), 0u) << s.name << " half the smallest subnormal ties to 0";
  EXPECT_EQ(s.enc(-min_sub / 2), sb) << s.name;
  EXPECT_EQ(s.enc(std::nextafter(min_sub / 2, 1.f)), 1u) << s.name;
  EXPECT_EQ(s.enc(std::nextafter(min_sub / 2, 0.f)), 0u) << s.name;
  EXPECT_EQ(s.enc(min_sub / 4), 0u) << s.name;
  EXPECT_EQ(s.enc(-min_sub / 4), sb) << s.name << " a negative underflow is -0";
  EXPECT_EQ(s.enc(FLT_MIN), s.E == 8 ? model_encode(s, t, FLT_MIN) : 0u) << s.name;
  EXPECT_EQ(s.enc(std::numeric_limits<float>::denorm_min()), 0u) << s.name;
  EXPECT_EQ(s.enc(-std::numeric_limits<float>::denorm_min()), sb) << s.name;
  // The subnormal/normal boundary: the largest subnormal and the smallest normal.
  const uint32_t first_normal = 1u << s.M;
  EXPECT_EQ(s.enc(static_cast<float>(t[first_normal - 1].value)), first_normal - 1) << s.name;
  EXPECT_EQ(s.enc(static_cast<float>(t[first_normal].value)), first_normal) << s.name;
}

// Two million floats (every float with 11 high mantissa bits, plus random bit patterns)
// against the brute-force nearest search.
TEST_P(FormatTest, DenseSweepMatchesNearestValue) {
  const Spec& s = GetParam();
  const std::vector<Entry> t = model_table(s);
  size_t failures = 0;
  for (float x : all_sweeps()) {
    const uint32_t want = model_encode(s, t, x);
    const uint32_t got = s.enc(x);
    if (got != want && ++failures <= 10)
      ADD_FAILURE() << s.name << " encode " << describe(x) << ": got " << hex(got) << ", want " << hex(want);
  }
  EXPECT_EQ(failures, 0u) << s.name;
}

INSTANTIATE_TEST_SUITE_P(AllFormats, FormatTest, ::testing::ValuesIn(specs()),
                         [](const ::testing::TestParamInfo<Spec>& i) { return i.param.name; });
INSTANTIATE_TEST_SUITE_P(AllFormats, DecoderTest, ::testing::ValuesIn(specs_with_decoder()),
                         [](const ::testing::TestParamInfo<Spec>& i) { return i.param.name; });

// ---- format-specific facts -------------------------------------------------------------

TEST(Formats, KnownValues) {
  using namespace sage::fmt;
  EXPECT_EQ(e4m3_decode(0x7E), 448.f);
  EXPECT_EQ(e4m3_decode(0x01), std::ldexp(1.f, -9));
  EXPECT_EQ(e4m3_decode(0x38), 1.f);
  EXPECT_EQ(e4m3_encode(1.f), 0x38);
  EXPECT_EQ(e5m2_decode(0x7B), 57344.f);
  EXPECT_EQ(e5m2_decode(0x01), std::ldexp(1.f, -16));
  EXPECT_EQ(e5m2_decode(0x7C), std::numeric_limits<float>::infinity());
  EXPECT_EQ(e5m2_decode(0xFC), -std::numeric_limits<float>::infinity());
  const float e2m1_values[8] = {0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f};
  for (uint8_t c = 0; c < 8; ++c) {
    EXPECT_EQ(e2m1_decode(c), e2m1_values[c]);
    EXPECT_EQ(e2m1_decode(c | 8), -e2m1_values[c]);
  }
  // Ties go to the even mantissa: 2.5 -> 2, 3.5 -> 4, 5 -> 4, 0.75 -> 1, 1.25 -> 1.
  EXPECT_EQ(e2m1_encode(2.5f), 0x4);
  EXPECT_EQ(e2m1_encode(3.5f), 0x6);
  EXPECT_EQ(e2m1_encode(5.f), 0x6);
  EXPECT_EQ(e2m1_encode(0.75f), 0x2);
  EXPECT_EQ(e2m1_encode(1.25f), 0x2);
  EXPECT_EQ(e2m1_encode(-5.f), 0xE);
  EXPECT_EQ(e4m3_encode(464.f), 0x7E);  // the tie past 448 would be 480: saturates
  EXPECT_EQ(fmt::fp16_bits(65520.f), 0x7C00);
  EXPECT_EQ(fmt::fp16_bits(65519.996f), 0x7BFF);
  EXPECT_EQ(fmt::round_fp16_satfinite(1e9f), 65504.f);
  EXPECT_EQ(fmt::round_fp16_satfinite(-std::numeric_limits<float>::infinity()), -65504.f);
  EXPECT_TRUE(std::isnan(fmt::round_fp16_satfinite(std::nanf(""))));
  EXPECT_TRUE(std::isnan(fmt::round_bf16(float_of(0x7F800001u))));  // must not become inf
  EXPECT_TRUE(std::isnan(fmt::round_fp16(float_of(0x7F800001u))));
}

// Only the low nibble of an e2m1 byte is read, so both halves of an e2m1x2 byte decode alike.
TEST(Formats, E2M1DecodeIgnoresHighNibble) {
  for (uint32_t c = 0; c < 256; ++c)
    EXPECT_EQ(bits_of(fmt::e2m1_decode(static_cast<uint8_t>(c))),
              bits_of(fmt::e2m1_decode(static_cast<uint8_t>(c & 0xF))))
        << hex(c);
}

// ---- E8M0 -------------------------------------------------------------------------------

TEST(E8M0, DecodeEveryCode) {
  for (uint32_t c = 0; c < 256; ++c) {
    const float got = fmt::e8m0_decode(static_cast<uint8_t>(c));
    if (c == 255) {
      EXPECT_TRUE(std::isnan(got));
      continue;
    }
    EXPECT_EQ(static_cast<double>(got), std::ldexp(1.0, static_cast<int>(c) - 127)) << c;
  }
}

TEST(E8M0, EveryCodeRoundTrips) {
  for (uint32_t c = 0; c < 256; ++c)
    EXPECT_EQ(fmt::e8m0_encode(fmt::e8m0_decode(static_cast<uint8_t>(c))), c) << c;
}

// The model: floor(log2 x) from the double's exponent, clamped to [-127, 127].
uint32_t model_e8m0(float x) {
  if (std::isnan(x)) return 255;
  if (!(x > 0)) return 0;
  if (std::isinf(x)) return 254;
  const int e = std::ilogb(static_cast<double>(x));
  return static_cast<uint32_t>(std::clamp(e + 127, 0, 254));
}

TEST(E8M0, EncodeRoundsExponentDown) {
  for (uint32_t c = 1; c < 255; ++c) {
    const float v = fmt::e8m0_decode(static_cast<uint8_t>(c));
    EXPECT_EQ(fmt::e8m0_encode(v * 1.5f), c) << c;
    EXPECT_EQ(fmt::e8m0_encode(std::nextafter(v, 0.f)), c - 1) << c;
    EXPECT_EQ(fmt::e8m0_encode(std::nextafter(v, std::numeric_limits<float>::infinity())), c) << c;
    if (c < 254) {
      EXPECT_EQ(fmt::e8m0_encode(std::nextafter(2 * v, 0.f)), c) << c;
    }
  }
}

TEST(E8M0, SpecialInputs) {
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(fmt::e8m0_encode(std::nanf("")), 0xFF);
  EXPECT_EQ(fmt::e8m0_encode(-std::nanf("")), 0xFF);
  EXPECT_EQ(fmt::e8m0_encode(inf), 0xFE);
  EXPECT_EQ(fmt::e8m0_encode(FLT_MAX), 0xFE);
  EXPECT_EQ(fmt::e8m0_encode(0.f), 0x00);
  EXPECT_EQ(fmt::e8m0_encode(-0.f), 0x00);
  EXPECT_EQ(fmt::e8m0_encode(-1.f), 0x00);
  EXPECT_EQ(fmt::e8m0_encode(-inf), 0x00);
  EXPECT_EQ(fmt::e8m0_encode(std::numeric_limits<float>::denorm_min()), 0x00);
  EXPECT_EQ(fmt::e8m0_encode(1.f), 127);
}

TEST(E8M0, DenseSweepMatchesModel) {
  size_t failures = 0;
  for (float x : all_sweeps()) {
    const uint32_t got = fmt::e8m0_encode(x), want = model_e8m0(x);
    if (got != want && ++failures <= 10)
      ADD_FAILURE() << "e8m0_encode " << describe(x) << ": got " << got << ", want " << want;
  }
  EXPECT_EQ(failures, 0u);
}

uint32_t model_mx_scale(float amax, int emax) {
  if (std::isnan(amax)) return 255;
  if (!(amax > 0)) return 0;
  if (std::isinf(amax)) return 255;
  const int e = std::ilogb(static_cast<double>(amax)) - emax;
  return static_cast<uint32_t>(std::clamp(e + 127, 0, 254));
}

TEST(E8M0, MxScaleMatchesOcpRule) {
  size_t failures = 0;
  for (int emax : {0, 2, 8, 15}) {
    for (float x : all_sweeps()) {
      const uint32_t got = fmt::e8m0_mx_scale(x, emax), want = model_mx_scale(x, emax);
      if (got != want && ++failures <= 10)
        ADD_FAILURE() << "e8m0_mx_scale(" << describe(x) << ", " << emax << "): got " << got
                      << ", want " << want;
    }
  }
  EXPECT_EQ(failures, 0u);
}

TEST(E8M0, MxScaleSpecialsAndRange) {
  EXPECT_EQ(fmt::e8m0_mx_scale(0.f, 2), 0x00);
  EXPECT_EQ(fmt::e8m0_mx_scale(-0.f, 2), 0x00);
  EXPECT_EQ(fmt::e8m0_mx_scale(std::nanf(""), 2), 0xFF);
  EXPECT_EQ(fmt::e8m0_mx_scale(std::numeric_limits<float>::infinity(), 2), 0xFF);
  EXPECT_EQ(fmt::e8m0_mx_scale(6.f, 2), 127);   // 6 = 1.5 * 2^2: scale 1, and 6 fits E2M1
  EXPECT_EQ(fmt::e8m0_mx_scale(8.f, 2), 128);   // 8 / 2 = 4
  EXPECT_EQ(fmt::e8m0_mx_scale(7.99f, 2), 127); // 7.99 saturates to 6 under scale 1 (the OCP rule)
  EXPECT_EQ(fmt::e8m0_mx_scale(FLT_MAX, 2), 252);
  EXPECT_EQ(fmt::e8m0_mx_scale(std::numeric_limits<float>::denorm_min(), 2), 0);
  // Where no clamping happens, amax / X lands in [2^emax, 2^(emax+1)).
  for (float amax : {1e-30f, 3e-5f, 0.7f, 1.f, 5.9f, 6.f, 100.f, 3e20f}) {
    const float q = amax / fmt::e8m0_decode(fmt::e8m0_mx_scale(amax, 2));
    EXPECT_GE(q, 4.f) << amax;
    EXPECT_LT(q, 8.f) << amax;
  }
}

// ---- FP22 truncation ------------------------------------------------------------------------

float model_fp22(float x) {
  if (std::isnan(x) || std::isinf(x) || x == 0) return x;
  const double a = std::fabs(static_cast<double>(x));
  const int e = std::max(std::ilogb(a), -126);  // float32 subnormals share the 2^-126 binade's ulp
  const double ulp = std::ldexp(1.0, e - 13);
  const double r = std::floor(a / ulp) * ulp;
  return static_cast<float>(std::signbit(x) ? -r : r);
}

TEST(FP22, SweepMatchesTruncationModel) {
  size_t failures = 0;
  auto check = [&](float x) {
    const float got = fmt::truncate_fp22(x), want = model_fp22(x);
    const bool same = std::isnan(want) ? std::isnan(got) : bits_of(got) == bits_of(want);
    if (!same && ++failures <= 10)
      ADD_FAILURE() << "truncate_fp22 " << describe(x) << ": got " << describe(got) << ", want "
                    << describe(want);
  };
  for (float x : all_sweeps()) check(x);
  // Every pattern of the 10 dropped bits and the lowest kept bit, over many exponents.
  for (uint32_t e = 0; e < 256; e += 3)
    for (uint32_t low = 0; low < 2048; ++low)
      for (uint32_t sign : {0u, 0x80000000u}) check(float_of(sign | (e << 23) | 0x2A000u | low));
  EXPECT_EQ(failures, 0u);
}

TEST(FP22, Specials) {
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(fmt::truncate_fp22(inf), inf);
  EXPECT_EQ(fmt::truncate_fp22(-inf), -inf);
  EXPECT_TRUE(std::isnan(fmt::truncate_fp22(float_of(0x7F800001u))));  // payload only in dropped bits
  EXPECT_TRUE(std::isnan(fmt::truncate_fp22(float_of(0xFF8003FFu))));
  EXPECT_EQ(bits_of(fmt::truncate_fp22(-0.f)), 0x80000000u);
  EXPECT_EQ(fmt::truncate_fp22(1.f + std::ldexp(1.f, -13)), 1.f + std::ldexp(1.f, -13));
  EXPECT_EQ(fmt::truncate_fp22(1.f + std::ldexp(1.f, -14)), 1.f);
  EXPECT_EQ(fmt::truncate_fp22(-(1.f + std::ldexp(1.f, -14))), -1.f);  // toward zero
}

// ---- quant_rules.h ----------------------------------------------------------------------

TEST(QuantRules, SymmetricScale) {
  EXPECT_EQ(rules::symmetric_scale(127.f, 127.f), 1.f);
  EXPECT_EQ(rules::symmetric_scale(254.f, 127.f), 2.f);
  EXPECT_EQ(rules::symmetric_scale(0.f, 127.f), 0.f);
  EXPECT_EQ(rules::symmetric_scale(448.f, 448.f), 1.f);
  EXPECT_EQ(rules::symmetric_scale(3.f, 7.f), 3.f / 7.f);
}

TEST(QuantRules, SymmetricInverse) {
  EXPECT_EQ(rules::symmetric_inverse(0.f, 127.f), 0.f) << "an all-zero group must not give inf";
  EXPECT_EQ(rules::symmetric_inverse(-0.f, 127.f), 0.f);
  EXPECT_EQ(rules::symmetric_inverse(2.f, 127.f), 63.5f);
  EXPECT_EQ(rules::symmetric_inverse(127.f, 127.f), 1.f);
  // The codes of an all-zero group are 0, never NaN.
  EXPECT_EQ(rules::round_clamp(0.f * rules::symmetric_inverse(0.f, 127.f), 127), 0);
}

TEST(QuantRules, RoundClampTiesToEven) {
  const struct { float x; int want; } cases[] = {
      {0.5f, 0},   {1.5f, 2},   {2.5f, 2},     {3.5f, 4},   {-0.5f, 0},   {-1.5f, -2},
      {-2.5f, -2}, {0.49999997f, 0}, {0.50000006f, 1}, {126.5f, 126}, {125.5f, 126}, {-126.5f, -126},
      {126.6f, 127}, {127.f, 127}, {127.5f, 127}, {1e9f, 127}, {-1e9f, -127}, {-127.5f, -127},
      {-128.f, -127},
  };
  for (const auto& c : cases) EXPECT_EQ(rules::round_clamp(c.x, rules::kInt8Max), c.want) << c.x;
  EXPECT_EQ(rules::round_clamp(6.5f, rules::kInt4Max), 6);
  EXPECT_EQ(rules::round_clamp(7.5f, rules::kInt4Max), 7);
  EXPECT_EQ(rules::round_clamp(-8.f, rules::kInt4Max), -7);
  EXPECT_EQ(rules::round_clamp(std::numeric_limits<float>::infinity(), 127), 127);
  EXPECT_EQ(rules::round_clamp(-std::numeric_limits<float>::infinity(), 127), -127);
  // Every half-integer in range: ties go to the even neighbour.
  for (int i = -127; i < 127; ++i) {
    const float x = static_cast<float>(i) + 0.5f;
    const int want = (i % 2 == 0) ? i : i + 1;
    EXPECT_EQ(rules::round_clamp(x, 127), want) << x;
  }
}

TEST(QuantRules, ScoreMultiplierOrder) {
  const float q = 0.37f, k = 1.9f, sm = 0.125f;
  const float log2 = rules::sm_scale_log2(sm);
  EXPECT_EQ(log2, sm * rules::kLog2e);
  EXPECT_EQ(rules::score_multiplier(q, k, log2), (q * k) * log2);
}

}  // namespace
