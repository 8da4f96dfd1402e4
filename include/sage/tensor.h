// Non-owning tensor views: the only way data enters or leaves the library.
//
// A view is a pointer, an element type, up to four dimensions, strides counted in
// elements (not bytes) and the device the memory lives on. Views never own memory,
// so callers keep full control of allocation (no call of this library allocates).
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>

namespace sage {

enum class DType : uint8_t {
  f16,
  bf16,
  f32,
  f64,
  i8,
  i32,
  e4m3,    // FP8 E4M3 (OCP "fn": no infinities, 0x7F/0xFF are NaN, max 448)
  e5m2,    // FP8 E5M2 (IEEE-like, max finite 57344)
  e2m1x2,  // two FP4 E2M1 values per byte, low nibble first; shapes count bytes
  e8m0,    // unsigned power-of-two scale (MX scale factor), 0xFF is NaN
};

const char* dtype_name(DType t);
// Bytes of one addressable element (e2m1x2 counts one byte holding two values).
size_t dtype_size(DType t);

enum class DeviceKind : uint8_t { cpu, cuda };

struct Device {
  DeviceKind kind = DeviceKind::cpu;
  int index = 0;
  static Device cpu() { return {DeviceKind::cpu, 0}; }
  static Device cuda(int i = 0) { return {DeviceKind::cuda, i}; }
  bool operator==(const Device& o) const { return kind == o.kind && index == o.index; }
  bool operator!=(const Device& o) const { return !(*this == o); }
};
std::string device_name(const Device& d);

constexpr int kMaxDims = 4;

struct TensorView {
  void* data = nullptr;
  DType dtype = DType::f16;
  int ndim = 0;
  int64_t shape[kMaxDims] = {0, 0, 0, 0};
  int64_t strides[kMaxDims] = {0, 0, 0, 0};  // in elements
  Device device{};

  bool defined() const { return data != nullptr || ndim > 0; }
  int64_t numel() const;
  template <class T>
  T* ptr() const { return static_cast<T*>(data); }
};

// A view with row-major (contiguous) strides.
TensorView contiguous_view(void* data, DType dtype, std::initializer_list<int64_t> shape,
                           Device device = Device::cpu());
// A view with explicit strides (in elements).
TensorView strided_view(void* data, DType dtype, std::initializer_list<int64_t> shape,
                        std::initializer_list<int64_t> strides, Device device = Device::cpu());

// How the four dimensions of Q, K, V and the output are ordered.
//   HND: [batch, heads, tokens, head_dim]
//   NHD: [batch, tokens, heads, head_dim]
// Any strides work as long as head_dim is contiguous (stride 1).
enum class Layout : uint8_t { HND, NHD };
const char* layout_name(Layout l);

}  // namespace sage
