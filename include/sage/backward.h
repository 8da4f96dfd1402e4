// The backward pass of attention (training): the gradients of out = softmax(sm_scale Q K^T +
// mask) V with respect to Q, K and V, given the gradient dO of the output.
//
// Only recipes with a backward (has_backward: the sagebwd and sagebwd_block presets, SageBwd's
// configuration, or a custom recipe that sets the four backward formats) have one;
// docs/numerics.md, "The backward", states what it computes step by step. The CPU references
// and the GPU entry point (attention_backward, sm_90a: sagebwd's configuration) live here.
//
// Shapes follow attention.h (HND shown; NHD swaps tokens and heads):
//   q, dout, dq, out  [batch, heads_q,  n_q,  head_dim]
//   k, v, dk, dv      [batch, heads_kv, n_kv, head_dim]
//   lse               [batch, heads_q, n_q] f32 (optional, written)
// dk and dv of a KV head are summed over the query heads that share it (GQA/MQA). v's head dim
// must be q's: the forward's V head dim of its own (attention.h) has no backward.
#pragma once

#include <optional>

#include "sage/attention.h"
#include "sage/recipe.h"
#include "sage/tensor.h"

namespace sage {

struct BackwardArgs {
  TensorView q, k, v;   // the forward's inputs: f16 / bf16 (f32 on the CPU)
  TensorView dout;      // dO: q's shape and dtype
  TensorView dq, dk, dv;  // written: q's, k's and v's shapes, any float dtype on the CPU
  TensorView out, lse;  // optional, written: the forward's output and natural-log LSE
  // Optional, read (GPU only): the rows' base-2 log-sums L2 that attention_for_training wrote,
  // f32 [batch, heads_q, n_q] contiguous. Given, the backward does not re-run the forward:
  // `out` must then be that call's output (read, not written) and `lse` undefined; only the
  // K/V quantization runs again (the backward's K' codes). The CPU references ignore it.
  TensorView lse2;
  Layout layout = Layout::HND;
  bool causal = false;
  std::optional<float> sm_scale;  // default 1/sqrt(head_dim)
  Recipe recipe = Recipe{};       // must have a backward (has_backward)
  // GPU: sum dQ (and dK, dV under GQA) in a fixed order, so that repeated calls give the same
  // bits (see "Determinism" below). The CPU references always sum in a fixed order: there it
  // changes nothing.
  bool deterministic = false;
};

// The forward call of a backward's arguments: q, k, v, layout, causal, sm_scale and recipe;
// out and lse left for the caller.
AttentionArgs forward_args(const BackwardArgs& args);

// Checks every argument (the recipe's backward included) and returns the problem's shape;
// throws sage::Error naming the first bad argument.
Problem check_backward_args(const BackwardArgs& args, DeviceKind device);

// ---- GPU (sm_90a) -------------------------------------------------------------------------
// attention_backward runs the recipe's forward (writing out and lse where they are given; a
// training step that has them from its own forward call gets the same bits again) and then its
// backward, and writes dq, dk, dv, with the view-and-workspace conventions of attention()
// (attention.h): views in cuda memory, rows of q, k, v and dout 16-byte aligned, the gradients
// in q's dtype (fp16 or bf16), a caller-provided workspace of backward_workspace_bytes(args)
// bytes aligned to 256, asynchronous on `stream` (a cudaStream_t).
//
// Which recipes: those whose backward the sm_90 kernel implements (gpu_supports_backward):
// sagebwd's choices, INT8 Q/K per_block (K smoothing optional), dV, dQ, dK int8, dP fp16, P per
// key (bwd_p_granularity per_token), and dS per token or per tile (bwd_ds_granularity
// per_token: sagebwd; per_block: sagebwd_block). Any other recipe is refused by name (no
// fallback); the simulator runs them.
//
// Determinism: dQ is summed across the K/V tiles' CTAs and dK, dV across a GQA group's query
// heads with fp32 atomics. deterministic = false (the default, as in FlashAttention: training
// tolerates last-bit noise, and the fixed order costs time) lets the atomics land in whatever
// order the CTAs reach them, so the last bits of dq, and of dk, dv under GQA, may differ from
// run to run (dk, dv without GQA get one addition per element and never do). deterministic =
// true fixes the order of the additions into every element: K/V tiles in decreasing order for
// dQ, the group's query heads in increasing order for dK and dV. Repeated calls with the same
// inputs and arguments then give the same bits (within one build; not the simulator's bits,
// only the same tolerances against it, docs/numerics.md).
// Its cost is waiting, not arithmetic: a CTA adds its dQ of a Q tile only after the CTAs of the
// higher K/V tiles of that head have added theirs (sm90/bwd/order.cuh). Causal, the higher K/V
// tiles start at later Q tiles, so they are ahead anyway and a CTA seldom waits; non-causal,
// one head's K/V tiles advance as a wavefront, the r-th in the order starting r Q-tile steps
// late (with all of a head's K/V tiles running at once at one pace, about n_kv / (4 n_q) of
// their busy time spent waiting). Under GQA a CTA adds dK and dV only after the previous query
// head's CTA of its K/V tile has (once, at the kernel's end). Measured on an H100: 5-12% of
// the backward (docs/performance.md, "Training"). The workspace grows by an int32
// counter per (batch, query head, 64-row Q tile) and per (batch, KV head, 128-key K/V tile).
size_t backward_workspace_bytes(const BackwardArgs& args);
void attention_backward(const BackwardArgs& args, void* workspace, size_t workspace_size,
                        void* stream);
// The forward of a training step: attention(args, ...) (the same out and lse, bit for bit)
// that also writes the rows' base-2 log-sums into lse2 (f32 [batch, heads_q, n_q], contiguous,
// cuda memory), for BackwardArgs::lse2. Recipes with a GPU backward only; workspace as
// attention()'s (workspace_bytes(args)).
void attention_for_training(const AttentionArgs& args, const TensorView& lse2, void* workspace,
                            size_t workspace_size, void* stream);
// Whether the sm_90 backward implements this recipe (false in a CPU-only build).
bool gpu_supports_backward(const Recipe& recipe);

namespace reference {
// Gradients in float64 (softmax attention differentiated exactly; the recipe is ignored),
// rounded once to the dtypes of dq, dk, dv; out and lse as exact() writes them.
void exact_backward(const BackwardArgs& args);
// The recipe's forward (exactly simulate()'s, whose out and lse it writes) and then its
// backward, computed the way docs/numerics.md, "The backward", says.
void simulate_backward(const BackwardArgs& args);
}  // namespace reference

}  // namespace sage
