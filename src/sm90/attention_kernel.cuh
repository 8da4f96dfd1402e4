// The sm_90a attention kernel: INT8 Q K^T on warpgroup MMAs, then the P V product of one of
// the PV operand policies (pv_operand.cuh): E4M3 two-level (SageAttention2, the default), E4M3
// with f16 pair accumulation (SageAttention2++), fp16 (SageAttention T/B) or INT8
// (SageAttention vT/vB, INT-FlashAttention).
//
// Warp specialization: warpgroup 0 is the producer (one thread issues TMA loads of the
// quantized K tile and the transposed V tile into a ring of shared-memory stages, released
// through mbarriers); warpgroups 1 and 2 are consumers, 64 Q rows each. Register budgets are
// moved from the producer to the consumers with setmaxnreg.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common/vec_io.cuh"
#include "sage/quant_rules.h"
#include "sm90/fragment.cuh"
#include "sm90/kernel_params.h"
#include "sm90/ptx.cuh"
#include "sm90/pv_operand.cuh"
#include "sm90/q_operand.cuh"
#include "sm90/softmax.cuh"
#include "sm90/wgmma_ops.cuh"

namespace sage::sm90 {

// Build-time knobs for experiments (docs/performance.md), e.g.
// -DCMAKE_CUDA_FLAGS="-DSAGE_SM90_STAGES=2"; the defaults are what was measured.
#ifndef SAGE_SM90_SETMAXNREG
#define SAGE_SM90_SETMAXNREG 1
#endif
#ifndef SAGE_SM90_STAGES
#define SAGE_SM90_STAGES 3  // the producer runs up to two K/V tiles ahead of the consumers
#endif
constexpr int kStages = SAGE_SM90_STAGES;
constexpr int kThreads = 384;
// Named barriers: 1 = Q statistics over the tile (256 threads), 2..3 = Q tile stored and
// 4..5 = Q smoothing's key biases written (per warpgroup).
// Registers move from the producer (one thread issuing TMA) to the consumers; without it the
// consumer path spills at the 168-register launch cap.
constexpr bool kReallocateRegisters = SAGE_SM90_SETMAXNREG;
constexpr int kProducerRegs = 24;
constexpr int kConsumerRegs = 240;

template <int D, int VBytes>
struct SharedStorage {
  alignas(1024) int8_t q[2][64 * D];  // one quantized Q tile per consumer warpgroup
  alignas(1024) int8_t k[kStages][kBlockKV * D];
  alignas(1024) uint8_t v[kStages][D * kBlockKV * VBytes];
  alignas(8) uint64_t full[kStages];
  alignas(8) uint64_t empty[kStages];
  float reduce[8];
  double q_sum[8][D];           // Q smoothing: column sums per consumer warp
  float q_mean[2][D];           // Q smoothing: the tile mean, one copy per warpgroup
  float key_bias[2][2][kBlockKV];  // Q smoothing: dS per key, [warpgroup][tile parity]
};

// How many K/V tiles the Q tile starting at q0 needs (bottom-right causal alignment:
// row i sees keys j <= i + n_kv - n_q).
__device__ __forceinline__ int kv_tiles_for(const AttentionParams& p, int q0) {
  const int all = (p.n_kv + kBlockKV - 1) / kBlockKV;
  if (!p.causal) return all;
  const int last_row = min(q0 + kBlockQ, p.n_q) - 1;
  const int last_key = last_row + p.n_kv - p.n_q;
  if (last_key < 0) return 0;
  return min(all, last_key / kBlockKV + 1);
}

// T: the output dtype (and the input dtype of fp16/bf16 Q). Path: the PV operand policy.
// KS: how the K scales are laid out (per tile groups or per token). SmoothQ: Q smoothing's
// per-tile dS work; a compile-time choice because as a run-time branch it cost the recipes
// without it ~5% at N = 16K (H100 A/B, 2026-11-22).
template <int D, class T, PVPath Path, KScales KS, bool SmoothQ>
__global__ void __launch_bounds__(kThreads, 1)
    attention_kernel(const __grid_constant__ CUtensorMap tma_k,
                     const __grid_constant__ CUtensorMap tma_v, const AttentionParams p) {
  using PV = PVOperand<D, Path>;
  extern __shared__ uint8_t smem_raw[];
  auto& s = *reinterpret_cast<SharedStorage<D, PV::kVBytes>*>(
      (reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));

  // Causal tiles on the diagonal's far end carry the most work: launch them first.
  const int q_tile = p.causal ? p.n_q_tiles - 1 - blockIdx.x : blockIdx.x;
  const int h = blockIdx.y, b = blockIdx.z;
  const int hk = h / (p.heads_q / p.heads_kv);
  const int q0 = q_tile * kBlockQ;
  const int n_tiles = kv_tiles_for(p, q0);
  const int warpgroup = threadIdx.x / 128;

  if (threadIdx.x == 0) {
    for (int i = 0; i < kStages; ++i) {
      mbar_init(&s.full[i], 1);
      mbar_init(&s.empty[i], 8);  // one arrival per consumer warp
    }
    fence_barrier_init();
  }
  __syncthreads();

  if (warpgroup == 0) {
    // ---- producer ------------------------------------------------------------------------
    if constexpr (kReallocateRegisters) setmaxnreg_dec<kProducerRegs>();
    if (threadIdx.x == 0) {
      prefetch_tma_descriptor(&tma_k);
      prefetch_tma_descriptor(&tma_v);
      const int k_row0 = (b * p.heads_kv + hk) * p.n_pad;
      const int v_row0 = (b * p.heads_kv + hk) * D;
      constexpr uint32_t kStageBytes = (1 + PV::kVBytes) * kBlockKV * D;
      // A V tile row is kBlockKV * VBytes bytes: one 128-byte swizzle span per TMA box.
      constexpr int kVBoxes = PV::kVBytes;
      for (int it = 0; it < n_tiles; ++it) {
        const int stage = it % kStages;
        mbar_wait(&s.empty[stage], ((it / kStages) & 1) ^ 1);
        mbar_expect_tx(&s.full[stage], kStageBytes);
        tma_load_2d(s.k[stage], &tma_k, &s.full[stage], 0, k_row0 + it * kBlockKV);
#pragma unroll
        for (int box = 0; box < kVBoxes; ++box)
          tma_load_2d(s.v[stage] + box * D * 128, &tma_v, &s.full[stage],
                      (it * kVBoxes + box) * 128, v_row0);
      }
    }
    return;
  }

  // ---- consumers -------------------------------------------------------------------------
  if constexpr (kReallocateRegisters) setmaxnreg_inc<kConsumerRegs>();
  const int cw = warpgroup - 1;                  // consumer warpgroup 0 / 1
  const int warp = (threadIdx.x / 32) % 4;       // warp inside the warpgroup
  const int lane = threadIdx.x % 32;
  const int g = frag::group_of_lane(lane), t = frag::quad_of_lane(lane);
  const int wg_row0 = q0 + 64 * cw;
  const int rows[2] = {wg_row0 + 16 * warp + g, wg_row0 + 16 * warp + g + 8};
  const int causal_offset = p.n_kv - p.n_q;
  const int64_t kv_head = (int64_t)b * p.heads_kv + hk;

  // Prequantized Q is int8: the pointer arithmetic is in elements of whichever type q is.
  const int64_t q_offset = b * p.q_stride_b + h * p.q_stride_h;
  const T* q_head = p.q_scale ? reinterpret_cast<const T*>(static_cast<const int8_t*>(p.q) + q_offset)
                              : static_cast<const T*>(p.q) + q_offset;
  const float* q_scale_head = p.q_scale ? p.q_scale + b * p.qs_stride_b + h * p.qs_stride_h : nullptr;
  QOperand<D> qop;
  const bool want_lse = p.lse != nullptr;
  qop.load(p, q_head, q_scale_head, p.kv.k_mean + kv_head * D, rows, min(kBlockQ, p.n_q - q0),
           lane, 4 * cw + warp, s.reduce, &s.q_sum[0][0], s.q_mean[cw], s.q[cw],
           want_lse && p.smooth_k);

  OnlineSoftmax<kBlockKV> softmax;
  float o[D / 2];
#pragma unroll
  for (int i = 0; i < D / 2; ++i) o[i] = 0.f;

  // per_tile: this thread's columns all fall in K group t of a tile (tile.h); per_token: one
  // scale per column.
  const float* k_scale = KS == KScales::per_token
                             ? p.kv.k_scale + kv_head * p.n_pad
                             : p.kv.k_scale + kv_head * (p.n_pad / kBlockKV) * kKScalesPerTile;
  int32_t sacc[kBlockKV / 2];  // S of the current tile

  // One tile at a time per warpgroup: QK, softmax, PV. The two consumer warpgroups overlap
  // each other's softmax and MMAs through the warp schedulers. (An explicit pingpong that
  // issued PV(i-1) with QK(i) in one turn measured slower on the H100, 466 vs 640 TOPS at
  // d=128, N=16K: holding O, the PV tile, S and P at once spilled 420 bytes; see
  // docs/performance.md.)
  auto issue_qk = [&](int stage) {
    mma_s8_ss<kBlockKV, false>(sacc, make_smem_desc(s.q[cw], D), make_smem_desc(s.k[stage], D));
#pragma unroll
    for (int kc = 1; kc < D / 32; ++kc)
      mma_s8_ss<kBlockKV, true>(sacc, make_smem_desc(s.q[cw] + 32 * kc, D),
                                make_smem_desc(s.k[stage] + 32 * kc, D));
  };
  for (int it = 0; it < n_tiles; ++it) {
    const int stage = it % kStages;
    const float ks_tile = KS == KScales::per_tile ? k_scale[it * kKScalesPerTile + t] : 0.f;
    mbar_wait(&s.full[stage], (it / kStages) & 1);

    wgmma_fence();
    issue_qk(stage);
    wgmma_commit();
    // Q smoothing: each thread computes one key's bias while the QK MMA runs.
    if constexpr (SmoothQ) {
      const int j = threadIdx.x % 128;
      const float kj_scale = KS == KScales::per_token
                                 ? k_scale[it * kBlockKV + j]
                                 : k_scale[it * kKScalesPerTile + (j % 8) / 2];
      s.key_bias[cw][it & 1][j] =
          smooth_q_key_bias<D>(s.k[stage], j, s.q_mean[cw], kj_scale, p.sm_scale_log2);
      named_barrier_sync(4 + cw, 128);
    }
    wgmma_wait<0>();
    reg_fence(sacc);

    float sc[kBlockKV / 2];
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
    const int kv0 = it * kBlockKV;
    const bool needs_mask =
        kv0 + kBlockKV > p.n_kv || (p.causal && kv0 + kBlockKV - 1 > wg_row0 + causal_offset);
    if (needs_mask) {
#pragma unroll
      for (int i = 0; i < kBlockKV / 2; ++i) {
        const int col = kv0 + frag::acc_col(i, t);
        const int row = rows[frag::acc_row(i)];
        if (col >= p.n_kv || (p.causal && col > row + causal_offset)) sc[i] = -INFINITY;
      }
    }
    float alpha[2], p_sum[2];
    softmax.update(sc, alpha, p_sum);
    int32_t code_sum[2] = {0, 0};
    PV::tile(o, sc, alpha, s.v[stage], p.p_max, code_sum, [&] {
      if (lane == 0) mbar_arrive(&s.empty[stage]);
    });
    if (Path == PVPath::int8 && p.quantized_row_sum) {
      // INT-FlashAttention: the denominator sums the quantized P (codes / 127).
      const float q_sum[2] = {float(code_sum[0]) / p.p_max, float(code_sum[1]) / p.p_max};
      softmax.add_row_sum(alpha, q_sum);
    } else {
      softmax.add_row_sum(alpha, p_sum);
    }
  }

  // ---- epilogue: normalize, undo the V scale, add back the V mean, store -----------------
  float l[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) l[r] = frag::quad_sum(softmax.l[r]);
  T* out_head = static_cast<T*>(p.out) + b * p.o_stride_b + h * p.o_stride_h;
  const float* v_scale = p.kv.v_scale + kv_head * D;
  const float* v_mean = p.kv.v_mean + kv_head * D;
#pragma unroll
  for (int j = 0; j < D / 8; ++j) {
    const int c = 8 * j + 2 * t;
    const float vs0 = v_scale[c] / p.p_max, vs1 = v_scale[c + 1] / p.p_max;
    const float vm0 = p.smooth_v ? v_mean[c] : 0.f, vm1 = p.smooth_v ? v_mean[c + 1] : 0.f;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      if (rows[r] >= p.n_q) continue;
      float y0 = 0.f, y1 = 0.f;
      if (l[r] > 0.f) {
        y0 = (o[4 * j + 2 * r] * vs0) / l[r] + vm0;
        y1 = (o[4 * j + 2 * r + 1] * vs1) / l[r] + vm1;
      }
      gpu::store2(out_head + (int64_t)rows[r] * p.o_stride_n + c, y0, y1);
    }
  }
  if (want_lse && t == 0) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      if (rows[r] >= p.n_q) continue;
      const float lse = l[r] > 0.f ? (softmax.m[r] + log2f(l[r])) * 0.69314718055994531f +
                                         p.sm_scale * qop.dot_kmean[r]
                                   : -INFINITY;
      p.lse[b * p.lse_stride_b + h * p.lse_stride_h + (int64_t)rows[r] * p.lse_stride_n] = lse;
    }
  }
}

}  // namespace sage::sm90
