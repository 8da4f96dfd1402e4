// Public entry points: quantized attention on the GPU and its two CPU references.
//
//   out = softmax(sm_scale * Q K^T + mask) V       (computed the way `recipe` says)
//
// Shapes (Layout::HND; NHD swaps the tokens and heads dimensions):
//   q   [batch, heads_q,  n_q,  head_dim]   fp16 / bf16 (or int8 for prequantized inputs)
//   k   [batch, heads_kv, n_kv, head_dim]   same dtype as q
//   v   [batch, heads_kv, n_kv, head_dim]   same dtype as q
//   out [batch, heads_q,  n_q,  head_dim]   fp16 / bf16 (the input dtype; f32/f64 allowed on CPU)
//   lse [batch, heads_q, n_q]               f32, optional: natural-log sum of exp(sm_scale q.k)
// heads_q must be a multiple of heads_kv (GQA; heads_kv = 1 is MQA).
//
// Causal masking is aligned bottom-right (as FlashAttention-2/3): query i may attend key j
// iff j <= i + (n_kv - n_q). A query row with no key to attend (n_q > n_kv) outputs zeros
// and its LSE is -inf.
#pragma once

#include <cstdint>

#include <cstddef>
#include <optional>

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
  std::optional<float> sm_scale;  // default 1/sqrt(head_dim)
  Recipe recipe = Recipe{};       // default: the sage2_8b preset's options

  // Prequantized inputs only (recipe.inputs == Inputs::prequantized_int8), all f32:
  //   q_scale [batch, heads_q, n_q], k_scale [batch, heads_kv, n_kv] (per token),
  //   v_scale [batch, heads_kv] (per tensor) or [batch, heads_kv, head_dim] (per channel).
  TensorView q_scale, k_scale, v_scale;
};

// The shape facts every entry point derives once from validated arguments.
struct Problem {
  int64_t batch = 0, heads_q = 0, heads_kv = 0, n_q = 0, n_kv = 0, head_dim = 0;
  float sm_scale = 0.f;
};

// Checks every argument and returns the problem's shape; throws sage::Error naming the
// first bad argument. `device` says where the data must live.
Problem check_args(const AttentionArgs& args, DeviceKind device);

// ---- GPU (sm_90a) -------------------------------------------------------------------------

// Bytes of device workspace attention() needs for these arguments (quantized K and V,
// scales, means). No call allocates: the caller passes at least this much.
size_t workspace_bytes(const AttentionArgs& args);

// Runs attention on the GPU on `stream` (a cudaStream_t; nullptr is the legacy stream).
// Asynchronous: returns once the work is enqueued; throws sage::Error for bad arguments
// before anything is enqueued and sage::CudaError if a launch fails.
void attention(const AttentionArgs& args, void* workspace, size_t workspace_size, void* stream);

// True when this build has GPU kernels and a device of compute capability 9.0 is present.
bool gpu_available();
// The head dims this build instantiated kernels for (a build option restricts them).
const char* gpu_head_dims();

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
