// Online softmax over one K/V tile in the base-2 logit domain. (What P~ then becomes is the
// PV operand policy's business: pv_operand.cuh.)
//
// The row max and row sum run as four interleaved chains per row instead of one serial chain
// of 32, so that a warp does not wait on its own FMNMX/FADD latency (the softmax is most of a
// consumer warp's issue slots per tile: v8, docs/history/README.md).
#pragma once

#include <cstdint>

#include <cmath>

#include "numerics/quant_rules.h"
#include "sm90/mma/fragment.cuh"
#include "common/ptx.cuh"

namespace sage::sm90 {

// How P's scale p_max enters P~ * p_max on the integer row max path (update_from_int).
enum class PScaleMode { multiply, add, fold };

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
  // kSum: false where the PV MMA takes the row sum (RowSum::pv_mma; pv_operand.cuh): no sums,
  // `sum` is left as it is.
  //
  // Not done (v8a, docs/history/README.md): the logit multiplier folded into one FFMA with
  // the subtraction (exact before its rounding where the simulator rounds the logit first)
  // lost whole rows of P near the fp16 limit of Q and K (logits ~1e10, half an ulp of the max
  // is 2^12), and a form guarded by a per-warp vote was slower than no fold. p_max folded into
  // the exponent moved INT8 P codes enough to shift INT-FlashAttention's LSE by 4e-3.
  template <bool kSum = true>
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
      if constexpr (kSum) part[r][chain_of(i)] += s[i];
    }
    if constexpr (kSum) {
#pragma unroll
      for (int r = 0; r < 2; ++r) sum[r] = (part[r][0] + part[r][1]) + (part[r][2] + part[r][3]);
    }
  }

  // The integer row max (docs/numerics.md steps 4 and 6, recipes with per-tile K scales and
  // no Q smoothing): the same P~ from the tile's INT32 accumulators without converting each
  // one to float. All of a thread's columns lie in one K group, so it has one multiplier and
  // the order of its accumulators is the order of its logits: the thread's max is
  // taken on integers, converted once, and each exponent argument is one FFMA of a biased
  // integer reinterpreted as float, f = 2^24 + (acc - amax) (exact, rules::kIntRowMaxBias):
  //     x = f * mult + c,  c = (tmax - m) - 2^24 * mult.
  // Why: the softmax is most of a consumer warp's issue slots; per score this is IMNMX, IADD,
  // FFMA where the logit path spends FMNMX, I2F, FMUL, FADD (and the max and the add run on
  // the integer pipe, which the float softmax leaves idle).
  // acc: masked entries INT32_MIN (masked_tile says whether any may be). mult: this thread's
  // multiplier (> 0), one for both rows: rows g and g + 8 share a Q group under every
  // granularity that comes with per-tile K scales (tile.h). p: P~ * p_max. alpha, sum: as
  // update's.
  // P's scale (p_max), by mode (PScaleMode, chosen per PV path and head dim by the kernel;
  // rules::p_scale_in_exponent and rules::p_scale_fold say the same for the simulator):
  //   multiply  P~ * p_max = ex2(x) * p_max, one multiply per score (the other PV paths: in
  //             the exponent SageAttention2++'s path lost at d = 64, v25c);
  //   add       ex2(x + k), k = log2(p_max) (fold_k): the add where the multiply was;
  //   fold      a thread whose multiplier is below fold_mult_limit (rules::p_scale_folds, as
  //             the simulator decides it per thread group) adds k to its offsets once, any
  //             other adds k to each exponent. The fold depends on mult alone, so its warp
  //             vote runs beside the max reduction, off the softmax's chain. Four loops, all
  //             before the exps: with the exps inside the branches ptxas issued the 64 MUFUs
  //             in one burst (v25a, docs/history/README.md). The folding warp's two loops
  //             repeat multiply and add's: shared, they changed ptxas's d = 128 schedule.
  // kPeak: also the row's peak P~ of the tile into `peak` (the PV path int8_dynamic), or -1
  // where the row sees no key of the tile (the simulator does not visit the tile for it).
  float peak[2] = {0.f, 0.f};
  template <PScaleMode kMode, bool kSum = true, bool kPeak = false>
  __device__ __forceinline__ void update_from_int(const int32_t (&acc)[kAcc], float mult,
                                                  bool masked_tile, float p_max, float fold_k,
                                                  float fold_mult_limit, float (&p)[kAcc],
                                                  float (&alpha)[2], float (&sum)[2]) {
    constexpr bool kFold = kMode == PScaleMode::fold;
    const bool folds = kFold && rules::p_scale_folds(mult, fold_mult_limit);
    const bool warp_folds = kFold && __all_sync(0xffffffffu, folds);
    const float k_in_offset = folds ? fold_k : 0.f;  // adding 0 leaves c as it is
    const float k_after = folds ? 0.f : fold_k;
    int32_t part[2][kChains];
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
      for (int c = 0; c < kChains; ++c) part[r][c] = INT32_MIN;
#pragma unroll
    for (int i = 0; i < kAcc; ++i) {
      int32_t& x = part[frag::acc_row(i)][chain_of(i)];
      x = max(x, acc[i]);
    }
    uint32_t bias[2];
    float c[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int32_t amax = max(max(part[r][0], part[r][1]), max(part[r][2], part[r][3]));
      // A thread whose columns of this row are all masked: tmax = c = -inf, so x = -inf.
      const float tmax = amax == INT32_MIN ? -INFINITY : __fmul_rn(__int2float_rn(amax), mult);
      const float row_tmax = frag::quad_max(tmax);
      const float m_new = fmaxf(m[r], row_tmax);
      const float base = m_new == -INFINITY ? 0.f : m_new;  // as in update
      alpha[r] = fast_exp2(m[r] - base);
      m[r] = m_new;
      // SageBwd's per-token P (docs/numerics.md step 7): the tile's largest P~ of the row,
      // 2^(tile max - m_new), from the maxima themselves (0 for a row with nothing visible).
      if constexpr (kPeak) peak[r] = row_tmax == -INFINITY ? -1.f : fast_exp2(__fsub_rn(row_tmax, base));
      c[r] = __fsub_rn(__fsub_rn(tmax, base), __fmul_rn(mult, 16777216.f));  // 2^24 mult: exact
      if (kFold) c[r] = __fadd_rn(c[r], k_in_offset);
      // The bits of float(n) for an integer n in [2^23, 2^24] are n + 0x4A800000.
      bias[r] = uint32_t(rules::kIntRowMaxBias) + 0x4A800000u - uint32_t(amax);
    }
    float psum[2][kChains];
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
      for (int k = 0; k < kChains; ++k) psum[r][k] = 0.f;
    auto exponent = [&](int i) {
      const int r = frag::acc_row(i);
      return __fmaf_rn(__uint_as_float(uint32_t(acc[i]) + bias[r]), mult, c[r]);
    };
    if (!kFold) {
      // multiply and add: k, or the multiply, in the exps' loop below (adding k in these
      // branches made ptxas spill at d = 64).
      if (masked_tile) {
#pragma unroll
        for (int i = 0; i < kAcc; ++i) p[i] = acc[i] == INT32_MIN ? -INFINITY : exponent(i);
      } else {
#pragma unroll
        for (int i = 0; i < kAcc; ++i) p[i] = exponent(i);
      }
    } else if (masked_tile) {
      if (warp_folds) {
#pragma unroll
        for (int i = 0; i < kAcc; ++i) p[i] = acc[i] == INT32_MIN ? -INFINITY : exponent(i);
      } else {
#pragma unroll
        for (int i = 0; i < kAcc; ++i)
          p[i] = acc[i] == INT32_MIN ? -INFINITY : __fadd_rn(exponent(i), k_after);
      }
    } else {
      if (warp_folds) {
#pragma unroll
        for (int i = 0; i < kAcc; ++i) p[i] = exponent(i);
      } else {
#pragma unroll
        for (int i = 0; i < kAcc; ++i) p[i] = __fadd_rn(exponent(i), k_after);
      }
    }
#pragma unroll
    for (int i = 0; i < kAcc; ++i) {
      if constexpr (kMode == PScaleMode::multiply)
        p[i] = __fmul_rn(fast_exp2(p[i]), p_max);
      else
        p[i] = fast_exp2(kMode == PScaleMode::add ? __fadd_rn(p[i], fold_k) : p[i]);
      if constexpr (kSum) psum[frag::acc_row(i)][chain_of(i)] += p[i];
    }
    if constexpr (kSum) {
#pragma unroll
      for (int r = 0; r < 2; ++r)
        sum[r] = (psum[r][0] + psum[r][1]) + (psum[r][2] + psum[r][3]);
    }
  }

  __device__ __forceinline__ void add_row_sum(const float (&alpha)[2], const float (&sum)[2]) {
#pragma unroll
    for (int r = 0; r < 2; ++r) l[r] = __fmaf_rn(l[r], alpha[r], sum[r]);
  }

 private:
  // Accumulator index -> chain: 8-column chunks round robin, so consecutive updates of one
  // row's chain are four chunks apart.
  __device__ __forceinline__ static constexpr int chain_of(int i) { return (i / 4) % kChains; }
};

}  // namespace sage::sm90
