// Online softmax over one K/V tile in the base-2 logit domain. (What P~ then becomes is the
// PV operand policy's business: pv_operand.cuh.)
//
// The row max and row sum run as four interleaved chains per row instead of one serial chain
// of 32, so that a warp does not wait on its own FMNMX/FADD latency (the softmax is most of a
// consumer warp's issue slots per tile: ncu, H100, d = 128).
#pragma once

#include <cstdint>

#include <cmath>

#include "sm90/fragment.cuh"
#include "sm90/ptx.cuh"

namespace sage::sm90 {

template <int N>  // columns per tile
struct OnlineSoftmax {
  static constexpr int kAcc = N / 2;
  static constexpr int kChains = 4;     // partial max / sum chains per row
  float m[2] = {-INFINITY, -INFINITY};  // running max of rows g and g+8 (base-2 logits)
  float l[2] = {0.f, 0.f};  // this thread's partial row sums of P~ * p_max (reduced at the end)

  // s: the tile's logits (masked = -inf). Overwritten with P~ * p_max, P~ = 2^(s - m): the
  // value the PV operand quantizes, in the simulator's operations (round the difference,
  // ex2, round the product). Returns the factor alpha by which earlier output must be
  // rescaled, per row, and this thread's sums of P~ * p_max per row; the caller folds a row
  // sum in with add_row_sum (these, or the quantized P's).
  //
  // Not done, measured: folding the logit multiplier into one FFMA with the subtraction
  // (exact before its rounding where the simulator rounds the logit first) lost whole rows
  // of P near the fp16 limit of Q and K (logits ~1e10, half an ulp of the max is 2^12), and
  // guarding it with a per-warp vote and a second loop made the kernel slower than without
  // the fold (H200: 661 vs 708 TOPS at d = 128, N = 16K). Folding p_max into the exponent
  // moved INT8 P codes enough to shift INT-FlashAttention's LSE by 4e-3.
  __device__ __forceinline__ void update(float (&s)[kAcc], float p_max, float (&alpha)[2],
                                         float (&sum)[2]) {
    float part[2][kChains];
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
      for (int c = 0; c < kChains; ++c) part[r][c] = -INFINITY;
#pragma unroll
    for (int i = 0; i < kAcc; ++i) {
      float& x = part[frag::acc_row(i)][chain_of(i)];
      x = fmaxf(x, s[i]);
    }
    float base[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float tile_max = fmaxf(fmaxf(part[r][0], part[r][1]), fmaxf(part[r][2], part[r][3]));
      const float m_new = fmaxf(m[r], frag::quad_max(tile_max));
      // A row with nothing unmasked so far keeps m = -inf; subtracting 0 instead keeps
      // 2^(-inf) = 0 everywhere rather than NaN from -inf - -inf.
      base[r] = m_new == -INFINITY ? 0.f : m_new;
      alpha[r] = fast_exp2(m[r] - base[r]);
      m[r] = m_new;
    }
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
      for (int c = 0; c < kChains; ++c) part[r][c] = 0.f;
#pragma unroll
    for (int i = 0; i < kAcc; ++i) {
      const int r = frag::acc_row(i);
      s[i] = __fmul_rn(fast_exp2(__fsub_rn(s[i], base[r])), p_max);
      part[r][chain_of(i)] += s[i];
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) sum[r] = (part[r][0] + part[r][1]) + (part[r][2] + part[r][3]);
  }

  __device__ __forceinline__ void add_row_sum(const float (&alpha)[2], const float (&sum)[2]) {
#pragma unroll
    for (int r = 0; r < 2; ++r) l[r] = l[r] * alpha[r] + sum[r];
  }

 private:
  // Accumulator index -> chain: 8-column chunks round robin, so consecutive updates of one
  // row's chain are four chunks apart.
  __device__ __forceinline__ static constexpr int chain_of(int i) { return (i / 4) % kChains; }
};

}  // namespace sage::sm90
