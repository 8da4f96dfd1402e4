// What the GPU backward (api/backward.cu) takes from the forward's dispatch (api/dispatch.cu):
// the forward of a training call, which also writes the rows' base-2 log-sums, and where its
// quantized K/V lie in the workspace.
#pragma once

#include <cstddef>

#include "quant/kv_layout.h"
#include "sage/attention.h"

namespace sage::detail {

// attention(args, workspace, ...) that also writes L2 = m + log2(l / p_max) per row into lse2
// (dense [batch, heads_q, n_q] floats, device memory); returns the workspace's quantized K/V.
quant::QuantizedKV attention_for_backward(const AttentionArgs& args, void* workspace,
                                          size_t workspace_size, float* lse2, void* stream);
// The K/V pre-pass of attention(args) alone (the backward's K' codes when the forward's L2 was
// saved); returns where the quantized K/V lie in the workspace.
quant::QuantizedKV quantize_kv_for_backward(const AttentionArgs& args, void* workspace,
                                            size_t workspace_size, void* stream);
// lse2's checks (BackwardArgs::lse2, attention_for_training): f32 [batch, heads_q, n_q],
// contiguous, on `device`.
void check_saved_l2(const TensorView& lse2, const Problem& p, DeviceKind device);
// The backward (and so a training forward) takes one head dim for q, k and v: the forward's V
// head dim of its own is refused, naming v.
void check_one_head_dim(int64_t head_dim, int64_t head_dim_v);

}  // namespace sage::detail
