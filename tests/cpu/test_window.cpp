// Sliding windows and fully masked rows (docs/numerics.md, step 5): the mask functions of
// numerics/mask.h, the argument checks, the exact reference against a mask written out here,
// and the simulator's promises (a window covering every key is no window, bit for bit;
// causal is window (-1, 0), bit for bit; rows with no key give 0 and an LSE of -inf).
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "numerics/formats.h"
#include "numerics/mask.h"
#include "reference/metrics.h"
#include "reference/synthetic.h"
#include "sage/attention.h"

namespace sage {
namespace {

constexpr float kMinusInf = -std::numeric_limits<float>::infinity();

// The mask as the issue states it, written independently of numerics/mask.h.
bool sees(int64_t i, int64_t j, int64_t n_q, int64_t n_kv, int64_t left, int64_t right) {
  const int64_t diagonal = i + n_kv - n_q;
  return (left < 0 || j >= diagonal - left) && (right < 0 || j <= diagonal + right);
}

struct Window {
  int64_t left, right;
};

// Shapes and windows that cover: no bound, each bound alone, both, windows narrower than a
// K/V tile, wider than the keys, n_q above and below n_kv, and rows left with no key.
const Window kWindows[] = {{-1, -1}, {0, 0}, {5, -1}, {-1, 3}, {100, 0}, {37, 200}, {0, -1},
                           {-1, 0},  {300, 300}, {1000, 1000}, {128, 127}, {1, 1}};

// ---- numerics/mask.h ---------------------------------------------------------------------

TEST(MaskFunctions, VisibleKeysAreTheWindowsInterval) {
  for (const auto& nn : {std::pair<int64_t, int64_t>{7, 7}, {5, 13}, {13, 5}, {1, 9}, {9, 1}, {0, 4}, {4, 0}})
    for (const Window& w : kWindows)
      for (bool causal : {false, true}) {
        if (causal && w.right > 0) continue;
        const int64_t n_q = nn.first, n_kv = nn.second;
        const KeyWindow kw = normalized_window(causal, w.left, w.right, n_q, n_kv);
        const int64_t right = causal ? 0 : w.right;
        for (int64_t i = 0; i < n_q; ++i) {
          const KeyRange r = visible_keys(i, n_q, n_kv, kw);
          for (int64_t j = 0; j < n_kv; ++j)
            ASSERT_EQ(j >= r.begin && j < r.end, sees(i, j, n_q, n_kv, w.left, right))
                << "n_q " << n_q << " n_kv " << n_kv << " window (" << w.left << ", " << right
                << ") row " << i << " key " << j;
        }
      }
}

// The tiles a block of rows visits hold every key any of its rows sees, and start and end
// with a tile that some row sees a key of (no tile is visited for nothing).
TEST(MaskFunctions, VisibleTilesAreTheRowsUnion) {
  constexpr int kTile = 16;
  for (const auto& nn : {std::pair<int, int>{100, 100}, {40, 150}, {150, 40}, {3, 70}})
    for (const Window& w : kWindows) {
      const int n_q = nn.first, n_kv = nn.second;
      const KeyWindow kw = normalized_window(false, w.left, w.right, n_q, n_kv);
      for (int row0 = 0; row0 < n_q; row0 += 24) {
        const int row_end = std::min(row0 + 24, n_q);
        const TileRange t = visible_tiles<int>(row0, row_end, n_q, n_kv, int(kw.left), int(kw.right), kTile);
        std::vector<bool> seen((n_kv + kTile - 1) / kTile + 1, false);
        bool any = false;
        for (int i = row0; i < row_end; ++i)
          for (int j = 0; j < n_kv; ++j)
            if (sees(i, j, n_q, n_kv, w.left, w.right)) {
              seen[j / kTile] = any = true;
              ASSERT_TRUE(j / kTile >= t.begin && j / kTile < t.end)
                  << "rows " << row0 << ".." << row_end << " key " << j;
            }
        if (!any) {
          EXPECT_GE(t.begin, t.end) << "rows " << row0 << " see no key: no tile";
          continue;
        }
        EXPECT_TRUE(seen[t.begin]) << "first tile " << t.begin << " holds no visible key";
        EXPECT_TRUE(seen[t.end - 1]) << "last tile " << t.end - 1 << " holds no visible key";
      }
    }
}

TEST(MaskFunctions, BoundsThatMaskNothingBecomeUnbounded) {
  // n_q = 10, n_kv = 20: the left bound masks a key iff left < 19, the right iff right < 9.
  EXPECT_EQ(normalized_window(false, 18, 8, 10, 20).left, 18);
  EXPECT_EQ(normalized_window(false, 19, 9, 10, 20).left, -1);
  EXPECT_EQ(normalized_window(false, 18, 8, 10, 20).right, 8);
  EXPECT_EQ(normalized_window(false, 18, 9, 10, 20).right, -1);
  EXPECT_EQ(normalized_window(false, int64_t(1) << 62, int64_t(1) << 62, 10, 20).left, -1);
  // causal is right = 0, which masks something unless there is a single query row.
  EXPECT_EQ(normalized_window(true, -1, -1, 10, 20).right, 0);
  EXPECT_EQ(normalized_window(true, 4, 0, 10, 20).left, 4);
  EXPECT_EQ(normalized_window(true, -1, -1, 1, 20).right, -1);
}

// ---- argument checks ---------------------------------------------------------------------

struct Buffers {
  std::vector<uint16_t> q, k, v;
  std::vector<float> out, lse;
  AttentionArgs args(int64_t n_q, int64_t n_kv, int64_t d = 64, int64_t hq = 2, int64_t hkv = 2) {
    q.assign(size_t(hq * n_q * d), 0), k.assign(size_t(hkv * n_kv * d), 0), v = k;
    out.assign(q.size(), 0.f), lse.assign(size_t(hq * n_q), 0.f);
    AttentionArgs a;
    a.q = contiguous_view(q.data(), DType::f16, {1, hq, n_q, d});
    a.k = contiguous_view(k.data(), DType::f16, {1, hkv, n_kv, d});
    a.v = contiguous_view(v.data(), DType::f16, {1, hkv, n_kv, d});
    a.out = contiguous_view(out.data(), DType::f32, {1, hq, n_q, d});
    a.lse = contiguous_view(lse.data(), DType::f32, {1, hq, n_q});
    return a;
  }
};

void expect_window_error(const AttentionArgs& a, const std::string& argument, const std::string& phrase) {
  try {
    check_args(a, DeviceKind::cpu);
    ADD_FAILURE() << "accepted; expected an error on " << argument;
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), argument) << e.what();
    EXPECT_NE(std::string(e.what()).find(phrase), std::string::npos) << e.what();
  }
}

