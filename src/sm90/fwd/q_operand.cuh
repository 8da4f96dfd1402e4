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
// tile after the first multiplied by the wrong operand (seen in SASS: v1,
// docs/history/README.md). Reading Q through a descriptor leaves nothing loop-carried in
// registers.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common/vec_io.cuh"
#include "numerics/quant_rules.h"
#include "sm90/mma/fragment.cuh"
#include "sm90/fwd/params.h"
#include "common/ptx.cuh"
#include "sm90/fwd/qk_layout.cuh"

namespace sage::sm90 {

template <int D>
struct QOperand {
  static constexpr int kChunks = D / 32;
  static constexpr int kConsumers = kConsumerWarpgroups<D>;
  static constexpr int kConsumerWarps = 4 * kConsumers;
  float scale[2];      // dequantization scale of rows g and g+8
  float dot_kmean[2];  // q_row . mean(K): the row shift K smoothing removed (for the LSE)

  // rows[0], rows[1]: the thread's two Q rows (may be >= n_q: then zeros). tile_rows: rows of
  // the CTA's Q tile inside n_q. consumer_warp: 0..kConsumerWarps-1 over all consumer
  // warpgroups. Shared memory: s_red kConsumerWarps floats; s_sum [kConsumerWarps][D] doubles
  // and s_mean [D] floats (this warpgroup's copy) for Q smoothing; s_q this warpgroup's
  // [64 x D] INT8 tile (1024-byte aligned), written swizzled.
  template <class T>
  __device__ void load(const AttentionParams& p, const T* q_head, const float* q_scale_head,
                       const float* k_mean_head, const float* balance_head, const int (&rows)[2],
                       int tile_rows, int lane, int consumer_warp, float* s_red, double* s_sum,
                       float* s_mean, int8_t* s_q, bool want_dot_kmean, int n_q) {
    const int t = frag::quad_of_lane(lane);
    const bool prequantized = q_scale_head != nullptr;
    float x[kChunks][2][2][4];  // [k slice][half][row][4 channels]
    float amax[2] = {0.f, 0.f};
    // The thread's four channels of each (slice, half) lie inside the caller's head dim (a
    // multiple of 8) or wholly past it: there they are zeros and never read (issue 34, a
    // smaller head dim on this kernel's tile). col_in[kc][half]; column offsets past it read
    // column 0 (a valid address) and are zeroed after, as rows past n_q are.
    bool col_in[kChunks][2];
    int col_at[kChunks][2];
#pragma unroll
    for (int kc = 0; kc < kChunks; ++kc)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int col = 32 * kc + 16 * half + 4 * t;
        col_in[kc][half] = col < p.head_dim;
        col_at[kc][half] = col_in[kc][half] ? col : 0;
      }
    // Two whole loops rather than a test per load: with the branch inside, the loads were no
    // longer issued back to back (v6-v7, docs/history/README.md).
    if (prequantized) {  // INT8 codes: q_head really points at int8
      const int8_t* q8 = reinterpret_cast<const int8_t*>(q_head);
#pragma unroll
      for (int kc = 0; kc < kChunks; ++kc)
#pragma unroll
        for (int half = 0; half < 2; ++half)
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            char4 c = make_char4(0, 0, 0, 0);
            if (rows[r] < n_q && col_in[kc][half])
              c = *reinterpret_cast<const char4*>(q8 + (int64_t)rows[r] * p.q_stride_n + 32 * kc +
                                                  16 * half + 4 * t);
            x[kc][half][r][0] = c.x, x[kc][half][r][1] = c.y, x[kc][half][r][2] = c.z,
            x[kc][half][r][3] = c.w;
          }
    } else {
      // All 16 loads are issued before any value is used: a row past n_q reads row n_q - 1 (a
      // valid address) and is zeroed after. (Predicated per row, ptxas put the last load
      // behind a branch after the other loads' uses: a second L2 round trip per item; v16,
      // docs/history/README.md.)
      const bool valid[2] = {rows[0] < n_q, rows[1] < n_q};
      const T* row_ptr[2];
#pragma unroll
      for (int r = 0; r < 2; ++r)
        row_ptr[r] = q_head + (int64_t)min(rows[r], n_q - 1) * p.q_stride_n;
      uint2 raw[kChunks][2][2];
#pragma unroll
      for (int kc = 0; kc < kChunks; ++kc)
#pragma unroll
        for (int half = 0; half < 2; ++half)
#pragma unroll
          for (int r = 0; r < 2; ++r)
            raw[kc][half][r] = *reinterpret_cast<const uint2*>(row_ptr[r] + col_at[kc][half]);
#pragma unroll
      for (int kc = 0; kc < kChunks; ++kc)
#pragma unroll
        for (int half = 0; half < 2; ++half)
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            // Zeroed as raw words (two selects per four values): +0 in fp16 and bf16.
            const bool in = valid[r] && col_in[kc][half];
            const float2 a = gpu::word_to_float2<T>(in ? raw[kc][half][r].x : 0u);
            const float2 b = gpu::word_to_float2<T>(in ? raw[kc][half][r].y : 0u);
            float* xs = x[kc][half][r];
            xs[0] = a.x, xs[1] = a.y, xs[2] = b.x, xs[3] = b.y;
          }
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
    // qk_channel_balance: after q . mean(K), which takes the unbalanced Q (the simulator's
    // order), and before Q smoothing.
    if (balance_head != nullptr) divide_by_balance(x, balance_head, t);
    if (p.smooth_q) subtract_tile_mean(x, rows, n_q, tile_rows, lane, consumer_warp, s_sum, s_mean);

#pragma unroll
    for (int kc = 0; kc < kChunks; ++kc)
#pragma unroll
      for (int half = 0; half < 2; ++half)
#pragma unroll
        for (int r = 0; r < 2; ++r)
#pragma unroll
          for (int i = 0; i < 4; ++i) amax[r] = rules::max_nan(amax[r], fabsf(x[kc][half][r][i]));

