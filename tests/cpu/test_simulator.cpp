// sage::reference::simulate: per-preset error bounds against exact, the group maps, the
// scale formulas, the accumulator models and the edge cases docs/numerics.md promises.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <iostream>
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "reference/accumulate.h"
#include "reference/metrics.h"
#include "reference/pv_quantize.h"
#include "reference/qk_quantize.h"
#include "reference/rounding.h"
#include "reference/synthetic.h"
#include "sage/attention.h"
#include "numerics/formats.h"
#include "numerics/quant_rules.h"
#include "numerics/tile.h"

namespace sage {
namespace {

using reference::ErrorStats;
using reference::PrequantizedInputs;
using reference::SyntheticInputs;
using reference::SyntheticShape;

SyntheticShape shape(int64_t hq, int64_t hkv, int64_t nq, int64_t nkv, int64_t d = 128) {
  SyntheticShape s;
  s.batch = 1;
  s.heads_q = hq;
  s.heads_kv = hkv;
  s.n_q = nq;
  s.n_kv = nkv;
  s.head_dim = d;
  return s;
}

// Arguments for `r` on `in`; prequantized recipes get prequantize_int8 of the same inputs.
struct Inputs {
  AttentionArgs args;
  PrequantizedInputs pq;
};
void bind(const Recipe& r, const SyntheticInputs& in, Inputs& x) {
  x.args.recipe = r;
  if (r.inputs == sage::Inputs::prequantized_int8) {
    x.pq = reference::prequantize_int8(in, r.v_scale == VScale::per_channel);
    x.args.q = x.pq.q_view();
    x.args.k = x.pq.k_view();
    x.args.v = x.pq.v_view();
    x.args.q_scale = x.pq.q_scale_view();
    x.args.k_scale = x.pq.k_scale_view();
    x.args.v_scale = x.pq.v_scale_view();
  } else {
    x.args.q = in.q_view();
    x.args.k = in.k_view();
    x.args.v = in.v_view();
  }
}

int64_t out_numel(const SyntheticShape& s) { return s.batch * s.heads_q * s.n_q * s.v_dim(); }
TensorView out_view(void* p, DType t, const SyntheticShape& s) {
  return contiguous_view(p, t, {s.batch, s.heads_q, s.n_q, s.v_dim()});
}
TensorView lse_view(float* p, const SyntheticShape& s) {
  return contiguous_view(p, DType::f32, {s.batch, s.heads_q, s.n_q});
}

struct Result {
  std::vector<float> out, lse;
};

Result simulate(const Recipe& r, const SyntheticInputs& in, bool causal = false,
                std::optional<float> sm_scale = std::nullopt) {
  Inputs x;
  bind(r, in, x);
  x.args.sm_scale = sm_scale;
  Result res;
  res.out.resize(static_cast<size_t>(out_numel(in.shape)));
  res.lse.resize(static_cast<size_t>(in.shape.batch * in.shape.heads_q * in.shape.n_q));
  x.args.causal = causal;
  x.args.out = out_view(res.out.data(), DType::f32, in.shape);
  x.args.lse = lse_view(res.lse.data(), in.shape);
  reference::simulate(x.args);
  return res;
}

// The exact answer for the fp16 inputs themselves (also for prequantized recipes).
struct Exact {
  std::vector<double> out;
  std::vector<float> lse;
};
Exact exact(const SyntheticInputs& in, bool causal = false) {
  Exact e;
  e.out.resize(static_cast<size_t>(out_numel(in.shape)));
  e.lse.resize(static_cast<size_t>(in.shape.batch * in.shape.heads_q * in.shape.n_q));
  AttentionArgs a;
  a.q = in.q_view();
  a.k = in.k_view();
  a.v = in.v_view();
  a.causal = causal;
  a.out = out_view(e.out.data(), DType::f64, in.shape);
  a.lse = lse_view(e.lse.data(), in.shape);
  reference::exact(a);
  return e;
}

ErrorStats error(const Result& r, const Exact& e) {
  return reference::compare(r.out.data(), e.out.data(), static_cast<int64_t>(e.out.size()));
}

Recipe custom(QKFormat qf, Granularity g, PVFormat pf, PScale ps, VScale vs, PVAccum acc) {
  Recipe r;
  r.qk_format = qf;
  r.qk_granularity = g;
  r.smooth_k = false;
  r.pv_format = pf;
  r.p_scale = ps;
  r.v_scale = vs;
  r.pv_accum = acc;
  return r;
}

// ---- per-preset bounds --------------------------------------------------------------------
//
// simulate (f16 output, as the kernels write it) against exact of the fp16 inputs, on every
// synthetic distribution; batch 1, 4 query heads over 2 KV heads, N = 512, d = 128, seed 0,
// both non-causal and causal. Each entry is {max 1 - cosine, max relative L1}: the larger of
// the two masks' measurements times 1.5 (cosine error) and 1.25 (relative L1), rounded up to
// two digits. docs/numerics.md lists the measured values next to these bounds.
//
// channel_offset's bounds are those of a known defect, not of a healthy recipe: Q's few
// large-mean channels set every token's INT8 scale (issue 35, section 1), so the presets
// lose 10-50x more than on normal there. They pin today's paper numerics (which the presets
// keep); the remedy, recipe.qk_channel_balance, is bounded in test_channel_balance.cpp.
struct Bound {
  double cos_err, rel_l1;
};
using BoundRow = std::map<std::string, Bound>;

// Presets whose forward is another's take its bounds (sagebwd_block: sagebwd's forward, the
// two differ in the backward's dS only).
std::map<std::string, BoundRow> with_aliases(std::map<std::string, BoundRow> table) {
  table["sagebwd_block"] = table.at("sagebwd");
  return table;
}

const std::map<std::string, BoundRow>& bounds() {
  static const std::map<std::string, BoundRow> table = with_aliases({
      {"sage1_t",
       {{"normal", {6.7e-05, 0.012}},
        {"k_bias", {6.4e-05, 0.012}},
        {"qk_bias", {0.00017, 0.019}},
        {"outliers", {0.0011, 0.016}},
        {"sharp", {0.00059, 0.025}},
        {"v_bias", {1.4e-07, 0.00048}},
        {"sink", {6.8e-07, 0.00098}},
        {"channel_offset", {0.0069, 0.12}}}},
      {"sage1_b",
       {{"normal", {0.00014, 0.017}},
        {"k_bias", {0.00013, 0.017}},
        {"qk_bias", {0.00033, 0.026}},
        {"outliers", {0.0046, 0.034}},
        {"sharp", {0.0012, 0.035}},
        {"v_bias", {2.3e-07, 0.00061}},
        {"sink", {1.2e-06, 0.0012}},
        {"channel_offset", {0.0094, 0.14}}}},
      {"sage1_vt",
       {{"normal", {0.00037, 0.027}},
        {"k_bias", {0.00035, 0.026}},
        {"qk_bias", {0.00042, 0.031}},
        {"outliers", {0.0011, 0.025}},
        {"sharp", {0.00065, 0.03}},
        {"v_bias", {2.7e-06, 0.0019}},
        {"sink", {0.004, 0.079}},
        {"channel_offset", {0.0075, 0.13}}}},
      {"sage1_vb",
       {{"normal", {0.00044, 0.029}},
        {"k_bias", {0.00041, 0.029}},
        {"qk_bias", {0.00057, 0.036}},
        {"outliers", {0.0046, 0.042}},
        {"sharp", {0.0013, 0.04}},
        {"v_bias", {2.7e-06, 0.0019}},
        {"sink", {0.004, 0.079}},
        {"channel_offset", {0.01, 0.14}}}},
      {"sage2_8b",
       {{"normal", {0.0011, 0.047}},
        {"k_bias", {0.0011, 0.047}},
        {"qk_bias", {0.00095, 0.042}},
        {"outliers", {0.003, 0.048}},
        {"sharp", {0.0015, 0.048}},
        {"v_bias", {2.4e-05, 0.0052}},
        {"sink", {0.00041, 0.024}},
        {"channel_offset", {0.0089, 0.14}}}},
      {"sage2_8b_vsmooth",
       {{"normal", {0.0011, 0.047}},
        {"k_bias", {0.0011, 0.046}},
        {"qk_bias", {0.0009, 0.042}},
        {"outliers", {0.003, 0.047}},
        {"sharp", {0.0015, 0.048}},
        {"v_bias", {1.1e-06, 0.0013}},
        {"sink", {9.9e-05, 0.013}},
        {"channel_offset", {0.0092, 0.14}}}},
      {"sage2_8b_balanced",  // sage2_8b's bounds, but channel_offset's: the balance's remedy
       {{"normal", {0.0011, 0.047}},
        {"k_bias", {0.0011, 0.047}},
        {"qk_bias", {0.0011, 0.046}},
        {"outliers", {0.0032, 0.049}},
        {"sharp", {0.0016, 0.049}},
        {"v_bias", {2.4e-05, 0.0052}},
        {"sink", {0.00041, 0.024}},
        {"channel_offset", {0.0011, 0.046}}}},
      {"sage2_4b",
       {{"normal", {0.032, 0.26}},
        {"k_bias", {0.032, 0.26}},
        {"qk_bias", {0.059, 0.35}},
        {"outliers", {0.26, 0.41}},
        {"sharp", {0.22, 0.52}},
        {"v_bias", {5.5e-05, 0.0092}},
        {"sink", {0.0013, 0.044}},
        {"channel_offset", {0.39, 1.1}}}},
      {"sage2pp_8b",
       {{"normal", {0.0011, 0.046}},
        {"k_bias", {0.0011, 0.046}},
        {"qk_bias", {0.00079, 0.04}},
        {"outliers", {0.003, 0.048}},
        {"sharp", {0.0015, 0.048}},
        {"v_bias", {1.9e-05, 0.0048}},
        {"sink", {0.00054, 0.028}},
        {"channel_offset", {0.0091, 0.14}}}},
      {"sage2pp_4b",
       {{"normal", {0.032, 0.26}},
        {"k_bias", {0.032, 0.26}},
        {"qk_bias", {0.06, 0.35}},
        {"outliers", {0.26, 0.41}},
        {"sharp", {0.22, 0.52}},
        {"v_bias", {5e-05, 0.0089}},
        {"sink", {0.0015, 0.047}},
        {"channel_offset", {0.39, 1.1}}}},
      {"sage3_fp4",
       {{"normal", {0.028, 0.24}},
        {"k_bias", {0.027, 0.24}},
        {"qk_bias", {0.04, 0.29}},
        {"outliers", {0.09, 0.26}},
        {"sharp", {0.13, 0.41}},
        {"v_bias", {0.00061, 0.029}},
        {"sink", {0.0063, 0.11}},
        {"channel_offset", {0.17, 0.58}}}},
      {"int_flash",
       {{"normal", {0.00042, 0.028}},
        {"k_bias", {0.00086, 0.042}},
        {"qk_bias", {0.0019, 0.071}},
        {"outliers", {0.0014, 0.028}},
        {"sharp", {0.00065, 0.032}},
        {"v_bias", {1.5e-06, 0.0015}},
        {"sink", {0.0013, 0.043}},
        {"channel_offset", {0.15, 0.51}}}},
      {"int_flash_q",
       {{"normal", {0.00042, 0.028}},
        {"k_bias", {0.00086, 0.042}},
        {"qk_bias", {0.0019, 0.071}},
        {"outliers", {0.0014, 0.028}},
        {"sharp", {0.00065, 0.032}},
        {"v_bias", {1.5e-06, 0.0015}},
        {"sink", {0.0013, 0.043}},
        {"channel_offset", {0.15, 0.51}}}},
      {"sagebwd",
       {{"normal", {0.00036, 0.027}},
        {"k_bias", {0.00034, 0.027}},
        {"qk_bias", {0.00053, 0.035}},
        {"outliers", {0.0046, 0.044}},
        {"sharp", {0.0013, 0.041}},
        {"v_bias", {3.3e-06, 0.0022}},
        {"sink", {0.00033, 0.024}},
        {"channel_offset", {0.0097, 0.14}}}},
  });
  return table;
}

SyntheticShape bound_shape() { return shape(4, 2, 512, 512); }

class SimBounds : public ::testing::TestWithParam<std::string> {};

TEST(SimBoundsTable, CoversEveryPresetAndDistribution) {
  for (const Recipe& r : presets()) {
    ASSERT_TRUE(bounds().count(r.name)) << "no accuracy bound for preset " << r.name;
    for (const std::string& d : reference::synthetic_distributions())
      EXPECT_TRUE(bounds().at(r.name).count(d)) << r.name << " has no bound on " << d;
  }
}

TEST_P(SimBounds, SimulateVsExactWithinBound) {
  const std::string dist = GetParam();
  const SyntheticShape s = bound_shape();
  const SyntheticInputs in = reference::make_synthetic(dist, s, 0);
  const bool print = std::getenv("SAGE_PRINT_MEASUREMENTS") != nullptr;
  for (bool causal : {false, true}) {
    std::vector<double> ref(static_cast<size_t>(out_numel(s)));
    {
      AttentionArgs a;
      a.q = in.q_view();
      a.k = in.k_view();
      a.v = in.v_view();
      a.causal = causal;
      a.out = out_view(ref.data(), DType::f64, s);
      reference::exact(a);
    }
    for (const Recipe& r : presets()) {
      Inputs x;
      bind(r, in, x);
      std::vector<uint16_t> out(ref.size());
      x.args.causal = causal;
      x.args.out = out_view(out.data(), DType::f16, s);
      reference::simulate(x.args);
      const ErrorStats e = reference::compare(x.args.out, Layout::HND, out_view(ref.data(), DType::f64, s),
                                              Layout::HND);
      if (print)
        std::cout << "MEASURED " << r.name << " " << dist << " " << (causal ? "causal" : "full") << " "
                  << 1 - e.cosine << " " << e.rel_l1 << "\n";
      ASSERT_TRUE(bounds().count(r.name) && bounds().at(r.name).count(dist)) << r.name << " " << dist;
      const Bound b = bounds().at(r.name).at(dist);
      EXPECT_LE(1 - e.cosine, b.cos_err) << r.name << " on " << dist << (causal ? " (causal)" : "");
      EXPECT_LE(e.rel_l1, b.rel_l1) << r.name << " on " << dist << (causal ? " (causal)" : "");
      EXPECT_EQ(e.nonfinite, 0);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Dist, SimBounds,
                         ::testing::ValuesIn(reference::synthetic_distributions()),
                         [](const ::testing::TestParamInfo<std::string>& i) { return i.param; });

// A bound that cannot fail is a defect: dropping a recipe's key technique must break it.
TEST(SimBoundsTable, BoundsCatchARegression) {
  const SyntheticShape s = bound_shape();
  const SyntheticInputs in = reference::make_synthetic("k_bias", s, 0);
  const Exact e = exact(in);
  Recipe broken = preset("sage1_b");
  broken.smooth_k = false;
  const ErrorStats err = error(simulate(broken, in), e);
  const Bound b = bounds().at("sage1_b").at("k_bias");
  EXPECT_GT(1 - err.cosine, b.cos_err);
  EXPECT_GT(err.rel_l1, b.rel_l1);

  Recipe fp22 = preset("sage2_8b_vsmooth");
  fp22.smooth_v = false;
  const SyntheticInputs vb = reference::make_synthetic("v_bias", s, 0);
  EXPECT_GT(error(simulate(fp22, vb), exact(vb)).rel_l1, bounds().at("sage2_8b_vsmooth").at("v_bias").rel_l1);
}

// ---- the unquantized path is exact attention --------------------------------------------

TEST(Simulate, Fp16EverywhereMatchesExact) {
  const Recipe r = custom(QKFormat::fp16, Granularity::per_tensor, PVFormat::fp16, PScale::none,
                          VScale::none, PVAccum::fp32);
  for (const char* dist : {"normal", "sharp", "v_bias"}) {
    const SyntheticInputs in = reference::make_synthetic(dist, shape(2, 1, 200, 300), 1);
    for (bool causal : {false, true}) {
      const ErrorStats e = error(simulate(r, in, causal), exact(in, causal));
      EXPECT_LT(e.rel_l1, 1e-3) << dist;
      EXPECT_GT(e.cosine, 1 - 1e-6) << dist;
    }
  }
  // K smoothing in fp16 only rounds K - mean(K) to fp16: still ~1e-3, whichever keys the mean
  // is taken over (any vector shared by all keys keeps softmax exact; 300: key 0 alone).
  Recipe smooth = r;
  smooth.smooth_k = true;
  const SyntheticInputs kb = reference::make_synthetic("k_bias", shape(2, 1, 200, 300), 1);
  for (int stride : {1, 8, 300}) {
    smooth.k_mean_stride = stride;
    EXPECT_LT(error(simulate(smooth, kb), exact(kb)).rel_l1, 1e-3) << "k_mean_stride " << stride;
  }
}

TEST(Simulate, KMeanOverAStrideOfTheKeys) {
  // 5 keys x 2 channels; stride 2 averages keys 0, 2, 4; stride 4 keys 0 and 4; 9 key 0.
  const std::vector<float> k = {1, 10, 2, 20, 3, 30, 4, 40, 5, 50};
  EXPECT_EQ(reference::sim::channel_mean(k.data(), 5, 2), (std::vector<float>{3.f, 30.f}));
  EXPECT_EQ(reference::sim::channel_mean(k.data(), 5, 2, 2), (std::vector<float>{3.f, 30.f}));
  EXPECT_EQ(reference::sim::channel_mean(k.data(), 4, 2, 2), (std::vector<float>{2.f, 20.f}));
  EXPECT_EQ(reference::sim::channel_mean(k.data(), 5, 2, 4), (std::vector<float>{3.f, 30.f}));
  EXPECT_EQ(reference::sim::channel_mean(k.data(), 4, 2, 3), (std::vector<float>{2.5f, 25.f}));
  EXPECT_EQ(reference::sim::channel_mean(k.data(), 5, 2, 9), (std::vector<float>{1.f, 10.f}));
  EXPECT_EQ(rules::k_mean_samples(5, 2), 3);
  EXPECT_EQ(rules::k_mean_samples(4, 3), 2);
  EXPECT_EQ(rules::k_mean_samples(1, 8), 1);
}

// ---- group maps ---------------------------------------------------------------------------

TEST(SimGroupMaps, PerThreadQGroupsAreRowsRAndRPlus8OfAWarpSlice) {
  const TileConfig tc = tile_config(128);
  const int64_t n = 3 * tc.block_q;
  std::map<int64_t, std::vector<int64_t>> members;
  for (int64_t t = 0; t < n; ++t) {
    const int64_t g = q_group_of(Granularity::per_thread, t, tc);
    ASSERT_GE(g, 0);
    ASSERT_LT(g, q_group_count(Granularity::per_thread, n, tc));
    members[g].push_back(t);
  }
  EXPECT_EQ(static_cast<int64_t>(members.size()), q_group_count(Granularity::per_thread, n, tc));
  for (const auto& [g, rows] : members) {
    ASSERT_EQ(rows.size(), 2u) << "group " << g;
    EXPECT_EQ(rows[1] - rows[0], kQThreadGroupRows);
    EXPECT_EQ(rows[0] / kWarpRows, rows[1] / kWarpRows) << "one warp slice";
    EXPECT_LT(rows[0] % kWarpRows, kQThreadGroupRows);
  }
}

TEST(SimGroupMaps, PerThreadKGroupsShareTokenPairsModulo8) {
  const TileConfig tc = tile_config(128);
  const int64_t n = 2 * tc.block_kv + 40;  // a partial last tile
  for (int64_t a = 0; a < n; ++a)
    for (int64_t b = 0; b < n; ++b) {
      const bool same = a / tc.block_kv == b / tc.block_kv && (a % 8) / 2 == (b % 8) / 2;
      ASSERT_EQ(k_group_of(Granularity::per_thread, a, tc) == k_group_of(Granularity::per_thread, b, tc), same)
          << a << " " << b;
    }
  EXPECT_EQ(k_group_count(Granularity::per_thread, n, tc), 3 * kKThreadGroups);
  // Per-warp K is per-block K: all four warps read the whole K tile.
  for (int64_t t = 0; t < n; ++t)
    EXPECT_EQ(k_group_of(Granularity::per_warp, t, tc), k_group_of(Granularity::per_block, t, tc));
}

// The simulator's Q/K scales follow the maps: a token's scale is its group's amax / qmax.
TEST(SimGroupMaps, SimulatorScalesFollowTheMaps) {
  const TileConfig tc = tile_config(64);
  const int64_t n = 300, d = 64;
  reference::Rng rng(7);
  std::vector<float> x(static_cast<size_t>(n * d));
  std::vector<float> token_amax(static_cast<size_t>(n), 0.f);
  for (int64_t t = 0; t < n; ++t)
    for (int64_t c = 0; c < d; ++c) {
      x[t * d + c] = static_cast<float>(rng.normal()) * (1.f + 0.01f * static_cast<float>(t));
      token_amax[t] = std::max(token_amax[t], std::fabs(x[t * d + c]));
    }
  for (Granularity g : {Granularity::per_tensor, Granularity::per_block, Granularity::per_warp,
                        Granularity::per_thread, Granularity::per_token}) {
    for (bool is_q : {true, false}) {
      const auto op = reference::sim::quantize_qk(x.data(), n, d, QKFormat::int8, g, is_q, tc);
      auto group = [&](int64_t t) { return is_q ? q_group_of(g, t, tc) : k_group_of(g, t, tc); };
      for (int64_t t = 0; t < n; ++t) {
        float amax = 0.f;
        for (int64_t u = 0; u < n; ++u)
          if (group(u) == group(t)) amax = std::max(amax, token_amax[u]);
        ASSERT_EQ(op.scale[t], rules::symmetric_scale(amax, 127.f))
            << to_string(g) << (is_q ? " Q" : " K") << " token " << t;
      }
    }
  }
}

// ---- scale formulas on hand-computed cases ----------------------------------------------

TEST(SimScaleFormulas, Int8PerBlockByHand) {
  const TileConfig tc = tile_config(128);
  const int64_t n = 2 * tc.block_kv, d = 4;
  std::vector<float> x(static_cast<size_t>(n * d), 0.f);
  // Block 0: amax 2.54, so scale = 2.54 / 127 and the multiplier 127 / 2.54 = 50 (in float).
  const float row[2][4] = {{1.f, -0.5f, 0.3f, 2.54f}, {0.25f, -0.75f, 0.f, -2.54f}};
  for (int c = 0; c < 4; ++c) {
    x[c] = row[0][c];
    x[5 * d + c] = row[1][c];
  }
  const auto op = reference::sim::quantize_qk(x.data(), n, d, QKFormat::int8, Granularity::per_block,
                                              false, tc);
  EXPECT_EQ(op.scale[0], 2.54f / 127.f);
  EXPECT_EQ(op.scale[127], 2.54f / 127.f);
  const int8_t want0[4] = {50, -25, 15, 127};
  const int8_t want5[4] = {12, -38, 0, -127};  // 12.5 and -37.5 round to even
  for (int c = 0; c < 4; ++c) {
    EXPECT_EQ(op.codes[c], want0[c]) << c;
    EXPECT_EQ(op.codes[5 * d + c], want5[c]) << c;
  }
  // Block 1 is all zero: scale 0, codes 0, no NaN anywhere.
  EXPECT_EQ(op.scale[128], 0.f);
  for (int64_t i = 128 * d; i < n * d; ++i) EXPECT_EQ(op.codes[i], 0);

  // Its logit: the int32 dot times (q_scale * k_scale) * sm_scale * log2(e).
  std::vector<float> qx(x.begin(), x.begin() + d);
  const auto qop = reference::sim::quantize_qk(qx.data(), 1, d, QKFormat::int8, Granularity::per_token,
                                               true, tc);
  float s2 = 0.f;
  reference::sim::qk_logits(qop, 0, op, 5, 1, rules::sm_scale_log2(0.5f), &s2);
  const int32_t acc = 50 * 12 + (-25) * (-38) + 15 * 0 + 127 * (-127);
  EXPECT_EQ(s2, static_cast<float>(acc) * ((qop.scale[0] * op.scale[5]) * (0.5f * rules::kLog2e)));
}

TEST(SimScaleFormulas, StaticP) {
  const float p[5] = {0.3f, 0.5f, 1.f, 1e-3f, 0.f};
  reference::sim::PTile t;
  Recipe r = preset("sage2_8b");  // e4m3 without p_range: P~ * 256 (rules::p_default_max)
  reference::sim::quantize_p(r, p, 5, t);
  const float e4m3_256[5] = {80.f, 128.f, 256.f, 0.25f, 0.f};  // 76.8 -> 80, 0.256 -> 0.25
  for (int j = 0; j < 5; ++j) EXPECT_EQ(t.values[j], e4m3_256[j]) << j;

  r.p_range = 448.f;  // the format max (the SageAttention2 paper's): P~ * 448
  reference::sim::quantize_p(r, p, 5, t);
  const float e4m3[5] = {128.f, 224.f, 448.f, 0.4375f, 0.f};  // 134.4 -> 128, 0.448 -> 0.4375
  for (int j = 0; j < 5; ++j) EXPECT_EQ(t.values[j], e4m3[j]) << j;
  EXPECT_EQ(t.dequantized_sum, (((128.f + 224.f) + 448.f) + 0.4375f) / 448.f);

  r.p_range = 112.f;  // SageAttention2++: P~ * 112; 33.6 -> 32
  reference::sim::quantize_p(r, p, 5, t);
  EXPECT_EQ(t.values[0], 32.f);
  EXPECT_EQ(t.values[2], 112.f);

  reference::sim::quantize_p(preset("sage1_vt"), p, 5, t);  // int8, P~ * 127
  const int8_t i8[5] = {38, 64, 127, 0, 0};                  // 63.5 -> 64 (even)
  for (int j = 0; j < 5; ++j) EXPECT_EQ(t.int_codes[j], i8[j]) << j;
}

TEST(SimScaleFormulas, Nvfp4PTwoLevelAndDirect) {
  std::vector<float> p(16, 0.f);
  p[0] = 1.f;
  p[1] = 0.5f;
  p[2] = 0.25f;
  p[3] = 0.1f;
  reference::sim::PTile t;
  const Recipe two = preset("sage3_fp4");
  reference::sim::quantize_p(two, p.data(), 16, t);
  // sr = 1 / 2688; P2 = 2688, 1344, 672, 268.8; group scale e4m3(2688 / 6) = 448; codes 6, 3,
  // 1.5 and 0.6 -> 0.5.
  EXPECT_EQ(t.row_scale, 1.f / 2688.f);
  EXPECT_EQ(t.values[0], 2688.f);
  EXPECT_EQ(t.values[1], 1344.f);
  EXPECT_EQ(t.values[2], 672.f);
  EXPECT_EQ(t.values[3], 224.f);
  EXPECT_EQ(t.values[4], 0.f);

  Recipe direct = two;
  direct.p_scale = PScale::static_max;
  reference::sim::quantize_p(direct, p.data(), 16, t);
  // Group scale e4m3(1 / 6) = 0.171875; codes 5.82 -> 6, 2.91 -> 3, 1.45 -> 1.5, 0.58 -> 0.5.
  EXPECT_EQ(t.row_scale, 1.f);
  EXPECT_EQ(t.values[0], 6 * 0.171875f);
  EXPECT_EQ(t.values[1], 3 * 0.171875f);
  EXPECT_EQ(t.values[2], 1.5f * 0.171875f);
  EXPECT_EQ(t.values[3], 0.5f * 0.171875f);

  // A tile row whose P~ all underflowed: no scale, no NaN.
  std::vector<float> zero(16, 0.f);
  reference::sim::quantize_p(two, zero.data(), 16, t);
  for (float v : t.values) EXPECT_EQ(v, 0.f);
  EXPECT_EQ(t.dequantized_sum, 0.f);
}

TEST(SimScaleFormulas, VPerChannelAndMicroscale) {
  const int64_t n = 3, d = 2;
  const float v[n * d] = {1.f, 0.f, -2.f, 0.f, 0.5f, 0.f};  // channel 1 all zero
  Recipe r = preset("sage2_8b");
  auto op = reference::sim::quantize_v(v, n, d, r);
  EXPECT_EQ(op.channel_scale[0], 2.f / 448.f);
  EXPECT_EQ(op.channel_scale[1], 0.f);
  EXPECT_EQ(op.values[0], 224.f);
  EXPECT_EQ(op.values[2], -448.f);
  EXPECT_EQ(op.values[4], 112.f);
  EXPECT_EQ(op.values[1], 0.f);
  r.v_range = 4.5f;  // SageAttention2++
  op = reference::sim::quantize_v(v, n, d, r);
  EXPECT_EQ(op.channel_scale[0], 2.f / 4.5f);
  EXPECT_EQ(op.values[2], -4.5f);
  EXPECT_EQ(op.values[0], 2.25f);

  // NVFP4 V: 16 consecutive tokens of a channel share an E4M3 scale of amax / 6.
  std::vector<float> col(32);
  for (int t = 0; t < 32; ++t) col[t] = t < 16 ? 0.1f * static_cast<float>(t) : 100.f;
  const auto fp4 = reference::sim::quantize_v(col.data(), 32, 1, preset("sage3_fp4"));
  const float s0 = fmt::e4m3_decode(fmt::e4m3_encode(1.5f / 6.f));
  EXPECT_EQ(fp4.values[15], 6.f * s0);
  EXPECT_EQ(fp4.values[16], 6.f * fmt::e4m3_decode(fmt::e4m3_encode(100.f / 6.f)));
}

// ---- rounding from double -----------------------------------------------------------------

// The accumulator models' fast roundings equal the plain two-step ones on every kind of
// input: random magnitudes over the whole fp16 range and beyond, exact fp16 ties, the
// overflow threshold 65520, fp16 subnormals, and FP22 boundaries.
TEST(SimRounding, FastPathsMatchReference) {
  reference::Rng rng(1234);
  std::vector<double> xs = {0.0, -0.0, 65504.0, 65519.99, 65520.0, -65520.0, 65536.0, 1e6,
                            0x1p-14, 0x1p-15, 0x1.8p-24, 0x1p-25, 1e-30, 0x1p-126, 0x1p-127,
                            3.4028234663852886e38, 3.5e38, -1e300};
  for (int i = 0; i < 200000; ++i) {
    const double m = 1.0 + rng.uniform();
    const int e = static_cast<int>(rng.next() % 60) - 40;
    const double sign = rng.next() & 1 ? -1.0 : 1.0;
    xs.push_back(sign * std::ldexp(m, e));
    // An exact tie between two fp16 neighbours (odd multiples of half an ulp).
    const int fe = static_cast<int>(rng.next() % 30) - 14;
    const double ulp = std::ldexp(1.0, std::max(fe, -14) - 10);
    xs.push_back(sign * (std::ldexp(1.0, fe) + ulp * (static_cast<double>(rng.next() % 1024) + 0.5)));
  }
  for (double x : xs) {
    const float a = reference::round_double_to_fp16(x), b = reference::round_double_to_fp16_reference(x);
    ASSERT_EQ(reference::float_bits(a), reference::float_bits(b)) << x;
    const float c = reference::truncate_double_to_fp22(x), d = reference::truncate_double_to_fp22_reference(x);
    ASSERT_EQ(reference::float_bits(c), reference::float_bits(d)) << x;
  }
}

// ---- accumulator models ------------------------------------------------------------------

TEST(SimAccumulators, Fp22TruncatesWhatFp32Keeps) {
  // One k-step: 448 * 1 + 1 * 2^-9. FP22 keeps 13 mantissa bits (ulp 2^-5 at 448).
  reference::sim::VOperand v;
  v.n = 2;
  v.d = 1;
  v.values = {1.f, 0x1p-9f};
  reference::sim::PTile p;
  p.values = {448.f, 1.f};
  reference::sim::AccumScratch sc;
  float o = 0.f;
  reference::sim::accumulate_tile(PVAccum::fp22, p, v, 0, 0.f, &o, sc);
  EXPECT_EQ(o, 448.f);
  o = 0.f;
  reference::sim::accumulate_tile(PVAccum::two_level, p, v, 0, 0.f, &o, sc);
  EXPECT_EQ(o, 448.f);
  o = 0.f;
  reference::sim::accumulate_tile(PVAccum::fp32, p, v, 0, 0.f, &o, sc);
  EXPECT_EQ(o, 448.f + 0x1p-9f);
  // An fp16 accumulator rounds to nearest (ulp 0.25 at 448); two fp16 k32 sums then fp32.
  o = 0.f;
  reference::sim::accumulate_tile(PVAccum::fp16x2_fp32, p, v, 0, 0.f, &o, sc);
  EXPECT_EQ(o, 448.f);
}

TEST(SimAccumulators, Fp22TruncationIsTowardZero) {
  reference::sim::VOperand v;
  v.n = 2;
  v.d = 1;
  v.values = {-1.f, -0x1p-9f};
  reference::sim::PTile p;
  p.values = {448.f, 1.f};
  reference::sim::AccumScratch sc;
  float o = 0.f;
  reference::sim::accumulate_tile(PVAccum::two_level, p, v, 0, 0.f, &o, sc);
  EXPECT_EQ(o, -448.f);
}

TEST(SimAccumulators, Fp16AccumulatorRoundsEachK16Step) {
  // 17 tokens of P = 1 and V = 2049: the first k16 step's exact sum 32784 lies halfway
  // between the fp16 neighbours 32768 and 32800 and rounds to even (32768); the second step
  // adds the 17th product and rounds again.
  reference::sim::VOperand v;
  v.n = 17;
  v.d = 1;
  v.values.assign(17, 2049.f);
  reference::sim::PTile p;
  p.values.assign(17, 1.f);
  reference::sim::AccumScratch sc;
  float o = 0.f;
  reference::sim::accumulate_tile(PVAccum::fp16, p, v, 0, 0.f, &o, sc);
  const float first = fmt::round_fp16(16.f * 2049.f);
  EXPECT_EQ(o, fmt::round_fp16(first + 2049.f));
  EXPECT_NE(o, 17.f * 2049.f);
}

// What the sm_90 FP8 MMA returned for these rows (bench/probe_fp8_accum.cu on the H200, V of
// ones, accumulator preloaded with C): small products beside a large term lose the bits
// below 13 fraction bits of it, each on its own, so 31 of them can vanish entirely.
TEST(SimAccumulators, Fp8MmaTruncatesEachTermToTheLargest) {
  struct Case {
    float c, big, x, gpu;
  } cases[] = {
      {0.f, 448.f, 0x1p-7f, 448.f},        // the old model: 448.21875 (the exact sum truncated)
      {0.f, 448.f, 0x1p-9f, 448.f},        // old: 448.03125
      {0.f, 448.f, 0x1p-5f, 448.96875f},   // on the grid: kept
      {0.f, -448.f, -0x1p-7f, -448.f},     // toward zero for negative terms too
      {0.f, 16.f, 0x1p-9f, 16.060546875f}, // a smaller leading term: a finer grid
      {4096.f, 0.375f, 0.375f, 4096.f},    // the accumulator is a term: old 4108
      {65536.f, 1.f, 1.f, 65536.f},        // old 65568
  };
  for (const Case& k : cases) {
    reference::sim::PTile p;
    p.values.assign(32, k.x);
    p.values[0] = k.big;
    reference::sim::VOperand ones;
    ones.n = 32, ones.d = 1;
    ones.values.assign(32, 1.f);
    reference::sim::AccumScratch sc;
    float o = k.c;  // fp22: the accumulator runs across steps (alpha 1 keeps it)
    reference::sim::accumulate_tile(PVAccum::fp22, p, ones, 0, 1.f, &o, sc);
    EXPECT_EQ(o, k.gpu) << "C " << k.c << " big " << k.big << " x " << k.x;
  }
}

// RowSum::pv_mma's contract: the tile's row sum is what the PV accumulator makes of one more V
// channel of ones, with its k32 steps and FP22 truncation (not the float sum of the codes).
TEST(SimAccumulators, PvMmaRowSumIsAChannelOfOnes) {
  reference::sim::PTile p;
  for (int t = 0; t < 100; ++t)  // E4M3 values from 2^-9 to 448, 100 tokens: four k32 steps
    p.values.push_back(fmt::e4m3_decode(uint8_t((t * 37) % 0x7F)));
  p.values[0] = 448.f, p.values[1] = 0x1p-9f;  // truncated away inside the first step
  reference::sim::VOperand ones;
  ones.n = 100, ones.d = 3;
  ones.values.assign(300, 1.f);
  reference::sim::AccumScratch sc;
  float o[3] = {0.f, 0.f, 0.f};
  reference::sim::accumulate_tile(PVAccum::two_level, p, ones, 0, 0.f, o, sc);
  const float sum = reference::sim::pv_mma_row_sum(PVAccum::two_level, p);
  for (float c : o) EXPECT_EQ(c, sum);
  double exact = 0.0;
  for (float x : p.values) exact += x;
  EXPECT_NE(double(sum), exact) << "the FP8 MMA's steps should round this sum";
  // Each term is truncated toward zero: a sum of positive P never comes out above its value.
  EXPECT_LT(double(sum), exact);
  EXPECT_GT(double(sum), exact * (1 - 0x1p-8));
  EXPECT_THROW(reference::sim::pv_mma_row_sum(PVAccum::fp32, p), std::logic_error);
}

// Where the recipe takes the MMA's row sum (rules::row_sum_in_pv_mma), and that elsewhere
// pv_mma is float_p bit for bit.
TEST(SimAccumulators, PvMmaRowSumRule) {
  const Recipe& s2 = preset("sage2_8b");
  EXPECT_EQ(s2.row_sum, RowSum::pv_mma);
  EXPECT_TRUE(rules::row_sum_in_pv_mma(s2, 128));
  EXPECT_FALSE(rules::row_sum_in_pv_mma(s2, 64));
  Recipe r = s2;
  r.row_sum = RowSum::float_p;
  EXPECT_FALSE(rules::row_sum_in_pv_mma(r, 128));
  r = preset("sage2pp_8b");
  r.row_sum = RowSum::pv_mma;
  EXPECT_FALSE(rules::row_sum_in_pv_mma(r, 128)) << "fp16x2 accumulation has no such kernel";
  r = s2;
  r.pv_format = PVFormat::e5m2;
  EXPECT_FALSE(rules::row_sum_in_pv_mma(r, 128));
  Recipe float_sum = s2;
  float_sum.row_sum = RowSum::float_p;
  for (int64_t d : {64, 128}) {
    const SyntheticInputs in = reference::make_synthetic("v_bias", shape(2, 1, 200, 300, d), 1);
    const Result a = simulate(s2, in, true), b = simulate(float_sum, in, true);
    if (d == 64) {
      EXPECT_EQ(a.out, b.out);
      EXPECT_EQ(a.lse, b.lse);
    } else {
      EXPECT_NE(a.lse, b.lse) << "d = 128 should sum the quantized P";
    }
  }
}

// SageAttention2's reason for two-level accumulation: FP22 over a whole long row loses
// accuracy that one FP32 add per KV tile keeps.
TEST(SimAccumulators, TwoLevelBeatsFp22OverLongRows) {
  const SyntheticInputs in = reference::make_synthetic("v_bias", shape(2, 2, 64, 4096), 0);
  const Exact e = exact(in);
  Recipe r = preset("sage2_8b");
  const double two = error(simulate(r, in), e).rel_l1;
  r.pv_accum = PVAccum::fp22;
  const double fp22 = error(simulate(r, in), e).rel_l1;
  r.pv_accum = PVAccum::fp32;
  const double fp32 = error(simulate(r, in), e).rel_l1;
  // Measured: two-level 1.5e-3, fp22 4.1e-3, ideal fp32 1.5e-3.
  EXPECT_GT(fp22, 2.0 * two);
  EXPECT_LT(two, 1.1 * fp32);
}

// ---- edge cases ---------------------------------------------------------------------------

TEST(SimEdgeCases, AllZeroInputsGiveZerosAndLogN) {
  SyntheticInputs in = reference::make_synthetic("normal", shape(2, 1, 130, 300, 64), 0);
  std::fill(in.q.begin(), in.q.end(), 0);
  std::fill(in.k.begin(), in.k.end(), 0);
  std::fill(in.v.begin(), in.v.end(), 0);
  for (const Recipe& r : presets()) {
    const Result res = simulate(r, in);
    for (float x : res.out) ASSERT_EQ(x, 0.f) << r.name;
    for (float l : res.lse) ASSERT_NEAR(l, std::log(300.f), 1e-5) << r.name;
  }
}

// Huge Q and K make attention one-hot; huge V stays finite through every scaled format.
TEST(SimEdgeCases, InputsNearTheFp16LimitStayFinite) {
  SyntheticInputs in = reference::make_synthetic("normal", shape(2, 1, 130, 300, 64), 0);
  reference::Rng rng(99);
  auto huge = [&](std::vector<uint16_t>& x) {
    for (auto& h : x)
      h = fmt::fp16_bits(static_cast<float>((rng.next() & 1 ? 1.0 : -1.0) * (50000.0 + 15000.0 * rng.uniform())));
  };
  huge(in.q);
  huge(in.k);
  huge(in.v);
  for (const Recipe& r : presets()) {
    const Result res = simulate(r, in);
    for (float x : res.out) ASSERT_TRUE(std::isfinite(x)) << r.name;
    for (float l : res.lse) ASSERT_TRUE(std::isfinite(l)) << r.name;
  }
  // Uniform attention (Q = K = 0) over |V| ~ 60000: finite and accurate wherever V is scaled
  // or accumulated in fp32. An fp16 accumulator (sage1_t / sage1_b) overflows once 16
  // products pass 65504, as the hardware's does: the contract keeps that visible (inf, or
  // NaN where tiles overflow in opposite directions) rather than saturating silently.
  std::fill(in.q.begin(), in.q.end(), 0);
  std::fill(in.k.begin(), in.k.end(), 0);
  const Exact e = exact(in);
  for (const Recipe& r : presets()) {
    const ErrorStats err = error(simulate(r, in), e);
    if (r.pv_accum == PVAccum::fp16) {
      EXPECT_GT(err.nonfinite, 0) << r.name;
      continue;
    }
    EXPECT_EQ(err.nonfinite, 0) << r.name;
    // NVFP4 has no per-tensor scale in this contract: an E4M3 group scale stops at 448, so
    // magnitudes above 6 * 448 = 2688 saturate (docs/numerics.md, "Range limits").
    if (r.pv_format != PVFormat::nvfp4) {
      EXPECT_LT(err.rel_l1, 0.05) << r.name;
    }
  }
}

// Logits ~1e10 (Q and K near the fp16 limit) with a clear winner per row: query i is a copy
// of key (37 i + 5) mod n_kv, and keys 2t, 2t + 1 are twins (one per-thread K group, so the
// same codes and logit). Exact attention averages V over the visible twins (or takes the one
// visible key); the recipe must find the same keys, P~ = 1 on them and 0 elsewhere, so what
// remains is V's quantization: within each preset's bound on `normal` V.
// (With the integer row max, docs/numerics.md step 6, the max keys' exponent is exactly 0.)
TEST(SimEdgeCases, HugeLogitsPickTheSameKeysAsExact) {
  const SyntheticShape s = shape(2, 1, 64, 300, 128);
  SyntheticInputs in = reference::make_synthetic("normal", s, 0);
  reference::Rng rng(7);
  const int64_t d = s.head_dim;
  for (auto& h : in.k)
    h = fmt::fp16_bits(static_cast<float>((rng.next() & 1 ? 1.0 : -1.0) * (50000.0 + 15000.0 * rng.uniform())));
  for (int64_t t = 0; t + 1 < s.n_kv; t += 2)
    std::copy(in.k.begin() + t * d, in.k.begin() + (t + 1) * d, in.k.begin() + (t + 1) * d);
  for (int64_t h = 0; h < s.heads_q; ++h)
    for (int64_t i = 0; i < s.n_q; ++i) {
      const int64_t j = (37 * i + 5 + 11 * h) % s.n_kv;
      std::copy(in.k.begin() + j * d, in.k.begin() + (j + 1) * d, in.q.begin() + (h * s.n_q + i) * d);
    }
  for (bool causal : {false, true}) {
    const Exact e = exact(in, causal);
    for (const Recipe& r : presets()) {
      const Result res = simulate(r, in, causal);
      const ErrorStats err = error(res, e);
      EXPECT_EQ(err.nonfinite, 0) << r.name;
      for (float l : res.lse) ASSERT_TRUE(std::isfinite(l)) << r.name;
      const Bound b = bounds().at(r.name).at("normal");
      if (std::getenv("SAGE_PRINT_MEASUREMENTS"))
        std::cout << "MEASURED huge-logits " << r.name << (causal ? " causal " : " full ") << 1 - err.cosine
                  << " " << err.rel_l1 << "\n";
      EXPECT_LE(1 - err.cosine, b.cos_err) << r.name << (causal ? " (causal)" : "");
      EXPECT_LE(err.rel_l1, b.rel_l1) << r.name << (causal ? " (causal)" : "");
    }
  }
}

TEST(SimEdgeCases, FullyMaskedRowsAreZeroWithLseMinusInf) {
  // Causal with n_q = 200 > n_kv = 64: rows 0..135 see no key.
  const SyntheticInputs in = reference::make_synthetic("normal", shape(2, 2, 200, 64, 64), 0);
  const Exact e = exact(in, true);
  for (const Recipe& r : presets()) {
    const Result res = simulate(r, in, true);
    for (int64_t h = 0; h < 2; ++h)
      for (int64_t i = 0; i < 200; ++i) {
        const float lse = res.lse[h * 200 + i];
        if (i < 136) {
          ASSERT_EQ(lse, -std::numeric_limits<float>::infinity()) << r.name << " row " << i;
          for (int64_t c = 0; c < 64; ++c) ASSERT_EQ(res.out[(h * 200 + i) * 64 + c], 0.f);
        } else {
          ASSERT_TRUE(std::isfinite(lse)) << r.name << " row " << i;
        }
      }
    EXPECT_EQ(error(res, e).nonfinite, 0);
  }
}

TEST(SimEdgeCases, NoKeysAtAll) {
  std::vector<uint16_t> q(2 * 8 * 64, fmt::fp16_bits(1.f));
  uint16_t dummy = 0;
  std::vector<float> out(q.size(), 5.f), lse(16, 5.f);
  AttentionArgs a;
  a.q = contiguous_view(q.data(), DType::f16, {1, 2, 8, 64});
  a.k = contiguous_view(&dummy, DType::f16, {1, 2, 0, 64});
  a.v = contiguous_view(&dummy, DType::f16, {1, 2, 0, 64});
  a.out = contiguous_view(out.data(), DType::f32, {1, 2, 8, 64});
  a.lse = contiguous_view(lse.data(), DType::f32, {1, 2, 8});
  for (const Recipe& r : presets()) {
    if (r.inputs == sage::Inputs::prequantized_int8) continue;
    a.recipe = r;
    reference::simulate(a);
    for (float x : out) ASSERT_EQ(x, 0.f) << r.name;
    for (float x : lse) ASSERT_EQ(x, -std::numeric_limits<float>::infinity()) << r.name;
  }
}

// ---- LSE, V smoothing, consistency --------------------------------------------------------

// The LSE is of the true scores: K smoothing's row shift q . mean(K) is added back.
TEST(Simulate, LseMatchesExactUnderKSmoothing) {
  const SyntheticInputs in = reference::make_synthetic("k_bias", shape(2, 1, 256, 512), 2);
  Recipe every_key = preset("sage2_8b");
  every_key.k_mean_stride = 1;
  every_key.name = "sage2_8b k_mean_stride 1";
  for (bool causal : {false, true}) {
    const Exact e = exact(in, causal);
    for (const Recipe& rc : {preset("sage2_8b"), every_key, preset("sage1_b"), preset("sage2_4b"),
                             preset("sage3_fp4")}) {
      const Result r = simulate(rc, in, causal);
      double worst = 0;
      for (size_t i = 0; i < e.lse.size(); ++i) worst = std::max(worst, std::fabs(double(r.lse[i]) - e.lse[i]));
      // The K-bias shift q . mean(K) / sqrt(d) is ~5 here; what remains is quantization
      // (measured: sage2_8b 0.0083 with its mean over every 8th of these 512 keys, 0.0035 over
      // every key; sage1_b 0.0054, sage2_4b 0.086, sage3_fp4 0.054).
      const bool four_bit = rc.name == "sage2_4b" || rc.name == "sage3_fp4";
      EXPECT_LT(worst, four_bit ? 0.12 : rc.name == "sage2_8b" ? 0.012 : 0.008) << rc.name;
    }
  }
}

TEST(Simulate, SmoothVReducesErrorOnVBias) {
  const SyntheticInputs in = reference::make_synthetic("v_bias", shape(2, 2, 256, 1024), 4);
  const Exact e = exact(in);
  const double plain = error(simulate(preset("sage2_8b"), in), e).rel_l1;
  const double smooth = error(simulate(preset("sage2_8b_vsmooth"), in), e).rel_l1;
  EXPECT_LT(smooth * 3, plain);  // measured ~4.5x
}

// GQA shares one quantized K/V per KV head: the same as repeating K and V per query head.
TEST(Simulate, GqaEqualsRepeatedKv) {
  const SyntheticInputs g = reference::make_synthetic("k_bias", shape(4, 2, 150, 200, 64), 5);
  SyntheticInputs m = g;
  m.shape.heads_kv = 4;
  const int64_t per_head = 200 * 64;
  m.k.resize(static_cast<size_t>(4 * per_head));
  m.v.resize(m.k.size());
  for (int64_t h = 0; h < 4; ++h)
    for (int64_t i = 0; i < per_head; ++i) {
      m.k[h * per_head + i] = g.k[(h / 2) * per_head + i];
      m.v[h * per_head + i] = g.v[(h / 2) * per_head + i];
    }
  for (const Recipe& r : presets()) {
    if (r.inputs == sage::Inputs::prequantized_int8) continue;
    // The Q/K channel balance takes Q's ranges over a KV head's whole group of query heads,
    // so under GQA a KV head is balanced against more query heads than each copy is.
    if (r.qk_channel_balance) continue;
    EXPECT_EQ(simulate(r, g, true).out, simulate(r, m, true).out) << r.name;
  }
}

// The same inputs in NHD give the same bits; runs are deterministic despite threads.
TEST(Simulate, LayoutIndependentAndDeterministic) {
  const SyntheticInputs in = reference::make_synthetic("outliers", shape(2, 1, 100, 180, 64), 6);
  const Recipe r = preset("sage2_4b");
  const Result hnd = simulate(r, in, true);
  EXPECT_EQ(hnd.out, simulate(r, in, true).out);

  auto to_nhd = [](const std::vector<uint16_t>& x, int64_t heads, int64_t n, int64_t d) {
    std::vector<uint16_t> y(x.size());
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t t = 0; t < n; ++t)
        for (int64_t c = 0; c < d; ++c) y[(t * heads + h) * d + c] = x[(h * n + t) * d + c];
    return y;
  };
  auto q = to_nhd(in.q, 2, 100, 64), k = to_nhd(in.k, 1, 180, 64), v = to_nhd(in.v, 1, 180, 64);
  std::vector<float> out(hnd.out.size());
  AttentionArgs a;
  a.recipe = r;
  a.causal = true;
  a.layout = Layout::NHD;
  a.q = contiguous_view(q.data(), DType::f16, {1, 100, 2, 64});
  a.k = contiguous_view(k.data(), DType::f16, {1, 180, 1, 64});
  a.v = contiguous_view(v.data(), DType::f16, {1, 180, 1, 64});
  a.out = contiguous_view(out.data(), DType::f32, {1, 100, 2, 64});
  reference::simulate(a);
  for (int64_t h = 0; h < 2; ++h)
    for (int64_t t = 0; t < 100; ++t)
      for (int64_t c = 0; c < 64; ++c)
        ASSERT_EQ(out[(t * 2 + h) * 64 + c], hnd.out[(h * 100 + t) * 64 + c]);
}

// int_flash on prequantize_int8(x) is int_flash_q on x: the kernel quantizes the same way.
TEST(Simulate, PrequantizedInt8MatchesInternalQuantization) {
  const SyntheticInputs in = reference::make_synthetic("qk_bias", shape(2, 1, 200, 260), 8);
  EXPECT_EQ(simulate(preset("int_flash"), in).out, simulate(preset("int_flash_q"), in).out);
  // Against the exact attention of the dequantized INT8 inputs, only P's INT8 rounding and
  // V's per-tensor scale remain.
  Inputs x;
  bind(preset("int_flash"), in, x);
  std::vector<double> ref(static_cast<size_t>(out_numel(in.shape)));
  x.args.out = out_view(ref.data(), DType::f64, in.shape);
  reference::exact(x.args);
  const Result sim = simulate(preset("int_flash"), in);
  EXPECT_LT(reference::compare(sim.out.data(), ref.data(), static_cast<int64_t>(ref.size())).rel_l1, 0.06);
}

TEST(Simulate, Bf16InputsAndHeadDim64) {
  SyntheticInputs in = reference::make_synthetic("normal", shape(2, 2, 128, 256, 64), 9);
  // bf16 inputs (the synthetic values rounded to bf16), against exact of the same values.
  std::vector<uint16_t> q(in.q.size()), k(in.k.size()), v(in.v.size());
  for (size_t i = 0; i < q.size(); ++i) q[i] = fmt::bf16_bits(fmt::fp16_from_bits(in.q[i]));
  for (size_t i = 0; i < k.size(); ++i) k[i] = fmt::bf16_bits(fmt::fp16_from_bits(in.k[i]));
  for (size_t i = 0; i < v.size(); ++i) v[i] = fmt::bf16_bits(fmt::fp16_from_bits(in.v[i]));
  AttentionArgs a;
  a.q = contiguous_view(q.data(), DType::bf16, {1, 2, 128, 64});
  a.k = contiguous_view(k.data(), DType::bf16, {1, 2, 256, 64});
  a.v = contiguous_view(v.data(), DType::bf16, {1, 2, 256, 64});
  std::vector<double> ref(static_cast<size_t>(2 * 128 * 64));
  a.out = contiguous_view(ref.data(), DType::f64, {1, 2, 128, 64});
  reference::exact(a);
  std::vector<uint16_t> out(ref.size());
  a.out = contiguous_view(out.data(), DType::bf16, {1, 2, 128, 64});
  a.recipe = preset("sage2_8b");
  reference::simulate(a);
  const ErrorStats e = reference::compare(a.out, Layout::HND, contiguous_view(ref.data(), DType::f64, {1, 2, 128, 64}),
                                          Layout::HND);
  EXPECT_GT(e.cosine, 0.998);
  EXPECT_LT(e.rel_l1, 0.06);
}

// ---- V with a head dim of its own (DeepSeek MLA's prefill: d = 192, d_v = 128) --------------

SyntheticShape shape_v(int64_t hq, int64_t hkv, int64_t nq, int64_t nkv, int64_t d, int64_t dv) {
  SyntheticShape s = shape(hq, hkv, nq, nkv, d);
  s.head_dim_v = dv;
  return s;
}

// The simulator with V's own head dim against exact, within sage2_8b's bound on `normal`
// (measured at d = 128: the table above).
TEST(Simulate, VHeadDimOfItsOwnWithinSage2Bound) {
  const SyntheticShape s = shape_v(4, 2, 512, 512, 192, 128);
  const SyntheticInputs in = reference::make_synthetic("normal", s, 0);
  const Bound b = bounds().at("sage2_8b").at("normal");
  for (bool causal : {false, true}) {
    std::vector<double> ref(static_cast<size_t>(out_numel(s)));
    AttentionArgs a;
    a.q = in.q_view(), a.k = in.k_view(), a.v = in.v_view();
    a.causal = causal;
    a.out = out_view(ref.data(), DType::f64, s);
    reference::exact(a);
    std::vector<uint16_t> out(ref.size());
    a.out = out_view(out.data(), DType::f16, s);
    a.recipe = preset("sage2_8b");
    reference::simulate(a);
    const ErrorStats e =
        reference::compare(a.out, Layout::HND, out_view(ref.data(), DType::f64, s), Layout::HND);
    if (std::getenv("SAGE_PRINT_MEASUREMENTS"))
      std::cout << "MEASURED d 192 d_v 128 sage2_8b " << (causal ? "causal " : "full ")
                << 1 - e.cosine << " " << e.rel_l1 << "\n";
    EXPECT_LE(1 - e.cosine, b.cos_err) << (causal ? "causal" : "full");
    EXPECT_LE(e.rel_l1, b.rel_l1) << (causal ? "causal" : "full");
    EXPECT_EQ(e.nonfinite, 0);
  }
}

// x's rows of `from` channels widened to `to` with zero channels.
std::vector<uint16_t> zero_padded(const std::vector<uint16_t>& x, int64_t from, int64_t to) {
  const size_t rows = x.size() / static_cast<size_t>(from);
  std::vector<uint16_t> y(rows * static_cast<size_t>(to), 0);
  for (size_t r = 0; r < rows; ++r)
    std::copy(x.begin() + r * from, x.begin() + (r + 1) * from, y.begin() + r * to);
  return y;
}

// Output channels [0, dv) of rows of d channels.
std::vector<float> first_channels(const std::vector<float>& x, int64_t d, int64_t dv) {
  std::vector<float> y;
  for (size_t r = 0; r < x.size() / static_cast<size_t>(d); ++r)
    y.insert(y.end(), x.begin() + r * d, x.begin() + r * d + dv);
  return y;
}

// A call with V's own head dim is the call with the smaller operand zero-padded to the larger
// dim, bit for bit, for every preset: zero channels change no scale (a maximum over |0|, so
// per-tensor and per-block V scales and per-token Q/K scales too; a zero channel's own
// per-channel scale is 0 and its codes 0), no mean, no integer score and no other output
// channel (every PV accumulator model rounds per channel). The tile, the row sum from the PV
// MMA and P's scale fold then follow the larger dim in both calls; had the simulator taken
// them from Q/K's dim alone, d = 40 with d_v = 136 would differ (192 against 128 Q rows per
// tile, float_p against pv_mma), so this cannot pass by construction.
TEST(Simulate, VHeadDimOfItsOwnEqualsZeroPaddedCall) {
  struct Case {
    int64_t d, dv;
  };
  for (const Case c : {Case{192, 128}, Case{64, 24}, Case{40, 136}}) {
    const int64_t wide = std::max(c.d, c.dv);
    const SyntheticInputs own =
        reference::make_synthetic("v_bias", shape_v(4, 2, 200, 300, c.d, c.dv), 3);
    SyntheticInputs padded = own;
    padded.shape.head_dim = padded.shape.head_dim_v = wide;
    padded.q = zero_padded(own.q, c.d, wide);
    padded.k = zero_padded(own.k, c.d, wide);
    padded.v = zero_padded(own.v, c.dv, wide);
    // The scale of the unpadded scores, for both (the default would follow the padded dim).
    const float sm_scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(c.d)));
    for (const Recipe& r : presets())
      for (bool causal : {false, true}) {
        SCOPED_TRACE(r.name + " d " + std::to_string(c.d) + " d_v " + std::to_string(c.dv) +
                     (causal ? " causal" : ""));
        const Result a = simulate(r, own, causal, sm_scale);
        const Result b = simulate(r, padded, causal, sm_scale);
        EXPECT_EQ(a.out, first_channels(b.out, wide, c.dv));
        EXPECT_EQ(a.lse, b.lse);
        // Not vacuous: the outputs carry V (v_bias: channels far from 0).
        EXPECT_TRUE(std::any_of(a.out.begin(), a.out.end(), [](float x) { return x != 0.f; }));
      }
  }
}

}  // namespace
}  // namespace sage
