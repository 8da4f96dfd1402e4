// The sm_90a attention kernel: INT8 Q K^T on warpgroup MMAs, then the P V product of one of
// the PV operand policies (pv_operand.cuh): E4M3 two-level (SageAttention2, the default), E4M3
// with f16 pair accumulation (SageAttention2++), fp16 (SageAttention T/B) or INT8
// (SageAttention vT/vB, INT-FlashAttention).
//
// Warp specialization: warpgroup 0 is the producer (one thread issues TMA loads of the
// quantized K tile and the transposed V tile into a ring of shared-memory stages, released
// through mbarriers; in the Q-stage instantiation its other three warps quantize Q tiles one
// item ahead, q_stage.cuh); warpgroups 1.. are consumers, 64 Q rows each (two at d = 128,
// three at d = 64: tile.h). Register budgets are moved from the producer to the consumers with
// setmaxnreg. A CTA runs one or more work items (Q tiles of a batch and head) one after the
// other.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common/vec_io.cuh"
#include "sage/quant_rules.h"
#include "sm90/epilogue.cuh"
#include "sm90/fragment.cuh"
#include "sm90/kernel_params.h"
#include "sm90/ptx.cuh"
#include "sm90/pv_operand.cuh"
#include "sm90/q_operand.cuh"
#include "sm90/q_stage.cuh"
#include "sm90/softmax.cuh"
#include "sm90/trace.cuh"
#include "sm90/work_order.h"
#include "sm90/wgmma_ops.cuh"

