// sage::reference::exact against a naive computation written independently here: explicit
// score matrices, an explicit mask, softmax by normalising exp(s - rowmax).
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "reference/synthetic.h"
#include "reference/tensor_io.h"
#include "sage/attention.h"
#include "numerics/formats.h"

namespace sage {
namespace {

using reference::Rng;

struct Shape {
  int64_t b, hq, hkv, nq, nkv, d;
  int64_t dv = 0;  // V's and the output's head dim; 0: d
  int64_t v_dim() const { return dv > 0 ? dv : d; }
};

std::vector<float> random_values(int64_t count, uint64_t seed, double scale = 1.0) {
  Rng rng(seed);
  std::vector<float> v(static_cast<size_t>(count));
  for (auto& x : v) x = static_cast<float>(scale * rng.normal());
  return v;
}

// Naive attention over dense HND arrays, in double.
void naive(const Shape& s, const std::vector<double>& q, const std::vector<double>& k,
           const std::vector<double>& v, bool causal, double scale, std::vector<double>& out,
           std::vector<double>& lse) {
  const int64_t dv = s.v_dim();
  out.assign(static_cast<size_t>(s.b * s.hq * s.nq * dv), 0.0);
  lse.assign(static_cast<size_t>(s.b * s.hq * s.nq), -std::numeric_limits<double>::infinity());
  for (int64_t b = 0; b < s.b; ++b)
    for (int64_t h = 0; h < s.hq; ++h) {
      const int64_t kh = h * s.hkv / s.hq;  // GQA: consecutive q heads share a kv head
      for (int64_t i = 0; i < s.nq; ++i) {
        std::vector<double> sc(static_cast<size_t>(s.nkv));
        std::vector<bool> allowed(static_cast<size_t>(s.nkv));
        double mx = -std::numeric_limits<double>::infinity();
        for (int64_t j = 0; j < s.nkv; ++j) {
          allowed[j] = !causal || (s.nkv - j) >= (s.nq - i);  // same distance from the end
          double dot = 0;
          for (int64_t c = 0; c < s.d; ++c)
            dot += q[((b * s.hq + h) * s.nq + i) * s.d + c] * k[((b * s.hkv + kh) * s.nkv + j) * s.d + c];
          sc[j] = dot * scale;
          if (allowed[j]) mx = std::max(mx, sc[j]);
        }
        if (mx == -std::numeric_limits<double>::infinity()) continue;
        double l = 0;
        for (int64_t j = 0; j < s.nkv; ++j) l += allowed[j] ? std::exp(sc[j] - mx) : 0.0;
        for (int64_t j = 0; j < s.nkv; ++j) {
          if (!allowed[j]) continue;
          const double p = std::exp(sc[j] - mx) / l;
          for (int64_t c = 0; c < dv; ++c)
            out[((b * s.hq + h) * s.nq + i) * dv + c] += p * v[((b * s.hkv + kh) * s.nkv + j) * dv + c];
        }
        lse[(b * s.hq + h) * s.nq + i] = mx + std::log(l);
      }
    }
}

std::vector<double> widen(const std::vector<float>& x) { return {x.begin(), x.end()}; }

// exact() on contiguous f32 HND inputs with f64 outputs, compared with naive().
void check_against_naive(const Shape& s, bool causal, uint64_t seed) {
  auto q = random_values(s.b * s.hq * s.nq * s.d, seed);
  auto k = random_values(s.b * s.hkv * s.nkv * s.d, seed + 1);
  auto v = random_values(s.b * s.hkv * s.nkv * s.v_dim(), seed + 2);
  std::vector<double> out(static_cast<size_t>(s.b * s.hq * s.nq * s.v_dim()), 7.0);
  std::vector<float> lse(static_cast<size_t>(s.b * s.hq * s.nq), 7.f);
  AttentionArgs a;
  a.q = contiguous_view(q.data(), DType::f32, {s.b, s.hq, s.nq, s.d});
  a.k = contiguous_view(k.data(), DType::f32, {s.b, s.hkv, s.nkv, s.d});
  a.v = contiguous_view(v.data(), DType::f32, {s.b, s.hkv, s.nkv, s.v_dim()});
  a.out = contiguous_view(out.data(), DType::f64, {s.b, s.hq, s.nq, s.v_dim()});
  a.lse = contiguous_view(lse.data(), DType::f32, {s.b, s.hq, s.nq});
  a.causal = causal;
  reference::exact(a);

  std::vector<double> want, want_lse;
  naive(s, widen(q), widen(k), widen(v), causal, 1.0 / std::sqrt(static_cast<double>(s.d)), want, want_lse);
  for (size_t i = 0; i < out.size(); ++i) ASSERT_NEAR(out[i], want[i], 1e-12) << "element " << i;
  for (size_t i = 0; i < lse.size(); ++i) {
    if (std::isinf(want_lse[i])) {
      EXPECT_TRUE(std::isinf(lse[i]) && lse[i] < 0) << "row " << i << " has no key: lse -inf";
    } else {
      EXPECT_NEAR(lse[i], want_lse[i], 1e-6 * std::fabs(want_lse[i]) + 1e-6) << "row " << i;
    }
  }
}

TEST(Exact, MatchesNaiveNonCausal) { check_against_naive({2, 2, 2, 5, 7, 8}, false, 1); }
TEST(Exact, MatchesNaiveCausalMoreKeysThanQueries) { check_against_naive({1, 2, 2, 5, 9, 8}, true, 2); }
TEST(Exact, MatchesNaiveCausalMoreQueriesThanKeys) { check_against_naive({1, 2, 2, 9, 5, 8}, true, 3); }
TEST(Exact, MatchesNaiveCausalSquare) { check_against_naive({2, 1, 1, 6, 6, 16}, true, 4); }
TEST(Exact, MatchesNaiveGqa) { check_against_naive({2, 6, 2, 4, 5, 8}, true, 5); }
TEST(Exact, MatchesNaiveMqa) { check_against_naive({1, 4, 1, 3, 6, 4}, false, 6); }
// V with its own head dim (DeepSeek MLA's prefill shape, scaled down): the scores over d = 48
// channels, the output over V's 24 (and the other way round), default scale 1/sqrt(48).
TEST(Exact, MatchesNaiveWithVHeadDimOfItsOwn) {
  for (bool causal : {false, true}) {
    SCOPED_TRACE(causal);
    check_against_naive({1, 2, 1, 5, 7, 48, 24}, causal, 7);
    check_against_naive({2, 2, 2, 7, 5, 8, 20}, causal, 8);
  }
}

TEST(Exact, CausalRowsWithoutKeysAreZeroWithLseMinusInf) {
  // n_q = 6 > n_kv = 2: query i sees keys j <= i - 4, so rows 0..3 see nothing.
  auto q = random_values(24, 10), k = random_values(8, 11), v = random_values(8, 12);
  std::vector<float> out(24, 5.f), lse(6, 5.f);
  AttentionArgs a;
  a.q = contiguous_view(q.data(), DType::f32, {1, 1, 6, 4});
  a.k = contiguous_view(k.data(), DType::f32, {1, 1, 2, 4});
  a.v = contiguous_view(v.data(), DType::f32, {1, 1, 2, 4});
  a.out = contiguous_view(out.data(), DType::f32, {1, 1, 6, 4});
  a.lse = contiguous_view(lse.data(), DType::f32, {1, 1, 6});
  a.causal = true;
  reference::exact(a);
  for (int i = 0; i < 4; ++i) {
    for (int c = 0; c < 4; ++c) EXPECT_EQ(out[i * 4 + c], 0.f);
    EXPECT_EQ(lse[i], -std::numeric_limits<float>::infinity());
  }
  // Row 4 sees key 0 only: its output is v[0] exactly and its LSE the one score.
  for (int c = 0; c < 4; ++c) EXPECT_FLOAT_EQ(out[4 * 4 + c], v[c]);
  double dot = 0;
  for (int c = 0; c < 4; ++c) dot += static_cast<double>(q[16 + c]) * k[c];
  EXPECT_FLOAT_EQ(lse[4], static_cast<float>(dot * 0.5));
}

TEST(Exact, NoKeysAtAll) {
  auto q = random_values(2 * 3 * 8, 20);
  std::vector<float> out(48, 3.f), lse(6, 3.f);
  float dummy = 0.f;
  AttentionArgs a;
  a.q = contiguous_view(q.data(), DType::f32, {1, 2, 3, 8});
  a.k = contiguous_view(&dummy, DType::f32, {1, 2, 0, 8});
  a.v = contiguous_view(&dummy, DType::f32, {1, 2, 0, 8});
  a.out = contiguous_view(out.data(), DType::f32, {1, 2, 3, 8});
  a.lse = contiguous_view(lse.data(), DType::f32, {1, 2, 3});
  for (bool causal : {false, true}) {
    a.causal = causal;
    reference::exact(a);
    for (float x : out) EXPECT_EQ(x, 0.f);
    for (float x : lse) EXPECT_EQ(x, -std::numeric_limits<float>::infinity());
  }
}

// The same numbers in HND, in NHD, and inside larger strided buffers give identical bits.
TEST(Exact, LayoutsAndStridedViewsAgree) {
  const int64_t B = 2, H = 2, HK = 1, N = 5, NK = 7, D = 8;
  auto q = random_values(B * H * N * D, 30), k = random_values(B * HK * NK * D, 31),
       v = random_values(B * HK * NK * D, 32);
  AttentionArgs a;
  a.causal = true;
  a.q = contiguous_view(q.data(), DType::f32, {B, H, N, D});
  a.k = contiguous_view(k.data(), DType::f32, {B, HK, NK, D});
  a.v = contiguous_view(v.data(), DType::f32, {B, HK, NK, D});
  std::vector<float> ref(static_cast<size_t>(B * H * N * D));
  a.out = contiguous_view(ref.data(), DType::f32, {B, H, N, D});
  reference::exact(a);

  // NHD copies.
  auto to_nhd = [&](const std::vector<float>& x, int64_t heads, int64_t n) {
    std::vector<float> y(x.size());
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < heads; ++h)
        for (int64_t t = 0; t < n; ++t)
          for (int64_t c = 0; c < D; ++c)
            y[((b * n + t) * heads + h) * D + c] = x[((b * heads + h) * n + t) * D + c];
    return y;
  };
  auto qn = to_nhd(q, H, N), kn = to_nhd(k, HK, NK), vn = to_nhd(v, HK, NK);
  std::vector<float> on(ref.size());
  AttentionArgs nhd = a;
  nhd.layout = Layout::NHD;
  nhd.q = contiguous_view(qn.data(), DType::f32, {B, N, H, D});
  nhd.k = contiguous_view(kn.data(), DType::f32, {B, NK, HK, D});
  nhd.v = contiguous_view(vn.data(), DType::f32, {B, NK, HK, D});
  nhd.out = contiguous_view(on.data(), DType::f32, {B, N, H, D});
  reference::exact(nhd);
  EXPECT_EQ(to_nhd(ref, H, N), on);

