// The sm_90a forward attention kernel: INT8 Q K^T on warpgroup MMAs, then the P V product of
// one of the PV operand policies (pv_operand.cuh). docs/design.md maps its parts:
//
//   kernel_traits.h   the shape of every variant (tiles, warpgroups, stages, registers)
//   tile_scheduler.*  which CTA runs which work items (Q tiles of a batch and head)
//   seqlen.cuh        each batch entry's lengths and offsets
//   mask.cuh          which keys a Q row sees
//   producer.cuh      TMA loads of the quantized K/V ring, and the Q stage
//   q_operand.cuh     the consumers' Q prologue (load, quantize, Q smoothing)
//   mainloop.cuh      a consumer warpgroup's K/V loop (QK MMA, softmax, PV MMA)
//   k_scales.cuh      K scale policies; pv_operand.cuh, the PV operand policies
//   epilogue.cuh      normalize, store O and the LSE
//
// Warp specialization: warpgroup 0 is the producer, warpgroups 1.. are consumers of 64 Q rows
// each. Registers move from the producer to the consumers with setmaxnreg. A CTA runs one or
// more work items one after the other, all consumer warpgroups on the same item.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common/ptx.cuh"
#include "sm90/fwd/epilogue.cuh"
#include "sm90/fwd/kernel_config.cuh"
#include "sm90/fwd/mainloop.cuh"
#include "sm90/fwd/mask.cuh"
#include "sm90/fwd/producer.cuh"
#include "sm90/fwd/q_operand.cuh"
#include "sm90/fwd/seqlen.cuh"

