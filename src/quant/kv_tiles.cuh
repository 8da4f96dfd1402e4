// The K/V pre-pass's per-CTA building blocks (kv_prepass.cu's two kernels, and the pre-pass
// CTAs of the attention kernel's one-launch form, sm90/fused_prepass.cuh): channel statistics
// and their combination, a head's finals, and the quantization of one 128-token K or V tile.
// All of them are written for kTileThreads threads (threadIdx.x below it); Sync is the barrier
// those threads meet at (the CTA's, or a named barrier of a CTA with more threads), and the
// shared scratch is the caller's, so that a kernel that holds other shared memory can place it.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cfloat>
#include <cstdint>
#include <type_traits>

#include "common/vec_io.cuh"
#include "quant/kv_prepass.cuh"
#include "sage/quant_rules.h"
#include "sage/tile.h"
#include "sm90/kernel_params.h"
#include "sm90/ptx.cuh"

namespace sage::quant {

constexpr int kTileThreads = 256;

struct CtaBarrier {
  __device__ __forceinline__ static void sync() { __syncthreads(); }
};

// The quantize functions' shared scratch.
template <int D>
struct KTileShared {
  alignas(16) float kmean[D];
  float row_amax[sm90::kBlockKV];
  float kinv[sm90::kBlockKV];  // per token, or the tile's per-thread groups
};
template <int D>
struct VTileShared {
  float vmean[D], vinv[D];
};

enum StatsRow : int { kSum = 0, kMax, kMin, kStatsRows };

template <class T>
struct ChannelStats {
  // The extremes stay packed in the input type (exact, and one max or min per two values);
  // the sums are fp32.
  using Pair = std::conditional_t<std::is_same_v<T, __half>, __half2, __nv_bfloat162>;
  static constexpr uint32_t kMinusInf = std::is_same_v<T, __half> ? 0xFC00FC00u : 0xFF80FF80u;
  static constexpr uint32_t kPlusInf = kMinusInf & 0x7FFF7FFFu;
  float sum[8];
  Pair max2[4], min2[4];
  __device__ __forceinline__ static Pair as_pair(uint32_t w) {
    return *reinterpret_cast<const Pair*>(&w);
  }
  __device__ __forceinline__ void init() {
#pragma unroll
    for (int i = 0; i < 8; ++i) sum[i] = 0.f;
#pragma unroll
    for (int j = 0; j < 4; ++j) max2[j] = as_pair(kMinusInf), min2[j] = as_pair(kPlusInf);
  }
  __device__ __forceinline__ void add(const uint4& raw) {
    const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 f = gpu::word_to_float2<T>(w[j]);
      sum[2 * j] += f.x;
      sum[2 * j + 1] += f.y;
    }
    add_extremes(raw);
  }
  __device__ __forceinline__ void add_extremes(const uint4& raw) {
    const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      max2[j] = __hmax2(max2[j], as_pair(w[j]));
      min2[j] = __hmin2(min2[j], as_pair(w[j]));
    }
  }
  // Value i of the max (or min) as a float.
  __device__ __forceinline__ float max(int i) const { return half_of(max2[i / 2], i % 2); }
  __device__ __forceinline__ float min(int i) const { return half_of(min2[i / 2], i % 2); }

 private:
  __device__ __forceinline__ static float half_of(Pair p, int hi) {
    const uint32_t w = *reinterpret_cast<const uint32_t*>(&p);
    const float2 f = gpu::word_to_float2<T>(w);
    return hi ? f.y : f.x;
  }
};