  // HND views into padded buffers: every row padded to 11 elements, tokens of a head 3 rows
  // apart from the next head's, an output with its own padding.
  const int64_t row = 11;
  auto pad = [&](const std::vector<float>& x, int64_t heads, int64_t n) {
    std::vector<float> y(static_cast<size_t>(B * heads * (n + 3) * row), -99.f);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < heads; ++h)
        for (int64_t t = 0; t < n; ++t)
          for (int64_t c = 0; c < D; ++c)
            y[((b * heads + h) * (n + 3) + t) * row + c] = x[((b * heads + h) * n + t) * D + c];
    return y;
  };
  auto qp = pad(q, H, N), kp = pad(k, HK, NK), vp = pad(v, HK, NK);
  std::vector<float> op(static_cast<size_t>(B * H * (N + 3) * row), -1.f);
  AttentionArgs s = a;
  s.q = strided_view(qp.data(), DType::f32, {B, H, N, D}, {H * (N + 3) * row, (N + 3) * row, row, 1});
  s.k = strided_view(kp.data(), DType::f32, {B, HK, NK, D}, {HK * (NK + 3) * row, (NK + 3) * row, row, 1});
  s.v = strided_view(vp.data(), DType::f32, {B, HK, NK, D}, {HK * (NK + 3) * row, (NK + 3) * row, row, 1});
  s.out = strided_view(op.data(), DType::f32, {B, H, N, D}, {H * (N + 3) * row, (N + 3) * row, row, 1});
  reference::exact(s);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t t = 0; t < N + 3; ++t)
        for (int64_t c = 0; c < row; ++c) {
          const float got = op[((b * H + h) * (N + 3) + t) * row + c];
          if (t < N && c < D)
            EXPECT_EQ(got, ref[((b * H + h) * N + t) * D + c]);
          else
            EXPECT_EQ(got, -1.f) << "padding must not be written";
        }
}

