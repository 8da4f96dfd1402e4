// Plain parameter blocks shared by the host launchers and the device kernels of the
// Hopper path. Strides are in elements; every pointer is device memory.
#pragma once

#include <cstdint>

#include "sage/recipe.h"

namespace sage::sm90 {

// Tokens per K/V tile: the online-softmax block and the unit of the quantized K/V layout.
constexpr int kBlockKV = 128;
// Q rows per CTA: two consumer warpgroups of 64 rows each.
constexpr int kBlockQ = 128;
// Per-thread K scale groups per tile (tile.h); other granularities store one per tile.
constexpr int kKScalesPerTile = 4;
// Tokens per partial-statistics chunk of the K/V pre-pass.
constexpr int kStatsChunk = 256;
// Statistics kept per (batch, kv head, chunk, channel).
enum Stat : int { kSumK = 0, kMaxK, kMinK, kSumV, kMaxV, kMinV, kNumStats };

// What the pre-pass writes and the attention kernel reads, per (batch, kv head).
struct QuantizedKV {
  int8_t* k;         // [B, Hkv, n_pad, D] int8, smoothed, row-major
  uint8_t* vt;       // [B, Hkv, D, n_pad] e4m3, transposed, tokens permuted per 32 (pv_operand)
  float* k_scale;    // [B, Hkv, n_pad / kBlockKV, kKScalesPerTile]
  float* k_mean;     // [B, Hkv, D]  (zeros when K is not smoothed)
  float* v_scale;    // [B, Hkv, D]  max|V'_c| / v_max
  float* v_mean;     // [B, Hkv, D]  (zeros when V is not smoothed)
  float* partials;   // [kNumStats, B, Hkv, chunks, D]
};

struct KVQuantParams {
  const void* k;
  const void* v;
  int64_t k_stride_b, k_stride_h, k_stride_n;
  int64_t v_stride_b, v_stride_h, v_stride_n;
  int batch, heads_kv, n_kv, n_pad, chunks;
  Granularity k_granularity;
  bool smooth_k, smooth_v;
  float v_max;  // the format value max|V'_c| maps to (448 for e4m3, or recipe.v_range)
  QuantizedKV out;
};

struct AttentionParams {
  const void* q;
  int64_t q_stride_b, q_stride_h, q_stride_n;
  void* out;
  int64_t o_stride_b, o_stride_h, o_stride_n;
  float* lse;  // optional
  int64_t lse_stride_b, lse_stride_h, lse_stride_n;
  int batch, heads_q, heads_kv, n_q, n_kv, n_pad, n_q_tiles;
  float sm_scale, sm_scale_log2;
  float p_max;  // P~ is scaled by this before the FP8 conversion (448 or recipe.p_range)
  Granularity q_granularity;
  bool causal, smooth_k, smooth_v;
  QuantizedKV kv;
};

}  // namespace sage::sm90
