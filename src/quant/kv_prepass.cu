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

// Eight 16-bit values loaded as one 16-byte word, to floats.
template <class T>
__device__ __forceinline__ void raw_to_float(const uint4& raw, float (&x)[8]) {
  const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = gpu::word_to_float2<T>(w[i]);
    x[2 * i] = f.x;
    x[2 * i + 1] = f.y;
  }
}

// Bytes per transposed V row in shared memory: a tile's tokens plus 4 bytes of padding per
// byte of element, which breaks the transpose's bank conflicts.
constexpr int kVtPitch8 = sm90::kBlockKV + 4;

// Two V values (already smoothed and scaled) in the path's format, `lo` in the low bits:
// E4M3 or INT8 bytes, or fp16 halves saturated to the finite range as the simulator's
// round_fp16_satfinite.
__device__ __forceinline__ uint32_t encode_v_pair(sm90::PVPath path, float lo, float hi) {
  switch (path) {
    case sm90::PVPath::int8:
      return (uint32_t(rules::round_clamp(lo, rules::kInt8Max)) & 0xFFu) |
             ((uint32_t(rules::round_clamp(hi, rules::kInt8Max)) & 0xFFu) << 8);
    case sm90::PVPath::fp16: {
      const __half2 h = __floats2half2_rn(fminf(fmaxf(lo, -65504.f), 65504.f),
                                          fminf(fmaxf(hi, -65504.f), 65504.f));
      return *reinterpret_cast<const uint32_t*>(&h);
    }
    default:
      return sm90::pack_e4m3x2(lo, hi);
  }
}

// Writes the transposed tile (D rows of kBlockKV * v_bytes bytes, `pitch` apart in shared
// memory) to its place in the workspace's [B, Hkv, D, n_pad] V.
template <int D>
__device__ __forceinline__ void store_vt_tile(const sm90::KVQuantParams& p, int b, int h, int tile,
                                              const uint8_t* s_vt, int pitch, int v_bytes) {
  const int64_t row_bytes = int64_t(p.n_pad) * v_bytes;
  uint8_t* vt = p.out.vt + ((int64_t)b * p.heads_kv + h) * D * row_bytes +
                int64_t(tile) * sm90::kBlockKV * v_bytes;
  const int words_per_row = sm90::kBlockKV * v_bytes / 4;
  for (int w = threadIdx.x; w < D * words_per_row; w += kThreads) {
    const int c = w / words_per_row, x = w % words_per_row;
    *reinterpret_cast<uint32_t*>(vt + c * row_bytes + 4 * x) =
        *reinterpret_cast<const uint32_t*>(&s_vt[c * pitch + 4 * x]);
  }
}

