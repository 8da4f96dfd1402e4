// The SageBwd backward kernel (docs/numerics.md, "The backward"; docs/design.md, "The backward
// kernel"), one file per pipeline stage like the forward's:
//
//   kernel_traits.h  tiles, warpgroups, stages, registers, the shared-memory layout
//   smem.cuh         typed views of shared memory, barriers and wgmma descriptors
//   producer.cuh     TMA: the K/V tile once, the Q tiles' operands through a ring
//   recompute.cuh    S^T and dP^T (wgmma), P and dS (steps 3-5)
//   quantize.cuh     P and dS to INT8 in registers and the dS tile (steps 6-7)
//   accumulate.cuh   dV and dK in registers, dQ through a bulk reduce per tile (step 8)
//   order.cuh        deterministic mode: the atomics' order fixed by turn counters
//
// One CTA per (128-key K/V tile, query head), looping over the 64-row Q tiles in increasing
// order (step 1). Warpgroup 0 produces; warpgroups 1 and 2 own 64 keys each. At the end dK *
// sm_scale and dV go into the KV head's fp32 accumulators, summed over the group's query heads
// by atomics (GQA; finalize.cuh converts). G, dS's scales (kernel_traits.h, DsGranularity),
// is a template parameter: one instantiation each; deterministic mode is a runtime flag (the
// turns cost a few scalar registers, not a second set of instantiations).
#pragma once

#include <cstdint>

#include "common/ptx.cuh"
#include "numerics/quant_rules.h"
#include "sm90/bwd/accumulate.cuh"
#include "sm90/bwd/kernel_traits.h"
#include "sm90/bwd/order.cuh"
#include "sm90/bwd/params.h"
#include "sm90/bwd/producer.cuh"
#include "sm90/bwd/quantize.cuh"
#include "sm90/bwd/recompute.cuh"
#include "sm90/bwd/smem.cuh"
#include "sm90/bwd/tma_maps.h"

