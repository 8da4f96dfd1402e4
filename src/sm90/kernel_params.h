// Plain parameter blocks shared by the host launchers and the device kernels of the
// Hopper path. Strides are in elements; every pointer is device memory.
#pragma once

#include <cstdint>

#include "sage/quant_rules.h"
#include "sage/recipe.h"
#include "sage/tile.h"
#include "sm90/work_order.h"

namespace sage::sm90 {

// Tokens per K/V tile: the online-softmax block and the unit of the quantized K/V layout.
constexpr int kBlockKV = 128;
// Q rows per CTA (tile.h): one consumer warpgroup per 64 rows.
template <int D>
constexpr int kBlockQ = tile_config(D).block_q;
template <int D>
constexpr int kConsumerWarpgroups = consumer_warpgroups(D);
static_assert(tile_config(64).block_kv == kBlockKV && tile_config(128).block_kv == kBlockKV,
              "the pre-pass lays K/V out in kBlockKV tiles: tile.h must agree");
// The named barriers of the attention kernel's consumer warpgroups (barrier 0 is
// __syncthreads). Sixteen exist; three consumer warpgroups use eight.
struct NamedBarrier {
  static constexpr int q_stats = 1;  // Q statistics over the whole Q tile (all consumers)
  // Per consumer warpgroup cw of C: its Q tile stored; Q smoothing's key biases written;
  // "warpgroup cw may issue its MMAs" (pingpong, two consumers only).
  static constexpr int q_stored(int cw) { return 2 + cw; }
  static constexpr int key_bias(int cw, int consumers) { return 2 + consumers + cw; }
  static constexpr int mma_turn(int cw, int consumers) { return 2 + 2 * consumers + cw; }
  static constexpr int q_stage = 15;  // the Q stage's three warps (q_stage.cuh)
};
// Per-thread K scale groups per tile (tile.h); other granularities store one per tile.
constexpr int kKScalesPerTile = 4;
// The P V operand policies (pv_operand.cuh): which formats P and V take and how their
// products accumulate. One kernel instantiation per path.
enum class PVPath : int {
  e4m3_two_level,  // SageAttention2: E4M3 P and V, FP8 MMA inside a tile, fp32 across tiles
  e4m3_fp16x2,     // SageAttention2++: E4M3 P and V, f16 accumulator over two k32 MMAs
  fp16,            // SageAttention (T/B): fp16 P and V, f16 accumulator over a tile
  int8,            // SageAttention (vT/vB), INT-FlashAttention: INT8 P and V, s32 per tile
};
// Bytes per element of the transposed V tile each path streams.
constexpr int v_bytes(PVPath path) { return path == PVPath::fp16 ? 2 : 1; }
// Rows of E4M3 ones under each V stage (RowSum::pv_mma: the PV MMA's extra n8 block sums P),
// where the kernel takes the row sum from the PV MMA: the two-level E4M3 path from head dim
// rules::kRowSumMmaMinHeadDim (the dispatch holds recipes to rules::row_sum_in_pv_mma).
constexpr int v_ones_rows(int head_dim, PVPath path) {
  return path == PVPath::e4m3_two_level && head_dim >= rules::kRowSumMmaMinHeadDim ? 8 : 0;
}
// Whether a kernel variant has a second instantiation with the Q stage (q_stage.cuh): the
// SageAttention2 default path without Q smoothing (whose tile mean and dS the consumers
// compute). Only there, to keep the instantiations and compile time in check; the other
// variants always quantize Q in the consumers' prologue.
constexpr bool q_stage_capable(PVPath path, bool smooth_q) {
  return path == PVPath::e4m3_two_level && !smooth_q;
}

// How the K scales are stored: a few groups per 128-token tile (per_thread / per_block /
// per_tensor, kKScalesPerTile slots) or one per token (per_token, prequantized inputs).
enum class KScales : int { per_tile, per_token };

// What the pre-pass writes and the attention kernel reads, per (batch, kv head).
struct QuantizedKV {
  int8_t* k;         // [B, Hkv, n_pad, D] int8 (or int4 values), smoothed, row-major
  uint8_t* vt;       // [B, Hkv, D, n_pad] transposed V: 8-bit codes with the tokens permuted
                     // per 32 (quant::pv_position_of_token), or fp16 in token order
  float* k_scale;    // per_tile: [B, Hkv, n_pad / kBlockKV, kKScalesPerTile]
                     // per_token: [B, Hkv, n_pad]
  float* k_mean;     // [B, Hkv, D]  (zeros when K is not smoothed)
  float* v_scale;    // [B, Hkv, D]  max|V'_c| / v_max (1 for fp16 V)
  float* v_mean;     // [B, Hkv, D]  (zeros when V is not smoothed)
  // Written by the statistics pass for the quantize pass only:
  float* v_inv;      // [B, Hkv, D]  v_max / max|V'_c| (the multiplier before encoding)
  float* k_amax;     // [B, Hkv]     max over channels of max|K'_c| (per-tensor K scales)
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
  int k_mean_stride;  // K's statistics over keys 0, stride, ... (recipe.k_mean_stride)
  // Set by launch_kv_prepass: the keys the stride samples, and the statistics CTAs (of each
  // head's cluster) that read them.
  int k_mean_samples, stats_k_ctas;
  PVPath pv_path;  // decides V's format in the workspace
  bool v_per_tensor;  // one V scale for all channels (INT-FlashAttention)
  float v_max;  // the format value max|V'_c| maps to (448 e4m3, 127 int8, or recipe.v_range)
  // Prequantized inputs (k and v are int8 codes): per-token K scales [B, Hkv, n_kv] and V
  // scales [B, Hkv] or [B, Hkv, D] (v_per_tensor says which); strides in elements.
  const float* k_scale_in;
  int64_t ks_stride_b, ks_stride_h, ks_stride_n;
  const float* v_scale_in;
  int64_t vs_stride_b, vs_stride_h, vs_stride_c;
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
  float p_max;  // P~ is scaled by this before its conversion (448, 127, 1 for fp16, or p_range)
  // P's scale in the integer row max's exponent: rules::p_scale_fold(p_max).
  float p_fold_k, p_fold_mult_limit;
  Granularity q_granularity;
  int q_max;  // the largest Q code: 127 (int8) or 7 (int4 values)
  bool causal, smooth_k, smooth_v;
  bool smooth_q;           // subtract the Q tile's mean, add dS = mean(Q) K^T back per key
  bool quantized_row_sum;  // int8 P: the softmax denominator sums the quantized P
  // Prequantized Q (int8 codes in q) with per-token scales [B, Hq, n_q]; null otherwise.
  const float* q_scale;
  int64_t qs_stride_b, qs_stride_h, qs_stride_n;
  // Q goes through the Q stage (q_stage.cuh: a TMA load of the fp16/bf16 tile, quantized by
  // the producer warpgroup's idle warps one item ahead) for every item of a CTA but its first,
  // instead of the consumers' prologue; the launch takes the kernel instantiation that has it.
  // Set by the dispatch (schedule.h, use_q_stage); the codes and scales are the same bits.
  bool q_stage;
  QuantizedKV kv;
  // Which CTA runs which work items (Q tiles of a (batch, head)), in what order, and the grid
  // (work_order.h); set by the dispatch from work_schedule (schedule.h). Last, so that the
  // fields above keep their offsets' alignment: placed where two fields of 8 bytes were, its 20
  // bytes split 64-bit constant loads of later field pairs in two and moved ptxas's K/V loop
  // schedule (SASS).
  WorkSchedule work;
};

}  // namespace sage::sm90
