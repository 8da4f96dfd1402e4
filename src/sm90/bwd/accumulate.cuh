// Step 8 of the backward and step 6's product: the INT8 MMAs of one tile, each tile's exact
// s32 product scaled and added once (the contract's per-tile fmaf):
//   dV[key] = fmaf(float(sum_rows c(P) c(dO)), s_P,key * s_dO, dV)   (registers, per warpgroup)
//   dK[key] = fmaf(float(sum_rows c(dS) qcode), s_dS,key * q_scale, dK)   (registers)
//   dQ[row] += float(sum_keys c(dS) kcode) * (s_dS,row * k_scale)         (a bulk reduce per
//              tile: the other K/V tiles' CTAs add into the same rows)
// (dS per block: s_dS,key = s_dS,row = the tile's scale.)
// dV and dK: A from registers (quantize.cuh), B = dO^T / Q^T codes of the stage; in column
// chunks of 64 (n = 64: the s32 product of a chunk is 32 registers beside the 2 x D/2 of dV
// and dK). dQ: warpgroup c takes channels [c D/2, (c+1) D/2), A = the dS tile, B = K'^T.
#pragma once

#include <cstdint>

#include "common/ptx.cuh"
#include "sm90/bwd/order.cuh"
#include "sm90/bwd/params.h"
#include "sm90/bwd/recompute.cuh"
#include "sm90/bwd/smem.cuh"
#include "sm90/mma/wgmma_ops.cuh"

namespace sage::sm90::bwd {

// Accumulator values per thread of dV or dK (64 keys x D over 128 threads).
template <int D>
constexpr int kGradAcc = D / 2;

// Channels per product chunk: the s32 product of a chunk (kChunk / 2 registers) lives beside
// dV and dK (2 x D/2), P^T's and dS^T's codes; 32 at d = 128 (64 spilled dV and dK there).
template <int D>
constexpr int kChunk = D >= 128 ? 32 : 64;

// dV's chunks then dK's (job j < D / N is dV's chunk j, the others dK's). At d = 64 one
// product is in flight while the previous one folds (two s32 buffers); at d = 128 that spilled
// (120 bytes against 40), so there each product is waited for before the next is issued.
template <int D>
__device__ __forceinline__ void accumulate_dv_dk(const Smem<D>& s, int st, uint32_t (&pa)[2][4],
                                                 const float (&p_scale)[2], float do_scale,
                                                 uint32_t (&dsa)[2][4], const float (&dk_scale)[2],
                                                 float (&dv)[kGradAcc<D>], float (&dk)[kGradAcc<D>]) {
  constexpr int N = kChunk<D>, kAcc = N / 2, kChunks = D / N, kJobs = 2 * kChunks;
  // s_P,key * s_dO (the contract's order), per key row g and g + 8.
  const float pv_scale[2] = {__fmul_rn(p_scale[0], do_scale), __fmul_rn(p_scale[1], do_scale)};
  int32_t prod[2][kAcc];
  auto issue = [&](int j) {
    int32_t(&acc)[kAcc] = prod[j & 1];
    reg_fence(acc);
    wgmma_fence();
    if (j < kChunks) {
      mma_s8_rs<N, false>(acc, pa[0], s.dot_desc(st, j * N, 0));
      mma_s8_rs<N, true>(acc, pa[1], s.dot_desc(st, j * N, 1));
    } else {
      mma_s8_rs<N, false>(acc, dsa[0], s.qt_desc(st, (j - kChunks) * N, 0));
      mma_s8_rs<N, true>(acc, dsa[1], s.qt_desc(st, (j - kChunks) * N, 1));
    }
    wgmma_commit();
  };
  constexpr bool kOverlap = D < 128;
  reg_fence(pa);
  reg_fence(dsa);
  if constexpr (kOverlap) issue(0);
#pragma unroll
  for (int j = 0; j < kJobs; ++j) {
    if constexpr (kOverlap) {
      if (j + 1 < kJobs) {
        issue(j + 1);
        wgmma_wait<1>();
      } else {
        wgmma_wait<0>();
      }
    } else {
      issue(j);
      wgmma_wait<0>();
    }
    int32_t(&acc)[kAcc] = prod[j & 1];
    reg_fence(acc);
    // Accumulator index x of the chunk: channel 8 (x / 4) + 2t + (x & 1) of it, the same
    // index kAcc n + x of dV / dK (whose layout is m64nD's: index 4j + e, channel 8j + ...).
    const int n = j < kChunks ? j : j - kChunks;
#pragma unroll
    for (int x = 0; x < kAcc; ++x) {
      float& y = j < kChunks ? dv[kAcc * n + x] : dk[kAcc * n + x];
      y = __fmaf_rn(small_int_to_float(acc[x]), j < kChunks ? pv_scale[(x % 4) / 2] : dk_scale[(x % 4) / 2], y);
    }
  }
  reg_fence(pa);
  reg_fence(dsa);
}

__device__ __forceinline__ void atomic_add2(float* at, float x, float y) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  atomicAdd(reinterpret_cast<float2*>(at), make_float2(x, y));
#else
  atomicAdd(at, x);
  atomicAdd(at + 1, y);
#endif
}

