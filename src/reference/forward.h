// The simulator's forward pass as data: what simulate() writes and what the backward
// (backward.cpp) reuses from it, as a kernel for training would save it. The numerics
// contract is docs/numerics.md.
#pragma once

#include <cstdint>
#include <vector>

#include "reference/pv_quantize.h"
#include "reference/qk_quantize.h"
#include "sage/attention.h"
#include "numerics/tile.h"

namespace sage::reference::sim {

// Everything the kernels prepare once per KV head before attention runs.
struct KVHead {
  QKOperand k;
  std::vector<float> k_mean;  // smooth_k: the subtracted mean (for the LSE), else empty
  // qk_channel_balance: s_c (powers of two), K' multiplied by them and Q divided, else empty
  std::vector<float> qk_balance;
  VOperand v;
  std::vector<float> v_mean;  // smooth_v: added back to the output, else empty
};

struct Forward {
  Problem p;
  TileConfig tc{};
  float sl2 = 0.f;                // rules::sm_scale_log2(p.sm_scale)
  std::vector<float> k;           // dense (b, h_kv, n_kv, d): K after smoothing (K')
  std::vector<KVHead> kv;         // per KV head
  std::vector<QKOperand> q_ops;   // per query head, kept when run_forward is asked to
  std::vector<float> out;         // dense (b, h_q, n_q, d_v), before rounding to out's dtype
  std::vector<float> lse;         // natural log of the true scores; -inf for a row without keys
  // m + log2f(l) of each row: the log-sum in the base-2 logit domain of the QK stage (the
  // smoothed, quantized scores), from which the backward rebuilds P. -inf without keys.
  std::vector<float> lse2;
};

// Runs steps 1-11 of docs/numerics.md for every (batch, head) on validated arguments
// (check_args). keep_q_operands keeps each query head's quantized Q for the backward.
Forward run_forward(const AttentionArgs& args, const Problem& p, bool keep_q_operands);

}  // namespace sage::reference::sim
