// The GPU backward entry point (sm_90a): the recipe's forward through the forward's dispatch
// (which also saves the rows' base-2 log-sums), then the SageBwd backward kernels
// (sm90/bwd/). docs/numerics.md, "The backward", is the contract; "GPU against the simulator
// (backward)" says where the kernel may differ from the simulator.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <string>

#include "api/backward_gpu.h"
#include "built_kernels.h"
#include "common/cuda_check.h"
#include "numerics/quant_rules.h"
#include "numerics/tile.h"
#include "sage/attention.h"
#include "sage/backward.h"
#include "sage/error.h"
#include "sm90/bwd/kernel_traits.h"
#include "sm90/bwd/params.h"

namespace sage {
namespace sm90::bwd {
template <int D, class T, DsGranularity G>
void launch_backward(const BackwardParams& p, cudaStream_t stream);
}

namespace {

constexpr size_t kAlign = 256;
size_t align_up(size_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

// What the sm_90 backward lacks for a recipe, in words; empty when it implements it. The
// kernel is SageBwd's configuration: any choice outside it is refused by name.
std::string gpu_backward_gap(const Recipe& r) {
  if (!has_backward(r)) return {};  // validate_backward names it
  if (r.qk_format != QKFormat::int8 || r.qk_granularity != Granularity::per_block)
    return "qk_format int8 with qk_granularity per_block (the kernel recomputes S from per-block "
           "Q and K codes)";
  if (!(r.pv_format == PVFormat::int8 && r.p_scale == PScale::per_token &&
        r.v_scale == VScale::per_block))
    return "SageBwd's forward, pv_format int8 with p_scale per_token and v_scale per_block (its "
           "kernel, the int8_dynamic PV path, is the one that saves the rows' base-2 log-sums)";
  if (r.dv_format != BwdFormat::int8) return "dv_format int8";
  if (r.dp_format != BwdFormat::fp16)
    return "dp_format fp16 (int8 dP, the paper's ablation, runs in the simulator only)";
  if (r.dq_format != BwdFormat::int8) return "dq_format int8";
  if (r.dk_format != BwdFormat::int8) return "dk_format int8";
  if (r.bwd_p_granularity != Granularity::per_token) return "bwd_p_granularity per_token";
  // bwd_ds_granularity: both of validate_backward's, per_block and per_token, have a kernel.
  return {};
}

// Rows of the backward's padded Q (a whole number of 64-row tiles).
int64_t q_pad(int64_t n_q) { return ceil_div(std::max<int64_t>(n_q, 1), sm90::bwd::kBlockQ) * sm90::bwd::kBlockQ; }
int64_t kv_pad(int64_t n_kv) {
  return std::max<int64_t>(1, ceil_div(n_kv, sm90::bwd::kBlockKV)) * sm90::bwd::kBlockKV;
}

struct BackwardLayout {
  size_t fwd, out, lse2, l2p, delta, q8, q8t, q_scale, do8t, do_scale, dq_acc, dk_acc, dv_acc;
  size_t dq_turn, dkv_turn;  // deterministic mode's counters (0 bytes otherwise)
  size_t total;
};

// A dense view of q's shape and dtype at `data`, in the call's layout: the forward's output
// when the caller does not ask for it.
TensorView dense_like(const TensorView& q, void* data) {
  TensorView t = q;
  t.data = data;
  int64_t stride = 1;
  for (int i = 3; i >= 0; --i) {
    t.strides[i] = stride;
    stride *= q.shape[i] > 0 ? q.shape[i] : 1;
  }
  return t;
}

// The forward's arguments; out is the caller's or the workspace's (at out_data).
AttentionArgs forward_of(const BackwardArgs& a, void* out_data) {
  AttentionArgs f = forward_args(a);
  f.out = a.out.defined() ? a.out : dense_like(a.q, out_data);
  f.lse = a.lse;
  return f;
}

struct Checked {
  Problem problem;
  BackwardLayout layout;
};

Checked check_gpu_backward(const BackwardArgs& a) {
  const Problem pr = check_backward_args(a, DeviceKind::cuda);
  validate_backward(a.recipe);
  const std::string gap = gpu_backward_gap(a.recipe);
  if (!gap.empty())
    throw Error("recipe", "'" + a.recipe.name + "' has no sm_90 backward (the kernel needs " + gap +
                              "); the CPU simulator runs it (reference::simulate_backward)");
  if (pr.heads_kv == 0 || pr.heads_q % pr.heads_kv != 0)
    throw Error("k", "heads_q must be a multiple of heads_kv");
  bool built = false;
#define SAGE_BUILT_DIM(D) built = built || pr.head_dim == D;
  SAGE_FOR_EACH_HEAD_DIM(SAGE_BUILT_DIM)
#undef SAGE_BUILT_DIM
  if (!built)
    throw Error("q", "head_dim " + std::to_string(pr.head_dim) + " has no kernel in this build (built: " +
                         SAGE_HEAD_DIMS_STRING + ")");
  if (!sm90::bwd::backward_has_kernel(int(pr.head_dim)))
    throw Error("q", "head_dim " + std::to_string(pr.head_dim) +
                         " has no sm_90 backward (the backward kernel exists at head_dim 64 and 128)");
  // The kernels read dout in 16-byte pieces (the forward's rule for q, k, v).
  bool aligned = reinterpret_cast<uintptr_t>(a.dout.data) % 16 == 0;
  for (int d = 0; d < 3; ++d) aligned = aligned && a.dout.strides[d] % 8 == 0;
  if (!aligned)
    throw Error("dout", "the GPU kernels need the data pointer aligned to 16 bytes and strides[0..2] "
                        "to be multiples of 8 elements");
  // The backward kernel reads V and dO with TMA through their strides: the same rule for v
  // (which the forward's checks also hold it to), checked before anything is enqueued.
  bool v_aligned = reinterpret_cast<uintptr_t>(a.v.data) % 16 == 0;
  for (int d = 0; d < 3; ++d) v_aligned = v_aligned && a.v.strides[d] % 8 == 0;
  if (!v_aligned)
    throw Error("v", "the GPU backward needs the data pointer aligned to 16 bytes and strides[0..2] "
                     "to be multiples of 8 elements");
  BackwardLayout w{};
  size_t off = 0;
  auto take = [&](size_t bytes) {
    const size_t at = off;
    off = align_up(off + bytes);
    return at;
  };
  const size_t bh = size_t(pr.batch * pr.heads_q), kvh = size_t(pr.batch * pr.heads_kv);
  const size_t d = size_t(pr.head_dim), nq = size_t(pr.n_q), nkv = size_t(pr.n_kv);
  const size_t nqp = size_t(q_pad(pr.n_q)), tiles = nqp / sm90::bwd::kBlockQ;
  const size_t kv_tiles = size_t(kv_pad(pr.n_kv)) / sm90::bwd::kBlockKV;
  // The forward's own workspace first (its quantized K' is the backward's).
  AttentionArgs f = forward_of(a, reinterpret_cast<void*>(kAlign));  // a non-null stand-in
  w.fwd = take(workspace_bytes(f));
  w.out = take(a.out.defined() ? 0 : bh * nq * d * dtype_size(a.q.dtype));
  w.lse2 = take(bh * nq * 4);
  w.l2p = take(bh * nqp * 4);
  w.delta = take(bh * nqp * 4);
  w.q8 = take(bh * nqp * d);
  w.q8t = take(bh * nqp * d);
  w.q_scale = take(bh * tiles * 4);
  w.do8t = take(bh * nqp * d);
  w.do_scale = take(bh * tiles * 4);
  w.dq_acc = take(bh * nqp * d * 4);  // tile-major (kernel_traits.h, dq_fragment_index)
  w.dk_acc = take(kvh * nkv * d * 4);
  w.dv_acc = take(kvh * nkv * d * 4);
  // After the accumulators: the memset that zeroes them zeroes the counters too.
  w.dq_turn = take(a.deterministic ? bh * tiles * 4 : 0);
  w.dkv_turn = take(a.deterministic ? kvh * kv_tiles * 4 : 0);
  w.total = off;
  return {pr, w};
}

struct Dims {
  int64_t b, h, n;
};
Dims strides_of(const TensorView& t, Layout layout) {
  if (layout == Layout::HND) return {t.strides[0], t.strides[1], t.strides[2]};
  return {t.strides[0], t.strides[2], t.strides[1]};
}

// The kernel of the recipe's dS granularity (validate_backward admits these two).
template <int D, class T>
void run_backward(const sm90::bwd::BackwardParams& p, Granularity ds, cudaStream_t s) {
  using sm90::bwd::DsGranularity;
  if constexpr (sm90::bwd::backward_has_kernel(D)) {
    if (ds == Granularity::per_token) sm90::bwd::launch_backward<D, T, DsGranularity::per_token>(p, s);
    else sm90::bwd::launch_backward<D, T, DsGranularity::per_block>(p, s);
  }
}

}  // namespace

bool gpu_supports_backward(const Recipe& recipe) {
  try {
    validate_recipe(recipe);
    validate_backward(recipe);
  } catch (const Error&) {
    return false;
  }
  return gpu_supports(recipe) && gpu_backward_gap(recipe).empty();
}

size_t backward_workspace_bytes(const BackwardArgs& args) { return check_gpu_backward(args).layout.total; }

void attention_backward(const BackwardArgs& args, void* workspace, size_t workspace_size, void* stream) {
  const Checked c = check_gpu_backward(args);
  const Problem& pr = c.problem;
  const BackwardLayout& w = c.layout;
  if (workspace_size < w.total)
    throw Error("workspace_size", "must be at least backward_workspace_bytes(args) = " +
                                      std::to_string(w.total) + " bytes (got " +
                                      std::to_string(workspace_size) + ")");
  if (workspace == nullptr || reinterpret_cast<uintptr_t>(workspace) % kAlign != 0)
    throw Error("workspace", "must be a device pointer aligned to 256 bytes");
  auto* ws = static_cast<uint8_t*>(workspace);
  auto* s = static_cast<cudaStream_t>(stream);
  // Empty problems: gradients of nothing (dk, dv of keys no query sees are zero).
  const AttentionArgs f = forward_of(args, ws + w.out);
  // With the saved forward's L2 (and out), only the K/V pre-pass runs again (K' codes).
  const bool saved = args.lse2.defined();
  auto* lse2 = saved ? static_cast<float*>(args.lse2.data) : reinterpret_cast<float*>(ws + w.lse2);
  const quant::QuantizedKV kv = saved ? detail::quantize_kv_for_backward(f, ws + w.fwd, w.out - w.fwd, s)
                                      : detail::attention_for_backward(f, ws + w.fwd, w.out - w.fwd, lse2, s);

  sm90::bwd::BackwardParams p{};
  const Dims qs = strides_of(args.q, args.layout), vs = strides_of(args.v, args.layout);
  const Dims dos = strides_of(args.dout, args.layout), os = strides_of(f.out, args.layout);
  const Dims dqs = strides_of(args.dq, args.layout), dks = strides_of(args.dk, args.layout);
  const Dims dvs = strides_of(args.dv, args.layout);
  p.q = args.q.data, p.q_sb = qs.b, p.q_sh = qs.h, p.q_sn = qs.n;
  p.v = args.v.data, p.v_sb = vs.b, p.v_sh = vs.h, p.v_sn = vs.n;
  p.dout = args.dout.data, p.do_sb = dos.b, p.do_sh = dos.h, p.do_sn = dos.n;
  p.out = f.out.data, p.o_sb = os.b, p.o_sh = os.h, p.o_sn = os.n;
  p.dq = args.dq.data, p.dq_sb = dqs.b, p.dq_sh = dqs.h, p.dq_sn = dqs.n;
  p.dk = args.dk.data, p.dk_sb = dks.b, p.dk_sh = dks.h, p.dk_sn = dks.n;
  p.dv = args.dv.data, p.dv_sb = dvs.b, p.dv_sh = dvs.h, p.dv_sn = dvs.n;
  p.k8 = kv.k;
  p.k_scale = kv.k_scale;
  p.lse2 = lse2;
  p.l2p = reinterpret_cast<float*>(ws + w.l2p);
  p.delta = reinterpret_cast<float*>(ws + w.delta);
  p.q8 = reinterpret_cast<int8_t*>(ws + w.q8);
  p.q8t = reinterpret_cast<int8_t*>(ws + w.q8t);
  p.q_scale = reinterpret_cast<float*>(ws + w.q_scale);
  p.do8t = reinterpret_cast<int8_t*>(ws + w.do8t);
  p.do_scale = reinterpret_cast<float*>(ws + w.do_scale);
  p.dq_acc = reinterpret_cast<float*>(ws + w.dq_acc);
  p.dk_acc = reinterpret_cast<float*>(ws + w.dk_acc);
  p.dv_acc = reinterpret_cast<float*>(ws + w.dv_acc);
  p.deterministic = args.deterministic;
  p.dq_turn = args.deterministic ? reinterpret_cast<int*>(ws + w.dq_turn) : nullptr;
  p.dkv_turn = args.deterministic ? reinterpret_cast<int*>(ws + w.dkv_turn) : nullptr;
  p.batch = int(pr.batch), p.heads_q = int(pr.heads_q), p.heads_kv = int(pr.heads_kv);
  p.n_q = int(pr.n_q), p.n_kv = int(pr.n_kv);
  p.n_pad = int(kv_pad(pr.n_kv));
  p.n_q_pad = int(q_pad(pr.n_q));
  p.fwd_block_q = tile_config(int(pr.head_dim)).block_q;
  p.causal = args.causal;

  p.sm_scale = pr.sm_scale;
  p.sm_scale_log2 = rules::sm_scale_log2(pr.sm_scale);
  // The fp32 accumulators start at zero (dK and dV also where no query sees a key), and so do
  // deterministic mode's turn counters.
  const cudaError_t err = cudaMemsetAsync(ws + w.dq_acc, 0, w.total - w.dq_acc, s);
  if (err != cudaSuccess) throw_cuda("backward workspace memset", err);
  const bool bf16 = args.q.dtype == DType::bf16;
  const Granularity ds = args.recipe.bwd_ds_granularity;
#define SAGE_BACKWARD_DIM(D)                                       \
  if (pr.head_dim == D) {                                          \
    if (bf16) run_backward<D, __nv_bfloat16>(p, ds, s);            \
    else run_backward<D, __half>(p, ds, s);                        \
    return;                                                        \
  }
  SAGE_FOR_EACH_HEAD_DIM(SAGE_BACKWARD_DIM)
#undef SAGE_BACKWARD_DIM
  throw Error("q", "head_dim " + std::to_string(pr.head_dim) + " has no kernel in this build (built: " +
                       SAGE_HEAD_DIMS_STRING + ")");
}

void attention_for_training(const AttentionArgs& args, const TensorView& lse2, void* workspace,
                            size_t workspace_size, void* stream) {
  const Problem pr = check_args(args, DeviceKind::cuda);
  if (!gpu_supports_backward(args.recipe))
    throw Error("recipe", "'" + args.recipe.name + "' has no sm_90 backward, so no training forward " +
                              "(gpu_supports_backward)");
  detail::check_one_head_dim(pr.head_dim, pr.head_dim_v);
  detail::check_saved_l2(lse2, pr, DeviceKind::cuda);
  detail::attention_for_backward(args, workspace, workspace_size, static_cast<float*>(lse2.data), stream);
}

}  // namespace sage