// dQ of the tile into the shared-memory staging tile (dq_fragment_index's order), for the
// bulk reduce that adds it to the workspace (add_dq_tile). dq_scale[r]: s_dS * k_scale of the
// thread's row r (0: row 16w + g, 1: + 8; dq_row_scales). The last tile's rows past n_q add
// zeros (their dS is 0) into the workspace's padding, which the finalize does not read.
template <int D>
__device__ __forceinline__ void accumulate_dq(const Smem<D>& s, const ConsumerThread& th,
                                              const float (&dq_scale)[2]) {
  constexpr int kN = D / 2;
  int32_t acc[kN / 2];
  reg_fence(acc);
  wgmma_fence();
#pragma unroll
  for (int ks = 0; ks < kBlockKV / 32; ++ks) {
    if (ks == 0) mma_s8_ss<kN, false>(acc, s.ds_desc(ks), s.kt_desc(th.c, ks));
    else mma_s8_ss<kN, true>(acc, s.ds_desc(ks), s.kt_desc(th.c, ks));
  }
  wgmma_commit();
  wgmma_wait<0>();
  reg_fence(acc);
  const int ct = 128 * th.c + 32 * th.w + th.lane;
  const uint32_t base = smem_addr(s.dq()) + 16 * ct;
#pragma unroll
  for (int j = 0; j < kN / 8; ++j) {
    float v[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) v[e] = __fmul_rn(small_int_to_float(acc[4 * j + e]), dq_scale[e / 2]);
    asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};" ::"r"(base + j * 16 * 128 * kConsumers),
                 "f"(v[0]), "f"(v[1]), "f"(v[2]), "f"(v[3])
                 : "memory");
  }
  // The tile is read by the bulk reduce through the async proxy.
  fence_proxy_async();
}

// One thread adds the staged dQ tile (Q tile `tile` of query head bh) to the workspace's
// accumulator: one bulk reduce of kBlockQ * D floats. In deterministic mode it first waits
// for the K/V tile's turn at that Q tile and passes the turn once the adds are complete
// (order.cuh); otherwise the shared-memory tile is reused only after bulk_wait_read.
template <int D>
__device__ __forceinline__ void add_dq_tile(const BackwardParams& p, const Smem<D>& s, int64_t bh, int tile,
                                            int kv_tile) {
  float* dst = p.dq_acc + (bh * (p.n_q_pad / kBlockQ) + tile) * int64_t(kBlockQ * D);
  if (p.deterministic) {
    wait_turn(dq_turn_counter(p, bh, tile), dq_turn_of(p, tile, kv_tile));
    fence_proxy_async_global();  // the earlier turns' adds before this one's
  }
  bulk_reduce_add_f32(dst, s.dq(), kBlockQ * D * 4);
  bulk_commit();
  if (p.deterministic) {
    bulk_wait_all();
    fence_proxy_async_global();  // this turn's adds before the increment that passes it
    add_release(dq_turn_counter(p, bh, tile), 1);
  }
}

}  // namespace sage::sm90::bwd