TEST(WindowArgs, BoundsBelowMinusOneAreRefused) {
  Buffers b;
  AttentionArgs a = b.args(8, 8);
  a.window_left = -2;
  expect_window_error(a, "window_left", "must be -1 (unbounded) or >= 0 keys (got -2)");
  a.window_left = 3;
  a.window_right = -7;
  expect_window_error(a, "window_right", "must be -1 (unbounded) or >= 0 keys (got -7)");
}

TEST(WindowArgs, CausalTakesNoPositiveRightBound) {
  Buffers b;
  AttentionArgs a = b.args(8, 8);
  a.causal = true;
  a.window_right = 4;
  expect_window_error(a, "window_right", "must be -1 or 0 with causal = true");
  for (int64_t right : {-1, 0}) {
    a.window_right = right;
    a.window_left = 2;
    const Problem p = check_args(a, DeviceKind::cpu);
    EXPECT_EQ(p.window_left, 2);
    EXPECT_EQ(p.window_right, 0);
  }
}

TEST(WindowArgs, ProblemCarriesTheNormalizedWindow) {
  Buffers b;
  AttentionArgs a = b.args(8, 12);
  a.window_left = 3, a.window_right = 2;
  Problem p = check_args(a, DeviceKind::cpu);
  EXPECT_EQ(p.window_left, 3);
  EXPECT_EQ(p.window_right, 2);
  a.window_left = 11, a.window_right = 7;  // mask nothing at n_q 8, n_kv 12
  p = check_args(a, DeviceKind::cpu);
  EXPECT_EQ(p.window_left, -1);
  EXPECT_EQ(p.window_right, -1);
  // The K/V half of the two-step call takes no mask: a window there is not checked.
  a.window_left = -5;
  EXPECT_NO_THROW(check_kv_args(a, DeviceKind::cpu));
}

// ---- the exact reference -------------------------------------------------------------------