// Outputs in f16 and bf16 are the float64 result rounded once to nearest even.
TEST(Exact, NarrowOutputsAreCorrectlyRounded) {
  const int64_t N = 9, D = 16;
  auto q = random_values(N * D, 40), k = random_values(N * D, 41), v = random_values(N * D, 42, 3.0);
  AttentionArgs a;
  a.q = contiguous_view(q.data(), DType::f32, {1, 1, N, D});
  a.k = contiguous_view(k.data(), DType::f32, {1, 1, N, D});
  a.v = contiguous_view(v.data(), DType::f32, {1, 1, N, D});
  std::vector<double> ref(static_cast<size_t>(N * D));
  a.out = contiguous_view(ref.data(), DType::f64, {1, 1, N, D});
  reference::exact(a);
  std::vector<uint16_t> h(ref.size()), bf(ref.size());
  a.out = contiguous_view(h.data(), DType::f16, {1, 1, N, D});
  reference::exact(a);
  a.out = contiguous_view(bf.data(), DType::bf16, {1, 1, N, D});
  reference::exact(a);
  for (size_t i = 0; i < ref.size(); ++i) {
    // The nearest fp16: no other fp16 is closer to the double.
    const double got = fmt::fp16_from_bits(h[i]);
    const double up = fmt::fp16_from_bits(static_cast<uint16_t>(h[i] + 1));
    const double down = fmt::fp16_from_bits(static_cast<uint16_t>(h[i] - 1));
    EXPECT_LE(std::fabs(got - ref[i]), std::fabs(up - ref[i]));
    EXPECT_LE(std::fabs(got - ref[i]), std::fabs(down - ref[i]));
    const double gb = fmt::bf16_from_bits(bf[i]);
    EXPECT_LE(std::fabs(gb - ref[i]), std::fabs(fmt::bf16_from_bits(static_cast<uint16_t>(bf[i] + 1)) - ref[i]));
    EXPECT_LE(std::fabs(gb - ref[i]), std::fabs(fmt::bf16_from_bits(static_cast<uint16_t>(bf[i] - 1)) - ref[i]));
  }
}

