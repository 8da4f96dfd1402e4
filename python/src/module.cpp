// sagekit._C: the library's public entry points for Python.
//
// Tensors arrive through DLPack (nanobind's nb::ndarray), so the extension needs neither
// torch nor NumPy at build time and accepts both, on the CPU or on CUDA. Allocation stays
// with the caller, as in the C++ API: outputs are passed in, and the GPU workspace is
// either an array or a callable that allocates it (the torch layer passes the caching
// allocator, so nothing here calls cudaMalloc or synchronizes).
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cctype>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "recipes.h"
#include "sage/attention.h"
#include "sage/backward.h"
#include "sage/calibrate.h"
#include "sage/error.h"
#include "sage/varlen.h"
#include "views.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace sagepy {
namespace {

sage::Layout layout_of(const std::string& s) {
  std::string u;
  for (char c : s) u += static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  if (u == "HND") return sage::Layout::HND;
  if (u == "NHD") return sage::Layout::NHD;
  throw sage::Error("layout", "must be 'HND' ([batch, heads, tokens, head_dim]) or 'NHD' "
                              "([batch, tokens, heads, head_dim]) (got '" + s + "')");
}

// The arguments every entry point shares, imported once.
struct Call {
  ViewSet arrays;
  sage::AttentionArgs args;
};

// The options and inputs every entry point takes, forward (AttentionArgs) or backward
// (BackwardArgs).
template <class Args>
void fill_shared(Args& a, ViewSet& arrays, nb::handle q, nb::handle k, nb::handle v,
                 const std::string& layout, bool causal, std::optional<double> sm_scale,
                 nb::handle recipe) {
  a.layout = layout_of(layout);
  a.causal = causal;
  if (sm_scale) a.sm_scale = static_cast<float>(*sm_scale);
  a.recipe = recipe_from(recipe);
  a.q = arrays.input(q, "q");
  a.k = arrays.input(k, "k");
  a.v = arrays.input(v, "v");
}

// The sliding window (FlashAttention's window_size): -1 or >= 0 keys per side.
struct Window {
  int64_t left = -1, right = -1;
};

void fill(Call& c, nb::handle q, nb::handle k, nb::handle v, nb::handle out, nb::handle lse,
          const std::string& layout, bool causal, Window window, std::optional<double> sm_scale,
          nb::handle recipe, nb::handle q_scale, nb::handle k_scale, nb::handle v_scale) {
  sage::AttentionArgs& a = c.args;
  fill_shared(a, c.arrays, q, k, v, layout, causal, sm_scale, recipe);
  a.window_left = window.left;
  a.window_right = window.right;
  if (out.is_none()) throw sage::Error("out", "is required (an array of q's shape to write into)");
  a.out = c.arrays.output(out, "out");
  a.lse = c.arrays.output(lse, "lse");
  a.q_scale = c.arrays.input(q_scale, "q_scale");
  a.k_scale = c.arrays.input(k_scale, "k_scale");
  a.v_scale = c.arrays.input(v_scale, "v_scale");
}

// The references dereference every pointer on the host, so device memory must not reach
// them even if a later check were to miss it.
using NamedViews = std::initializer_list<std::pair<const sage::TensorView*, const char*>>;
void require_host(NamedViews views) {
  for (const auto& [view, name] : views)
    if (view->defined() && view->device.kind != sage::DeviceKind::cpu)
      throw sage::Error(name, "must be in host memory for the CPU references (got " +
                                  sage::device_name(view->device) + ")");
}
void require_host(const sage::AttentionArgs& a) {
  require_host({{&a.q, "q"}, {&a.k, "k"}, {&a.v, "v"}, {&a.out, "out"}, {&a.lse, "lse"},
                {&a.q_scale, "q_scale"}, {&a.k_scale, "k_scale"}, {&a.v_scale, "v_scale"}});
}

// A backward call's arguments, imported once; for the CPU references (host) every view must
// be in host memory.
struct BackwardCall {
  ViewSet arrays;
  sage::BackwardArgs args;
};

// lse2 (GPU only): the saved forward's L2 (attention_for_training's); with it, `out` is that
// forward's output, which the backward reads instead of writing (so it may be read-only).
// deterministic (GPU only; the CPU references always sum in a fixed order): BackwardArgs's.
void fill_backward(BackwardCall& c, nb::handle q, nb::handle k, nb::handle v, nb::handle dout,
                   nb::handle dq, nb::handle dk, nb::handle dv, nb::handle out, nb::handle lse,
                   const std::string& layout, bool causal, std::optional<double> sm_scale,
                   nb::handle recipe, bool host = true, nb::handle lse2 = nb::none(),
                   bool deterministic = false) {
  sage::BackwardArgs& a = c.args;
  fill_shared(a, c.arrays, q, k, v, layout, causal, sm_scale, recipe);
  a.deterministic = deterministic;
  a.dout = c.arrays.input(dout, "dout");
  a.dq = c.arrays.output(dq, "dq");
  a.dk = c.arrays.output(dk, "dk");
  a.dv = c.arrays.output(dv, "dv");
  a.lse2 = c.arrays.input(lse2, "lse2");
  a.out = a.lse2.defined() ? c.arrays.input(out, "out") : c.arrays.output(out, "out");
  a.lse = c.arrays.output(lse, "lse");
  if (!host) return;
  require_host({{&a.q, "q"}, {&a.k, "k"}, {&a.v, "v"}, {&a.dout, "dout"}, {&a.dq, "dq"},
                {&a.dk, "dk"}, {&a.dv, "dv"}, {&a.out, "out"}, {&a.lse, "lse"}});
}

// A packed variable-length call of the CPU references, imported once; every view (the
// offsets included, which the references read) must be in host memory.
struct VarlenCall {
  ViewSet arrays;
  sage::VarlenArgs args;
};

void fill_varlen(VarlenCall& c, nb::handle q, nb::handle k, nb::handle v, nb::handle cu_seqlens_q,
                 nb::handle cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k,
                 nb::handle out, nb::handle lse, bool causal, Window window,
                 std::optional<double> sm_scale, nb::handle recipe, bool host = true) {
  sage::VarlenArgs& a = c.args;
  a.recipe = recipe_from(recipe);
  a.q = c.arrays.input(q, "q");
  a.k = c.arrays.input(k, "k");
  a.v = c.arrays.input(v, "v");
  a.cu_seqlens_q = c.arrays.input(cu_seqlens_q, "cu_seqlens_q");
  a.cu_seqlens_k = c.arrays.input(cu_seqlens_k, "cu_seqlens_k");
  a.max_seqlen_q = max_seqlen_q;
  a.max_seqlen_k = max_seqlen_k;
  if (out.is_none()) throw sage::Error("out", "is required (an array of q's shape to write into)");
  a.out = c.arrays.output(out, "out");
  a.lse = c.arrays.output(lse, "lse");
  a.causal = causal;
  a.window_left = window.left;
  a.window_right = window.right;
  if (sm_scale) a.sm_scale = static_cast<float>(*sm_scale);
  // The CPU references read host memory; the GPU entry point checks devices itself.
  if (host)
    require_host({{&a.q, "q"}, {&a.k, "k"}, {&a.v, "v"}, {&a.cu_seqlens_q, "cu_seqlens_q"},
                  {&a.cu_seqlens_k, "cu_seqlens_k"}, {&a.out, "out"}, {&a.lse, "lse"}});
}

nb::dict problem_dict(const sage::Problem& p) {
  nb::dict d;
  d["batch"] = p.batch;
  d["heads_q"] = p.heads_q;
  d["heads_kv"] = p.heads_kv;
  d["n_q"] = p.n_q;
  d["n_kv"] = p.n_kv;
  d["head_dim"] = p.head_dim;
  d["sm_scale"] = p.sm_scale;
  d["window_left"] = p.window_left;
  d["window_right"] = p.window_right;
  return d;
}

std::vector<int> parse_head_dims(const char* s) {
  std::vector<int> dims;
  int cur = -1;
  for (const char* p = s ? s : ""; ; ++p) {
    if (*p >= '0' && *p <= '9') {
      cur = (cur < 0 ? 0 : cur * 10) + (*p - '0');
    } else {
      if (cur >= 0) dims.push_back(cur);
      cur = -1;
      if (!*p) break;
    }
  }
  return dims;
}

// K's dims read through the layout. The two-step entry points size the workspace from them
// before the library sees the call, so a K of the wrong rank is reported here in the
// library's words.
struct KVDims {
  int64_t batch, heads, tokens, head_dim;
};
KVDims kv_dims(const sage::TensorView& k, sage::Layout layout) {
  const bool hnd = layout == sage::Layout::HND;
  if (k.ndim != 4)
    throw sage::Error("k", std::string("must be a 4-d view ") +
                               (hnd ? "[batch, heads, tokens, head_dim]" : "[batch, tokens, heads, head_dim]") +
                               " for layout " + (hnd ? "HND" : "NHD") + " (got " +
                               (k.defined() ? std::to_string(k.ndim) + " dimensions)" : "none)"));
  if (hnd) return {k.shape[0], k.shape[1], k.shape[2], k.shape[3]};
  return {k.shape[0], k.shape[2], k.shape[1], k.shape[3]};
}

size_t kv_bytes_of(const sage::AttentionArgs& a) {
  const KVDims d = kv_dims(a.k, a.layout);
  // V's head dim where the view has one (checked with the rest of the call); else K's.
  const int64_t dv = a.v.ndim == 4 ? a.v.shape[3] : d.head_dim;
  return sage::kv_workspace_bytes(d.batch, d.heads, d.tokens, d.head_dim, a.recipe, dv);
}

// The device range behind a `workspace` argument: checks that it is a flat buffer on
// `device` with at least `need` bytes. `read_only`: the library only reads it.
void* workspace_range(ViewSet& arrays, nb::handle buffer, size_t need, const sage::Device& device,
                      const char* device_owner, bool read_only, size_t* size) {
  sage::Device dev;
  void* ptr = arrays.bytes(buffer, "workspace", size, &dev, read_only);
  if (dev != device)
    throw sage::Error("workspace", std::string("must be on ") + device_owner + "'s device " +
                                       sage::device_name(device) + " (got " +
                                       sage::device_name(dev) + ")");
  if (*size < need)
    throw sage::Error("workspace", "needs at least " + std::to_string(need) + " bytes (got " +
                                       std::to_string(*size) + ")");
  return ptr;
}

// The device workspace of a one-call GPU entry point (attention, attention_backward): `need`
// bytes from `workspace`, a buffer or a callable(nbytes) returning one, on `device`. An
// allocator's buffer is kept in `keep` until the launch is queued.
void* call_workspace(ViewSet& arrays, nb::handle workspace, size_t need, const sage::Device& device,
                     nb::object& keep, size_t* size) {
  *size = 0;
  if (need == 0) return nullptr;
  nb::handle buffer = workspace;
  if (workspace.is_none())
    throw sage::Error("workspace", "these arguments need " + std::to_string(need) +
                                       " bytes of device workspace; pass a buffer or "
                                       "an allocator callable(nbytes)");
  if (PyCallable_Check(workspace.ptr())) {
    keep = workspace(need);
    buffer = keep;
  }
  sage::Device dev;
  void* ws = arrays.bytes(buffer, "workspace", size, &dev);
  if (dev != device)
    throw sage::Error("workspace", "must be on q's device " + sage::device_name(device) +
                                       " (got " + sage::device_name(dev) + ")");
  if (*size < need)
    throw sage::Error("workspace", "needs at least " + std::to_string(need) + " bytes (got " +
                                       std::to_string(*size) + ")");
  return ws;
}

PyObject* g_argument_error = nullptr;
PyObject* g_cuda_error = nullptr;

}  // namespace
}  // namespace sagepy

