// The papers' qualitative accuracy claims, checked with the simulator on synthetic tensors.
//
// Each claim compares errors (simulate vs exact) of two or more recipes on the same inputs,
// summed over several seeds, and asserts the ordering with a margin well inside what was
// measured (the measured ratios are in the comments and in docs/numerics.md). Where a claim
// is about one matmul, the other runs unquantized (fp16 P and V, or fp16 Q and K), so the
// comparison is not drowned by the other stage's error.
#include <gtest/gtest.h>

#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

#include "reference/metrics.h"
#include "reference/synthetic.h"
#include "sage/attention.h"

namespace sage {
namespace {

using reference::ErrorStats;
using reference::SyntheticInputs;
using reference::SyntheticShape;

SyntheticShape shape(int64_t heads, int64_t nq, int64_t nkv) {
  SyntheticShape s;
  s.batch = 1;
  s.heads_q = heads;
  s.heads_kv = heads;
  s.n_q = nq;
  s.n_kv = nkv;
  s.head_dim = 128;
  return s;
}

struct Case {
  SyntheticInputs in;
  std::vector<double> exact;
};

std::vector<Case> cases(const std::string& dist, const SyntheticShape& s, int seeds) {
  std::vector<Case> v;
  for (int seed = 0; seed < seeds; ++seed) {
    Case c{reference::make_synthetic(dist, s, 100 + seed), {}};
    c.exact.resize(static_cast<size_t>(s.batch * s.heads_q * s.n_q * s.head_dim));
    AttentionArgs a;
    a.q = c.in.q_view();
    a.k = c.in.k_view();
    a.v = c.in.v_view();
    a.out = contiguous_view(c.exact.data(), DType::f64, {s.batch, s.heads_q, s.n_q, s.head_dim});
    reference::exact(a);
    v.push_back(std::move(c));
  }
  return v;
}

// Mean over the cases of 1 - cosine and of relative L1.
struct Err {
  double cos_err = 0, rel_l1 = 0;
};
Err measure(const Recipe& r, const std::vector<Case>& cs, const char* label) {
  Err e;
  for (const Case& c : cs) {
    const SyntheticShape& s = c.in.shape;
    std::vector<float> out(c.exact.size());
    AttentionArgs a;
    a.q = c.in.q_view();
    a.k = c.in.k_view();
    a.v = c.in.v_view();
    a.recipe = r;
    a.out = contiguous_view(out.data(), DType::f32, {s.batch, s.heads_q, s.n_q, s.head_dim});
    reference::simulate(a);
    const ErrorStats st = reference::compare(out.data(), c.exact.data(), static_cast<int64_t>(out.size()));
    e.cos_err += (1 - st.cosine) / static_cast<double>(cs.size());
    e.rel_l1 += st.rel_l1 / static_cast<double>(cs.size());
  }
  if (std::getenv("SAGE_PRINT_MEASUREMENTS"))
    std::cout << "MEASURED " << label << " 1-cos " << e.cos_err << " rel_l1 " << e.rel_l1 << "\n";
  return e;
}

// PV in fp16 with an fp32 accumulator: isolates the QK^T stage's error.
Recipe qk_only(Recipe r) {
  r.pv_format = PVFormat::fp16;
  r.p_scale = PScale::none;
  r.v_scale = VScale::none;
  r.pv_accum = PVAccum::fp32;
  r.p_range = r.v_range = 0.f;
  return r;
}

// QK in fp16 (unquantized): isolates the PV stage's error.
Recipe pv_only(PVFormat f) {
  Recipe r;
  r.qk_format = QKFormat::fp16;
  r.qk_granularity = Granularity::per_tensor;
  r.smooth_k = false;
  r.pv_format = f;
  r.p_scale = PScale::static_max;
  r.v_scale = VScale::per_channel;
  r.pv_accum = PVAccum::fp32;
  return r;
}

// SageAttention: K carries a large per-channel bias shared by all tokens; subtracting mean(K)
// removes it before INT8 quantization (softmax ignores the per-row shift). With smoothing the
// error on k_bias is the error on bias-free K; without it, the bias sets the scale.
TEST(PaperClaims, KSmoothingRemovesTheChannelBiasError) {
  const auto biased = cases("k_bias", shape(2, 512, 1024), 3);
  const auto plain = cases("normal", shape(2, 512, 1024), 3);
  const Recipe with = preset("sage2_8b");
  Recipe without = with;
  without.smooth_k = false;
  const Err w = measure(with, biased, "sage2_8b k_bias");
  const Err wo = measure(without, biased, "sage2_8b-no-smooth_k k_bias");
  const Err ref = measure(with, plain, "sage2_8b normal");
  // Whole recipe (FP8 PV error included): measured 1-cos 7.0e-4 vs 1.4e-3, L1 0.037 vs 0.053;
  // smoothed k_bias 0.0372 vs normal 0.0375.
  EXPECT_GT(wo.cos_err, 1.4 * w.cos_err);
  EXPECT_GT(wo.rel_l1, 1.15 * w.rel_l1);
  EXPECT_LT(w.rel_l1, 1.05 * ref.rel_l1) << "smoothed K on k_bias is as good as bias-free K";
  // The QK stage alone: measured 1-cos 6.2e-5 vs 7.8e-4, L1 0.011 vs 0.039.
  const Err qw = measure(qk_only(with), biased, "qk-only smooth_k");
  const Err qwo = measure(qk_only(without), biased, "qk-only no smooth_k");
  EXPECT_GT(qwo.cos_err, 5 * qw.cos_err);
  EXPECT_GT(qwo.rel_l1, 2.2 * qw.rel_l1);
}

// SageAttention2: for INT4, smoothing Q (per-block mean, compensated by dS) on top of K beats
// smoothing K alone when Q has a channel bias.
TEST(PaperClaims, SmoothingQAndKBeatsKAloneForInt4) {
  const auto cs = cases("qk_bias", shape(2, 512, 1024), 3);
  const Recipe qk = preset("sage2_4b");
  Recipe k_only = qk;
  k_only.smooth_q = false;
  const Err both = measure(qk, cs, "sage2_4b smooth Q+K");
  const Err konly = measure(k_only, cs, "sage2_4b smooth K");
  // Measured: 1-cos 4.4e-2 vs 6.6e-2, L1 0.30 vs 0.37.
  EXPECT_GT(konly.cos_err, 1.25 * both.cos_err);
  EXPECT_GT(konly.rel_l1, 1.1 * both.rel_l1);
}

// SageAttention2: per-thread groups (2 Q rows, 32 K tokens) land between per-token and
// per-block in accuracy, for INT4 and INT8 alike.
TEST(PaperClaims, PerThreadLandsBetweenPerTokenAndPerBlock) {
  const auto cs = cases("normal", shape(2, 512, 1024), 2);
  const auto outl = cases("outliers", shape(2, 512, 1024), 2);
  for (QKFormat f : {QKFormat::int4, QKFormat::int8}) {
    Recipe r = qk_only(preset(f == QKFormat::int4 ? "sage2_4b" : "sage2_8b"));
    for (const auto* c : {&cs, &outl}) {
      const std::string tag = std::string(to_string(f)) + (c == &cs ? " normal " : " outliers ");
      r.qk_granularity = Granularity::per_token;
      const Err token = measure(r, *c, (tag + "per_token").c_str());
      r.qk_granularity = Granularity::per_thread;
      const Err thread = measure(r, *c, (tag + "per_thread").c_str());
      r.qk_granularity = Granularity::per_block;
      const Err block = measure(r, *c, (tag + "per_block").c_str());
      // Measured L1 (token < thread < block): int4 normal 0.166 < 0.201 < 0.238, outliers
      // 0.235 < 0.313 < 0.465; int8 normal 0.0091 < 0.0109 < 0.0129, outliers 0.015 < 0.021
      // < 0.031. 1 - cos gaps are 1.4x or more.
      EXPECT_GT(thread.rel_l1, 1.05 * token.rel_l1) << tag;
      EXPECT_GT(block.rel_l1, 1.05 * thread.rel_l1) << tag;
      EXPECT_GT(thread.cos_err, 1.1 * token.cos_err) << tag;
      EXPECT_GT(block.cos_err, 1.1 * thread.cos_err) << tag;
    }
  }
}

// SageAttention2: E4M3 is the most accurate 8-bit type for P and V. The paper's condition is
// its P: long rows of many tiny values whose sum still matters, which INT8's uniform grid
// (static 1/127) flushes to zero; the `sink` distribution reproduces it.
TEST(PaperClaims, E4m3BeatsE5m2AndInt8ForPAndV) {
  const auto cs = cases("sink", shape(2, 128, 4096), 2);
  const Err e4m3 = measure(pv_only(PVFormat::e4m3), cs, "PV e4m3 sink");
  const Err e5m2 = measure(pv_only(PVFormat::e5m2), cs, "PV e5m2 sink");
  const Err int8 = measure(pv_only(PVFormat::int8), cs, "PV int8 sink");
  // Measured: L1 0.016 (e4m3), 0.033 (e5m2), 0.25 (int8); 1-cos 2.1e-4, 8.7e-4, 3.2e-2.
  EXPECT_GT(e5m2.rel_l1, 1.5 * e4m3.rel_l1);
  EXPECT_GT(int8.rel_l1, 5 * e4m3.rel_l1);
  EXPECT_GT(e5m2.cos_err, 2 * e4m3.cos_err);
  EXPECT_GT(int8.cos_err, 5 * e4m3.cos_err);
  // E5M2's missing mantissa bit costs on every distribution, not only this one (measured
  // L1 0.070 vs 0.036 on normal). INT8 is not beaten everywhere: with short rows and
  // Gaussian V its uniform grid is finer than E4M3's (docs/numerics.md).
  const auto normal = cases("normal", shape(2, 256, 1024), 1);
  EXPECT_GT(measure(pv_only(PVFormat::e5m2), normal, "PV e5m2 normal").rel_l1,
            1.5 * measure(pv_only(PVFormat::e4m3), normal, "PV e4m3 normal").rel_l1);
}

// SageAttention3: quantizing P~ (in [0, 1]) straight to NVFP4 puts its E4M3 group scales in
// their subnormal range; scaling each row to 448 * 6 first (two-level) avoids it.
TEST(PaperClaims, TwoLevelPBeatsDirectNvfp4) {
  const auto cs = cases("sink", shape(2, 128, 4096), 2);
  const Recipe two = preset("sage3_fp4");
  Recipe direct = two;
  direct.p_scale = PScale::static_max;
  const Err t = measure(two, cs, "sage3_fp4 two-level sink");
  const Err d = measure(direct, cs, "sage3_fp4 direct sink");
  // Measured: L1 0.085 vs 0.22, 1-cos 4.5e-3 vs 3.5e-2.
  EXPECT_GT(d.rel_l1, 2 * t.rel_l1);
  EXPECT_GT(d.cos_err, 3 * t.cos_err);
}

// SageAttention3: NVFP4 (16-element groups, E4M3 scales) beats MXFP4 (32, power-of-two).
TEST(PaperClaims, Nvfp4BeatsMxfp4) {
  const Recipe nv = preset("sage3_fp4");
  Recipe mx = nv;
  mx.qk_format = QKFormat::mxfp4;
  mx.pv_format = PVFormat::mxfp4;
  for (const char* dist : {"normal", "outliers", "sink"}) {
    const auto cs = cases(dist, shape(2, 256, 1024), 2);
    const Err n = measure(nv, cs, (std::string("nvfp4 ") + dist).c_str());
    const Err m = measure(mx, cs, (std::string("mxfp4 ") + dist).c_str());
    // Measured L1: normal 0.187 vs 0.233, outliers 0.26 vs 0.63, sink 0.088 vs 0.129;
    // 1-cos ratios 1.6x, 4.2x, 1.7x.
    EXPECT_GT(m.rel_l1, 1.15 * n.rel_l1) << dist;
    EXPECT_GT(m.cos_err, 1.3 * n.cos_err) << dist;
  }
}

// SageAttention2++: narrowing P and V to Pr = 112, Vr = 4.5 so two k32 MMAs fit an fp16
// accumulator costs no accuracy against SageAttention2's full-range FP8 with FP32 buffers.
TEST(PaperClaims, NarrowedFp16AccumulationMatchesSage2) {
  const auto cs = cases("normal", shape(2, 512, 1024), 2);
  const Err pp = measure(preset("sage2pp_8b"), cs, "sage2pp_8b normal");
  const Err s2 = measure(preset("sage2_8b"), cs, "sage2_8b normal");
  // Measured: L1 0.0375 vs 0.0378 (the paper's Table 2: identical to 4 digits).
  EXPECT_LT(pp.rel_l1, 1.05 * s2.rel_l1);
  EXPECT_LT(pp.cos_err, 1.1 * s2.cos_err);
}

}  // namespace
}  // namespace sage