TEST(Exact, Fp16AndBf16InputsAreReadExactly) {
  const int64_t N = 6, D = 8;
  auto qf = random_values(N * D, 50), kf = random_values(N * D, 51), vf = random_values(N * D, 52);
  std::vector<uint16_t> q(qf.size()), k(qf.size()), v(qf.size());
  for (size_t i = 0; i < qf.size(); ++i) {
    q[i] = fmt::bf16_bits(qf[i]);
    k[i] = fmt::bf16_bits(kf[i]);
    v[i] = fmt::bf16_bits(vf[i]);
    qf[i] = fmt::bf16_from_bits(q[i]);
    kf[i] = fmt::bf16_from_bits(k[i]);
    vf[i] = fmt::bf16_from_bits(v[i]);
  }
  AttentionArgs a;
  a.q = contiguous_view(q.data(), DType::bf16, {1, 1, N, D});
  a.k = contiguous_view(k.data(), DType::bf16, {1, 1, N, D});
  a.v = contiguous_view(v.data(), DType::bf16, {1, 1, N, D});
  std::vector<double> got(static_cast<size_t>(N * D)), want;
  a.out = contiguous_view(got.data(), DType::f64, {1, 1, N, D});
  reference::exact(a);
  std::vector<double> lse;
  naive({1, 1, 1, N, N, D}, widen(qf), widen(kf), widen(vf), false, 1.0 / std::sqrt(8.0), want, lse);
  for (size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], want[i], 1e-12);
}

