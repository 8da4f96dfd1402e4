#include "reference/accumulate.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "reference/rounding.h"

namespace sage::reference::sim {
namespace {

// The sum of the products of tokens [t0, t1) of the tile, per channel, in double: exact for
// E4M3 and INT8 codes (8-bit products between 2^-18 and 2^18), within 2^-53 relative for
// fp16 and E5M2 operands, which is below any rounding the models apply afterwards.
void step_sum(const PTile& p, const VOperand& v, int64_t j0, int64_t t0, int64_t t1, double* s) {
  const int64_t d = v.d;
  std::fill(s, s + d, 0.0);
  for (int64_t t = t0; t < t1; ++t) {
    const double pt = p.values[t];
    if (pt == 0.0 && !v.nonfinite) continue;
    const float* vt = v.values.data() + (j0 + t) * d;
    for (int64_t c = 0; c < d; ++c) s[c] += pt * vt[c];
  }
}


// One k32 step of the FP8 MMA into acc[0, d) (FP22 values), as the sm_90 tensor core does it
// (measured, bench/probe_fp8_accum.cu, every one of 162 crafted rows bit for bit on the H200):
// the accumulator and the step's products are each truncated toward zero to the grid of 13
// fraction bits below the leading bit of the largest of them in magnitude, the truncated terms
// are summed exactly, and the sum is truncated to FP22. (Summing exactly and truncating only
// the sum, the model before, matched 103 of the 162: it keeps the low bits that small products
// lose beside a large one, which biased a sum of positive P upwards.)
// product(t, c): the exact product of token t's P and channel c's V (double); tokens [t0, t1).
// grid, step: d doubles of scratch each.
// A NaN or an infinity among the terms gives their IEEE sum (NaN, or an infinity), as the
// tensor core's does; the grid is for finite terms.
template <class Product>
void fp8_mma_step(int64_t d, int64_t t0, int64_t t1, Product product, float* acc, double* grid,
                  double* step) {
  for (int64_t c = 0; c < d; ++c) grid[c] = std::fabs(double(acc[c]));  // the largest |term|
  for (int64_t t = t0; t < t1; ++t)
    for (int64_t c = 0; c < d; ++c) {
      const double term = std::fabs(product(t, c));
      grid[c] = std::isnan(term) || std::isnan(grid[c]) ? term + grid[c] : std::max(grid[c], term);
    }
  for (int64_t c = 0; c < d; ++c) {
    if (std::isfinite(grid[c])) continue;
    double sum = double(acc[c]);
    for (int64_t t = t0; t < t1; ++t) sum += product(t, c);
    acc[c] = static_cast<float>(sum);
    grid[c] = -1.0;  // done: the finite-grid passes below leave this channel alone
  }
  for (int64_t c = 0; c < d; ++c) {
    if (grid[c] < 0.0) continue;
    int e = 0;
    std::frexp(grid[c], &e);  // largest = m 2^e, m in [0.5, 1): its leading bit is 2^(e - 1)
    // The inverse of the grid 2^(e - 14), or 0 where every term is 0 (they all stay 0).
    grid[c] = grid[c] > 0.0 ? std::ldexp(1.0, 14 - e) : 0.0;
    step[c] = grid[c] > 0.0 ? std::trunc(double(acc[c]) * grid[c]) / grid[c] : 0.0;
  }
  for (int64_t t = t0; t < t1; ++t)
    for (int64_t c = 0; c < d; ++c)
      if (grid[c] > 0.0) step[c] += std::trunc(product(t, c) * grid[c]) / grid[c];
  for (int64_t c = 0; c < d; ++c)
    if (grid[c] >= 0.0) acc[c] = truncate_double_to_fp22(step[c]);
}

// fp8_mma_step over tokens [t0, t1) of the tile, for every channel of v.
void fp8_mma_step(const PTile& p, const VOperand& v, int64_t j0, int64_t t0, int64_t t1,
                  float* acc, AccumScratch& sc) {
  const int64_t d = v.d;
  const auto product = [&](int64_t t, int64_t c) {
    return double(p.values[t]) * double(v.values[(j0 + t) * d + c]);
  };
  fp8_mma_step(d, t0, t1, product, acc, sc.grid.data(), sc.step.data());
}

}  // namespace

void accumulate_tile(PVAccum accum, const PTile& p, const VOperand& v, int64_t j0, float alpha,
                     float* O, AccumScratch& sc) {
  const int64_t d = v.d;
  const int64_t count = static_cast<int64_t>(p.values.size());
  sc.step.resize(static_cast<size_t>(d));
  sc.grid.resize(static_cast<size_t>(d));
  sc.tile.resize(static_cast<size_t>(d));
  double* s = sc.step.data();
  float* acc = sc.tile.data();

  switch (accum) {
    case PVAccum::fp32: {
      if (!v.int_codes.empty() && !p.int_codes.empty()) {
        // The INT8 MMA accumulates in int32 exactly; it is converted once per tile.
        sc.ints.assign(static_cast<size_t>(d), 0);
        for (int64_t t = 0; t < count; ++t) {
          const int32_t pt = p.int_codes[t];
          if (pt == 0) continue;
          const int8_t* vt = v.int_codes.data() + (j0 + t) * d;
          for (int64_t c = 0; c < d; ++c) sc.ints[c] += pt * static_cast<int32_t>(vt[c]);
        }
        // Per-tile scales (SageBwd's per_token P and per_block V) enter with one fused
        // multiply-add; static ones are applied at the output, so the factor is 1 there and
        // the fma is the plain add (float(acc) is exact).
        const float factor = p.row_scale * v.tile_scale(j0);
        for (int64_t c = 0; c < d; ++c)
          O[c] = std::fma(static_cast<float>(sc.ints[c]), factor, O[c] * alpha);
        return;
      }
      std::fill(acc, acc + d, 0.f);
      for (int64_t t = 0; t < count; ++t) {
        const float pt = p.values[t];
        const float* vt = v.values.data() + (j0 + t) * d;
        for (int64_t c = 0; c < d; ++c) acc[c] += pt * vt[c];
      }
      for (int64_t c = 0; c < d; ++c) O[c] = O[c] * alpha + acc[c] * p.row_scale;
      return;
    }
    case PVAccum::fp16: {
      std::fill(acc, acc + d, 0.f);
      for (int64_t t0 = 0; t0 < count; t0 += kFp16KStep) {
        step_sum(p, v, j0, t0, std::min(count, t0 + kFp16KStep), s);
        for (int64_t c = 0; c < d; ++c) acc[c] = round_double_to_fp16(acc[c] + s[c]);
      }
      for (int64_t c = 0; c < d; ++c) O[c] = O[c] * alpha + acc[c];
      return;
    }
    case PVAccum::fp22: {
      for (int64_t c = 0; c < d; ++c) O[c] *= alpha;
      for (int64_t t0 = 0; t0 < count; t0 += kFp8KStep)
        fp8_mma_step(p, v, j0, t0, std::min(count, t0 + kFp8KStep), O, sc);
      return;
    }
    case PVAccum::two_level: {
      std::fill(acc, acc + d, 0.f);
      for (int64_t t0 = 0; t0 < count; t0 += kFp8KStep)
        fp8_mma_step(p, v, j0, t0, std::min(count, t0 + kFp8KStep), acc, sc);
      for (int64_t c = 0; c < d; ++c) O[c] = O[c] * alpha + acc[c];
      return;
    }
    case PVAccum::fp16x2_fp32: {
      // The output is rescaled first and each pair's f16 sum is added straight into it: no
      // fp32 tile buffer, which is the registers this accumulation saves (pv_operand.cuh).
      for (int64_t c = 0; c < d; ++c) O[c] *= alpha;
      for (int64_t pair = 0; pair < count; pair += 2 * kFp8KStep) {
        std::fill(acc, acc + d, 0.f);
        for (int64_t t0 = pair; t0 < std::min(count, pair + 2 * kFp8KStep); t0 += kFp8KStep) {
          step_sum(p, v, j0, t0, std::min(count, t0 + kFp8KStep), s);
          for (int64_t c = 0; c < d; ++c) acc[c] = round_double_to_fp16(acc[c] + s[c]);
        }
        for (int64_t c = 0; c < d; ++c) O[c] += acc[c];
      }
      return;
    }
  }
}

float pv_mma_row_sum(PVAccum accum, const PTile& p) {
  if (accum != PVAccum::two_level)
    throw std::logic_error("pv_mma_row_sum: two_level accumulation only (rules::row_sum_in_pv_mma)");
  const int64_t count = static_cast<int64_t>(p.values.size());
  const auto times_one = [&](int64_t t, int64_t) { return double(p.values[t]); };
  float acc = 0.f;
  double grid = 0.0, step = 0.0;
  for (int64_t t0 = 0; t0 < count; t0 += kFp8KStep)
    fp8_mma_step(1, t0, std::min(count, t0 + kFp8KStep), times_one, &acc, &grid, &step);
  return acc;
}

}  // namespace sage::reference::sim
