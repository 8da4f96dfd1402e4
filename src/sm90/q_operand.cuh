// QK operand policy, Q side: each consumer thread loads the Q elements of its rows g and g+8
// straight from global memory (any strides), quantizes them in registers with the recipe's
// group map, and stores the INT8 codes into its warpgroup's Q tile in shared memory, swizzled
// as TMA would, for the QK MMA to read through a descriptor.
//
// Why in the kernel: a Q tile is read once per CTA, so quantizing here costs no extra pass
// over Q; and a per-thread group (rows g and g+8 of a warp slice, tile.h) is exactly what one
// thread holds, so per-thread scales need only a quad reduction.
//
// Why shared memory and not register A fragments: with Q held in registers across the K/V
// loop, ptxas (CUDA 13.0) reused those registers for scores and P inside the loop, so every
// tile after the first multiplied by the wrong operand (seen in SASS, 2026-11-22). Reading
// Q through a descriptor leaves nothing loop-carried in registers.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common/vec_io.cuh"
#include "sage/quant_rules.h"
#include "sm90/fragment.cuh"
#include "sm90/kernel_params.h"
#include "sm90/ptx.cuh"

namespace sage::sm90 {

template <int D>
struct QOperand {
  static constexpr int kChunks = D / 32;
  float scale[2];      // dequantization scale of rows g and g+8
  float dot_kmean[2];  // q_row . mean(K): the row shift K smoothing removed (for the LSE)

  // rows[0], rows[1]: the thread's two Q rows (may be >= n_q: then zeros).
  // consumer_warp: 0..7 over both consumer warpgroups; s_red: 8 floats of shared memory;
  // s_q: this warpgroup's [64 x D] INT8 tile (1024-byte aligned), written swizzled.
  template <class T>
  __device__ void load(const AttentionParams& p, const T* q_head, const float* k_mean_head,
                       const int (&rows)[2], int lane, int consumer_warp, float* s_red,
                       int8_t* s_q, bool want_dot_kmean) {
    const int t = frag::quad_of_lane(lane);
    float x[kChunks][2][2][4];  // [k slice][half][row][4 channels]
    float amax[2] = {0.f, 0.f};
#pragma unroll
    for (int kc = 0; kc < kChunks; ++kc)
#pragma unroll
      for (int half = 0; half < 2; ++half)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int col = 32 * kc + 16 * half + 4 * t;
          if (rows[r] < p.n_q) {
            gpu::load4(q_head + (int64_t)rows[r] * p.q_stride_n + col, x[kc][half][r]);
          } else {
#pragma unroll
            for (int i = 0; i < 4; ++i) x[kc][half][r][i] = 0.f;
          }
#pragma unroll
          for (int i = 0; i < 4; ++i) amax[r] = fmaxf(amax[r], fabsf(x[kc][half][r][i]));
        }

    dot_kmean[0] = dot_kmean[1] = 0.f;
    if (want_dot_kmean) {
#pragma unroll
      for (int kc = 0; kc < kChunks; ++kc)
#pragma unroll
        for (int half = 0; half < 2; ++half)
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const float km = k_mean_head[32 * kc + 16 * half + 4 * t + i];
            dot_kmean[0] += x[kc][half][0][i] * km;
            dot_kmean[1] += x[kc][half][1][i] * km;
          }
      dot_kmean[0] = frag::quad_sum(dot_kmean[0]);
      dot_kmean[1] = frag::quad_sum(dot_kmean[1]);
    }

    // The group map of tile.h, as reductions over the threads that share a group.
    switch (p.q_granularity) {
      case Granularity::per_token:
        amax[0] = frag::quad_max(amax[0]);
        amax[1] = frag::quad_max(amax[1]);
        break;
      case Granularity::per_thread:
        amax[0] = amax[1] = frag::quad_max(fmaxf(amax[0], amax[1]));
        break;
      case Granularity::per_warp:
        amax[0] = amax[1] = frag::warp_max(fmaxf(amax[0], amax[1]));
        break;
      default: {  // per_block: both consumer warpgroups (the whole Q tile)
        const float w = frag::warp_max(fmaxf(amax[0], amax[1]));
        if (lane == 0) s_red[consumer_warp] = w;
        named_barrier_sync(1, 256);
        float m = s_red[0];
#pragma unroll
        for (int i = 1; i < 8; ++i) m = fmaxf(m, s_red[i]);
        amax[0] = amax[1] = m;
        break;
      }
    }

    float inv[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      scale[r] = rules::symmetric_scale(amax[r], rules::kInt8Max);
      inv[r] = rules::symmetric_inverse(amax[r], rules::kInt8Max);
    }
    const int warp_row0 = 16 * (consumer_warp % 4) + frag::group_of_lane(lane);
#pragma unroll
    for (int kc = 0; kc < kChunks; ++kc)
#pragma unroll
      for (int half = 0; half < 2; ++half)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          int32_t c[4];
#pragma unroll
          for (int i = 0; i < 4; ++i)
            c[i] = rules::round_clamp(x[kc][half][r][i] * inv[r], rules::kInt8Max);
          const int row = warp_row0 + 8 * r, col = 32 * kc + 16 * half + 4 * t;
          *reinterpret_cast<uint32_t*>(s_q + swizzled_offset(row, col, D)) =
              frag::pack_bytes(c[0], c[1], c[2], c[3]);
        }
    // The MMA reads the tile through the async proxy: make the stores visible to it, then
    // wait for the whole warpgroup.
    fence_proxy_async();
    named_barrier_sync(2 + consumer_warp / 4, 128);
  }
};

}  // namespace sage::sm90
