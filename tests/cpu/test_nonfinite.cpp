// Non-finite inputs in the simulator (docs/numerics.md, "Non-finite inputs"): a NaN or an
// infinity reaches the outputs its scale group feeds instead of being absorbed. Before, one
// NaN in q gave a finite output, and an infinity in every row of one channel of q made
// sage2_8b return zeros.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "sage/attention.h"

namespace sage {
namespace {

struct SimRun {
  std::vector<float> out, lse;
};

// One head pair (2 query heads on 1 KV head), n tokens, d = 64, f32 inputs; q, k, v given.
SimRun simulate_f32(const std::string& recipe, std::vector<float>& q, std::vector<float>& k,
                 std::vector<float>& v, int64_t n, bool causal) {
  constexpr int64_t d = 64;
  SimRun r{std::vector<float>(q.size()), std::vector<float>(size_t(2 * n))};
  AttentionArgs a;
  a.recipe = preset(recipe);
  a.causal = causal;
  a.q = contiguous_view(q.data(), DType::f32, {1, 2, n, d});
  a.k = contiguous_view(k.data(), DType::f32, {1, 1, n, d});
  a.v = contiguous_view(v.data(), DType::f32, {1, 1, n, d});
  a.out = contiguous_view(r.out.data(), DType::f32, {1, 2, n, d});
  a.lse = contiguous_view(r.lse.data(), DType::f32, {1, 2, n});
  reference::simulate(a);
  return r;
}

std::vector<float> normal(size_t count, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> dist(0.f, 1.f);
  std::vector<float> x(count);
  for (float& e : x) e = dist(rng);
  return x;
}

bool row_all_nan(const std::vector<float>& out, int64_t row) {
  for (int64_t c = 0; c < 64; ++c)
    if (!std::isnan(out[size_t(row * 64 + c)])) return false;
  return true;
}

constexpr int64_t kN = 300, kD = 64;

TEST(NonFinite, NaNOrInfinityInAQueryRowMakesItsRowNaN) {
  for (const char* recipe : {"sage2_8b", "sage1_b", "sage2pp_8b", "int_flash_q", "sage1_vt"})
    for (float bad : {std::nanf(""), INFINITY, -INFINITY}) {
      SCOPED_TRACE(std::string(recipe) + " " + std::to_string(bad));
      std::vector<float> q = normal(size_t(2 * kN * kD), 1), k = normal(size_t(kN * kD), 2),
                         v = normal(size_t(kN * kD), 3);
      q[size_t(17 * kD + 5)] = bad;  // head 0, row 17
      const SimRun r = simulate_f32(recipe, q, k, v, kN, false);
      EXPECT_TRUE(row_all_nan(r.out, 17));
      EXPECT_TRUE(std::isnan(r.lse[17]));
      // The other query head shares no Q scale with row 17: untouched.
      EXPECT_FALSE(row_all_nan(r.out, kN + 17));
    }
}

TEST(NonFinite, NaNInKReachesTheRowsThatSeeItsScaleGroup) {
  std::vector<float> q = normal(size_t(2 * kN * kD), 4), k = normal(size_t(kN * kD), 5),
                     v = normal(size_t(kN * kD), 6);
  k[size_t(250 * kD + 3)] = std::nanf("");
  // sage1_b smooths K by its mean over every key: the NaN reaches every key, and so every
  // row that sees a key, under a causal mask too.
  const SimRun all = simulate_f32("sage1_b", q, k, v, kN, true);
  for (int64_t row : {int64_t(0), int64_t(100), int64_t(299), kN + 7}) EXPECT_TRUE(row_all_nan(all.out, row));
  // sage2_8b takes the mean over every 8th key (250 is not one): the NaN reaches the scale of
  // key 250's per-thread group (keys 128 + 8i + {2, 3}), so the rows that see key 130 or later.
  const SimRun group = simulate_f32("sage2_8b", q, k, v, kN, true);
  for (int64_t row : {int64_t(0), int64_t(100), int64_t(129)}) EXPECT_FALSE(std::isnan(group.out[size_t(row * kD)]));
  for (int64_t row : {int64_t(130), int64_t(249), int64_t(299)}) EXPECT_TRUE(row_all_nan(group.out, row));
}

TEST(NonFinite, NaNInVReachesItsChannel) {
  std::vector<float> q = normal(size_t(2 * kN * kD), 7), k = normal(size_t(kN * kD), 8),
                     v = normal(size_t(kN * kD), 9);
  v[size_t(40 * kD + 11)] = std::nanf("");  // channel 11
  const SimRun r = simulate_f32("sage2_8b", q, k, v, kN, false);
  for (int64_t row = 0; row < 2 * kN; ++row) {
    EXPECT_TRUE(std::isnan(r.out[size_t(row * kD + 11)]));
    EXPECT_TRUE(std::isfinite(r.out[size_t(row * kD + 12)]));
  }
}

// The defect of issue 35: an infinity in every row of one channel of q gave all zeros.
TEST(NonFinite, InfinityInAWholeQueryChannelIsNotZeros) {
  std::vector<float> q = normal(size_t(2 * kN * kD), 10), k = normal(size_t(kN * kD), 11),
                     v = normal(size_t(kN * kD), 12);
  for (int64_t row = 0; row < 2 * kN; ++row) q[size_t(row * kD + 9)] = INFINITY;
  const SimRun r = simulate_f32("sage2_8b", q, k, v, kN, false);
  for (int64_t row : {int64_t(0), int64_t(150), 2 * kN - 1}) EXPECT_TRUE(row_all_nan(r.out, row));
}

// sagebwd's per-block V: a NaN in key j's V makes its K/V tile's scale NaN, so every channel of
// every row that sees a key of that tile; under a causal mask the rows that see none of it stay
// finite (they do not fold the tile in). std::max took the tile's maximum before and dropped the
// NaN, leaving the output finite: absorbed, against the rule above.
TEST(NonFinite, NaNInPerBlockVReachesTheRowsThatSeeItsTile) {
  std::vector<float> q = normal(size_t(2 * kN * kD), 16), k = normal(size_t(kN * kD), 17),
                     v = normal(size_t(kN * kD), 18);
  v[size_t(200 * kD + 7)] = std::nanf("");  // key 200: the tile of keys 128..255
  const SimRun r = simulate_f32("sagebwd", q, k, v, kN, true);
  for (int64_t row : {int64_t(128), int64_t(200), int64_t(299), kN + 150}) EXPECT_TRUE(row_all_nan(r.out, row)) << row;
  for (int64_t row : {int64_t(0), int64_t(127), kN + 100})
    EXPECT_TRUE(std::isfinite(r.out[size_t(row * kD)])) << row;
}

// Finite inputs are unchanged by all this: rows that see no key stay 0 with LSE -inf.
TEST(NonFinite, RowsWithoutKeysStayZero) {
  std::vector<float> q = normal(size_t(2 * kN * kD), 13), k = normal(size_t(kN * kD), 14),
                     v = normal(size_t(kN * kD), 15);
  constexpr int64_t n_kv = 100;
  k.resize(size_t(n_kv * kD)), v.resize(size_t(n_kv * kD));
  std::vector<float> out(q.size()), lse(size_t(2 * kN));
  AttentionArgs a;
  a.recipe = preset("sage2_8b");
  a.causal = true;  // bottom-right: query rows below n_q - n_kv see no key
  a.q = contiguous_view(q.data(), DType::f32, {1, 2, kN, kD});
  a.k = contiguous_view(k.data(), DType::f32, {1, 1, n_kv, kD});
  a.v = contiguous_view(v.data(), DType::f32, {1, 1, n_kv, kD});
  a.out = contiguous_view(out.data(), DType::f32, {1, 2, kN, kD});
  a.lse = contiguous_view(lse.data(), DType::f32, {1, 2, kN});
  reference::simulate(a);
  EXPECT_EQ(out[5 * kD], 0.f);
  EXPECT_EQ(lse[5], -INFINITY);
  EXPECT_TRUE(std::isfinite(out[size_t(299 * kD)]));
}

}  // namespace
}  // namespace sage