// The keyword arguments of every entry point that takes an attention call, in order.
#define SAGEKIT_CALL_KWARGS                                                                     \
  "q"_a.none(), "k"_a.none(), "v"_a.none(), "out"_a.none(), "lse"_a.none() = nb::none(),       \
      "layout"_a = "HND", "causal"_a = false, "window_left"_a = -1, "window_right"_a = -1,     \
      "sm_scale"_a = nb::none(), "recipe"_a.none() = "sage2_8b", "q_scale"_a.none() = nb::none(), \
      "k_scale"_a.none() = nb::none(), "v_scale"_a.none() = nb::none()

NB_MODULE(_C, m) {
  using namespace sagepy;
  m.doc() = "sagekit's C++ library (quantized attention) bound through DLPack.";

  // sage::Error is a caller's mistake: a ValueError that also carries the argument's name,
  // so code can react to it without parsing the message.
  g_argument_error = PyErr_NewExceptionWithDoc(
      "sagekit._C.ArgumentError",
      "A bad argument: a ValueError whose `argument` attribute names it (e.g. 'q', "
      "'recipe.pv_accum') and whose message is the library's one-sentence explanation.",
      PyExc_ValueError, nullptr);
  g_cuda_error = PyErr_NewExceptionWithDoc(
      "sagekit._C.CudaError", "A failure reported by the CUDA runtime or driver.",
      PyExc_RuntimeError, nullptr);
  m.attr("ArgumentError") = nb::handle(g_argument_error);
  m.attr("CudaError") = nb::handle(g_cuda_error);
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const sage::Error& e) {
      PyObject* exc = PyObject_CallFunction(g_argument_error, "s", e.what());
      if (!exc) return;  // the failed call already set a Python error
      PyObject* name = PyUnicode_FromString(e.argument().c_str());
      if (name) {
        PyObject_SetAttrString(exc, "argument", name);
        Py_DECREF(name);
      }
      PyErr_SetObject(g_argument_error, exc);
      Py_DECREF(exc);
    } catch (const sage::CudaError& e) {
      PyErr_SetString(g_cuda_error, e.what());
    }
  });

