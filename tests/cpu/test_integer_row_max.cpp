// The integer row max path of the simulator (rules::integer_row_max; docs/numerics.md, steps
// 4 and 6): which recipes take it, that it is the contract's float operations exactly (P's
// scale in the exponent included), how far it may move P~ from the logit path's
// exp2f(float(acc) * mult - m), the exact zero of the row max's exponent (also near the fp16
// limit), partial tiles, and that simulate() uses it.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <set>
#include <string>
#include <vector>

#include "reference/online_softmax.h"
#include "reference/qk_quantize.h"
#include "reference/rounding.h"
#include "reference/synthetic.h"
#include "sage/attention.h"
#include "numerics/formats.h"
#include "numerics/quant_rules.h"
#include "numerics/tile.h"

namespace sage {
namespace {

namespace sim = reference::sim;

constexpr float kInf = std::numeric_limits<float>::infinity();

// Half the spacing of floats just above |z|: a round-to-nearest result z is within this of
// the exact value it rounded.
double half_ulp(float z) {
  const float a = std::fabs(z);
  return 0.5 * (static_cast<double>(std::nextafter(a, kInf)) - a);
}

// The presets that take the integer row max: INT8 Q/K from floating inputs with a scale per
// tile (or finer, but not per token) and no Q smoothing (docs/numerics.md, step 4).
const std::set<std::string>& integer_max_presets() {
  static const std::set<std::string> names = {"sage1_b",          "sage1_vb",          "sage2_8b",
                                              "sage2_8b_vsmooth", "sage2_8b_balanced", "sage2pp_8b",
                                              "sagebwd",          "sagebwd_block"};
  return names;
}

// Q and K of one head quantized as recipe r's QK stage does (K smoothing included).
struct Operands {
  sim::QKOperand q, k;
  float sl2 = 0.f;
  int64_t nq = 0, nkv = 0;
  // What the path's exp2 yields P~ times: P's scale where it is in the exponent
  // (rules::p_scale_in_exponent), else 1.
  float p_scale = 1.f;
  rules::PScaleFold fold;  // of p_scale
};
Operands quantize(const Recipe& r, std::vector<float> q, std::vector<float> k, int64_t nq,
                  int64_t nkv, int64_t d) {
  const TileConfig tc = tile_config(static_cast<int>(d));
  if (r.smooth_k) {
    const std::vector<float> mean = sim::channel_mean(k.data(), nkv, d);
    sim::subtract_channel_mean(k.data(), nkv, d, mean.data());
  }
  Operands x;
  x.q = sim::quantize_qk(q.data(), nq, d, r.qk_format, r.qk_granularity, /*is_q=*/true, tc);
  x.k = sim::quantize_qk(k.data(), nkv, d, r.qk_format, r.qk_granularity, /*is_q=*/false, tc);
  x.sl2 = rules::sm_scale_log2(static_cast<float>(1.0 / std::sqrt(static_cast<double>(d))));
  x.nq = nq;
  x.nkv = nkv;
  x.p_scale = rules::p_scale_in_exponent(r) ? rules::p_static_max(r) : 1.f;
  x.fold = rules::p_scale_fold(x.p_scale, static_cast<int>(d));
  return x;
}

std::vector<float> normals(int64_t n, double sigma, uint64_t seed) {
  reference::Rng rng(seed);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = static_cast<float>(sigma * rng.normal());
  return v;
}

// One row's visit of one KV tile, through both paths, with the contract's intermediate values
// recomputed here independently of the library.
struct Tile {
  int64_t i = 0, j0 = 0, count = 0;
  float m_before = -kInf;            // the row max before the tile
  float m_old = 0.f, m_new = 0.f;    // after it: logit path, integer path
  float alpha_old = 0.f, alpha_new = 0.f;
  std::vector<int32_t> acc;
  std::vector<float> mult, s2, p_old;
  std::vector<float> p_new;  // P~ * p_scale (the path's output; the logit path's p_old is P~)
  bool present[kKThreadGroups] = {};
  int32_t amax[kKThreadGroups] = {};
  float gmult[kKThreadGroups] = {}, tmax[kKThreadGroups] = {}, gap[kKThreadGroups] = {},
        c[kKThreadGroups] = {};
  // P's scale in the exponent: k = log2(p_scale) as a float, and whether group g took it
  // in its offset (rules::p_scale_folds) or adds it to each exponent.
  bool folded[kKThreadGroups] = {};
  float k = 0.f, p_scale = 1.f;
  std::vector<float> x_ref;     // the exponent argument before k: fl(f * mult + c)
  std::vector<float> x_scaled;  // with k: fl(f * mult + fl(c + k)) folded, fl(x_ref + k) not
  std::vector<bool> x_by_double;  // x_ref came from the exact double sum, not from std::fma
  static int group(int64_t j) { return static_cast<int>((j % 8) / 2); }
  // The contract's P~ * p_scale of key j.
  float p_ref(int64_t j) const { return std::exp2(x_scaled[static_cast<size_t>(j)]); }
  // The exponent in P~'s own units, x_scaled - log2(p_scale), in double.
  double x_new(int64_t j) const {
    return static_cast<double>(x_scaled[static_cast<size_t>(j)]) - std::log2(static_cast<double>(p_scale));
  }
  // How far the float k is from log2(p_scale) (0 for a power of two).
  double k_error() const { return std::fabs(k - std::log2(static_cast<double>(p_scale))); }
};

// f * mult + c rounded once to float: exactly in double where that holds, else std::fma.
// mult = M 2^(e-23) with M < 2^24; f * mult is a multiple of 2^(e-23), and so is c when
// |c| >= 2^24 mult >= 2^(e+24) (a float; so is c + k where k is an integer that ulp(c)
// divides). With |c| < 2^25 mult the sum is below 2^(e+27): at most 50 bits, exact in
// double, so its one rounding to float is the fused multiply-add's.
float fma_once(float f, float mult, float c, bool* by_double) {
  *by_double = std::fabs(static_cast<double>(c)) < 33554432.0 * mult;
  return *by_double ? static_cast<float>(static_cast<double>(f) * mult + c) : std::fma(f, mult, c);
}

// Visits every row (causal: bottom-right aligned) and every tile it sees, in order. Without
// `integer_path` (a recipe the rule excludes) only the logit path runs and the *_new fields
// repeat the old ones.
template <class F>
void for_each_tile(const Operands& x, bool causal, F&& f, bool integer_path = true) {
  const int64_t block = tile_config(static_cast<int>(x.q.d)).block_kv;
  for (int64_t i = 0; i < x.nq; ++i) {
    const int64_t visible = causal ? std::clamp<int64_t>(i + x.nkv - x.nq + 1, 0, x.nkv) : x.nkv;
    sim::RowState st_old, st_new;
    for (int64_t j0 = 0; j0 < visible; j0 += block) {
      Tile t;
      t.i = i;
      t.j0 = j0;
      t.count = std::min<int64_t>(block, visible - j0);
      const size_t n = static_cast<size_t>(t.count);
      t.acc.resize(n);
      t.mult.resize(n);
      t.s2.resize(n);
      t.p_old.resize(n);
      t.p_new.resize(n);
      t.m_before = st_new.m;
      sim::qk_logits(x.q, i, x.k, j0, t.count, x.sl2, t.s2.data());
      sim::qk_int_accumulators(x.q, i, x.k, j0, t.count, x.sl2, t.acc.data(), t.mult.data());
      t.alpha_old = sim::softmax_enter_tile(st_old, t.s2.data(), t.count, t.p_old.data());
      t.m_old = st_old.m;
      if (!integer_path) {
        t.alpha_new = t.alpha_old;
        t.m_new = t.m_old;
        t.p_new = t.p_old;
        f(t);
        continue;
      }
      t.alpha_new = sim::softmax_enter_tile_integer_max(st_new, t.acc.data(), t.mult.data(),
                                                        t.count, x.fold, t.p_new.data());
      t.m_new = st_new.m;
      // The contract, step by step (this file is compiled with -ffp-contract=off).
      for (int64_t j = 0; j < t.count; ++j) {
        const int g = Tile::group(j);
        if (!t.present[g]) {
          t.present[g] = true;
          t.amax[g] = t.acc[j];
          t.gmult[g] = t.mult[j];
        }
        t.amax[g] = std::max(t.amax[g], t.acc[j]);
        EXPECT_EQ(t.mult[j], t.gmult[g]) << "row " << i << " key " << j0 + j;
      }
      for (int g = 0; g < kKThreadGroups; ++g) {
        if (!t.present[g]) continue;
        t.tmax[g] = static_cast<float>(t.amax[g]) * t.gmult[g];
        t.gap[g] = t.tmax[g] - t.m_new;
        t.c[g] = t.gap[g] - t.gmult[g] * 16777216.f;  // 2^24 mult, exact
        // Where the rule folds k into c and c <= -k, c + k is exact (checked in double).
        t.k = x.fold.k;
        t.p_scale = x.p_scale;
        t.folded[g] = rules::p_scale_folds(t.gmult[g], x.fold.mult_limit);
        if (t.folded[g] && t.c[g] <= -t.k)
          EXPECT_EQ(static_cast<double>(t.c[g] + t.k), static_cast<double>(t.c[g]) + t.k);
      }
      t.x_ref.resize(n);
      t.x_scaled.resize(n);
      t.x_by_double.resize(n);
      for (int64_t j = 0; j < t.count; ++j) {
        const int g = Tile::group(j);
        const float fj = static_cast<float>(16777216 + (t.acc[j] - t.amax[g]));
        bool by_double = false;
        t.x_ref[j] = fma_once(fj, t.gmult[g], t.c[g], &by_double);
        t.x_by_double[j] = by_double;
        t.x_scaled[j] = t.folded[g] ? fma_once(fj, t.gmult[g], t.c[g] + t.k, &by_double)
                                    : t.x_ref[j] + t.k;
      }
      f(t);
    }
  }
}

// ---- the rule -------------------------------------------------------------------------------

TEST(SimIntegerRowMax, RuleSelectsIntegerCodesWithPerTileScalesAndNoQSmoothing) {
  for (const Recipe& r : presets()) {
    EXPECT_EQ(rules::integer_row_max(r), integer_max_presets().count(r.name) == 1) << r.name;
    // P's scale in the exponent: the integer row max on the two-level E4M3 path only.
    EXPECT_EQ(rules::p_scale_in_exponent(r), r.name == "sage2_8b" || r.name == "sage2_8b_vsmooth" ||
                                                   r.name == "sage2_8b_balanced")
        << r.name;
  }
  Recipe r = preset("sage2_8b");
  for (Granularity g : {Granularity::per_tensor, Granularity::per_block, Granularity::per_warp,
                        Granularity::per_thread}) {
    r.qk_granularity = g;
    EXPECT_TRUE(rules::integer_row_max(r)) << to_string(g);
  }
  r.qk_granularity = Granularity::per_token;
  EXPECT_FALSE(rules::integer_row_max(r));
  Recipe four = preset("sage2_4b");  // INT4 codes: the rule holds once Q smoothing is off
  EXPECT_FALSE(rules::integer_row_max(four));
  four.smooth_q = false;
  EXPECT_TRUE(rules::integer_row_max(four));
  Recipe e4m3 = preset("sage2_8b");
  e4m3.qk_format = QKFormat::e4m3;
  EXPECT_FALSE(rules::integer_row_max(e4m3));
  Recipe pre = preset("int_flash");
  EXPECT_FALSE(rules::integer_row_max(pre));
  pre.qk_granularity = Granularity::per_thread;  // not a valid recipe; the inputs alone decide
  EXPECT_FALSE(rules::integer_row_max(pre));
}

// std::fma must be a fused multiply-add (one rounding), not a multiply and an add.
TEST(SimIntegerRowMax, FmaRoundsOnce) {
  volatile float a = 1.f + 0x1p-12f, c = -(1.f + 0x1p-11f);
  // (1 + 2^-12)^2 = 1 + 2^-11 + 2^-24: unfused, the product rounds to 1 + 2^-11 and gives 0.
  EXPECT_EQ(std::fma(static_cast<float>(a), static_cast<float>(a), static_cast<float>(c)), 0x1p-24f);
  EXPECT_EQ(static_cast<float>(a) * static_cast<float>(a) + static_cast<float>(c), 0.f);
}

// P's scale in the exponent (rules::p_scale_fold, p_scale_folds; docs/numerics.md step 6):
// at head dim 128 a power-of-two scale 2^k, k >= 0, joins the offset of groups whose
// multiplier is below 2^tz(k), where c + k is exact for the row max's group; any other scale,
// and any scale at head dim 64, only has its (rounded) log2 added after.
TEST(SimIntegerRowMax, PScaleInTheExponentRule) {
  struct Case { float scale; int d; float k, mult_limit; };
  for (const Case& e : {Case{256.f, 128, 8.f, 8.f}, Case{1.f, 128, 0.f, kInf},
                        Case{64.f, 128, 6.f, 2.f}, Case{32768.f, 128, 15.f, 1.f},
                        Case{448.f, 128, std::log2(448.f), 0.f}, Case{127.f, 128, std::log2(127.f), 0.f},
                        Case{112.f, 128, std::log2(112.f), 0.f}, Case{0.5f, 128, -1.f, 0.f},
                        Case{256.f, 64, 8.f, 0.f}, Case{1.f, 64, 0.f, 0.f}}) {
    const rules::PScaleFold f = rules::p_scale_fold(e.scale, e.d);
    EXPECT_EQ(f.k, e.k) << e.scale << " d " << e.d;
    EXPECT_EQ(f.mult_limit, e.mult_limit) << e.scale << " d " << e.d;
  }
  const rules::PScaleFold f = rules::p_scale_fold(256.f, 128);
  // The row max's group: c = -2^24 mult. Folded below mult = 8, and c + 8 exact from 2^-21
  // up; above 8 (ulp(c) = 16) it would round.
  for (float mult : {0x1p-21f, 1e-4f, 0.37f, 7.99f, std::nextafter(8.f, 0.f)}) {
    const float c = -mult * 16777216.f;
    ASSERT_TRUE(rules::p_scale_folds(mult, f.mult_limit)) << mult;
    EXPECT_EQ(static_cast<double>(c + f.k), static_cast<double>(c) + f.k) << mult;
  }
  EXPECT_TRUE(rules::p_scale_folds(1e-9f, f.mult_limit));  // c > -8: c + 8 rounds, by < 2^-21
  for (float mult : {8.f, 9.f, 1000.f}) EXPECT_FALSE(rules::p_scale_folds(mult, f.mult_limit)) << mult;
  const float c9 = -9.f * 16777216.f;  // mult = 9
  EXPECT_NE(static_cast<double>(c9 + 8.f), static_cast<double>(c9) + 8.0);
  // Through the path: one group at mult = 1e-3 (folded) and one at mult = 16 (not: c =
  // -2^28 - 32 takes 8 after the fused multiply-add), with gaps that c holds exactly.
  const float small = 1e-3f;
  const int32_t acc[4] = {0, -10, -2, -4};
  const float mult[4] = {small, small, 16.f, 16.f};
  float ps[4];
  sim::RowState st;
  sim::softmax_enter_tile_integer_max(st, acc, mult, 4, f, ps);
  ASSERT_EQ(st.m, 0.f);
  EXPECT_EQ(ps[0], 256.f);  // the row max: P~ = 1
  EXPECT_EQ(ps[1], std::exp2(static_cast<float>(-10.0 * small + 8.0)));
  EXPECT_EQ(ps[2], std::exp2(-32.f + 8.f));
  EXPECT_EQ(ps[3], std::exp2(-64.f + 8.f));
  // A scale that is no power of two adds its rounded log2 to every exponent.
  const rules::PScaleFold g = rules::p_scale_fold(112.f, 128);
  sim::RowState st2;
  sim::softmax_enter_tile_integer_max(st2, acc, mult, 4, g, ps);
  EXPECT_EQ(ps[0], std::exp2(0.f + g.k));
  EXPECT_EQ(ps[1], std::exp2(std::fma(16777216.f - 10.f, small, -small * 16777216.f) + g.k));
}

// ---- the path against the contract and against the logit path --------------------------

// For every rule-true preset (and INT4 without Q smoothing) on random rows, full and causal:
//  * m and alpha are bit-identical to the logit path's;
//  * P~ * p_scale is exp2f of the contract's x_j' (P's scale in the exponent), recomputed here:
//    fl(f_j mult + fl(c + k)) for a folded group (the fused multiply-add exactly, in double,
//    where |c| < 2^25 mult; else with std::fma), fl(fl(f_j mult + c) + k) for any other;
//  * x_new = x_j' - log2(p_scale) and x_old = fl(fl(acc * mult) - m) both lie within a sum of
//    half-ulps of the exact acc * mult - m, so |x_new - x_old| <= h(tmax) + h(tmax - m) + h(c)
//    + h(c + k) + h(x_j') + [h(x_j) not folded] + h(S2) + h(x_old) + |k - log2(p_scale)|, and
//    in mult units (d = 128: |acc| < 2^21, h(tmax), h(S2) <= mult / 8; h(c) <= 2^-24 |c| <=
//    mult + 2^-24 |tmax - m|): |x_new - x_old| <= 1.25 mult + 2^-24 (2 |tmax - m| + 2 |k| +
//    |x_j'| + |x_j| + |x_old|) + |k - log2(p_scale)|;
//  * P~ * p_scale then agrees with the logit path's within the factor 2^|x_new - x_old| and
//    exp2f's last-bit error.
TEST(SimIntegerRowMax, MatchesTheContractAndStaysWithinItsBoundOfTheLogitPath) {
  std::vector<Recipe> recipes;
  for (const Recipe& r : presets())
    if (integer_max_presets().count(r.name)) recipes.push_back(r);
  Recipe four = preset("sage2_4b");
  four.smooth_q = false;
  recipes.push_back(four);
  const int64_t d = 128, nq = 96, nkv = 2 * 128 + 113;  // a partial last tile of 113 keys
  for (const Recipe& r : recipes) {
    // K with a channel bias (what K smoothing is for) and per-key spread, so that the four
    // thread groups of a tile get different scales.
    std::vector<float> k = normals(nkv * d, 1.0, 11);
    const std::vector<float> bias = normals(d, 3.0, 12);
    for (int64_t t = 0; t < nkv; ++t)
      for (int64_t c = 0; c < d; ++c) k[t * d + c] = k[t * d + c] * (1.f + (t % 8) * 0.25f) + bias[c];
    const Operands x = quantize(r, normals(nq * d, 1.5, 10), k, nq, nkv, d);
    int64_t keys = 0, differ = 0, by_double = 0, groups = 0, folded = 0;
    double worst_units = 0;  // max |x_new - x_old| / mult over keys with P~ >= 2^-24
    for (bool causal : {false, true}) {
      for_each_tile(x, causal, [&](const Tile& t) {
        ASSERT_EQ(reference::float_bits(t.m_new), reference::float_bits(t.m_old))
            << r.name << " row " << t.i << " tile " << t.j0;
        ASSERT_EQ(reference::float_bits(t.alpha_new), reference::float_bits(t.alpha_old))
            << r.name << " row " << t.i << " tile " << t.j0;
        if (t.j0 == 0) ASSERT_EQ(t.alpha_new, 0.f);
        for (int g = 0; g < kKThreadGroups; ++g) {
          groups += t.present[g];
          folded += t.folded[g];
        }
        for (int64_t j = 0; j < t.count; ++j) {
          const int g = Tile::group(j);
          const double x_new = t.x_new(j);
          const float x_old = t.s2[j] - t.m_new;
          ASSERT_EQ(t.p_new[j], t.p_ref(j)) << r.name << " row " << t.i << " key " << t.j0 + j;
          ASSERT_LE(x_new, t.k_error());
          ASSERT_TRUE(t.p_new[j] >= 0.f && t.p_new[j] <= x.p_scale * (1 + 0x1p-20));
          const double dx = std::fabs(x_new - x_old);
          const double tight =
              half_ulp(t.tmax[g]) + half_ulp(t.gap[g]) + half_ulp(t.c[g]) +
              (t.folded[g] ? half_ulp(t.c[g] + t.k) : half_ulp(t.x_ref[j])) +
              half_ulp(t.x_scaled[j]) + half_ulp(t.s2[j]) + half_ulp(x_old) + t.k_error();
          ASSERT_LE(dx, tight) << r.name << " row " << t.i << " key " << t.j0 + j;
          const double units = (1.25 + 0x1p-20) * t.gmult[g] + t.k_error() +
                               0x1p-24 * (2.001 * std::fabs(t.gap[g]) + 2 * std::fabs(t.k) +
                                          std::fabs(t.x_scaled[j]) + std::fabs(t.x_ref[j]) +
                                          std::fabs(x_old));
          ASSERT_LE(dx, units) << r.name << " row " << t.i << " key " << t.j0 + j;
          const double p_old = static_cast<double>(t.p_old[j]) * x.p_scale;
          const double pmax = std::max<double>(t.p_new[j], p_old);
          ASSERT_LE(std::fabs(t.p_new[j] - p_old), pmax * (std::exp2(dx) * (1 + 0x1p-21) - 1) + 0x1p-140)
              << r.name << " row " << t.i << " key " << t.j0 + j;
          ++keys;
          differ += x_new != x_old;
          by_double += t.x_by_double[j];
          if (x_old >= -24.f) worst_units = std::max(worst_units, dx / t.gmult[g]);
        }
      });
    }
    // The two paths are different computations (one rounding instead of two for the row
    // max's group), and the double check covered almost every key.
    EXPECT_GT(differ, keys / 100) << r.name;
    EXPECT_GT(by_double, keys * 9 / 10) << r.name;
    EXPECT_LE(worst_units, 1.25 + 0.05) << r.name;
    // A power-of-two P scale (sage2_8b's 256, fp16 P's 1) joins every group's offset for
    // these inputs; any other scale none.
    EXPECT_EQ(folded, x.fold.mult_limit > 0.f ? groups : 0) << r.name;
  }
}

// For a group whose max is the row max (tmax_g == m), c_g = -2^24 mult_g exactly and x_j is
// (acc_j - amax_g) * mult_g rounded once (with P's scale 2^k in the offset, (acc_j - amax_g)
// * mult_g + k rounded once); the max key's P~ is exactly 1, P~ * p_scale = 2^k.
TEST(SimIntegerRowMax, RowMaxGroupIsOneRoundingAndItsMaxKeyIsOne) {
  const int64_t d = 128, nq = 64, nkv = 300;
  for (const char* name : {"sage2_8b", "sage1_b"}) {
    const Recipe& r = preset(name);
    const Operands x = quantize(r, normals(nq * d, 1.0, 20), normals(nkv * d, 1.0, 21), nq, nkv, d);
    int64_t groups = 0;
    for_each_tile(x, false, [&](const Tile& t) {
      for (int g = 0; g < kKThreadGroups; ++g) {
        if (!t.present[g] || t.tmax[g] != t.m_new) continue;
        ++groups;
        ASSERT_EQ(t.c[g], -t.gmult[g] * 16777216.f);
        for (int64_t j = 0; j < t.count; ++j) {
          if (Tile::group(j) != g) continue;
          const float exact_once =
              static_cast<float>(static_cast<double>(t.acc[j] - t.amax[g]) * t.gmult[g]);
          ASSERT_EQ(t.x_ref[j], exact_once) << name << " row " << t.i << " key " << t.j0 + j;
          ASSERT_TRUE(t.folded[g]);
          ASSERT_EQ(t.x_scaled[j], static_cast<float>(static_cast<double>(t.acc[j] - t.amax[g]) *
                                                          t.gmult[g] + t.k));
          ASSERT_EQ(t.p_new[j], t.p_ref(j));
          if (t.acc[j] == t.amax[g]) ASSERT_EQ(t.p_new[j], x.p_scale) << name << " row " << t.i;
        }
      }
    });
    EXPECT_GE(groups, nq) << name;  // every row's max tile has one
  }
}

// c_g is two float subtractions, (tmax_g - m) - 2^24 mult_g, not one rounding of the exact
// difference: a case where the two differ (found by a bounded search) gives the former.
TEST(SimIntegerRowMax, OffsetRoundsEachSubtraction) {
  // Group 0 (key 0) holds the row max m ~ 5.5; group 1 (key 2) lies ~4 below it with
  // 2^24 mult ~ 2^14, so c ~ -(2^14 + 4) sits on a grid of 2^-9 while tmax - m has bits
  // down to 2^-21: the first rounding can land on a midpoint of c's grid.
  const int32_t amax0 = 1000;
  const float mult0 = 5.5e-3f;
  const float m = static_cast<float>(amax0) * mult0;
  bool found = false;
  float mult1 = 1.0e-3f;
  int32_t amax1 = 0;
  float c_twice = 0.f, c_once = 0.f;
  for (int step = 0; step < 200000 && !found; ++step) {
    mult1 = std::nextafter(mult1, kInf);
    amax1 = 1500 + step % 37;
    const float tmax1 = static_cast<float>(amax1) * mult1;
    const float t1 = mult1 * 16777216.f;
    c_twice = (tmax1 - m) - t1;
    // tmax1, m and t1 lie within 2^14 of each other's scale: their sum is exact in double.
    c_once = static_cast<float>(static_cast<double>(tmax1) - m - t1);
    found = c_twice != c_once;
  }
  ASSERT_TRUE(found);
  const int32_t acc[3] = {amax0, amax0 - 7, amax1};
  const float mult[3] = {mult0, mult0, mult1};
  float p[3];
  sim::RowState st;
  sim::softmax_enter_tile_integer_max(st, acc, mult, 3, rules::p_scale_fold(1.f, 128), p);
  ASSERT_EQ(st.m, m);
  EXPECT_EQ(p[0], 1.f);
  // Key 2 is its group's max: f = 2^24, x = fl(2^24 mult1 + c).
  EXPECT_EQ(p[2], std::exp2(std::fma(16777216.f, mult1, c_twice)));
  EXPECT_NE(p[2], std::exp2(std::fma(16777216.f, mult1, c_once)));
}

// Q and K near the fp16 limit: logits ~1e10 in log2 units, ulp(m) ~ 2^10. The max key (and
// its twin of the same thread group) keeps P~ = 1 exactly, nothing is NaN, and m is the
// logit path's. Here mult >= 8: no group takes k = 8 into its offset (c + 8 would round).
TEST(SimIntegerRowMax, HugeLogitsKeepTheMaxKeyAtOne) {
  const int64_t d = 128, nq = 64, nkv = 300;
  reference::Rng rng(99);
  auto huge = [&] {
    return static_cast<float>((rng.next() & 1 ? 1.0 : -1.0) * (50000.0 + 15000.0 * rng.uniform()));
  };
  std::vector<float> k(static_cast<size_t>(nkv * d)), q(static_cast<size_t>(nq * d));
  for (float& v : k) v = fmt::fp16_from_bits(fmt::fp16_bits(huge()));
  for (int64_t t = 0; t + 1 < nkv; t += 2)  // keys 2t and 2t + 1 share a thread group
    std::copy(k.begin() + t * d, k.begin() + (t + 1) * d, k.begin() + (t + 1) * d);
  for (int64_t i = 0; i < nq; ++i) {  // query i points at key (37 i + 5) mod nkv
    const int64_t j = (37 * i + 5) % nkv;
    std::copy(k.begin() + j * d, k.begin() + (j + 1) * d, q.begin() + i * d);
  }
  for (const Recipe& r : presets()) {
    if (!rules::integer_row_max(r)) continue;
    const Operands x = quantize(r, q, k, nq, nkv, d);
    std::vector<int> ones(static_cast<size_t>(nq), 0);
    std::vector<float> row_max(static_cast<size_t>(nq), -kInf);
    for (bool causal : {false, true}) {
      std::fill(ones.begin(), ones.end(), 0);
      for_each_tile(x, causal, [&](const Tile& t) {
        ASSERT_EQ(t.m_new, t.m_old) << r.name;
        ASSERT_TRUE(std::isfinite(t.m_new)) << r.name;
        for (int g = 0; g < kKThreadGroups; ++g) {
          ASSERT_TRUE(!t.present[g] || t.gmult[g] >= 8.f) << r.name;
          ASSERT_TRUE(!t.folded[g] || t.k == 0.f) << r.name;  // adding 0 is exact
        }
        for (int64_t j = 0; j < t.count; ++j) {
          ASSERT_FALSE(std::isnan(t.p_new[j])) << r.name;
          ASSERT_TRUE(t.p_new[j] >= 0.f && t.p_new[j] <= x.p_scale * (1 + 0x1p-20)) << r.name;
          const int g = Tile::group(j);
          if (t.tmax[g] == t.m_new && t.acc[j] == t.amax[g]) {
            // P~ = 1: exactly p_scale for a power of two, exp2f(fl(log2 p_scale)) otherwise.
            ASSERT_EQ(t.p_new[j], std::exp2(t.k)) << r.name << " row " << t.i << " key " << t.j0 + j;
            ++ones[t.i];
          }
        }
        row_max[t.i] = t.m_new;
      });
      for (int64_t i = 0; i < nq; ++i) {
        EXPECT_GT(row_max[i], 1e9f) << r.name << " row " << i;  // logits ~1e10: ulp(m) ~ 2^10
        // Without the mask every row sees its pointed key and that key's twin: >= 2 ones.
        if (!causal) EXPECT_GE(ones[i], 2) << r.name << " row " << i;
        if (causal) EXPECT_GE(ones[i], 1) << r.name << " row " << i;
      }
    }
  }
}

// Tiles whose visible count is no multiple of 8, down to one key (three empty thread
// groups): the empty groups take no part and the present ones follow the contract.
TEST(SimIntegerRowMax, PartialTilesWithEmptyGroups) {
  const int64_t d = 64, n = 113;
  const Recipe& r = preset("sage2_8b");
  const Operands x = quantize(r, normals(n * d, 1.0, 30), normals(n * d, 1.0, 31), n, n, d);
  std::set<int64_t> counts;
  for_each_tile(x, true, [&](const Tile& t) {
    counts.insert(t.count);
    for (int g = 0; g < kKThreadGroups; ++g) EXPECT_EQ(t.present[g], t.count > 2 * g);
    ASSERT_EQ(t.m_new, t.m_old);
    for (int64_t j = 0; j < t.count; ++j) ASSERT_EQ(t.p_new[j], t.p_ref(j));
  });
  for (int64_t c : {1, 2, 3, 7, 9, 113}) EXPECT_TRUE(counts.count(c)) << c;
  // One visible key: its own max, so P~ = 1.
  sim::RowState st;
  const int32_t acc = -12345;
  const float mult = 3.5e-4f;
  float p = -1.f;
  EXPECT_EQ(sim::softmax_enter_tile_integer_max(st, &acc, &mult, 1, x.fold, &p), 0.f);
  EXPECT_EQ(p, x.p_scale);  // P~ = 1
  EXPECT_EQ(st.m, static_cast<float>(acc) * mult);
}

// simulate() takes the path for rule-true recipes and the logit path otherwise: its LSE,
// (m + log2 l) ln 2 (no K smoothing here, so no shift), equals the one this test forms from
// the path's own functions, bit for bit, and for the rule-true recipe differs in some rows
// from the logit path's.
TEST(SimIntegerRowMax, SimulateUsesThePathTheRuleSelects) {
  const int64_t d = 128, n = 300;
  reference::SyntheticShape s;
  s.heads_q = s.heads_kv = 1;
  s.n_q = s.n_kv = n;
  s.head_dim = d;
  const reference::SyntheticInputs in = reference::make_synthetic("sharp", s, 3);
  std::vector<float> q(in.q.size()), k(in.k.size());
  for (size_t t = 0; t < q.size(); ++t) q[t] = fmt::fp16_from_bits(in.q[t]);
  for (size_t t = 0; t < k.size(); ++t) k[t] = fmt::fp16_from_bits(in.k[t]);
  Recipe int_max = preset("sage2_8b");
  int_max.smooth_k = false;
  int_max.row_sum = RowSum::float_p;  // the float sum of P~ that this test recomputes
  Recipe logits = int_max;
  logits.qk_granularity = Granularity::per_token;
  ASSERT_TRUE(rules::integer_row_max(int_max));
  ASSERT_FALSE(rules::integer_row_max(logits));
  constexpr float kLn2 = 0.6931471805599453f;
  for (bool causal : {false, true}) {
    for (const Recipe* r : {&int_max, &logits}) {
      std::vector<float> out(static_cast<size_t>(n * d)), lse(static_cast<size_t>(n));
      AttentionArgs a;
      a.recipe = *r;
      a.q = in.q_view();
      a.k = in.k_view();
      a.v = in.v_view();
      a.causal = causal;
      a.out = contiguous_view(out.data(), DType::f32, {1, 1, n, d});
      a.lse = contiguous_view(lse.data(), DType::f32, {1, 1, n});
      reference::simulate(a);
      const Operands x = quantize(*r, q, k, n, n, d);
      std::vector<sim::RowState> st_old(static_cast<size_t>(n)), st_new(static_cast<size_t>(n));
      const bool path = r == &int_max;
      for_each_tile(x, causal, [&](const Tile& t) {
        sim::softmax_add_row_sum(st_old[t.i], t.alpha_old, sim::softmax_row_sum(t.p_old.data(), t.count));
        // simulate() sums P~ = (P~ * p_scale) / p_scale on this path.
        std::vector<float> p_tilde(t.p_new);
        if (path)
          for (float& v : p_tilde) v /= x.p_scale;
        sim::softmax_add_row_sum(st_new[t.i], t.alpha_new, sim::softmax_row_sum(p_tilde.data(), t.count));
        st_old[t.i].m = t.m_old;
        st_new[t.i].m = t.m_new;
      }, path);
      int64_t differ = 0;
      for (int64_t i = 0; i < n; ++i) {
        const float lse_old = (st_old[i].m + std::log2(st_old[i].l)) * kLn2;
        const float lse_new = (st_new[i].m + std::log2(st_new[i].l)) * kLn2;
        ASSERT_EQ(lse[i], path ? lse_new : lse_old) << r->name << " row " << i;
        differ += lse_old != lse_new;
      }
      if (path) EXPECT_GT(differ, 0) << "some row's LSE should tell the two paths apart";
    }
  }
}

}  // namespace
}  // namespace sage
