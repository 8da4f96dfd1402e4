// The backward's producer warpgroup: thread 0 loads the CTA's K' codes and V once, then each
// Q tile's operands (Q codes both ways, dO, dO^T codes, L2 and D) into the ring of kStages
// stages, one TMA box per operand (two for the 16-bit ones at d = 128) and two 256-byte bulk
// copies. The other 127 threads give their registers to the consumers and exit.
#pragma once

#include "common/ptx.cuh"
#include "sm90/bwd/kernel_traits.h"
#include "sm90/bwd/params.h"
#include "sm90/bwd/smem.cuh"
#include "sm90/bwd/tma_maps.h"

namespace sage::sm90::bwd {

// The Q tiles a CTA runs: all of them, or under the bottom-right causal mask those whose last
// row sees a key of the tile (first_q_tile, kernel_traits.h; j0 < n_kv).
struct QTiles {
  int begin, end;
};
__device__ __forceinline__ QTiles q_tiles(const BackwardParams& p, int j0) {
  const int end = (p.n_q + kBlockQ - 1) / kBlockQ;
  const int begin = first_q_tile(j0, p.n_q, p.n_kv, p.causal);
  return {min(begin, end), end};
}

template <int D>
__device__ __forceinline__ void run_producer(const BackwardMaps& maps, const BackwardParams& p,
                                             const Smem<D>& s, int j0, int hk, int h, int b) {
  setmaxnreg_dec<kProducerRegs>();
  if (threadIdx.x != 0) return;
  const int64_t kvh = (int64_t)b * p.heads_kv + hk, bh = (int64_t)b * p.heads_q + h;
  mbar_expect_tx(s.kv_full(), kv_tx_bytes(D));
  tma_load_2d(s.k8(), &maps.k8, s.kv_full(), 0, int(kvh * p.n_pad + j0));
#pragma unroll
  for (int blk = 0; blk < D / 64; ++blk)
    tma_load_4d(s.v() + blk * kBlockKV * 128, &maps.v, s.kv_full(), 64 * blk, j0, hk, b);
  const QTiles tiles = q_tiles(p, j0);
  int fill = 0;
  for (int tile = tiles.begin; tile < tiles.end; ++tile, ++fill) {
    const int st = fill % kStages;
    // Sleeping, not spinning: the stage comes free a whole Q tile's work later, and a spinning
    // try_wait takes issue slots from the consumer warps on its scheduler (docs/design.md,
    // "The backward kernel", the profile).
    mbar_wait_sleeping(s.empty(st), ((fill / kStages) & 1) ^ 1);
    uint64_t* bar = s.full(st);
    mbar_expect_tx(bar, stage_tx_bytes(D));
    const int i0 = tile * kBlockQ;
    tma_load_2d(s.q8(st), &maps.q8, bar, 0, int(bh * p.n_q_pad + i0));
    tma_load_2d(s.qt8(st), &maps.q8t, bar, i0, int(bh * D));
    tma_load_2d(s.dot8(st), &maps.do8t, bar, i0, int(bh * D));
#pragma unroll
    for (int blk = 0; blk < D / 64; ++blk)
      tma_load_4d(s.dout(st) + blk * kBlockQ * 128, &maps.dout, bar, 64 * blk, i0, h, b);
    bulk_load_1d(s.l2(st), p.l2p + bh * p.n_q_pad + i0, kBlockQ * 4, bar);
    bulk_load_1d(s.delta(st), p.delta + bh * p.n_q_pad + i0, kBlockQ * 4, bar);
  }
}

}  // namespace sage::sm90::bwd
