// Online softmax over one K/V tile in the base-2 logit domain. (What P~ then becomes is the
// PV operand policy's business: pv_operand.cuh.)
#pragma once

#include <cstdint>

#include <cmath>

#include "sm90/fragment.cuh"
#include "sm90/ptx.cuh"

namespace sage::sm90 {

template <int N>  // columns per tile
struct OnlineSoftmax {
  static constexpr int kAcc = N / 2;
  float m[2] = {-INFINITY, -INFINITY};  // running max of rows g and g+8 (base-2 logits)
  float l[2] = {0.f, 0.f};              // this thread's partial row sums (reduced at the end)

  // s: logits of the tile (masked = -inf). Overwritten with P~ = 2^(s - m). Returns the
  // factor alpha by which earlier output must be rescaled, per row, and this thread's sums of
  // P~ per row; the caller folds a row sum in with add_row_sum (P~'s, or the quantized P's).
  __device__ __forceinline__ void update(float (&s)[kAcc], float (&alpha)[2], float (&sum)[2]) {
    float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int i = 0; i < kAcc; ++i) tile_max[frag::acc_row(i)] = fmaxf(tile_max[frag::acc_row(i)], s[i]);
    float base[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float m_new = fmaxf(m[r], frag::quad_max(tile_max[r]));
      // A row with nothing unmasked so far keeps m = -inf; subtracting 0 instead keeps
      // 2^(-inf) = 0 everywhere rather than NaN from -inf - -inf.
      base[r] = m_new == -INFINITY ? 0.f : m_new;
      alpha[r] = fast_exp2(m[r] - base[r]);
      m[r] = m_new;
    }
    sum[0] = sum[1] = 0.f;
#pragma unroll
    for (int i = 0; i < kAcc; ++i) {
      s[i] = fast_exp2(s[i] - base[frag::acc_row(i)]);
      sum[frag::acc_row(i)] += s[i];
    }
  }

  __device__ __forceinline__ void add_row_sum(const float (&alpha)[2], const float (&sum)[2]) {
#pragma unroll
    for (int r = 0; r < 2; ++r) l[r] = l[r] * alpha[r] + sum[r];
  }
};

}  // namespace sage::sm90
