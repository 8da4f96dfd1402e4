#include "reference/accumulate.h"

#include <algorithm>

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
    if (pt == 0.0) continue;
    const float* vt = v.values.data() + (j0 + t) * d;
    for (int64_t c = 0; c < d; ++c) s[c] += pt * vt[c];
  }
}


}  // namespace

void accumulate_tile(PVAccum accum, const PTile& p, const VOperand& v, int64_t j0, float alpha,
                     float* O, AccumScratch& sc) {
  const int64_t d = v.d;
  const int64_t count = static_cast<int64_t>(p.values.size());
  sc.step.resize(static_cast<size_t>(d));
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
        for (int64_t c = 0; c < d; ++c) O[c] = O[c] * alpha + static_cast<float>(sc.ints[c]);
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
      for (int64_t t0 = 0; t0 < count; t0 += kFp8KStep) {
        step_sum(p, v, j0, t0, std::min(count, t0 + kFp8KStep), s);
        for (int64_t c = 0; c < d; ++c) O[c] = truncate_double_to_fp22(O[c] + s[c]);
      }
      return;
    }
    case PVAccum::two_level: {
      std::fill(acc, acc + d, 0.f);
      for (int64_t t0 = 0; t0 < count; t0 += kFp8KStep) {
        step_sum(p, v, j0, t0, std::min(count, t0 + kFp8KStep), s);
        for (int64_t c = 0; c < d; ++c) acc[c] = truncate_double_to_fp22(acc[c] + s[c]);
      }
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

}  // namespace sage::reference::sim
