// Packed variable-length batches: several sequences of different lengths in one call, with
// FlashAttention's flash_attn_varlen_func names (code written for it ports by renaming).
//
//   q    [total_q, heads_q,  head_dim]   fp16 / bf16 (f32 allowed on the CPU)
//   k, v [total_k, heads_kv, head_dim]   same dtype as q
//   out  [total_q, heads_q,  head_dim]   any float dtype on the CPU
//   lse  [heads_q, total_q]              f32, optional (the packed form FlashAttention uses)
//   cu_seqlens_q [batch + 1], cu_seqlens_k [batch + 1]   i32, in host memory
// Sequence b owns query tokens cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1 and key tokens
// cu_seqlens_k[b] .. cu_seqlens_k[b + 1] - 1. The offsets start at 0, never decrease, and end
// at the token counts; max_seqlen_q / max_seqlen_k are at least the longest sequence (they
// size FlashAttention's grid, so an upper bound is accepted, a smaller value refused).
//
// Each sequence is its own attention problem, exactly the dense call on its tokens alone
// (sequence_args): the mask is aligned bottom-right per sequence (causal, window_size), and
// every statistic the recipe takes over tokens (K's mean, V's scales, Q's block means, the
// Q/K channel balance's ranges) is taken over that sequence only, so nothing leaks between
// sequences. A sequence with no query token writes nothing; one with query tokens and no key
// writes output 0 and LSE -inf.
//
// Only the CPU references run varlen today. The sm_90 kernel does not exist yet:
// attention_varlen() refuses every call by name (argument "cu_seqlens_q").
// Prequantized INT8 inputs are refused too (their scales have no packed form yet).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

#include "sage/attention.h"
#include "sage/recipe.h"
#include "sage/tensor.h"

namespace sage {

struct VarlenArgs {
  TensorView q, k, v;  // packed [total_tokens, heads, head_dim], head_dim contiguous
  TensorView out;
  TensorView lse;  // optional: leave undefined to skip
  TensorView cu_seqlens_q, cu_seqlens_k;  // i32 [batch + 1], host memory
  int64_t max_seqlen_q = 0, max_seqlen_k = 0;
  bool causal = false;
  int64_t window_left = -1, window_right = -1;  // as AttentionArgs, per sequence
  std::optional<float> sm_scale;                // default 1/sqrt(head_dim)
  Recipe recipe = Recipe{};                     // default: the sage2_8b preset's options
};

// The shape facts of a validated varlen call, with the offsets read once.
struct VarlenProblem {
  int64_t batch = 0, heads_q = 0, heads_kv = 0, total_q = 0, total_k = 0, head_dim = 0;
  std::vector<int64_t> cu_seqlens_q, cu_seqlens_k;  // batch + 1 entries each
  int64_t seqlen_q(int64_t b) const { return cu_seqlens_q[b + 1] - cu_seqlens_q[b]; }
  int64_t seqlen_k(int64_t b) const { return cu_seqlens_k[b + 1] - cu_seqlens_k[b]; }
};

// Checks every argument and returns the problem; throws sage::Error naming the first bad
// argument. The offsets are read here, so they must be in host memory.
VarlenProblem check_varlen_args(const VarlenArgs& args);

// Sequence b of a checked call as a dense call: NHD views of batch 1 into the packed q, k, v,
// out and lse (no copy), with the mask, scale and recipe of `args`.
AttentionArgs sequence_args(const VarlenArgs& args, const VarlenProblem& p, int64_t b);

// The GPU entry point. No sm_90 kernel for packed batches exists yet: every call throws
// sage::Error("cu_seqlens_q", ...) saying so, before anything is read or enqueued.
void attention_varlen(const VarlenArgs& args, void* workspace, size_t workspace_size, void* stream);

namespace reference {
// reference::exact and reference::simulate run on each sequence, into the packed out and lse.
void exact_varlen(const VarlenArgs& args);
void simulate_varlen(const VarlenArgs& args);
}  // namespace reference

}  // namespace sage