// Pass 2: quantize one 128-token tile of K and of V.
template <int D, class T>
__global__ void __launch_bounds__(kThreads) kv_quantize_kernel(const sm90::KVQuantParams p) {
  constexpr int kLanesPerRow = D / 8;
  constexpr int kRowsPerIter = kThreads / kLanesPerRow;
  constexpr int kRows = sm90::kBlockKV / kRowsPerIter;  // rows per thread
  const int tile = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int lane_c = threadIdx.x % kLanesPerRow, r0 = threadIdx.x / kLanesPerRow;
  const bool v_fp16 = p.pv_path == sm90::PVPath::fp16;

  __shared__ float s_kmean[D], s_kamax[D], s_vmean[D], s_vamax[D], s_vinv[D];
  __shared__ float s_row_amax[sm90::kBlockKV];
  __shared__ float s_kinv[sm90::kBlockKV];  // per token, or the tile's per-thread groups
  __shared__ float s_group_stats[kThreads / D][sm90::kNumStats][D];
  // The transposed V tile, D rows of `pitch` bytes: dynamic, sized by the launch for the
  // path's element size, so that 8-bit V does not pay fp16's shared memory in occupancy.
  extern __shared__ __align__(16) uint8_t s_vt[];

  // The tile's K and V rows, loaded raw before anything else: these loads are the kernel's
  // DRAM traffic, and issued together up front they are in flight while the statistics are
  // reduced (issued after it, K then V, each round waited for its own latency; ncu showed the
  // kernel at 41% of DRAM bandwidth, H100, d = 128, N = 1K).
  const T* kb = static_cast<const T*>(p.k) + b * p.k_stride_b + h * p.k_stride_h + lane_c * 8;
  const T* vb = static_cast<const T*>(p.v) + b * p.v_stride_b + h * p.v_stride_h + lane_c * 8;
  uint4 k_raw[kRows], v_raw[kRows];
#pragma unroll
  for (int i = 0; i < kRows; ++i) {
    const int t = tile * sm90::kBlockKV + r0 + i * kRowsPerIter;
    k_raw[i] = v_raw[i] = make_uint4(0, 0, 0, 0);  // zeros: padding never counts toward a scale
    if (t < p.n_kv) {
      k_raw[i] = *reinterpret_cast<const uint4*>(kb + (int64_t)t * p.k_stride_n);
      v_raw[i] = *reinterpret_cast<const uint4*>(vb + (int64_t)t * p.v_stride_n);
    }
  }

  // Channel statistics over all tokens, reduced from the partials: kGroups thread groups
  // each take a contiguous run of chunks in order, then the runs combine in group order
  // (deterministic). Every CTA of a head repeats this (docs/performance.md, next steps).
  constexpr int kGroups = kThreads / D;
  {
    const int c = threadIdx.x % D, group = threadIdx.x / D;
    const int per_group = (p.chunks + kGroups - 1) / kGroups;
    const int ch0 = group * per_group, ch1 = min(p.chunks, ch0 + per_group);
    float st[sm90::kNumStats] = {0.f, -FLT_MAX, FLT_MAX, 0.f, -FLT_MAX, FLT_MAX};
#pragma unroll 4
    for (int ch = ch0; ch < ch1; ++ch) {
      st[sm90::kSumK] += p.out.partials[partial_index(p, sm90::kSumK, b, h, ch, c, D)];
      st[sm90::kMaxK] = fmaxf(st[sm90::kMaxK], p.out.partials[partial_index(p, sm90::kMaxK, b, h, ch, c, D)]);
      st[sm90::kMinK] = fminf(st[sm90::kMinK], p.out.partials[partial_index(p, sm90::kMinK, b, h, ch, c, D)]);
      st[sm90::kSumV] += p.out.partials[partial_index(p, sm90::kSumV, b, h, ch, c, D)];
      st[sm90::kMaxV] = fmaxf(st[sm90::kMaxV], p.out.partials[partial_index(p, sm90::kMaxV, b, h, ch, c, D)]);
      st[sm90::kMinV] = fminf(st[sm90::kMinV], p.out.partials[partial_index(p, sm90::kMinV, b, h, ch, c, D)]);
    }
#pragma unroll
    for (int k = 0; k < sm90::kNumStats; ++k) s_group_stats[group][k][c] = st[k];
  }
  __syncthreads();
  if (threadIdx.x < D) {
    const int c = threadIdx.x;
    float ksum = s_group_stats[0][sm90::kSumK][c], vsum = s_group_stats[0][sm90::kSumV][c];
    float kmax = s_group_stats[0][sm90::kMaxK][c], kmin = s_group_stats[0][sm90::kMinK][c];
    float vmax = s_group_stats[0][sm90::kMaxV][c], vmin = s_group_stats[0][sm90::kMinV][c];
#pragma unroll
    for (int g = 1; g < kGroups; ++g) {
      ksum += s_group_stats[g][sm90::kSumK][c];
      vsum += s_group_stats[g][sm90::kSumV][c];
      kmax = fmaxf(kmax, s_group_stats[g][sm90::kMaxK][c]);
      kmin = fminf(kmin, s_group_stats[g][sm90::kMinK][c]);
      vmax = fmaxf(vmax, s_group_stats[g][sm90::kMaxV][c]);
      vmin = fminf(vmin, s_group_stats[g][sm90::kMinV][c]);
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
    s_vamax[c] = vamax;
  }
  __syncthreads();
  if (threadIdx.x < D) {
    const int c = threadIdx.x;
    float vamax = s_vamax[c];
    if (p.v_per_tensor)  // INT-FlashAttention: one scale over all channels
      for (int i = 0; i < D; ++i) vamax = fmaxf(vamax, s_vamax[i]);
    // fp16 V is not scaled: the kernel's epilogue multiplies by 1.
    s_vinv[c] = v_fp16 ? 1.f : rules::symmetric_inverse(vamax, p.v_max);
    if (tile == 0) {
      const int64_t o = ((int64_t)b * p.heads_kv + h) * D + c;
      p.out.k_mean[o] = s_kmean[c];
      p.out.v_mean[o] = s_vmean[c];
      p.out.v_scale[o] = v_fp16 ? 1.f : rules::symmetric_scale(vamax, p.v_max);
    }
  }
  __syncthreads();

  // ---- K: smooth, group amax, INT8 -------------------------------------------------------
  // Each 16-bit value is converted twice (here for the amax, below for the codes) rather than
  // kept as floats: 64 fewer live registers per thread, two CTAs per SM.
#pragma unroll
  for (int i = 0; i < kRows; ++i) {
    const int r = r0 + i * kRowsPerIter;
    float x[8];
    raw_to_float<T>(k_raw[i], x);
    float amax = 0.f;
    if (tile * sm90::kBlockKV + r < p.n_kv)
#pragma unroll
      for (int j = 0; j < 8; ++j) amax = fmaxf(amax, fabsf(x[j] - s_kmean[lane_c * 8 + j]));
#pragma unroll
    for (int off = 1; off < kLanesPerRow; off *= 2)
      amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
    if (lane_c == 0) s_row_amax[r] = amax;
  }
  __syncthreads();
  const float k_max = float(p.k_max);
  if (p.k_granularity == Granularity::per_token) {
    if (threadIdx.x < sm90::kBlockKV) {
      const int r = threadIdx.x;
      s_kinv[r] = rules::symmetric_inverse(s_row_amax[r], k_max);
      p.out.k_scale[((int64_t)b * p.heads_kv + h) * p.n_pad + tile * sm90::kBlockKV + r] =
          rules::symmetric_scale(s_row_amax[r], k_max);
    }
  } else if (threadIdx.x < sm90::kKScalesPerTile) {
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
    s_kinv[g] = rules::symmetric_inverse(amax, k_max);
    p.out.k_scale[(((int64_t)b * p.heads_kv + h) * (p.n_pad / sm90::kBlockKV) + tile) *
                      sm90::kKScalesPerTile + g] = rules::symmetric_scale(amax, k_max);
  }
  __syncthreads();
  int8_t* kq = p.out.k + (((int64_t)b * p.heads_kv + h) * p.n_pad + tile * sm90::kBlockKV) * D +
               lane_c * 8;
#pragma unroll
  for (int i = 0; i < kRows; ++i) {
    const int r = r0 + i * kRowsPerIter;
    const float inv = s_kinv[p.k_granularity == Granularity::per_token    ? r
                             : p.k_granularity == Granularity::per_thread ? (r % 8) / 2
                                                                          : 0];
    const bool valid = tile * sm90::kBlockKV + r < p.n_kv;
    float x[8];
    raw_to_float<T>(k_raw[i], x);
    uint32_t w[2] = {0, 0};
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float smoothed = valid ? x[j] - s_kmean[lane_c * 8 + j] : 0.f;
      const int32_t q = rules::round_clamp(smoothed * inv, p.k_max);
      w[j / 4] |= (uint32_t(q) & 0xFFu) << (8 * (j % 4));
    }
    *reinterpret_cast<uint2*>(kq + (int64_t)r * D) = make_uint2(w[0], w[1]);
  }

  // ---- V: smooth, scale, encode (E4M3, INT8 or fp16), transpose --------------------------
  // 8-bit V takes the P-layout token permutation; fp16 V stays in token order (pv_operand.cuh).
  const int v_bytes = v_fp16 ? 2 : 1;
  const int pitch = v_bytes * kVtPitch8;
#pragma unroll
  for (int i = 0; i < kRows; ++i) {
    const int r = r0 + i * kRowsPerIter;
    const int t = tile * sm90::kBlockKV + r;
    float y[8];
    raw_to_float<T>(v_raw[i], y);
    const int pos = v_fp16 ? r : 32 * (r / 32) + pv_position_of_token(r % 32);
#pragma unroll
    for (int j = 0; j < 8; j += 2) {
      const int c = lane_c * 8 + j;
      float a = 0.f, bb = 0.f;
      if (t < p.n_kv) {
        a = (y[j] - s_vmean[c]) * s_vinv[c];
        bb = (y[j + 1] - s_vmean[c + 1]) * s_vinv[c + 1];
      }
      const uint32_t two = encode_v_pair(p.pv_path, a, bb);
      if (v_fp16) {
        *reinterpret_cast<uint16_t*>(&s_vt[c * pitch + 2 * pos]) = uint16_t(two & 0xFFFF);
        *reinterpret_cast<uint16_t*>(&s_vt[(c + 1) * pitch + 2 * pos]) = uint16_t(two >> 16);
      } else {
        s_vt[c * pitch + pos] = uint8_t(two & 0xFF);
        s_vt[(c + 1) * pitch + pos] = uint8_t(two >> 8);
      }
    }
  }
  __syncthreads();
  store_vt_tile<D>(p, b, h, tile, s_vt, pitch, v_bytes);
}

