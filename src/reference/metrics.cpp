#include "reference/metrics.h"

#include <cmath>
#include <string>
#include <vector>

#include "reference/tensor_io.h"
#include "sage/error.h"

namespace sage::reference {
namespace {

template <class A, class B>
ErrorStats compare_impl(const A* a, const B* ref, int64_t n) {
  ErrorStats s;
  s.count = n;
  double ab = 0, aa = 0, bb = 0, l1 = 0, l1_ref = 0, sq = 0, mx = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double x = a[i], y = ref[i];
    if (!std::isfinite(x)) ++s.nonfinite;
    const double e = x - y;
    ab += x * y;
    aa += x * x;
    bb += y * y;
    l1 += std::fabs(e);
    l1_ref += std::fabs(y);
    sq += e * e;
    // NaN must win the max, so compare in the form that is false for NaN.
    if (!(std::fabs(e) <= mx)) mx = std::fabs(e);
  }
  if (aa == 0 && bb == 0) s.cosine = 1.0;
  else if (aa == 0 || bb == 0) s.cosine = 0.0;
  else s.cosine = ab / std::sqrt(aa * bb);
  s.rel_l1 = l1_ref > 0 ? l1 / l1_ref : (l1 == 0 ? 0.0 : HUGE_VAL);
  s.rmse = n > 0 ? std::sqrt(sq / static_cast<double>(n)) : 0.0;
  s.max_abs = mx;
  return s;
}

std::vector<double> read_any(const TensorView& v, Layout layout) {
  return v.ndim == 4 ? read_bhnd_f64(v, layout) : read_flat_f64(v);
}

}  // namespace

ErrorStats compare(const double* a, const double* ref, int64_t n) { return compare_impl(a, ref, n); }
ErrorStats compare(const float* a, const double* ref, int64_t n) { return compare_impl(a, ref, n); }
ErrorStats compare(const float* a, const float* ref, int64_t n) { return compare_impl(a, ref, n); }

ErrorStats compare(const TensorView& a, Layout a_layout, const TensorView& ref, Layout ref_layout) {
  const std::vector<double> x = read_any(a, a_layout), y = read_any(ref, ref_layout);
  bool same = a.ndim == ref.ndim && x.size() == y.size();
  if (same && a.ndim == 4) {
    const Dims4 da = dims_of(a, a_layout), db = dims_of(ref, ref_layout);
    same = da.b == db.b && da.h == db.h && da.n == db.n && da.d == db.d;
  } else if (same) {
    for (int i = 0; i < a.ndim; ++i) same = same && a.shape[i] == ref.shape[i];
  }
  if (!same) throw Error("tensor", "compare needs two views of the same logical shape");
  return compare_impl(x.data(), y.data(), static_cast<int64_t>(x.size()));
}

}  // namespace sage::reference
