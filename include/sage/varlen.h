// Packed variable-length batches: several sequences of different lengths in one call, with
// FlashAttention's flash_attn_varlen_func names (code written for it ports by renaming).
//
//   q    [total_q, heads_q,  head_dim]     fp16 / bf16 (f32 allowed on the CPU)
//   k    [total_k, heads_kv, head_dim]     same dtype as q
//   v    [total_k, heads_kv, head_dim_v]   same dtype as q; V may have its own head dim
//   out  [total_q, heads_q,  head_dim_v]   any float dtype on the CPU; V's head dim
//   lse  [heads_q, total_q]                f32, optional (the packed form FlashAttention uses)
//   cu_seqlens_q [batch + 1], cu_seqlens_k [batch + 1]   i32: in host memory for the CPU
//                                          references, in device memory for attention_varlen
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
// The CPU references (reference::simulate_varlen / exact_varlen) read the offsets on the host.
// The GPU path (attention_varlen) takes them in device memory, as flash_attn_varlen_func
// does, and never reads them on the host (no synchronization; CUDA-graph capture): its grid
// and workspace come from batch, max_seqlen_q / max_seqlen_k and the head counts, so the
// offsets' contract above is the caller's (a length above max_seqlen is cut to max_seqlen on
// the device rather than read out of bounds; nothing else is checked there).
// Prequantized INT8 inputs are refused (their scales have no packed form yet).
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
  TensorView q, k, v;  // packed [tokens, heads, head_dim] (v: head_dim_v), last dim contiguous
  TensorView out;
  TensorView lse;  // optional: leave undefined to skip
  // i32 [batch + 1]: host memory (CPU references) or device memory (attention_varlen), as the
  // views' device says.
  TensorView cu_seqlens_q, cu_seqlens_k;
  int64_t max_seqlen_q = 0, max_seqlen_k = 0;
  bool causal = false;
  int64_t window_left = -1, window_right = -1;  // as AttentionArgs, per sequence
  std::optional<float> sm_scale;                // default 1/sqrt(head_dim), q's head dim
  Recipe recipe = Recipe{};                     // default: the sage2_8b preset's options
};

// The shape facts of a validated varlen call, with the offsets read once.
struct VarlenProblem {
  int64_t batch = 0, heads_q = 0, heads_kv = 0, total_q = 0, total_k = 0, head_dim = 0;
  int64_t head_dim_v = 0;  // v's (and out's) head dim
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

// ---- GPU (sm_90a) -------------------------------------------------------------------------
// Bytes of device workspace attention_varlen needs: the quantized K/V laid out per sequence,
// each padded to whole 128-key tiles of max_seqlen_k (at most total_k): a dense batch of
// `batch` entries of max_seqlen_k keys, sized from host-known values only (batch from the
// offsets' shape, never their contents), so the same size serves CUDA-graph replays.
size_t varlen_workspace_bytes(const VarlenArgs& args);
// The same from sizes alone (what a traced graph knows): batch = cu_seqlens' length - 1,
// total_k = k's token count. Shape arithmetic only; equal to the above for such arguments.
// head_dim_v: V's head dim where it differs from K's; -1: the same.
size_t varlen_workspace_bytes(int64_t batch, int64_t heads_kv, int64_t max_seqlen_k,
                              int64_t total_k, int64_t head_dim, const Recipe& recipe,
                              int64_t head_dim_v = -1);

// Runs a packed batch on the GPU on `stream`. Asynchronous; throws sage::Error for bad
// arguments (naming them) before anything is enqueued. cu_seqlens_q / cu_seqlens_k in device
// memory (i32, contiguous), max_seqlen_q / max_seqlen_k upper bounds of the lengths. Every
// statistic is per sequence (the pre-pass reads sequence b into the workspace's entry b; the
// kernel's items are (sequence, head, Q tile) and an item past its sequence's end exits), so a
// sequence's output does not depend on its neighbours, bit for bit.
void attention_varlen(const VarlenArgs& args, void* workspace, size_t workspace_size, void* stream);

namespace reference {
// reference::exact and reference::simulate run on each sequence, into the packed out and lse.
void exact_varlen(const VarlenArgs& args);
void simulate_varlen(const VarlenArgs& args);
}  // namespace reference

}  // namespace sage
