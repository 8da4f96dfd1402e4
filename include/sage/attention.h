// Public entry points: quantized attention on the GPU and its two CPU references.
//
//   out = softmax(sm_scale * Q K^T + mask) V       (computed the way `recipe` says)
//
// Shapes (Layout::HND; NHD swaps the tokens and heads dimensions):
//   q   [batch, heads_q,  n_q,  head_dim]    fp16 / bf16 (or int8 for prequantized inputs)
//   k   [batch, heads_kv, n_kv, head_dim]    same dtype as q
//   v   [batch, heads_kv, n_kv, head_dim_v]  same dtype as q
//   out [batch, heads_q,  n_q,  head_dim_v]  fp16 / bf16 (the input dtype; f32/f64 allowed on CPU)
//   lse [batch, heads_q, n_q]                f32, optional: natural-log sum of exp(sm_scale q.k)
// heads_q must be a multiple of heads_kv (GQA; heads_kv = 1 is MQA). V may have its own head
// dim (head_dim_v; DeepSeek MLA's prefill has head_dim 192, head_dim_v 128); out has V's. The
// scores use head_dim (and the default sm_scale is 1/sqrt(head_dim)); V and out use head_dim_v.
//
// Masks are aligned bottom-right (as FlashAttention-2/3). With off = n_kv - n_q, query i
// attends key j iff
//     i + off - window_left <= j <= i + off + window_right
// where a window bound of -1 is unbounded on that side (the default: no mask). causal is
// window_right = 0, and combines with a left window (a sliding window over past keys). A
// query row with no key to attend (causal or a right window with n_q > n_kv + window_right,
// or n_kv = 0) outputs zeros and its LSE is -inf, never NaN.
//
// Packed variable-length batches (FlashAttention's cu_seqlens form) are sage/varlen.h: the CPU
// references run them; the GPU has no kernel for them yet.
#pragma once

#include <cstdint>

#include <cstddef>
#include <optional>
#include <vector>

#include "sage/error.h"
#include "sage/recipe.h"
#include "sage/tensor.h"

namespace sage {

struct AttentionArgs {
  TensorView q, k, v;
  TensorView out;
  TensorView lse;  // optional: leave undefined (data == nullptr, ndim == 0) to skip
  Layout layout = Layout::HND;
  bool causal = false;
  // The sliding window (FlashAttention's window_size = (left, right)): -1 or >= 0 each. With
  // causal, window_right must be -1 or 0. Keys outside the window are masked; statistics the
  // recipe takes over keys (K smoothing's mean, V's scales) still cover every key.
  int64_t window_left = -1, window_right = -1;
  std::optional<float> sm_scale;  // default 1/sqrt(head_dim), q's head dim
  Recipe recipe = Recipe{};       // default: the sage2_8b preset's options

