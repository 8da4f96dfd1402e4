// The quantized K/V layout: what the K/V pre-pass writes into the caller's workspace and every
// attention kernel reads. The quantizer owns it; kernels only consume it.
#pragma once

#include <cstdint>

#include "sage/recipe.h"

namespace sage::quant {

// Tokens per K/V tile of the layout (the attention kernels' K/V pipeline block).
constexpr int kKVTile = 128;
// Channels per K row and per V head in the workspace for head dim d: the pre-pass runs at this
// size (64, 128 or 256), writing zeros into the channels from d on, and every kernel reads rows
// of this many channels. The workspace is the library's own buffer: padding it costs no copy of
// the caller's tensors, and it gives the d = 96 kernel whole 128-byte K rows (one 128B swizzle
// span: TMA boxes and MMA descriptors as at d = 128) and the pre-pass power-of-two lanes per
// row. Channels past d are zero in K and V, so they add nothing to a score or an output column
// and change no scale (a maximum over |0|).
constexpr int kv_layout_head_dim(int head_dim) {
  return head_dim <= 64 ? 64 : head_dim <= 128 ? 128 : 256;
}

// Per-thread K scale groups per tile (numerics/tile.h); other granularities store one per
// tile in the same slots.
constexpr int kKScalesPerTile = 4;

// The format of the transposed V tiles.
enum class VFormat : int {
  e4m3,  // 8-bit codes, tokens permuted per 32 (pv_position_of_token, kv_prepass.cuh)
  fp16,  // fp16 in token order (unscaled)
  int8,  // 8-bit codes, permuted as e4m3
};
constexpr int v_format_bytes(VFormat f) { return f == VFormat::fp16 ? 2 : 1; }

// Per (batch, kv head), in the workspace.
struct QuantizedKV {
  int8_t* k;         // [B, Hkv, n_pad, D] int8 (or int4 values), smoothed, row-major
  uint8_t* vt;       // [B, Hkv, D, n_pad] transposed V in its VFormat
  float* k_scale;    // per-tile groups: [B, Hkv, n_pad / kKVTile, kKScalesPerTile]
                     // per token:       [B, Hkv, n_pad]
  float* k_mean;     // [B, Hkv, D]  (zeros when K is not smoothed)
  float* v_scale;    // [B, Hkv, D]  max|V'_c| / v_max (1 for fp16 V)
  float* v_mean;     // [B, Hkv, D]  (zeros when V is not smoothed)
  // VScale::per_block (SageBwd): [B, Hkv, n_pad / kKVTile], one V scale per K/V tile over all
  // channels (v_scale then holds 1 for every channel); null otherwise.
  float* v_block_scale;
  float* v_block_inv;  // [B, Hkv, n_pad / kKVTile] the multipliers (quantize pass only)
  // Written by the statistics pass for the quantize pass only:
  float* v_inv;      // [B, Hkv, D]  v_max / max|V'_c| (the multiplier before encoding)
  float* k_amax;     // [B, Hkv]     max over channels of max|K'_c| (per-tensor K scales)
  // qk_channel_balance: [B, Hkv, D] the power-of-two s_c (K' took * s_c; the attention kernel
  // divides Q by them), and [B, Hkv] whether any of a head's s_c is not 1 (where none is, Q is
  // quantized as without the balance, which divides by 1); both null when the recipe does not
  // balance.
  float* qk_balance;
  int* qk_balance_active;
};

struct KVQuantParams {
  const void* k;
  const void* v;
  int64_t k_stride_b, k_stride_h, k_stride_n;
  int64_t v_stride_b, v_stride_h, v_stride_n;
  int batch, heads_kv, n_kv, n_pad;
  Granularity k_granularity;
  int k_max;  // the largest K code: 127 (int8) or 7 (int4 values)
  bool smooth_k, smooth_v;
  // The caller's head dims of K and of V (multiples of 8, at most the pre-pass's D =
  // kv_layout_head_dim; V's differs for shapes like MLA's 192 / 128): channels from them on
  // are read as zeros, so the workspace's padding channels are zero.
  int head_dim, head_dim_v;
  int k_mean_stride;  // K's statistics over keys 0, stride, ... (recipe.k_mean_stride)
  // Set by launch_kv_prepass: the keys the stride samples, and the statistics CTAs (of each
  // head's cluster) that read them.
  int k_mean_samples, stats_k_ctas;
  VFormat v_format;
  bool v_per_tensor;  // one V scale for all channels (INT-FlashAttention)
  bool v_per_block;   // one V scale per K/V tile over all channels (SageBwd; int8 V only)
  float v_max;  // the format value max|V'_c| maps to (448 e4m3, 127 int8, or recipe.v_range)
  // Prequantized inputs (k and v are int8 codes): per-token K scales [B, Hkv, n_kv] and V
  // scales [B, Hkv] or [B, Hkv, D] (v_per_tensor says which); strides in elements.
  const float* k_scale_in;
  int64_t ks_stride_b, ks_stride_h, ks_stride_n;
  const float* v_scale_in;
  int64_t vs_stride_b, vs_stride_h, vs_stride_c;
  // qk_channel_balance: [B, Hkv, D] max |Q_c| over the group's query heads (the Q channel
  // range pass, q_channel_range.cuh); null when the recipe does not balance.
  const float* q_amax;
  QuantizedKV out;
  // Packed variable-length batches (sage/varlen.h): int32 [batch + 1] offsets in device
  // memory, or null for a dense batch. Batch entry b is then sequence b, keys
  // cu_seqlens_k[b] .. cu_seqlens_k[b + 1] - 1 of the packed k and v (k_stride_b and
  // v_stride_b are 0); n_kv is max_seqlen_k and n_pad its whole tiles, so each sequence owns a
  // dense batch entry of the workspace and no K/V tile straddles two sequences. Every
  // statistic (K's mean, V's scales and mean, the balance's ranges) is the sequence's own
  // (sequence_params, kv_prepass.cu). Last, so that no field moves.
  const int* cu_seqlens_k;
};

}  // namespace sage::quant
