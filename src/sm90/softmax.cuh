// Online softmax over one K/V tile in the base-2 logit domain, and the P operand policy
// (E4M3 with a static scale) that turns the probabilities into the A fragments of the PV
// MMA in place.
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
  // factor alpha by which earlier output must be rescaled, per row.
  __device__ __forceinline__ void update(float (&s)[kAcc], float (&alpha)[2]) {
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
    float sum[2] = {0.f, 0.f};
#pragma unroll
    for (int i = 0; i < kAcc; ++i) {
      s[i] = fast_exp2(s[i] - base[frag::acc_row(i)]);
      sum[frag::acc_row(i)] += s[i];
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) l[r] = l[r] * alpha[r] + sum[r];
  }
};

// P~ in [0, 1] times p_max, to E4M3, packed as the A fragments of the PV MMA: slice kc takes
// the accumulator chunks 4kc..4kc+3. The bytes land in the permuted token order that the
// K/V pre-pass stored V in (quant::pv_position_of_token).
template <int N>
__device__ __forceinline__ void pack_p_e4m3(const float (&p)[N / 2], float p_max,
                                            uint32_t (&a)[N / 32][4]) {
#pragma unroll
  for (int kc = 0; kc < N / 32; ++kc) {
    const int j = 16 * kc;  // first accumulator index of chunk 4kc
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      // row r of chunks (4kc, 4kc+1) -> a[r]; of chunks (4kc+2, 4kc+3) -> a[2 + r]
      const int e = 2 * r;
      const uint32_t lo0 = pack_e4m3x2(p[j + e] * p_max, p[j + e + 1] * p_max);
      const uint32_t hi0 = pack_e4m3x2(p[j + 4 + e] * p_max, p[j + 4 + e + 1] * p_max);
      const uint32_t lo1 = pack_e4m3x2(p[j + 8 + e] * p_max, p[j + 8 + e + 1] * p_max);
      const uint32_t hi1 = pack_e4m3x2(p[j + 12 + e] * p_max, p[j + 12 + e + 1] * p_max);
      a[kc][r] = lo0 | (hi0 << 16);
      a[kc][2 + r] = lo1 | (hi1 << 16);
    }
  }
}

}  // namespace sage::sm90