// The CTA's per-thread statistics combined in a fixed order, so that repeated calls are
// bit-identical: cta_stats[s][c] for s in StatsRow. The lanes of a warp that hold the same
// channels combine by shuffles first, then thread c < D takes the warps' rows from `red`: one
// round of shared memory for the three statistics, where until v20 a round per statistic over
// every thread row put ~50 dependent shared loads on each CTA's path. Every thread calls it.
constexpr int kWarps = kTileThreads / 32;
template <int D, class T, class Sync = CtaBarrier>
__device__ __forceinline__ void combine_cta_stats(const ChannelStats<T>& st, int lane_c,
                                                  float (*red)[kWarps][D], float (*cta_stats)[D]) {
  constexpr int kLanesPerRow = D / 8;
  float v[kStatsRows][8];
#pragma unroll
  for (int i = 0; i < 8; ++i) v[kSum][i] = st.sum[i], v[kMax][i] = st.max(i), v[kMin][i] = st.min(i);
#pragma unroll
  for (int off = kLanesPerRow; off < 32; off *= 2)
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      v[kSum][i] += __shfl_xor_sync(0xffffffffu, v[kSum][i], off);
      v[kMax][i] = fmaxf(v[kMax][i], __shfl_xor_sync(0xffffffffu, v[kMax][i], off));
      v[kMin][i] = fminf(v[kMin][i], __shfl_xor_sync(0xffffffffu, v[kMin][i], off));
    }
  const int warp = threadIdx.x / 32;
  if (threadIdx.x % 32 < kLanesPerRow)
#pragma unroll
    for (int s = 0; s < kStatsRows; ++s)
#pragma unroll
      for (int i = 0; i < 8; ++i) red[s][warp][lane_c * 8 + i] = v[s][i];
  Sync::sync();
  if (threadIdx.x < D) {
    const int c = threadIdx.x;
    float sum = red[kSum][0][c], mx = red[kMax][0][c], mn = red[kMin][0][c];
#pragma unroll
    for (int w = 1; w < kWarps; ++w) {
      sum += red[kSum][w][c];
      mx = fmaxf(mx, red[kMax][w][c]);
      mn = fminf(mn, red[kMin][w][c]);
    }
    cta_stats[kSum][c] = sum, cta_stats[kMax][c] = mx, cta_stats[kMin][c] = mn;
  }
  Sync::sync();
}

// The head's finals from its combined statistics (sum, mx, mn: [0] K's, [1] V's, per channel
// c = threadIdx.x < D): the means, V's scales and inverses, K's largest |K - mean|. Every
// thread calls it (one barrier inside).
template <int D, class Sync = CtaBarrier>
__device__ __forceinline__ void write_head_finals(const sm90::KVQuantParams& p, int64_t head,
                                                  const float (&sum)[2], const float (&mx)[2],
                                                  const float (&mn)[2],
                                                  float (&s_warp_amax)[2][D / 32]) {
  const int c = threadIdx.x;
  float kamax = 0.f, vamax = 0.f;
  if (c < D) {
    const float km = p.smooth_k ? sum[0] / p.k_mean_samples : 0.f;
    const float vm = p.smooth_v ? sum[1] / p.n_kv : 0.f;
    // Rounding is monotonic, so the extreme of |x - mean| is reached at the channel's max
    // or min: the same value a pass over every token would find. (K's over its sampled keys
    // only: kamax serves per_tensor K scales alone, which have no sm_90 kernel.)
    kamax = fmaxf(mx[0] - km, km - mn[0]);
    vamax = fmaxf(mx[1] - vm, vm - mn[1]);
    p.out.k_mean[head * D + c] = km;
    p.out.v_mean[head * D + c] = vm;
    // The largest over the channels (per-tensor scales) by a shuffle tree: max is exact in
    // any order, and one thread looping over D shared values (until v20) kept the cluster
    // waiting ~D dependent loads.
    float mk = kamax, mv = vamax;
#pragma unroll
    for (int off = 16; off > 0; off /= 2) {
      mk = fmaxf(mk, __shfl_xor_sync(0xffffffffu, mk, off));
      mv = fmaxf(mv, __shfl_xor_sync(0xffffffffu, mv, off));
    }
    if (c % 32 == 0) s_warp_amax[0][c / 32] = mk, s_warp_amax[1][c / 32] = mv;
  }
  Sync::sync();
  if (c < D) {
    float all_k = s_warp_amax[0][0], all_v = s_warp_amax[1][0];
#pragma unroll
    for (int w = 1; w < D / 32; ++w)
      all_k = fmaxf(all_k, s_warp_amax[0][w]), all_v = fmaxf(all_v, s_warp_amax[1][w]);
    if (p.v_per_tensor) vamax = all_v;  // INT-FlashAttention: one scale over all channels
    // fp16 V is not scaled: the kernel's epilogue multiplies by 1.
    const bool v_fp16 = p.pv_path == sm90::PVPath::fp16;
    p.out.v_scale[head * D + c] = v_fp16 ? 1.f : rules::symmetric_scale(vamax, p.v_max);
    p.out.v_inv[head * D + c] = v_fp16 ? 1.f : rules::symmetric_inverse(vamax, p.v_max);
    if (c == 0) p.out.k_amax[head] = all_k;
  }
}

