// The output epilogue of a consumer warp: its 16 rows of O, normalized, unscaled and with the
// V mean added back, converted to fp16/bf16 and written to global memory through shared
// memory.
//
// Why through shared memory: straight from the accumulator layout every thread wrote 32
// four-byte pieces per item (d = 128), each warp store touching eight rows, and the epilogue
// waited on the LSU (v13, docs/history/README.md). Here `stmatrix` puts the warp's tile into
// shared memory (one instruction per four 8x8 pieces) and each lane then writes whole 16-byte
// pieces of rows: a warp store covers four full 128-byte row segments.
//
// The staging buffer is the warp's own 16 rows of its warpgroup's Q tile (16 x D bytes): the
// item's QK MMAs, its only readers, have completed, and the next item's prologue rewrites it.
// That holds half the warp's output row, so the tile goes out in two column halves.
#pragma once

#include <cstdint>

#include "common/vec_io.cuh"
#include "common/ptx.cuh"
#include "sm90/fwd/mainloop.cuh"
#include "sm90/fwd/qk_layout.cuh"
#include "sm90/fwd/seqlen.cuh"

namespace sage::sm90 {

// o: the warp's accumulator (fragment.cuh layout); inv_l / l: its two rows' normalizers;
// v_scale, v_mean: the head's V channel scales and means (v_mean null: zeros). stage: the
// warp's first row (16 x its 16 rows) in the first column block of its warpgroup's Q tile
// (qk_layout.cuh: rows of at least D bytes in column blocks of 64 rows; the warp's rows of
// block b are 64 rows' worth further, and 16 rows keep the swizzle's phase). out_rows: the
// warp's first row; rows at or past n_rows and columns at or past head_dim (the caller's: a
// multiple of 8, <= D) are not written. aligned16: out_rows and the row stride allow 16-byte
// stores (else four 4-byte stores each).
template <int D, class T>
__device__ __forceinline__ void store_output_rows(const float (&o)[D / 2], const float (&inv_l)[2],
                                                  const float (&l)[2], const float* v_scale,
                                                  const float* v_mean, int8_t* stage,
                                                  T* out_rows, int64_t row_stride, int n_rows,
                                                  int head_dim, bool aligned16, int lane) {
  using L = QKLayout<D>;
  constexpr int kHalfChunks = D / 16;  // 16-byte pieces of a half row: 8-column blocks per half
  const uint32_t stage_addr = smem_addr(stage);
  // Row `row` of the warp's slice, byte column `col`. (Addressed from the tile's rows instead,
  // ptxas spilled the d = 128 Q-smoothing kernel.)
  auto offset = [](int row, int col) {
    return (col / L::kSpan) * (64 * L::kSpan) + swizzled_offset(row, col % L::kSpan, L::kSpan);
  };
  const int t = lane % 4;
  // The channel scales and means of columns 8j + 2t, +1, all requested before the first use
  // (loaded where used, each multiply waited for its load). Loaded here, not by the caller:
  // as kernel-side arrays filled after the last PV MMA they spilled the d = 128 kernel (v13,
  // docs/history/README.md).
  // Above d = 128 one half's at a time: all of them (128 registers) beside O's 128 would not fit.
  constexpr bool kPerHalf = D > 128;
  constexpr int kLoads = kPerHalf ? D / 16 : D / 8;
  float2 vs[kLoads], vm[kLoads];
  if constexpr (!kPerHalf) {
#pragma unroll
    for (int j = 0; j < D / 8; ++j) {
      vs[j] = *reinterpret_cast<const float2*>(v_scale + 8 * j + 2 * t);
      vm[j] = v_mean ? *reinterpret_cast<const float2*>(v_mean + 8 * j + 2 * t) : make_float2(0.f, 0.f);
    }
  }
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    if constexpr (kPerHalf) {
#pragma unroll
      for (int j = 0; j < kLoads; ++j) {
        const int c = 8 * (half * kHalfChunks + j) + 2 * t;
        vs[j] = *reinterpret_cast<const float2*>(v_scale + c);
        vm[j] = v_mean ? *reinterpret_cast<const float2*>(v_mean + c) : make_float2(0.f, 0.f);
      }
    }
    // stmatrix x4: pieces (row half 0, block j), (1, j), (0, j + 1), (1, j + 1); lane l gives
    // the address of row l % 8 of piece l / 8.
#pragma unroll
    for (int jj = 0; jj < kHalfChunks; jj += 2) {
      uint32_t piece[4];
#pragma unroll
      for (int m = 0; m < 4; ++m) {
        const int j = half * kHalfChunks + jj + m / 2, r = m % 2;
        float y0 = 0.f, y1 = 0.f;
        // l sums P~ * p_max: its p_max cancels the one of P's codes. Rows without keys (l = 0)
        // give 0; a NaN l (a non-finite input reached the row) gives NaN.
        if (!(l[r] <= 0.f)) {
          const int js = kPerHalf ? j - half * kHalfChunks : j;
          y0 = (o[4 * j + 2 * r] * vs[js].x) * inv_l[r] + vm[js].x;
          y1 = (o[4 * j + 2 * r + 1] * vs[js].y) * inv_l[r] + vm[js].y;
        }
        piece[m] = gpu::pack2<T>(y0, y1);
      }
      const int m = lane / 8, row = 8 * (m % 2) + lane % 8, chunk = jj + m / 2;
      stmatrix_x4(stage_addr + offset(row, 16 * chunk), piece);
    }
    __syncwarp();
#pragma unroll
    for (int k = 0; k < 16 * kHalfChunks / 32; ++k) {
      const int q = 32 * k + lane, row = q / kHalfChunks, chunk = q % kHalfChunks;
      const uint4 v = ld_shared_v4(stage_addr + offset(row, 16 * chunk));
      const int col = half * (D / 2) + 8 * chunk;
      if (row < n_rows && col < head_dim) {
        T* dst = out_rows + row * row_stride + col;
        if (aligned16) {
          *reinterpret_cast<uint4*>(dst) = v;
        } else {
          uint32_t* d4 = reinterpret_cast<uint32_t*>(dst);
          d4[0] = v.x, d4[1] = v.y, d4[2] = v.z, d4[3] = v.w;
        }
      }
    }
    __syncwarp();  // every lane has read this half before it is overwritten
  }
}

