// DLPack -> sage::TensorView.
//
// nanobind does the DLPack import (capsule protocol, versioned or not); this file only
// maps the DLPack description onto the library's vocabulary. Every failure is a
// sage::Error naming the argument, so Python sees the same kind of message as for any
// other bad argument.
#include "views.h"

#include <cstdint>
#include <string>

#include "sage/error.h"

namespace sagepy {
namespace {

namespace dl = nb::dlpack;

// DLPack 1.1 numbers its FP8 codes after the classic ones; nanobind's enum predates them.
constexpr uint8_t kDLFloat8_e4m3fn = 10;
constexpr uint8_t kDLFloat8_e5m2 = 12;
constexpr uint8_t kDLFloat8_e8m0fnu = 14;

std::string dlpack_dtype_name(dl::dtype t) {
  std::string base;
  switch (t.code) {
    case (uint8_t)dl::dtype_code::Int: base = "int"; break;
    case (uint8_t)dl::dtype_code::UInt: base = "uint"; break;
    case (uint8_t)dl::dtype_code::Float: base = "float"; break;
    case (uint8_t)dl::dtype_code::Bfloat: base = "bfloat"; break;
    case (uint8_t)dl::dtype_code::Complex: base = "complex"; break;
    case (uint8_t)dl::dtype_code::Bool: return "bool";
    case kDLFloat8_e4m3fn: return "float8_e4m3fn";
    case kDLFloat8_e5m2: return "float8_e5m2";
    case kDLFloat8_e8m0fnu: return "float8_e8m0fnu";
    default: base = "dlpack_code" + std::to_string(t.code) + "_bits";
  }
  std::string s = base + std::to_string(t.bits);
  if (t.lanes != 1) s += "x" + std::to_string(t.lanes);
  return s;
}

sage::DType dtype_of(dl::dtype t, const char* name) {
  if (t.lanes == 1) {
    switch (t.code) {
      case (uint8_t)dl::dtype_code::Float:
        if (t.bits == 16) return sage::DType::f16;
        if (t.bits == 32) return sage::DType::f32;
        if (t.bits == 64) return sage::DType::f64;
        break;
      case (uint8_t)dl::dtype_code::Bfloat:
        if (t.bits == 16) return sage::DType::bf16;
        break;
      case (uint8_t)dl::dtype_code::Int:
        if (t.bits == 8) return sage::DType::i8;
        if (t.bits == 32) return sage::DType::i32;
        break;
      case kDLFloat8_e4m3fn:
        if (t.bits == 8) return sage::DType::e4m3;
        break;
      case kDLFloat8_e5m2:
        if (t.bits == 8) return sage::DType::e5m2;
        break;
      case kDLFloat8_e8m0fnu:
        if (t.bits == 8) return sage::DType::e8m0;
        break;
      default: break;
    }
  }
  throw sage::Error(name, "dtype " + dlpack_dtype_name(t) +
                              " is not supported (allowed: float16, bfloat16, float32, float64, "
                              "int8, int32, float8_e4m3fn, float8_e5m2, float8_e8m0fnu)");
}

template <class Array>
sage::TensorView view_of(const Array& a, const char* name) {
  sage::TensorView v;
  if (a.ndim() > static_cast<size_t>(sage::kMaxDims))
    throw sage::Error(name, "must have at most " + std::to_string(sage::kMaxDims) +
                                " dimensions (got " + std::to_string(a.ndim()) + ")");
  v.dtype = dtype_of(a.dtype(), name);
  v.ndim = static_cast<int>(a.ndim());
  for (int i = 0; i < v.ndim; ++i) {
    v.shape[i] = static_cast<int64_t>(a.shape(i));
    v.strides[i] = a.stride(i);
  }
  // data() already includes DLPack's byte_offset, so storage offsets of views survive.
  v.data = const_cast<void*>(static_cast<const void*>(a.data()));
  v.device = device_of(a.device_type(), a.device_id(), name);
  return v;
}

std::string type_label(nb::handle obj) {
  return nb::type_name(obj.type()).c_str();
}

[[noreturn]] void not_an_array(nb::handle obj, const char* name) {
  throw sage::Error(name, "expected an array with DLPack support (a NumPy array, a torch tensor "
                          "or a DLPack capsule), got " + type_label(obj) +
                          " (a torch tensor that requires grad must be detached first)");
}

}  // namespace

sage::Device device_of(int type, int id, const char* name) {
  switch (type) {
    case nb::device::cpu::value:
    case nb::device::cuda_host::value:  // pinned host memory is ordinary host memory to us
      return sage::Device::cpu();
    case nb::device::cuda::value:
    case nb::device::cuda_managed::value:
      return sage::Device::cuda(id);
    default:
      throw sage::Error(name, "lives on DLPack device type " + std::to_string(type) +
                                  ", which sagekit cannot address (allowed: CPU, CUDA)");
  }
}

sage::TensorView ViewSet::input(nb::handle obj, const char* name) {
  if (obj.is_none()) return sage::TensorView{};
  nb::ndarray<nb::ro> a;
  if (!nb::try_cast(obj, a, /*convert=*/false)) not_an_array(obj, name);
  read_only_.push_back(a);
  return view_of(a, name);
}

sage::TensorView ViewSet::output(nb::handle obj, const char* name) {
  if (obj.is_none()) return sage::TensorView{};
  nb::ndarray<> a;
  if (!nb::try_cast(obj, a, /*convert=*/false)) {
    // A capsule is consumed by the first import attempt, so only retry with objects.
    nb::ndarray<nb::ro> ro;
    if (!PyCapsule_CheckExact(obj.ptr()) && nb::try_cast(obj, ro, false))
      throw sage::Error(name, "must be writable (got a read-only array)");
    not_an_array(obj, name);
  }
  writable_.push_back(a);
  return view_of(a, name);
}

namespace {

template <class Array>
void* flat_bytes(const Array& a, const char* name, size_t* size, sage::Device* device) {
  // The library treats the buffer as one flat range, so it must be dense.
  int64_t expected = 1;
  for (size_t i = a.ndim(); i-- > 0;) {
    if (a.shape(i) != 1 && a.stride(i) != expected)
      throw sage::Error(name, "must be contiguous (a flat byte buffer)");
    expected *= static_cast<int64_t>(a.shape(i));
  }
  *size = a.nbytes();
  *device = device_of(a.device_type(), a.device_id(), name);
  return const_cast<void*>(static_cast<const void*>(a.data()));
}

}  // namespace

void* ViewSet::bytes(nb::handle obj, const char* name, size_t* size, sage::Device* device,
                     bool read_only) {
  if (read_only) {
    nb::ndarray<nb::ro> a;
    if (!nb::try_cast(obj, a, /*convert=*/false)) not_an_array(obj, name);
    read_only_.push_back(a);
    return flat_bytes(a, name, size, device);
  }
  nb::ndarray<> a;
  if (!nb::try_cast(obj, a, /*convert=*/false)) not_an_array(obj, name);
  writable_.push_back(a);
  return flat_bytes(a, name, size, device);
}

}  // namespace sagepy
