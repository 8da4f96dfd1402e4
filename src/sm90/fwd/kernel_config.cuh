// Everything one kernel instantiation fixes at compile time, in one type that the kernel's
// parts (producer, mainloop, epilogue) take as their template argument.
#pragma once

#include "sm90/fwd/k_scales.cuh"
#include "sm90/fwd/kernel_traits.h"
#include "sm90/fwd/mask.cuh"
#include "sm90/fwd/pv_operand.cuh"
#include "sm90/fwd/shared_storage.cuh"
#include "sm90/fwd/softmax.cuh"

namespace sage::sm90 {

// T: the output dtype (and the input dtype of fp16/bf16 Q). Path: the PV operand policy.
// KS: the K scale policy. SmoothQ: Q smoothing's per-tile dS work; a compile-time choice
// because as a run-time branch it slowed the recipes without it (v6-v7). WithQStage: the
// instantiation with the Q stage (q_stage.cuh), a second one because its code slowed the
// kernel where the stage is not used (v23). Both in docs/history/README.md. LeftWindow: the
// instantiation for launches with a left window bound (mask.cuh), whose items start past K/V
// tile 0 and mask their first tiles from below; a second one because in the kernel without it
// the run-time first tile and the second limit made ptxas spill (d = 64, and d = 128 with Q
// smoothing or per-token K scales), where every other launch keeps the code it had.
// Varlen: the instantiation for packed variable-length batches (seqlen.cuh, VarlenSeqLen):
// each item's lengths and offsets come from its sequence's cu_seqlens and items past their
// sequence's end exit at once; the dense kernels keep their code. No Q stage (its TMA map is
// over a dense [B, Hq, n_q, D] Q).
template <int D_, class T_, PVPath Path_, KScales KS_, bool SmoothQ_, bool WithQStage_,
          bool LeftWindow_ = false, bool Varlen_ = false>
struct KernelConfig {
  static constexpr int D = D_;
  using T = T_;
  static constexpr PVPath kPath = Path_;
  static constexpr KScales kKScales = KS_;
  static constexpr bool kSmoothQ = SmoothQ_;
  static constexpr bool kQStage = WithQStage_;
  static_assert(!kQStage || q_stage_capable(kPath, kSmoothQ, D), "no Q stage in this variant");
  static_assert(variant_has_kernel(D, kPath), "no kernel for this PV path at this head dim");
  static constexpr bool kLeftWindow = LeftWindow_;
  static_assert(!(kQStage && kLeftWindow), "the left-window instantiation has no Q stage");
  static constexpr bool kVarlen = Varlen_;
  static_assert(!(kQStage && kVarlen), "the packed-batch instantiation has no Q stage");

  static constexpr KernelTraits kTraits = kernel_traits(D, Variant{kPath, kKScales, kSmoothQ});
  static constexpr int kBlockQ = kTraits.block_q;
  static constexpr int kConsumers = kTraits.consumers;
  static constexpr int kThreads = kTraits.threads;
  static constexpr int kStages = kTraits.stages;
  static constexpr bool kOverlapPV = kTraits.overlap_pv;

  using PV = PVOperand<D, kPath>;
  using KScale = KScaleOperand<kKScales>;
  using Storage = SharedStorage<D, kStages, PV::kVBytes, kQStage, PV::kOnesRows>;
  static_assert(PV::kVBytes == kTraits.v_bytes && PV::kOnesRows == kTraits.v_ones_rows);
  // The device layout and the host's TMA maps (tma_maps.cu reads the traits) agree.
  static_assert(QKLayout<D>::kSpan == kTraits.k_swizzle_bytes &&
                QKLayout<D>::kRowBytes == kTraits.qk_row_bytes);
  // The opt-in maximum of dynamic shared memory per block on sm_90 (227 KiB), with the launch's
  // 1024 bytes of alignment slack.
  static_assert(sizeof(Storage) + 1024 <= 232448, "shared memory");
  // The packed-batch kernels also hold mask.cuh's static per-warp slots.
  static_assert(!Varlen_ || (sizeof(Storage) + 1024 + sizeof(varlen_mask_slot) <= 232448 &&
                             kThreads <= 32 * kMaxWarpsPerCta), "shared memory (packed batches)");

  // The integer row max (softmax.cuh, update_from_int) for per-tile K scales without Q
  // smoothing: the simulator follows rules::integer_row_max, which dispatch checks against this.
  static constexpr bool kIntegerMax = kKScales == KScales::per_tile && !kSmoothQ;
  // The row sum from the PV MMA's column of ones (RowSum::pv_mma) rather than the softmax's
  // FADD per score.
  static constexpr bool kRowSumInMma = PV::kOnesRows > 0;
  // P's scale in the exponent on the two-level E4M3 path (rules::p_scale_in_exponent), folded
  // into the offsets from head dim 128 (rules::p_scale_fold).
  static constexpr PScaleMode kPScaleMode = kPath != PVPath::e4m3_two_level ? PScaleMode::multiply
                                            : D >= rules::kPScaleFoldMinHeadDim ? PScaleMode::fold
                                                                                : PScaleMode::add;
};

// A consumer's place in the K/V ring: the stage it reads next and that stage's fill parity.
// Carried from tile to tile (and item to item) rather than derived from a tile count, which
// cost a division by the stage count and its fix-ups for each of the two stages a pipelined
// tile touches (SASS).
template <int Stages>
struct RingCursor {
  int stage = 0;
  uint32_t phase = 0;
  __device__ __forceinline__ void advance() {
    if (++stage == Stages) stage = 0, phase ^= 1;
  }
};

// A CTA's unit of work: one Q tile of one (batch, head), the one at a slot of the CTA's
// sequence (tile_scheduler.h says which CTA runs which, in what order).
struct WorkItem {
  int q_tile, h, b;
};
__device__ __forceinline__ WorkItem work_item(const AttentionParams& p, int slot) {
  const WorkItemRef item = item_at(p.work, slot);
  return {item.q_tile, item.hb % p.heads_q, item.hb / p.heads_q};
}

}  // namespace sage::sm90
