// The end of the backward: the fp32 accumulators times a factor (dQ: sm_scale, step 9; dK has
// it already, dV none) rounded once to the gradient views' 16-bit dtype (step 10).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "sm90/bwd/kernel_traits.h"

namespace sage::sm90::bwd {

struct FinalizeView {
  const float* acc;  // dense [batch, heads, n, D], or with dq_tiles dQ's tile-major order
  void* dst;         // the view, [b, h, n, D] through its strides
  int64_t sb, sh, sn;
  int heads, n;
  float factor;  // 1: no multiply
  // dQ's accumulator: [batch * heads][n_pad / kBlockQ tiles][kBlockQ * D], each tile in
  // dq_fragment_index's order (kernel_traits.h).
  bool dq_tiles;
  int n_pad;
};

// Where element (row i of head bh, channel c) lies in the accumulator.
template <int D>
__device__ __forceinline__ int64_t accumulator_index(const FinalizeView& v, int64_t bh, int i, int c) {
  if (!v.dq_tiles) return (bh * v.n + i) * D + c;
  const int64_t tile = bh * (v.n_pad / kBlockQ) + i / kBlockQ;
  return tile * (kBlockQ * D) + dq_fragment_index(i % kBlockQ, c, D);
}

template <int D, class T>
__global__ void __launch_bounds__(256) backward_finalize_kernel(const FinalizeView v, int64_t total) {
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < total;
       e += int64_t(gridDim.x) * blockDim.x) {
    const int c = int(e % D);
    const int64_t row = e / D;
    const int i = int(row % v.n);
    const int64_t bh = row / v.n;
    const int h = int(bh % v.heads);
    const int64_t b = bh / v.heads;
    float x = v.acc[accumulator_index<D>(v, bh, i, c)];
    if (v.factor != 1.f) x = __fmul_rn(x, v.factor);
    T* dst = static_cast<T*>(v.dst) + b * v.sb + h * v.sh + i * v.sn + c;
    if constexpr (std::is_same_v<T, __half>) *dst = __float2half_rn(x);
    else *dst = __float2bfloat16_rn(x);
  }
}

}  // namespace sage::sm90::bwd