// Bytes per transposed V row in shared memory: a tile's tokens plus 4 bytes of padding per
// byte of element, which breaks the transpose's bank conflicts.
constexpr int kVtPitch8 = sm90::kBlockKV + 4;

// V's format in the workspace: E4M3 (both E4M3 PV paths), INT8 or fp16.
enum class VFormat { e4m3, int8, fp16 };

// Two V values (already smoothed and scaled) in the format, `lo` in the low bits: E4M3 or
// INT8 bytes, or fp16 halves saturated to the finite range as the simulator's
// round_fp16_satfinite. A template parameter: as a run-time switch it cost a compare and two
// branches per pair inside the tile loop (SASS).
template <VFormat F>
__device__ __forceinline__ uint32_t encode_v_pair(float lo, float hi) {
  if constexpr (F == VFormat::int8) {
    return (uint32_t(rules::round_clamp(lo, rules::kInt8Max)) & 0xFFu) |
           ((uint32_t(rules::round_clamp(hi, rules::kInt8Max)) & 0xFFu) << 8);
  } else if constexpr (F == VFormat::fp16) {
    const __half2 h = __floats2half2_rn(fminf(fmaxf(lo, -65504.f), 65504.f),
                                        fminf(fmaxf(hi, -65504.f), 65504.f));
    return *reinterpret_cast<const uint32_t*>(&h);
  } else {
    return sm90::pack_e4m3x2(lo, hi);
  }
}

// Writes the transposed tile (D rows of kBlockKV * VBytes bytes, VBytes * kVtPitch8 apart in
// shared memory) to its place in the workspace's [B, Hkv, D, n_pad] V. The element size is a
// template parameter: as a run-time value, each 32-bit word's row and column took an integer
// division and a remainder, ~8% of the quantize kernel's instructions (ncu, H200, v21b).
template <int D, int VBytes>
__device__ __forceinline__ void store_vt_tile(const sm90::KVQuantParams& p, int b, int h, int tile,
                                              const uint8_t* s_vt) {
  constexpr int kWordsPerRow = sm90::kBlockKV * VBytes / 4, kPitch = VBytes * kVtPitch8;
  static_assert(D * kWordsPerRow % kTileThreads == 0, "whole rounds of words");
  const int64_t row_bytes = int64_t(p.n_pad) * VBytes;
  uint8_t* vt = p.out.vt + ((int64_t)b * p.heads_kv + h) * D * row_bytes +
                int64_t(tile) * sm90::kBlockKV * VBytes + 4 * (threadIdx.x % kWordsPerRow);
  const uint8_t* src = s_vt + 4 * (threadIdx.x % kWordsPerRow);
#pragma unroll 4
  for (int round = 0; round < D * kWordsPerRow / kTileThreads; ++round) {
    const int c = (threadIdx.x + round * kTileThreads) / kWordsPerRow;
    *reinterpret_cast<uint32_t*>(vt + c * row_bytes) =
        *reinterpret_cast<const uint32_t*>(src + c * kPitch);
  }
}

