// Accuracy of one recipe on one synthetic input on the CPU: what `check` and `docs` share.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "reference/metrics.h"
#include "reference/synthetic.h"
#include "sage/attention.h"

namespace sage::cli {

struct CheckShape {
  int64_t batch = 1, heads = 2, kv_heads = 2, n = 1024, d = 128;
  int64_t dv = 0;  // V's (and the output's) head dim; 0: d
  int64_t v_dim() const { return dv > 0 ? dv : d; }
  bool causal = false;
  int64_t window_left = -1, window_right = -1;  // the sliding window (-1: unbounded)
  uint64_t seed = 0;
  reference::SyntheticShape synthetic() const;
  // "batch 1, heads 2/2, N 1024, d 128, non-causal, seed 0" (", d_v 128" after d when V's
  // head dim differs, ", window (L, R)" when set)
  std::string describe() const;
};

// One distribution's inputs and its float64 reference output, computed once and shared by
// every recipe checked on it.
class DistributionCase {
 public:
  DistributionCase(const std::string& distribution, const CheckShape& shape);

  const reference::SyntheticInputs& inputs() const { return inputs_; }
  const CheckShape& shape() const { return shape_; }
  // Exact attention of the fp16 inputs, HND, as f64.
  const std::vector<double>& exact() const { return exact_; }
  TensorView exact_view() const;

  // The arguments `recipe` takes on these inputs, with `out` as output. A prequantized
  // recipe gets the INT8 codes and scales that prequantize_int8 makes of the same inputs
  // (V per tensor or per channel as the recipe says), so every recipe's error is measured
  // against exact attention of the same fp16 tensors.
  AttentionArgs args(const Recipe& recipe, const TensorView& out);
  const reference::PrequantizedInputs& prequantized(bool v_per_channel);

  // simulate() with an f16 output: the numbers the kernel would write.
  std::vector<uint16_t> simulate(const Recipe& recipe);
  TensorView out_view(void* data, DType dtype) const;

 private:
  CheckShape shape_;
  reference::SyntheticInputs inputs_;
  std::vector<double> exact_;
  std::unique_ptr<reference::PrequantizedInputs> preq_[2];  // [v_per_channel]
};

}  // namespace sage::cli
