// Argument checking of packed variable-length batches, and the dense call of one sequence.
//
// The packed tensors are checked as one dense call over all their tokens (batch 1, NHD): that
// is every rule of check_args about dtypes, devices, strides, head dims, GQA, the window and
// sm_scale, with its messages. What is particular to packing (ranks, the offsets, max_seqlen)
// is checked here first, in check_args' order (recipe, presence, memory, dtype, shape).
#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "api/varlen_gpu.h"
#include "numerics/mask.h"
#include "sage/attention.h"
#include "sage/error.h"
#include "sage/recipe.h"
#include "sage/tensor.h"
#include "sage/varlen.h"

namespace sage {
namespace {

std::string num(int64_t v) { return std::to_string(v); }

std::string shape_text(const TensorView& t) {
  std::string s = "[";
  for (int i = 0; i < t.ndim; ++i) s += (i ? ", " : "") + num(t.shape[i]);
  return s + "]";
}

void require_rank(const TensorView& t, const char* name, int ndim, const char* dims) {
  const std::string want = "must be a " + num(ndim) + "-d view " + dims;
  if (!t.defined()) throw Error(name, want + " (got an undefined view)");
  if (t.ndim != ndim) throw Error(name, want + " (got " + num(t.ndim) + " dimensions)");
}

void require_shape(const TensorView& t, const char* name, std::vector<int64_t> want,
                   const char* dims) {
  bool same = true;
  for (size_t i = 0; i < want.size(); ++i) same = same && t.shape[i] == want[i];
  if (same) return;
  std::string w = "[";
  for (size_t i = 0; i < want.size(); ++i) w += (i ? ", " : "") + num(want[i]);
  throw Error(name, std::string("shape must be ") + dims + " = " + w + "] (got " + shape_text(t) + ")");
}

// Tokens [first, first + count) of a packed [tokens, heads, head_dim] view, as the NHD view
// [1, count, heads, head_dim] of a dense call. A batch of one never steps, so its stride is 0.
TensorView token_slice(const TensorView& packed, int64_t first, int64_t count) {
  TensorView t = packed;
  if (packed.data != nullptr)
    t.data = static_cast<char*>(packed.data) +
             first * packed.strides[0] * static_cast<int64_t>(dtype_size(packed.dtype));
  t.ndim = 4;
  const int64_t shape[4] = {1, count, packed.shape[1], packed.shape[2]};
  const int64_t strides[4] = {0, packed.strides[0], packed.strides[1], packed.strides[2]};
  std::copy(shape, shape + 4, t.shape);
  std::copy(strides, strides + 4, t.strides);
  return t;
}

// Columns [first, first + count) of the packed LSE [heads, tokens], as the dense call's
// [1, heads, count].
TensorView lse_slice(const TensorView& lse, int64_t first, int64_t count) {
  if (!lse.defined()) return lse;
  TensorView t = lse;
  if (lse.data != nullptr)
    t.data = static_cast<char*>(lse.data) +
             first * lse.strides[1] * static_cast<int64_t>(dtype_size(lse.dtype));
  t.ndim = 3;
  const int64_t shape[3] = {1, lse.shape[0], count};
  const int64_t strides[3] = {0, lse.strides[0], lse.strides[1]};
  std::copy(shape, shape + 3, t.shape);
  std::copy(strides, strides + 3, t.strides);
  t.shape[3] = t.strides[3] = 0;
  return t;
}

// The dense call over tokens [first_q, first_q + n_q) and keys [first_k, first_k + n_k).
AttentionArgs dense_call(const VarlenArgs& a, int64_t first_q, int64_t n_q, int64_t first_k,
                         int64_t n_k) {
  AttentionArgs d;
  d.q = token_slice(a.q, first_q, n_q);
  d.k = token_slice(a.k, first_k, n_k);
  d.v = token_slice(a.v, first_k, n_k);
  d.out = token_slice(a.out, first_q, n_q);
  d.lse = lse_slice(a.lse, first_q, n_q);
  d.layout = Layout::NHD;
  d.causal = a.causal;
  d.window_left = a.window_left;
  d.window_right = a.window_right;
  d.sm_scale = a.sm_scale;
  d.recipe = a.recipe;
  return d;
}

// cu_seqlens_q or _k: an i32 vector of batch + 1 offsets in host memory.
void check_offsets_view(const TensorView& t, const char* name) {
  require_rank(t, name, 1, "[batch + 1] of i32 offsets");
  if (t.dtype != DType::i32)
    throw Error(name, std::string("dtype must be i32 (got ") + dtype_name(t.dtype) + ")");
  if (t.shape[0] < 1)
    throw Error(name, "must hold batch + 1 >= 1 offsets (got shape " + shape_text(t) + ")");
  if (t.strides[0] < 0) throw Error(name, "stride must be >= 0 (got " + num(t.strides[0]) + ")");
  if (t.data == nullptr) throw Error(name, "data must not be null");
  if (t.device.kind != DeviceKind::cpu)
    throw Error(name, "must be in cpu memory: the CPU references read the offsets (got " +
                          device_name(t.device) + ")");
}

// The offsets, which must start at 0, never decrease and end at the packed token count.
std::vector<int64_t> read_offsets(const TensorView& t, const char* name, int64_t total,
                                  const char* tokens_of) {
  std::vector<int64_t> cu(static_cast<size_t>(t.shape[0]));
  for (int64_t i = 0; i < t.shape[0]; ++i) cu[i] = t.ptr<const int32_t>()[i * t.strides[0]];
  if (cu[0] != 0) throw Error(name, "must start at 0 (got " + num(cu[0]) + ")");
  for (size_t i = 1; i < cu.size(); ++i)
    if (cu[i] < cu[i - 1])
      throw Error(name, "must not decrease, but entry " + num(int64_t(i)) + " is " + num(cu[i]) +
                            " after " + num(cu[i - 1]));
  if (cu.back() != total)
    throw Error(name, "must end at " + std::string(tokens_of) + "'s token count " + num(total) +
                          " (got " + num(cu.back()) + ")");
  return cu;
}

void check_max_seqlen(int64_t max_seqlen, const std::vector<int64_t>& cu, const char* name) {
  int64_t longest = 0;
  for (size_t i = 1; i < cu.size(); ++i) longest = std::max(longest, cu[i] - cu[i - 1]);
  if (max_seqlen < longest)
    throw Error(name, "must be at least the longest sequence, " + num(longest) + " tokens (got " +
                          num(max_seqlen) + ")");
}

// cu_seqlens_q or _k for the GPU: i32 [batch + 1] in device memory on q's device, contiguous
// (the kernels read entry b at b). Its contents are never read here.
void check_device_offsets_view(const TensorView& t, const char* name, const Device& q_device) {
  require_rank(t, name, 1, "[batch + 1] of i32 offsets");
  if (t.dtype != DType::i32)
    throw Error(name, std::string("dtype must be i32 (got ") + dtype_name(t.dtype) + ")");
  if (t.shape[0] < 1)
    throw Error(name, "must hold batch + 1 >= 1 offsets (got shape " + shape_text(t) + ")");
  if (t.shape[0] > 1 && t.strides[0] != 1)
    throw Error(name, "must be contiguous on the GPU (stride 1; got " + num(t.strides[0]) + ")");
  if (t.data == nullptr) throw Error(name, "data must not be null");
  if (reinterpret_cast<uintptr_t>(t.data) % 4 != 0)
    throw Error(name, "data must be aligned to 4 bytes");
  if (t.device.kind != DeviceKind::cuda)
    throw Error(name, "must be in device memory for the GPU path, as flash_attn_varlen_func takes "
                      "it (got " + device_name(t.device) + "); the CPU references "
                      "(reference::simulate_varlen) take host offsets");
  if (t.device != q_device)
    throw Error(name, "must be on q's device " + device_name(q_device) + " (got " +
                          device_name(t.device) + ")");
}

// max_seqlen_q / _k on the GPU: sizes the grid and the workspace (never read from the offsets).
int64_t checked_max_seqlen(int64_t max_seqlen, int64_t total, const char* name) {
  if (max_seqlen < 0) throw Error(name, "must be >= 0 (got " + num(max_seqlen) + ")");
  if (max_seqlen > (int64_t(1) << 30))
    throw Error(name, "must be at most 2^30 tokens on the GPU (got " + num(max_seqlen) + ")");
  // No sequence is longer than the packed tensor: a larger bound costs nothing more.
  return std::min(max_seqlen, total);
}

// A packed [tokens, heads, d] view as the NHD view [batch, max_seqlen, heads, d] whose batch
// stride is 0: the kernels add sequence b's first row from the device offsets.
TensorView per_sequence_view(const TensorView& packed, int64_t batch, int64_t max_seqlen) {
  TensorView t = packed;
  t.ndim = 4;
  const int64_t shape[4] = {batch, max_seqlen, packed.shape[1], packed.shape[2]};
  const int64_t strides[4] = {0, packed.strides[0], packed.strides[1], packed.strides[2]};
  std::copy(shape, shape + 4, t.shape);
  std::copy(strides, strides + 4, t.strides);
  return t;
}

// The rules a packed call shares on both devices: the recipe, ranks, the offsets' views
// (device memory on cuda, never read here; host memory on cpu), packed shapes, then every
// dense rule over all tokens at once (dtypes, devices, strides, head dims, GQA, the window's
// values, sm_scale) on that device's terms.
Problem check_packed_call(const VarlenArgs& a, DeviceKind kind) {
  validate_recipe(a.recipe);
  if (a.recipe.inputs != Inputs::floating)
    throw Error("recipe.inputs", "packed variable-length batches take floating inputs only "
                                 "(prequantized INT8 scales have no packed form yet)");
  require_rank(a.q, "q", 3, "[total_q, heads_q, head_dim]");
  require_rank(a.k, "k", 3, "[total_k, heads_kv, head_dim]");
  require_rank(a.v, "v", 3, "[total_k, heads_kv, head_dim_v]");
  require_rank(a.out, "out", 3, "[total_q, heads_q, head_dim_v]");
  if (a.lse.defined()) require_rank(a.lse, "lse", 2, "[heads_q, total_q] (f32)");
  for (const auto& [view, name] : {std::pair{&a.cu_seqlens_q, "cu_seqlens_q"}, std::pair{&a.cu_seqlens_k, "cu_seqlens_k"}}) {
    if (kind == DeviceKind::cuda) check_device_offsets_view(*view, name, a.q.device);
    else check_offsets_view(*view, name);
  }
  if (a.cu_seqlens_k.shape[0] != a.cu_seqlens_q.shape[0])
    throw Error("cu_seqlens_k", "must have cu_seqlens_q's length batch + 1 = " +
                                    num(a.cu_seqlens_q.shape[0]) + " (got " +
                                    num(a.cu_seqlens_k.shape[0]) + ")");
  // V may have its own head dim; out is q's shape with V's.
  require_shape(a.v, "v", {a.k.shape[0], a.k.shape[1]}, "[total_k, heads_kv] of k's shape");
  require_shape(a.out, "out", {a.q.shape[0], a.q.shape[1], a.v.shape[2]},
                "q's shape with v's head_dim as its last dim, [total_q, heads_q, head_dim_v]");
  if (a.lse.defined()) require_shape(a.lse, "lse", {a.q.shape[1], a.q.shape[0]}, "[heads_q, total_q]");
  return check_args(dense_call(a, 0, a.q.shape[0], 0, a.k.shape[0]), kind);
}

}  // namespace

VarlenGpuCall check_varlen_args_gpu(const VarlenArgs& a) {
  const Problem whole = check_packed_call(a, DeviceKind::cuda);

  VarlenGpuCall c;
  c.total_q = whole.n_q;
  c.total_k = whole.n_kv;
  const int64_t batch = a.cu_seqlens_q.shape[0] - 1;
  const int64_t max_q = checked_max_seqlen(a.max_seqlen_q, c.total_q, "max_seqlen_q");
  const int64_t max_k = checked_max_seqlen(a.max_seqlen_k, c.total_k, "max_seqlen_k");
  c.problem = whole;
  c.problem.batch = batch;
  c.problem.n_q = max_q;
  c.problem.n_kv = max_k;
  const KeyWindow w = normalized_window(a.causal, a.window_left, a.window_right, max_q, max_k);
  c.problem.window_left = w.left;
  c.problem.window_right = w.right;
  c.dense = dense_call(a, 0, a.q.shape[0], 0, a.k.shape[0]);
  c.dense.q = per_sequence_view(a.q, batch, max_q);
  c.dense.out = per_sequence_view(a.out, batch, max_q);
  c.dense.k = per_sequence_view(a.k, batch, max_k);
  c.dense.v = per_sequence_view(a.v, batch, max_k);
  if (a.lse.defined()) {
    TensorView l = a.lse;
    l.ndim = 3;
    const int64_t shape[4] = {batch, a.lse.shape[0], max_q, 0};
    const int64_t strides[4] = {0, a.lse.strides[0], a.lse.strides[1], 0};
    std::copy(shape, shape + 4, l.shape);
    std::copy(strides, strides + 4, l.strides);
    c.dense.lse = l;
  }
  return c;
}

VarlenProblem check_varlen_args(const VarlenArgs& a) {
  const Problem whole = check_packed_call(a, DeviceKind::cpu);

  // ---- offsets ----
  VarlenProblem p;
  p.batch = a.cu_seqlens_q.shape[0] - 1;
  p.heads_q = whole.heads_q;
  p.heads_kv = whole.heads_kv;
  p.total_q = whole.n_q;
  p.total_k = whole.n_kv;
  p.head_dim = whole.head_dim;
  p.head_dim_v = whole.head_dim_v;
  p.cu_seqlens_q = read_offsets(a.cu_seqlens_q, "cu_seqlens_q", p.total_q, "q");
  p.cu_seqlens_k = read_offsets(a.cu_seqlens_k, "cu_seqlens_k", p.total_k, "k");
  check_max_seqlen(a.max_seqlen_q, p.cu_seqlens_q, "max_seqlen_q");
  check_max_seqlen(a.max_seqlen_k, p.cu_seqlens_k, "max_seqlen_k");
  return p;
}

AttentionArgs sequence_args(const VarlenArgs& a, const VarlenProblem& p, int64_t b) {
  return dense_call(a, p.cu_seqlens_q[b], p.seqlen_q(b), p.cu_seqlens_k[b], p.seqlen_k(b));
}

}  // namespace sage
