// Tensor view helpers: names for messages and the two view constructors.
#include "sage/tensor.h"

#include <string>

#include "sage/error.h"

namespace sage {

const char* dtype_name(DType t) {
  switch (t) {
    case DType::f16: return "f16";
    case DType::bf16: return "bf16";
    case DType::f32: return "f32";
    case DType::f64: return "f64";
    case DType::i8: return "i8";
    case DType::i32: return "i32";
    case DType::e4m3: return "e4m3";
    case DType::e5m2: return "e5m2";
    case DType::e2m1x2: return "e2m1x2";
    case DType::e8m0: return "e8m0";
  }
  return "?";
}

size_t dtype_size(DType t) {
  switch (t) {
    case DType::f16:
    case DType::bf16: return 2;
    case DType::f32:
    case DType::i32: return 4;
    case DType::f64: return 8;
    case DType::i8:
    case DType::e4m3:
    case DType::e5m2:
    case DType::e2m1x2:
    case DType::e8m0: return 1;
  }
  return 0;
}

std::string device_name(const Device& d) {
  // The CPU has one address space, so its index carries no information and is left out.
  if (d.kind == DeviceKind::cpu) return "cpu";
  return "cuda:" + std::to_string(d.index);
}

int64_t TensorView::numel() const {
  // An undefined view holds nothing; a defined 0-d view is a scalar.
  if (!defined()) return 0;
  int64_t n = 1;
  for (int i = 0; i < ndim; ++i) n *= shape[i];
  return n;
}

namespace {

void set_shape(TensorView& t, std::initializer_list<int64_t> shape) {
  if (shape.size() > static_cast<size_t>(kMaxDims))
    throw Error("shape", "a view has at most " + std::to_string(kMaxDims) + " dimensions (got " +
                             std::to_string(shape.size()) + ")");
  int i = 0;
  for (int64_t s : shape) {
    if (s < 0)
      throw Error("shape", "dimensions must be >= 0 (got " + std::to_string(s) + " in dimension " +
                               std::to_string(i) + ")");
    t.shape[i++] = s;
  }
  t.ndim = i;
}

}  // namespace

TensorView contiguous_view(void* data, DType dtype, std::initializer_list<int64_t> shape,
                           Device device) {
  TensorView t;
  t.data = data;
  t.dtype = dtype;
  t.device = device;
  set_shape(t, shape);
  int64_t stride = 1;
  for (int i = t.ndim - 1; i >= 0; --i) {
    t.strides[i] = stride;
    // A zero-sized dimension would zero every outer stride; keep them meaningful instead.
    stride *= t.shape[i] > 0 ? t.shape[i] : 1;
  }
  return t;
}

TensorView strided_view(void* data, DType dtype, std::initializer_list<int64_t> shape,
                        std::initializer_list<int64_t> strides, Device device) {
  if (strides.size() != shape.size())
    throw Error("strides", "must have one entry per dimension, " + std::to_string(shape.size()) +
                               " (got " + std::to_string(strides.size()) + ")");
  TensorView t;
  t.data = data;
  t.dtype = dtype;
  t.device = device;
  set_shape(t, shape);
  // Stride values are checked where they are used (check_args), which names the argument.
  int i = 0;
  for (int64_t s : strides) t.strides[i++] = s;
  return t;
}

const char* layout_name(Layout l) {
  switch (l) {
    case Layout::HND: return "HND";
    case Layout::NHD: return "NHD";
  }
  return "?";
}

}  // namespace sage