// exact() with a window against softmax over the keys sees() allows, in double.
TEST(WindowExact, MatchesTheWrittenOutMask) {
  const int64_t d = 16;
  for (const auto& nn : {std::pair<int64_t, int64_t>{20, 20}, {9, 30}, {30, 9}})
    for (const Window& w : kWindows) {
      const int64_t n_q = nn.first, n_kv = nn.second;
      reference::SyntheticShape s;
      s.batch = 1, s.heads_q = 2, s.heads_kv = 1, s.n_q = n_q, s.n_kv = n_kv, s.head_dim = d;
      const reference::SyntheticInputs in = reference::make_synthetic("normal", s, 3);
      std::vector<double> out(size_t(2 * n_q * d), 7.0);
      std::vector<float> lse(size_t(2 * n_q), 7.f);
      AttentionArgs a;
      a.q = in.q_view(), a.k = in.k_view(), a.v = in.v_view();
      a.out = contiguous_view(out.data(), DType::f64, {1, 2, n_q, d});
      a.lse = contiguous_view(lse.data(), DType::f32, {1, 2, n_q});
      a.window_left = w.left, a.window_right = w.right;
      reference::exact(a);
      auto value = [](uint16_t bits) { return double(fmt::fp16_from_bits(bits)); };
      const double scale = 1.0 / std::sqrt(double(d));
      for (int64_t h = 0; h < 2; ++h)
        for (int64_t i = 0; i < n_q; ++i) {
          std::vector<double> p(size_t(n_kv), 0.0);
          double m = -std::numeric_limits<double>::infinity();
          for (int64_t j = 0; j < n_kv; ++j) {
            if (!sees(i, j, n_q, n_kv, w.left, w.right)) continue;
            double dot = 0;
            for (int64_t c = 0; c < d; ++c) dot += value(in.q[(h * n_q + i) * d + c]) * value(in.k[j * d + c]);
            p[j] = dot * scale;
            m = std::max(m, p[j]);
          }
          const std::string where = "window (" + std::to_string(w.left) + ", " + std::to_string(w.right) +
                                    ") n_q " + std::to_string(n_q) + " n_kv " + std::to_string(n_kv) +
                                    " row " + std::to_string(i);
          if (std::isinf(m)) {  // no key: 0 and -inf
            EXPECT_EQ(lse[h * n_q + i], kMinusInf) << where;
            for (int64_t c = 0; c < d; ++c) ASSERT_EQ(out[(h * n_q + i) * d + c], 0.0) << where;
            continue;
          }
          double l = 0;
          std::vector<double> o(size_t(d), 0.0);
          for (int64_t j = 0; j < n_kv; ++j) {
            if (!sees(i, j, n_q, n_kv, w.left, w.right)) continue;
            const double e = std::exp(p[j] - m);
            l += e;
            for (int64_t c = 0; c < d; ++c) o[c] += e * value(in.v[j * d + c]);
          }
          for (int64_t c = 0; c < d; ++c) ASSERT_NEAR(out[(h * n_q + i) * d + c], o[c] / l, 1e-12) << where;
          EXPECT_NEAR(lse[h * n_q + i], m + std::log(l), 1e-5) << where;
        }
    }
}

// ---- the simulator -------------------------------------------------------------------------

struct Outputs {
  std::vector<float> out, lse;
};

// simulate (or exact) of `recipe` on `in` with a mask; prequantized recipes get
// prequantize_int8 of the same inputs.
Outputs run(bool simulated, const Recipe& recipe, const reference::SyntheticInputs& in, bool causal,
        int64_t left, int64_t right) {
  const reference::SyntheticShape& s = in.shape;
  Outputs r;
  r.out.assign(size_t(s.batch * s.heads_q * s.n_q * s.head_dim), 0.f);
  r.lse.assign(size_t(s.batch * s.heads_q * s.n_q), 0.f);
  AttentionArgs a;
  reference::PrequantizedInputs pq;
  if (recipe.inputs == Inputs::prequantized_int8) {
    pq = reference::prequantize_int8(in, recipe.v_scale == VScale::per_channel);
    a.q = pq.q_view(), a.k = pq.k_view(), a.v = pq.v_view();
    a.q_scale = pq.q_scale_view(), a.k_scale = pq.k_scale_view(), a.v_scale = pq.v_scale_view();
  } else {
    a.q = in.q_view(), a.k = in.k_view(), a.v = in.v_view();
  }
  a.out = contiguous_view(r.out.data(), DType::f32, {s.batch, s.heads_q, s.n_q, s.head_dim});
  a.lse = contiguous_view(r.lse.data(), DType::f32, {s.batch, s.heads_q, s.n_q});
  a.recipe = recipe;
  a.causal = causal;
  a.window_left = left, a.window_right = right;
  if (simulated) reference::simulate(a);
  else reference::exact(a);
  return r;
}

reference::SyntheticInputs inputs(int64_t n_q, int64_t n_kv, int64_t d, uint64_t seed,
                                  const char* dist = "normal") {
  reference::SyntheticShape s;
  s.batch = 1, s.heads_q = 2, s.heads_kv = 1, s.n_q = n_q, s.n_kv = n_kv, s.head_dim = d;
  return reference::make_synthetic(dist, s, seed);
}

