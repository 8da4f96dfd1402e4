// The backward references: exact_backward against finite differences of exact(), its
// invariances, and simulate_backward (the recipe's backward, docs/numerics.md "The backward")
// against exact_backward: accuracy, the INT8-dP ablation, causal, GQA, layouts, arguments.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <iostream>
#include <limits>
#include <string>
#include <vector>

#include "expect_refusal.h"
#include "numerics/formats.h"
#include "numerics/mask.h"
#include "numerics/quant_rules.h"
#include "numerics/tile.h"
#include "reference/backward.h"
#include "reference/metrics.h"
#include "reference/qk_quantize.h"
#include "reference/synthetic.h"
#include "sage/backward.h"
#include "sage/error.h"
#include "sm90/bwd/kernel_traits.h"

namespace sage {
namespace {

using reference::ErrorStats;
using reference::SyntheticInputs;
using reference::SyntheticShape;

bool print_measurements() { return std::getenv("SAGE_PRINT_MEASUREMENTS") != nullptr; }

SyntheticShape shape(int64_t hq, int64_t hkv, int64_t nq, int64_t nkv, int64_t d) {
  SyntheticShape s;
  s.heads_q = hq, s.heads_kv = hkv, s.n_q = nq, s.n_kv = nkv, s.head_dim = d;
  return s;
}

int64_t q_numel(const SyntheticShape& s) { return s.batch * s.heads_q * s.n_q * s.head_dim; }
int64_t kv_numel(const SyntheticShape& s) { return s.batch * s.heads_kv * s.n_kv * s.head_dim; }
TensorView q_view(void* p, DType t, const SyntheticShape& s) {
  return contiguous_view(p, t, {s.batch, s.heads_q, s.n_q, s.head_dim});
}
TensorView kv_view(void* p, DType t, const SyntheticShape& s) {
  return contiguous_view(p, t, {s.batch, s.heads_kv, s.n_kv, s.head_dim});
}

// Gradients (and the forward's output) of one backward call, in the dtype T of their views.
template <class T>
struct Grads {
  std::vector<T> dq, dk, dv, out;
  std::vector<float> lse;
};

// Runs `fn` (exact_backward or simulate_backward) on views of the given inputs (dtype `in`),
// writing T outputs of dtype `out`.
template <class T>
Grads<T> run(void (*fn)(const BackwardArgs&), const SyntheticShape& s, DType in, void* q, void* k,
             void* v, void* dout, DType out, bool causal, const Recipe& recipe,
             std::optional<float> sm_scale = std::nullopt) {
  Grads<T> g;
  g.dq.resize(q_numel(s)), g.out.resize(q_numel(s));
  g.dk.resize(kv_numel(s)), g.dv.resize(kv_numel(s));
  g.lse.resize(static_cast<size_t>(s.batch * s.heads_q * s.n_q));
  BackwardArgs a;
  a.q = q_view(q, in, s), a.k = kv_view(k, in, s), a.v = kv_view(v, in, s);
  a.dout = q_view(dout, in, s);
  a.dq = q_view(g.dq.data(), out, s), a.out = q_view(g.out.data(), out, s);
  a.dk = kv_view(g.dk.data(), out, s), a.dv = kv_view(g.dv.data(), out, s);
  a.lse = contiguous_view(g.lse.data(), DType::f32, {s.batch, s.heads_q, s.n_q});
  a.causal = causal;
  a.recipe = recipe;
  a.sm_scale = sm_scale;
  fn(a);
  return g;
}

// ---- exact_backward against finite differences ------------------------------------------

// Values exactly representable in fp16 and small, so that x +- 2^-16 is exact in float: the
// perturbed inputs are what the difference quotient assumes.
std::vector<float> fp16_values(int64_t n, uint64_t seed) {
  reference::Rng rng(seed);
  std::vector<float> x(static_cast<size_t>(n));
  for (float& v : x) v = fmt::round_fp16(static_cast<float>(rng.normal()));
  return x;
}

struct SmallCase {
  SyntheticShape s;
  std::vector<float> q, k, v, dout;
};

SmallCase small_case(const SyntheticShape& s, uint64_t seed) {
  return {s, fp16_values(q_numel(s), seed), fp16_values(kv_numel(s), seed + 1),
          fp16_values(kv_numel(s), seed + 2), fp16_values(q_numel(s), seed + 3)};
}

// The loss sum(out * dout) of exact() in float64.
double exact_loss(SmallCase& c, bool causal, float sm_scale) {
  std::vector<double> out(static_cast<size_t>(q_numel(c.s)));
  AttentionArgs a;
  a.q = q_view(c.q.data(), DType::f32, c.s);
  a.k = kv_view(c.k.data(), DType::f32, c.s);
  a.v = kv_view(c.v.data(), DType::f32, c.s);
  a.out = q_view(out.data(), DType::f64, c.s);
  a.causal = causal;
  a.sm_scale = sm_scale;
  reference::exact(a);
  double loss = 0;
  for (size_t i = 0; i < out.size(); ++i) loss += out[i] * c.dout[i];
  return loss;
}

// Central differences of the loss in every element of one tensor of c, against `grad`.
void expect_matches_differences(SmallCase& c, std::vector<float>& x, const std::vector<double>& grad,
                                bool causal, float sm_scale, const char* name) {
  constexpr float h = 1.f / 65536;
  double worst = 0, scale = 0;
  for (size_t e = 0; e < x.size(); ++e) {
    const float keep = x[e];
    x[e] = keep + h;
    const double up = exact_loss(c, causal, sm_scale);
    x[e] = keep - h;
    const double down = exact_loss(c, causal, sm_scale);
    x[e] = keep;
    worst = std::max(worst, std::fabs((up - down) / (2.0 * h) - grad[e]));
    scale = std::max(scale, std::fabs(grad[e]));
  }
  if (print_measurements())
    std::cout << "MEASURED finite-differences " << name << " worst " << worst << " of " << scale << "\n";
  // Truncation error ~h^2 = 2^-32 and the loss's rounding ~1e-16 / h: both near 1e-10.
  EXPECT_LT(worst, 1e-7 * std::max(1.0, scale)) << name << " (largest gradient " << scale << ")";
}

void check_exact_backward(const SyntheticShape& s, bool causal, uint64_t seed, float sm_scale = 0.3f) {
  SmallCase c = small_case(s, seed);
  const Grads<double> g = run<double>(&reference::exact_backward, s, DType::f32, c.q.data(),
                                      c.k.data(), c.v.data(), c.dout.data(), DType::f64, causal,
                                      Recipe{}, sm_scale);
  expect_matches_differences(c, c.q, g.dq, causal, sm_scale, "dq");
  expect_matches_differences(c, c.k, g.dk, causal, sm_scale, "dk");
  expect_matches_differences(c, c.v, g.dv, causal, sm_scale, "dv");
}

TEST(ExactBackward, MatchesFiniteDifferences) { check_exact_backward(shape(2, 2, 5, 7, 8), false, 1); }
TEST(ExactBackward, MatchesFiniteDifferencesCausalMoreKeys) {
  check_exact_backward(shape(1, 1, 5, 9, 8), true, 2);
}
// Rows 0..3 see no key: their gradient is 0, and they add nothing to dK and dV.
TEST(ExactBackward, MatchesFiniteDifferencesCausalMoreQueries) {
  check_exact_backward(shape(1, 1, 9, 5, 4), true, 3);
}
TEST(ExactBackward, MatchesFiniteDifferencesGqaAndMqa) {
  check_exact_backward(shape(4, 2, 4, 6, 8), true, 4);
  check_exact_backward(shape(3, 1, 4, 5, 4), false, 5, 0.125f);
}

// ---- simulate_backward against exact_backward ---------------------------------------------

struct Accuracy {
  ErrorStats dq, dk, dv;
};

// A synthetic case's fp16 inputs and dO, and exact_backward's gradients of them.
struct Case {
  SyntheticInputs in;
  std::vector<uint16_t> dout;
  bool causal = false;
  Grads<double> exact;
};

Case make_case(const std::string& dist, const SyntheticShape& s, bool causal, uint64_t seed = 0) {
  Case c{reference::make_synthetic(dist, s, seed), reference::synthetic_output_gradient(s, seed), causal, {}};
  c.exact = run<double>(&reference::exact_backward, s, DType::f16, c.in.q.data(), c.in.k.data(),
                        c.in.v.data(), c.dout.data(), DType::f64, causal, Recipe{});
  return c;
}

Grads<float> simulate(Case& c, const Recipe& r) {
  return run<float>(&reference::simulate_backward, c.in.shape, DType::f16, c.in.q.data(),
                    c.in.k.data(), c.in.v.data(), c.dout.data(), DType::f32, c.causal, r);
}

ErrorStats compare(const std::vector<float>& a, const std::vector<double>& ref) {
  return reference::compare(a.data(), ref.data(), static_cast<int64_t>(ref.size()));
}

Accuracy accuracy(Case& c, const Recipe& r, const std::string& label) {
  const Grads<float> g = simulate(c, r);
  const Accuracy a{compare(g.dq, c.exact.dq), compare(g.dk, c.exact.dk), compare(g.dv, c.exact.dv)};
  if (print_measurements())
    for (const auto& [name, e] : {std::pair<const char*, ErrorStats>{"dq", a.dq}, {"dk", a.dk}, {"dv", a.dv}})
      std::cout << "MEASURED backward " << label << " " << name << " cos " << e.cosine << " rel_l1 "
                << e.rel_l1 << "\n";
  for (const ErrorStats* e : {&a.dq, &a.dk, &a.dv}) EXPECT_EQ(e->nonfinite, 0) << label;
  return a;
}

// sagebwd's forward formats, every backward matmul in 16 bits, Q/K and P/V too: only 16-bit
// roundings remain.
Recipe all_16_bit() {
  Recipe r = preset("sagebwd");
  r.name = "all 16-bit";
  r.qk_format = QKFormat::fp16;
  r.qk_granularity = Granularity::per_tensor;
  r.pv_format = PVFormat::fp16;
  r.p_scale = PScale::none;
  r.v_scale = VScale::none;
  r.dv_format = r.dp_format = r.dq_format = r.dk_format = BwdFormat::fp16;
  return r;
}

Recipe int8_dp() {
  Recipe r = preset("sagebwd");
  r.name = "sagebwd int8 dP";
  r.dp_format = BwdFormat::int8;
  return r;
}

TEST(SimBackward, SixteenBitRecipeMatchesExact) {
  for (bool causal : {false, true}) {
    Case c = make_case("normal", shape(4, 2, 200, 300, 64), causal, 1);
    const Accuracy a = accuracy(c, all_16_bit(), causal ? "16-bit causal" : "16-bit");
    for (const ErrorStats* e : {&a.dq, &a.dk, &a.dv}) {
      EXPECT_GT(e->cosine, 0.99999);
      EXPECT_LT(e->rel_l1, 2e-3);
    }
  }
}

// The expected order on normal inputs (dV cosine >= 0.999, dQ and dK >= 0.995),
// d = 64 and 128, causal or not. Measured (1 - cos / rel. L1, N = 512, 2 heads): dV 1.9e-4 /
// 0.019, dQ 2.6e-4 / 0.022, dK 2.1e-4 / 0.020 (d = 128; d = 64 and causal within 30%; with
// sagebwd_block's dS per tile dQ and dK are 1.4e-3 / 0.053).
TEST(SimBackward, SagebwdReachesTheExpectedAccuracy) {
  for (int64_t d : {64, 128})
    for (bool causal : {false, true}) {
      Case c = make_case("normal", shape(2, 2, 512, 512, d), causal);
      const std::string label = "sagebwd normal d" + std::to_string(d) + (causal ? " causal" : "");
      const Accuracy a = accuracy(c, preset("sagebwd"), label);
      EXPECT_GE(a.dv.cosine, 0.999) << label;
      EXPECT_GE(a.dq.cosine, 0.995) << label;
      EXPECT_GE(a.dk.cosine, 0.995) << label;
      EXPECT_LT(a.dv.rel_l1, 0.03) << label;
      EXPECT_LT(std::max(a.dq.rel_l1, a.dk.rel_l1), 0.08) << label;
    }
}

// SageBwd keeps dP = dO V^T in 16 bits: its error enters dS and from there dQ and dK. On
// normal inputs the INT8 ablation is measurably worse (1 - cos of dQ 3.5e-4 vs 2.6e-4; with
// dS per tile, whose own rounding dominates, 1.50e-3 vs 1.41e-3); with a channel bias in V
// (v_bias), whose large common part dP - D cancels, INT8 dO and V lose the difference: 2.7e-3
// vs 3.1e-4 (per tile 3.7e-3 vs 1.3e-3). Reported, and asserted only as "worse" (and 2x on
// v_bias).
TEST(SimBackward, Int8DpAblationIsWorseOnDq) {
  for (const char* dist : {"normal", "v_bias"}) {
    Case c = make_case(dist, shape(2, 2, 512, 512, 128), false);
    const Accuracy fp16 = accuracy(c, preset("sagebwd"), std::string(dist) + " sagebwd");
    const Accuracy int8 = accuracy(c, int8_dp(), std::string(dist) + " int8-dP");
    EXPECT_GT(1 - int8.dq.cosine, 1 - fp16.dq.cosine) << dist;
    EXPECT_GT(int8.dq.rel_l1, fp16.dq.rel_l1) << dist;
    EXPECT_EQ(int8.dv.cosine, fp16.dv.cosine) << "dV does not depend on dP";
    if (std::string(dist) == "v_bias") EXPECT_GT(1 - int8.dq.cosine, 2 * (1 - fp16.dq.cosine));
  }
}

// The scale granularities of the backward's INT8 P and dS (bwd_p_granularity,
// bwd_ds_granularity): per token follows the spread of diffuse attention that one scale per
// 64 x 128 tile cannot. Measured on normal: dV 1 - cos 1.1e-3 (P per block, the paper's) vs
// 1.9e-4 (per key, sagebwd's); dQ 1.4e-3 (dS per block, sagebwd_block) vs 2.6e-4 (per token,
// sagebwd), dK 1.4e-3 vs 2.1e-4.
TEST(SimBackward, PerTokenScalesBeatPerBlockOnDiffuseAttention) {
  Case c = make_case("normal", shape(2, 2, 512, 512, 128), false);
  Recipe p_block = preset("sagebwd");
  p_block.bwd_p_granularity = Granularity::per_block;
  const Accuracy token = accuracy(c, preset("sagebwd"), "sagebwd");
  const Accuracy ds_block = accuracy(c, preset("sagebwd_block"), "sagebwd_block");
  const Accuracy pb = accuracy(c, p_block, "P per block");
  EXPECT_GT(1 - pb.dv.cosine, 3 * (1 - token.dv.cosine));
  EXPECT_GT(1 - ds_block.dq.cosine, 3 * (1 - token.dq.cosine));
  EXPECT_GT(1 - ds_block.dk.cosine, 3 * (1 - token.dk.cosine));
  EXPECT_EQ(pb.dq.cosine, token.dq.cosine) << "P's granularity touches dV only";
  EXPECT_EQ(ds_block.dv.cosine, token.dv.cosine) << "dS's granularity touches dQ and dK only";
}

// The backward runs the recipe's own forward: its out and lse are simulate()'s, bit for bit.
TEST(SimBackward, ForwardOutputsAreSimulates) {
  Case c = make_case("k_bias", shape(2, 1, 150, 260, 64), true, 3);
  const Grads<float> g = simulate(c, preset("sagebwd"));
  std::vector<float> out(g.out.size()), lse(g.lse.size());
  AttentionArgs a;
  a.q = c.in.q_view(), a.k = c.in.k_view(), a.v = c.in.v_view();
  a.out = q_view(out.data(), DType::f32, c.in.shape);
  a.lse = contiguous_view(lse.data(), DType::f32, {1, 2, 150});
  a.causal = true;
  a.recipe = preset("sagebwd");
  reference::simulate(a);
  EXPECT_EQ(out, g.out);
  EXPECT_EQ(lse, g.lse);
}

// GQA: dK and dV of a KV head are its query heads' gradients summed in head order, which is
// what MHA with K and V repeated gives once its per-head dK, dV are summed the same way.
TEST(SimBackward, GqaSumsTheGradientsOfItsQueryHeads) {
  Case g = make_case("normal", shape(4, 2, 100, 140, 64), true, 5);
  SyntheticShape ms = g.in.shape;
  ms.heads_kv = 4;
  std::vector<uint16_t> k(static_cast<size_t>(kv_numel(ms))), v(k.size());
  const int64_t per_head = ms.n_kv * ms.head_dim;
  for (int64_t h = 0; h < 4; ++h)
    for (int64_t e = 0; e < per_head; ++e) {
      k[h * per_head + e] = g.in.k[(h / 2) * per_head + e];
      v[h * per_head + e] = g.in.v[(h / 2) * per_head + e];
    }
  const Grads<float> gq = simulate(g, preset("sagebwd"));
  const Grads<float> mh = run<float>(&reference::simulate_backward, ms, DType::f16, g.in.q.data(),
                                     k.data(), v.data(), g.dout.data(), DType::f32, true,
                                     preset("sagebwd"));
  EXPECT_EQ(gq.dq, mh.dq);
  for (int64_t kvh = 0; kvh < 2; ++kvh)
    for (int64_t e = 0; e < per_head; ++e) {
      const int64_t a = (2 * kvh) * per_head + e, b = (2 * kvh + 1) * per_head + e;
      ASSERT_EQ(gq.dk[kvh * per_head + e], mh.dk[a] + mh.dk[b]) << e;
      ASSERT_EQ(gq.dv[kvh * per_head + e], mh.dv[a] + mh.dv[b]) << e;
    }
}

// The same inputs in NHD give the same bits; repeated runs (threads) too.
TEST(SimBackward, LayoutIndependentAndDeterministic) {
  Case c = make_case("outliers", shape(2, 1, 90, 200, 64), true, 6);
  const Grads<float> hnd = simulate(c, preset("sagebwd"));
  EXPECT_EQ(hnd.dk, simulate(c, preset("sagebwd")).dk);
  auto to_nhd = [](const std::vector<uint16_t>& x, int64_t heads, int64_t n, int64_t d) {
    std::vector<uint16_t> y(x.size());
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t t = 0; t < n; ++t)
        for (int64_t e = 0; e < d; ++e) y[(t * heads + h) * d + e] = x[(h * n + t) * d + e];
    return y;
  };
  auto q = to_nhd(c.in.q, 2, 90, 64), k = to_nhd(c.in.k, 1, 200, 64), v = to_nhd(c.in.v, 1, 200, 64);
  auto dout = to_nhd(c.dout, 2, 90, 64);
  std::vector<float> dq(hnd.dq.size()), dk(hnd.dk.size()), dv(hnd.dv.size());
  BackwardArgs a;
  a.layout = Layout::NHD;
  a.causal = true;
  a.recipe = preset("sagebwd");
  a.q = contiguous_view(q.data(), DType::f16, {1, 90, 2, 64});
  a.dout = contiguous_view(dout.data(), DType::f16, {1, 90, 2, 64});
  a.k = contiguous_view(k.data(), DType::f16, {1, 200, 1, 64});
  a.v = contiguous_view(v.data(), DType::f16, {1, 200, 1, 64});
  a.dq = contiguous_view(dq.data(), DType::f32, {1, 90, 2, 64});
  a.dk = contiguous_view(dk.data(), DType::f32, {1, 200, 1, 64});
  a.dv = contiguous_view(dv.data(), DType::f32, {1, 200, 1, 64});
  reference::simulate_backward(a);
  for (int64_t h = 0; h < 2; ++h)
    for (int64_t t = 0; t < 90; ++t)
      for (int64_t e = 0; e < 64; ++e) ASSERT_EQ(dq[(t * 2 + h) * 64 + e], hnd.dq[(h * 90 + t) * 64 + e]);
  EXPECT_EQ(dk, hnd.dk);  // one KV head: NHD and HND coincide
  EXPECT_EQ(dv, hnd.dv);
}

// Causal with n_q > n_kv: rows that see no key have dQ = 0 and add nothing to dK, dV.
TEST(SimBackward, RowsWithoutKeysHaveZeroGradient) {
  Case c = make_case("normal", shape(2, 2, 200, 64, 64), true, 7);
  const Grads<float> g = simulate(c, preset("sagebwd"));
  for (int64_t h = 0; h < 2; ++h)
    for (int64_t i = 0; i < 136; ++i)
      for (int64_t e = 0; e < 64; ++e) ASSERT_EQ(g.dq[(h * 200 + i) * 64 + e], 0.f);
  const Accuracy a = accuracy(c, preset("sagebwd"), "rows without keys");
  EXPECT_GT(a.dq.cosine, 0.99);
  EXPECT_GT(a.dv.cosine, 0.999);
}

// A zero dO has zero gradients exactly; bf16 inputs keep the accuracy of fp16 ones.
TEST(SimBackward, ZeroGradientAndBf16Inputs) {
  Case c = make_case("normal", shape(2, 1, 130, 170, 64), false, 8);
  std::vector<uint16_t> zero(c.dout.size(), 0);
  const Grads<float> z = run<float>(&reference::simulate_backward, c.in.shape, DType::f16, c.in.q.data(),
                                    c.in.k.data(), c.in.v.data(), zero.data(), DType::f32, false,
                                    preset("sagebwd"));
  for (const auto* x : {&z.dq, &z.dk, &z.dv})
    for (float e : *x) ASSERT_EQ(e, 0.f);
  auto bf16 = [](const std::vector<uint16_t>& x) {
    std::vector<uint16_t> y(x.size());
    for (size_t i = 0; i < x.size(); ++i) y[i] = fmt::bf16_bits(fmt::fp16_from_bits(x[i]));
    return y;
  };
  auto q = bf16(c.in.q), k = bf16(c.in.k), v = bf16(c.in.v), dout = bf16(c.dout);
  const SyntheticShape& s = c.in.shape;
  const Grads<double> ref = run<double>(&reference::exact_backward, s, DType::bf16, q.data(), k.data(),
                                        v.data(), dout.data(), DType::f64, false, Recipe{});
  const Grads<float> g = run<float>(&reference::simulate_backward, s, DType::bf16, q.data(), k.data(),
                                    v.data(), dout.data(), DType::f32, false, preset("sagebwd"));
  EXPECT_GT(compare(g.dv, ref.dv).cosine, 0.999);
  EXPECT_GT(compare(g.dq, ref.dq).cosine, 0.995);
  EXPECT_GT(compare(g.dk, ref.dk).cosine, 0.995);
}

// K smoothing leaves attention and its exact gradients unchanged (docs/numerics.md, "K
// smoothing in the backward"); quantized, it is what keeps INT8 K accurate on k_bias.
TEST(SimBackward, KSmoothingKeepsGradientsAccurateOnKBias) {
  Case c = make_case("k_bias", shape(2, 2, 256, 512, 128), false, 9);
  Recipe plain = preset("sagebwd");
  plain.smooth_k = false;
  const Accuracy smooth = accuracy(c, preset("sagebwd"), "k_bias smoothed");
  const Accuracy off = accuracy(c, plain, "k_bias not smoothed");
  EXPECT_LT(1 - smooth.dq.cosine, 1 - off.dq.cosine);
  EXPECT_LT(1 - smooth.dk.cosine, 1 - off.dk.cosine);
  EXPECT_GE(smooth.dq.cosine, 0.995);
  EXPECT_GE(smooth.dk.cosine, 0.995);
}

// Adding one vector to every key shifts each row's scores by a constant: the exact gradients
// do not move (dQ gains rowsum(dS) c = 0, dK and dV are unchanged).
TEST(ExactBackward, ShiftingEveryKeyChangesNoGradient) {
  SmallCase c = small_case(shape(2, 1, 6, 9, 8), 20);
  const Grads<double> a = run<double>(&reference::exact_backward, c.s, DType::f32, c.q.data(), c.k.data(),
                                      c.v.data(), c.dout.data(), DType::f64, true, Recipe{}, 0.35f);
  for (int64_t t = 0; t < 9; ++t)
    for (int64_t e = 0; e < 8; ++e) c.k[t * 8 + e] += static_cast<float>(e % 3) - 1.5f;  // exact
  const Grads<double> b = run<double>(&reference::exact_backward, c.s, DType::f32, c.q.data(), c.k.data(),
                                      c.v.data(), c.dout.data(), DType::f64, true, Recipe{}, 0.35f);
  for (const auto& [x, y] : {std::pair{&a.dq, &b.dq}, {&a.dk, &b.dk}, {&a.dv, &b.dv}})
    for (size_t i = 0; i < x->size(); ++i) ASSERT_NEAR((*x)[i], (*y)[i], 1e-12) << i;
}

// docs/numerics.md, "The backward", recomputed here from its text on one tile (64 queries x
// 128 keys, d = 64) with sagebwd's formats, dS per token (sagebwd) and per tile
// (sagebwd_block): every gradient bit for bit.
TEST(SimBackward, OneTileFollowsTheContract) {
  const int64_t nq = 64, nkv = 128, d = 64;
  const SyntheticInputs in = reference::make_synthetic("normal", shape(1, 1, nq, nkv, d), 11);
  const SyntheticInputs o_src = reference::make_synthetic("normal", shape(1, 1, nq, nq, d), 12);
  const std::vector<uint16_t> dout_bits = reference::synthetic_output_gradient(in.shape, 11);
  auto floats = [](const std::vector<uint16_t>& x) {
    std::vector<float> y(x.size());
    for (size_t i = 0; i < x.size(); ++i) y[i] = fmt::fp16_from_bits(x[i]);
    return y;
  };
  const std::vector<float> q = floats(in.q), k = floats(in.k), v = floats(in.v);
  const std::vector<float> o = floats(o_src.q), dout = floats(dout_bits);
  const TileConfig tc = tile_config(static_cast<int>(d));
  const reference::sim::QKOperand qop =
      reference::sim::quantize_qk(q.data(), nq, d, QKFormat::int8, Granularity::per_block, true, tc);
  const reference::sim::QKOperand kop =
      reference::sim::quantize_qk(k.data(), nkv, d, QKFormat::int8, Granularity::per_block, false, tc);
  const float sm = 0.125f, sl2 = rules::sm_scale_log2(sm);
  auto acc_of = [&](int64_t i, int64_t j) {
    int32_t a = 0;
    for (int64_t c = 0; c < d; ++c) a += int32_t(qop.codes[i * d + c]) * kop.codes[j * d + c];
    return a;
  };
  auto mult_of = [&](int64_t i, int64_t j) { return (qop.scale[i] * kop.scale[j]) * sl2; };
  std::vector<float> lse2(nq);  // any LSE works; this one makes each row of P a distribution
  for (int64_t i = 0; i < nq; ++i) {
    double sum = 0;
    for (int64_t j = 0; j < nkv; ++j) sum += std::exp2(double(float(acc_of(i, j)) * mult_of(i, j)));
    lse2[i] = static_cast<float>(std::log2(sum));
  }
  reference::sim::BackwardHeadInputs bin;
  bin.n_q = nq, bin.n_kv = nkv, bin.d = d, bin.sm_scale = sm, bin.sm_scale_log2 = sl2;
  bin.q = &qop, bin.k = &kop, bin.q16 = q.data(), bin.k16 = k.data(), bin.v16 = v.data();
  bin.o16 = o.data(), bin.do16 = dout.data(), bin.lse2 = lse2.data();
  using reference::sim::HeadGradients;
  const HeadGradients g = reference::sim::backward_head(preset("sagebwd"), bin, backward_tile_config(int(d)));
  const HeadGradients gb = reference::sim::backward_head(preset("sagebwd_block"), bin, backward_tile_config(int(d)));

  // B2-B5: D, P, dP, dS.
  std::vector<float> D(nq), P(nq * nkv), dS(nq * nkv);
  for (int64_t i = 0; i < nq; ++i) {
    double s = 0;
    for (int64_t c = 0; c < d; ++c) s += double(dout[i * d + c]) * o[i * d + c];
    D[i] = float(s);
    for (int64_t j = 0; j < nkv; ++j) {
      P[i * nkv + j] = std::exp2(std::fma(float(acc_of(i, j)), mult_of(i, j), -lse2[i]));
      double dp = 0;
      for (int64_t c = 0; c < d; ++c) dp += double(dout[i * d + c]) * v[j * d + c];
      dS[i * nkv + j] = P[i * nkv + j] * (float(dp) - D[i]);
    }
  }
  auto amax = [](const float* x, int64_t n, int64_t stride) {
    float m = 0.f;
    for (int64_t e = 0; e < n; ++e) m = std::max(m, std::fabs(x[e * stride]));
    return m;
  };
  auto code = [](float x, float m) { return rules::round_clamp(x * rules::symmetric_inverse(m, 127.f), 127); };
  // B6: dO per Q tile, P per key (column), dV = fma(acc, s_P,j * s_dO, 0).
  const float do_max = amax(dout.data(), nq * d, 1), do_s = do_max / 127.f;
  for (int64_t j = 0; j < nkv; ++j) {
    const float p_max = amax(P.data() + j, nq, nkv);
    for (int64_t c = 0; c < d; ++c) {
      int32_t a = 0;
      for (int64_t i = 0; i < nq; ++i) a += code(P[i * nkv + j], p_max) * code(dout[i * d + c], do_max);
      ASSERT_EQ(g.dv[j * d + c], std::fma(float(a), (p_max / 127.f) * do_s, 0.f)) << j << " " << c;
    }
  }
  EXPECT_EQ(gb.dv, g.dv) << "dS's granularity touches dQ and dK only";
  // B7-B9: dS's group maxima row_max(i) for dQ's codes and key_max(j) for dK's;
  // dQ = fma(acc, s_dS,i * s_K, 0) * sm, dK = fma(acc, s_dS,j * s_Q, 0) * sm.
  auto expect_dq_dk = [&](const HeadGradients& got, auto row_max, auto key_max, const char* what) {
    SCOPED_TRACE(what);
    for (int64_t i = 0; i < nq; ++i)
      for (int64_t c = 0; c < d; ++c) {
        int32_t a = 0;
        for (int64_t j = 0; j < nkv; ++j) a += code(dS[i * nkv + j], row_max(i)) * kop.codes[j * d + c];
        ASSERT_EQ(got.dq[i * d + c], std::fma(float(a), (row_max(i) / 127.f) * kop.scale[0], 0.f) * sm)
            << i << " " << c;
      }
    for (int64_t j = 0; j < nkv; ++j)
      for (int64_t c = 0; c < d; ++c) {
        int32_t a = 0;
        for (int64_t i = 0; i < nq; ++i) a += code(dS[i * nkv + j], key_max(j)) * qop.codes[i * d + c];
        ASSERT_EQ(got.dk[j * d + c], std::fma(float(a), (key_max(j) / 127.f) * qop.scale[0], 0.f) * sm)
            << j << " " << c;
      }
  };
  // Per token (sagebwd): query row i over the tile's keys, key j over its rows.
  expect_dq_dk(
      g, [&](int64_t i) { return amax(dS.data() + i * nkv, nkv, 1); },
      [&](int64_t j) { return amax(dS.data() + j, nq, nkv); }, "dS per token");
  // Per tile (sagebwd_block): one group of all 64 x 128 entries.
  const float ds_max = amax(dS.data(), nq * nkv, 1);
  auto tile_max = [&](int64_t) { return ds_max; };
  expect_dq_dk(gb, tile_max, tile_max, "dS per tile");
}

// The backward's Q tiles nest in the forward's per_block Q groups at every head dim, and its
// K/V tiles are the forward's: per_block Q and K scales are one number per backward tile.
TEST(BackwardTiles, NestInTheForwardsScaleGroups) {
  for (int d : {32, 64, 96, 128, 256}) {
    const BackwardTileConfig bt = backward_tile_config(d);
    EXPECT_EQ(tile_config(d).block_q % bt.block_q, 0) << d;
    EXPECT_EQ(tile_config(d).block_kv, bt.block_kv) << d;
  }
}

// The sm_90 kernel's Q tiles per K/V tile (sm90/bwd/kernel_traits.h): the CTA of K/V tile j runs
// exactly the Q tiles with a row that sees a key of tile j, and the K/V tiles that add into a
// Q tile's dQ are 0 .. last_kv_tile (deterministic mode's turns are positions in that prefix).
// dQ's tile-major accumulator order (kernel_traits.h): a bijection of a tile's rows x channels
// onto [0, kBlockQ * D), in which the thread holding a value (the wgmma accumulator layout)
// stores its group of four at one 16-byte slot, a warp's 32 slots contiguous.
TEST(BackwardTiles, DqFragmentIndexIsTheAccumulatorLayoutAndABijection) {
  using sm90::bwd::dq_fragment_index;
  using sm90::bwd::kBlockQ;
  for (int d : {64, 128}) {
    SCOPED_TRACE(d);
    std::vector<int> hits(size_t(kBlockQ) * d, 0);
    for (int row = 0; row < kBlockQ; ++row)
      for (int ch = 0; ch < d; ++ch) {
        const int at = dq_fragment_index(row, ch, d);
        ASSERT_GE(at, 0);
        ASSERT_LT(at, kBlockQ * d);
        ++hits[size_t(at)];
      }
    for (int h : hits) ASSERT_EQ(h, 1);
    // The writer's side (accumulate.cuh): thread ct's value x at (x / 4) * 1024 + 4 ct + x % 4.
    for (int ct = 0; ct < 256; ++ct)
      for (int x = 0; x < d / 4; ++x) {
        const int c = ct / 128, w = (ct / 32) % 4, lane = ct % 32, g = lane / 4, t = lane % 4;
        const int row = 16 * w + g + (x % 4 >= 2 ? 8 : 0);
        const int ch = c * d / 2 + 8 * (x / 4) + 2 * t + (x & 1);
        ASSERT_EQ(dq_fragment_index(row, ch, d), (x / 4) * 1024 + 4 * ct + x % 4) << ct << " " << x;
      }
  }
}

TEST(BackwardTiles, KernelQTilesAreTheMasksAndTheirKvTilesAPrefix) {
  using sm90::bwd::kBlockKV;
  using sm90::bwd::kBlockQ;
  for (bool causal : {false, true})
    for (int n_q : {1, 63, 64, 65, 200, 333, 1024, 1088})
      for (int n_kv : {1, 127, 128, 129, 200, 333, 700, 1024}) {
        SCOPED_TRACE(std::to_string(n_q) + " x " + std::to_string(n_kv) + (causal ? " causal" : ""));
        const int q_tiles = (n_q + kBlockQ - 1) / kBlockQ, kv_tiles = (n_kv + kBlockKV - 1) / kBlockKV;
        const KeyWindow window{-1, causal ? 0 : -1};
        for (int t = 0; t < q_tiles; ++t) {
          int contributors = 0, highest = -1;
          for (int j = 0; j < kv_tiles; ++j) {
            bool sees = false;
            for (int i = t * kBlockQ; i < std::min(n_q, (t + 1) * kBlockQ); ++i) {
              const KeyRange keys = visible_keys(i, n_q, n_kv, window);
              sees = sees || (!keys.empty() && keys.begin < (j + 1) * kBlockKV && keys.end > j * kBlockKV);
            }
            const bool runs = sm90::bwd::first_q_tile(j * kBlockKV, n_q, n_kv, causal) <= t;
            ASSERT_EQ(runs, sees) << "Q tile " << t << ", K/V tile " << j;
            if (runs) ++contributors, highest = j;
          }
          if (contributors == 0) continue;
          ASSERT_EQ(highest, contributors - 1) << "Q tile " << t << ": not a prefix";
          ASSERT_EQ(sm90::bwd::last_kv_tile(t, n_q, n_kv, kv_tiles, causal), highest) << "Q tile " << t;
        }
      }
}

// Deterministic mode's turn taking (sm90/bwd/order.cuh) played out on the CPU: the grid's CTAs
// dispatched in increasing linear index (blockIdx.x fastest) onto `slots` SMs, one CTA each,
// every resident CTA taking its next step whenever its turn has come. Every CTA finishes with
// any number of slots, one included (each waits only for CTAs dispatched before it), and every
// sum gets its additions in the promised order: a Q tile's dQ from its highest K/V tile down,
// a K/V tile's dK and dV (under GQA) from the group's first query head up.
struct TurnGrid {
  int batch, heads_q, heads_kv, n_q, n_kv;
  bool causal;
};

struct TurnStep {
  size_t counter;
  int turn, who;  // who: the K/V tile (dQ) or the query head (dK, dV) that adds
};

// Each CTA's steps, in linear block index order.
std::vector<std::vector<TurnStep>> turn_steps(const TurnGrid& g, size_t& counters) {
  using namespace sm90::bwd;
  const int kv_tiles = (g.n_kv + kBlockKV - 1) / kBlockKV, q_tiles = (g.n_q + kBlockQ - 1) / kBlockQ;
  const int group = g.heads_q / g.heads_kv;
  const size_t dq_counters = size_t(g.batch * g.heads_q * q_tiles);
  counters = dq_counters + size_t(g.batch * g.heads_kv * kv_tiles);
  std::vector<std::vector<TurnStep>> ctas;
  for (int b = 0; b < g.batch; ++b)
    for (int h = 0; h < g.heads_q; ++h)
      for (int x = 0; x < kv_tiles; ++x) {
        const int j = kv_tile_of_block(x, kv_tiles, true);
        std::vector<TurnStep> steps;
        for (int t = first_q_tile(j * kBlockKV, g.n_q, g.n_kv, g.causal); t < q_tiles; ++t)
          steps.push_back({size_t((b * g.heads_q + h) * q_tiles + t),
                           dq_turn(t, j, g.n_q, g.n_kv, kv_tiles, g.causal), j});
        if (group > 1 && !steps.empty())
          steps.push_back({dq_counters + size_t((b * g.heads_kv + h / group) * kv_tiles + j), h % group, h});
        ctas.push_back(steps);
      }
  return ctas;
}

// The additions each counter's sum received, in order; empty if the grid deadlocks.
std::vector<std::vector<int>> play_turns(const TurnGrid& g, size_t slots) {
  size_t counters = 0;
  const std::vector<std::vector<TurnStep>> ctas = turn_steps(g, counters);
  std::vector<int> count(counters, 0);
  std::vector<std::vector<int>> order(counters);
  std::vector<size_t> done(ctas.size(), 0), resident;
  size_t next = 0;
  while (true) {
    while (resident.size() < slots && next < ctas.size()) resident.push_back(next++);
    if (resident.empty()) return order;
    bool moved = false;
    for (size_t r = 0; r < resident.size();) {
      const size_t c = resident[r];
      if (done[c] < ctas[c].size() && count[ctas[c][done[c]].counter] == ctas[c][done[c]].turn) {
        const TurnStep& s = ctas[c][done[c]++];
        order[s.counter].push_back(s.who);
        ++count[s.counter];
        moved = true;
      }
      if (done[c] == ctas[c].size()) {
        resident.erase(resident.begin() + std::ptrdiff_t(r));
        moved = true;
      } else {
        ++r;
      }
    }
    if (!moved) return {};
  }
}

TEST(BackwardTiles, DeterministicTurnsFinishAndAddInTheirOrder) {
  using sm90::bwd::kBlockKV;
  using sm90::bwd::kBlockQ;
  const TurnGrid grids[] = {{2, 4, 1, 1024, 1024, false}, {2, 4, 1, 1024, 1024, true},
                            {1, 2, 2, 1088, 700, true},   {1, 3, 1, 200, 333, true},
                            {1, 2, 1, 333, 1024, true},   {1, 4, 2, 64, 65, false},
                            {1, 1, 1, 1, 1, true}};
  for (const TurnGrid& g : grids)
    for (size_t slots : {1, 2, 7, 1000}) {
      SCOPED_TRACE(std::to_string(g.heads_q) + "/" + std::to_string(g.heads_kv) + " heads, " +
                   std::to_string(g.n_q) + " x " + std::to_string(g.n_kv) + (g.causal ? " causal, " : ", ") +
                   std::to_string(slots) + " slots");
      const std::vector<std::vector<int>> order = play_turns(g, slots);
      ASSERT_FALSE(order.empty()) << "deadlock";
      const int q_tiles = (g.n_q + kBlockQ - 1) / kBlockQ, kv_tiles = (g.n_kv + kBlockKV - 1) / kBlockKV;
      const int group = g.heads_q / g.heads_kv;
      for (int bh = 0; bh < g.batch * g.heads_q; ++bh)
        for (int t = 0; t < q_tiles; ++t) {
          std::vector<int> want;  // the K/V tiles that run Q tile t, highest first
          for (int j = kv_tiles - 1; j >= 0; --j)
            if (sm90::bwd::first_q_tile(j * kBlockKV, g.n_q, g.n_kv, g.causal) <= t) want.push_back(j);
          EXPECT_EQ(order[size_t(bh * q_tiles + t)], want) << "dQ of query head " << bh << ", Q tile " << t;
        }
      const size_t dq_counters = size_t(g.batch * g.heads_q * q_tiles);
      for (int kvh = 0; kvh < g.batch * g.heads_kv; ++kvh)
        for (int j = 0; j < kv_tiles; ++j) {
          std::vector<int> want;  // the group's query heads, in increasing order
          for (int h = 0; group > 1 && h < group; ++h) want.push_back((kvh % g.heads_kv) * group + h);
          EXPECT_EQ(order[dq_counters + size_t(kvh * kv_tiles + j)], want) << "dK, dV of KV head " << kvh;
        }
    }
}

// ---- arguments -----------------------------------------------------------------------------

class BackwardArgsTest : public ::testing::Test {
 protected:
  SyntheticShape s = shape(2, 1, 8, 12, 16);
  SyntheticInputs in = reference::make_synthetic("normal", s, 0);
  std::vector<uint16_t> dout = reference::synthetic_output_gradient(s, 0);
  std::vector<float> dq = std::vector<float>(q_numel(s)), dk = std::vector<float>(kv_numel(s));
  std::vector<float> dv = std::vector<float>(kv_numel(s));
  BackwardArgs args() {
    BackwardArgs a;
    a.q = in.q_view(), a.k = in.k_view(), a.v = in.v_view();
    a.dout = q_view(dout.data(), DType::f16, s);
    a.dq = q_view(dq.data(), DType::f32, s);
    a.dk = kv_view(dk.data(), DType::f32, s);
    a.dv = kv_view(dv.data(), DType::f32, s);
    a.recipe = preset("sagebwd");
    return a;
  }
  void expect_error(const BackwardArgs& a, const std::string& argument, const std::string& phrase) {
    EXPECT_REFUSAL(reference::simulate_backward(a), argument, phrase);
  }
};

// deterministic is the GPU's switch: the CPU references always add in a fixed order (GQA's dK
// and dV over the group's query heads in increasing order), so it is accepted and changes no bit.
TEST_F(BackwardArgsTest, DeterministicChangesNoBitOnTheCpu) {
  for (void (*fn)(const BackwardArgs&) : {&reference::simulate_backward, &reference::exact_backward}) {
    BackwardArgs a = args();  // 2 query heads on 1 KV head
    a.causal = true;
    fn(a);
    const std::vector<float> dq0 = dq, dk0 = dk, dv0 = dv;
    a.deterministic = true;
    fn(a);
    EXPECT_EQ(dq, dq0);
    EXPECT_EQ(dk, dk0);
    EXPECT_EQ(dv, dv0);
  }
}

TEST_F(BackwardArgsTest, ValidArgumentsRunAndEveryBadOneIsNamed) {
  EXPECT_NO_THROW(reference::simulate_backward(args()));
  BackwardArgs a = args();
  a.recipe = preset("sage2_8b");
  expect_error(a, "recipe.dv_format", "'sage2_8b' has no backward");
  EXPECT_NO_THROW(reference::exact_backward(a));  // the exact gradients need no recipe
  a = args();
  a.dout = kv_view(dout.data(), DType::f16, s);
  expect_error(a, "dout", "shape must equal q's shape");
  a = args();
  a.dout.dtype = DType::bf16;
  expect_error(a, "dout", "dtype must equal q's dtype f16");
  a = args();
  a.dq.dtype = DType::i8;
  expect_error(a, "dq", "dtype must be one of f16, bf16, f32, f64");
  a = args();
  a.dk = q_view(dk.data(), DType::f32, s);
  expect_error(a, "dk", "shape must equal k's shape");
  a = args();
  a.dv = TensorView{};
  expect_error(a, "dv", "undefined view");
  a = args();
  a.dq.strides[2] = 0;
  expect_error(a, "dq", "every element its own address");
  a = args();
  a.recipe.qk_granularity = Granularity::per_thread;
  expect_error(a, "recipe.dq_format", "one scale per K/V tile");
}

// The forward takes a V head dim of its own (DeepSeek MLA); the backward does not, and says so
// by naming v, whatever out is given as (absent, of q's shape or of v's).
TEST_F(BackwardArgsTest, VHeadDimOfItsOwnIsRefusedByName) {
  SyntheticShape sv = s;
  sv.head_dim_v = 8;
  const SyntheticInputs own = reference::make_synthetic("normal", sv, 0);
  std::vector<float> dv8(static_cast<size_t>(sv.batch * sv.heads_kv * sv.n_kv * 8));
  std::vector<float> out(static_cast<size_t>(q_numel(s)));
  for (void (*fn)(const BackwardArgs&) : {&reference::simulate_backward, &reference::exact_backward})
    for (int64_t out_dim : {int64_t(0), int64_t(16), int64_t(8)}) {
      SCOPED_TRACE(out_dim);
      BackwardArgs a = args();
      a.v = own.v_view();
      a.dv = contiguous_view(dv8.data(), DType::f32, {sv.batch, sv.heads_kv, sv.n_kv, 8});
      if (out_dim > 0)
        a.out = contiguous_view(out.data(), DType::f32, {s.batch, s.heads_q, s.n_q, out_dim});
      EXPECT_REFUSAL(fn(a), "v", "head_dim must equal q's head_dim 16 for the backward (got 8)");
    }
  // dv keeps v's shape: with equal head dims a dv of another head dim is still refused.
  BackwardArgs a = args();
  a.dv = contiguous_view(dv8.data(), DType::f32, {s.batch, s.heads_kv, s.n_kv, 8});
  expect_error(a, "dv", "shape must equal v's shape");
}

}  // namespace
}  // namespace sage
