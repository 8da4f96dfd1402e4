#include "quant/kv_prepass.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <atomic>
#include <cfloat>

#include "common/vec_io.cuh"
#include "sage/error.h"
#include "sage/quant_rules.h"
#include "sage/tile.h"
#include "sm90/head_dims.h"
#include "sm90/ptx.cuh"
#include "sm90/schedule.h"
#include "sm90/tma_maps.h"

namespace sage::quant {
namespace {

constexpr int kThreads = 256;

// ---- statistics ----------------------------------------------------------------------------
// A head's channel statistics (K mean, V mean, V scale and its inverse, K's largest |K - mean|)
// come from per-chunk partials: each statistics item reads a chunk of the head's K and V
// tiles and writes its per-channel sums and extremes; the item that completes the head's last
// chunk combines them in chunk order (deterministic: repeated calls are bit-identical) and
// marks the head ready for its quantize items.
enum StatsRow : int { kSum = 0, kMax, kMin, kStatsRows };
// Chunks per head at most: the combine reads this many partials per channel, so that it stays
// short at long N, where a chunk then covers several tiles.
constexpr int kMaxStatsChunks = 16;
static_assert(kPrepassPartialFloats == kMaxStatsChunks * 2 * kStatsRows, "workspace partials");

template <class T>
struct ChannelStats {
  float sum[8], max[8], min[8];
  __device__ __forceinline__ void init() {
#pragma unroll
    for (int i = 0; i < 8; ++i) sum[i] = 0.f, max[i] = -FLT_MAX, min[i] = FLT_MAX;
  }
  __device__ __forceinline__ void add(const uint4& raw) {
    float x[8];
    gpu::unpack8<T>(raw, x);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      sum[i] += x[i];
      max[i] = fmaxf(max[i], x[i]);
      min[i] = fminf(min[i], x[i]);
    }
  }
  __device__ __forceinline__ float row(int s, int i) const {
    return s == kSum ? sum[i] : s == kMax ? max[i] : min[i];
  }
};

// Partials of one chunk: [2 tensors (K, V)][kStatsRows][D] floats.
template <int D>
__device__ __forceinline__ float* chunk_partials(const sm90::KVQuantParams& p, int64_t head,
                                                 int chunk) {
  return p.out.stat_partials + (head * kMaxStatsChunks + chunk) * 2 * kStatsRows * D;
}

// Shared memory of a statistics item: the CTA's rows of one tensor, before their reduction.
template <int D>
struct StatsScratch {
  static constexpr int kRowsPerIter = kThreads / (D / 8);
  float red[kStatsRows][kRowsPerIter][D];
};

// Row r's 16-byte piece `chunk` (channels 8 chunk .. 8 chunk + 7) of a K or V tile staged in
// shared memory as it lies in global memory (rows of D fp16/bf16 values).
template <int D>
__device__ __forceinline__ uint4 staged_piece(const uint8_t* rows, int r, int chunk) {
  return *reinterpret_cast<const uint4*>(rows + r * (D * 2) + chunk * 16);
}

// A statistics item's pass over one staged tile: this thread's rows into its channel sums and
// extremes (valid tokens only).
template <int D, class T>
__device__ __forceinline__ void stats_add(const sm90::KVQuantParams& p, const uint8_t* rows,
                                          int tile, ChannelStats<T>& st) {
  constexpr int kLanesPerRow = D / 8;
  constexpr int kRowsPerIter = kThreads / kLanesPerRow;
  const int lane_c = threadIdx.x % kLanesPerRow, r0 = threadIdx.x / kLanesPerRow;
#pragma unroll
  for (int i = 0; i < sm90::kBlockKV / kRowsPerIter; ++i) {
    const int r = r0 + i * kRowsPerIter;
    if (tile * sm90::kBlockKV + r < p.n_kv) st.add(staged_piece<D>(rows, r, lane_c));
  }
}

// The CTA's rows combined in a fixed order, one (statistic, channel) per thread, into the
// chunk's partials of `tensor` (0: K, 1: V).
template <int D, class T>
__device__ __forceinline__ void stats_write(const sm90::KVQuantParams& p, int64_t head, int chunk,
                                            int tensor, const ChannelStats<T>& st,
                                            StatsScratch<D>& scratch) {
  constexpr int kLanesPerRow = D / 8;
  constexpr int kRowsPerIter = kThreads / kLanesPerRow;
  const int lane_c = threadIdx.x % kLanesPerRow, r0 = threadIdx.x / kLanesPerRow;
#pragma unroll
  for (int s = 0; s < kStatsRows; ++s)
#pragma unroll
    for (int i = 0; i < 8; ++i) scratch.red[s][r0][lane_c * 8 + i] = st.row(s, i);
  __syncthreads();
  float* out = chunk_partials<D>(p, head, chunk) + tensor * kStatsRows * D;
  for (int e = threadIdx.x; e < kStatsRows * D; e += kThreads) {
    const int s = e / D, c = e % D;
    float acc = scratch.red[s][0][c];
    for (int r = 1; r < kRowsPerIter; ++r) {
      const float v = scratch.red[s][r][c];
      acc = s == kSum ? acc + v : s == kMax ? fmaxf(acc, v) : fminf(acc, v);
    }
    out[s * D + c] = acc;
  }
}

// The head's finals from its chunks' partials, in chunk order. Called by the CTA that
// completed the head's last chunk, after a fence: the partials are read from L2.
template <int D>
__device__ __forceinline__ void combine_head_stats(const sm90::KVQuantParams& p, int64_t head,
                                                   int chunks, float (&s_amax)[2][D]) {
  if (threadIdx.x < 2 * D) {
    const int tensor = threadIdx.x / D, c = threadIdx.x % D;  // 0: K, 1: V
    float sum = 0.f, mx = -FLT_MAX, mn = FLT_MAX;
    for (int k = 0; k < chunks; ++k) {
      const float* part = chunk_partials<D>(p, head, k) + tensor * kStatsRows * D + c;
      sum += __ldcg(part + kSum * D);
      mx = fmaxf(mx, __ldcg(part + kMax * D));
      mn = fminf(mn, __ldcg(part + kMin * D));
    }
    const bool smooth = tensor == 0 ? p.smooth_k : p.smooth_v;
    const float mean = smooth ? sum / p.n_kv : 0.f;
    // Rounding is monotonic, so the extreme of |x - mean| is reached at the channel's max
    // or min: the same value a pass over every token would find.
    s_amax[tensor][c] = fmaxf(mx - mean, mean - mn);
    (tensor == 0 ? p.out.k_mean : p.out.v_mean)[head * D + c] = mean;
  }
  __syncthreads();
  if (threadIdx.x < D) {
    const int c = threadIdx.x;
    float vamax = s_amax[1][c];
    if (p.v_per_tensor)  // INT-FlashAttention: one scale over all channels
      for (int i = 0; i < D; ++i) vamax = fmaxf(vamax, s_amax[1][i]);
    // fp16 V is not scaled: the kernel's epilogue multiplies by 1.
    const bool v_fp16 = p.pv_path == sm90::PVPath::fp16;
    p.out.v_scale[head * D + c] = v_fp16 ? 1.f : rules::symmetric_scale(vamax, p.v_max);
    p.out.v_inv[head * D + c] = v_fp16 ? 1.f : rules::symmetric_inverse(vamax, p.v_max);
    if (c == 0) {
      float kamax = 0.f;
      for (int i = 0; i < D; ++i) kamax = fmaxf(kamax, s_amax[0][i]);
      p.out.k_amax[head] = kamax;
    }
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


// ---- pass 2: quantize ----------------------------------------------------------------------
// Two CTAs per 128-token tile, one for K and one for V (blockIdx.x = 2 * tile + is_v). Each
// holds only its own tensor's rows in registers, all loads issued first: 64 registers per
// thread at d = 128 where one CTA for both took 126, so three CTAs per SM instead of two (that
// v8 kernel ran at 39% of DRAM bandwidth, ncu, H100, d = 128, N = 1K).
// s_kmean: the head's K mean, in shared memory (loaded once per item by the caller).
template <int D, class T>
__device__ __forceinline__ void quantize_k_tile(const sm90::KVQuantParams& p, int tile, int h,
                                                int b, const uint8_t* rows, const float* s_kmean) {
  constexpr int kLanesPerRow = D / 8;
  constexpr int kRowsPerIter = kThreads / kLanesPerRow;
  constexpr int kRows = sm90::kBlockKV / kRowsPerIter;  // rows per thread
  const int lane_c = threadIdx.x % kLanesPerRow, r0 = threadIdx.x / kLanesPerRow;
  const int64_t head = (int64_t)b * p.heads_kv + h;
  __shared__ float s_row_amax[sm90::kBlockKV];
  __shared__ float s_kinv[sm90::kBlockKV];  // per token, or the tile's per-thread groups

  uint4 raw[kRows];
#pragma unroll
  for (int i = 0; i < kRows; ++i) {
    const int r = r0 + i * kRowsPerIter;
    // Zeros past n_kv: padding never counts toward a scale.
    raw[i] = tile * sm90::kBlockKV + r < p.n_kv ? staged_piece<D>(rows, r, lane_c) : make_uint4(0, 0, 0, 0);
  }

  // Each 16-bit value is converted twice (here for the amax, below for the codes) rather
  // than kept as floats: 32 fewer live registers per thread.
#pragma unroll
  for (int i = 0; i < kRows; ++i) {
    const int r = r0 + i * kRowsPerIter;
    float x[8];
    gpu::unpack8<T>(raw[i], x);
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
      p.out.k_scale[head * p.n_pad + tile * sm90::kBlockKV + r] =
          rules::symmetric_scale(s_row_amax[r], k_max);
    }
  } else if (threadIdx.x < 32) {
    // One warp reduces the row maxima (max is exact in any order): lane l takes rows l, l + 32,
    // l + 64, l + 96, which all lie in thread group (l % 8) / 2, as do lanes l ^ 1, l ^ 8 and
    // l ^ 16. (Until v11 four threads each scanned all 128 rows while the CTA waited.)
    static_assert(sm90::kBlockKV == 128 && sm90::kKScalesPerTile == 4, "lane map");
    const int lane = threadIdx.x;
    float amax = 0.f;
    for (int r = lane; r < sm90::kBlockKV; r += 32) amax = fmaxf(amax, s_row_amax[r]);
    for (int off : {1, 8, 16}) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
    const float tile_amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
    const int g = lane;  // lanes 0..3 write group g, whose maximum lane 2g holds
    const float group_amax = __shfl_sync(0xffffffffu, amax, 2 * (g % sm90::kKScalesPerTile));
    const float both_groups = __shfl_sync(0xffffffffu, tile_amax, 4);
    if (g < sm90::kKScalesPerTile) {
      float a;
      switch (p.k_granularity) {
        case Granularity::per_thread: a = group_amax; break;
        case Granularity::per_tensor: a = __ldcg(&p.out.k_amax[head]); break;
        default:  // per_block and per_warp: every warp reads the whole K tile
          a = fmaxf(tile_amax, both_groups);
          break;
      }
      s_kinv[g] = rules::symmetric_inverse(a, k_max);
      p.out.k_scale[(head * (p.n_pad / sm90::kBlockKV) + tile) * sm90::kKScalesPerTile + g] =
          rules::symmetric_scale(a, k_max);
    }
  }
  __syncthreads();
  int8_t* kq = p.out.k + (head * p.n_pad + tile * sm90::kBlockKV) * D + lane_c * 8;
#pragma unroll
  for (int i = 0; i < kRows; ++i) {
    const int r = r0 + i * kRowsPerIter;
    const float inv = s_kinv[p.k_granularity == Granularity::per_token    ? r
                             : p.k_granularity == Granularity::per_thread ? (r % 8) / 2
                                                                          : 0];
    const bool valid = tile * sm90::kBlockKV + r < p.n_kv;
    float x[8];
    gpu::unpack8<T>(raw[i], x);
    uint32_t w[2] = {0, 0};
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float smoothed = valid ? x[j] - s_kmean[lane_c * 8 + j] : 0.f;
      const int32_t q = rules::round_clamp(smoothed * inv, p.k_max);
      w[j / 4] |= (uint32_t(q) & 0xFFu) << (8 * (j % 4));
    }
    *reinterpret_cast<uint2*>(kq + (int64_t)r * D) = make_uint2(w[0], w[1]);
  }
}

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
// s_vmean, s_vinv: the head's V mean and per-channel multiplier, in shared memory (loaded once
// per item by the caller).
template <int D, class T>
__device__ __forceinline__ void quantize_v_tile(const sm90::KVQuantParams& p, int tile, int h,
                                                int b, const uint8_t* rows, const float* s_vmean,
                                                const float* s_vinv, uint8_t* s_vt) {
  constexpr int kChunks = D / 8;                 // 8-channel pieces of a token's row
  constexpr int kQuads = sm90::kBlockKV / 4;     // groups of four stored positions per tile
  constexpr int kChunksPerWarp = kChunks == 8 ? 8 : 4, kQuadsPerWarp = 32 / kChunksPerWarp;
  constexpr int kUnits = kQuads * kChunks / kThreads;  // (quad, chunk) units per thread
  static_assert(kQuads * kChunks % kThreads == 0 && kQuads % kQuadsPerWarp == 0 &&
                kChunks % kChunksPerWarp == 0, "unit map");
  const bool v_fp16 = p.pv_path == sm90::PVPath::fp16;

  auto unit_quad = [](int k) {
    const int u = threadIdx.x + k * kThreads, w = u / 32, lane = u % 32;
    return (w % (kQuads / kQuadsPerWarp)) * kQuadsPerWarp + lane % kQuadsPerWarp;
  };
  auto unit_chunk = [](int k) {
    const int u = threadIdx.x + k * kThreads, w = u / 32, lane = u % 32;
    return (w / (kQuads / kQuadsPerWarp)) * kChunksPerWarp + lane / kQuadsPerWarp;
  };
  // The tile token stored at position 4 * quad + i.
  auto token_at = [&](int quad, int i) {
    const int pos = 4 * quad + i;
    return v_fp16 ? pos : 32 * (pos / 32) + pv_token_at_position(pos % 32);
  };

  uint4 raw[kUnits][4];
#pragma unroll
  for (int k = 0; k < kUnits; ++k)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int r = token_at(unit_quad(k), i);
      // Zeros past n_kv: padding never counts toward a scale.
      raw[k][i] = tile * sm90::kBlockKV + r < p.n_kv ? staged_piece<D>(rows, r, unit_chunk(k))
                                                     : make_uint4(0, 0, 0, 0);
    }