    // The group map of tile.h, as reductions over the threads that share a group.
    switch (p.q_granularity) {
      case Granularity::per_token:
        amax[0] = frag::quad_max_nan(amax[0]);
        amax[1] = frag::quad_max_nan(amax[1]);
        break;
      case Granularity::per_thread:
        amax[0] = amax[1] = frag::quad_max_nan(rules::max_nan(amax[0], amax[1]));
        break;
      case Granularity::per_warp:
        amax[0] = amax[1] = frag::warp_max_nan(rules::max_nan(amax[0], amax[1]));
        break;
      default: {  // per_block: all consumer warpgroups (the whole Q tile)
        const float w = frag::warp_max_nan(rules::max_nan(amax[0], amax[1]));
        if (lane == 0) s_red[consumer_warp] = w;
        named_barrier_sync(NamedBarrier::q_stats, 32 * kConsumerWarps);
        float m = s_red[0];
#pragma unroll
        for (int i = 1; i < kConsumerWarps; ++i) m = rules::max_nan(m, s_red[i]);
        amax[0] = amax[1] = m;
        break;
      }
    }

    float inv[2];
    const float q_max = float(p.q_max);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      if (prequantized) {  // the codes go in as they are, with the caller's scales
        scale[r] = rows[r] < n_q ? q_scale_head[(int64_t)rows[r] * p.qs_stride_n] : 0.f;
        inv[r] = 1.f;
      } else {
        scale[r] = rules::symmetric_scale(amax[r], q_max);
        inv[r] = rules::symmetric_inverse(amax[r], q_max);
      }
    }
    // Codes by round_to_low_bits (ptx.cuh): the low byte of the product rounded to nearest
    // even, in two's complement. No clamp is needed for the codes of rules::round_clamp: each
    // value is at most its group's amax in magnitude, so |x * inv| <= q_max (1 + 2^-23)^2
    // rounds into [-q_max, q_max] (prequantized codes: inv = 1, exact, -128 included). Finite
    // inputs only, as the simulator. Per value an FMUL and an FADD, and three byte permutes per
    // four values, where rintf, the two-sided clamp and the float-to-int conversion took four
    // instructions beside the FMUL (v16).
    const uint32_t s_q_addr = smem_addr(s_q);
    const int warp_row0 = 16 * (consumer_warp % 4) + frag::group_of_lane(lane);
#pragma unroll
    for (int kc = 0; kc < kChunks; ++kc)
#pragma unroll
      for (int half = 0; half < 2; ++half)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          uint32_t c[4];
