// Moving attention tensors between caller views (any dtype, layout, strides) and the dense
// row-major (batch, heads, tokens, head_dim) arrays the CPU references compute on.
//
// Reading is exact for every dtype listed below (into float: all but f64, and i32 beyond
// 2^24). Writing rounds once, to nearest even, from the value given: a double is rounded
// straight to f16/bf16 without a detour through float, so the float64 reference stays the
// correctly rounded answer in any output dtype.
#pragma once

#include <cstdint>
#include <vector>

#include "sage/tensor.h"

namespace sage::reference {

// The logical shape of a dense (b, h, n, d) array.
struct Dims4 {
  int64_t b = 0, h = 0, n = 0, d = 0;
  int64_t numel() const { return b * h * n * d; }
};

// The (b, h, n, d) shape a 4-d attention view has under `layout`.
Dims4 dims_of(const TensorView& v, Layout layout);

// Reads a 4-d view of dtype f16, bf16, f32, f64, i8, i32, e4m3 or e5m2 into a dense
// (b, h, n, d) array. Throws sage::Error("tensor", ...) for other dtypes or ndim != 4.
std::vector<float> read_bhnd_f32(const TensorView& v, Layout layout);
std::vector<double> read_bhnd_f64(const TensorView& v, Layout layout);

// Writes a dense (b, h, n, d) array into a 4-d view of dtype f16, bf16, f32 or f64.
void write_bhnd(const TensorView& v, Layout layout, const float* data);
void write_bhnd(const TensorView& v, Layout layout, const double* data);

// Views of any rank (scales, LSE) read and written in the row-major order of their logical
// shape, honouring strides.
std::vector<double> read_flat_f64(const TensorView& v);
void write_flat(const TensorView& v, const double* data);
void write_flat(const TensorView& v, const float* data);

}  // namespace sage::reference