// ---- pass 2: quantize ----------------------------------------------------------------------
// Two CTAs per 128-token tile, one for K and one for V (blockIdx.x = 2 * tile + is_v). Each
// holds only its own tensor's rows in registers, all loads issued first: 64 registers per
// thread at d = 128 where one CTA for both took 126, so three CTAs per SM instead of two (that
// v8 kernel ran at 39% of DRAM bandwidth, ncu, H100, d = 128, N = 1K).
// kFull: n_kv is a multiple of kBlockKV, so no token of the tile is padding and the
// per-element padding tests go (kv_quantize_kernel).
template <int D, class T, bool kFull, class Sync = CtaBarrier>
__device__ __forceinline__ void quantize_k_tile(const sm90::KVQuantParams& p, int tile, int h,
                                                int b, KTileShared<D>& sh) {
  constexpr int kLanesPerRow = D / 8;
  constexpr int kRowsPerIter = kTileThreads / kLanesPerRow;
  constexpr int kRows = sm90::kBlockKV / kRowsPerIter;  // rows per thread
  const int lane_c = threadIdx.x % kLanesPerRow, r0 = threadIdx.x / kLanesPerRow;
  const int64_t head = (int64_t)b * p.heads_kv + h;

  const T* kb = static_cast<const T*>(p.k) + b * p.k_stride_b + h * p.k_stride_h + lane_c * 8;
  uint4 raw[kRows];
#pragma unroll
  for (int i = 0; i < kRows; ++i) {
    const int t = tile * sm90::kBlockKV + r0 + i * kRowsPerIter;
    // Zeros past n_kv: padding never counts toward a scale.
    raw[i] = kFull || t < p.n_kv
                 ? *reinterpret_cast<const uint4*>(kb + (int64_t)t * p.k_stride_n)
                 : make_uint4(0, 0, 0, 0);
  }
  sm90::grid_dependency_wait();  // the statistics kernel's finals (launched with PDL)
  if (threadIdx.x < D) sh.kmean[threadIdx.x] = p.out.k_mean[head * D + threadIdx.x];
  Sync::sync();
  // The thread's eight channel means, as two 16-byte loads where they are used: read one float
  // at a time, they were 16 shared loads per row (four-way bank conflicts), the kernel's
  // largest share of shared-memory wavefronts (ncu, H200).
  auto kmean8 = [&](float (&km)[8]) {
    const float4 a = *reinterpret_cast<const float4*>(&sh.kmean[lane_c * 8]);
    const float4 c = *reinterpret_cast<const float4*>(&sh.kmean[lane_c * 8 + 4]);
    km[0] = a.x, km[1] = a.y, km[2] = a.z, km[3] = a.w, km[4] = c.x, km[5] = c.y, km[6] = c.z,
    km[7] = c.w;
  };

  // sh.row_amax: per token, each row's amax (a shuffle across the row's lanes for every row).
  // Otherwise only the thread groups' maxima are needed, and a thread's rows r0 + i *
  // kRowsPerIter all lie in thread group (r0 % 8) / 2: entry r0 holds the maximum over those
  // rows, one shuffle round per thread instead of one per row (v20c).
  const bool per_token = p.k_granularity == Granularity::per_token;
  if (per_token) {
    // Each 16-bit value is converted twice (here for the amax, below for the codes) rather
    // than kept as floats: 32 fewer live registers per thread.
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      const int r = r0 + i * kRowsPerIter;
      float x[8];
      gpu::unpack8<T>(raw[i], x);
      float km[8];
      kmean8(km);
      float amax = 0.f;
      if (kFull || tile * sm90::kBlockKV + r < p.n_kv)
#pragma unroll
        for (int j = 0; j < 8; ++j) amax = fmaxf(amax, fabsf(__fsub_rn(x[j], km[j])));
#pragma unroll
      for (int off = 1; off < kLanesPerRow; off *= 2)
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
      if (lane_c == 0) sh.row_amax[r] = amax;
    }
  } else {
    // The thread's largest |K - mean| from its channels' extremes over its rows, as the
    // statistics kernel finds the per-tensor one: rounding is monotonic and fl(a - b) =
    // -fl(b - a), so max_r |fl(x_r - m)| = max(fl(max_r x_r - m), fl(m - min_r x_r)), the same
    // value. The extremes are packed comparisons in the input type (exact): per thread 16 of
    // them, 16 conversions and subtractions, where each of 64 values took a conversion, a
    // subtraction and a maximum (v21c).
    ChannelStats<T> ext;
    ext.init();
#pragma unroll
    for (int i = 0; i < kRows; ++i)
      if (kFull || tile * sm90::kBlockKV + r0 + i * kRowsPerIter < p.n_kv)
        ext.add_extremes(raw[i]);
    float km[8];
    kmean8(km);
    float thread_amax = 0.f;  // also where the thread has no row below n_kv
#pragma unroll
    for (int j = 0; j < 8; ++j)
      thread_amax = fmaxf(thread_amax, fmaxf(__fsub_rn(ext.max(j), km[j]),
                                             __fsub_rn(km[j], ext.min(j))));
#pragma unroll
    for (int off = 1; off < kLanesPerRow; off *= 2)
      thread_amax = fmaxf(thread_amax, __shfl_xor_sync(0xffffffffu, thread_amax, off));
    if (lane_c == 0) sh.row_amax[r0] = thread_amax;
  }
  Sync::sync();
  const float k_max = float(p.k_max);
  if (per_token) {
    if (threadIdx.x < sm90::kBlockKV) {
      const int r = threadIdx.x;
      sh.kinv[r] = rules::symmetric_inverse(sh.row_amax[r], k_max);
      p.out.k_scale[head * p.n_pad + tile * sm90::kBlockKV + r] =
          rules::symmetric_scale(sh.row_amax[r], k_max);
    }
  } else if (threadIdx.x < 32) {
    // One warp reduces the kRowsPerIter (16 or 32) entries (max is exact in any order): lane
    // l takes entry l, whose rows lie in thread group (l % 8) / 2, as do lanes l ^ 1, l ^ 8 and
    // l ^ 16. (Until v11 four threads each scanned all 128 rows while the CTA waited.)
    static_assert(sm90::kBlockKV == 128 && sm90::kKScalesPerTile == 4 && kRowsPerIter <= 32 &&
                      kRowsPerIter % 8 == 0, "lane map");
    const int lane = threadIdx.x;
    float amax = lane < kRowsPerIter ? sh.row_amax[lane] : 0.f;
    for (int off : {1, 8, 16}) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
    const float tile_amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
    const int g = lane;  // lanes 0..3 write group g, whose maximum lane 2g holds
    const float group_amax = __shfl_sync(0xffffffffu, amax, 2 * (g % sm90::kKScalesPerTile));
    const float both_groups = __shfl_sync(0xffffffffu, tile_amax, 4);
    if (g < sm90::kKScalesPerTile) {
      float a;
      switch (p.k_granularity) {
        case Granularity::per_thread: a = group_amax; break;
        case Granularity::per_tensor: a = p.out.k_amax[head]; break;
        default:  // per_block and per_warp: every warp reads the whole K tile
          a = fmaxf(tile_amax, both_groups);
          break;
      }
      sh.kinv[g] = rules::symmetric_inverse(a, k_max);
      p.out.k_scale[(head * (p.n_pad / sm90::kBlockKV) + tile) * sm90::kKScalesPerTile + g] =
          rules::symmetric_scale(a, k_max);
    }
  }
  Sync::sync();
  int8_t* kq = p.out.k + (head * p.n_pad + tile * sm90::kBlockKV) * D + lane_c * 8;
  // The codes of rules::round_clamp, as the Q path gets them (q_operand.cuh, docs/numerics.md
  // step 3): the low byte of the product plus 1.5 * 2^23, and no clamp, which never acts since
  // each smoothed value is at most its group's amax in magnitude (the amax above, or per
  // tensor the statistics pass's max(max - mean, mean - min), which rounding's monotonicity
  // makes the same bound). Per value an FMUL and an FADD, and three byte permutes per four
  // values, where rintf, the two-sided clamp, the float-to-int conversion and the shifts into
  // place took about seven: this kernel issues rather than waits on DRAM (ncu, H200, d = 128,
  // N = 1K: 63% issue active, DRAM 52%).
