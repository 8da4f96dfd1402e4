// The Q channel-range pass of qk_channel_balance (docs/numerics.md, step 2): for every
// (batch, KV head), max |Q[t][c]| per channel c over every token of every query head of the
// KV head's group. The K/V statistics pass turns these ranges and K's into the balance
// scales s_c (kv_prepass.cu); the attention kernel divides Q by them as it quantizes. The
// tokens are sampled with the stride of K's statistics: a channel's offset (the case the
// balance is for) shows in every token, and the full read cost ~7% of the call at N = 1K.
//
// Why a pass of its own: the ranges must be complete before any K tile is quantized, and the
// attention kernel reads Q only after the K/V pre-pass. It costs one read of Q.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace sage::quant {

struct QRangeParams {
  const void* q;                           // fp16/bf16 [B, Hq, Nq, D] through the strides
  int64_t q_stride_b, q_stride_h, q_stride_n;  // in elements
  int batch, heads_q, heads_kv, n_q;
  int head_dim;  // the caller's (a multiple of 8, <= D): channels from it on read as zeros
  int stride;  // the tokens read: 0, stride, 2 stride, ... of each head (recipe.k_mean_stride)
  int samples;  // how many that is per head (set by the launch)
  float* q_amax;  // [B, Hkv, D] (D: kv_layout_head_dim): written here (zeroed first by the launch)
  // Packed variable-length batches: int32 [batch + 1] query offsets in device memory (null
  // for a dense batch). Entry b is then sequence b, tokens cu_seqlens_q[b] .. [b + 1] - 1 of
  // the packed q (q_stride_b 0, n_q max_seqlen_q): its ranges are its own tokens'.
  const int* cu_seqlens_q;
};

template <int D, class T>
void launch_q_channel_range(const QRangeParams& p, cudaStream_t stream);

}  // namespace sage::quant