  const int v_bytes = v_fp16 ? 2 : 1;
  const int pitch = v_bytes * kVtPitch8;
#pragma unroll
  for (int k = 0; k < kUnits; ++k) {
    const int quad = unit_quad(k), c0 = unit_chunk(k) * 8;
    bool valid[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) valid[i] = tile * sm90::kBlockKV + token_at(quad, i) < p.n_kv;
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
        float v[4];
#pragma unroll
        for (int i = 0; i < 4; ++i)
          v[i] = valid[i] ? ((half ? y[i].y : y[i].x) - s_vmean[c]) * s_vinv[c] : 0.f;
        const uint32_t lo = encode_v_pair(p.pv_path, v[0], v[1]);
        const uint32_t hi = encode_v_pair(p.pv_path, v[2], v[3]);
        if (v_fp16)
          *reinterpret_cast<uint2*>(&s_vt[c * pitch + 8 * quad]) = make_uint2(lo, hi);
        else
          *reinterpret_cast<uint32_t*>(&s_vt[c * pitch + 4 * quad]) = (lo & 0xFFFFu) | (hi << 16);
      }
    }
  }
  __syncthreads();
  store_vt_tile<D>(p, b, h, tile, s_vt, pitch, v_bytes);
}

// ---- one launch: statistics and quantization -------------------------------------------------
// K and V are read once from DRAM: a head's quantize items run `lag` heads after its
// statistics items, while its K/V is still in L2. (Two launches, statistics then quantization,
// read every byte twice from DRAM: 0.47 ms at d = 128, N = 1K on the H200, against 0.31 ms for
// that traffic; one read and one write take 0.19 ms at the same bandwidth.)
//
// The items, in one global order: step j holds head j's statistics items (j < heads: a K and a
// V item per chunk of `span` tiles), then head (j - lag)'s quantize items (j >= lag: a K and a
// V item per tile). CTA c runs items c, c + grid, c + 2 grid, ... and the grid is never larger
// than what is resident at once. A quantize item waits until its head is ready; every item it
// can wait on comes earlier in the order, so the earliest unfinished item never waits and the
// launch cannot deadlock.
//
// Each item reads whole tiles (128 rows of one tensor), which one thread stages into shared
// memory with bulk copies kRing tiles ahead of the CTA's use. Loaded into registers by the
// item that uses them, each item waited for its own loads: with two or three CTAs per SM (the
// registers), a persistent grid ran at a third of the DRAM bandwidth (0.70 ms at d = 128,
// N = 1K, H200).
struct PrepassItems {
  int heads, lag, tiles;
  int chunks, span;     // statistics items per tensor and head, and tiles per item
  int qchunks, qspan;   // the same for quantize items
  int64_t items;
};

