// The PV accumulator models: how one KV tile's P·V products reach the running output row.
// See docs/numerics.md, step 9, for each model and why it matches the hardware.
#pragma once

#include <cstdint>
#include <vector>

#include "reference/pv_quantize.h"
#include "sage/recipe.h"

namespace sage::reference::sim {

// Reusable per-thread buffers, sized to head_dim on first use.
struct AccumScratch {
  std::vector<double> step;   // exact sum of one MMA k-step's products, per channel
  std::vector<double> grid;   // the FP8 MMA's alignment grid of one k-step, per channel
  std::vector<float> tile;    // a per-tile accumulator (fp32, fp22 or fp16 values)
  std::vector<int32_t> ints;  // int8 P and V: the exact int32 tile sum
};

// O = O * alpha + P·V over tokens [j0, j0 + p.values.size()) of v, with the rounding of
// `accum` (fp22 rescales O first and accumulates into it directly). O has v.d entries.
void accumulate_tile(PVAccum accum, const PTile& p, const VOperand& v, int64_t j0, float alpha,
                     float* O, AccumScratch& scratch);

// The tile's row sum as the PV MMA takes it under `accum` (RowSum::pv_mma): the sum of
// p.values (P~ * p_max units) over one more V channel of ones, with the same k-step rounding
// as accumulate_tile's channels. two_level only (rules::row_sum_in_pv_mma).
float pv_mma_row_sum(PVAccum accum, const PTile& p);

// The k-step widths of the tensor-core instructions the models follow.
constexpr int64_t kFp16KStep = 16;  // mma k16 with fp16 operands
constexpr int64_t kFp8KStep = 32;   // wgmma / mma k32 with 8-bit operands

}  // namespace sage::reference::sim
