// The problem's shape per work item: how many Q and K/V rows its batch entry has and where
// its head's rows start. Every batch entry has the same lengths today (UniformSeqLen); a packed
// variable-length batch is a second type with the same members, reading cu_seqlens.
#pragma once

#include <cstdint>

#include "sm90/fwd/params.h"

namespace sage::sm90 {

struct UniformSeqLen {
  const AttentionParams& p;

  // Lengths of batch entry b (the same for all).
  __device__ __forceinline__ int n_q(int /*b*/) const { return p.n_q; }
  __device__ __forceinline__ int n_kv(int /*b*/) const { return p.n_kv; }
  // Offsets, in elements, of the first row of (batch b, head h) in Q and the output.
  __device__ __forceinline__ int64_t q_offset(int b, int h) const {
    return b * p.q_stride_b + h * p.q_stride_h;
  }
  __device__ __forceinline__ int64_t out_offset(int b, int h) const {
    return b * p.o_stride_b + h * p.o_stride_h;
  }
  __device__ __forceinline__ int64_t lse_offset(int b, int h) const {
    return b * p.lse_stride_b + h * p.lse_stride_h;
  }
  // The quantized K/V head (b, kv head hk): its index in the workspace, and its first K row
  // and V row in the TMA maps' 2-D views (Row: the workspace's channels per head,
  // quant::kv_layout_head_dim).
  __device__ __forceinline__ int64_t kv_head(int b, int hk) const { return (int64_t)b * p.heads_kv + hk; }
  __device__ __forceinline__ int k_row0(int b, int hk) const { return (b * p.heads_kv + hk) * p.n_pad; }
  template <int Row>
  __device__ __forceinline__ int v_row0(int b, int hk) const { return (b * p.heads_kv + hk) * Row; }
};

}  // namespace sage::sm90
