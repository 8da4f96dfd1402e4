// The backward kernels' parameter block, filled by the host dispatch (api/backward.cu).
// Strides are in elements; every pointer is device memory. Dense workspace arrays are indexed
// by bh = batch * heads_q + head (query heads) or kvh = batch * heads_kv + kv head.
#pragma once

#include <cstdint>

namespace sage::sm90::bwd {

struct BackwardParams {
  // The caller's views (16-bit), [B, H, N, D] through their strides.
  const void* q;
  int64_t q_sb, q_sh, q_sn;
  const void* v;
  int64_t v_sb, v_sh, v_sn;
  const void* dout;
  int64_t do_sb, do_sh, do_sn;
  const void* out;  // the forward's O as stored (16-bit)
  int64_t o_sb, o_sh, o_sn;
  void* dq;
  int64_t dq_sb, dq_sh, dq_sn;
  void* dk;
  int64_t dk_sb, dk_sh, dk_sn;
  void* dv;
  int64_t dv_sb, dv_sh, dv_sn;
  // The forward's quantized K' (its workspace, quant::QuantizedKV): [kvh, n_pad, D] codes and
  // [kvh, n_pad / 128, 4] per-tile scales (per_block: the four slots equal).
  const int8_t* k8;
  const float* k_scale;
  // Written by the forward: L2 per row [bh, n_q].
  const float* lse2;
  // Written by the pre-pass (prep.cuh), every row array padded to n_q_pad rows per head so that
  // each 64-row tile is one TMA box or bulk copy:
  //   l2p, delta [bh, n_q_pad]: L2 (-inf past n_q) and D_i (0 past n_q);
  //   q8 [bh, n_q_pad, D]: Q codes, one scale per backward Q tile [bh, n_q_pad / 64] (its
  //   forward block's); q8t [bh, D, n_q_pad]: the same codes transposed, each 32-row slice's
  //   rows in kp_row order (kernel_traits.h);
  //   do8t [bh, D, n_q_pad]: dO codes, transposed and permuted alike, one scale per tile.
  float* l2p;
  float* delta;
  int8_t* q8;
  int8_t* q8t;
  float* q_scale;
  int8_t* do8t;
  float* do_scale;
  // fp32 accumulators, zeroed before the kernel: dQ unscaled [bh, n_q_pad / kBlockQ tiles,
  // kBlockQ * D], each tile in dq_fragment_index's order (kernel_traits.h); dK (times
  // sm_scale) and dV [kvh, n_kv, D], summed over the group's query heads.
  float* dq_acc;
  float* dk_acc;
  float* dv_acc;
  // Deterministic mode (order.cuh), else null: int32 turn counters zeroed with the accumulators,
  // dq_turn [bh, n_q_pad / kBlockQ] per Q tile, dkv_turn [kvh, n_pad / kBlockKV] per K/V tile.
  int* dq_turn;
  int* dkv_turn;
  int batch, heads_q, heads_kv, n_q, n_kv, n_pad, n_q_pad;
  int fwd_block_q;  // rows of one forward Q scale group (tile_config(D).block_q)
  bool causal;      // bottom-right
  bool deterministic;  // BackwardArgs::deterministic: the atomics in a fixed order (order.cuh)
  float sm_scale, sm_scale_log2;
};

}  // namespace sage::sm90::bwd