struct PrepassItem {
  bool stats;
  int head, tensor;  // tensor 0: K, 1: V
  int first_tile, tiles;  // the tiles it reads
};

__device__ __forceinline__ PrepassItem prepass_item(const PrepassItems& s, int64_t i) {
  const int stats = 2 * s.chunks, quant = 2 * s.qchunks, both = stats + quant;
  const int first = min(s.lag, s.heads), middle_end = max(s.lag, s.heads);
  int head, k;  // k: the item's index in its step
  bool is_stats;
  if (i < int64_t(first) * stats) {
    head = int(i / stats), k = int(i % stats), is_stats = true;
  } else {
    i -= int64_t(first) * stats;
    const int64_t middle = s.lag < s.heads ? int64_t(middle_end - first) * both : 0;
    if (i < middle) {  // steps [lag, heads) hold both kinds
      const int j = first + int(i / both);
      k = int(i % both), is_stats = k < stats;
      head = is_stats ? j : j - s.lag;
      if (!is_stats) k -= stats;
    } else {
      i -= middle;
      head = middle_end + int(i / quant) - s.lag, k = int(i % quant), is_stats = false;
    }
  }
  const int span = is_stats ? s.span : s.qspan, first_tile = (k / 2) * span;
  return {is_stats, head, k % 2, first_tile, min(span, s.tiles - first_tile)};
}

