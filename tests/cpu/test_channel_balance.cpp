// The channel_offset distribution (Q/K channels with large means, issue 35 section 1) and the
// simulator's remedy for it, recipe.qk_channel_balance.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "numerics/formats.h"
#include "numerics/quant_rules.h"
#include "reference/metrics.h"
#include "reference/qk_quantize.h"
#include "reference/synthetic.h"
#include "sage/attention.h"
#include "sage/error.h"

namespace sage {
namespace {

using reference::ErrorStats;
using reference::SyntheticInputs;
using reference::SyntheticShape;

SyntheticShape gqa_shape(int64_t d, int64_t n = 512) {
  SyntheticShape s;
  s.heads_q = 8, s.heads_kv = 2, s.n_q = n, s.n_kv = n, s.head_dim = d;
  return s;
}

// Per-channel mean over the tokens of one head of an fp16 HND tensor.
std::vector<double> channel_means(const std::vector<uint16_t>& x, int64_t head, int64_t n, int64_t d) {
  std::vector<double> mean(static_cast<size_t>(d), 0.0);
  for (int64_t t = 0; t < n; ++t)
    for (int64_t c = 0; c < d; ++c) mean[c] += fmt::fp16_from_bits(x[(head * n + t) * d + c]) / n;
  return mean;
}

std::vector<int64_t> offset_channels(const std::vector<double>& mean) {
  std::vector<int64_t> chosen;
  for (size_t c = 0; c < mean.size(); ++c)
    if (std::fabs(mean[c]) >= 9.0) chosen.push_back(static_cast<int64_t>(c));
  return chosen;
}

TEST(ChannelOffset, FewLargeMeanChannelsSharedByKAndItsQueryHeads) {
  for (int64_t d : {64, 128}) {
    const SyntheticShape s = gqa_shape(d, 256);
    const SyntheticInputs in = reference::make_synthetic("channel_offset", s, 3);
    const int64_t group = s.heads_q / s.heads_kv;
    for (int64_t kvh = 0; kvh < s.heads_kv; ++kvh) {
      const std::vector<double> k_mean = channel_means(in.k, kvh, s.n_kv, d);
      const std::vector<int64_t> k_offsets = offset_channels(k_mean);
      EXPECT_EQ(static_cast<int64_t>(k_offsets.size()), std::max<int64_t>(2, d / 32)) << "d " << d;
      for (int64_t g = 0; g < group; ++g) {
        const std::vector<double> q_mean = channel_means(in.q, kvh * group + g, s.n_q, d);
        EXPECT_EQ(offset_channels(q_mean), k_offsets) << "d " << d << " q head " << kvh * group + g;
        // The other channels are N(0, 1): their means stay near 0, so the offsets are
        // 10-50x their RMS.
        for (int64_t c = 0; c < d; ++c)
          if (std::fabs(q_mean[c]) < 9.0) EXPECT_LT(std::fabs(q_mean[c]), 0.5);
      }
    }
  }
}

TEST(ChannelOffset, DeterministicBySeed) {
  const SyntheticShape s = gqa_shape(64, 64);
  const SyntheticInputs a = reference::make_synthetic("channel_offset", s, 7);
  const SyntheticInputs b = reference::make_synthetic("channel_offset", s, 7);
  const SyntheticInputs c = reference::make_synthetic("channel_offset", s, 8);
  EXPECT_EQ(a.q, b.q);
  EXPECT_EQ(a.k, b.k);
  EXPECT_EQ(a.v, b.v);
  EXPECT_NE(a.q, c.q);
  EXPECT_NE(a.k, c.k);
}

// s_c is the power of two nearest sqrt(max|Q_c| / max|K'_c|) in log; ranges end within 2x.
TEST(QKChannelBalance, ScalesArePowersOfTwoThatEvenTheRanges) {
  const std::vector<float> q = {50.f, 0.5f, 1.f, 0.f, 3.f};
  const std::vector<float> k = {0.5f, 50.f, 1.f, 2.f, INFINITY};
  const std::vector<float> s = reference::sim::qk_balance_scales(q.data(), k.data(), 5);
  EXPECT_EQ(s[0], 8.f);          // 50 / 8 = 6.25 against 0.5 * 8 = 4
  EXPECT_EQ(s[1], 0.125f);       // the mirror image
  EXPECT_EQ(s[2], 1.f);          // balanced already
  EXPECT_EQ(s[3], 1.f);          // nothing on one side: nothing to balance
  EXPECT_EQ(s[4], 1.f);          // a non-finite range is left alone
}

struct SimRun {
  std::vector<float> out, lse;
};

SimRun simulate(const Recipe& r, const SyntheticInputs& in, bool causal) {
  const SyntheticShape& s = in.shape;
  SimRun run;
  run.out.resize(static_cast<size_t>(s.batch * s.heads_q * s.n_q * s.head_dim));
  run.lse.resize(static_cast<size_t>(s.batch * s.heads_q * s.n_q));
  AttentionArgs a;
  a.recipe = r;
  a.q = in.q_view(), a.k = in.k_view(), a.v = in.v_view();
  a.causal = causal;
  a.out = contiguous_view(run.out.data(), DType::f32, {s.batch, s.heads_q, s.n_q, s.head_dim});
  a.lse = contiguous_view(run.lse.data(), DType::f32, {s.batch, s.heads_q, s.n_q});
  reference::simulate(a);
  return run;
}

std::vector<double> exact(const SyntheticInputs& in, bool causal) {
  const SyntheticShape& s = in.shape;
  std::vector<double> out(static_cast<size_t>(s.batch * s.heads_q * s.n_q * s.head_dim));
  AttentionArgs a;
  a.q = in.q_view(), a.k = in.k_view(), a.v = in.v_view();
  a.causal = causal;
  a.out = contiguous_view(out.data(), DType::f64, {s.batch, s.heads_q, s.n_q, s.head_dim});
  reference::exact(a);
  return out;
}

Recipe balanced(Recipe r) {
  r.qk_channel_balance = true;
  r.name += "+balance";
  return r;
}

// Without quantization the balance changes nothing but float rounding: q_c / s_c times
// k_c * s_c is q_c k_c, and the powers of two make even the rounding vanish here.
TEST(QKChannelBalance, ExactInMathWithoutQuantization) {
  Recipe fp16_qk = preset("sage2_8b");
  fp16_qk.qk_format = QKFormat::fp16;
  fp16_qk.qk_granularity = Granularity::per_tensor;
  const SyntheticInputs in = reference::make_synthetic("channel_offset", gqa_shape(64, 256), 1);
  for (bool causal : {false, true}) {
    const SimRun plain = simulate(fp16_qk, in, causal), bal = simulate(balanced(fp16_qk), in, causal);
    const ErrorStats out = reference::compare(bal.out.data(), plain.out.data(),
                                              static_cast<int64_t>(plain.out.size()));
    const ErrorStats lse = reference::compare(bal.lse.data(), plain.lse.data(),
                                              static_cast<int64_t>(plain.lse.size()));
    EXPECT_LE(out.max_abs, 1e-6) << (causal ? "causal" : "full");
    EXPECT_LE(lse.max_abs, 1e-5) << (causal ? "causal" : "full");
  }
}

// The remedy's gain on the defect issue 35 describes. Measured at N = 1024, 8 query heads over
// 2 KV heads, seed 0: sage2_8b reaches cosine 0.9936-0.9957 on channel_offset and 0.9993-0.9995
// with the balance (d = 64 and 128, causal and not); sage1_b 0.9932-0.9958 and 0.9998.
TEST(QKChannelBalance, RecoversAccuracyOnChannelOffsets) {
  for (const char* name : {"sage2_8b", "sage1_b", "sage2pp_8b"})
    for (int64_t d : {64, 128})
      for (bool causal : {false, true}) {
        const SyntheticInputs in = reference::make_synthetic("channel_offset", gqa_shape(d), 0);
        const std::vector<double> ref = exact(in, causal);
        const auto cosine = [&](const Recipe& r) {
          const SimRun run = simulate(r, in, causal);
          return reference::compare(run.out.data(), ref.data(), static_cast<int64_t>(ref.size())).cosine;
        };
        const double plain = cosine(preset(name)), bal = cosine(balanced(preset(name)));
        const std::string where = std::string(name) + " d " + std::to_string(d) + (causal ? " causal" : "");
        EXPECT_LT(plain, 0.997) << where << ": the defect no longer shows; is the distribution still hard?";
        EXPECT_GE(bal, 0.999) << where;  // the bar is 0.998
      }
}

// On inputs without channel offsets no channel's ranges differ by 4x: every s_c is 1 and the
// balance computes the recipe's own bits (rules::qk_balance_scale), on every distribution
// whose Q and K channels share one scale, for both head dims, GQA, causal or not.
TEST(QKChannelBalance, SameBitsWithoutChannelOffsets) {
  for (const char* dist : {"normal", "k_bias", "sharp", "sink"})
    for (int64_t d : {64, 128})
      for (bool causal : {false, true}) {
        const SyntheticInputs in = reference::make_synthetic(dist, gqa_shape(d), 0);
        const SimRun plain = simulate(preset("sage2_8b"), in, causal);
        const SimRun bal = simulate(balanced(preset("sage2_8b")), in, causal);
        EXPECT_EQ(bal.out, plain.out) << dist << " d " << d << (causal ? " causal" : "");
        EXPECT_EQ(bal.lse, plain.lse) << dist << " d " << d << (causal ? " causal" : "");
      }
}

// And where they do differ, every s_c moved was one whose ranges differ by 4x or more.
TEST(QKChannelBalance, ScalesMoveOnlyFromAFourfoldRatio) {
  EXPECT_EQ(rules::qk_balance_scale(3.9f, 1.f), 1.f);
  EXPECT_EQ(rules::qk_balance_scale(1.f, 4.f), 1.f);     // L = -2
  EXPECT_EQ(rules::qk_balance_scale(4.f, 1.f), 2.f);     // L = 2: s = 2^1
  EXPECT_EQ(rules::qk_balance_scale(1.f, 4.1f), 0.5f);   // L = -3: s = 2^-1
  EXPECT_EQ(rules::qk_balance_scale(64.f, 1.f), 8.f);   // L = 6: s = 2^3, ranges 8 and 8
  EXPECT_EQ(rules::qk_balance_scale(1.f, 0.f), 1.f);
  EXPECT_EQ(rules::qk_balance_scale(std::numeric_limits<float>::infinity(), 1.f), 1.f);
  EXPECT_EQ(rules::qk_balance_scale(std::nanf(""), 1.f), 1.f);
  EXPECT_EQ(rules::qk_balance_scale(1e30f, 1e-30f), std::ldexp(1.f, rules::kMaxBalanceExponent));
}

void expect_invalid(const Recipe& r, const std::string& option, const std::string& words) {
  try {
    validate_recipe(r);
    ADD_FAILURE() << r.name << " validated";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), option);
    EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
  }
}