#pragma unroll
          for (int i = 0; i < 4; ++i)
            c[i] = round_to_low_bits(__fmul_rn(x[kc][half][r][i], inv[r]));
          const int row = warp_row0 + 8 * r, col = 32 * kc + 16 * half + 4 * t;
          st_shared_u32(s_q_addr + QKLayout<D>::template offset<64>(row, col),
                        __byte_perm(__byte_perm(c[0], c[1], 0x0040), __byte_perm(c[2], c[3], 0x0040),
                                    0x5410));
        }
    // The MMA reads the tile through the async proxy: make the stores visible to it, then
    // wait for the whole warpgroup (which also publishes s_mean).
    fence_proxy_async();
    named_barrier_sync(NamedBarrier::q_stored(consumer_warp / 4), 128);
  }

 private:
  // x[c] / s_c for the head's balance scales s (powers of two: the reciprocal is exact, and so
  // is the product, as the simulator's division).
  __device__ static void divide_by_balance(float (&x)[kChunks][2][2][4], const float* s, int t) {
#pragma unroll
    for (int kc = 0; kc < kChunks; ++kc)
#pragma unroll
      for (int half = 0; half < 2; ++half)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const float inv = rules::reciprocal_pow2(s[32 * kc + 16 * half + 4 * t + i]);
          x[kc][half][0][i] = __fmul_rn(x[kc][half][0][i], inv);
          x[kc][half][1][i] = __fmul_rn(x[kc][half][1][i], inv);
        }
  }

  // Q smoothing (SageAttention2): subtract the mean over the CTA's Q tile (all consumer
  // warpgroups, tile_rows valid rows) from every valid row. Sums run in double: a sum of at
  // most 192 fp16 values is exact there (bf16 values: while their exponents lie within ~37
  // binades of each other), so the mean has the simulator's bits in any order.
  __device__ void subtract_tile_mean(float (&x)[kChunks][2][2][4], const int (&rows)[2], int n_q,
                                     int tile_rows, int lane, int consumer_warp, double* s_sum,
                                     float* s_mean) {
    const int t = frag::quad_of_lane(lane);
#pragma unroll
    for (int kc = 0; kc < kChunks; ++kc)
#pragma unroll
      for (int half = 0; half < 2; ++half)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          double cs = double(x[kc][half][0][i]) + double(x[kc][half][1][i]);
#pragma unroll
          for (int off = 4; off < 32; off *= 2) cs += __shfl_xor_sync(0xffffffffu, cs, off);
          if (lane < 4) s_sum[consumer_warp * D + 32 * kc + 16 * half + 4 * t + i] = cs;
        }
    named_barrier_sync(NamedBarrier::q_stats, 32 * kConsumerWarps);
#pragma unroll
    for (int kc = 0; kc < kChunks; ++kc)
#pragma unroll
      for (int half = 0; half < 2; ++half)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int c = 32 * kc + 16 * half + 4 * t + i;
          double total = 0.0;
#pragma unroll
          for (int w = 0; w < kConsumerWarps; ++w) total += s_sum[w * D + c];
          const float mean = float(total / double(tile_rows));
          if (consumer_warp % 4 == 0 && lane < 4) s_mean[c] = mean;
#pragma unroll
          for (int r = 0; r < 2; ++r)
            if (rows[r] < n_q) x[kc][half][r][i] -= mean;
        }
  }
};

// Q smoothing's logit bias of key j of the tile in shared memory: dS_j = mean(Q_tile) . K_j,
// dequantized and in the base-2 logit domain, in the simulator's order (eight interleaved
// partial sums, a fixed tree, no fused multiply-adds: docs/numerics.md step 4) so that it has
// the simulator's bits.
template <int D>
__device__ __forceinline__ float smooth_q_key_bias(const int8_t* k_tile, int j, const float* q_mean,
                                                   float k_scale, float sm_scale_log2) {
  float part[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int c0 = 0; c0 < D; c0 += 16) {
    const int4 w = *reinterpret_cast<const int4*>(k_tile + QKLayout<D>::template offset<kBlockKV>(j, c0));
    const int8_t* b = reinterpret_cast<const int8_t*>(&w);
#pragma unroll
    for (int i = 0; i < 16; ++i)
      part[i % 8] = __fadd_rn(part[i % 8], __fmul_rn(q_mean[c0 + i], float(b[i])));
  }
  const float acc = __fadd_rn(__fadd_rn(__fadd_rn(part[0], part[1]), __fadd_rn(part[2], part[3])),
                              __fadd_rn(__fadd_rn(part[4], part[5]), __fadd_rn(part[6], part[7])));
  return __fmul_rn(__fmul_rn(k_scale, acc), sm_scale_log2);
}

}  // namespace sage::sm90
