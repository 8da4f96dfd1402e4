#include "reference/tensor_io.h"

#include <string>

#include "reference/rounding.h"
#include "sage/error.h"
#include "numerics/formats.h"

namespace sage::reference {
namespace {

// Element offsets of a 4-d view in logical (b, h, n, d) order.
struct Strides4 {
  int64_t b, h, n, d;
};

Strides4 strides_of(const TensorView& v, Layout layout) {
  if (layout == Layout::HND) return {v.strides[0], v.strides[1], v.strides[2], v.strides[3]};
  return {v.strides[0], v.strides[2], v.strides[1], v.strides[3]};
}

void require_rank4(const TensorView& v) {
  if (v.ndim != 4)
    throw Error("tensor", "the CPU reference reads 4-d attention views (got " +
                              std::to_string(v.ndim) + " dimensions)");
}

[[noreturn]] void bad_dtype(const TensorView& v, const char* what) {
  throw Error("tensor", std::string("the CPU reference cannot ") + what + " dtype " +
                            dtype_name(v.dtype));
}

// Calls f(dense_index, element_offset) for every element, dense index in (b, h, n, d) order.
template <class F>
void for_each_bhnd(const Dims4& dm, const Strides4& st, F&& f) {
  int64_t idx = 0;
  for (int64_t b = 0; b < dm.b; ++b)
    for (int64_t h = 0; h < dm.h; ++h)
      for (int64_t n = 0; n < dm.n; ++n) {
        const int64_t base = b * st.b + h * st.h + n * st.n;
        for (int64_t d = 0; d < dm.d; ++d) f(idx++, base + d * st.d);
      }
}

// The dtype switch sits outside the element loop: one instantiation per dtype.
template <class Out>
std::vector<Out> read4(const TensorView& v, Layout layout) {
  require_rank4(v);
  const Dims4 dm = dims_of(v, layout);
  const Strides4 st = strides_of(v, layout);
  std::vector<Out> out(static_cast<size_t>(dm.numel()));
  auto run = [&](auto load) {
    for_each_bhnd(dm, st, [&](int64_t i, int64_t off) { out[i] = static_cast<Out>(load(off)); });
  };
  switch (v.dtype) {
    case DType::f16: run([p = v.ptr<const uint16_t>()](int64_t o) { return fmt::fp16_from_bits(p[o]); }); break;
    case DType::bf16: run([p = v.ptr<const uint16_t>()](int64_t o) { return fmt::bf16_from_bits(p[o]); }); break;
    case DType::f32: run([p = v.ptr<const float>()](int64_t o) { return p[o]; }); break;
    case DType::f64: run([p = v.ptr<const double>()](int64_t o) { return p[o]; }); break;
    case DType::i8: run([p = v.ptr<const int8_t>()](int64_t o) { return static_cast<double>(p[o]); }); break;
    case DType::i32: run([p = v.ptr<const int32_t>()](int64_t o) { return static_cast<double>(p[o]); }); break;
    case DType::e4m3: run([p = v.ptr<const uint8_t>()](int64_t o) { return fmt::e4m3_decode(p[o]); }); break;
    case DType::e5m2: run([p = v.ptr<const uint8_t>()](int64_t o) { return fmt::e5m2_decode(p[o]); }); break;
    default: bad_dtype(v, "read");
  }
  return out;
}

template <class In>
float narrow(In x, DType t);

template <>
float narrow<float>(float x, DType t) {
  if (t == DType::f16) return fmt::round_fp16(x);
  return fmt::round_bf16(x);
}
template <>
float narrow<double>(double x, DType t) {
  return t == DType::f16 ? round_double_to_fp16(x) : round_double_to_bf16(x);
}

template <class In>
void store(const TensorView& v, int64_t off, In x) {
  switch (v.dtype) {
    case DType::f16: v.ptr<uint16_t>()[off] = fmt::fp16_bits(narrow<In>(x, DType::f16)); break;
    case DType::bf16: v.ptr<uint16_t>()[off] = fmt::bf16_bits(narrow<In>(x, DType::bf16)); break;
    case DType::f32: v.ptr<float>()[off] = static_cast<float>(x); break;
    case DType::f64: v.ptr<double>()[off] = static_cast<double>(x); break;
    default: bad_dtype(v, "write");
  }
}

template <class In>
void write4(const TensorView& v, Layout layout, const In* data) {
  require_rank4(v);
  switch (v.dtype) {
    case DType::f16: case DType::bf16: case DType::f32: case DType::f64: break;
    default: bad_dtype(v, "write");
  }
  for_each_bhnd(dims_of(v, layout), strides_of(v, layout),
                [&](int64_t i, int64_t off) { store<In>(v, off, data[i]); });
}

// Calls f(dense_index, element_offset) over a view of any rank in row-major logical order.
template <class F>
void for_each_flat(const TensorView& v, F&& f) {
  int64_t shape[kMaxDims] = {1, 1, 1, 1}, strides[kMaxDims] = {0, 0, 0, 0};
  const int pad = kMaxDims - v.ndim;
  for (int i = 0; i < v.ndim; ++i) {
    shape[pad + i] = v.shape[i];
    strides[pad + i] = v.strides[i];
  }
  int64_t idx = 0;
  for (int64_t a = 0; a < shape[0]; ++a)
    for (int64_t b = 0; b < shape[1]; ++b)
      for (int64_t c = 0; c < shape[2]; ++c)
        for (int64_t d = 0; d < shape[3]; ++d)
          f(idx++, a * strides[0] + b * strides[1] + c * strides[2] + d * strides[3]);
}

template <class In>
void write_flat_impl(const TensorView& v, const In* data) {
  for_each_flat(v, [&](int64_t i, int64_t off) { store<In>(v, off, data[i]); });
}

}  // namespace

Dims4 dims_of(const TensorView& v, Layout layout) {
  require_rank4(v);
  if (layout == Layout::HND) return {v.shape[0], v.shape[1], v.shape[2], v.shape[3]};
  return {v.shape[0], v.shape[2], v.shape[1], v.shape[3]};
}

std::vector<float> read_bhnd_f32(const TensorView& v, Layout layout) {
  if (v.dtype == DType::f64) bad_dtype(v, "read into float without rounding");
  return read4<float>(v, layout);
}
std::vector<double> read_bhnd_f64(const TensorView& v, Layout layout) {
  return read4<double>(v, layout);
}

void write_bhnd(const TensorView& v, Layout layout, const float* data) { write4(v, layout, data); }
void write_bhnd(const TensorView& v, Layout layout, const double* data) { write4(v, layout, data); }

std::vector<double> read_flat_f64(const TensorView& v) {
  std::vector<double> out(static_cast<size_t>(v.numel()));
  auto run = [&](auto load) {
    for_each_flat(v, [&](int64_t i, int64_t off) { out[i] = static_cast<double>(load(off)); });
  };
  switch (v.dtype) {
    case DType::f16: run([p = v.ptr<const uint16_t>()](int64_t o) { return fmt::fp16_from_bits(p[o]); }); break;
    case DType::bf16: run([p = v.ptr<const uint16_t>()](int64_t o) { return fmt::bf16_from_bits(p[o]); }); break;
    case DType::f32: run([p = v.ptr<const float>()](int64_t o) { return p[o]; }); break;
    case DType::f64: run([p = v.ptr<const double>()](int64_t o) { return p[o]; }); break;
    case DType::i8: run([p = v.ptr<const int8_t>()](int64_t o) { return p[o]; }); break;
    case DType::i32: run([p = v.ptr<const int32_t>()](int64_t o) { return p[o]; }); break;
    default: bad_dtype(v, "read");
  }
  return out;
}

void write_flat(const TensorView& v, const double* data) { write_flat_impl(v, data); }
void write_flat(const TensorView& v, const float* data) { write_flat_impl(v, data); }

}  // namespace sage::reference