#if defined(SAGE_WITH_CUDA)
  m.attr("cuda_built") = true;
#else
  m.attr("cuda_built") = false;
#endif
#if defined(SAGEKIT_VERSION)
  m.attr("__version__") = SAGEKIT_VERSION;
#endif

  const auto common_doc =
      "q, k, v: [batch, heads, tokens, head_dim] (HND) or [batch, tokens, heads, head_dim] "
      "(NHD) arrays; out: q's shape, written; lse: optional [batch, heads_q, n_q] float32, "
      "written; causal: bottom-right causal mask; window_left/window_right: a sliding window "
      "(-1: unbounded; FlashAttention's window_size); recipe: a preset name, a spec string "
      "('sage2_8b,pv_accum=fp32') or a dict of options; q_scale/k_scale/v_scale: float32 "
      "scales for prequantized INT8 inputs.";

  m.def(
      "attention",
      [](nb::handle q, nb::handle k, nb::handle v, nb::handle out, nb::handle lse,
         const std::string& layout, bool causal, int64_t window_left, int64_t window_right,
         std::optional<double> sm_scale, nb::handle recipe, nb::handle workspace,
         uintptr_t stream, nb::handle q_scale, nb::handle k_scale, nb::handle v_scale) {
        Call c;
        fill(c, q, k, v, out, lse, layout, causal, {window_left, window_right}, sm_scale, recipe,
             q_scale, k_scale, v_scale);
        const size_t need = sage::workspace_bytes(c.args);
        size_t ws_size = 0;
        nb::object allocated;  // keeps an allocator's buffer alive until the launch is queued
        void* ws = call_workspace(c.arrays, workspace, need, c.args.q.device, allocated, &ws_size);
        nb::gil_scoped_release unlocked;
        sage::attention(c.args, ws, ws_size, reinterpret_cast<void*>(stream));
      },
      "q"_a.none(), "k"_a.none(), "v"_a.none(), "out"_a.none(), "lse"_a.none() = nb::none(), "layout"_a = "HND", "causal"_a = false,
      "window_left"_a = -1, "window_right"_a = -1,
      "sm_scale"_a = nb::none(), "recipe"_a.none() = "sage2_8b", "workspace"_a.none() = nb::none(),
      "stream"_a = 0, "q_scale"_a.none() = nb::none(), "k_scale"_a.none() = nb::none(),
      "v_scale"_a.none() = nb::none(),
      (std::string("Quantized attention on the GPU, enqueued on `stream` (a cudaStream_t as "
                   "an int; 0 is the legacy default stream). Returns once enqueued. workspace: "
                   "a contiguous device buffer of at least workspace_bytes(...) bytes, or a "
                   "callable(nbytes) returning one. ") +
       common_doc)
          .c_str());

  m.def(
      "workspace_bytes",
      [](nb::handle q, nb::handle k, nb::handle v, nb::handle out, nb::handle lse,
         const std::string& layout, bool causal, int64_t window_left, int64_t window_right,
         std::optional<double> sm_scale, nb::handle recipe, nb::handle q_scale,
         nb::handle k_scale, nb::handle v_scale) {
        Call c;
        fill(c, q, k, v, out, lse, layout, causal, {window_left, window_right}, sm_scale, recipe,
             q_scale, k_scale, v_scale);
        return sage::workspace_bytes(c.args);
      },
      SAGEKIT_CALL_KWARGS,
      (std::string("Bytes of device workspace attention() needs for these arguments. ") +
       common_doc)
          .c_str());

  // ---- GPU in two steps: quantize K/V once, then attend any number of times -------------
  m.def(
      "kv_workspace_bytes",
      [](int64_t batch, int64_t heads_kv, int64_t n_kv, int64_t head_dim, nb::handle recipe,
         std::optional<int64_t> head_dim_v) {
        const int64_t dv = head_dim_v.value_or(head_dim);
        const std::pair<int64_t, const char*> dims[] = {{batch, "batch"},
                                                        {heads_kv, "heads_kv"},
                                                        {n_kv, "n_kv"},
                                                        {head_dim, "head_dim"},
                                                        {dv, "head_dim_v"}};
        // Negative sizes would wrap in the library's size_t arithmetic.
        for (const auto& [value, name] : dims)
          if (value < 0)
            throw sage::Error(name, "must be >= 0 (got " + std::to_string(value) + ")");
        return sage::kv_workspace_bytes(batch, heads_kv, n_kv, head_dim, recipe_from(recipe), dv);
      },
      "batch"_a, "heads_kv"_a, "n_kv"_a, "head_dim"_a, "recipe"_a.none() = "sage2_8b",
      "head_dim_v"_a.none() = nb::none(),
      "Bytes of device workspace that quantize_kv fills for K/V of these sizes and this recipe "
      "(head_dim_v: V's head dim where it differs from K's). Shape arithmetic only: no device "
      "is touched. Raises in a build without CUDA.");

  m.def(
      "quantize_kv",
      [](nb::handle k, nb::handle v, nb::handle workspace, const std::string& layout,
         nb::handle recipe, uintptr_t stream, nb::handle k_scale,
         nb::handle v_scale) -> nb::object {
        Call c;
        sage::AttentionArgs& a = c.args;
        a.layout = layout_of(layout);
        a.recipe = recipe_from(recipe);
        a.k = c.arrays.input(k, "k");
        a.v = c.arrays.input(v, "v");
        a.k_scale = c.arrays.input(k_scale, "k_scale");
        a.v_scale = c.arrays.input(v_scale, "v_scale");
        const size_t need = kv_bytes_of(a);
        // The workspace is this call's output and outlives it, so an allocator's buffer is
        // handed back to the caller (who must keep it for attention_from_quantized_kv).
        nb::object result = nb::borrow(workspace);
        if (PyCallable_Check(workspace.ptr())) result = workspace(need);
        void* ws = nullptr;
        size_t ws_size = 0;
        if (!result.is_none()) {
          ws = workspace_range(c.arrays, result, need, a.k.device, "k", /*read_only=*/false,
                               &ws_size);
        } else if (need > 0) {
          throw sage::Error("workspace", "these arguments need " + std::to_string(need) +
                                             " bytes of device workspace (kv_workspace_bytes); "
                                             "pass a buffer or an allocator callable(nbytes)");
        }
        {
          nb::gil_scoped_release unlocked;
          sage::quantize_kv(a, ws, ws_size, reinterpret_cast<void*>(stream));
        }
        return result;
      },
      "k"_a.none(), "v"_a.none(), "workspace"_a.none() = nb::none(), "layout"_a = "HND",
      "recipe"_a.none() = "sage2_8b", "stream"_a = 0, "k_scale"_a.none() = nb::none(),
      "v_scale"_a.none() = nb::none(),
      "Step one of attention(): quantizes k and v (the way `recipe` says) into `workspace`, "
      "enqueued on `stream` (a cudaStream_t as an int). workspace: a contiguous device buffer "
      "of at least kv_workspace_bytes(...) bytes on k's device, aligned to 256 bytes, or a "
      "callable(nbytes) returning one. Returns the buffer (the callable's result, or the one "
      "passed). k_scale/v_scale: float32 scales for prequantized INT8 inputs.");

  m.def(
      "attention_from_quantized_kv",
      [](nb::handle q, nb::handle k, nb::handle v, nb::handle out, nb::handle lse,
         const std::string& layout, bool causal, int64_t window_left, int64_t window_right,
         std::optional<double> sm_scale, nb::handle recipe, nb::handle workspace,
         uintptr_t stream, nb::handle q_scale, nb::handle k_scale, nb::handle v_scale) {
        Call c;
        fill(c, q, k, v, out, lse, layout, causal, {window_left, window_right}, sm_scale, recipe,
             q_scale, k_scale, v_scale);
        if (workspace.is_none())
          throw sage::Error("workspace", "is required: the buffer quantize_kv filled from these "
                                         "k and v with this recipe");
        // Sizes are checked here only when k is well formed; otherwise the library's own
        // checks name k.
        const size_t need = c.args.k.ndim == 4 ? kv_bytes_of(c.args) : 0;
        size_t ws_size = 0;
        const void* ws = workspace_range(c.arrays, workspace, need, c.args.q.device, "q",
                                         /*read_only=*/true, &ws_size);
        nb::gil_scoped_release unlocked;
        sage::attention_from_quantized_kv(c.args, ws, ws_size, reinterpret_cast<void*>(stream));
      },
      "q"_a.none(), "k"_a.none(), "v"_a.none(), "out"_a.none(), "lse"_a.none() = nb::none(),
      "layout"_a = "HND", "causal"_a = false, "window_left"_a = -1, "window_right"_a = -1,
      "sm_scale"_a = nb::none(), "recipe"_a.none() = "sage2_8b", "workspace"_a.none() = nb::none(),
      "stream"_a = 0,
      "q_scale"_a.none() = nb::none(), "k_scale"_a.none() = nb::none(),
      "v_scale"_a.none() = nb::none(),
      (std::string("Step two of attention(): attention of q over the K/V that quantize_kv put in "
                   "`workspace` (read only; it may serve any number of calls), enqueued on "
                   "`stream`. k and v must describe the tensors quantize_kv saw: only their "
                   "shapes are used, their data is not read. ") +
       common_doc)
          .c_str());

  m.def(
      "gpu_supports", [](nb::handle recipe) { return sage::gpu_supports(recipe_from(recipe)); },
      "recipe"_a.none(),
      "Whether a recipe (preset name, spec string or dict) has an sm_90 kernel in this build "
      "(False in a build without CUDA); attention() refuses the others with an error naming "
      "what is missing.");

  // The backward (training) on the GPU: attention()'s conventions, with dout in and dq, dk,
  // dv (and optionally the forward's out and lse) written; or, given the saved forward's L2
  // (attention_for_training, below) and out, read, without running the forward again.
  m.def(
      "attention_backward",
      [](nb::handle q, nb::handle k, nb::handle v, nb::handle dout, nb::handle dq, nb::handle dk,
         nb::handle dv, nb::handle out, nb::handle lse, const std::string& layout, bool causal,
         std::optional<double> sm_scale, nb::handle recipe, nb::handle workspace,
         uintptr_t stream, nb::handle lse2, bool deterministic) {
        BackwardCall c;
        fill_backward(c, q, k, v, dout, dq, dk, dv, out, lse, layout, causal, sm_scale, recipe,
                      /*host=*/false, lse2, deterministic);
        const size_t need = sage::backward_workspace_bytes(c.args);
        size_t ws_size = 0;
        nb::object allocated;  // keeps an allocator's buffer alive until the launch is queued
        void* ws = call_workspace(c.arrays, workspace, need, c.args.q.device, allocated, &ws_size);
        nb::gil_scoped_release unlocked;
        sage::attention_backward(c.args, ws, ws_size, reinterpret_cast<void*>(stream));
      },
      "q"_a.none(), "k"_a.none(), "v"_a.none(), "dout"_a.none(), "dq"_a.none(), "dk"_a.none(),
      "dv"_a.none(), "out"_a.none() = nb::none(), "lse"_a.none() = nb::none(), nb::kw_only(),
      "layout"_a = "HND", "causal"_a = false, "sm_scale"_a = nb::none(),
      "recipe"_a.none() = "sagebwd", "workspace"_a.none() = nb::none(), "stream"_a = 0,
      "lse2"_a.none() = nb::none(), "deterministic"_a = false,
      "The gradients of attention on the GPU (sm_90a), enqueued on `stream` (a cudaStream_t as "
      "an int). Without lse2 it runs the recipe's forward again (writing out and lse where "
      "given), then its backward; with lse2, the rows' base-2 log-sums that "
      "attention_for_training() wrote, and out, that same call's output (read, not written; "
      "lse must then be None), only the K/V pre-pass runs again before the backward. "
      "The gradients are the same bits either way: dq, dk, dv in q's dtype (dk, dv summed "
      "over the query heads of a GQA group), with fp32 atomics: their last bits may change "
      "from run to run unless deterministic=True, which fixes the atomics' order (slower; "
      "sage/backward.h, \"Determinism\"). q, k, v: as for attention(); dout: q's shape and dtype; dq, dk, dv: q's, k's and "
      "v's shapes, written; out: q's shape, lse: [batch, heads_q, n_q] float32, optional; "
      "lse2: [batch, heads_q, n_q] float32, contiguous, optional. recipe: one the sm_90 "
      "backward implements (gpu_supports_backward: sagebwd, sagebwd_block). workspace: a contiguous device "
      "buffer of at least backward_workspace_bytes(...) bytes (with the same lse2 and "
      "deterministic) aligned to 256, or a callable(nbytes) returning one.");
  m.def(
      "backward_workspace_bytes",
      [](nb::handle q, nb::handle k, nb::handle v, nb::handle dout, nb::handle dq, nb::handle dk,
         nb::handle dv, nb::handle out, nb::handle lse, const std::string& layout, bool causal,
         std::optional<double> sm_scale, nb::handle recipe, nb::handle lse2, bool deterministic) {
        BackwardCall c;
        fill_backward(c, q, k, v, dout, dq, dk, dv, out, lse, layout, causal, sm_scale, recipe,
                      /*host=*/false, lse2, deterministic);
        return sage::backward_workspace_bytes(c.args);
      },
      "q"_a.none(), "k"_a.none(), "v"_a.none(), "dout"_a.none(), "dq"_a.none(), "dk"_a.none(),
      "dv"_a.none(), "out"_a.none() = nb::none(), "lse"_a.none() = nb::none(), nb::kw_only(),
      "layout"_a = "HND", "causal"_a = false, "sm_scale"_a = nb::none(),
      "recipe"_a.none() = "sagebwd", "lse2"_a.none() = nb::none(), "deterministic"_a = false,
      "Bytes of device workspace attention_backward() needs for these arguments, lse2 (the "
      "saved forward's L2) and deterministic (its turn counters) included, since the size "
      "depends on them (raises in a build without CUDA, like every GPU entry point there).");
  m.def(
      "attention_for_training",
      [](nb::handle q, nb::handle k, nb::handle v, nb::handle out, nb::handle lse2,
         nb::handle lse, const std::string& layout, bool causal, int64_t window_left,
         int64_t window_right, std::optional<double> sm_scale, nb::handle recipe,
         nb::handle workspace, uintptr_t stream) {
        Call c;
        fill(c, q, k, v, out, lse, layout, causal, {window_left, window_right}, sm_scale, recipe,
             nb::none(), nb::none(), nb::none());
        if (lse2.is_none())
          throw sage::Error("lse2", "is required (a float32 [batch, heads_q, n_q] contiguous "
                                    "array to write the rows' base-2 log-sums into)");
        const sage::TensorView l2 = c.arrays.output(lse2, "lse2");
        const size_t need = sage::workspace_bytes(c.args);
        size_t ws_size = 0;
        nb::object allocated;  // keeps an allocator's buffer alive until the launch is queued
        void* ws = call_workspace(c.arrays, workspace, need, c.args.q.device, allocated, &ws_size);
        nb::gil_scoped_release unlocked;
        sage::attention_for_training(c.args, l2, ws, ws_size, reinterpret_cast<void*>(stream));
      },
      "q"_a.none(), "k"_a.none(), "v"_a.none(), "out"_a.none(), "lse2"_a.none(),
      "lse"_a.none() = nb::none(), nb::kw_only(), "layout"_a = "HND", "causal"_a = false,
      "window_left"_a = -1, "window_right"_a = -1, "sm_scale"_a = nb::none(),
      "recipe"_a.none() = "sagebwd", "workspace"_a.none() = nb::none(), "stream"_a = 0,
      "The forward of a training step on the GPU (sm_90a): attention() (the same out and lse, "
      "bit for bit) that also writes the rows' base-2 log-sums L2 into lse2 (float32 "
      "[batch, heads_q, n_q], contiguous, on q's device), which attention_backward(..., "
      "out=out, lse2=lse2) then uses instead of running the forward again. Recipes the sm_90 "
      "backward implements only (gpu_supports_backward). Enqueued on `stream`; workspace: as "
      "attention()'s (workspace_bytes(...) bytes, or a callable(nbytes) returning them). q, k, "
      "v, out, lse, layout, causal, window_left/window_right, sm_scale, recipe: as for "
      "attention().");
  m.def(
      "gpu_supports_backward",
      [](nb::handle recipe) { return sage::gpu_supports_backward(recipe_from(recipe)); },
      "recipe"_a.none(),
      "Whether the sm_90 backward implements a recipe (preset name, spec string or dict) in "
      "this build: sagebwd's configuration, dS per token (sagebwd) or per tile (sagebwd_block) "
      "(False in a build without CUDA); "
      "attention_backward() refuses the others naming what is missing.");
  m.def(
      "has_backward", [](nb::handle recipe) { return sage::has_backward(recipe_from(recipe)); },
      "recipe"_a.none(),
      "Whether a recipe has a backward at all (its backward formats are set: sagebwd, "
      "sagebwd_block and their variants); the CPU simulator runs every such recipe.");

  // The CPU references share everything but the function they call.
  auto host_reference = [](void (*reference)(const sage::AttentionArgs&)) {
    return [reference](nb::handle q, nb::handle k, nb::handle v, nb::handle out, nb::handle lse,
                       const std::string& layout, bool causal, int64_t window_left,
                       int64_t window_right, std::optional<double> sm_scale, nb::handle recipe,
                       nb::handle q_scale, nb::handle k_scale, nb::handle v_scale) {
      Call c;
      fill(c, q, k, v, out, lse, layout, causal, {window_left, window_right}, sm_scale, recipe,
           q_scale, k_scale, v_scale);
      require_host(c.args);
      nb::gil_scoped_release unlocked;
      reference(c.args);
    };
  };
  m.def("simulate", host_reference(&sage::reference::simulate), SAGEKIT_CALL_KWARGS,
        (std::string("The recipe computed on the CPU with exactly the GPU kernel's quantization; "
                     "host arrays only. ") +
         common_doc)
            .c_str());
  m.def("exact", host_reference(&sage::reference::exact), SAGEKIT_CALL_KWARGS,
        (std::string("Attention in float64 on the CPU (the recipe only matters for prequantized "
                     "inputs); host arrays only. ") +
         common_doc)
            .c_str());

  // The backward's CPU references share everything but the function they call.
  auto host_backward = [](void (*reference)(const sage::BackwardArgs&)) {
    return [reference](nb::handle q, nb::handle k, nb::handle v, nb::handle dout, nb::handle dq,
                       nb::handle dk, nb::handle dv, nb::handle out, nb::handle lse,
                       const std::string& layout, bool causal, std::optional<double> sm_scale,
                       nb::handle recipe) {
      BackwardCall c;
      fill_backward(c, q, k, v, dout, dq, dk, dv, out, lse, layout, causal, sm_scale, recipe);
      nb::gil_scoped_release unlocked;
      reference(c.args);
    };
  };
  const auto backward_doc =
      "q, k, v, dout (dO, q's shape and dtype): host arrays as for simulate; dq, dk, dv: "
      "arrays of q's, k's and v's shapes, written (dk, dv summed over the query heads of a "
      "GQA group); out, lse: optional, written with the forward's output and natural-log LSE.";
