// The producer warpgroup: thread 0 streams each work item's quantized K/V tiles into the ring
// with TMA; in the Q-stage instantiation, warps 1-3 quantize the next item's Q tile
// (q_stage.cuh). The fourth warp's other lanes idle.
#pragma once

#include "common/ptx.cuh"
#include "sm90/fwd/kernel_config.cuh"
#include "sm90/fwd/mask.cuh"
#include "sm90/fwd/q_stage.cuh"
#include "sm90/fwd/seqlen.cuh"

namespace sage::sm90 {

template <class K>
struct Producer {
  using Storage = typename K::Storage;
  static constexpr int D = K::D;

  // The K/V tiles of all of the CTA's items through one ring, so that the next item's first
  // tiles load while the consumers run the last one's epilogue.
  __device__ __forceinline__ static void load_kv(const CUtensorMap* tma_k, const CUtensorMap* tma_v,
                                 const AttentionParams& p, Storage& s, CtaSlots mine, int group_size) {
    prefetch_tma_descriptor(tma_k);
    prefetch_tma_descriptor(tma_v);
    using L = QKLayout<D>;
    // The K tile's whole workspace rows (padding channels included: qk_layout.cuh), V's D rows.
    constexpr uint32_t kStageBytes = kBlockKV * (L::kRowBytes + K::PV::kVBytes * D);
    // A V tile row is kBlockKV * VBytes bytes: one 128-byte swizzle span per TMA box.
    constexpr int kVBoxes = K::PV::kVBytes;
    const SeqLenOf<K::kVarlen> seq{p};
    int fill = 0;  // K/V tiles put into the ring so far, over all items
    for (int w = mine.begin; w < mine.end; w += slot_step(p.work)) {
      const WorkItem item = work_item(p, w);
      const int hk = item.h / group_size;
      const int k_row0 = seq.k_row0(item.b, hk);
      const int v_row0 = seq.template v_row0<L::kRowBytes>(item.b, hk);
      MaskOf<K::kVarlen> mask(p);
      if constexpr (K::kVarlen) {
        // An item past its sequence's last Q row loads nothing (the consumers skip it too).
        const int n_q = seq.n_q(item.b);
        if (item.q_tile * K::kBlockQ >= n_q) continue;
        mask.template set_lengths<false>(n_q, seq.n_kv(item.b));
      }
      // Only the tiles the item's rows see: a window's others are never loaded.
      const KvTiles tiles = mask.template kv_tiles<K::kBlockQ, K::kLeftWindow>(item.q_tile * K::kBlockQ);
      for (int it = tiles.begin; it < tiles.end; ++it, ++fill) {
        const int stage = fill % K::kStages;
        mbar_wait(&s.empty[stage], ((fill / K::kStages) & 1) ^ 1);
        mbar_expect_tx(&s.full[stage], kStageBytes);
#pragma unroll
        for (int blk = 0; blk < L::kBlocks; ++blk)
          tma_load_2d(s.k[stage] + blk * kBlockKV * L::kSpan, tma_k, &s.full[stage], blk * L::kSpan,
                      k_row0 + it * kBlockKV);
#pragma unroll
        for (int box = 0; box < kVBoxes; ++box)
          tma_load_2d(s.v[stage] + box * D * 128, tma_v, &s.full[stage], (it * kVBoxes + box) * 128,
                      v_row0);
      }
    }
  }

  // Threads 32..127: item k's Q tile into buffer k % 2, once the consumers are done with item
  // k - 2 there. The next item's TMA load is issued as soon as this one's raw tile has been
  // read, so it lands while the consumers still run this item. The consumers quantize a CTA's
  // first item themselves: staged, it waited for a TMA round trip and 96 threads'
  // quantization with nothing else to do (v23, docs/history/README.md).
  __device__ __forceinline__ static void run_q_stage(const CUtensorMap* tma_q, const AttentionParams& p, Storage& s,
                                     CtaSlots mine, int group_size) {
    using Stage = QStage<D, typename K::T>;
    const int stage_thread = threadIdx.x - 32;
    if (stage_thread == 0) prefetch_tma_descriptor(tma_q);
    const int step = slot_step(p.work);
    int k = 1;
    for (int w = mine.begin + step; w < mine.end; w += step, ++k) {
      const WorkItem item = work_item(p, w);
      const int buf = k & 1;
      if (stage_thread == 0)
        Stage::load(tma_q, s.q_raw, &s.q_raw_full, item.q_tile * K::kBlockQ, item.h, item.b);
      // Suspending waits: the next buffer frees up only when the consumers finish an item, and
      // three warps re-issuing try_wait meanwhile would take issue slots from the consumers.
      mbar_wait_sleeping(&s.q_raw_full, (k - 1) & 1);
      if (k >= 2) mbar_wait_sleeping(&s.q_empty[buf], ((k >> 1) - 1) & 1);
      const float* balance = balance_of_head<D>(p, UniformSeqLen{p}.kv_head(item.b, item.h / group_size));
      Stage::quantize(smem_addr(s.q_raw), smem_addr(s.q[buf][0]), s.q_scale[buf],
                      p.q_granularity == Granularity::per_token, float(p.q_max), balance, stage_thread);
      // The codes are read by the MMA through the async proxy.
      fence_proxy_async();
      named_barrier_sync(NamedBarrier::q_stage, Stage::kThreads);
      if (stage_thread == 0) mbar_arrive(&s.q_full[buf]);
    }
  }

  __device__ __forceinline__ static void run(const CUtensorMap* tma_k, const CUtensorMap* tma_v,
                             const CUtensorMap* tma_q, const AttentionParams& p, Storage& s,
                             CtaSlots mine, int group_size) {
    setmaxnreg_dec<K::kTraits.producer_regs>();
    if (threadIdx.x == 0) {
      load_kv(tma_k, tma_v, p, s, mine, group_size);
    } else if (threadIdx.x >= 32) {
      if constexpr (K::kQStage) {
        if (p.q_stage) run_q_stage(tma_q, p, s, mine, group_size);
      }
    }
  }
};

}  // namespace sage::sm90
