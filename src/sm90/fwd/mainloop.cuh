// The consumer mainloop: one consumer warpgroup's pass over a work item's K/V tiles. It owns
// the ring cursor (carried over the CTA's items), the online-softmax state and the output
// accumulator, and runs the QK MMA, the logits, the softmax and the PV MMA of each tile.
//
// The tiles run as a software pipeline inside the warpgroup (FlashAttention-3's
// intra-warpgroup overlap): tile i's QK MMA and tile i-1's PV MMA are issued back to back,
// and tile i's softmax runs while the PV MMA does. Registers: O, the PV product, P of the
// running PV and the scores are live at once (208 for d = 128 and 8-bit P); the next P is
// packed only after the product is folded in, when both are dead. Variants where ptxas
// spills the pipeline (kernel_traits.h, overlap_pv) run one tile at a time.
#pragma once

#include "common/ptx.cuh"
#include "sm90/fwd/kernel_config.cuh"
#include "sm90/fwd/mask.cuh"
#include "sm90/fwd/q_operand.cuh"
#include "sm90/mma/wgmma_ops.cuh"

namespace sage::sm90 {

// A consumer thread's place in the CTA, and the work item as it sees it.
struct ConsumerItem {
  int cw, warp, lane, g, t;  // consumer warpgroup, warp in it, lane, its MMA row group and quad
  int h, b, hk, q0, wg_row0;
  int kv_begin, kv_end;  // the item's K/V tiles [kv_begin, kv_end) (Mask::kv_tiles)
  int rows[2];  // the thread's two Q rows
  int64_t kv_head;
};

template <class K>
struct Mainloop {
  static constexpr int D = K::D;
  using PV = typename K::PV;
  using Storage = typename K::Storage;
  static constexpr int kAcc = kBlockKV / 2;
  static_assert(PV::kSplits == 1 || !K::kOverlapPV, "a split PV MMA runs one tile at a time");

  RingCursor<K::kStages> ring;  // the next K/V tile's stage, over all of the CTA's items
  OnlineSoftmax<kBlockKV> softmax;
  float o[D / 2];
  int32_t sacc[kAcc];             // S of the tile whose softmax runs next
  typename PV::Fragments pa;      // P of the tile whose PV MMA runs next
  typename PV::Accumulator pv_acc;  // that PV MMA's product
  float alpha_pending[2];         // the output rescale that goes with that product
  // int8_dynamic (SageBwd): the V scale of the tile being computed and, per row, the factor
  // s_P * s_V its product folds in with (one tile at a time: no pending pair).
  static constexpr bool kDynamicP = K::kPath == PVPath::int8_dynamic;
  static_assert(!(kDynamicP && K::kOverlapPV), "int8_dynamic runs one tile at a time");
  static_assert(!kDynamicP || K::kIntegerMax, "the P peak comes from the integer row max");
  float v_tile_scale = 1.f;
  float pv_factor[2] = {0.f, 0.f};

  // What one item's tiles read.
  const AttentionParams& p;
  Storage& s;
  using ItemMask = MaskOf<K::kVarlen>;
  const ItemMask& mask;
  const ConsumerItem* item = nullptr;
  const float* k_scale = nullptr;  // the head's (KScaleOperand)
  float q_scale[2] = {0.f, 0.f};   // this thread's two Q rows' (QOperand::scale)
  uint32_t q_desc = 0, k_desc0 = 0, v_desc0 = 0;

  __device__ __forceinline__ Mainloop(const AttentionParams& p_, Storage& s_, const ItemMask& mask_)
      : p(p_), s(s_), mask(mask_) {}