TEST(Exact, ExplicitSmScale) {
  const int64_t N = 4, D = 8;
  auto q = random_values(N * D, 60), k = random_values(N * D, 61), v = random_values(N * D, 62);
  AttentionArgs a;
  a.q = contiguous_view(q.data(), DType::f32, {1, 1, N, D});
  a.k = contiguous_view(k.data(), DType::f32, {1, 1, N, D});
  a.v = contiguous_view(v.data(), DType::f32, {1, 1, N, D});
  a.sm_scale = 0.75f;
  std::vector<double> got(static_cast<size_t>(N * D)), want, lse;
  a.out = contiguous_view(got.data(), DType::f64, {1, 1, N, D});
  reference::exact(a);
  naive({1, 1, 1, N, N, D}, widen(q), widen(k), widen(v), false, 0.75, want, lse);
  for (size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], want[i], 1e-12);
}

// Prequantized INT8 inputs stand for codes times scales (per token for Q and K, per tensor
// or per channel for V).
TEST(Exact, PrequantizedInputsAreDequantized) {
  reference::SyntheticShape sh;
  sh.batch = 1;
  sh.heads_q = 2;
  sh.heads_kv = 1;
  sh.n_q = 5;
  sh.n_kv = 6;
  sh.head_dim = 8;
  const auto in = reference::make_synthetic("k_bias", sh, 3);
  for (bool per_channel : {false, true}) {
    const auto pq = reference::prequantize_int8(in, per_channel);
    AttentionArgs a;
    a.recipe = preset("int_flash");
    a.recipe.v_scale = per_channel ? VScale::per_channel : VScale::per_tensor;
    a.q = pq.q_view();
    a.k = pq.k_view();
    a.v = pq.v_view();
    a.q_scale = pq.q_scale_view();
    a.k_scale = pq.k_scale_view();
    a.v_scale = pq.v_scale_view();
    std::vector<double> got(static_cast<size_t>(2 * 5 * 8));
    a.out = contiguous_view(got.data(), DType::f64, {1, 2, 5, 8});
    reference::exact(a);

    std::vector<double> q(pq.q.size()), k(pq.k.size()), v(pq.v.size());
    for (size_t i = 0; i < q.size(); ++i) q[i] = pq.q[i] * static_cast<double>(pq.q_scale[i / 8]);
    for (size_t i = 0; i < k.size(); ++i) k[i] = pq.k[i] * static_cast<double>(pq.k_scale[i / 8]);
    for (size_t i = 0; i < v.size(); ++i)
      v[i] = pq.v[i] * static_cast<double>(per_channel ? pq.v_scale[i % 8] : pq.v_scale[0]);
    std::vector<double> want, lse;
    naive({1, 2, 1, 5, 6, 8}, q, k, v, false, 1.0 / std::sqrt(8.0), want, lse);
    for (size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], want[i], 1e-12);
  }
}

TEST(Exact, RejectsBadArguments) {
  AttentionArgs a;  // nothing given
  EXPECT_THROW(reference::exact(a), Error);
}

}  // namespace
}  // namespace sage