#define SAGEKIT_BACKWARD_KWARGS                                                                \
  "q"_a.none(), "k"_a.none(), "v"_a.none(), "dout"_a.none(), "dq"_a.none(), "dk"_a.none(),    \
      "dv"_a.none(), "out"_a.none() = nb::none(), "lse"_a.none() = nb::none(),                 \
      "layout"_a = "HND", "causal"_a = false, "sm_scale"_a = nb::none(),                       \
      "recipe"_a.none() = "sagebwd"
  m.def("simulate_backward", host_backward(&sage::reference::simulate_backward),
        SAGEKIT_BACKWARD_KWARGS,
        (std::string("The recipe's forward and backward on the CPU as docs/numerics.md (\"The "
                     "backward\") states them; the recipe must have a backward (sagebwd, sagebwd_block). ") +
         backward_doc)
            .c_str());
  m.def("exact_backward", host_backward(&sage::reference::exact_backward), SAGEKIT_BACKWARD_KWARGS,
        (std::string("The gradients of attention in float64 on the CPU (the recipe is not "
                     "used). ") +
         backward_doc)
            .c_str());
#undef SAGEKIT_BACKWARD_KWARGS

  // Packed variable-length batches (FlashAttention's flash_attn_varlen_func names): the CPU
  // references run them; the GPU entry point refuses by name until its kernel exists.
  auto host_varlen = [](void (*reference)(const sage::VarlenArgs&)) {
    return [reference](nb::handle q, nb::handle k, nb::handle v, nb::handle cu_seqlens_q,
                       nb::handle cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k,
                       nb::handle out, nb::handle lse, bool causal, int64_t window_left,
                       int64_t window_right, std::optional<double> sm_scale, nb::handle recipe) {
      VarlenCall c;
      fill_varlen(c, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, out, lse,
                  causal, {window_left, window_right}, sm_scale, recipe);
      nb::gil_scoped_release unlocked;
      reference(c.args);
    };
  };
  const auto varlen_doc =
      "q: [total_q, heads_q, head_dim], k, v: [total_k, heads_kv, head_dim] host arrays; "
      "cu_seqlens_q, cu_seqlens_k: int32 [batch + 1] offsets (host); max_seqlen_q/_k: at least "
      "the longest sequence; out: q's shape, written; lse: optional [heads_q, total_q] float32, "
      "written; causal, window_left/window_right, sm_scale, recipe as for simulate, per sequence.";