  // The item's tiles into o and softmax. qbuf: the Q buffer this item's codes are in.
  __device__ __forceinline__ void run(const ConsumerItem& it_item, const QOperand<D>& qop, int qbuf) {
    item = &it_item;
    softmax = OnlineSoftmax<kBlockKV>();
#pragma unroll
    for (int i = 0; i < D / 2; ++i) o[i] = 0.f;
    k_scale = K::KScale::head(p.kv.k_scale, it_item.kv_head, p.n_pad);
    q_scale[0] = qop.scale[0], q_scale[1] = qop.scale[1];
    alpha_pending[0] = alpha_pending[1] = 1.f;
    // Descriptor low words of stage 0's K and V tiles; a stage's are a constant stride further.
    k_desc0 = smem_desc_lo(s.k[0]), v_desc0 = smem_desc_lo(s.v[0]);
    // This warpgroup's Q tile. The warpgroup index broadcast from lane 0 is known to be
    // warp-uniform, so the descriptor lives in uniform registers; from the thread index, the
    // compiler rebuilt it in ordinary ones and moved it across for every MMA (SASS).
    q_desc = smem_desc_lo(s.q[qbuf][0]) +
             uint32_t(__shfl_sync(0xffffffffu, it_item.cw, 0)) * (sizeof(s.q[0][0]) / 16);
    // Without a left window every item starts at tile 0: a constant first tile (as a run-time
    // index it made ptxas spill; kernel_config.cuh, kLeftWindow).
    const int begin = K::kLeftWindow ? it_item.kv_begin : 0;
    if constexpr (K::kOverlapPV) {
      run_pipelined(begin, it_item.kv_end);
    } else {
      run_one_tile_at_a_time(begin, it_item.kv_end);
    }
  }

 private:
  static constexpr uint32_t kKStageDesc = sizeof(Storage::k[0]) / 16;
  static constexpr uint32_t kVStageDesc = sizeof(Storage::v[0]) / 16;

  __device__ __forceinline__ void issue_qk(int stage) {
    const uint32_t k_desc = k_desc0 + stage * kKStageDesc;
    wgmma_fence();
    using L = QKLayout<D>;
    mma_s8_ss<kBlockKV, false>(sacc, L::template desc<64>(q_desc, 0), L::template desc<kBlockKV>(k_desc, 0));
#pragma unroll
    for (int kc = 1; kc < L::kChunks; ++kc)
      mma_s8_ss<kBlockKV, true>(sacc, L::template desc<64>(q_desc, kc), L::template desc<kBlockKV>(k_desc, kc));
    wgmma_commit();
  }
  __device__ __forceinline__ void issue_pv(int stage) {
    PV::issue(pv_acc, pa, v_desc0 + stage * kVStageDesc);
  }

  // Q smoothing: each thread computes one key's bias while the QK MMA runs.
  __device__ __forceinline__ void compute_key_bias(int it, int stage) {
    const int j = threadIdx.x % 128;
    const int cw = item->cw;
    s.key_bias[cw][it & 1][j] = smooth_q_key_bias<D>(s.k[stage], j, s.q_mean[cw],
                                                     K::KScale::key_scale(k_scale, it, j),
                                                     p.sm_scale_log2);
    named_barrier_sync(NamedBarrier::key_bias(cw, K::kConsumers), 128);
  }

  // Column range S of a split PV MMA (pv_operand.cuh, kSplits): issued, waited for and folded
  // into O before the next range reuses the accumulator; the row sum comes with the last.
  template <int S>
  __device__ __forceinline__ void split_pv(int stage, const float (&alpha)[2]) {
    PV::template issue<S>(pv_acc, pa, v_desc0 + stage * kVStageDesc);
    wgmma_wait<0>();
    PV::template fold<S>(o, pv_acc, pa, alpha);
    if constexpr (K::kRowSumInMma && S == PV::kSplits - 1) PV::fold_row_sum(softmax.l, pv_acc, alpha);
  }

  // The product of the tile whose PV MMA was waited for, into O (and l).
  __device__ __forceinline__ void fold_pv(const float (&alpha)[2]) {
    if constexpr (kDynamicP)
      PV::fold(o, pv_acc, pa, alpha, pv_factor);
    else
      PV::fold(o, pv_acc, pa, alpha);
    if constexpr (K::kRowSumInMma) PV::fold_row_sum(softmax.l, pv_acc, alpha);
  }