// The end of a consumer's item: O normalized, unscaled, with the V mean added back and stored;
// the Q buffer returned to the Q stage; the LSE written if asked for.
template <class K>
__device__ __forceinline__ void run_epilogue(const AttentionParams& p, typename K::Storage& s,
                                             const Mainloop<K>& ml, const ConsumerItem& item,
                                             const QOperand<K::D>& qop, int qbuf, bool q_staged) {
  constexpr int D = K::D;
  using T = typename K::T;
  const SeqLenOf<K::kVarlen> seq{p};
  const int n_q = seq.n_q(item.b);
  // One reciprocal per row rather than an IEEE division per element (docs/numerics.md, GPU
  // vs simulator).
  float l[2], inv_l[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    // The MMA's row sum is already the whole row's; the softmax's are the quad's partials.
    l[r] = K::kRowSumInMma ? ml.softmax.l[r] : frag::quad_sum(ml.softmax.l[r]);
    inv_l[r] = l[r] <= 0.f ? 0.f : __frcp_rn(l[r]);  // NaN stays NaN
  }
  T* out_head = static_cast<T*>(p.out) + seq.out_offset(item.b, item.h);
  const int warp_row0 = item.wg_row0 + 16 * item.warp;
  const bool aligned16 = reinterpret_cast<uintptr_t>(out_head) % 16 == 0 && p.o_stride_n % 8 == 0;
  using L = QKLayout<D>;  // the workspace's channels per head: L::kRowBytes
  store_output_rows<D, T>(ml.o, inv_l, l, p.kv.v_scale + item.kv_head * L::kRowBytes,
                          p.smooth_v ? p.kv.v_mean + item.kv_head * L::kRowBytes : nullptr,
                          s.q[qbuf][item.cw] + 16 * item.warp * L::kSpan,
                          out_head + (int64_t)warp_row0 * p.o_stride_n, p.o_stride_n,
                          n_q - warp_row0, p.head_dim_v, aligned16, item.lane);
  // The buffer (Q codes and this warp's staging) goes back to the stage (the epilogue
  // ended with __syncwarp: every lane's staging reads are done).
  if (q_staged && item.lane == 0) mbar_arrive(&s.q_empty[qbuf]);
  if (p.lse != nullptr && item.t == 0) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      if (item.rows[r] >= n_q) continue;
      // l sums P~ * p_max.
      const float lse = l[r] <= 0.f ? -INFINITY
                                    : (ml.softmax.m[r] + (log2f(l[r]) - log2f(p.p_max))) * 0.69314718055994531f +
                                          p.sm_scale * qop.dot_kmean[r];
      p.lse[seq.lse_offset(item.b, item.h) + (int64_t)item.rows[r] * p.lse_stride_n] = lse;
    }
  }
  // Only SageBwd's forward is trained (api/backward.cu): the other kernels keep their code.
  if constexpr (K::kPath == PVPath::int8_dynamic) {
    if (p.lse2 != nullptr && item.t == 0) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        if (item.rows[r] >= n_q) continue;
        const float l2 = l[r] <= 0.f ? -INFINITY : ml.softmax.m[r] + (log2f(l[r]) - log2f(p.p_max));
        p.lse2[((int64_t)item.b * p.heads_q + item.h) * p.n_q + item.rows[r]] = l2;
      }
    }
  }
}

}  // namespace sage::sm90