#pragma unroll
  for (int i = 0; i < kRows; ++i) {
    const int r = r0 + i * kRowsPerIter;
    const float inv = sh.kinv[p.k_granularity == Granularity::per_token    ? r
                             : p.k_granularity == Granularity::per_thread ? (r % 8) / 2
                                                                          : 0];
    const bool valid = kFull || tile * sm90::kBlockKV + r < p.n_kv;
    float x[8], km[8];
    gpu::unpack8<T>(raw[i], x);
    kmean8(km);
    uint32_t c[8];
#pragma unroll
    for (int j = 0; j < 8; ++j)
      c[j] = sm90::round_to_low_bits(__fmul_rn(valid ? __fsub_rn(x[j], km[j]) : 0.f, inv));
    uint32_t w[2];
#pragma unroll
    for (int h4 = 0; h4 < 2; ++h4)
      w[h4] = __byte_perm(__byte_perm(c[4 * h4], c[4 * h4 + 1], 0x0040),
                          __byte_perm(c[4 * h4 + 2], c[4 * h4 + 3], 0x0040), 0x5410);
    *reinterpret_cast<uint2*>(kq + (int64_t)r * D) = make_uint2(w[0], w[1]);
  }
}

// The first token of stored quad `quad` (positions 4 quad .. 4 quad + 3) of an 8-bit V tile;
// its four tokens are this plus 0, 1, 8, 9.
__host__ __device__ constexpr int quad_token_base(int quad) {
  return 32 * (quad / 8) + 16 * ((quad / 4) % 2) + 2 * (quad % 4);
}
constexpr bool quad_tokens_match() {
  for (int pos = 0; pos < sm90::kBlockKV; ++pos) {
    const int i = pos % 4;
    const int token = 32 * (pos / 32) + pv_token_at_position(pos % 32);
    if (quad_token_base(pos / 4) + (i < 2 ? i : 6 + i) != token) return false;
  }
  return true;
}
static_assert(quad_tokens_match(), "quad_token_base agrees with pv_token_at_position");

