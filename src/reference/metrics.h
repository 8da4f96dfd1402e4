// Error metrics between an approximation and a reference, as the papers report them
// (SageAttention2 appendix A.7): both tensors flattened, then
//   cosine  = sum(a b) / sqrt(sum a^2 sum b^2)
//   rel_l1  = sum |a - b| / sum |b|          (b is the reference)
//   rmse    = sqrt(mean (a - b)^2)
//   max_abs = max |a - b|
// Non-finite values are not filtered: they propagate into the metrics (NaN fails every
// bound) and are counted in `nonfinite`.
#pragma once

#include <cstdint>

#include "sage/tensor.h"

namespace sage::reference {

struct ErrorStats {
  double cosine = 1.0;
  double rel_l1 = 0.0;
  double rmse = 0.0;
  double max_abs = 0.0;
  int64_t count = 0;
  int64_t nonfinite = 0;  // elements of `a` that are Inf or NaN
};

// Two all-zero arrays have cosine 1 and rel_l1 0; a zero reference against a nonzero
// approximation has cosine 0 and rel_l1 +inf.
ErrorStats compare(const double* a, const double* ref, int64_t n);
ErrorStats compare(const float* a, const double* ref, int64_t n);
ErrorStats compare(const float* a, const float* ref, int64_t n);
// Views of any dtype tensor_io reads; 4-d views are read in (b, h, n, d) order under
// `layout`, so an NHD result compares against an HND reference. Shapes must agree.
ErrorStats compare(const TensorView& a, Layout a_layout, const TensorView& ref, Layout ref_layout);

}  // namespace sage::reference
