// The problem's shape per work item: how many Q and K/V rows its batch entry has and where
// its head's rows start. A dense batch has the same lengths in every entry (UniformSeqLen); a
// packed variable-length batch (VarlenSeqLen) reads each sequence's from cu_seqlens in device
// memory. The kernel takes one or the other at compile time (SeqLenOf<K::kVarlen>).
#pragma once

#include <cstdint>
#include <type_traits>

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

// Sequence b of a packed batch (AttentionParams::cu_seqlens_q/_k): its Q rows are the packed
// rows from cu_seqlens_q[b], so offsets are the first row's plus the head's (the batch strides
// are 0), and its lengths are the offsets' differences, clamped to [0, max_seqlen] (n_q, n_kv):
// offsets that break the call's contract (sage/varlen.h) can neither index past the
// workspace's entry of the sequence nor make the mask's arithmetic overflow. The quantized K/V
// is laid out as a dense batch of max_seqlen_k keys per entry (the pre-pass writes sequence b
// into entry b), so its members are UniformSeqLen's. The offsets are re-read at each use (two
// loads that hit L1) rather than kept live through the K/V loop.
struct VarlenSeqLen {
  const AttentionParams& p;

  // One offset, loaded where the call stands (a volatile asm stays behind the K/V loop's
  // volatile MMAs and barrier waits: the epilogue's loads are not hoisted above the loop and
  // held through it).
  __device__ __forceinline__ static int load(const int* at) {
    int v;
    asm volatile("ld.global.nc.b32 %0, [%1];" : "=r"(v) : "l"(at));
    return v;
  }
  __device__ __forceinline__ int first_q(int b) const { return load(p.cu_seqlens_q + b); }

  __device__ __forceinline__ int n_q(int b) const {
    return min(max(load(p.cu_seqlens_q + b + 1) - load(p.cu_seqlens_q + b), 0), p.n_q);
  }
  __device__ __forceinline__ int n_kv(int b) const {
    return min(max(load(p.cu_seqlens_k + b + 1) - load(p.cu_seqlens_k + b), 0), p.n_kv);
  }
  __device__ __forceinline__ int64_t q_offset(int b, int h) const {
    return (int64_t)first_q(b) * p.q_stride_n + h * p.q_stride_h;
  }
  __device__ __forceinline__ int64_t out_offset(int b, int h) const {
    return (int64_t)first_q(b) * p.o_stride_n + h * p.o_stride_h;
  }
  __device__ __forceinline__ int64_t lse_offset(int b, int h) const {
    return (int64_t)first_q(b) * p.lse_stride_n + h * p.lse_stride_h;
  }
  __device__ __forceinline__ int64_t kv_head(int b, int hk) const { return UniformSeqLen{p}.kv_head(b, hk); }
  __device__ __forceinline__ int k_row0(int b, int hk) const { return UniformSeqLen{p}.k_row0(b, hk); }
  template <int Row>
  __device__ __forceinline__ int v_row0(int b, int hk) const { return UniformSeqLen{p}.template v_row0<Row>(b, hk); }
};

template <bool kVarlen>
using SeqLenOf = std::conditional_t<kVarlen, VarlenSeqLen, UniformSeqLen>;

}  // namespace sage::sm90
