#include "quant/kv_prepass.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cfloat>

#include "common/vec_io.cuh"
#include "sage/error.h"
#include "sage/quant_rules.h"
#include "sage/tile.h"
#include "sm90/head_dims.h"
#include "sm90/ptx.cuh"

namespace sage::quant {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ int64_t partial_index(const sm90::KVQuantParams& p, int stat, int b,
                                                 int h, int chunk, int c, int D) {
  return ((((int64_t)stat * p.batch + b) * p.heads_kv + h) * p.chunks + chunk) * D + c;
}

// Pass 1: per-chunk channel statistics of K and V.
template <int D, class T>
__global__ void __launch_bounds__(kThreads) kv_stats_kernel(const sm90::KVQuantParams p) {
  constexpr int kLanesPerRow = D / 8;
  constexpr int kRowsPerIter = kThreads / kLanesPerRow;
  const int chunk = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int lane_c = threadIdx.x % kLanesPerRow, r0 = threadIdx.x / kLanesPerRow;

  float st[sm90::kNumStats][8];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    st[sm90::kSumK][i] = st[sm90::kSumV][i] = 0.f;
    st[sm90::kMaxK][i] = st[sm90::kMaxV][i] = -FLT_MAX;
    st[sm90::kMinK][i] = st[sm90::kMinV][i] = FLT_MAX;
  }
  const T* kb = static_cast<const T*>(p.k) + b * p.k_stride_b + h * p.k_stride_h + lane_c * 8;
  const T* vb = static_cast<const T*>(p.v) + b * p.v_stride_b + h * p.v_stride_h + lane_c * 8;
  const int end = min(p.n_kv, (chunk + 1) * sm90::kStatsChunk);
  for (int t = chunk * sm90::kStatsChunk + r0; t < end; t += kRowsPerIter) {
    float x[8], y[8];
    gpu::load8(kb + t * p.k_stride_n, x);
    gpu::load8(vb + t * p.v_stride_n, y);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      st[sm90::kSumK][i] += x[i];
      st[sm90::kMaxK][i] = fmaxf(st[sm90::kMaxK][i], x[i]);
      st[sm90::kMinK][i] = fminf(st[sm90::kMinK][i], x[i]);
      st[sm90::kSumV][i] += y[i];
      st[sm90::kMaxV][i] = fmaxf(st[sm90::kMaxV][i], y[i]);
      st[sm90::kMinV][i] = fminf(st[sm90::kMinV][i], y[i]);
    }
  }
  // Combine the row groups in a fixed order (deterministic).
  __shared__ float red[kRowsPerIter * D];
#pragma unroll
  for (int s = 0; s < sm90::kNumStats; ++s) {
#pragma unroll
    for (int i = 0; i < 8; ++i) red[r0 * D + lane_c * 8 + i] = st[s][i];
    __syncthreads();
    if (threadIdx.x < D) {
      float acc = red[threadIdx.x];
      for (int r = 1; r < kRowsPerIter; ++r) {
        const float v = red[r * D + threadIdx.x];
        acc = (s == sm90::kSumK || s == sm90::kSumV) ? acc + v
              : (s == sm90::kMaxK || s == sm90::kMaxV) ? fmaxf(acc, v)
                                                       : fminf(acc, v);
      }
      p.out.partials[partial_index(p, s, b, h, chunk, threadIdx.x, D)] = acc;
    }
    __syncthreads();
  }
}

