// Deterministic mode (BackwardParams::deterministic; sage/backward.h, "Determinism"): every fp32
// sum that several CTAs add into gets a fixed order of addition. A turn counter per sum (int32,
// in the workspace, zeroed with the accumulators) says how many CTAs have added: a CTA waits
// until it equals its turn, adds as the default mode does (dQ: one bulk reduce of the tile,
// accumulate.cuh, add_dq_tile; dK, dV: red.global.add; the order was all that varied) and
// passes the turn by incrementing the counter.
//   dQ of a Q tile: the K/V tiles that add into it are 0 .. last_kv_tile (kernel_traits.h); they
//     add in decreasing order. Under the causal mask a higher K/V tile starts at a later Q
//     tile, so at the same pace it reaches any Q tile before the lower ones: it goes first, and
//     the lower ones seldom wait for it (in increasing order, with n_q = n_kv, K/V tile j would
//     idle about 3 j Q-tile steps before its first tile). Without the mask all start at Q tile
//     0 and the turns form a wavefront: the r-th in order starts r Q-tile steps late.
//   dK, dV of a K/V tile under GQA: the group's query heads in increasing order.
//
// Why this cannot deadlock: a waiting CTA holds its SM, so every CTA it waits for must already
// be running or finished. In deterministic mode blockIdx.x is the K/V tiles in decreasing order
// (backward_kernel), so a CTA waits only for CTAs of lower linear block index (blockIdx.x
// fastest, then y, then z): for dQ those of a lower blockIdx.x with its (y, z), for dK and dV
// those of a lower blockIdx.y with its (x, z). The hardware dispatches a grid's CTAs in
// increasing linear index (CUDA does not promise it; the block scheduler has always done so,
// and FlashAttention's and CUTLASS's ordered reductions rely on it alike), so what a running CTA
// waits for has been dispatched; the lowest-index unfinished CTA then waits for no one, and
// finishes, and so in turn does every CTA.
#pragma once

#include "common/ptx.cuh"
#include "sm90/bwd/kernel_traits.h"
#include "sm90/bwd/params.h"
#include "sm90/bwd/smem.cuh"

namespace sage::sm90::bwd {

// The K/V tile of this CTA: blockIdx.x in the default mode, the K/V tiles in decreasing order
// in deterministic mode (the dQ turns' order, for the argument above).
__device__ __forceinline__ int kv_tile_of_this_block(const BackwardParams& p) {
  return kv_tile_of_block(int(blockIdx.x), p.n_pad / kBlockKV, p.deterministic);
}

__device__ __forceinline__ int load_acquire(const int* at) {
  int x;
  asm volatile("ld.global.acquire.gpu.b32 %0, [%1];" : "=r"(x) : "l"(at) : "memory");
  return x;
}

__device__ __forceinline__ void add_release(int* at, int x) {
  asm volatile("red.release.gpu.global.add.s32 [%0], %1;" ::"l"(at), "r"(x) : "memory");
}

// One thread spins until the counter reaches `turn`. Its acquire makes the earlier turns'
// additions visible to it; the named barrier that follows (every caller's) extends that to
// the other consumer threads.
__device__ __forceinline__ void wait_turn(const int* counter, int turn) {
  while (load_acquire(counter) != turn) {
  }
}

// After the consumer threads' additions of a turn: the barrier orders every thread's additions
// before one thread's release increment, whose fence is cumulative (PTX's release pattern covers
// what the barrier made visible to that thread; CUTLASS's and FlashAttention's ordered reductions
// rest on the same rule). No fence in each thread: it would add nothing, and ptxas then turns
// every float red.global.add of the kernel, the default mode's too, into an atomic that returns.
__device__ __forceinline__ void pass_turn(int* counter, int ct) {
  named_barrier_sync(kTurn, 128 * kConsumers);
  if (ct == 0) add_release(counter, 1);
}

// The counter of the dQ of Q tile `tile` of query head bh, and the K/V tile's turn there (the
// K/V tiles after it go first).
__device__ __forceinline__ int* dq_turn_counter(const BackwardParams& p, int64_t bh, int tile) {
  return p.dq_turn + bh * (p.n_q_pad / kBlockQ) + tile;
}
__device__ __forceinline__ int dq_turn_of(const BackwardParams& p, int tile, int kv_tile) {
  return dq_turn(tile, kv_tile, p.n_q, p.n_kv, p.n_pad / kBlockKV, p.causal);
}

// The counter of the dK, dV sums of K/V tile kv_tile of KV head kvh (query head h's turn there:
// h % group).
__device__ __forceinline__ int* dkv_turn_counter(const BackwardParams& p, int64_t kvh, int kv_tile) {
  return p.dkv_turn + kvh * (p.n_pad / kBlockKV) + kv_tile;
}

}  // namespace sage::sm90::bwd