namespace sage::sm90 {

// The work item at slot w as consumer thread threadIdx.x sees it. The coordinates are
// recomputed per item from an opaque copy of the thread index: left loop-invariant, the
// compiler hoisted everything the prologue and epilogue derive from them (Q and output
// addresses, swizzled offsets) out of the item loop, where they stayed live through the K/V
// loop and spilled it at d = 128 (v11).
// Packed batches (K::kVarlen): the item's sequence's lengths go into the mask first, which
// the K/V tiles and the loop's masking read.
template <class K>
__device__ __forceinline__ ConsumerItem consumer_item(const AttentionParams& p, MaskOf<K::kVarlen>& mask,
                                                      int w, int group_size) {
  ConsumerItem c;
  int tid = threadIdx.x;
  reg_fence(tid);
  c.cw = tid / 128 - 1;
  c.warp = (tid / 32) % 4;
  c.lane = tid % 32;
  c.g = frag::group_of_lane(c.lane), c.t = frag::quad_of_lane(c.lane);
  const WorkItem item = work_item(p, w);
  c.h = item.h, c.b = item.b, c.hk = item.h / group_size;
  c.q0 = item.q_tile * K::kBlockQ;
  if constexpr (K::kVarlen) {
    const VarlenSeqLen seq{p};
    mask.set_lengths(seq.n_q(c.b), seq.n_kv(c.b));
  }
  const KvTiles tiles = mask.template kv_tiles<K::kBlockQ, K::kLeftWindow>(c.q0);
  c.kv_begin = tiles.begin, c.kv_end = tiles.end;
  c.wg_row0 = c.q0 + 64 * c.cw;
  if constexpr (K::kVarlen) mask.set_rows(c.wg_row0);
  c.rows[0] = c.wg_row0 + 16 * c.warp + c.g;
  c.rows[1] = c.wg_row0 + 16 * c.warp + c.g + 8;
  c.kv_head = UniformSeqLen{p}.kv_head(c.b, c.hk);
  return c;
}

// The head's K scales and V scales/means are a few KiB that the quantize pass wrote long
// before (its K/V output has evicted them from L2): every 128-byte line of K scales cost the
// CTA a DRAM round trip inside its loop (v9 knobs, docs/history/README.md). Asked for now,
// under the Q load.
template <class K>
__device__ __forceinline__ void prefetch_item_scales(const AttentionParams& p, const ConsumerItem& c) {
  constexpr int D = K::D, kRow = QKLayout<D>::kRowBytes;
  const int64_t k_scale_bytes = K::KScale::head_bytes(p.n_pad);
  const char* k_scale_head = reinterpret_cast<const char*>(p.kv.k_scale) + c.kv_head * k_scale_bytes;
  const int consumer_thread = threadIdx.x - 128;
  for (int64_t line = consumer_thread; line * 128 < k_scale_bytes; line += 128 * K::kConsumers)
    prefetch_l2(k_scale_head + line * 128);
  if (consumer_thread < D / 32) prefetch_l2(p.kv.v_scale + c.kv_head * kRow + 32 * consumer_thread);
  else if (p.smooth_v && consumer_thread < D / 16)
    prefetch_l2(p.kv.v_mean + c.kv_head * kRow + 32 * (consumer_thread - D / 32));
}

// Q rows start at the head's offset; prequantized Q is int8, so the arithmetic is in elements
// of whichever type q is.
template <class K>
__device__ __forceinline__ const typename K::T* q_head_of(const AttentionParams& p, int b, int h) {
  using T = typename K::T;
  const int64_t q_offset = SeqLenOf<K::kVarlen>{p}.q_offset(b, h);
  return p.q_scale ? reinterpret_cast<const T*>(static_cast<const int8_t*>(p.q) + q_offset)
                   : static_cast<const T*>(p.q) + q_offset;
}

// The next item's Q rows into L2 (one 128-byte line per consumer thread, 2 per row at most),
// so that its load in the next prologue does not wait for DRAM.
template <class K>
__device__ __forceinline__ void prefetch_next_q(const AttentionParams& p, int w_next) {
  const WorkItem next = work_item(p, w_next);
  const int row = next.q_tile * K::kBlockQ + (threadIdx.x - 128) % K::kBlockQ;
  const int line = (threadIdx.x - 128) / K::kBlockQ;
  const int elem_bytes = p.q_scale ? 1 : int(sizeof(typename K::T));
  if (row < p.n_q && line * 128 < p.head_dim * elem_bytes)
    prefetch_l2(reinterpret_cast<const char*>(q_head_of<K>(p, next.b, next.h)) +
                ((int64_t)row * p.q_stride_n) * elem_bytes + line * 128);
}

// The item's Q codes and scales: from the Q stage's buffer (items after a CTA's first, where
// the launch took the stage), else quantized here by the consumers (q_operand.cuh).
template <class K>
__device__ __forceinline__ void load_q(const AttentionParams& p, typename K::Storage& s,
                                       const ConsumerItem& c, QOperand<K::D>& qop, int item_index,
                                       int qbuf, bool q_staged, int n_q) {
  constexpr int D = K::D;
  if (q_staged && item_index > 0) {
    // Not with the LSE under K smoothing (the dispatch's rule): q . mean(K) needs raw Q.
    // Buffer 1 is filled for items 1, 3, ..., buffer 0 for items 2, 4, ...
    mbar_wait(&s.q_full[qbuf], ((item_index - 1) >> 1) & 1);
    const int tile_row = 64 * c.cw + 16 * c.warp + c.g;
    qop.scale[0] = s.q_scale[qbuf][tile_row];
    qop.scale[1] = s.q_scale[qbuf][tile_row + 8];
    qop.dot_kmean[0] = qop.dot_kmean[1] = 0.f;
  } else {
    const float* q_scale_head = p.q_scale ? p.q_scale + c.b * p.qs_stride_b + c.h * p.qs_stride_h : nullptr;
    const float* balance_head = balance_of_head<D>(p, c.kv_head);
    qop.load(p, q_head_of<K>(p, c.b, c.h), q_scale_head,
             p.kv.k_mean + c.kv_head * QKLayout<D>::kRowBytes, balance_head,
             c.rows, min(K::kBlockQ, n_q - c.q0), c.lane, 4 * c.cw + c.warp, s.reduce,
             &s.q_sum[0][0], s.q_mean[c.cw], s.q[qbuf][c.cw], p.lse != nullptr && p.smooth_k, n_q);
  }
}

// The consumer warpgroups: each of the CTA's items, prologue, K/V loop, epilogue.
template <class K>
__device__ __forceinline__ void run_consumers(const AttentionParams& p, typename K::Storage& s,
                                              CtaSlots mine, int group_size) {
  setmaxnreg_inc<K::kTraits.consumer_regs>();
  MaskOf<K::kVarlen> mask(p);
  Mainloop<K> mainloop(p, s, mask);
  // s.reduce and s.q_sum (per-block Q scales, Q smoothing) are shared by all warpgroups: one
  // that finished an item must not overwrite them before the other has read the last item's.
  const bool q_stats_shared = p.smooth_q || p.q_granularity == Granularity::per_block;
  const bool q_staged = K::kQStage && p.q_stage;  // items after the first come from the stage
  int item_index = 0;  // of this CTA's items: the Q buffer and the stage's barrier phases
  for (int w = mine.begin; w < mine.end; w += slot_step(p.work), ++item_index) {
    const ConsumerItem c = consumer_item<K>(p, mask, w, group_size);
    // Packed batches: an item past its sequence's last Q row has nothing to do (the producer
    // loads nothing for it). Every consumer warpgroup skips it, so barriers stay matched.
    if constexpr (K::kVarlen) {
      if (c.q0 >= mask.n_q()) continue;
    }
    if (w > mine.begin && q_stats_shared) named_barrier_sync(NamedBarrier::q_stats, 128 * K::kConsumers);
    prefetch_item_scales<K>(p, c);
    QOperand<K::D> qop;
    const int qbuf = K::kQStage ? item_index & 1 : 0;
    if constexpr (K::kVarlen) {
      load_q<K>(p, s, c, qop, item_index, qbuf, q_staged, mask.n_q());
    } else {
      load_q<K>(p, s, c, qop, item_index, qbuf, q_staged, p.n_q);
      if (const int w_next = w + slot_step(p.work); !q_staged && w_next < mine.end) prefetch_next_q<K>(p, w_next);
    }
    mainloop.run(c, qop, qbuf);
    run_epilogue<K>(p, s, mainloop, c, qop, qbuf, q_staged);
  }
}

template <class K>
__global__ void __launch_bounds__(K::kThreads, 1)
    attention_kernel(const __grid_constant__ CUtensorMap tma_k, const __grid_constant__ CUtensorMap tma_v,
                     const __grid_constant__ CUtensorMap tma_q, const AttentionParams p) {
  auto& s = shared_storage<typename K::Storage>();
  const CtaSlots mine = cta_slots(p.work, blockIdx.x);
  const int group_size = p.heads_q / p.heads_kv;
  s.init(blockDim.x);
  __syncthreads();
  if (threadIdx.x / 128 == 0) {
    Producer<K>::run(&tma_k, &tma_v, &tma_q, p, s, mine, group_size);
    return;
  }
  run_consumers<K>(p, s, mine, group_size);
}

}  // namespace sage::sm90