  // The tile's logits from its QK accumulator (K scales, Q smoothing's bias), masked -inf.
  __device__ __forceinline__ void make_scores(int it, float (&sc)[kAcc]) {
    K::KScale::scores(sacc, q_scale, p.sm_scale_log2, k_scale, it, item->t, sc);
    if constexpr (K::kSmoothQ) {
      const float* bias = s.key_bias[item->cw][it & 1];
#pragma unroll
      for (int i = 0; i < kAcc; ++i) sc[i] = __fadd_rn(sc[i], bias[frag::acc_col(i, item->t)]);
    }
    if (mask.template tile_needs_mask<K::kLeftWindow>(it, item->wg_row0))
      mask.template apply<K::kLeftWindow>(it, item->rows, item->t, sc);
  }

  // The tile's P~ * p_max (in sc), the rescale of earlier output and the row sums, from its
  // QK accumulator. Recipes with per-tile K scales and no Q smoothing skip the float logits:
  // the integer row max (softmax.cuh, update_from_int; the simulator follows
  // rules::integer_row_max, which dispatch checks against this choice).
  __device__ __forceinline__ void tile_to_p(int it, float (&sc)[kAcc], float (&alpha)[2],
                                            float (&p_sum)[2]) {
    if constexpr (K::kIntegerMax) {
      const float ks_tile = K::KScale::tile_scale(k_scale, it, item->t);
      const float mult = rules::score_multiplier(q_scale[0], ks_tile, p.sm_scale_log2);
      const bool masked = mask.template tile_needs_mask<K::kLeftWindow>(it, item->wg_row0);
      if (masked) mask.template apply<K::kLeftWindow>(it, item->rows, item->t, sacc);
      softmax.template update_from_int<K::kPScaleMode, !K::kRowSumInMma, kDynamicP>(
          sacc, mult, masked, p.p_max, p.p_fold_k, p.p_fold_mult_limit, sc, alpha, p_sum);
      if constexpr (kDynamicP)
        v_tile_scale = p.kv.v_block_scale[item->kv_head * (p.n_pad / kBlockKV) + it];
    } else {
      make_scores(it, sc);
      softmax.template update<!K::kRowSumInMma>(sc, p.p_max, alpha, p_sum);
    }
  }

  // P of the tile into the PV operand, and the tile's row sums into the softmax state.
  __device__ __forceinline__ void pack_p(const float (&sc)[kAcc], const float (&alpha)[2],
                                         const float (&p_sum)[2]) {
    int32_t code_sum[2] = {0, 0};
    if constexpr (kDynamicP) {
      // s_P = peak / 127 per row and tile (docs/numerics.md step 7), then s_P * s_V (step 9).
      float inv[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        // peak < 0: the row sees no key of the tile and adds nothing (the simulator does not
        // visit the tile for it): inverse and factor 0, not 0 times the tile's V scale, which
        // is NaN where V holds a non-finite value. (symmetric_inverse gives 0 for peak <= 0.)
        const float peak = softmax.peak[r];
        inv[r] = rules::symmetric_inverse(peak, float(rules::kInt8Max));
        pv_factor[r] = peak < 0.f ? 0.f
                                  : __fmul_rn(rules::symmetric_scale(peak, float(rules::kInt8Max)),
                                              v_tile_scale);
      }
      PV::pack(sc, pa, code_sum, inv);
    } else {
      PV::pack(sc, pa, code_sum);
    }
    if constexpr (!K::kRowSumInMma) {  // else fold_pv adds the MMA's row sum
      if (K::kPath == PVPath::int8 && p.quantized_row_sum) {
        // INT-FlashAttention: the denominator sums the quantized P (the codes, which are in
        // the row sum's units of P~ * p_max).
        // (p_sum - p_sum) is +0, or NaN where a non-finite input reached the row: the codes
        // of a NaN P are not NaN, so the float sum carries it into the denominator.
        const float q_sum[2] = {float(code_sum[0]) + (p_sum[0] - p_sum[0]),
                                float(code_sum[1]) + (p_sum[1] - p_sum[1])};
        softmax.add_row_sum(alpha, q_sum);
      } else {
        softmax.add_row_sum(alpha, p_sum);
      }
    }
  }

