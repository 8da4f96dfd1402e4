#include "reference/online_softmax.h"

#include <algorithm>
#include <cassert>
#include <cmath>
#include <limits>

#include "numerics/quant_rules.h"
#include "numerics/tile.h"

namespace sage::reference::sim {

float softmax_enter_tile(RowState& st, const float* s2, int64_t count, float* p) {
  float tile_max = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < count; ++j) tile_max = std::fmax(tile_max, s2[j]);
  const float m_new = std::fmax(st.m, tile_max);
  // The first tile has nothing to rescale; exp2(-inf - m) would be 0 anyway, but stating it
  // keeps -inf - -inf (NaN) out when a row's logits are all -inf.
  const float alpha = st.seen ? std::exp2(st.m - m_new) : 0.f;
  for (int64_t j = 0; j < count; ++j) p[j] = std::exp2(s2[j] - m_new);
  st.m = m_new;
  st.tile_max = tile_max;
  st.seen = true;
  return alpha;
}

float softmax_enter_tile_integer_max(RowState& st, const int32_t* acc, const float* mult,
                                     int64_t count, const rules::PScaleFold& fold, float* ps,
                                     int64_t first) {
  // Numbered as docs/numerics.md, step 6, "Integer row max".
  // 1. The integer max of each thread group (a GPU thread's own columns, nothing wider: the
  // groups' multipliers differ, so they meet only as floats, in 2).
  int32_t amax[kKThreadGroups] = {};
  float gmult[kKThreadGroups] = {};
  bool present[kKThreadGroups] = {};
  for (int64_t j = first; j < count; ++j) {
    const int g = static_cast<int>((j % 8) / 2);
    if (!present[g]) {
      present[g] = true;
      amax[g] = acc[j];
      gmult[g] = mult[j];
    } else {
      amax[g] = std::max(amax[g], acc[j]);
      assert(mult[j] == gmult[g] && "the keys of one thread group share one multiplier");
    }
  }
  // 1-2. The group max in the logit domain, then the row max. Rounding is monotone and
  // mult >= 0, so max_g tmax_g is the tile's largest S2 = float(acc) * mult: m is
  // softmax_enter_tile's.
  float tmax[kKThreadGroups];
  float tile_max = -std::numeric_limits<float>::infinity();
  for (int g = 0; g < kKThreadGroups; ++g) {
    tmax[g] = present[g] ? static_cast<float>(amax[g]) * gmult[g]
                         : -std::numeric_limits<float>::infinity();
    tile_max = std::fmax(tile_max, tmax[g]);
  }
  const float m_new = std::fmax(st.m, tile_max);
  const float alpha = st.seen ? std::exp2(st.m - m_new) : 0.f;  // as softmax_enter_tile
  // 3. The group's offset, two float subtractions (not fused): c = -2^24 mult exactly for
  // a group whose max is the row max; otherwise the rounding of c costs at most
  // 2^-24 |c| <= mult + 2^-24 |tmax - m| (docs/numerics.md).
  // 3a. P's scale in the exponent: k joins the offset of a group below the limit.
  float c[kKThreadGroups] = {};
  bool folded[kKThreadGroups] = {};
  for (int g = 0; g < kKThreadGroups; ++g) {
    if (!present[g]) continue;
    const float t = std::ldexp(gmult[g], 24);  // 2^24 * mult: exact
    const float gap = tmax[g] - m_new;
    c[g] = gap - t;
    folded[g] = rules::p_scale_folds(gmult[g], fold.mult_limit);
    if (folded[g]) c[g] += fold.k;
  }
  // 4-5. The biased integer is exact as a float ([2^23, 2^24] for d <= 256), and one
  // fused multiply-add rounds once: x = (acc - amax) * mult + (tmax - m), up to c's rounding.
  // Any other group adds k after it (a second rounding). exp2 then gives P~ * p_scale.
  for (int64_t j = 0; j < first; ++j) ps[j] = 0.f;
  for (int64_t j = first; j < count; ++j) {
    const int g = static_cast<int>((j % 8) / 2);
    assert(acc[j] - amax[g] >= -rules::kIntRowMaxBias);
    const float f = static_cast<float>(rules::kIntRowMaxBias + (acc[j] - amax[g]));
    const float x = std::fma(f, gmult[g], c[g]);
    ps[j] = std::exp2(folded[g] ? x : x + fold.k);
  }
  st.m = m_new;
  st.tile_max = tile_max;
  st.seen = true;
  return alpha;
}

void softmax_add_row_sum(RowState& st, float alpha, float row_sum) {
  st.l = st.l * alpha + row_sum;
}

float softmax_row_sum(const float* p, int64_t count) {
  float s = 0.f;
  for (int64_t j = 0; j < count; ++j) s += p[j];
  return s;
}

}  // namespace sage::reference::sim