// V: smooth, scale, encode (E4M3, INT8 or fp16), transpose through s_vt (D rows of `pitch`
// bytes). 8-bit V takes the P-layout token permutation; fp16 V stays in token order
// (pv_operand.cuh).
//
// A thread works on units of four consecutive stored positions ("quads") x eight channels:
// it loads the four tokens stored there (one 16-byte row piece each) and writes each channel's
// four codes as one 32-bit word (fp16: 64 bits). At d = 128 a warp takes 8 quads x 4 channel
// chunks, so with the 33-word pitch the 32 words of one store land in 32 banks (bank =
// channel + quad); at d = 64 it takes 4 quads x all 8 chunks (2-way conflicts), so that each
// load reads whole 128-byte rows: half rows measured 11% slower there (H100, 2026-11-23).
// (Until v11 each thread stored single bytes of one token's channels: 4x the shared-memory
// stores, 4-way bank conflicts.)
template <int D, class T, VFormat F, bool kFull, class Sync = CtaBarrier>
__device__ __forceinline__ void quantize_v_tile(const sm90::KVQuantParams& p, int tile, int h,
                                                int b, uint8_t* s_vt, VTileShared<D>& sh) {
  constexpr int kChunks = D / 8;                 // 8-channel pieces of a token's row
  constexpr int kQuads = sm90::kBlockKV / 4;     // groups of four stored positions per tile
  constexpr int kChunksPerWarp = kChunks == 8 ? 8 : 4, kQuadsPerWarp = 32 / kChunksPerWarp;
  constexpr int kUnits = kQuads * kChunks / kTileThreads;  // (quad, chunk) units per thread
  static_assert(kQuads * kChunks % kTileThreads == 0 && kQuads % kQuadsPerWarp == 0 &&
                kChunks % kChunksPerWarp == 0, "unit map");
  const int64_t head = (int64_t)b * p.heads_kv + h;
  constexpr bool v_fp16 = F == VFormat::fp16;

  auto unit_quad = [](int k) {
    const int u = threadIdx.x + k * kTileThreads, w = u / 32, lane = u % 32;
    return (w % (kQuads / kQuadsPerWarp)) * kQuadsPerWarp + lane % kQuadsPerWarp;
  };
  auto unit_chunk = [](int k) {
    const int u = threadIdx.x + k * kTileThreads, w = u / 32, lane = u % 32;
    return (w / (kQuads / kQuadsPerWarp)) * kChunksPerWarp + lane / kQuadsPerWarp;
  };
  // The tile token stored at position 4 * quad + i. 8-bit V: positions 4t .. 4t + 3 of a
  // 16-token half slice hold tokens 2t, 2t + 1, 2t + 8, 2t + 9 (pv_token_at_position), so a
  // quad's tokens are one base plus constants once i is unrolled (checked below).
  auto token_at = [&](int quad, int i) {
    if constexpr (v_fp16) return 4 * quad + i;
    return quad_token_base(quad) + (i < 2 ? i : 6 + i);
  };

  const T* vb = static_cast<const T*>(p.v) + b * p.v_stride_b + h * p.v_stride_h;
  uint4 raw[kUnits][4];
#pragma unroll
  for (int k = 0; k < kUnits; ++k)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int t = tile * sm90::kBlockKV + token_at(unit_quad(k), i);
      // Zeros past n_kv: padding never counts toward a scale.
      raw[k][i] = kFull || t < p.n_kv ? *reinterpret_cast<const uint4*>(
                                            vb + (int64_t)t * p.v_stride_n + unit_chunk(k) * 8)
                                      : make_uint4(0, 0, 0, 0);
    }
  sm90::grid_dependency_wait();  // the statistics kernel's finals (launched with PDL)
  if (threadIdx.x < D) {
    sh.vmean[threadIdx.x] = p.out.v_mean[head * D + threadIdx.x];
    sh.vinv[threadIdx.x] = p.out.v_inv[head * D + threadIdx.x];
  }
  Sync::sync();

  constexpr int pitch = (v_fp16 ? 2 : 1) * kVtPitch8;