// Pass for prequantized INT8 inputs (INT-FlashAttention): nothing to measure or quantize, so
// one launch copies K with its per-token scales into the workspace layout, transposes V with
// the P-layout permutation, and broadcasts V's scales to one per channel.
template <int D>
__global__ void __launch_bounds__(kThreads) kv_copy_prequantized_kernel(const sm90::KVQuantParams p) {
  constexpr int kLanesPerRow = D / 8;
  constexpr int kRowsPerIter = kThreads / kLanesPerRow;
  constexpr int kRows = sm90::kBlockKV / kRowsPerIter;
  const int tile = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int lane_c = threadIdx.x % kLanesPerRow, r0 = threadIdx.x / kLanesPerRow;
  __shared__ __align__(16) uint8_t s_vt[D * kVtPitch8];

  const int64_t head = (int64_t)b * p.heads_kv + h;
  if (tile == 0 && threadIdx.x < D) {
    const int c = threadIdx.x;
    const float* vs = p.v_scale_in + b * p.vs_stride_b + h * p.vs_stride_h;
    p.out.v_scale[head * D + c] = p.v_per_tensor ? vs[0] : vs[c * p.vs_stride_c];
    p.out.k_mean[head * D + c] = 0.f;
    p.out.v_mean[head * D + c] = 0.f;
  }
  if (threadIdx.x < sm90::kBlockKV) {
    const int t = tile * sm90::kBlockKV + threadIdx.x;
    p.out.k_scale[head * p.n_pad + t] =
        t < p.n_kv ? p.k_scale_in[b * p.ks_stride_b + h * p.ks_stride_h + t * p.ks_stride_n] : 0.f;
  }
  const int8_t* kb = static_cast<const int8_t*>(p.k) + b * p.k_stride_b + h * p.k_stride_h + lane_c * 8;
  const int8_t* vb = static_cast<const int8_t*>(p.v) + b * p.v_stride_b + h * p.v_stride_h + lane_c * 8;
  int8_t* kq = p.out.k + (head * p.n_pad + tile * sm90::kBlockKV) * D + lane_c * 8;
#pragma unroll
  for (int i = 0; i < kRows; ++i) {
    const int r = r0 + i * kRowsPerIter;
    const int t = tile * sm90::kBlockKV + r;
    uint2 kw = make_uint2(0, 0), vw = make_uint2(0, 0);
    if (t < p.n_kv) {
      kw = *reinterpret_cast<const uint2*>(kb + (int64_t)t * p.k_stride_n);
      vw = *reinterpret_cast<const uint2*>(vb + (int64_t)t * p.v_stride_n);
    }
    *reinterpret_cast<uint2*>(kq + (int64_t)r * D) = kw;
    const int pos = 32 * (r / 32) + pv_position_of_token(r % 32);
#pragma unroll
    for (int j = 0; j < 8; ++j)
      s_vt[(lane_c * 8 + j) * kVtPitch8 + pos] = uint8_t(((j < 4 ? vw.x : vw.y) >> (8 * (j % 4))) & 0xFF);
  }
  __syncthreads();
  store_vt_tile<D>(p, b, h, tile, s_vt, kVtPitch8, 1);
}

}  // namespace

