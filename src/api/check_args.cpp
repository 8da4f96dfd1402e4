// Argument checking shared by every entry point (GPU and CPU references).
//
// Each rule throws sage::Error(argument, one sentence saying what is allowed and what was
// given). Rules run in a fixed order (recipe, presence, memory, device, dtype, shape) so the
// first error a caller sees is the most basic one.
#include <algorithm>
#include <cmath>
#include <sstream>
#include <string>
#include <vector>

#include "sage/attention.h"
#include "sage/error.h"
#include "sage/recipe.h"
#include "sage/tensor.h"
#include "numerics/mask.h"
#include "sm90/fwd/kernel_traits.h"

namespace sage {
namespace {

// Head dims the GPU kernels exist for (sm90/fwd/kernel_traits.h). A CUDA build reports the
// subset it instantiated (SAGE_HEAD_DIMS) through gpu_head_dims(), and that is what the check
// uses; a CPU-only build reports none, and its GPU entry points refuse every call anyway.
#define SAGE_HEAD_DIM_ENTRY(D) D,
constexpr int64_t kGpuHeadDims[] = {SAGE_SUPPORTED_HEAD_DIMS(SAGE_HEAD_DIM_ENTRY)};
#undef SAGE_HEAD_DIM_ENTRY

}  // namespace

std::vector<int64_t> gpu_kernel_head_dim_list() {
  std::vector<int64_t> dims;
  std::istringstream is(gpu_kernel_head_dims());
  std::string item;
  while (std::getline(is, item, ',')) dims.push_back(std::stoll(item));
  if (dims.empty()) dims.assign(std::begin(kGpuHeadDims), std::end(kGpuHeadDims));
  return dims;
}

namespace {
// Issue 34: the smallest head dim the GPU path takes (below it the d = 64 tile would be mostly
// padding; 32 is the smallest real models use) and the step (16-byte rows of fp16/bf16, the
// unit of the kernels' bounded loads and stores).
constexpr int64_t kGpuMinHeadDim = 32, kGpuHeadDimStep = 8;
// Every head dim that runs on one of the kernel tiles `kernels`.
std::vector<int64_t> accepted_head_dims(const std::vector<int64_t>& kernels) {
  std::vector<int64_t> dims;
  for (int64_t d = kGpuMinHeadDim; d <= 256; d += kGpuHeadDimStep)
    for (int64_t k : kernels)
      if (k == kernel_head_dim(int(d))) dims.push_back(d);
  return dims;
}
}  // namespace

std::vector<int64_t> gpu_head_dim_list() { return accepted_head_dims(gpu_kernel_head_dim_list()); }

const char* gpu_head_dims() {
  static const std::string s = [] {
    std::string out;
    if (*gpu_kernel_head_dims() == '\0') return out;  // no CUDA: as gpu_kernel_head_dims
    for (int64_t d : gpu_head_dim_list()) out += (out.empty() ? "" : ", ") + std::to_string(d);
    return out;
  }();
  return s.c_str();
}

namespace {
constexpr int64_t kCpuMaxHeadDim = 256;

std::string join(const int64_t* v, int n) {
  std::ostringstream os;
  os << "[";
  for (int i = 0; i < n; ++i) os << (i ? ", " : "") << v[i];
  os << "]";
  return os.str();
}
std::string shape_str(const TensorView& t) { return join(t.shape, t.ndim); }
std::string strides_str(const TensorView& t) { return join(t.strides, t.ndim); }
std::string num(int64_t v) { return std::to_string(v); }

std::string float_str(float v) {
  std::ostringstream os;
  os << v;
  return os.str();
}

const char* device_kind_name(DeviceKind k) { return k == DeviceKind::cpu ? "cpu" : "cuda"; }

const char* layout_dims(Layout l) {
  return l == Layout::HND ? "[batch, heads, tokens, head_dim]" : "[batch, tokens, heads, head_dim]";
}

struct Dims {
  int64_t batch, heads, tokens, head_dim;
};
Dims dims_of(const TensorView& t, Layout l) {
  if (l == Layout::HND) return {t.shape[0], t.shape[1], t.shape[2], t.shape[3]};
  return {t.shape[0], t.shape[2], t.shape[1], t.shape[3]};
}

struct Named {
  const TensorView* t;
  const char* name;
  bool head_dim_contiguous;  // the 4-d operands: their last dim is the contiguous head_dim
};

void require_4d(const TensorView& t, const char* name, Layout l) {
  const std::string want = std::string("must be a 4-d view ") + layout_dims(l) + " for layout " +
                           layout_name(l);
  if (!t.defined()) throw Error(name, want + " (got an undefined view)");
  if (t.ndim != 4) throw Error(name, want + " (got " + num(t.ndim) + " dimensions)");
}

void require_ndim(const TensorView& t, const char* name, int ndim, const std::string& what) {
  if (t.ndim != ndim)
    throw Error(name, "must be a " + num(ndim) + "-d f32 view " + what + " (got " + num(t.ndim) +
                          " dimensions)");
}

void check_memory(const Named& n) {
  const TensorView& t = *n.t;
  for (int i = 0; i < t.ndim; ++i)
    if (t.shape[i] < 0) throw Error(n.name, "dimensions must be >= 0 (got shape " + shape_str(t) + ")");
  for (int i = 0; i < t.ndim; ++i)
    if (t.strides[i] < 0)
      throw Error(n.name, "strides must be >= 0 (got strides " + strides_str(t) + ")");
  // A size-1 head_dim has no neighbour, so its stride is irrelevant (frameworks leave any value);
  // nor does an empty view address any element (NumPy gives empty arrays zero strides).
  const int64_t count = t.numel();
  if (n.head_dim_contiguous && count > 0 && t.shape[3] > 1 && t.strides[3] != 1)
    throw Error(n.name, "the last dimension (head_dim) must be contiguous, stride 1 (got stride " +
                            num(t.strides[3]) + ")");
  if (t.data == nullptr && count > 0)
    throw Error(n.name, "data must not be null for a view of " + num(count) + " elements (shape " +
                            shape_str(t) + ")");
}

// Two output elements at one address would make the result depend on write order (a race on
// the GPU). Sorting dims by stride and requiring each stride to step past everything the
// smaller ones span is a sufficient test; it rejects only exotic interleaved layouts.
void check_no_self_overlap(const TensorView& t, const char* name) {
  if (t.numel() == 0) return;
  std::vector<std::pair<int64_t, int64_t>> dims;  // (stride, size) of dims that vary
  for (int i = 0; i < t.ndim; ++i)
    if (t.shape[i] > 1) dims.emplace_back(t.strides[i], t.shape[i]);
  std::sort(dims.begin(), dims.end());
  int64_t span = 0;  // largest offset reachable with the dims seen so far
  for (const auto& d : dims) {
    if (d.first <= span)
      throw Error(name, "is written, so its strides must give every element its own address (got "
                        "strides " + strides_str(t) + " for shape " + shape_str(t) + ")");
    span += d.first * (d.second - 1);
  }
}

void check_device(const Named& n, DeviceKind kind, const Device& first) {
  const Device& d = n.t->device;
  if (d.kind != kind)
    throw Error(n.name, std::string("must be in ") + device_kind_name(kind) +
                            " memory for this entry point (got " + device_name(d) + ")");
  // Host memory is one address space; only GPU ordinals must agree.
  if (kind == DeviceKind::cuda && d.index != first.index)
    throw Error(n.name, "must be on the same device as q, " + device_name(first) + " (got " +
                            device_name(d) + ")");
}

void check_scale(const TensorView& t, const char* name, std::initializer_list<int64_t> want,
                 const std::string& what) {
  require_ndim(t, name, static_cast<int>(want.size()), what);
  if (t.dtype != DType::f32)
    throw Error(name, std::string("dtype must be f32 (got ") + dtype_name(t.dtype) + ")");
  int i = 0;
  for (int64_t w : want) {
    if (t.shape[i] != w)
      throw Error(name, "shape must be " + what + " = " + join(std::vector<int64_t>(want).data(),
                                                               static_cast<int>(want.size())) +
                            " (got " + shape_str(t) + ")");
    ++i;
  }
}

// q's (and k's) or v's head dim: at least 1, at most kCpuMaxHeadDim on the CPU, and on the GPU
// one that a kernel tile of this build runs.
void check_head_dim(int64_t head_dim, const char* name, DeviceKind device) {
  if (head_dim < 1) throw Error(name, "head_dim must be >= 1 (got " + num(head_dim) + ")");
  if (device == DeviceKind::cpu) {
    if (head_dim > kCpuMaxHeadDim)
      throw Error(name, "head_dim must be at most " + num(kCpuMaxHeadDim) + " on cpu (got " +
                            num(head_dim) + ")");
    return;
  }
  const std::vector<int64_t> dims = gpu_head_dim_list();
  bool supported = false, steps = true;  // steps: dims are every multiple of 8 in a range
  std::string list;
  for (size_t i = 0; i < dims.size(); ++i) {
    supported = supported || dims[i] == head_dim;
    steps = steps && (i == 0 || dims[i] == dims[i - 1] + kGpuHeadDimStep);
    list += (list.empty() ? "" : ", ") + num(dims[i]);
  }
  if (!supported && steps && !dims.empty())
    throw Error(name, "head_dim must be a multiple of " + num(kGpuHeadDimStep) + " from " +
                          num(dims.front()) + " to " + num(dims.back()) + " on cuda (got " +
                          num(head_dim) + ")");
  if (!supported)
    throw Error(name, "head_dim must be one of " + list + " on cuda (got " + num(head_dim) + ")");
}

void check_window(const AttentionArgs& a) {
  const struct {
    int64_t value;
    const char* name;
  } bounds[] = {{a.window_left, "window_left"}, {a.window_right, "window_right"}};
  for (const auto& b : bounds)
    if (b.value < -1)
      throw Error(b.name, "must be -1 (unbounded) or >= 0 keys (got " + num(b.value) + ")");
  if (a.causal && a.window_right > 0)
    throw Error("window_right", "must be -1 or 0 with causal = true, which is window_right = 0 "
                                "(got " + num(a.window_right) + ")");
}

}  // namespace

Problem check_args(const AttentionArgs& a, DeviceKind device) {
  validate_recipe(a.recipe);
  const bool preq = a.recipe.inputs == Inputs::prequantized_int8;
  const Layout l = a.layout;

  // ---- presence and rank ----
  require_4d(a.q, "q", l);
  require_4d(a.k, "k", l);
  require_4d(a.v, "v", l);
  require_4d(a.out, "out", l);
  if (a.lse.defined()) require_ndim(a.lse, "lse", 3, "[batch, heads_q, n_q]");

  const std::string v_scale_dims = a.recipe.v_scale == VScale::per_channel
                                       ? "[batch, heads_kv, head_dim_v]"
                                       : "[batch, heads_kv]";
  const struct {
    const TensorView* t;
    const char* name;
    int ndim;
    std::string dims;
  } scales[] = {{&a.q_scale, "q_scale", 3, "[batch, heads_q, n_q]"},
                {&a.k_scale, "k_scale", 3, "[batch, heads_kv, n_kv]"},
                {&a.v_scale, "v_scale", a.recipe.v_scale == VScale::per_channel ? 3 : 2,
                 v_scale_dims}};
  for (const auto& s : scales) {
    if (preq && !s.t->defined())
      throw Error(s.name, "is required with recipe.inputs = prequantized_int8: an f32 view " +
                              s.dims + " (got an undefined view)");
    if (!preq && s.t->defined())
      throw Error(s.name, "only used with recipe.inputs = prequantized_int8; leave it undefined");
    if (preq) require_ndim(*s.t, s.name, s.ndim, s.dims);
  }

  // ---- memory: shapes >= 0, strides, null data ----
  std::vector<Named> views = {{&a.q, "q", true}, {&a.k, "k", true}, {&a.v, "v", true},
                              {&a.out, "out", true}};
  if (a.lse.defined()) views.push_back({&a.lse, "lse", false});
  for (const auto& s : scales)
    if (s.t->defined()) views.push_back({s.t, s.name, false});
  for (const Named& n : views) check_memory(n);

  // ---- device ----
  for (const Named& n : views) check_device(n, device, a.q.device);

  // ---- dtypes ----
  const DType qt = a.q.dtype;
  if (preq) {
    if (qt != DType::i8)
      throw Error("q", std::string("dtype must be i8 with recipe.inputs = prequantized_int8 (got ") +
                           dtype_name(qt) + ")");
  } else if (device == DeviceKind::cuda) {
    if (qt != DType::f16 && qt != DType::bf16)
      throw Error("q", std::string("dtype must be f16 or bf16 on cuda (got ") + dtype_name(qt) + ")");
  } else {
    if (qt != DType::f16 && qt != DType::bf16 && qt != DType::f32)
      throw Error("q", std::string("dtype must be f16, bf16 or f32 on cpu (got ") + dtype_name(qt) +
                           ")");
  }
  for (const Named& n : {Named{&a.k, "k", true}, Named{&a.v, "v", true}})
    if (n.t->dtype != qt)
      throw Error(n.name, std::string("dtype must equal q's dtype ") + dtype_name(qt) + " (got " +
                              dtype_name(n.t->dtype) + ")");
  const DType ot = a.out.dtype;
  if (device == DeviceKind::cuda) {
    if (preq && ot != DType::f16 && ot != DType::bf16)
      throw Error("out", std::string("dtype must be f16 or bf16 on cuda (got ") + dtype_name(ot) + ")");
    if (!preq && ot != qt)
      throw Error("out", std::string("dtype must equal q's dtype ") + dtype_name(qt) +
                             " on cuda (got " + dtype_name(ot) + ")");
  } else if (ot != DType::f16 && ot != DType::bf16 && ot != DType::f32 && ot != DType::f64) {
    throw Error("out", std::string("dtype must be one of f16, bf16, f32, f64 on cpu (got ") +
                           dtype_name(ot) + ")");
  }

  // ---- shapes ----
  const Dims q = dims_of(a.q, l), k = dims_of(a.k, l), v = dims_of(a.v, l);
  check_head_dim(q.head_dim, "q", device);
  if (k.batch != q.batch)
    throw Error("k", "batch must equal q's batch " + num(q.batch) + " (got " + num(k.batch) + ")");
  if (k.head_dim != q.head_dim)
    throw Error("k", "head_dim must equal q's head_dim " + num(q.head_dim) + " (got " +
                         num(k.head_dim) + ")");
  const bool divides = k.heads == 0 ? q.heads == 0 : q.heads % k.heads == 0;
  if (!divides)
    throw Error("k", "heads_kv must divide heads_q (GQA/MQA), but heads_q " + num(q.heads) +
                         " is not a multiple of heads_kv " + num(k.heads));
  if (v.batch != q.batch)
    throw Error("v", "batch must equal q's batch " + num(q.batch) + " (got " + num(v.batch) + ")");
  if (v.heads != k.heads)
    throw Error("v", "heads must equal k's heads " + num(k.heads) + " (got " + num(v.heads) + ")");
  if (v.tokens != k.tokens)
    throw Error("v", "tokens must equal k's tokens " + num(k.tokens) + " (got " + num(v.tokens) + ")");
  // V may have its own head dim (DeepSeek MLA: 192 for Q and K, 128 for V); out has V's.
  check_head_dim(v.head_dim, "v", device);
  int64_t out_shape[4];
  std::copy(a.q.shape, a.q.shape + 4, out_shape);
  out_shape[3] = v.head_dim;
  for (int i = 0; i < 4; ++i)
    if (a.out.shape[i] != out_shape[i])
      throw Error("out", "shape must equal q's shape with v's head_dim as its last dim, " +
                             join(out_shape, 4) + " (got " + shape_str(a.out) + ")");

  if (a.lse.defined()) {
    if (a.lse.dtype != DType::f32)
      throw Error("lse", std::string("dtype must be f32 (got ") + dtype_name(a.lse.dtype) + ")");
    const int64_t want[3] = {q.batch, q.heads, q.tokens};
    if (a.lse.shape[0] != want[0] || a.lse.shape[1] != want[1] || a.lse.shape[2] != want[2])
      throw Error("lse", "shape must be [batch, heads_q, n_q] = " + join(want, 3) + " (got " +
                             shape_str(a.lse) + ")");
  }

  if (preq) {
    check_scale(a.q_scale, "q_scale", {q.batch, q.heads, q.tokens}, scales[0].dims);
    check_scale(a.k_scale, "k_scale", {k.batch, k.heads, k.tokens}, scales[1].dims);
    if (a.recipe.v_scale == VScale::per_channel)
      check_scale(a.v_scale, "v_scale", {k.batch, k.heads, v.head_dim}, scales[2].dims);
    else
      check_scale(a.v_scale, "v_scale", {k.batch, k.heads}, scales[2].dims);
  }

  if (a.sm_scale && !(std::isfinite(*a.sm_scale) && *a.sm_scale > 0.f))
    throw Error("sm_scale", "must be finite and > 0 (got " + float_str(*a.sm_scale) + ")");
  check_window(a);

  check_no_self_overlap(a.out, "out");
  if (a.lse.defined()) check_no_self_overlap(a.lse, "lse");

  Problem p;
  p.batch = q.batch;
  p.heads_q = q.heads;
  p.heads_kv = k.heads;
  p.n_q = q.tokens;
  p.n_kv = k.tokens;
  p.head_dim = q.head_dim;
  p.head_dim_v = v.head_dim;
  p.sm_scale = a.sm_scale ? *a.sm_scale
                          : static_cast<float>(1.0 / std::sqrt(static_cast<double>(q.head_dim)));
  const KeyWindow w = normalized_window(a.causal, a.window_left, a.window_right, p.n_q, p.n_kv);
  p.window_left = w.left;
  p.window_right = w.right;
  return p;
}

Problem check_kv_args(const AttentionArgs& a, DeviceKind device) {
  validate_recipe(a.recipe);
  require_4d(a.k, "k", a.layout);
  require_4d(a.v, "v", a.layout);
  // The K/V half is checked as the self-attention call q = k would be: every rule about k, v
  // and their scales is the one check_args applies. q's stand-in is k itself (so an error
  // about it is an error about k), and out's a fresh contiguous view of q's shape with v's
  // head dim that is never dereferenced.
  AttentionArgs self = a;
  self.q = a.k;
  self.q_scale = a.k_scale;
  self.lse = TensorView{};
  self.out = a.k;
  self.out.shape[3] = a.v.shape[3];
  self.out.dtype = a.recipe.inputs == Inputs::prequantized_int8 ? DType::f16 : a.k.dtype;
  int64_t stride = 1;
  for (int i = 3; i >= 0; --i) {
    self.out.strides[i] = stride;
    stride *= std::max<int64_t>(1, self.out.shape[i]);
  }
  self.sm_scale.reset();
  // The mask belongs to the attention half, which checks it.
  self.causal = false;
  self.window_left = self.window_right = -1;
  try {
    Problem p = check_args(self, device);
    p.n_q = 0;
    return p;
  } catch (const Error& e) {
    const std::string& arg = e.argument();
    if (arg == "q" || arg == "q_scale") {
      const std::string name = arg == "q" ? "k" : "k_scale";
      std::string msg = e.what();
      const std::string prefix = arg + ": ";
      if (msg.rfind(prefix, 0) == 0) msg = msg.substr(prefix.size());
      throw Error(name, msg);
    }
    throw;
  }
}

}  // namespace sage