#pragma unroll
  for (int k = 0; k < kUnits; ++k) {
    const int quad = unit_quad(k), c0 = unit_chunk(k) * 8;
    bool valid[4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
      valid[i] = kFull || tile * sm90::kBlockKV + token_at(quad, i) < p.n_kv;
    // One 32-bit word (two channels) of the four tokens at a time: 8 floats live, not 32 (with
    // all 32 the fp16 d = 128 kernel took 80 registers, three CTAs per SM instead of four).
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      float2 y[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const uint4& r = raw[k][i];
        y[i] = gpu::word_to_float2<T>(w == 0 ? r.x : w == 1 ? r.y : w == 2 ? r.z : r.w);
      }
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int c = c0 + 2 * w + half;
        // Read once for the four tokens (under the valid test, the compiler loaded them once
        // per token).
        const float vmean = sh.vmean[c], vinv = sh.vinv[c];
        float v[4];
#pragma unroll
        for (int i = 0; i < 4; ++i)
          v[i] = valid[i] ? __fmul_rn(__fsub_rn(half ? y[i].y : y[i].x, vmean), vinv) : 0.f;
        const uint32_t lo = encode_v_pair<F>(v[0], v[1]);
        const uint32_t hi = encode_v_pair<F>(v[2], v[3]);
        if constexpr (v_fp16)
          *reinterpret_cast<uint2*>(&s_vt[c * pitch + 8 * quad]) = make_uint2(lo, hi);
        else
          *reinterpret_cast<uint32_t*>(&s_vt[c * pitch + 4 * quad]) = (lo & 0xFFFFu) | (hi << 16);
      }
    }
  }
  Sync::sync();
  store_vt_tile<D, v_fp16 ? 2 : 1>(p, b, h, tile, s_vt);
}

}  // namespace sage::quant