// Pass 2: quantize one 128-token tile of K and of V.
template <int D, class T>
__global__ void __launch_bounds__(kThreads) kv_quantize_kernel(const sm90::KVQuantParams p) {
  constexpr int kLanesPerRow = D / 8;
  constexpr int kRowsPerIter = kThreads / kLanesPerRow;
  constexpr int kRows = sm90::kBlockKV / kRowsPerIter;  // rows per thread
  constexpr int kVtPitch = sm90::kBlockKV + 4;           // bytes; breaks the transpose's bank conflicts
  const int tile = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int lane_c = threadIdx.x % kLanesPerRow, r0 = threadIdx.x / kLanesPerRow;

  __shared__ float s_kmean[D], s_kamax[D], s_vmean[D], s_vinv[D];
  __shared__ float s_row_amax[sm90::kBlockKV];
  __shared__ float s_kinv[sm90::kKScalesPerTile];
  __shared__ __align__(16) uint8_t s_vt[D * kVtPitch];

  // Channel statistics over all tokens, reduced from the partials in chunk order.
  if (threadIdx.x < D) {
    const int c = threadIdx.x;
    float ksum = 0.f, vsum = 0.f, kmax = -FLT_MAX, kmin = FLT_MAX, vmax = -FLT_MAX, vmin = FLT_MAX;
    for (int ch = 0; ch < p.chunks; ++ch) {
      ksum += p.out.partials[partial_index(p, sm90::kSumK, b, h, ch, c, D)];
      vsum += p.out.partials[partial_index(p, sm90::kSumV, b, h, ch, c, D)];
      kmax = fmaxf(kmax, p.out.partials[partial_index(p, sm90::kMaxK, b, h, ch, c, D)]);
      kmin = fminf(kmin, p.out.partials[partial_index(p, sm90::kMinK, b, h, ch, c, D)]);
      vmax = fmaxf(vmax, p.out.partials[partial_index(p, sm90::kMaxV, b, h, ch, c, D)]);
      vmin = fminf(vmin, p.out.partials[partial_index(p, sm90::kMinV, b, h, ch, c, D)]);
    }
    const float km = p.smooth_k ? ksum / p.n_kv : 0.f;
    const float vm = p.smooth_v ? vsum / p.n_kv : 0.f;
    // Rounding is monotonic, so the extreme of |x - mean| is reached at the channel's max or
    // min: the same value a pass over every token would find.
    const float kamax = fmaxf(kmax - km, km - kmin);
    const float vamax = fmaxf(vmax - vm, vm - vmin);
    s_kmean[c] = km;
    s_kamax[c] = kamax;
    s_vmean[c] = vm;
    s_vinv[c] = rules::symmetric_inverse(vamax, p.v_max);
    if (tile == 0) {
      const int64_t o = ((int64_t)b * p.heads_kv + h) * D + c;
      p.out.k_mean[o] = km;
      p.out.v_mean[o] = vm;
      p.out.v_scale[o] = rules::symmetric_scale(vamax, p.v_max);
    }
  }
  __syncthreads();

  // ---- K: smooth, group amax, INT8 -------------------------------------------------------
  const T* kb = static_cast<const T*>(p.k) + b * p.k_stride_b + h * p.k_stride_h + lane_c * 8;
  float kx[kRows][8];
#pragma unroll
  for (int i = 0; i < kRows; ++i) {
    const int r = r0 + i * kRowsPerIter;
    const int t = tile * sm90::kBlockKV + r;
    float amax = 0.f;
    if (t < p.n_kv) {
      gpu::load8(kb + (int64_t)t * p.k_stride_n, kx[i]);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        kx[i][j] = kx[i][j] - s_kmean[lane_c * 8 + j];
        amax = fmaxf(amax, fabsf(kx[i][j]));
      }
    } else {
#pragma unroll
      for (int j = 0; j < 8; ++j) kx[i][j] = 0.f;  // padding never counts toward a scale
    }
#pragma unroll
    for (int off = 1; off < kLanesPerRow; off *= 2)
      amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
    if (lane_c == 0) s_row_amax[r] = amax;
  }
  __syncthreads();
  if (threadIdx.x < sm90::kKScalesPerTile) {
    const int g = threadIdx.x;
    float amax = 0.f;
    switch (p.k_granularity) {
      case Granularity::per_thread:
        for (int r = 0; r < sm90::kBlockKV; ++r)
          if ((r % 8) / 2 == g) amax = fmaxf(amax, s_row_amax[r]);
        break;
      case Granularity::per_tensor:
        for (int c = 0; c < D; ++c) amax = fmaxf(amax, s_kamax[c]);
        break;
      default:  // per_block and per_warp: every warp reads the whole K tile
        for (int r = 0; r < sm90::kBlockKV; ++r) amax = fmaxf(amax, s_row_amax[r]);
        break;
    }
    s_kinv[g] = rules::symmetric_inverse(amax, rules::kInt8Max);
    p.out.k_scale[(((int64_t)b * p.heads_kv + h) * (p.n_pad / sm90::kBlockKV) + tile) *
                      sm90::kKScalesPerTile + g] = rules::symmetric_scale(amax, rules::kInt8Max);
  }
  __syncthreads();
  int8_t* kq = p.out.k + (((int64_t)b * p.heads_kv + h) * p.n_pad + tile * sm90::kBlockKV) * D +
               lane_c * 8;