__device__ __forceinline__ uint32_t load_acquire(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

constexpr int kRing = 2;       // staged tiles per CTA
constexpr int kStatsSpan = 8;  // tiles per statistics item, at least
constexpr int kQuantSpan = 4;  // tiles per quantize item

// Dynamic shared memory of the pre-pass kernel.
template <int D>
struct PrepassSmem {
  alignas(128) uint8_t tiles[kRing][sm90::kBlockKV * D * 2];
  union Work {
    StatsScratch<D> stats;
    uint8_t vt[D * 2 * kVtPitch8];  // the transposed V tile (fp16 V at most)
  } work;
  alignas(8) uint64_t full[kRing];
};

// Thread 0: the rows of `tile` of the item's tensor into `dst`, completing on `bar`.
template <int D, class T>
__device__ __forceinline__ void stage_tile(const sm90::KVQuantParams& p, int head, int tensor,
                                           int tile, uint8_t* dst, uint64_t* bar) {
  const int b = head / p.heads_kv, h = head % p.heads_kv;
  const T* base = tensor == 0 ? static_cast<const T*>(p.k) + b * p.k_stride_b + h * p.k_stride_h
                              : static_cast<const T*>(p.v) + b * p.v_stride_b + h * p.v_stride_h;
  const int64_t stride = tensor == 0 ? p.k_stride_n : p.v_stride_n;
  const int rows = min(sm90::kBlockKV, p.n_kv - tile * sm90::kBlockKV);
  constexpr uint32_t kRowBytes = D * 2;
  const T* src = base + int64_t(tile) * sm90::kBlockKV * stride;
  sm90::mbar_expect_tx(bar, rows * kRowBytes);
  if (stride == D) {
    sm90::bulk_copy_g2s(dst, src, rows * kRowBytes, bar);
  } else {
    for (int r = 0; r < rows; ++r) sm90::bulk_copy_g2s(dst + r * kRowBytes, src + r * stride, kRowBytes, bar);
  }
}

template <int D, class T>
__global__ void __launch_bounds__(kThreads, 2)
    kv_prepass_kernel(const sm90::KVQuantParams p, const PrepassItems items) {
  extern __shared__ __align__(128) uint8_t smem_raw[];
  auto& sm = *reinterpret_cast<PrepassSmem<D>*>(smem_raw);
  __shared__ float s_amax[2][D];
  __shared__ float s_channel[2][D];  // a quantize item's mean (and V multiplier) per channel
  __shared__ bool s_last;
  // ready[head]: statistics items done, then one more once the finals are written.
  uint32_t* ready = p.out.head_ready;
  const uint32_t stats_per_head = 2 * items.chunks;

  // Thread 0 walks this CTA's tile loads kRing ahead of their use.
  int64_t load_item = blockIdx.x;
  int load_k = 0;
  auto stage_next = [&](int buf) {
    if (load_item >= items.items) return;
    const PrepassItem it = prepass_item(items, load_item);
    stage_tile<D, T>(p, it.head, it.tensor, it.first_tile + load_k, sm.tiles[buf], &sm.full[buf]);
    if (++load_k == it.tiles) load_k = 0, load_item += gridDim.x;
  };
  if (threadIdx.x == 0) {
    for (int i = 0; i < kRing; ++i) sm90::mbar_init(&sm.full[i], 1);
    sm90::fence_barrier_init();
    for (int i = 0; i < kRing; ++i) stage_next(i);
  }
  __syncthreads();

  int consumed = 0;  // tiles this CTA has taken from the ring
  for (int64_t i = blockIdx.x; i < items.items; i += gridDim.x) {
    const PrepassItem it = prepass_item(items, i);
    const int b = it.head / p.heads_kv, h = it.head % p.heads_kv;
    // The next staged tile (waited for), and its release to thread 0's next bulk copy.
    auto take_tile = [&]() -> const uint8_t* {
      const int buf = consumed % kRing;
      sm90::mbar_wait(&sm.full[buf], (consumed / kRing) & 1);
      return sm.tiles[buf];
    };
    auto release_tile = [&] {
      __syncthreads();  // the staged tile (and the work area) are free again
      if (threadIdx.x == 0) stage_next(consumed % kRing);
      ++consumed;
    };
    if (!it.stats) {
      if (threadIdx.x == 0)
        while (load_acquire(&ready[it.head]) <= stats_per_head) __nanosleep(128);
      __syncthreads();
      // The head's finals, written during this launch by another CTA: read past L1.
      if (threadIdx.x < D) {
        const int64_t c = int64_t(it.head) * D + threadIdx.x;
        s_channel[0][threadIdx.x] = __ldcg(it.tensor == 0 ? &p.out.k_mean[c] : &p.out.v_mean[c]);
        if (it.tensor == 1) s_channel[1][threadIdx.x] = __ldcg(&p.out.v_inv[c]);
      }
      __syncthreads();
      for (int k = 0; k < it.tiles; ++k) {
        const uint8_t* rows = take_tile();
        if (it.tensor == 0)
          quantize_k_tile<D, T>(p, it.first_tile + k, h, b, rows, s_channel[0]);
        else
          quantize_v_tile<D, T>(p, it.first_tile + k, h, b, rows, s_channel[0], s_channel[1],
                                sm.work.vt);
        release_tile();
      }
    } else {
      ChannelStats<T> st;
      st.init();
      for (int k = 0; k < it.tiles; ++k) {
        stats_add<D, T>(p, take_tile(), it.first_tile + k, st);
        release_tile();
      }
      stats_write<D, T>(p, it.head, it.first_tile / items.span, it.tensor, st, sm.work.stats);
      __syncthreads();
      if (threadIdx.x == 0) {
        __threadfence();  // the partials before the count
        s_last = atomicAdd(&ready[it.head], 1u) == stats_per_head - 1;
      }
      __syncthreads();
      if (s_last) {
        __threadfence();
        combine_head_stats<D>(p, it.head, items.chunks, s_amax);
        __syncthreads();
        if (threadIdx.x == 0) {
          __threadfence();  // the finals before the flag
          atomicAdd(&ready[it.head], 1u);
        }
      }
      __syncthreads();  // the scratch and s_last are reused by the next item
    }
  }
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

std::atomic<int> g_lag_override{0};

}  // namespace

void set_prepass_lag_override(int heads) { g_lag_override.store(std::max(0, heads)); }

template <int D, class T>
void launch_kv_prepass(const sm90::KVQuantParams& p, cudaStream_t stream) {
  if (p.k_scale_in != nullptr) {
    const dim3 grid(p.n_pad / sm90::kBlockKV, p.heads_kv, p.batch);
    kv_copy_prequantized_kernel<D><<<grid, kThreads, 0, stream>>>(p);
    return;
  }
  PrepassItems items;
  items.heads = p.batch * p.heads_kv;
  items.tiles = p.n_pad / sm90::kBlockKV;
  // Items of several tiles: each item pays a few round trips to L2 (the ready flag, the
  // head's finals, the partials and their count) that its tiles share. With one tile per item
  // the grid ran at a third of the DRAM bandwidth.
  items.span = std::min(items.tiles, std::max(kStatsSpan, (items.tiles + kMaxStatsChunks - 1) / kMaxStatsChunks));
  items.chunks = (items.tiles + items.span - 1) / items.span;
  items.qspan = std::min(items.tiles, kQuantSpan);
  items.qchunks = (items.tiles + items.qspan - 1) / items.qspan;
  const size_t smem_bytes = sizeof(PrepassSmem<D>);
  // Resident CTAs: every CTA of the grid must run at once (the waits above). Looked up once
  // per device, with the shared-memory limit raised there (a per-device attribute).
  constexpr int kMaxDevices = 64;
  static std::atomic<int> known_per_sm[kMaxDevices] = {};
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) sm90::throw_cuda("cudaGetDevice", err);
  int per_sm = device < kMaxDevices ? known_per_sm[device].load(std::memory_order_relaxed) : 0;
  if (per_sm == 0) {
    err = cudaFuncSetAttribute(kv_prepass_kernel<D, T>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               int(smem_bytes));
    if (err != cudaSuccess) sm90::throw_cuda("K/V pre-pass shared memory", err);
    err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kv_prepass_kernel<D, T>, kThreads,
                                                        smem_bytes);
    if (err != cudaSuccess) sm90::throw_cuda("K/V pre-pass occupancy", err);
    per_sm = std::max(per_sm, 1);
    if (device < kMaxDevices) known_per_sm[device].store(per_sm, std::memory_order_relaxed);
  }
  const int per_head = 2 * (items.chunks + items.qchunks);
  const int64_t grid = std::min<int64_t>(int64_t(per_sm) * sm90::sm_count(), int64_t(items.heads) * per_head);
  // The lag keeps a third of the L2 in heads' fp16 K/V between a head's statistics and its
  // quantize items (their reads and the quantized writes in between fill the rest), and at
  // least one and a half grids' worth of items (a statistics item finishes about a grid
  // after the grid starts it), so that quantize items seldom find their head still being
  // measured.
  const int64_t head_bytes = int64_t(p.n_kv) * D * 2 * 2;
  const int64_t by_bytes = std::max<int64_t>(1, sm90::l2_bytes() / 3 / head_bytes);
  const int64_t by_items = (3 * grid / 2 + per_head - 1) / per_head;
  const int forced = g_lag_override.load();
  items.lag = int(std::min<int64_t>(forced > 0 ? forced : std::max(by_bytes, by_items), items.heads));
  items.items = int64_t(items.heads) * per_head;
  cudaMemsetAsync(p.out.head_ready, 0, size_t(items.heads) * sizeof(uint32_t), stream);
  kv_prepass_kernel<D, T><<<unsigned(grid), kThreads, smem_bytes, stream>>>(p, items);
}

#define SAGE_INSTANTIATE_PREPASS(D)                                                        \
  template void launch_kv_prepass<D, __half>(const sm90::KVQuantParams&, cudaStream_t);   \
  template void launch_kv_prepass<D, __nv_bfloat16>(const sm90::KVQuantParams&, cudaStream_t);
SAGE_FOR_EACH_HEAD_DIM(SAGE_INSTANTIATE_PREPASS)

}  // namespace sage::quant
