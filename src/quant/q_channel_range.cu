#include "quant/q_channel_range.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

#include "built_kernels.h"
#include "common/cuda_check.h"
#include "numerics/quant_rules.h"

namespace sage::quant {
namespace {

constexpr int kThreads = 256;
constexpr int kUnroll = 4;  // 16-byte loads in flight per thread
// CTAs per (batch, KV head) at most: enough for a few waves on 132 SMs at small head counts,
// few enough that the atomics stay negligible.
constexpr int kMaxCtasPerHead = 32;

template <class T>
using Pair = std::conditional_t<std::is_same_v<T, __half>, __half2, __nv_bfloat162>;

// max(m, |x|) per 16-bit half, NaN-propagating (a NaN range leaves the channel unbalanced:
// rules::qk_balance_scale). Exact in the input type.
template <class T>
__device__ __forceinline__ Pair<T> max_abs(Pair<T> m, uint32_t x) {
  return __hmax2_nan(m, __habs2(*reinterpret_cast<const Pair<T>*>(&x)));
}

template <int D, class T>
__global__ void __launch_bounds__(kThreads) q_channel_range_kernel(const QRangeParams p) {
  constexpr int kLanesPerRow = D / 8;  // each thread reads 8 channels of a row
  constexpr int kRowsPerIter = kThreads / kLanesPerRow;
  const int h = blockIdx.y, b = blockIdx.z;
  const int group = p.heads_q / p.heads_kv;
  // A packed batch's sequence: its first token and its samples (its length clamped to
  // [0, max_seqlen_q], as the other passes do).
  int samples = p.samples;
  int64_t first = 0;
  if (p.cu_seqlens_q != nullptr) {
    first = p.cu_seqlens_q[b];
    const int n = min(max(p.cu_seqlens_q[b + 1] - int(first), 0), p.n_q);
    samples = int(rules::k_mean_samples(n, p.stride));
  }
  const int rows = group * samples;  // the group's query heads' samples, head after head
  const int lane_c = threadIdx.x % kLanesPerRow;
  const T* base = static_cast<const T*>(p.q) + b * p.q_stride_b + first * p.q_stride_n + lane_c * 8;
  Pair<T> m[4];
  const uint32_t zero = 0u;
#pragma unroll
  for (int j = 0; j < 4; ++j) m[j] = *reinterpret_cast<const Pair<T>*>(&zero);
  const int step = kRowsPerIter * gridDim.x;
  for (int r = blockIdx.x * kRowsPerIter + threadIdx.x / kLanesPerRow; r < rows; r += kUnroll * step) {
    uint4 raw[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int row = r + u * step;
      if (row < rows && lane_c * 8 < p.head_dim) {
        const int hq = h * group + row / samples, t = (row % samples) * p.stride;
        raw[u] = *reinterpret_cast<const uint4*>(base + hq * p.q_stride_h + int64_t(t) * p.q_stride_n);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (r + u * step < rows && lane_c * 8 < p.head_dim) {
        m[0] = max_abs<T>(m[0], raw[u].x), m[1] = max_abs<T>(m[1], raw[u].y);
        m[2] = max_abs<T>(m[2], raw[u].z), m[3] = max_abs<T>(m[3], raw[u].w);
      }
  }
  // The threads of a warp that hold the same channels, then the warps through shared memory,
  // then the CTAs through an integer max on the bits: for non-negative floats (and a positive
  // NaN, whose bits exceed an infinity's) it orders as the values do, and max is exact in
  // any order, so the result does not depend on the CTAs' timing.
  float v[8];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float2 f = std::is_same_v<T, __half> ? __half22float2(*reinterpret_cast<const __half2*>(&m[j]))
                                               : __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&m[j]));
    v[2 * j] = f.x, v[2 * j + 1] = f.y;
  }
#pragma unroll
  for (int off = kLanesPerRow; off < 32; off *= 2)
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = rules::max_nan(v[i], __shfl_xor_sync(0xffffffffu, v[i], off));
  __shared__ float s_max[kThreads / 32][D];
  const int warp = threadIdx.x / 32;
  if (threadIdx.x % 32 < kLanesPerRow)
#pragma unroll
    for (int i = 0; i < 8; ++i) s_max[warp][lane_c * 8 + i] = v[i];
  __syncthreads();
  if (threadIdx.x < D) {
    float x = s_max[0][threadIdx.x];
#pragma unroll
    for (int w = 1; w < kThreads / 32; ++w) x = rules::max_nan(x, s_max[w][threadIdx.x]);
    auto* out = reinterpret_cast<unsigned int*>(p.q_amax + (int64_t(b) * p.heads_kv + h) * D);
    atomicMax(out + threadIdx.x, __float_as_uint(x));
  }
}

}  // namespace

template <int D, class T>
void launch_q_channel_range(const QRangeParams& p, cudaStream_t stream) {
  const size_t bytes = size_t(p.batch) * p.heads_kv * D * sizeof(float);
  cudaError_t err = cudaMemsetAsync(p.q_amax, 0, bytes, stream);
  if (err != cudaSuccess) throw_cuda("Q channel range: clearing the ranges", err);
  QRangeParams q = p;
  q.samples = int(rules::k_mean_samples(p.n_q, p.stride));
  const int rows = p.heads_q / p.heads_kv * q.samples;
  constexpr int kRowsPerCta = kThreads / (D / 8) * kUnroll;
  int ctas = (rows + kRowsPerCta - 1) / kRowsPerCta;
  ctas = ctas < 1 ? 1 : ctas > kMaxCtasPerHead ? kMaxCtasPerHead : ctas;
  q_channel_range_kernel<D, T><<<dim3(ctas, p.heads_kv, p.batch), kThreads, 0, stream>>>(q);
  err = cudaGetLastError();
  if (err != cudaSuccess) throw_cuda("Q channel range launch", err);
}

#define SAGE_INSTANTIATE_Q_RANGE(D)                                                     \
  template void launch_q_channel_range<D, __half>(const QRangeParams&, cudaStream_t); \
  template void launch_q_channel_range<D, __nv_bfloat16>(const QRangeParams&, cudaStream_t);
SAGE_FOR_EACH_KV_LAYOUT_DIM(SAGE_INSTANTIATE_Q_RANGE)

}  // namespace sage::quant