TEST(QKChannelBalance, ValidationNamesTheOption) {
  validate_recipe(balanced(preset("sage2_8b")));
  validate_recipe(balanced(preset("int_flash_q")));
  expect_invalid(balanced(preset("int_flash")), "recipe.qk_channel_balance", "floating inputs");
  expect_invalid(balanced(preset("sagebwd")), "recipe.qk_channel_balance", "backward");
}

// The balance is an operand policy of the Q and K quantizers, not a kernel of its own: every
// recipe the GPU runs, it runs balanced (with floating inputs and no backward). In a build
// without CUDA both sides are false.
TEST(QKChannelBalance, GpuRunsItWhereItRunsTheRecipe) {
  for (const Recipe& r : presets()) {
    if (r.inputs != Inputs::floating || has_backward(r)) continue;
    EXPECT_EQ(gpu_supports(balanced(r)), gpu_supports(r)) << r.name;
  }
}

// The "auto" preset is sage2_8b with the balance, nothing else.
TEST(QKChannelBalance, AutoPresetIsBalancedSage2) {
  Recipe expected = balanced(preset("sage2_8b"));
  expected.name = "sage2_8b_balanced";
  const Recipe& r = preset("sage2_8b_balanced");
  EXPECT_TRUE(r.qk_channel_balance);
  {
    const SyntheticInputs in = reference::make_synthetic("channel_offset", gqa_shape(64), 3);
    const SimRun a = simulate(r, in, true), b = simulate(expected, in, true);
    EXPECT_EQ(a.out, b.out) << "sage2_8b_balanced computes other numerics than sage2_8b + balance";
  }
  for (int64_t d : {64, 128})
    for (bool causal : {false, true}) {
      const SyntheticInputs in = reference::make_synthetic("channel_offset", gqa_shape(d), 0);
      const std::vector<double> ref = exact(in, causal);
      const SimRun run = simulate(r, in, causal);
      const double cosine =
          reference::compare(run.out.data(), ref.data(), static_cast<int64_t>(ref.size())).cosine;
      EXPECT_GE(cosine, 0.999) << "d " << d << (causal ? " causal" : "");  // issue 35's bar: 0.998
    }
}

}  // namespace
}  // namespace sage
