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

// Eight 16-bit values held in one 16-byte word (a raw vector load), to floats.
template <class T>
__device__ __forceinline__ void unpack8(const uint4& raw, float (&x)[8]) {
  const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = word_to_float2<T>(w[i]);
    x[2 * i] = f.x;
    x[2 * i + 1] = f.y;
  }
}

// Two floats to two fp16/bf16 values (round to nearest even), packed into one 32-bit word,
// the first in the low half.
template <class T>
__device__ __forceinline__ uint32_t pack2(float a, float b) {
  if constexpr (std::is_same_v<T, __half>) {
    const __half2 h = __floats2half2_rn(a, b);
    return *reinterpret_cast<const uint32_t*>(&h);
  } else {
    const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<const uint32_t*>(&h);
  }
}

}  // namespace sage::gpu
