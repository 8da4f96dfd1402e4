// The attention kernel's parameter block, filled by the host dispatch (api/dispatch.cu).
// Strides are in elements; every pointer is device memory.
#pragma once

#include <cstdint>

#include "quant/kv_layout.h"
#include "sage/recipe.h"
#include "sm90/fwd/kernel_traits.h"
#include "sm90/fwd/tile_scheduler.h"

namespace sage::sm90 {

using quant::kKScalesPerTile;
using quant::QuantizedKV;

// The named barriers of the attention kernel's consumer warpgroups (barrier 0 is
// __syncthreads). Sixteen exist; three consumer warpgroups use seven.
struct NamedBarrier {
  static constexpr int q_stats = 1;  // Q statistics over the whole Q tile (all consumers)
  // Per consumer warpgroup cw of C: its Q tile stored; Q smoothing's key biases written.
  static constexpr int q_stored(int cw) { return 2 + cw; }
  static constexpr int key_bias(int cw, int consumers) { return 2 + consumers + cw; }
  static constexpr int q_stage = 15;  // the Q stage's three warps (q_stage.cuh)
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
  // Causal or a right window bound: items carry more K/V tiles along the diagonal, which the
  // scheduler orders by (tile_scheduler.h). The mask itself is window_left/right below.
  bool causal;
  bool smooth_k, smooth_v;
  bool smooth_q;           // subtract the Q tile's mean, add dS = mean(Q) K^T back per key
  bool quantized_row_sum;  // int8 P: the softmax denominator sums the quantized P
  // Prequantized Q (int8 codes in q) with per-token scales [B, Hq, n_q]; null otherwise.
  const float* q_scale;
  int64_t qs_stride_b, qs_stride_h, qs_stride_n;
  // Q goes through the Q stage (q_stage.cuh: a TMA load of the fp16/bf16 tile, quantized by
  // the producer warpgroup's idle warps one item ahead) for every item of a CTA but its first,
  // instead of the consumers' prologue; the launch takes the kernel instantiation that has it.
  // Set by the dispatch (tile_scheduler.h, use_q_stage); the codes and scales are the same bits.
  bool q_stage;
  QuantizedKV kv;
  // Which CTA runs which work items (Q tiles of a (batch, head)), in what order, and the grid
  // (tile_scheduler.h); set by the dispatch from work_schedule (tile_scheduler.h). Last, so that the
  // fields above keep their offsets' alignment: placed where two fields of 8 bytes were, its 20
  // bytes split 64-bit constant loads of later field pairs in two and moved ptxas's K/V loop
  // schedule (SASS).
  WorkSchedule work;
  // The keys each row sees (mask.cuh): Problem's normalized window, causal folded in as
  // window_right = 0; -1 unbounded. After the schedule, so that no earlier field moves.
  int window_left, window_right;
  // The caller's head dim: a multiple of 8, at most the kernel's D (tile.h, kernel_head_dim).
  // Q loads and output stores stop there; the workspace's channels past it are zeros.
  int head_dim;
  // Optional (training, SageBwd): L2 = m + log2(l / p_max) per row, the row's log-sum in the
  // base-2 domain of the smoothed, quantized scores (docs/numerics.md, "What the forward
  // saves"), dense [B, Hq, n_q]; -inf for a row without keys. Last, so no field moves.
  float* lse2;
  // Packed variable-length batches (sage/varlen.h; the kernel instantiation with kVarlen):
  // int32 [batch + 1] offsets in device memory, null for a dense batch. Batch entry b is then
  // sequence b: Q rows cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1 of the packed q and out
  // (q_stride_b, o_stride_b and lse_stride_b are 0), its keys the workspace's dense entry b
  // (the pre-pass's layout, n_pad from max_seqlen_k); n_q and n_kv are max_seqlen_q and
  // max_seqlen_k (seqlen.cuh, VarlenSeqLen). Last, so no field moves.
  const int* cu_seqlens_q;
  const int* cu_seqlens_k;
  // V's head dim (the caller's, a multiple of 8, at most D): output stores stop there. Equal
  // to head_dim unless V has a head dim of its own (MLA: Q/K 192, V 128). Last, so no field
  // moves.
  int head_dim_v;
};

}  // namespace sage::sm90