  __device__ __forceinline__ void release_stage(int stage) {
    if (item->lane == 0) mbar_arrive(&s.empty[stage]);
  }

  // QK, softmax, PV, one tile after the other. Tiles are numbered from the head's first key
  // (K scales, the mask), so a window's item starts past 0.
  __device__ __forceinline__ void run_one_tile_at_a_time(int begin, int end) {
    for (int it = begin; it < end; ++it, ring.advance()) {
      const int stage = ring.stage;
      mbar_wait(&s.full[stage], ring.phase);
      // Above d = 128 the bias goes before the QK MMA: beside its 64 accumulators and O's 128
      // the bias's registers spilled (ptxas).
      constexpr bool kBiasFirst = D > 128;
      if constexpr (K::kSmoothQ && kBiasFirst) compute_key_bias(it, stage);
      issue_qk(stage);
      if constexpr (K::kSmoothQ && !kBiasFirst) compute_key_bias(it, stage);
      wgmma_wait<0>();
      reg_fence(sacc);
      float sc[kAcc], alpha[2], p_sum[2];
      tile_to_p(it, sc, alpha, p_sum);
      pack_p(sc, alpha, p_sum);
      if constexpr (PV::kSplits == 1) {
        issue_pv(stage);
        wgmma_wait<0>();
        fold_pv(alpha);
      } else {
        static_assert(PV::kSplits == 2, "two column ranges");
        split_pv<0>(stage, alpha);
        split_pv<1>(stage, alpha);
      }
      release_stage(stage);
    }
  }

  __device__ __forceinline__ void run_pipelined(int begin, int end) {
    if (end <= begin) return;
    pipeline_first_tile(begin);
    for (int it = begin + 1; it < end; ++it) pipeline_tile(it);
    pipeline_drain();
  }

  // The item's first tile: QK and softmax; its PV MMA goes with the next tile's QK.
  __device__ __forceinline__ void pipeline_first_tile(int it) {
    mbar_wait(&s.full[ring.stage], ring.phase);
    issue_qk(ring.stage);
    if constexpr (K::kSmoothQ) compute_key_bias(it, ring.stage);
    wgmma_wait<0>();
    reg_fence(sacc);
    float sc[kAcc], p_sum[2];
    tile_to_p(it, sc, alpha_pending, p_sum);
    pack_p(sc, alpha_pending, p_sum);
  }

  __device__ __forceinline__ void pipeline_tile(int it) {
    const int prev = ring.stage;
    ring.advance();
    const int stage = ring.stage;
    mbar_wait(&s.full[stage], ring.phase);
    issue_qk(stage);  // commit group: S of tile it
    // Before the PV MMA owns its registers: with both in flight the bias spilled (ptxas).
    if constexpr (K::kSmoothQ) compute_key_bias(it, stage);
    issue_pv(prev);  // commit group: P V of tile it - 1
    wgmma_wait<1>();  // S is ready; the PV MMA may still run
    reg_fence(sacc);
    float sc[kAcc], alpha[2], p_sum[2];
    tile_to_p(it, sc, alpha, p_sum);
    wgmma_wait<0>();
    fold_pv(alpha_pending);
    release_stage(prev);  // tile it - 1's K and V are read
    pack_p(sc, alpha, p_sum);
    alpha_pending[0] = alpha[0], alpha_pending[1] = alpha[1];
  }

  // The last tile's PV MMA.
  __device__ __forceinline__ void pipeline_drain() {
    const int last = ring.stage;
    ring.advance();
    issue_pv(last);
    wgmma_wait<0>();
    fold_pv(alpha_pending);
    // The last stage goes back to the producer too: with chained items it refills it.
    release_stage(last);
  }
};

}  // namespace sage::sm90