#define SAGEKIT_VARLEN_KWARGS                                                                  \
  "q"_a.none(), "k"_a.none(), "v"_a.none(), "cu_seqlens_q"_a.none(), "cu_seqlens_k"_a.none(), \
      "max_seqlen_q"_a, "max_seqlen_k"_a, "out"_a.none(), "lse"_a.none() = nb::none(),         \
      "causal"_a = false, "window_left"_a = -1, "window_right"_a = -1,                         \
      "sm_scale"_a = nb::none(), "recipe"_a.none() = "sage2_8b"
  m.def("simulate_varlen", host_varlen(&sage::reference::simulate_varlen), SAGEKIT_VARLEN_KWARGS,
        (std::string("simulate on each sequence of a packed batch (every statistic over that "
                     "sequence's tokens only). ") +
         varlen_doc)
            .c_str());
  m.def("exact_varlen", host_varlen(&sage::reference::exact_varlen), SAGEKIT_VARLEN_KWARGS,
        (std::string("exact on each sequence of a packed batch. ") + varlen_doc).c_str());
#undef SAGEKIT_VARLEN_KWARGS
  const auto gpu_varlen_doc =
      "q: [total_q, heads_q, head_dim], k, v: [total_k, heads_kv, head_dim] device arrays "
      "(fp16/bf16, head_dim contiguous, any other strides); cu_seqlens_q, cu_seqlens_k: int32 "
      "[batch + 1] offsets in device memory (flash_attn_varlen_func's; never read on the host); "
      "max_seqlen_q/_k: at least the longest sequence (they size the grid and the workspace); "
      "out: q's shape, written; lse: optional [heads_q, total_q] float32, written; causal "
      "(bottom-right per sequence), window_left/window_right, sm_scale, recipe as for attention.";
  m.def(
      "attention_varlen",
      [](nb::handle q, nb::handle k, nb::handle v, nb::handle cu_seqlens_q, nb::handle cu_seqlens_k,
         int64_t max_seqlen_q, int64_t max_seqlen_k, nb::handle out, nb::handle lse, bool causal,
         int64_t window_left, int64_t window_right, std::optional<double> sm_scale,
         nb::handle recipe, nb::handle workspace, uintptr_t stream) {
        VarlenCall c;
        fill_varlen(c, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, out, lse,
                    causal, {window_left, window_right}, sm_scale, recipe, /*host=*/false);
        const size_t need = sage::varlen_workspace_bytes(c.args);
        size_t ws_size = 0;
        nb::object allocated;  // keeps an allocator's buffer alive until the launch is queued
        void* ws = call_workspace(c.arrays, workspace, need, c.args.q.device, allocated, &ws_size);
        nb::gil_scoped_release unlocked;
        sage::attention_varlen(c.args, ws, ws_size, reinterpret_cast<void*>(stream));
      },
      "q"_a.none(), "k"_a.none(), "v"_a.none(), "cu_seqlens_q"_a.none(), "cu_seqlens_k"_a.none(),
      "max_seqlen_q"_a, "max_seqlen_k"_a, "out"_a.none(), "lse"_a.none() = nb::none(),
      "causal"_a = false, "window_left"_a = -1, "window_right"_a = -1, "sm_scale"_a = nb::none(),
      "recipe"_a.none() = "sage2_8b", "workspace"_a.none() = nb::none(), "stream"_a = 0,
      (std::string("Quantized attention on a packed variable-length batch on the GPU, enqueued "
                   "on `stream` (a cudaStream_t as an int). Every statistic is per sequence. "
                   "workspace: a device buffer of at least varlen_workspace_bytes(...) bytes, "
                   "or a callable(nbytes) returning one. ") +
       gpu_varlen_doc)
          .c_str());
  m.def(
      "varlen_workspace_bytes",
      [](int64_t batch, int64_t heads_kv, int64_t max_seqlen_k, int64_t total_k, int64_t head_dim,
         nb::handle recipe, std::optional<int64_t> head_dim_v) {
        const int64_t dv = head_dim_v.value_or(head_dim);
        const std::pair<int64_t, const char*> dims[] = {{batch, "batch"},
                                                        {heads_kv, "heads_kv"},
                                                        {max_seqlen_k, "max_seqlen_k"},
                                                        {total_k, "total_k"},
                                                        {head_dim, "head_dim"},
                                                        {dv, "head_dim_v"}};
        for (const auto& [value, name] : dims)
          if (value < 0)
            throw sage::Error(name, "must be >= 0 (got " + std::to_string(value) + ")");
        return sage::varlen_workspace_bytes(batch, heads_kv, max_seqlen_k, total_k, head_dim,
                                            recipe_from(recipe), dv);
      },
      "batch"_a, "heads_kv"_a, "max_seqlen_k"_a, "total_k"_a, "head_dim"_a,
      "recipe"_a.none() = "sage2_8b", "head_dim_v"_a.none() = nb::none(),
      "Bytes of device workspace attention_varlen needs: the quantized K/V laid out per "
      "sequence, each padded to whole 128-key tiles of min(max_seqlen_k, total_k) keys. Shape "
      "arithmetic only (no device is touched, no offset read). Raises in a build without CUDA.");

  m.def(
      "check_args",
      [](nb::handle q, nb::handle k, nb::handle v, nb::handle out, nb::handle lse,
         const std::string& layout, bool causal, int64_t window_left, int64_t window_right,
         std::optional<double> sm_scale, nb::handle recipe, nb::handle q_scale,
         nb::handle k_scale, nb::handle v_scale, const std::string& device) {
        Call c;
        fill(c, q, k, v, out, lse, layout, causal, {window_left, window_right}, sm_scale, recipe,
             q_scale, k_scale, v_scale);
        sage::DeviceKind kind;
        if (device == "cuda") kind = sage::DeviceKind::cuda;
        else if (device == "cpu") kind = sage::DeviceKind::cpu;
        else throw sage::Error("device", "must be 'cuda' or 'cpu' (got '" + device + "')");
        return problem_dict(sage::check_args(c.args, kind));
      },
      SAGEKIT_CALL_KWARGS, "device"_a = "cuda",
      "Checks the arguments as the entry points do (device 'cuda' or 'cpu') and returns the "
      "problem's shape as a dict; raises ArgumentError naming the first bad argument.");

  m.def(
      "presets",
      []() {
        nb::list l;
        for (const sage::Recipe& r : sage::presets()) l.append(recipe_to_dict(r));
        return l;
      },
      "The papers' configurations: one dict per preset with name, paper, summary and every "
      "recipe option.");
  m.def(
      "resolve_recipe", [](nb::handle spec) { return recipe_to_dict(recipe_from(spec)); },
      "spec"_a.none(),
      "Validates a recipe (preset name, spec string or dict of options) and returns all its "
      "options as a dict.");
  m.def(
      "recipe_spec", [](nb::handle spec) { return recipe_to_spec(recipe_from(spec)); },
      "spec"_a.none(),
      "The canonical spec string of a recipe: a plain str that names every option.");
  // Per-layer recipe selection over host arrays; the result is the calibration JSON text.
  m.def(
      "calibrate",
      [](nb::list layers, nb::handle speeds, std::optional<std::vector<std::string>> recipes,
         double threshold, bool causal, const std::string& layout,
         std::optional<double> sm_scale, int64_t speed_tokens) {
        ViewSet arrays;
        std::vector<sage::LayerSamples> samples;
        for (size_t i = 0; i < layers.size(); ++i) {
          nb::sequence qkv = nb::cast<nb::sequence>(layers[i]);
          if (nb::len(qkv) != 3)
            throw sage::Error("layers", "item " + std::to_string(i) + " must be a (q, k, v) triple");
          sage::LayerSamples l{arrays.input(qkv[0], "q"), arrays.input(qkv[1], "k"),
                               arrays.input(qkv[2], "v")};
          sage::AttentionArgs probe;
          probe.q = l.q, probe.k = l.k, probe.v = l.v;
          require_host(probe);
          samples.push_back(l);
        }
        sage::SpeedTable table;
        if (nb::isinstance<nb::str>(speeds)) {
          table = sage::load_speed_table(nb::cast<std::string>(speeds));
        } else {
          for (nb::handle e : nb::cast<nb::list>(speeds)) {
            nb::dict d = nb::cast<nb::dict>(e);
            table.add({nb::cast<std::string>(d["recipe"]), nb::cast<int64_t>(d["d"]),
                       nb::cast<bool>(d["causal"]), nb::cast<int64_t>(d["n"]),
                       nb::cast<double>(d["tops"])});
          }
        }
        sage::CalibrationOptions o;
        if (recipes) o.candidates = *recipes;
        o.threshold = threshold;
        o.causal = causal;
        o.layout = layout_of(layout);
        if (sm_scale) o.sm_scale = static_cast<float>(*sm_scale);
        o.speed_tokens = speed_tokens;
        sage::Calibration c;
        {
          nb::gil_scoped_release unlocked;
          c = sage::calibrate(samples, table, o);
        }
        return sage::calibration_json(c);
      },
      "layers"_a, "speeds"_a, "recipes"_a = nb::none(), "threshold"_a = 0.998, "causal"_a = false,
      "layout"_a = "HND", "sm_scale"_a = nb::none(), "speed_tokens"_a = 0,
      "Per-layer recipe selection (docs/calibration.md) on host arrays; returns the JSON text.");
  m.def(
      "load_layer_choices",
      [](const std::string& path) {
        std::vector<std::string> names;
        for (const sage::Recipe& r : sage::load_layer_choices(path)) names.push_back(r.name);
        return names;
      },
      "path"_a, "The recipe name of each layer, from a calibration file.");

  m.def("gpu_available", &sage::gpu_available,
        "True when this build has GPU kernels and a device of compute capability 9.0 is "
        "present.");
  m.def(
      "gpu_head_dims", []() { return parse_head_dims(sage::gpu_head_dims()); },
      "The head dims the GPU path of this build takes: every multiple of 8 from 32 up to its "
      "largest kernel tile, zero-padded inside the kernel to the next tile (empty without CUDA).");
  m.def(
      "gpu_kernel_head_dims", []() { return parse_head_dims(sage::gpu_kernel_head_dims()); },
      "The head dims this build instantiated GPU kernel tiles for (empty without CUDA).");
}
