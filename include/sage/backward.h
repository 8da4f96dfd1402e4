// The backward pass of attention (training): the gradients of out = softmax(sm_scale Q K^T +
// mask) V with respect to Q, K and V, given the gradient dO of the output.
//
// Only recipes with a backward (has_backward: the sagebwd preset, SageBwd's configuration, or
// a custom recipe that sets the four backward formats) have one; docs/numerics.md, "The
// backward", states what it computes step by step. The CPU references live here; the GPU
// kernels do not exist yet.
//
// Shapes follow attention.h (HND shown; NHD swaps tokens and heads):
//   q, dout, dq, out  [batch, heads_q,  n_q,  head_dim]
//   k, v, dk, dv      [batch, heads_kv, n_kv, head_dim]
//   lse               [batch, heads_q, n_q] f32 (optional, written)
// dk and dv of a KV head are summed over the query heads that share it (GQA/MQA).
#pragma once

#include <optional>

#include "sage/attention.h"
#include "sage/recipe.h"
#include "sage/tensor.h"
#include "sage/tile.h"

namespace sage {

struct BackwardArgs {
  TensorView q, k, v;   // the forward's inputs: f16 / bf16 (f32 on the CPU)
  TensorView dout;      // dO: q's shape and dtype
  TensorView dq, dk, dv;  // written: q's, k's and v's shapes, any float dtype on the CPU
  TensorView out, lse;  // optional, written: the forward's output and natural-log LSE
  Layout layout = Layout::HND;
  bool causal = false;
  std::optional<float> sm_scale;  // default 1/sqrt(head_dim)
  Recipe recipe = Recipe{};       // must have a backward (has_backward)
};

// The tiles of the backward, one function for every head dim (as tile_config is for the
// forward). A Hopper backward in FlashAttention-3's style runs one CTA per K/V tile of
// block_kv keys, looping over Q tiles of block_q rows; INT8 P, dO and dS take one scale per
// such tile. block_kv is the forward's (tile_config(d).block_kv), so a per_block K or V scale
// of the forward is one scale per backward K/V tile. block_q is one warpgroup's 64 rows at
// every head dim (FlashAttention-3 takes 128 at d = 64): INT8 dK = dS^T Q sums over Q rows, so
// each backward Q tile must lie inside one Q scale group, and the forward's per_block groups
// (tile_config(d).block_q: 192 rows at d = 64, 128 at d = 128) are multiples of 64, not of 128.
struct BackwardTileConfig {
  int block_q;   // Q rows per backward tile
  int block_kv;  // K/V tokens per backward tile (one CTA's)
};
constexpr BackwardTileConfig backward_tile_config(int head_dim) {
  return BackwardTileConfig{64, tile_config(head_dim).block_kv};
}

// Checks every argument (the recipe's backward included) and returns the problem's shape;
// throws sage::Error naming the first bad argument.
Problem check_backward_args(const BackwardArgs& args, DeviceKind device);

namespace reference {
// Gradients in float64 (softmax attention differentiated exactly; the recipe is ignored),
// rounded once to the dtypes of dq, dk, dv; out and lse as exact() writes them.
void exact_backward(const BackwardArgs& args);
// The recipe's forward (exactly simulate()'s, whose out and lse it writes) and then its
// backward, computed the way docs/numerics.md, "The backward", says.
void simulate_backward(const BackwardArgs& args);
}  // namespace reference

}  // namespace sage