TEST(WindowSimulate, CoveringWindowIsNoWindowBitForBit) {
  const reference::SyntheticInputs in = inputs(150, 300, 64, 1);
  for (const Recipe& r : presets()) {
    const Outputs plain = run(true, r, in, false, -1, -1);
    const Outputs covering = run(true, r, in, false, 299, 149);
    EXPECT_EQ(plain.out, covering.out) << r.name;
    EXPECT_EQ(plain.lse, covering.lse) << r.name;
    const Outputs causal = run(true, r, in, true, -1, -1);
    EXPECT_EQ(causal.out, run(true, r, in, true, 299, 0).out) << r.name;
  }
}

TEST(WindowSimulate, CausalIsWindowMinusOneZeroBitForBit) {
  for (const auto& nn : {std::pair<int64_t, int64_t>{200, 200}, {130, 300}, {300, 130}}) {
    const reference::SyntheticInputs in = inputs(nn.first, nn.second, 64, 2);
    for (const Recipe& r : presets()) {
      const Outputs causal = run(true, r, in, true, -1, -1);
      const Outputs window = run(true, r, in, false, -1, 0);
      EXPECT_EQ(causal.out, window.out) << r.name << " n_q " << nn.first;
      EXPECT_EQ(causal.lse, window.lse) << r.name << " n_q " << nn.first;
    }
  }
}

// n_q 300 > n_kv 100 + right 20: rows 0..179 see no key. Every preset gives them 0 and -inf,
// and every other row a finite output.
TEST(WindowSimulate, FullyMaskedRowsAreZeroWithLseMinusInf) {
  const int64_t n_q = 300, n_kv = 100, d = 64;
  const reference::SyntheticInputs in = inputs(n_q, n_kv, d, 3);
  for (const Recipe& r : presets())
    for (const Window& w : {Window{-1, 20}, Window{10, 20}}) {
      const Outputs res = run(true, r, in, false, w.left, w.right);
      for (int64_t h = 0; h < 2; ++h)
        for (int64_t i = 0; i < n_q; ++i) {
          const float lse = res.lse[h * n_q + i];
          if (i < 180) {
            ASSERT_EQ(lse, kMinusInf) << r.name << " row " << i;
            for (int64_t c = 0; c < d; ++c) ASSERT_EQ(res.out[(h * n_q + i) * d + c], 0.f) << r.name;
          } else {
            ASSERT_TRUE(std::isfinite(lse)) << r.name << " row " << i;
            for (int64_t c = 0; c < d; ++c) ASSERT_TRUE(std::isfinite(res.out[(h * n_q + i) * d + c]));
          }
        }
    }
}

// A window's rows start inside K/V tiles (masked keys before the window's first, in the
// integer row max and the float logits alike): each preset stays as close to exact attention
// with the same window as it is without one on the same inputs, within 10% (measured: every
// preset at or below its error without a window, 0.98x at worst, sage2_8b at (200, 33)).
TEST(WindowSimulate, WindowedErrorIsTheRecipesError) {
  const reference::SyntheticInputs in = inputs(256, 700, 128, 4);
  for (const Recipe& r : presets()) {
    const Outputs ex = run(false, r, in, false, -1, -1), sim = run(true, r, in, false, -1, -1);
    const reference::ErrorStats base = reference::compare(sim.out.data(), ex.out.data(), int64_t(ex.out.size()));
    for (const Window& w : {Window{70, 0}, Window{200, 33}, Window{5, 5}}) {
      const bool causal = w.right == 0;
      const Outputs wex = run(false, r, in, causal, w.left, causal ? -1 : w.right);
      const Outputs wsim = run(true, r, in, causal, w.left, causal ? -1 : w.right);
      const reference::ErrorStats e = reference::compare(wsim.out.data(), wex.out.data(), int64_t(wex.out.size()));
      const std::string where = r.name + " window (" + std::to_string(w.left) + ", " + std::to_string(w.right) + ")";
      EXPECT_EQ(e.nonfinite, 0) << where;
      EXPECT_LE(1 - e.cosine, (1 - base.cosine) * 1.1) << where;
      EXPECT_LE(e.rel_l1, base.rel_l1 * 1.1) << where;
      for (size_t i = 0; i < wsim.lse.size(); ++i)
        ASSERT_TRUE(std::isfinite(wsim.lse[i])) << where << " row " << i;
    }
  }
}

}  // namespace
}  // namespace sage