namespace sage::sm90 {

// Build-time knobs for experiments (docs/performance.md), e.g.
// -DCMAKE_CUDA_FLAGS="-DSAGE_SM90_STAGES=2"; the defaults are what was measured.
#ifndef SAGE_SM90_SETMAXNREG
#define SAGE_SM90_SETMAXNREG 1
#endif
#ifndef SAGE_SM90_STAGES
// 3: the pipelined consumers hold two stages (tile i's K, tile i-1's V), so the producer runs
// one K/V tile ahead of them.
#define SAGE_SM90_STAGES 3
#endif
#ifndef SAGE_SM90_OVERLAP_PV
#define SAGE_SM90_OVERLAP_PV 1  // the intra-warpgroup pipeline (0: one tile at a time)
#endif
#ifndef SAGE_SM90_PRODUCER_SLEEP
// 1: the producer's wait on a full ring asks to be suspended (try_wait with a time hint)
// instead of re-issuing try_wait; 0 (default): spin, measured ~1% faster at d = 128
// (H100, same-run A/B, docs/performance.md v9).
#define SAGE_SM90_PRODUCER_SLEEP 0
#endif
#ifndef SAGE_SM90_KSCALE_AHEAD
// 1: a per-tile K group scale is loaded into a register one tile before its use; 0
// (default): where it is used, with the head's scales prefetched into L2 (next knob). Measured
// (H100, same-run A/B, docs/performance.md v9 knobs): 0 with the prefetch is faster at every
// point (d = 128 16K: 745 vs 734 TOPS kernel-only).
#define SAGE_SM90_KSCALE_AHEAD 0
#endif
#ifndef SAGE_SM90_L2_PREFETCH
// 1 (default): the head's K scales and V scales/means are prefetched into L2 in the prologue.
#define SAGE_SM90_L2_PREFETCH 1
#endif
#ifndef SAGE_SM90_PINGPONG
// off: measured slower three times (H200: v8b 686 vs 738 TOPS at d = 128, N = 16K; v17
// -3% / -1% / +0.6% kernel only at d = 128, N = 1K / 4K / 16K and -8% to -10% at d = 64).
#define SAGE_SM90_PINGPONG 0
#endif
constexpr int kStages = SAGE_SM90_STAGES;
constexpr bool kReallocateRegisters = SAGE_SM90_SETMAXNREG;
constexpr int kProducerRegs = 24;

// The CTA of head dim D: the producer warpgroup and kConsumers consumer warpgroups.
// Registers move from the producer (one thread issuing TMA) to the consumers; without it the
// consumer path spills at the launch cap (168 registers over 384 threads). The budgets stay
// within the CTA's launch allocation, 168 x 384 >= 24 x 128 + 240 x 256 and 128 x 512 >= 24 x
// 128 + 160 x 384: setmaxnreg only moves registers within it, and an increase past it never
// returns (a 32-register producer beside 240-register consumers hung the GPU tests, v14 in
// docs/performance.md).
template <int D>
struct CtaShape {
  static constexpr int kConsumers = kConsumerWarpgroups<D>;
  static constexpr int kThreads = 128 * (1 + kConsumers);
  static constexpr int kLaunchRegs = 65536 / kThreads / 8 * 8;
  // All that is left to the consumers: 240 at d = 128, 160 at d = 64.
  static constexpr int kConsumerRegs =
      (kLaunchRegs * kThreads - kProducerRegs * 128) / (128 * kConsumers) / 8 * 8;
  static_assert(kProducerRegs * 128 + kConsumerRegs * 128 * kConsumers <= kLaunchRegs * kThreads,
                "setmaxnreg budgets exceed the CTA's launch allocation: setmaxnreg.inc would hang");
  static_assert(NamedBarrier::mma_turn(kConsumers - 1, kConsumers) < 16, "16 named barriers");
};

// QStage: the variant has the Q stage (q_stage.cuh), which needs two Q buffers (the stage
// fills one while the consumers read the other) and the raw tile.
// VOnesRows: v_ones_rows, written once per launch below each stage's V tile.
template <int D, int VBytes, bool QStage, int VOnesRows>
struct SharedStorage {
  static constexpr int kConsumers = kConsumerWarpgroups<D>;
  static constexpr int kQBuffers = QStage ? 2 : 1;
  // Quantized Q tiles, one per consumer warpgroup (per buffer).
  alignas(1024) int8_t q[kQBuffers][kConsumers][64 * D];
  alignas(1024) int8_t k[kStages][kBlockKV * D];
  alignas(1024) uint8_t v[kStages][(D + VOnesRows) * kBlockKV * VBytes];
  alignas(1024) uint8_t q_raw[QStage ? kBlockQ<D> * D * 2 : 16];  // the stage's fp16/bf16 tile
  alignas(8) uint64_t full[kStages];
  alignas(8) uint64_t empty[kStages];
  // The Q stage: raw tile landed; buffer i quantized (stage -> consumers); buffer i read
  // and its epilogue staging done (consumers -> stage).
  alignas(8) uint64_t q_raw_full;
  uint64_t q_full[2];
  uint64_t q_empty[2];
  float q_scale[2][QStage ? kBlockQ<D> : 1];  // per row of the tile, per buffer
  float reduce[4 * kConsumers];
  double q_sum[4 * kConsumers][D];  // Q smoothing: column sums per consumer warp
  float q_mean[kConsumers][D];      // Q smoothing: the tile mean, one copy per warpgroup
  float key_bias[kConsumers][2][kBlockKV];  // Q smoothing: dS per key, [warpgroup][tile parity]
};

// How many K/V tiles the Q tile starting at q0 needs (bottom-right causal alignment:
// row i sees keys j <= i + n_kv - n_q).
template <int D>
__device__ __forceinline__ int kv_tiles_for(const AttentionParams& p, int q0) {
  const int all = (p.n_kv + kBlockKV - 1) / kBlockKV;
  if (!p.causal) return all;
  const int last_row = min(q0 + kBlockQ<D>, p.n_q) - 1;
  const int last_key = last_row + p.n_kv - p.n_q;
  if (last_key < 0) return 0;
  return min(all, last_key / kBlockKV + 1);
}

// A consumer's place in the K/V ring: the stage it reads next and that stage's fill parity.
// Carried from tile to tile (and item to item) rather than derived from a tile count, which
// cost a division by kStages and its fix-ups for each of the two stages a pipelined tile
// touches (SASS).
struct RingCursor {
  int stage = 0;
  uint32_t phase = 0;
  __device__ __forceinline__ void advance() {
    if (++stage == kStages) stage = 0, phase ^= 1;
  }
};

// A CTA's unit of work: one Q tile of one (batch, head), the one at a slot of the CTA's
// sequence (work_order.h says which CTA runs which, in what order).
struct WorkItem {
  int q_tile, h, b;
};
__device__ __forceinline__ WorkItem work_item(const AttentionParams& p, int slot) {
  const WorkItemRef item = item_at(p.work, slot);
  return {item.q_tile, item.hb % p.heads_q, item.hb / p.heads_q};
}

// T: the output dtype (and the input dtype of fp16/bf16 Q). Path: the PV operand policy.
// KS: how the K scales are laid out (per tile groups or per token). SmoothQ: Q smoothing's
// per-tile dS work; a compile-time choice because as a run-time branch it cost the recipes
// without it ~5% at N = 16K (H100 A/B, 2026-11-22). WithQStage: the instantiation with the Q
// stage (q_stage.cuh), a second one because its code cost the kernel without it 1-4%
// (bench/results/h200_v23_ab_2026-11-24.md).
template <int D, class T, PVPath Path, KScales KS, bool SmoothQ, bool WithQStage>
__global__ void __launch_bounds__(CtaShape<D>::kThreads, 1)
    attention_kernel(const __grid_constant__ CUtensorMap tma_k,
                     const __grid_constant__ CUtensorMap tma_v,
                     const __grid_constant__ CUtensorMap tma_q, const AttentionParams p) {
  using PV = PVOperand<D, Path>;
  using Cta = CtaShape<D>;
  constexpr int kBlockQ = sage::sm90::kBlockQ<D>;
  constexpr bool kQStage = WithQStage;
  static_assert(!kQStage || q_stage_capable(Path, SmoothQ), "no Q stage in this variant");
  using Stage = QStage<D, T>;
  // The software pipeline below, except in the variants where ptxas (CUDA 13.0) spilled it
  // heavily (scripts/ptxas_report.sh): at d = 128 (240 registers) INT8 PV (sage1_vt/vb,
  // int_flash) and f16-pair PV (sage2pp_*), by 16 to 272 bytes depending on the softmax's
  // exact code; at d = 64 (160 registers) Q smoothing and per-token K scales, by 244 to 524
  // bytes (the rest spill 76-92 bytes there). They run one tile at a time.
  constexpr bool kOverlapPV =
      SAGE_SM90_OVERLAP_PV && (D == 64 ? KS == KScales::per_tile && !SmoothQ
                                       : Path == PVPath::e4m3_two_level || Path == PVPath::fp16);
  extern __shared__ uint8_t smem_raw[];
  auto& s = *reinterpret_cast<SharedStorage<D, PV::kVBytes, kQStage, PV::kOnesRows>*>(
      (reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));

  // The CTA's items (sm90/schedule.cu), in work_order.h's order: the producer streams the K/V
  // tiles of all of them through one ring, so the next item's first tiles are loaded while the
  // consumers run the last one's epilogue, and the next item's Q rows are prefetched into L2
  // (below); no CTA exit and launch between items. All consumer warpgroups work on the same
  // item, within a stage or two of each other.
  const CtaSlots mine = cta_slots(p.work, blockIdx.x);
  const int warpgroup = threadIdx.x / 128;
  const int group_size = p.heads_q / p.heads_kv;

  if (threadIdx.x == 0) {
    for (int i = 0; i < kStages; ++i) {
      mbar_init(&s.full[i], 1);
      mbar_init(&s.empty[i], 4 * Cta::kConsumers);  // one arrival per consumer warp
    }
    mbar_init(&s.q_raw_full, 1);
    for (int i = 0; i < 2; ++i) {
      mbar_init(&s.q_full[i], 1);
      mbar_init(&s.q_empty[i], 4 * Cta::kConsumers);
    }
    fence_barrier_init();
  }
  if constexpr (PV::kOnesRows > 0) {
    // The row sum's V channel of ones (RowSum::pv_mma): E4M3 1.0 (0x38) in every byte of the
    // rows below each stage's V tile, which the TMA loads never write. The PV MMA reads them
    // through the async proxy.
    constexpr int kWords = PV::kOnesRows * kBlockKV / 4;
    for (int i = threadIdx.x; i < kStages * kWords; i += blockDim.x)
      reinterpret_cast<uint32_t*>(s.v[i / kWords] + D * kBlockKV)[i % kWords] = 0x38383838u;
    fence_proxy_async();
  }
  __syncthreads();

  // The Q stage (q_stage.cuh), threads 32..127 of the producer warpgroup: item k's tile into
  // buffer k % 2, once the consumers are done with item k - 2 there. The next item's TMA
  // load is issued as soon as this one's raw tile has been read, so it lands while the
  // consumers still run this item. The consumers quantize a CTA's first item themselves:
  // staged, it waited for a TMA round trip and 96 threads' quantization with nothing else to
  // do (-2% to -7% kernel where CTAs run one or two items, h200_v23_ab_2026-11-24.md).
  auto run_q_stage = [&] {
    const int stage_thread = threadIdx.x - 32;
    trace::Recorder trace_event(4, stage_thread == 0);
    if (stage_thread == 0) prefetch_tma_descriptor(&tma_q);
    const int step = slot_step(p.work);
    int k = 1;
    for (int w = mine.begin + step; w < mine.end; w += step, ++k) {
      const WorkItem item = work_item(p, w);
      const int buf = k & 1;
      if (stage_thread == 0) Stage::load(&tma_q, s.q_raw, &s.q_raw_full, item.q_tile * kBlockQ, item.h, item.b);
      // Suspending waits: the next buffer frees up only when the consumers finish an item, and
      // three warps re-issuing try_wait meanwhile would take issue slots from the consumers.
      mbar_wait_sleeping(&s.q_raw_full, (k - 1) & 1);
      if (k >= 2) mbar_wait_sleeping(&s.q_empty[buf], ((k >> 1) - 1) & 1);
      trace_event(trace::stage_begin);
      Stage::quantize(smem_addr(s.q_raw), smem_addr(s.q[buf][0]), s.q_scale[buf],
                      p.q_granularity == Granularity::per_token, float(p.q_max), stage_thread);
      // The codes are read by the MMA through the async proxy.
      fence_proxy_async();
      named_barrier_sync(NamedBarrier::q_stage, Stage::kThreads);
      if (stage_thread == 0) mbar_arrive(&s.q_full[buf]);
      trace_event(trace::stage_end);
    }
  };

  if (warpgroup == 0) {
    // ---- producer ------------------------------------------------------------------------
    if constexpr (kReallocateRegisters) setmaxnreg_dec<kProducerRegs>();
    if (threadIdx.x == 0) {
      trace::Recorder trace_event(0, true);
      prefetch_tma_descriptor(&tma_k);
      prefetch_tma_descriptor(&tma_v);
      constexpr uint32_t kStageBytes = (1 + PV::kVBytes) * kBlockKV * D;
      // A V tile row is kBlockKV * VBytes bytes: one 128-byte swizzle span per TMA box.
      constexpr int kVBoxes = PV::kVBytes;
      int fill = 0;  // K/V tiles put into the ring so far, over all items
      for (int w = mine.begin; w < mine.end; w += slot_step(p.work)) {
        const WorkItem item = work_item(p, w);
        const int hk = item.h / group_size;
        const int k_row0 = (item.b * p.heads_kv + hk) * p.n_pad;
        const int v_row0 = (item.b * p.heads_kv + hk) * D;
        const int n_tiles = kv_tiles_for<D>(p, item.q_tile * kBlockQ);
        for (int it = 0; it < n_tiles; ++it, ++fill) {
          const int stage = fill % kStages;
          if constexpr (SAGE_SM90_PRODUCER_SLEEP)
            mbar_wait_sleeping(&s.empty[stage], ((fill / kStages) & 1) ^ 1);
          else
            mbar_wait(&s.empty[stage], ((fill / kStages) & 1) ^ 1);
          mbar_expect_tx(&s.full[stage], kStageBytes);
          tma_load_2d(s.k[stage], &tma_k, &s.full[stage], 0, k_row0 + it * kBlockKV);
#pragma unroll
          for (int box = 0; box < kVBoxes; ++box)
            tma_load_2d(s.v[stage] + box * D * 128, &tma_v, &s.full[stage],
                        (it * kVBoxes + box) * 128, v_row0);
          trace_event(trace::kv_issued);
        }
      }
    } else if (threadIdx.x >= 32) {
      if constexpr (kQStage) {
        if (p.q_stage) run_q_stage();
      }
    }
    return;
  }

  // ---- consumers -------------------------------------------------------------------------
  if constexpr (kReallocateRegisters) setmaxnreg_inc<Cta::kConsumerRegs>();
  const int causal_offset = p.n_kv - p.n_q;
  // Prequantized Q is int8: the pointer arithmetic is in elements of whichever type q is.
  auto q_head_of = [&](const WorkItem& item) {
    const int64_t q_offset = item.b * p.q_stride_b + item.h * p.q_stride_h;
    return p.q_scale ? reinterpret_cast<const T*>(static_cast<const int8_t*>(p.q) + q_offset)
                     : static_cast<const T*>(p.q) + q_offset;
  };
  // s.reduce and s.q_sum (per-block Q scales, Q smoothing) are shared by all warpgroups: one
  // that finished an item must not overwrite them before the other has read the last item's.
  const bool q_stats_shared = p.smooth_q || p.q_granularity == Granularity::per_block;
  RingCursor ring;  // the next K/V tile's stage, over all of this CTA's items
  // Descriptor low words of stage 0's K and V tiles; a stage's are a constant stride further.
  const uint32_t k_desc0 = smem_desc_lo(s.k[0]), v_desc0 = smem_desc_lo(s.v[0]);
  constexpr uint32_t kKStageDesc = sizeof(s.k[0]) / 16, kVStageDesc = sizeof(s.v[0]) / 16;
  const bool q_staged = kQStage && p.q_stage;  // items after the first come from the stage
  int item_index = 0;  // of this CTA's items: the Q buffer and the stage's barrier phases
  trace::Recorder trace_event(warpgroup, threadIdx.x % 128 == 0);
  for (int w = mine.begin; w < mine.end; w += slot_step(p.work), ++item_index) {
    // The thread's coordinates, recomputed per item from an opaque copy of its index: left
    // loop-invariant, the compiler hoisted everything the prologue and epilogue derive from
    // them (Q and output addresses, swizzled offsets) out of the item loop, where they stayed
    // live through the K/V loop and spilled it (ptxas, d = 128: 72 bytes).
    int tid = threadIdx.x;
    reg_fence(tid);
    const int cw = tid / 128 - 1;        // consumer warpgroup 0 .. kConsumers - 1
    const int warp = (tid / 32) % 4;     // warp inside the warpgroup
    const int lane = tid % 32;
    const int g = frag::group_of_lane(lane), t = frag::quad_of_lane(lane);
    trace_event(trace::item_begin);
    const WorkItem item = work_item(p, w);
    const int h = item.h, b = item.b, hk = h / group_size;
    const int q0 = item.q_tile * kBlockQ;
    const int n_tiles = kv_tiles_for<D>(p, q0);
    const int wg_row0 = q0 + 64 * cw;
    const int rows[2] = {wg_row0 + 16 * warp + g, wg_row0 + 16 * warp + g + 8};
    const int64_t kv_head = (int64_t)b * p.heads_kv + hk;
    if (w > mine.begin && q_stats_shared)
      named_barrier_sync(NamedBarrier::q_stats, 128 * Cta::kConsumers);

    const T* q_head = q_head_of(item);
    const float* q_scale_head = p.q_scale ? p.q_scale + b * p.qs_stride_b + h * p.qs_stride_h : nullptr;
    // The head's K scales and V scales/means are a few KiB that the quantize pass wrote long
    // before (its K/V output has evicted them from L2): every 128-byte line of K scales cost
    // the CTA a DRAM round trip inside its loop (ncu stall samples). Ask for all of them now,
    // under the Q load. Measured (H100, same-run A/B, with SAGE_SM90_KSCALE_AHEAD=0): +2-4%
    // kernel-only at d = 64 16K and at d = 128.
    if constexpr (SAGE_SM90_L2_PREFETCH) {
      const int64_t k_scale_bytes =
          int64_t(KS == KScales::per_token ? p.n_pad : (p.n_pad / kBlockKV) * kKScalesPerTile) * 4;
      const char* k_scale_head =
          reinterpret_cast<const char*>(p.kv.k_scale) + kv_head * k_scale_bytes;
      const int consumer_thread = threadIdx.x - 128;
      for (int64_t line = consumer_thread; line * 128 < k_scale_bytes; line += 128 * Cta::kConsumers)
        prefetch_l2(k_scale_head + line * 128);
      if (consumer_thread < D / 32) prefetch_l2(p.kv.v_scale + kv_head * D + 32 * consumer_thread);
      else if (p.smooth_v && consumer_thread < D / 16)
        prefetch_l2(p.kv.v_mean + kv_head * D + 32 * (consumer_thread - D / 32));
    }
    QOperand<D> qop;
    const bool want_lse = p.lse != nullptr;
    const int qbuf = kQStage ? item_index & 1 : 0;
    if (q_staged && item_index > 0) {
      // Not with the LSE under K smoothing (the dispatch's rule): q . mean(K) needs raw Q.
      // Buffer 1 is filled for items 1, 3, ..., buffer 0 for items 2, 4, ...
      mbar_wait(&s.q_full[qbuf], ((item_index - 1) >> 1) & 1);
      const int tile_row = 64 * cw + 16 * warp + g;
      qop.scale[0] = s.q_scale[qbuf][tile_row];
      qop.scale[1] = s.q_scale[qbuf][tile_row + 8];
      qop.dot_kmean[0] = qop.dot_kmean[1] = 0.f;
    } else {
      qop.load(p, q_head, q_scale_head, p.kv.k_mean + kv_head * D, rows, min(kBlockQ, p.n_q - q0),
               lane, 4 * cw + warp, s.reduce, &s.q_sum[0][0], s.q_mean[cw], s.q[qbuf][cw],
               want_lse && p.smooth_k);
    }
    trace_event(trace::q_ready);
    // The next item's Q rows into L2 (one 128-byte line per consumer thread, 2 per row at most),
    // so that its load in the next prologue does not wait for DRAM.
    if (const int w_next = w + slot_step(p.work); !q_staged && w_next < mine.end) {
      const WorkItem next = work_item(p, w_next);
      const int row = next.q_tile * kBlockQ + (threadIdx.x - 128) % kBlockQ;
      const int line = (threadIdx.x - 128) / kBlockQ;
      const int elem_bytes = p.q_scale ? 1 : int(sizeof(T));
      if (row < p.n_q && line * 128 < D * elem_bytes)
        prefetch_l2(reinterpret_cast<const char*>(q_head_of(next)) +
                    ((int64_t)row * p.q_stride_n) * elem_bytes + line * 128);
    }

    OnlineSoftmax<kBlockKV> softmax;
    float o[D / 2];
#pragma unroll
    for (int i = 0; i < D / 2; ++i) o[i] = 0.f;

    // per_tile: this thread's columns all fall in K group t of a tile (tile.h); per_token: one
    // scale per column.
    const float* k_scale = KS == KScales::per_token
                               ? p.kv.k_scale + kv_head * p.n_pad
                               : p.kv.k_scale + kv_head * (p.n_pad / kBlockKV) * kKScalesPerTile;
    // Per-tile K group scales loaded one tile ahead of their use (SAGE_SM90_KSCALE_AHEAD): read
    // where needed, each tile's first score waited for the load (ncu stall samples, H100,
    // d = 128, N = 1K). Not with Q smoothing, where the extra loop-carried register spilled
    // (ptxas, d = 128): there make_scores loads its own.
    constexpr bool kPrefetchKScale = SAGE_SM90_KSCALE_AHEAD && KS == KScales::per_tile && !SmoothQ;
    auto load_k_scale = [&](int it) {
      return kPrefetchKScale && it < n_tiles ? k_scale[it * kKScalesPerTile + t] : 0.f;
    };
    float ks_next = load_k_scale(0);
    int32_t sacc[kBlockKV / 2];            // S of the tile whose softmax runs next
    typename PV::Fragments pa;             // P of the tile whose PV MMA runs next
    typename PV::Accumulator pv_acc;       // that PV MMA's product
    float alpha_pending[2] = {1.f, 1.f};   // the output rescale that goes with that product

    // This warpgroup's Q tile. The warpgroup index broadcast from lane 0 is known to be
    // warp-uniform, so the descriptor lives in uniform registers; from the thread index, the
    // compiler rebuilt it in ordinary ones and moved it across for every MMA (SASS).
    const uint32_t q_desc = smem_desc_lo(s.q[qbuf][0]) +
                            uint32_t(__shfl_sync(0xffffffffu, cw, 0)) * (sizeof(s.q[0][0]) / 16);
    auto issue_qk = [&](int stage) {
      const uint32_t k_desc = k_desc0 + stage * kKStageDesc;
      wgmma_fence();
      mma_s8_ss<kBlockKV, false>(sacc, smem_desc<D>(q_desc), smem_desc<D>(k_desc));
#pragma unroll
      for (int kc = 1; kc < D / 32; ++kc)
        mma_s8_ss<kBlockKV, true>(sacc, smem_desc<D>(q_desc, 32 * kc),
                                  smem_desc<D>(k_desc, 32 * kc));
      wgmma_commit();
    };
    auto issue_pv = [&](int stage) { PV::issue(pv_acc, pa, v_desc0 + stage * kVStageDesc); };
    // Q smoothing: each thread computes one key's bias while the QK MMA runs.
    auto compute_key_bias = [&](int it, int stage) {
      const int j = threadIdx.x % 128;
      const float kj_scale = KS == KScales::per_token
                                 ? k_scale[it * kBlockKV + j]
                                 : k_scale[it * kKScalesPerTile + (j % 8) / 2];
      s.key_bias[cw][it & 1][j] =
          smooth_q_key_bias<D>(s.k[stage], j, s.q_mean[cw], kj_scale, p.sm_scale_log2);
      named_barrier_sync(NamedBarrier::key_bias(cw, Cta::kConsumers), 128);
    };
    // Whether any entry of tile it may be masked for this warpgroup's rows, and which.
    auto tile_needs_mask = [&](int it) {
      const int kv0 = it * kBlockKV;
      return kv0 + kBlockKV > p.n_kv || (p.causal && kv0 + kBlockKV - 1 > wg_row0 + causal_offset);
    };
    // Entry i of tile it is masked iff its column offset from this thread's first column,
    // 8 (i / 4) + i % 2 (a constant once unrolled), reaches the row's limit: one compare per
    // entry against two registers. (Column and row tests per entry made the INT32 mask pass of
    // the integer row max spill, ptxas, d = 128.)
    auto mask_limits = [&](int it, int (&limit)[2]) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int first_masked = p.causal ? min(p.n_kv, rows[r] + causal_offset + 1) : p.n_kv;
        limit[r] = first_masked - (it * kBlockKV + 2 * t);
      }
    };
    auto is_masked = [](const int (&limit)[2], int i) {
      return 8 * (i / 4) + i % 2 >= limit[frag::acc_row(i)];
    };
    constexpr bool kIntegerMax = KS == KScales::per_tile && !SmoothQ;
    // The row sum from the PV MMA's column of ones (RowSum::pv_mma, pv_operand.cuh) rather
    // than the softmax's FADD per score.
    constexpr bool kRowSumInMma = PV::kOnesRows > 0;
    // The product of the tile whose PV MMA was waited for, into O (and l).
    auto fold_pv = [&](const float (&alpha)[2]) {
      PV::fold(o, pv_acc, pa, alpha);
      if constexpr (kRowSumInMma) PV::fold_row_sum(softmax.l, pv_acc, alpha);
    };
    // P's scale in the exponent on the two-level E4M3 path (rules::p_scale_in_exponent), folded
    // into the offsets from head dim 128 (rules::p_scale_fold).
    constexpr PScaleMode kPScaleMode =
        Path != PVPath::e4m3_two_level               ? PScaleMode::multiply
        : D >= rules::kPScaleFoldMinHeadDim ? PScaleMode::fold
                                                     : PScaleMode::add;
    // The tile's logits from its QK accumulator (per-token or per-tile K scales, Q smoothing's
    // bias), masked entries -inf.
    // ks_prefetched: this thread's per-tile K group scale when loaded ahead.
    auto make_scores = [&](int it, float ks_prefetched, float (&sc)[kBlockKV / 2]) {
      if constexpr (KS == KScales::per_token) {
#pragma unroll
        for (int j = 0; j < kBlockKV / 8; ++j) {
          // Straight from global memory (L1/L2): a copy into the stage's shared memory by the
          // producer's bulk copy was reported as a race by compute-sanitizer racecheck, which
          // does not follow mbarrier ordering into the async proxy.
          const float2 ks = *reinterpret_cast<const float2*>(k_scale + it * kBlockKV + 8 * j + 2 * t);
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int i = 4 * j + e;
            sc[i] = float(sacc[i]) * rules::score_multiplier(qop.scale[frag::acc_row(i)],
                                                             e % 2 ? ks.y : ks.x, p.sm_scale_log2);
          }
        }
      } else {
        const float ks_tile = kPrefetchKScale ? ks_prefetched : k_scale[it * kKScalesPerTile + t];
        const float mult[2] = {rules::score_multiplier(qop.scale[0], ks_tile, p.sm_scale_log2),
                               rules::score_multiplier(qop.scale[1], ks_tile, p.sm_scale_log2)};
#pragma unroll
        for (int i = 0; i < kBlockKV / 2; ++i) sc[i] = float(sacc[i]) * mult[frag::acc_row(i)];
      }
      if constexpr (SmoothQ) {
        const float* bias = s.key_bias[cw][it & 1];
#pragma unroll
        for (int i = 0; i < kBlockKV / 2; ++i) sc[i] = __fadd_rn(sc[i], bias[frag::acc_col(i, t)]);
      }
      if (tile_needs_mask(it)) {
        int limit[2];
        mask_limits(it, limit);
#pragma unroll
        for (int i = 0; i < kBlockKV / 2; ++i)
          if (is_masked(limit, i)) sc[i] = -INFINITY;
      }
    };
    // The tile's P~ * p_max (in sc), the rescale of earlier output and the row sums, from its
    // QK accumulator. Recipes with per-tile K scales and no Q smoothing skip the float logits:
    // the integer row max (softmax.cuh, update_from_int; the simulator follows
    // rules::integer_row_max, which dispatch checks against this choice).
    auto tile_to_p = [&](int it, float ks_prefetched, float (&sc)[kBlockKV / 2], float (&alpha)[2],
                         float (&p_sum)[2]) {
      if constexpr (kIntegerMax) {
        const float ks_tile = kPrefetchKScale ? ks_prefetched : k_scale[it * kKScalesPerTile + t];
        const float mult = rules::score_multiplier(qop.scale[0], ks_tile, p.sm_scale_log2);
        const bool masked = tile_needs_mask(it);
        if (masked) {
          int limit[2];
          mask_limits(it, limit);
#pragma unroll
          for (int i = 0; i < kBlockKV / 2; ++i)
            if (is_masked(limit, i)) sacc[i] = INT32_MIN;
        }
        softmax.template update_from_int<kPScaleMode, !kRowSumInMma>(
            sacc, mult, masked, p.p_max, p.p_fold_k, p.p_fold_mult_limit, sc, alpha, p_sum);
      } else {
        make_scores(it, ks_prefetched, sc);
        softmax.template update<!kRowSumInMma>(sc, p.p_max, alpha, p_sum);
      }
    };
    // P of the tile into the PV operand, and the tile's row sums into the softmax state.
    auto pack_p = [&](const float (&sc)[kBlockKV / 2], const float (&alpha)[2],
                      const float (&p_sum)[2]) {
      int32_t code_sum[2] = {0, 0};
      PV::pack(sc, pa, code_sum);
      if constexpr (!kRowSumInMma) {  // else fold_pv adds the MMA's row sum
        if (Path == PVPath::int8 && p.quantized_row_sum) {
          // INT-FlashAttention: the denominator sums the quantized P (the codes, which are in
          // the row sum's units of P~ * p_max).
          const float q_sum[2] = {float(code_sum[0]), float(code_sum[1])};
          softmax.add_row_sum(alpha, q_sum);
        } else {
          softmax.add_row_sum(alpha, p_sum);
        }
      }
    };

    // Pingpong between two consumer warpgroups (FlashAttention-3): each issues its MMAs of
    // a tile (QK of tile i, PV of tile i-1) only after the other has issued its own, so the
    // tensor cores alternate between them and one warpgroup's softmax runs while the other's
    // MMAs do. Every warpgroup has n_tiles + 1 issue turns; warpgroup 1 lets warpgroup 0 start
    // and skips its last hand-over, so that no arrival is left pending on a barrier at exit.
    // (The hand-over restarts with every item; not measured since items were chained.)
    constexpr bool kPingpong = SAGE_SM90_PINGPONG && kOverlapPV && Cta::kConsumers == 2;
    auto begin_turn = [&] {
      if constexpr (kPingpong) named_barrier_sync(NamedBarrier::mma_turn(cw, 2), 256);
    };
    auto end_turn = [&](bool last_turn) {
      if constexpr (kPingpong)
        if (!(last_turn && cw == 1)) named_barrier_arrive(NamedBarrier::mma_turn(cw ^ 1, 2), 256);
    };
    if (kPingpong && cw == 1 && n_tiles > 0) named_barrier_arrive(NamedBarrier::mma_turn(0, 2), 256);

    // A software pipeline inside the warpgroup (FlashAttention-3's intra-warpgroup overlap):
    // tile i's QK MMA and tile i-1's PV MMA are issued back to back, and tile i's softmax runs
    // while the PV MMA does. Run one tile at a time (QK, softmax, PV), consumer warps waited on
    // their own MMAs in 20% of the stall samples (ncu, H100, d = 128, N = 16K). Registers: O,
    // the PV product, P of the running PV and the scores are live at once (208 for d = 128 and
    // 8-bit P); the next P is packed only after the product is folded in, when both are dead.
    // (v3 in docs/performance.md also held the next P and spilled.)
    if constexpr (!kOverlapPV) {
      // One tile at a time: the pipeline's extra live registers spill in this variant.
      for (int it = 0; it < n_tiles; ++it, ring.advance()) {
        const int stage = ring.stage;
        mbar_wait(&s.full[stage], ring.phase);
        issue_qk(stage);
        const float ks_tile = ks_next;
        ks_next = load_k_scale(it + 1);
        if constexpr (SmoothQ) compute_key_bias(it, stage);
        wgmma_wait<0>();
        reg_fence(sacc);
        float sc[kBlockKV / 2], alpha[2], p_sum[2];
        tile_to_p(it, ks_tile, sc, alpha, p_sum);
        pack_p(sc, alpha, p_sum);
        issue_pv(stage);
        wgmma_wait<0>();
        fold_pv(alpha);
        if (lane == 0) mbar_arrive(&s.empty[stage]);
      }
    }
    if (kOverlapPV && n_tiles > 0) {
      mbar_wait(&s.full[ring.stage], ring.phase);
      trace_event(trace::kv_full);
      begin_turn();
      issue_qk(ring.stage);
      const float ks_tile = ks_next;
      ks_next = load_k_scale(1);
      if constexpr (SmoothQ) compute_key_bias(0, ring.stage);
      end_turn(false);
      wgmma_wait<0>();
      reg_fence(sacc);
      trace_event(trace::s_ready);
      float sc[kBlockKV / 2], p_sum[2];
      tile_to_p(0, ks_tile, sc, alpha_pending, p_sum);
      trace_event(trace::softmax_done);
      pack_p(sc, alpha_pending, p_sum);
      trace_event(trace::tile_done);
    }
    for (int it = 1; kOverlapPV && it < n_tiles; ++it) {
      const int prev = ring.stage;
      ring.advance();
      const int stage = ring.stage;
      mbar_wait(&s.full[stage], ring.phase);
      trace_event(trace::kv_full);
      begin_turn();
      issue_qk(stage);  // commit group: S of tile it
      const float ks_tile = ks_next;
      ks_next = load_k_scale(it + 1);
      // Before the PV MMA owns its registers: with both in flight the bias spilled (ptxas).
      if constexpr (SmoothQ) compute_key_bias(it, stage);
      issue_pv(prev);  // commit group: P V of tile it - 1
      end_turn(false);
      wgmma_wait<1>();  // S is ready; the PV MMA may still run
      reg_fence(sacc);
      trace_event(trace::s_ready);
      float sc[kBlockKV / 2], alpha[2], p_sum[2];
      tile_to_p(it, ks_tile, sc, alpha, p_sum);
      trace_event(trace::softmax_done);
      wgmma_wait<0>();
      trace_event(trace::pv_done);
      fold_pv(alpha_pending);
      if (lane == 0) mbar_arrive(&s.empty[prev]);  // tile it - 1's K and V are read
      pack_p(sc, alpha, p_sum);
      alpha_pending[0] = alpha[0], alpha_pending[1] = alpha[1];
      trace_event(trace::tile_done);
    }
    if (kOverlapPV && n_tiles > 0) {
      const int last = ring.stage;
      ring.advance();
      begin_turn();
      issue_pv(last);
      end_turn(true);
      wgmma_wait<0>();
      trace_event(trace::pv_done);
      fold_pv(alpha_pending);
      // The last stage goes back to the producer too: with chained items it refills it.
      if (lane == 0) mbar_arrive(&s.empty[last]);
    }

    // ---- epilogue: normalize, undo the V scale, add back the V mean, store -----------------
    trace_event(trace::epilogue_begin);
    // One reciprocal per row rather than an IEEE division per element (docs/numerics.md, GPU
    // vs simulator).
    float l[2], inv_l[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      // The MMA's row sum is already the whole row's; the softmax's are the quad's partials.
      l[r] = kRowSumInMma ? softmax.l[r] : frag::quad_sum(softmax.l[r]);
      inv_l[r] = l[r] > 0.f ? __frcp_rn(l[r]) : 0.f;
    }
    T* out_head = static_cast<T*>(p.out) + b * p.o_stride_b + h * p.o_stride_h;
    const int warp_row0 = wg_row0 + 16 * warp;
    const bool aligned16 = reinterpret_cast<uintptr_t>(out_head) % 16 == 0 && p.o_stride_n % 8 == 0;
    store_output_rows<D, T>(o, inv_l, l, p.kv.v_scale + kv_head * D,
                            p.smooth_v ? p.kv.v_mean + kv_head * D : nullptr, s.q[qbuf][cw] + 16 * warp * D,
                            out_head + (int64_t)warp_row0 * p.o_stride_n, p.o_stride_n,
                            p.n_q - warp_row0, aligned16, lane);
    // The buffer (Q codes and this warp's staging) goes back to the stage (the epilogue
    // ended with __syncwarp: every lane's staging reads are done).
    if (q_staged && lane == 0) mbar_arrive(&s.q_empty[qbuf]);
    trace_event(trace::epilogue_end);
    if (want_lse && t == 0) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        if (rows[r] >= p.n_q) continue;
        // l sums P~ * p_max.
        const float lse = l[r] > 0.f ? (softmax.m[r] + (log2f(l[r]) - log2f(p.p_max))) * 0.69314718055994531f +
                                           p.sm_scale * qop.dot_kmean[r]
                                     : -INFINITY;
        p.lse[b * p.lse_stride_b + h * p.lse_stride_h + (int64_t)rows[r] * p.lse_stride_n] = lse;
      }
    }
  }
}

}  // namespace sage::sm90
