// 16-byte vector loads/stores of 16-bit inputs, converted to and from float.
// The GPU entry points check that rows are 16-byte aligned (api/gpu_checks.cpp), which is
// what makes one 16-byte access per 8 channels legal for any strided view.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>
#include <type_traits>

namespace sage::gpu {

// Two 16-bit values packed in a word, to floats.
template <class T>
__device__ __forceinline__ float2 word_to_float2(uint32_t w) {
  if constexpr (std::is_same_v<T, __half>) {
    return __half22float2(*reinterpret_cast<const __half2*>(&w));
  } else {
    return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w));
  }
}

// N consecutive elements (N = 4: 8 bytes, N = 8: 16 bytes) in one vector load.
template <int N, class T>
__device__ __forceinline__ void load_vec(const T* p, float (&x)[N]) {
  static_assert(N == 4 || N == 8, "8- or 16-byte loads");
  uint32_t w[N / 2];
  if constexpr (N == 8) {
    const uint4 raw = *reinterpret_cast<const uint4*>(p);
    w[0] = raw.x, w[1] = raw.y, w[2] = raw.z, w[3] = raw.w;
  } else {
    const uint2 raw = *reinterpret_cast<const uint2*>(p);
    w[0] = raw.x, w[1] = raw.y;
  }
#pragma unroll
  for (int i = 0; i < N / 2; ++i) {
    const float2 f = word_to_float2<T>(w[i]);
    x[2 * i] = f.x;
    x[2 * i + 1] = f.y;
  }
}
template <class T>
__device__ __forceinline__ void load8(const T* p, float (&x)[8]) { load_vec<8>(p, x); }
template <class T>
__device__ __forceinline__ void load4(const T* p, float (&x)[4]) { load_vec<4>(p, x); }

template <class T>
__device__ __forceinline__ void store2(T* p, float a, float b) {
  if constexpr (std::is_same_v<T, __half>) {
    *reinterpret_cast<__half2*>(p) = __floats2half2_rn(a, b);
  } else {
    *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(a, b);
  }
}

}  // namespace sage::gpu
