#include "reference/online_softmax.h"

#include <cmath>

namespace sage::reference::sim {

float softmax_enter_tile(RowState& st, const float* s2, int64_t count, float* p) {
  float m_new = st.m;
  for (int64_t j = 0; j < count; ++j) m_new = std::fmax(m_new, s2[j]);
  // The first tile has nothing to rescale; exp2(-inf - m) would be 0 anyway, but stating it
  // keeps -inf - -inf (NaN) out when a row's logits are all -inf.
  const float alpha = st.seen ? std::exp2(st.m - m_new) : 0.f;
  for (int64_t j = 0; j < count; ++j) p[j] = std::exp2(s2[j] - m_new);
  st.m = m_new;
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