namespace sage::sm90::bwd {

// K'^T [channel][key position] from the TMA-loaded K' [key][channel], once per CTA (the
// consumers' 256 threads; kp_key order).
template <int D>
__device__ __forceinline__ void build_kt(const Smem<D>& s, int ct) {
  const uint8_t* k8 = s.k8();
  uint8_t* kt8 = s.kt8();
  for (int e = ct; e < D * kBlockKV; e += 128 * kConsumers) {
    const int ch = e / kBlockKV, kp = e % kBlockKV;
    kt8[swizzled_offset(ch, kp, 128)] = k8[swizzled_offset(kp_key(kp), ch, D)];
  }
  fence_proxy_async();
}

// Step 9 for dK (per query head, as the simulator scales before the group's sum) and step 10's
// sum over the group.
template <int D>
__device__ __forceinline__ void add_dk_dv(const BackwardParams& p, const ConsumerThread& th, int64_t kvh,
                                          int key0, const float (&dk)[kGradAcc<D>],
                                          const float (&dv)[kGradAcc<D>]) {
#pragma unroll
  for (int x = 0; x < kGradAcc<D>; x += 2) {
    const int key = key0 + 16 * th.w + th.g + ((x % 4) >= 2 ? 8 : 0);
    const int ch = 64 * (x / 32) + 8 * ((x % 32) / 4) + 2 * th.t;
    if (key >= p.n_kv) continue;
    const int64_t at = (kvh * p.n_kv + key) * D + ch;
    atomic_add2(p.dk_acc + at, __fmul_rn(dk[x], p.sm_scale), __fmul_rn(dk[x + 1], p.sm_scale));
    atomic_add2(p.dv_acc + at, dv[x], dv[x + 1]);
  }
}

template <int D, class T, DsGranularity G>
__device__ __forceinline__ void run_consumers(const BackwardParams& p, const Smem<D>& s, int j0, int kv_tile,
                                              int hk, int h, int b) {
  setmaxnreg_inc<kConsumerRegs>();
  const int ct = threadIdx.x - 128;  // consumer thread 0 .. 255
  ConsumerThread th;
  th.c = ct / 128;
  th.w = (ct / 32) % 4;
  th.lane = ct % 32;
  th.g = th.lane / 4, th.t = th.lane % 4;
  const int64_t kvh = (int64_t)b * p.heads_kv + hk, bh = (int64_t)b * p.heads_q + h;
  const int key0 = j0 + 64 * th.c;
  // per_block K: one scale per K/V tile (its four per-thread slots hold the same value).
  const float k_scale = p.k_scale[(kvh * (p.n_pad / kBlockKV) + kv_tile) * 4];
  const int pad_tiles = p.n_q_pad / kBlockQ;
  float dv[kGradAcc<D>], dk[kGradAcc<D>];
#pragma unroll
  for (int x = 0; x < kGradAcc<D>; ++x) dv[x] = 0.f, dk[x] = 0.f;
  mbar_wait(s.kv_full(), 0);
  build_kt<D>(s, ct);  // ordered before dQ's first MMA by the kDsStored barrier
  const QTiles tiles = q_tiles(p, j0);
  int fill = 0;
  for (int tile = tiles.begin; tile < tiles.end; ++tile, ++fill) {
    const int st = fill % kStages;
    const int i0 = tile * kBlockQ;
    const float q_scale = p.q_scale[bh * pad_tiles + tile];
    const float do_scale = p.do_scale[bh * pad_tiles + tile];
    const float mult = rules::score_multiplier(q_scale, k_scale, p.sm_scale_log2);
    mbar_wait(s.full(st), (fill / kStages) & 1);
    int32_t sacc[kTileAcc];
    float pv[kTileAcc], dsv[kTileAcc];
    issue_s<D>(s, th.c, st, sacc);
    if constexpr (kDpWithS<D>) issue_dp<D, T>(s, th.c, st, dsv);
    recompute_p<D>(s, th, st, i0, key0, p.n_q, p.n_kv, p.causal, mult, sacc, pv);
    if constexpr (!kDpWithS<D>) issue_dp<D, T>(s, th.c, st, dsv);
    uint32_t pa[2][4], dsa[2][4];
    float p_scale[2];
    quantize_per_key(pv, pa, p_scale);
    recompute_ds<D>(s, th, st, pv, dsv);
    float ds_scale[2];  // per key row
    quantize_ds<G>(s, th, fill & 1, dsv, dsa, ds_scale);
    const float dk_scale[2] = {__fmul_rn(ds_scale[0], q_scale), __fmul_rn(ds_scale[1], q_scale)};
    accumulate_dv_dk<D>(s, st, pa, p_scale, do_scale, dsa, dk_scale, dv, dk);
    // The stage's operands are read (S^T, dP^T, dV, dK waited for). Every thread arrives,
    // each after its own reads of the stage's L2 and D rows: with one arrival per warp behind
    // __syncwarp, racecheck still sees the producer's next bulk load of the stage race the
    // other lanes' reads.
    mbar_arrive(s.empty(st));
    // The last tile's dQ bulk reduce has read the staging tile (its issuer waits here, so the
    // barrier below holds every consumer until the tile may be written again).
    if (ct == 0) bulk_wait_read();
    // Every warp's dS codes (and, the first time, K'^T) are in shared memory.
    named_barrier_sync(kDsStored, 128 * kConsumers);
    float dq_scale[2];
    dq_row_scales<G>(s, th, fill & 1, ds_scale[0], k_scale, dq_scale);
    accumulate_dq<D>(s, th, dq_scale);
    named_barrier_sync(kDqStaged, 128 * kConsumers);
    if (ct == 0) add_dq_tile<D>(p, s, bh, tile, kv_tile);
  }
  // The bulk reduces complete before the CTA (and its shared memory) goes.
  if (ct == 0) bulk_wait_all();
  // Nothing added: the accumulators stay zero. The Q tiles depend on the K/V tile alone, so
  // the group's other query heads return here too and none waits for this CTA's turn.
  if (tiles.begin >= tiles.end) return;
  // Under GQA in deterministic mode, the group's query heads add dK and dV in increasing order.
  const int group = p.heads_q / p.heads_kv;
  const bool ordered = p.deterministic && group > 1;
  if (ordered) {
    if (ct == 0) wait_turn(dkv_turn_counter(p, kvh, kv_tile), h % group);
    named_barrier_sync(kTurn, 128 * kConsumers);
  }
  add_dk_dv<D>(p, th, kvh, key0, dk, dv);
  if (ordered) pass_turn(dkv_turn_counter(p, kvh, kv_tile), ct);
}

template <int D, class T, DsGranularity G>
__global__ void __launch_bounds__(kThreads, 1)
    backward_kernel(const __grid_constant__ BackwardMaps maps, const BackwardParams p) {
  // Aligned to 1024 bytes (the swizzled tiles' repeat; the launch adds the slack).
  extern __shared__ uint8_t smem_raw[];
  const Smem<D> s(reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023)));
  const int kv_tile = kv_tile_of_this_block(p), h = blockIdx.y, b = blockIdx.z;
  const int hk = h / (p.heads_q / p.heads_kv);
  const int j0 = kv_tile * kBlockKV;
  if (threadIdx.x == 0) {
    for (int st = 0; st < kStages; ++st) {
      mbar_init(s.full(st), 1);
      mbar_init(s.empty(st), 128 * kConsumers);  // every consumer thread
    }
    mbar_init(s.kv_full(), 1);
    fence_barrier_init();
  }
  // Per token, the rows' dS maxima start at zero in both parities (quantize_ds_per_token).
  if (G == DsGranularity::per_token && threadIdx.x < 2 * kBlockQ) s.red(0)[threadIdx.x] = 0.f;
  __syncthreads();
  if (threadIdx.x < 128) {
    run_producer<D>(maps, p, s, j0, hk, h, b);
    return;
  }
  run_consumers<D, T, G>(p, s, j0, kv_tile, hk, h, b);
}

}  // namespace sage::sm90::bwd