template <int D, class T>
void launch_kv_prepass(const sm90::KVQuantParams& p, cudaStream_t stream) {
  if (p.k_scale_in != nullptr) {
    const dim3 grid(p.n_pad / sm90::kBlockKV, p.heads_kv, p.batch);
    kv_copy_prequantized_kernel<D><<<grid, kThreads, 0, stream>>>(p);
    return;
  }
  const dim3 stats_grid(p.chunks, p.heads_kv, p.batch);
  kv_stats_kernel<D, T><<<stats_grid, kThreads, 0, stream>>>(p);
  const dim3 quant_grid(p.n_pad / sm90::kBlockKV, p.heads_kv, p.batch);
  const size_t vt_bytes = size_t(D) * sm90::v_bytes(p.pv_path) * kVtPitch8;  // < 48 KiB
  kv_quantize_kernel<D, T><<<quant_grid, kThreads, vt_bytes, stream>>>(p);
}

#define SAGE_INSTANTIATE_PREPASS(D)                                                        \
  template void launch_kv_prepass<D, __half>(const sm90::KVQuantParams&, cudaStream_t);   \
  template void launch_kv_prepass<D, __nv_bfloat16>(const sm90::KVQuantParams&, cudaStream_t);
SAGE_FOR_EACH_HEAD_DIM(SAGE_INSTANTIATE_PREPASS)

}  // namespace sage::quant