  // Prequantized inputs only (recipe.inputs == Inputs::prequantized_int8), all f32:
  //   q_scale [batch, heads_q, n_q], k_scale [batch, heads_kv, n_kv] (per token),
  //   v_scale [batch, heads_kv] (per tensor) or [batch, heads_kv, head_dim_v] (per channel).
  TensorView q_scale, k_scale, v_scale;
};

// The shape facts every entry point derives once from validated arguments.
struct Problem {
  int64_t batch = 0, heads_q = 0, heads_kv = 0, n_q = 0, n_kv = 0, head_dim = 0;
  int64_t head_dim_v = 0;  // v's (and out's) head dim; equal to head_dim in the usual case
  float sm_scale = 0.f;
  // The mask as the window every entry point applies: causal folded in as window_right = 0,
  // and a bound that masks no key of any row (e.g. window_left >= n_kv - 1) set to -1.
  int64_t window_left = -1, window_right = -1;
};

// Checks every argument and returns the problem's shape; throws sage::Error naming the
// first bad argument. `device` says where the data must live.
Problem check_args(const AttentionArgs& args, DeviceKind device);
// The same checks for the K/V half of a call only (k, v, k_scale, v_scale, layout, recipe):
// q, out and lse are ignored. The result has heads_q = heads_kv and n_q = 0.
Problem check_kv_args(const AttentionArgs& args, DeviceKind device);

// ---- GPU (sm_90a) -------------------------------------------------------------------------

// Bytes of device workspace attention() needs for these arguments (quantized K and V,
// scales, means): kv_workspace_bytes of their shapes. No call allocates: the caller passes at
// least this much.
size_t workspace_bytes(const AttentionArgs& args);

// Runs attention on the GPU on `stream` (a cudaStream_t; nullptr is the legacy stream).
// Asynchronous: returns once the work is enqueued; throws sage::Error for bad arguments
// before anything is enqueued and sage::CudaError if a launch fails.
void attention(const AttentionArgs& args, void* workspace, size_t workspace_size, void* stream);

// ---- GPU in two steps ----------------------------------------------------------------------
// attention() is quantize_kv() followed by attention_from_quantized_kv() on one workspace.
//   * quantize_kv reads k, v (and, for prequantized inputs, k_scale and v_scale), layout and
//     recipe, and writes the quantized K/V into the workspace. q, out and lse may be left
//     undefined: they are not checked or read.
//   * attention_from_quantized_kv checks the whole call (k and v must describe the tensors
//     quantize_kv saw, for their shapes; their data is not read), reads q and the workspace,
//     and writes out and lse.
// Between the two, the workspace holds this recipe's quantized K/V and may serve any number
// of attention calls (a KV cache, several query sets, or timing the attention kernel alone).
// Its size depends only on the K/V shapes and the recipe (head_dim_v: V's head dim where it
// differs from K's; -1: the same):
size_t kv_workspace_bytes(int64_t batch, int64_t heads_kv, int64_t n_kv, int64_t head_dim,
                          const Recipe& recipe, int64_t head_dim_v = -1);
void quantize_kv(const AttentionArgs& args, void* workspace, size_t workspace_size, void* stream);
void attention_from_quantized_kv(const AttentionArgs& args, const void* workspace,
                                 size_t workspace_size, void* stream);

// Whether `recipe` has an sm_90 kernel (the same rule attention() applies; it refuses any
// other recipe with an error that names what is missing). False in a CPU-only build. The one
// condition that needs the head dim is not part of it: on the two-level E4M3 path the kernel
// takes the row sum from its PV MMA from d = 128, so there attention() refuses row_sum float_p
// or quantized_p ("recipe.row_sum"; rules::row_sum_in_pv_mma).
bool gpu_supports(const Recipe& recipe);

// True when this build has GPU kernels and a device of compute capability 9.0 is present.
bool gpu_available();
// The head dims the GPU path of this build accepts, e.g. "32, 40, ..., 128": every multiple of
// 8 from 32 whose kernel tile (numerics/tile.h, kernel_head_dim) is instantiated; a dim between
// tiles runs on the next one, zero-padded inside the kernel. "" in a build without CUDA.
const char* gpu_head_dims();
// The same as numbers; a build without CUDA gives the head dims a CUDA build of this source
// accepts by default.
std::vector<int64_t> gpu_head_dim_list();
// The head dims with a kernel tile of their own in this build (a build option restricts them),
// e.g. "64, 96, 128"; "" without CUDA. The list form falls back as gpu_head_dim_list does.
const char* gpu_kernel_head_dims();
std::vector<int64_t> gpu_kernel_head_dim_list();

// ---- CPU references ----------------------------------------------------------------------

namespace reference {
// float64 attention; writes args.out (any float dtype) and args.lse if given.
// The recipe is ignored except for recipe.inputs (prequantized inputs are dequantized).
void exact(const AttentionArgs& args);
// The recipe computed on the CPU with exactly the kernel's quantization (group maps, scale
// formulas, rounding, encodings, accumulator behaviour, online-softmax blocking).
void simulate(const AttentionArgs& args);
}  // namespace reference

}  // namespace sage
