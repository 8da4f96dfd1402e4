// Argument checking of the backward entry points: the forward's checks (check_args) for q, k,
// v, out, lse and the recipe, then the gradients' own views.
#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "api/backward_gpu.h"
#include "sage/attention.h"
#include "sage/backward.h"
#include "sage/error.h"

namespace sage {

void detail::check_one_head_dim(int64_t head_dim, int64_t head_dim_v) {
  if (head_dim_v != head_dim)
    throw Error("v", "head_dim must equal q's head_dim " + std::to_string(head_dim) +
                         " for the backward (got " + std::to_string(head_dim_v) +
                         "): only the forward takes a V head dim of its own");
}

void detail::check_saved_l2(const TensorView& t, const Problem& p, DeviceKind device) {
  const int64_t want[3] = {p.batch, p.heads_q, p.n_q};
  const std::string dims = "[batch, heads_q, n_q] = [" + std::to_string(want[0]) + ", " +
                           std::to_string(want[1]) + ", " + std::to_string(want[2]) + "]";
  if (t.ndim != 3 || t.shape[0] != want[0] || t.shape[1] != want[1] || t.shape[2] != want[2])
    throw Error("lse2", "must be an f32 view " + dims);
  if (t.dtype != DType::f32) throw Error("lse2", std::string("dtype must be f32 (got ") + dtype_name(t.dtype) + ")");
  if (t.strides[2] != 1 || t.strides[1] != want[2] || t.strides[0] != want[1] * want[2])
    if (t.numel() > 1) throw Error("lse2", "must be contiguous (row-major strides)");
  if (t.data == nullptr && t.numel() > 0) throw Error("lse2", "data must not be null");
  if (t.device.kind != device)
    throw Error("lse2", std::string("must be in ") + (device == DeviceKind::cpu ? "cpu" : "cuda") +
                            " memory for this entry point (got " + device_name(t.device) + ")");
}

namespace {

std::string shape_text(const TensorView& t) {
  std::string s = "[";
  for (int i = 0; i < t.ndim; ++i) s += (i ? ", " : "") + std::to_string(t.shape[i]);
  return s + "]";
}

// A contiguous stand-in for an absent output of `like`'s shape and dtype: check_args requires
// `out`, which the backward only writes when asked. It is never dereferenced.
TensorView stand_in(const TensorView& like) {
  TensorView t = like;
  int64_t stride = 1;
  for (int i = t.ndim - 1; i >= 0; --i) {
    t.strides[i] = stride;
    stride *= t.shape[i] > 0 ? t.shape[i] : 1;
  }
  return t;
}

const char* layout_dims(Layout l) {
  return l == Layout::HND ? "[batch, heads, tokens, head_dim]" : "[batch, tokens, heads, head_dim]";
}

// A 4-d view of `like`'s shape on the same device, head_dim contiguous, not null.
void check_like(const TensorView& t, const char* name, const TensorView& like, const char* like_name,
                Layout layout, DeviceKind device) {
  if (!t.defined() || t.ndim != 4)
    throw Error(name, std::string("must be a 4-d view ") + layout_dims(layout) + " of " + like_name +
                          "'s shape " + shape_text(like) + " (got " +
                          (t.defined() ? std::to_string(t.ndim) + " dimensions)" : "an undefined view)"));
  for (int i = 0; i < 4; ++i)
    if (t.shape[i] != like.shape[i])
      throw Error(name, "shape must equal " + std::string(like_name) + "'s shape " + shape_text(like) +
                            " (got " + shape_text(t) + ")");
  for (int i = 0; i < 4; ++i)
    if (t.strides[i] < 0)
      throw Error(name, "strides must be >= 0");
  if (t.shape[3] > 1 && t.strides[3] != 1)
    throw Error(name, "the last dimension (head_dim) must be contiguous, stride 1 (got stride " +
                          std::to_string(t.strides[3]) + ")");
  if (t.data == nullptr && t.numel() > 0)
    throw Error(name, "data must not be null for a view of " + std::to_string(t.numel()) + " elements");
  if (t.device.kind != device)
    throw Error(name, std::string("must be in ") + (device == DeviceKind::cpu ? "cpu" : "cuda") +
                          " memory for this entry point (got " + device_name(t.device) + ")");
}

// A gradient is written: no two of its elements may share an address (check_args' rule for
// out: sorted by stride, each dim must step past everything the smaller ones span).
void check_no_self_overlap(const TensorView& t, const char* name) {
  if (t.numel() == 0) return;
  std::vector<std::pair<int64_t, int64_t>> dims;  // (stride, size) of the dims that vary
  for (int i = 0; i < t.ndim; ++i)
    if (t.shape[i] > 1) dims.emplace_back(t.strides[i], t.shape[i]);
  std::sort(dims.begin(), dims.end());
  int64_t span = 0;
  for (const auto& d : dims) {
    if (d.first <= span)
      throw Error(name, "is written, so its strides must give every element its own address");
    span += d.first * (d.second - 1);
  }
}

void check_gradient_dtype(const TensorView& t, const char* name) {
  if (t.dtype != DType::f16 && t.dtype != DType::bf16 && t.dtype != DType::f32 && t.dtype != DType::f64)
    throw Error(name, std::string("dtype must be one of f16, bf16, f32, f64 on cpu (got ") +
                          dtype_name(t.dtype) + ")");
}

// The forward takes a V head dim of its own (attention.h); the backward does not: its gradients
// (dP = dO V^T, dV = P^T dO) are built for one head dim. Checked before the forward's rules, so
// that an out of q's shape is not reported first. Views that are not 4-d are check_args' to name.
void check_v_head_dim(const BackwardArgs& a) {
  if (!a.q.defined() || !a.v.defined() || a.q.ndim != 4 || a.v.ndim != 4) return;
  detail::check_one_head_dim(a.q.shape[3], a.v.shape[3]);
}

// The forward call a backward call implies, for check_args: its out and lse are the
// backward's (out standing in when absent).
AttentionArgs forward_of(const BackwardArgs& a) {
  AttentionArgs f = forward_args(a);
  f.out = a.out.defined() ? a.out : stand_in(a.q);
  f.lse = a.lse;
  return f;
}

}  // namespace

AttentionArgs forward_args(const BackwardArgs& a) {
  AttentionArgs f;
  f.q = a.q;
  f.k = a.k;
  f.v = a.v;
  f.layout = a.layout;
  f.causal = a.causal;
  f.sm_scale = a.sm_scale;
  f.recipe = a.recipe;
  return f;
}

Problem check_backward_args(const BackwardArgs& a, DeviceKind device) {
  if (a.recipe.inputs != Inputs::floating)
    throw Error("recipe.inputs", "the backward needs floating inputs (prequantized INT8 inputs "
                                 "have no gradient)");
  check_v_head_dim(a);
  const Problem p = check_args(forward_of(a), device);
  check_like(a.dout, "dout", a.q, "q", a.layout, device);
  if (a.dout.dtype != a.q.dtype)
    throw Error("dout", std::string("dtype must equal q's dtype ") + dtype_name(a.q.dtype) + " (got " +
                            dtype_name(a.dout.dtype) + ")");
  const struct {
    const TensorView* t;
    const char* name;
    const TensorView* like;
    const char* like_name;
  } grads[] = {{&a.dq, "dq", &a.q, "q"}, {&a.dk, "dk", &a.k, "k"}, {&a.dv, "dv", &a.v, "v"}};
  for (const auto& g : grads) {
    check_like(*g.t, g.name, *g.like, g.like_name, a.layout, device);
    if (device == DeviceKind::cpu) {
      check_gradient_dtype(*g.t, g.name);
    } else if (g.t->dtype != a.q.dtype) {
      // The GPU writes each gradient once, rounded to the inputs' 16-bit dtype.
      throw Error(g.name, std::string("dtype must equal q's dtype ") + dtype_name(a.q.dtype) +
                              " on cuda (got " + dtype_name(g.t->dtype) + ")");
    }
    check_no_self_overlap(*g.t, g.name);
  }
  if (a.lse2.defined()) {
    if (device == DeviceKind::cuda) detail::check_saved_l2(a.lse2, p, device);  // the CPU ignores it
    if (!a.out.defined())
      throw Error("out", "is required with lse2: the saved forward's output, read by the backward");
    if (a.lse.defined())
      throw Error("lse", "must be left undefined with lse2: the backward does not re-run the forward");
  }
  return p;
}

}  // namespace sage
