// The backward's pre-pass, one CTA per 64-row Q tile of a (batch, query head)
// (docs/numerics.md, "The backward", step 2 and "What the forward saves"):
//   - D_i = dO_i . O_i: the exact products of the 16-bit values summed in double, rounded once
//     to float; beside it the forward's L2 copied into the kernel's padded row array;
//   - dO's INT8 codes with one scale per 64-row tile (the tile's rows x all channels), stored
//     transposed (dV's B operand, kp_row order: kernel_traits.h);
//   - Q's INT8 codes as the forward made them: one scale per forward Q block (block_q rows of
//     tile_config, per_block Q), amax over the block's rows, code = rint(x * 127 / amax). They
//     are deterministic, so the backward recomputes them instead of the forward saving them.
//     Stored both ways: [row][channel] (S^T's B) and transposed in kp_row order (dK's B).
// Rows at or past n_q get zero codes, L2 = -inf and D = 0.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "numerics/quant_rules.h"
#include "sm90/bwd/kernel_traits.h"
#include "sm90/bwd/params.h"

namespace sage::sm90::bwd {

template <class T>
__device__ __forceinline__ float to_float(T x) {
  if constexpr (std::is_same_v<T, __half>) return __half2float(x);
  else return __bfloat162float(x);
}

// The largest |x| over the CTA (finite inputs: fmaxf; as the simulator's std::max).
constexpr int kPrepThreads = 256;

__device__ __forceinline__ float block_max(float x, float* s_red) {
#pragma unroll
  for (int off = 16; off > 0; off /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, off));
  __syncthreads();  // s_red free
  if (threadIdx.x % 32 == 0) s_red[threadIdx.x / 32] = x;
  __syncthreads();
  float m = s_red[0];
#pragma unroll
  for (int w = 1; w < kPrepThreads / 32; ++w) m = fmaxf(m, s_red[w]);
  return m;
}

template <int D, class T>
__global__ void __launch_bounds__(kPrepThreads) backward_prep_kernel(const BackwardParams p) {
  constexpr int kPrepWarps = kPrepThreads / 32;
  __shared__ float s_red[kPrepWarps];
  const int tile = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int64_t bh = (int64_t)b * p.heads_q + h;
  const int i0 = tile * kBlockQ;
  const int rows = min(kBlockQ, p.n_q - i0);  // may be <= 0 for padding tiles
  const T* q = static_cast<const T*>(p.q) + b * p.q_sb + h * p.q_sh;
  const T* dout = static_cast<const T*>(p.dout) + b * p.do_sb + h * p.do_sh;
  const T* o = static_cast<const T*>(p.out) + b * p.o_sb + h * p.o_sh;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;

  // L2 and D padded: the kernel reads a whole tile of each.
  if (threadIdx.x < kBlockQ) {
    const int a = threadIdx.x;
    p.l2p[bh * p.n_q_pad + i0 + a] = a < rows ? p.lse2[bh * p.n_q + i0 + a] : -INFINITY;
    if (a >= rows) p.delta[bh * p.n_q_pad + i0 + a] = 0.f;
  }
  // D: a warp per row.
  for (int a = warp; a < rows; a += kPrepWarps) {
    const int64_t i = i0 + a;
    double s = 0.0;
    for (int c = lane; c < D; c += 32)
      s += double(to_float(dout[i * p.do_sn + c])) * double(to_float(o[i * p.o_sn + c]));
#pragma unroll
    for (int off = 16; off > 0; off /= 2) s += __shfl_xor_sync(0xffffffffu, s, off);
    if (lane == 0) p.delta[bh * p.n_q_pad + i] = float(s);
  }

  // dO codes, one scale for the tile.
  float amax = 0.f;
  for (int e = threadIdx.x; e < kBlockQ * D; e += kPrepThreads) {
    const int a = e / D, c = e % D;
    if (a < rows) amax = fmaxf(amax, fabsf(to_float(dout[(int64_t)(i0 + a) * p.do_sn + c])));
  }
  amax = block_max(amax, s_red);
  const float fq = float(rules::kInt8Max);
  float inv = rules::symmetric_inverse(amax, fq);
  if (threadIdx.x == 0) p.do_scale[bh * (p.n_q_pad / kBlockQ) + tile] = rules::symmetric_scale(amax, fq);
  // Transposed [channel][row position]: consecutive threads write consecutive positions.
  int8_t* do8t = p.do8t + bh * D * p.n_q_pad + i0;
  for (int e = threadIdx.x; e < kBlockQ * D; e += kPrepThreads) {
    const int c = e / kBlockQ, kp = e % kBlockQ, a = (kp & ~31) + kp_row(kp & 31);
    const float x = a < rows ? to_float(dout[(int64_t)(i0 + a) * p.do_sn + c]) : 0.f;
    do8t[(int64_t)c * p.n_q_pad + kp] = int8_t(rules::round_clamp(__fmul_rn(x, inv), rules::kInt8Max));
  }

  // Q codes with the forward block's scale (per_block Q: the block's rows inside n_q).
  const int f0 = i0 / p.fwd_block_q * p.fwd_block_q;
  const int f1 = min(p.n_q, f0 + p.fwd_block_q);
  amax = 0.f;
  for (int64_t e = threadIdx.x; e < (int64_t)max(0, f1 - f0) * D; e += kPrepThreads) {
    const int64_t i = f0 + e / D;
    amax = fmaxf(amax, fabsf(to_float(q[i * p.q_sn + e % D])));
  }
  amax = block_max(amax, s_red);
  inv = rules::symmetric_inverse(amax, fq);
  if (threadIdx.x == 0) p.q_scale[bh * (p.n_q_pad / kBlockQ) + tile] = rules::symmetric_scale(amax, fq);
  int8_t* q8 = p.q8 + (bh * p.n_q_pad + i0) * D;
  for (int e = threadIdx.x; e < kBlockQ * D; e += kPrepThreads) {
    const int a = e / D, c = e % D;
    const float x = a < rows ? to_float(q[(int64_t)(i0 + a) * p.q_sn + c]) : 0.f;
    q8[e] = int8_t(rules::round_clamp(__fmul_rn(x, inv), rules::kInt8Max));
  }
  int8_t* q8t = p.q8t + bh * D * p.n_q_pad + i0;
  for (int e = threadIdx.x; e < kBlockQ * D; e += kPrepThreads) {
    const int c = e / kBlockQ, kp = e % kBlockQ, a = (kp & ~31) + kp_row(kp & 31);
    const float x = a < rows ? to_float(q[(int64_t)(i0 + a) * p.q_sn + c]) : 0.f;
    q8t[(int64_t)c * p.n_q_pad + kp] = int8_t(rules::round_clamp(__fmul_rn(x, inv), rules::kInt8Max));
  }
}

}  // namespace sage::sm90::bwd