#pragma unroll
  for (int i = 0; i < kRows; ++i) {
    const int r = r0 + i * kRowsPerIter;
    const float inv = s_kinv[p.k_granularity == Granularity::per_thread ? (r % 8) / 2 : 0];
    uint32_t w[2] = {0, 0};
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int32_t q = rules::round_clamp(kx[i][j] * inv, rules::kInt8Max);
      w[j / 4] |= (uint32_t(q) & 0xFFu) << (8 * (j % 4));
    }
    *reinterpret_cast<uint2*>(kq + (int64_t)r * D) = make_uint2(w[0], w[1]);
  }

  // ---- V: smooth, per-channel scale, E4M3, transpose with the P-layout permutation --------
  const T* vb = static_cast<const T*>(p.v) + b * p.v_stride_b + h * p.v_stride_h + lane_c * 8;
#pragma unroll
  for (int i = 0; i < kRows; ++i) {
    const int r = r0 + i * kRowsPerIter;
    const int t = tile * sm90::kBlockKV + r;
    float y[8];
    if (t < p.n_kv) {
      gpu::load8(vb + (int64_t)t * p.v_stride_n, y);
    }
    const int pos = 32 * (r / 32) + pv_position_of_token(r % 32);
#pragma unroll
    for (int j = 0; j < 8; j += 2) {
      const int c = lane_c * 8 + j;
      float a = 0.f, bb = 0.f;
      if (t < p.n_kv) {
        a = (y[j] - s_vmean[c]) * s_vinv[c];
        bb = (y[j + 1] - s_vmean[c + 1]) * s_vinv[c + 1];
      }
      const uint16_t two = sm90::pack_e4m3x2(a, bb);
      s_vt[c * kVtPitch + pos] = uint8_t(two & 0xFF);
      s_vt[(c + 1) * kVtPitch + pos] = uint8_t(two >> 8);
    }
  }
  __syncthreads();
  uint8_t* vt = p.out.vt + ((int64_t)b * p.heads_kv + h) * D * p.n_pad + tile * sm90::kBlockKV;
  constexpr int kWordsPerRow = sm90::kBlockKV / 4;
  for (int w = threadIdx.x; w < D * kWordsPerRow; w += kThreads) {
    const int c = w / kWordsPerRow, x = w % kWordsPerRow;
    *reinterpret_cast<uint32_t*>(vt + (int64_t)c * p.n_pad + 4 * x) =
        *reinterpret_cast<const uint32_t*>(&s_vt[c * kVtPitch + 4 * x]);
  }
}

}  // namespace

template <int D, class T>
void launch_kv_prepass(const sm90::KVQuantParams& p, cudaStream_t stream) {
  const dim3 stats_grid(p.chunks, p.heads_kv, p.batch);
  kv_stats_kernel<D, T><<<stats_grid, kThreads, 0, stream>>>(p);
  const dim3 quant_grid(p.n_pad / sm90::kBlockKV, p.heads_kv, p.batch);
  kv_quantize_kernel<D, T><<<quant_grid, kThreads, 0, stream>>>(p);
}

#define SAGE_INSTANTIATE_PREPASS(D)                                                        \
  template void launch_kv_prepass<D, __half>(const sm90::KVQuantParams&, cudaStream_t);   \
  template void launch_kv_prepass<D, __nv_bfloat16>(const sm90::KVQuantParams&, cudaStream_t);
SAGE_FOR_EACH_HEAD_DIM(SAGE_INSTANTIATE_PREPASS)

}  // namespace sage::quant
