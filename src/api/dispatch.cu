// GPU entry points: argument checks specific to the kernels, workspace layout, and the
// dispatch of a recipe to its pre-pass and attention kernel.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <sstream>
#include <stdexcept>
#include <string>

#include "quant/kv_prepass.cuh"
#include "quant/q_channel_range.cuh"
#include "sage/attention.h"
#include "sage/varlen.h"
#include "api/varlen_gpu.h"
#include "api/backward_gpu.h"
#include "numerics/quant_rules.h"
#include "numerics/tile.h"
#include "built_kernels.h"
#include "sm90/fwd/params.h"
#include "sm90/fwd/tile_scheduler.h"
#include "sm90/fwd/tma_maps.h"

namespace sage {
namespace sm90 {
template <int D, class T, PVPath Path, KScales KS, bool SmoothQ>
void launch_attention(const AttentionParams& p, const AttentionMaps& maps, cudaStream_t stream);
template <int D, class T, PVPath Path, KScales KS, bool SmoothQ>
void launch_attention_varlen(const AttentionParams& p, const AttentionMaps& maps, cudaStream_t stream);
}

namespace {

constexpr size_t kAlign = 256;
size_t align_up(size_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

// The kernel a recipe runs on: its PV operand policy, K scale layout and Q smoothing.
struct KernelVariant {
  sm90::PVPath path;
  sm90::KScales k_scales;
  bool smooth_q;
};

// Maps a recipe onto a kernel variant, or says what it lacks. Everything not matched here is
// refused by name: no fallback, no approximation.
std::string gpu_variant(const Recipe& r, KernelVariant& v) {
  using G = Granularity;
  if (r.qk_format != QKFormat::int8 && r.qk_format != QKFormat::int4)
    return "qk_format int8 or int4 (" + std::string(to_string(r.qk_format)) +
           " has no sm_90 kernel; FP4 tensor cores exist only on Blackwell)";
  const G g = r.qk_granularity;
  if (!(g == G::per_thread || g == G::per_warp || g == G::per_block || g == G::per_token))
    return "qk_granularity per_thread, per_warp, per_block or per_token";
  v.k_scales = g == G::per_token ? sm90::KScales::per_token : sm90::KScales::per_tile;
  v.smooth_q = r.smooth_q;
  const bool static_p = r.p_scale == PScale::static_max;
  const bool scaled_v = r.v_scale == VScale::per_channel || r.v_scale == VScale::per_tensor;
  if (r.pv_format == PVFormat::e4m3 && static_p && scaled_v && r.pv_accum == PVAccum::two_level)
    v.path = sm90::PVPath::e4m3_two_level;
  else if (r.pv_format == PVFormat::e4m3 && static_p && scaled_v && r.pv_accum == PVAccum::fp16x2_fp32)
    v.path = sm90::PVPath::e4m3_fp16x2;
  else if (r.pv_format == PVFormat::fp16 && r.pv_accum == PVAccum::fp16)
    v.path = sm90::PVPath::fp16;
  else if (r.pv_format == PVFormat::int8 && static_p && scaled_v && r.pv_accum == PVAccum::fp32)
    v.path = sm90::PVPath::int8;
  else if (r.pv_format == PVFormat::int8 && r.p_scale == PScale::per_token &&
           r.v_scale == VScale::per_block && r.pv_accum == PVAccum::fp32)
    v.path = sm90::PVPath::int8_dynamic;  // SageBwd's forward
  else
    return "P V as e4m3 (static P, per_channel/per_tensor V) with two_level or fp16x2_fp32 "
           "accumulation, fp16 with fp16 accumulation, or int8 (static P, per_channel/per_tensor "
           "V; or per_token P with per_block V) with fp32 accumulation";
  if (v.path == sm90::PVPath::int8_dynamic && r.row_sum == RowSum::quantized_p)
    return "row_sum float_p with per_token P (the kernel sums P~, not its codes)";
  if (v.path == sm90::PVPath::int8_dynamic && !(g == G::per_block || g == G::per_thread || g == G::per_warp))
    return "per-tile K scales with per_token P (the P peak comes from the integer row max)";
  if (v.path == sm90::PVPath::int8 && r.p_range > float(rules::kInt8Max))
    return "p_range <= 127 with int8 P (P~ * p_range must fit a code)";
  if (r.row_sum == RowSum::quantized_p && v.path != sm90::PVPath::int8)
    return "row_sum quantized_p only with pv_format int8";
  if (r.inputs == Inputs::prequantized_int8 &&
      !(g == G::per_token && v.path == sm90::PVPath::int8 && !r.smooth_k && !r.smooth_q && !r.smooth_v))
    return "prequantized inputs with per_token int8 Q/K, int8 P V and no smoothing";
  // The generated instantiations (instantiate.cmake): a combination no preset uses has no
  // kernel.
  bool built = false;
#define SAGE_MATCH_VARIANT(P, K, SQ) \
  built = built || (v.path == sm90::PVPath::P && v.k_scales == sm90::KScales::K && v.smooth_q == bool(SQ));
  SAGE_FOR_EACH_KERNEL_VARIANT(SAGE_MATCH_VARIANT)
#undef SAGE_MATCH_VARIANT
  if (!built)
    return "a combination of PV path, K scale layout and Q smoothing that has a kernel (see "
           "src/sm90/fwd/instantiate.cmake)";
  // The kernel takes the integer row max exactly for per-tile K scales without Q smoothing
  // (sm90/fwd/kernel_config.cuh, kIntegerMax); the simulator, for the recipes of this rule. They
  // must be the same set, or the GPU would not compute what the simulator does.
  const bool kernel_integer_max = v.k_scales == sm90::KScales::per_tile && !v.smooth_q;
  if (kernel_integer_max != rules::integer_row_max(r))
    throw std::logic_error("sage: internal error: the sm_90 kernel's row max path for recipe '" +
                           r.name + "' disagrees with rules::integer_row_max");
  // The same for P's scale in the exponent (kernel_config.cuh, kPScaleMode).
  const bool kernel_p_in_exponent = kernel_integer_max && v.path == sm90::PVPath::e4m3_two_level;
  if (kernel_p_in_exponent != rules::p_scale_in_exponent(r))
    throw std::logic_error("sage: internal error: the sm_90 kernel's P scale for recipe '" +
                           r.name + "' disagrees with rules::p_scale_in_exponent");
  return {};
}

KernelVariant check_gpu_recipe(const Recipe& r) {
  KernelVariant v{};
  const std::string missing = gpu_variant(r, v);
  if (!missing.empty())
    throw Error("recipe", "'" + r.name + "' has no sm_90 kernel (the GPU path needs " + missing +
                              "); every preset except sage3_fp4 runs on the GPU");
  return v;
}

// TMA-free global accesses of Q, K, V read 8 channels per vector and the output uses 2-element
// pairs: the rows they start at must be aligned accordingly.
void check_alignment(const char* name, const TensorView& t, int elems) {
  const size_t bytes = dtype_size(t.dtype) * elems;
  if (reinterpret_cast<uintptr_t>(t.data) % bytes != 0)
    throw Error(name, "the GPU kernels need the data pointer aligned to " + std::to_string(bytes) +
                          " bytes (storage offset a multiple of " + std::to_string(elems) + " elements)");
  for (int d = 0; d < 3; ++d)
    if (t.strides[d] % elems != 0)
      throw Error(name, "the GPU kernels need strides[" + std::to_string(d) + "] to be a multiple of " +
                            std::to_string(elems) + " elements (got " + std::to_string(t.strides[d]) + ")");
}

struct Dims {  // strides of a [B, H, N, D] view read through the layout
  int64_t b, h, n;
};
Dims strides_of(const TensorView& t, Layout layout) {
  if (layout == Layout::HND) return {t.strides[0], t.strides[1], t.strides[2]};
  return {t.strides[0], t.strides[2], t.strides[1]};
}

// The head dim the kernels' tiles are chosen for (tile.h, call_head_dim): the larger of Q/K's
// and V's, the other tensor's channels zero-padded in the workspace and bounded in every load
// and store.
int64_t tile_head_dim(const Problem& pr) { return call_head_dim(pr.head_dim, pr.head_dim_v); }

struct WorkspaceLayout {
  size_t k, vt, k_scale, k_mean, v_scale, v_mean, v_inv, k_amax, qk_balance, qk_balance_active,
      q_amax, v_block_scale, total;
  int n_pad;
  size_t heads;  // batch * heads_kv
};

WorkspaceLayout workspace_layout(const Problem& pr, sm90::PVPath path) {
  WorkspaceLayout w{};
  w.n_pad = int(std::max<int64_t>(1, ceil_div(pr.n_kv, sm90::kBlockKV)) * sm90::kBlockKV);
  const size_t heads = size_t(pr.batch) * pr.heads_kv;
  w.heads = heads;
  // The workspace's channels per head: the caller's head dim padded with zero channels
  // (quant/kv_layout.h).
  const size_t d = size_t(quant::kv_layout_head_dim(int(tile_head_dim(pr))));
  size_t off = 0;
  auto take = [&](size_t bytes) {
    const size_t at = off;
    off = align_up(off + bytes);
    return at;
  };
  w.k = take(heads * w.n_pad * d);
  w.vt = take(heads * w.n_pad * d * sm90::v_bytes(path));
  // One float per token covers both layouts (per tile: kKScalesPerTile <= kBlockKV slots).
  static_assert(quant::kKScalesPerTile <= quant::kKVTile);
  w.k_scale = take(heads * w.n_pad * sizeof(float));
  w.k_mean = take(heads * d * sizeof(float));
  w.v_scale = take(heads * d * sizeof(float));
  w.v_mean = take(heads * d * sizeof(float));
  w.v_inv = take(heads * d * sizeof(float));
  w.k_amax = take(heads * sizeof(float));
  w.qk_balance = take(heads * d * sizeof(float));  // qk_channel_balance only
  w.qk_balance_active = take(heads * sizeof(int));
  w.q_amax = take(heads * d * sizeof(float));
  // per_block V only: the tiles' scales, then their multipliers.
  w.v_block_scale = take(2 * heads * (w.n_pad / sm90::kBlockKV) * sizeof(float));
  w.total = off;
  return w;
}

quant::QuantizedKV quantized_kv_at(uint8_t* ws, const WorkspaceLayout& w, const Recipe& r) {
  quant::QuantizedKV kv;
  kv.k = reinterpret_cast<int8_t*>(ws + w.k);
  kv.vt = ws + w.vt;
  kv.k_scale = reinterpret_cast<float*>(ws + w.k_scale);
  kv.k_mean = reinterpret_cast<float*>(ws + w.k_mean);
  kv.v_scale = reinterpret_cast<float*>(ws + w.v_scale);
  kv.v_mean = reinterpret_cast<float*>(ws + w.v_mean);
  kv.v_inv = reinterpret_cast<float*>(ws + w.v_inv);
  kv.k_amax = reinterpret_cast<float*>(ws + w.k_amax);
  kv.qk_balance = r.qk_channel_balance ? reinterpret_cast<float*>(ws + w.qk_balance) : nullptr;
  kv.qk_balance_active = r.qk_channel_balance ? reinterpret_cast<int*>(ws + w.qk_balance_active) : nullptr;
  const bool per_block_v = r.v_scale == VScale::per_block;
  kv.v_block_scale = per_block_v ? reinterpret_cast<float*>(ws + w.v_block_scale) : nullptr;
  kv.v_block_inv = per_block_v ? kv.v_block_scale + size_t(w.n_pad / sm90::kBlockKV) * w.heads : nullptr;
  return kv;
}

void check_workspace(const void* workspace, size_t workspace_size, size_t need) {
  if (workspace_size < need)
    throw Error("workspace_size", "must be at least workspace_bytes(args) = " + std::to_string(need) +
                                      " bytes (got " + std::to_string(workspace_size) + ")");
  if (workspace == nullptr || reinterpret_cast<uintptr_t>(workspace) % kAlign != 0)
    throw Error("workspace", "must be a device pointer aligned to 256 bytes");
}

// The kernels' P factor: the simulator's static factor, or 1 for fp16 P and per-token P
// (P~ itself; per-token P scales each row and tile in the PV operand).
float p_format_max(const Recipe& r) {
  return r.pv_format == PVFormat::fp16 || r.p_scale == PScale::per_token ? 1.f : rules::p_static_max(r);
}
int qk_format_max(const Recipe& r) {
  return r.qk_format == QKFormat::int4 ? rules::kInt4Max : rules::kInt8Max;
}

// A packed variable-length batch's device offsets (attention_varlen): the dense steps below
// then run with batch = the sequences and n_q / n_kv = max_seqlen_q / max_seqlen_k, on views
// whose batch stride is 0 (varlen_gpu.h, VarlenGpuCall), and every pass adds sequence b's first
// row and takes its lengths from these. Null for a dense call.
struct VarlenOffsets {
  const int* cu_seqlens_q;
  const int* cu_seqlens_k;
};

// ---- the two steps, for one head dim and dtype ----------------------------------------------

// qk_channel_balance: the Q channel ranges of every KV head's group into q_amax (workspace).
template <int D, class T>
const float* measure_q_channel_range(const AttentionArgs& args, const Problem& pr, uint8_t* q_amax,
                                     cudaStream_t stream, const VarlenOffsets* varlen) {
  quant::QRangeParams qr{};
  qr.q = args.q.data;
  const Dims qs = strides_of(args.q, args.layout);
  qr.q_stride_b = qs.b, qr.q_stride_h = qs.h, qr.q_stride_n = qs.n;
  qr.batch = int(pr.batch), qr.heads_q = int(pr.heads_q), qr.heads_kv = int(pr.heads_kv);
  qr.n_q = int(pr.n_q);
  qr.head_dim = int(pr.head_dim);
  qr.stride = args.recipe.k_mean_stride;
  qr.q_amax = reinterpret_cast<float*>(q_amax);
  qr.cu_seqlens_q = varlen ? varlen->cu_seqlens_q : nullptr;
  quant::launch_q_channel_range<D, T>(qr, stream);
  return qr.q_amax;
}

template <int D, class T>
void run_quantize_kv(const AttentionArgs& args, const Problem& pr, const KernelVariant& v,
                     uint8_t* ws, cudaStream_t stream, const VarlenOffsets* varlen) {
  // Nothing to quantize; with no keys the attention kernel writes zeros and -inf LSE without
  // reading the workspace's values.
  if (pr.batch == 0 || pr.heads_kv == 0 || pr.n_kv == 0) return;
  const WorkspaceLayout w = workspace_layout(pr, v.path);
  const Recipe& r = args.recipe;
  quant::KVQuantParams qp{};
  qp.k = args.k.data;
  qp.v = args.v.data;
  const Dims ks = strides_of(args.k, args.layout), vs = strides_of(args.v, args.layout);
  qp.k_stride_b = ks.b, qp.k_stride_h = ks.h, qp.k_stride_n = ks.n;
  qp.v_stride_b = vs.b, qp.v_stride_h = vs.h, qp.v_stride_n = vs.n;
  qp.batch = int(pr.batch), qp.heads_kv = int(pr.heads_kv), qp.n_kv = int(pr.n_kv);
  qp.n_pad = w.n_pad;
  qp.head_dim = int(pr.head_dim);
  qp.head_dim_v = int(pr.head_dim_v);
  qp.k_granularity = r.qk_granularity;
  qp.k_max = qk_format_max(r);
  qp.smooth_k = r.smooth_k, qp.smooth_v = r.smooth_v;
  qp.k_mean_stride = r.k_mean_stride;
  qp.v_format = sm90::v_format(v.path);
  qp.v_per_tensor = r.v_scale == VScale::per_tensor;
  qp.v_per_block = r.v_scale == VScale::per_block;
  qp.v_max = rules::v_static_max(r);  // unused for fp16 V, which is not scaled
  if (r.inputs == Inputs::prequantized_int8) {
    // Scale views are [B, Hkv, n_kv] and [B, Hkv(, D)] whatever the layout.
    qp.k_scale_in = static_cast<const float*>(args.k_scale.data);
    qp.ks_stride_b = args.k_scale.strides[0], qp.ks_stride_h = args.k_scale.strides[1];
    qp.ks_stride_n = args.k_scale.strides[2];
    qp.v_scale_in = static_cast<const float*>(args.v_scale.data);
    qp.vs_stride_b = args.v_scale.strides[0], qp.vs_stride_h = args.v_scale.strides[1];
    qp.vs_stride_c = args.v_scale.ndim == 3 ? args.v_scale.strides[2] : 0;
  }
  qp.out = quantized_kv_at(ws, w, r);
  qp.cu_seqlens_k = varlen ? varlen->cu_seqlens_k : nullptr;
  if (r.qk_channel_balance)
    qp.q_amax = measure_q_channel_range<D, T>(args, pr, ws + w.q_amax, stream, varlen);
  quant::launch_kv_prepass<D, T>(qp, stream);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) throw_cuda("K/V pre-pass launch", err);
}

// The packed kernels of a variant, where the build has them (SAGE_VARLEN_KERNELS; without them
// attention_varlen refuses before anything runs).
template <int D, class T, sm90::PVPath P, sm90::KScales K, bool SQ>
void launch_varlen_variant(const sm90::AttentionParams& ap, const sm90::AttentionMaps& maps,
                           cudaStream_t stream) {
#if SAGE_VARLEN_KERNELS
  sm90::launch_attention_varlen<D, T, P, K, SQ>(ap, maps, stream);
#else
  (void)ap, (void)maps, (void)stream;
  throw std::logic_error("sage: internal error: a packed batch reached a build without its kernels");
#endif
}

template <int D, class T>
void run_attention(const AttentionArgs& args, const Problem& pr, const KernelVariant& v,
                   uint8_t* ws, cudaStream_t stream, float* lse2, const VarlenOffsets* varlen) {
  if (pr.batch == 0 || pr.heads_q == 0 || pr.n_q == 0) return;
  const WorkspaceLayout w = workspace_layout(pr, v.path);
  const Recipe& r = args.recipe;
  sm90::AttentionParams ap{};
  ap.q = args.q.data;
  const Dims qs = strides_of(args.q, args.layout), os = strides_of(args.out, args.layout);
  ap.q_stride_b = qs.b, ap.q_stride_h = qs.h, ap.q_stride_n = qs.n;
  ap.out = args.out.data;
  ap.o_stride_b = os.b, ap.o_stride_h = os.h, ap.o_stride_n = os.n;
  if (args.lse.data != nullptr) {
    ap.lse = static_cast<float*>(args.lse.data);
    ap.lse_stride_b = args.lse.strides[0], ap.lse_stride_h = args.lse.strides[1];
    ap.lse_stride_n = args.lse.strides[2];
  }
  if (r.inputs == Inputs::prequantized_int8) {
    ap.q_scale = static_cast<const float*>(args.q_scale.data);
    ap.qs_stride_b = args.q_scale.strides[0], ap.qs_stride_h = args.q_scale.strides[1];
    ap.qs_stride_n = args.q_scale.strides[2];
  }
  ap.batch = int(pr.batch), ap.heads_q = int(pr.heads_q), ap.heads_kv = int(pr.heads_kv);
  ap.n_q = int(pr.n_q), ap.n_kv = int(pr.n_kv), ap.n_pad = w.n_pad;
  ap.n_q_tiles = int(ceil_div(pr.n_q, sm90::kBlockQ<D>));
  ap.sm_scale = pr.sm_scale;
  ap.sm_scale_log2 = rules::sm_scale_log2(pr.sm_scale);
  ap.p_max = p_format_max(r);
  const rules::PScaleFold fold = rules::p_scale_fold(ap.p_max, D);  // read where in the exponent
  ap.p_fold_k = fold.k, ap.p_fold_mult_limit = fold.mult_limit;
  ap.q_granularity = r.qk_granularity;
  ap.q_max = qk_format_max(r);
  // A right bound makes the items' work grow along the diagonal, as causal does (the
  // scheduler's causal orders); causal with n_q = 1 masks nothing and keeps its order.
  ap.causal = args.causal || pr.window_right >= 0;
  ap.smooth_k = r.smooth_k, ap.smooth_v = r.smooth_v;
  ap.window_left = int(pr.window_left), ap.window_right = int(pr.window_right);
  ap.head_dim = int(pr.head_dim);
  ap.head_dim_v = int(pr.head_dim_v);
  ap.smooth_q = r.smooth_q;
  ap.quantized_row_sum = r.row_sum == RowSum::quantized_p;
  ap.lse2 = lse2;
  ap.work = sm90::work_schedule(ap, D, sm90::v_bytes(v.path));  // after every field it reads
  ap.kv = quantized_kv_at(ws, w, r);
  if (varlen) {
    // The Q stage's TMA map is over a dense [B, Hq, n_q, D] Q: the packed kernels load Q in
    // their prologue (kernel_config.cuh, kVarlen).
    ap.cu_seqlens_q = varlen->cu_seqlens_q, ap.cu_seqlens_k = varlen->cu_seqlens_k;
    ap.q_stage = false;
  } else {
    ap.q_stage = sm90::take_q_stage(ap, sm90::q_stage_capable(v.path, v.smooth_q, D), D);
  }
  const sm90::AttentionMaps maps = sm90::make_attention_maps(ap, D, sm90::v_bytes(v.path));
  bool launched = false;
#define SAGE_LAUNCH_VARIANT(P, K, SQ)                                                       \
  if constexpr (sm90::variant_has_kernel(D, sm90::PVPath::P)) {                             \
    if (!launched && v.path == sm90::PVPath::P && v.k_scales == sm90::KScales::K &&         \
        v.smooth_q == bool(SQ)) {                                                           \
      if (varlen)                                                                           \
        launch_varlen_variant<D, T, sm90::PVPath::P, sm90::KScales::K, bool(SQ)>(ap, maps, stream); \
      else                                                                                  \
        sm90::launch_attention<D, T, sm90::PVPath::P, sm90::KScales::K, bool(SQ)>(ap, maps, stream); \
      launched = true;                                                                      \
    }                                                                                       \
  }
  SAGE_FOR_EACH_KERNEL_VARIANT(SAGE_LAUNCH_VARIANT)
#undef SAGE_LAUNCH_VARIANT
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) throw_cuda("attention launch", err);
}

enum class Step { quantize_kv, attention };

// Picks the (head dim, dtype) instantiation. The kernels' T is the fp16/bf16 type of the
// inputs, or of the output when the inputs are prequantized INT8. The pre-pass runs at the
// workspace's row size (quant::kv_layout_head_dim), the attention kernel on the tile of
// kernel_head_dim (tile.h); both bound their reads of the caller's tensors by its head dim.
void run_step(Step step, const AttentionArgs& args, const Problem& pr, const KernelVariant& v,
              uint8_t* ws, cudaStream_t s, float* lse2 = nullptr,
              const VarlenOffsets* varlen = nullptr) {
  const bool preq = args.recipe.inputs == Inputs::prequantized_int8;
  // quantize_kv of prequantized inputs never reads T; any instantiation serves.
  const DType t = preq ? (step == Step::attention ? args.out.dtype : DType::f16) : args.k.dtype;
  const bool bf16 = t == DType::bf16;
  const int d = int(tile_head_dim(pr));
#define SAGE_DISPATCH_KV_DIM(D)                                                            \
  if (step == Step::quantize_kv && d % 8 == 0 && quant::kv_layout_head_dim(d) == D) {      \
    if (bf16) run_quantize_kv<D, __nv_bfloat16>(args, pr, v, ws, s, varlen);               \
    else run_quantize_kv<D, __half>(args, pr, v, ws, s, varlen);                           \
    return;                                                                                \
  }
#define SAGE_DISPATCH_DIM(D)                                                               \
  if (step == Step::attention && d % 8 == 0 && kernel_head_dim(d) == D) {                  \
    if (bf16) run_attention<D, __nv_bfloat16>(args, pr, v, ws, s, lse2, varlen);           \
    else run_attention<D, __half>(args, pr, v, ws, s, lse2, varlen);                       \
    return;                                                                                \
  }
  SAGE_FOR_EACH_KV_LAYOUT_DIM(SAGE_DISPATCH_KV_DIM)
  SAGE_FOR_EACH_HEAD_DIM(SAGE_DISPATCH_DIM)
#undef SAGE_DISPATCH_DIM
#undef SAGE_DISPATCH_KV_DIM
  throw Error(step == Step::attention ? "q" : "k",
              "head_dim " + std::to_string(d) + " has no kernel in this build (built: " +
                  SAGE_HEAD_DIMS_STRING + ")");
}

struct Checked {
  Problem problem;
  KernelVariant variant;
  size_t workspace;
};

// A PV path without a kernel at the head dim's tile (kernel_traits.h, variant_has_kernel).
void check_variant_at_head_dim(const Recipe& r, const KernelVariant& v, int64_t head_dim) {
  const int k = kernel_head_dim(int(head_dim));
  if (!sm90::variant_has_kernel(k, v.path))
    throw Error("recipe", "'" + r.name + "' (pv_format " + to_string(r.pv_format) +
                              ") has no sm_90 kernel at head_dim " + std::to_string(head_dim) +
                              " (tile " + std::to_string(k) + "): " +
                              (v.path == sm90::PVPath::int8_dynamic
                                   ? "SageBwd's kernels stop at head_dim 128"
                                   : "16-bit V does not fit shared memory there; use an 8-bit "
                                     "pv_format (e4m3 or int8)") +
                              ", or the CPU simulator");
}

// Where the kernel takes the row sum from its PV MMA (v_ones_rows: the two-level E4M3 path
// from d = 128) the recipe must ask for that sum, and only there.
void check_row_sum(const Recipe& r, const KernelVariant& v, int64_t head_dim) {
  const int d = int(head_dim);
  const bool kernel_mma_sum = sm90::v_ones_rows(kernel_head_dim(d), v.path) > 0;
  if (kernel_mma_sum != rules::row_sum_in_pv_mma(r, d)) {
    if (!kernel_mma_sum)
      throw std::logic_error("sage: internal error: rules::row_sum_in_pv_mma holds for recipe '" +
                             r.name + "' where the sm_90 kernel sums in the softmax");
    throw Error("recipe.row_sum", "'" + r.name + "' (row_sum " +
                                      to_string(r.row_sum) + ") at head_dim " +
                                      std::to_string(d) +
                                      ": the sm_90 kernel of this PV path takes the row sum from "
                                      "its PV MMA there; use row_sum pv_mma (the SageAttention2 "
                                      "presets' choice), or the CPU simulator for float_p");
  }
}

// Prequantized INT8 inputs with a V head dim of their own have no GPU test yet (the simulator
// runs them), so the GPU path refuses them rather than run them unchecked.
void refuse_prequantized_v_head_dim(const Recipe& r, const Problem& pr) {
  if (r.inputs == Inputs::prequantized_int8 && pr.head_dim_v != pr.head_dim)
    throw Error("v", "head_dim must equal q's head_dim " + std::to_string(pr.head_dim) + " for prequantized INT8 "
                     "inputs on the GPU (got " + std::to_string(pr.head_dim_v) + "); the CPU simulator runs it");
}

Checked check_gpu_call(const AttentionArgs& args) {
  const Problem pr = check_args(args, DeviceKind::cuda);
  refuse_prequantized_v_head_dim(args.recipe, pr);
  const KernelVariant v = check_gpu_recipe(args.recipe);
  check_variant_at_head_dim(args.recipe, v, tile_head_dim(pr));
  check_row_sum(args.recipe, v, tile_head_dim(pr));
  check_alignment("q", args.q, 8);
  check_alignment("k", args.k, 8);
  check_alignment("v", args.v, 8);
  check_alignment("out", args.out, 2);
  return {pr, v, workspace_layout(pr, v.path).total};
}

// The two-step path quantizes K/V once for any Q; a balanced K depends on Q's channel ranges.
void refuse_balance_in_two_steps(const Recipe& r, const char* entry) {
  if (r.qk_channel_balance)
    throw Error("recipe.qk_channel_balance",
                std::string(entry) + " cannot take it: the balanced K codes depend on Q's channel "
                "ranges, so K/V quantized ahead of Q would not fit another Q; use attention()");
}

Checked check_gpu_kv(const AttentionArgs& args) {
  const Problem pr = check_kv_args(args, DeviceKind::cuda);
  refuse_balance_in_two_steps(args.recipe, "quantize_kv");
  refuse_prequantized_v_head_dim(args.recipe, pr);
  const KernelVariant v = check_gpu_recipe(args.recipe);
  check_variant_at_head_dim(args.recipe, v, tile_head_dim(pr));
  check_alignment("k", args.k, 8);
  check_alignment("v", args.v, 8);
  return {pr, v, workspace_layout(pr, v.path).total};
}

}  // namespace

size_t workspace_bytes(const AttentionArgs& args) { return check_gpu_call(args).workspace; }

size_t kv_workspace_bytes(int64_t batch, int64_t heads_kv, int64_t n_kv, int64_t head_dim,
                          const Recipe& recipe, int64_t head_dim_v) {
  if (head_dim_v == -1) head_dim_v = head_dim;
  const struct {
    const char* name;
    int64_t value;
  } dims[] = {{"batch", batch}, {"heads_kv", heads_kv}, {"n_kv", n_kv}, {"head_dim", head_dim},
              {"head_dim_v", head_dim_v}};
  for (const auto& d : dims)
    if (d.value < 0) throw Error(d.name, "must be >= 0 (got " + std::to_string(d.value) + ")");
  validate_recipe(recipe);
  refuse_balance_in_two_steps(recipe, "kv_workspace_bytes");
  const KernelVariant v = check_gpu_recipe(recipe);
  Problem pr;
  pr.batch = batch, pr.heads_kv = heads_kv, pr.heads_q = heads_kv, pr.n_kv = n_kv;
  pr.head_dim = head_dim;
  pr.head_dim_v = head_dim_v;
  return workspace_layout(pr, v.path).total;
}

void quantize_kv(const AttentionArgs& args, void* workspace, size_t workspace_size, void* stream) {
  const Checked c = check_gpu_kv(args);
  check_workspace(workspace, workspace_size, c.workspace);
  run_step(Step::quantize_kv, args, c.problem, c.variant, static_cast<uint8_t*>(workspace),
           static_cast<cudaStream_t>(stream));
}

void attention_from_quantized_kv(const AttentionArgs& args, const void* workspace,
                                 size_t workspace_size, void* stream) {
  refuse_balance_in_two_steps(args.recipe, "attention_from_quantized_kv");
  const Checked c = check_gpu_call(args);
  check_workspace(workspace, workspace_size, c.workspace);
  // The kernel only reads the workspace; the parameter block is shared with the pre-pass.
  run_step(Step::attention, args, c.problem, c.variant,
           static_cast<uint8_t*>(const_cast<void*>(workspace)), static_cast<cudaStream_t>(stream));
}

void attention(const AttentionArgs& args, void* workspace, size_t workspace_size, void* stream) {
  const Checked c = check_gpu_call(args);
  check_workspace(workspace, workspace_size, c.workspace);
  if (c.problem.batch == 0 || c.problem.heads_q == 0 || c.problem.n_q == 0) return;
  auto* ws = static_cast<uint8_t*>(workspace);
  auto* s = static_cast<cudaStream_t>(stream);
  run_step(Step::quantize_kv, args, c.problem, c.variant, ws, s);
  run_step(Step::attention, args, c.problem, c.variant, ws, s);
}

namespace detail {
// The forward of a training call (api/backward_gpu.h): attention() that also writes the rows'
// base-2 log-sums into lse2, returning where its quantized K/V lie in the workspace.
quant::QuantizedKV attention_for_backward(const AttentionArgs& args, void* workspace,
                                          size_t workspace_size, float* lse2, void* stream) {
  const Checked c = check_gpu_call(args);
  check_workspace(workspace, workspace_size, c.workspace);
  auto* ws = static_cast<uint8_t*>(workspace);
  auto* s = static_cast<cudaStream_t>(stream);
  const quant::QuantizedKV kv = quantized_kv_at(ws, workspace_layout(c.problem, c.variant.path), args.recipe);
  if (c.problem.batch == 0 || c.problem.heads_q == 0 || c.problem.n_q == 0) return kv;
  run_step(Step::quantize_kv, args, c.problem, c.variant, ws, s);
  run_step(Step::attention, args, c.problem, c.variant, ws, s, lse2);
  return kv;
}

quant::QuantizedKV quantize_kv_for_backward(const AttentionArgs& args, void* workspace,
                                            size_t workspace_size, void* stream) {
  const Checked c = check_gpu_call(args);
  check_workspace(workspace, workspace_size, c.workspace);
  auto* ws = static_cast<uint8_t*>(workspace);
  const quant::QuantizedKV kv = quantized_kv_at(ws, workspace_layout(c.problem, c.variant.path), args.recipe);
  if (c.problem.batch == 0 || c.problem.heads_q == 0 || c.problem.n_q == 0) return kv;
  run_step(Step::quantize_kv, args, c.problem, c.variant, ws, static_cast<cudaStream_t>(stream));
  return kv;
}
}  // namespace detail

// ---- packed variable-length batches ----------------------------------------------------------

namespace {

struct CheckedVarlen {
  VarlenGpuCall call;
  KernelVariant variant;
  size_t workspace;
};

// The dense GPU checks of the call's per-sequence views (recipe, head dim, alignment), then
// what packing adds. Nothing here reads the offsets' contents (CUDA graphs, torch.compile).
CheckedVarlen check_gpu_varlen(const VarlenArgs& args) {
  if (!SAGE_VARLEN_KERNELS)
    throw Error("cu_seqlens_q", "this build has no packed variable-length kernels (configured with "
                                "SAGE_VARLEN_KERNELS=OFF); the CPU simulator runs them "
                                "(reference::simulate_varlen)");
  VarlenGpuCall call = check_varlen_args_gpu(args);
  const Recipe& r = args.recipe;
  const KernelVariant v = check_gpu_recipe(r);
  check_variant_at_head_dim(r, v, tile_head_dim(call.problem));
  check_row_sum(r, v, tile_head_dim(call.problem));
  // On the 4-d per-sequence views, whose last stride is head_dim's 1 (check_alignment reads
  // the first three).
  check_alignment("q", call.dense.q, 8);
  check_alignment("k", call.dense.k, 8);
  check_alignment("v", call.dense.v, 8);
  check_alignment("out", call.dense.out, 2);
  // The pre-pass's grids take a sequence per blockIdx.z.
  if (call.problem.batch > 65535)
    throw Error("cu_seqlens_q", "at most 65535 sequences per call on the GPU (got " +
                                    std::to_string(call.problem.batch) + ")");
  const WorkspaceLayout w = workspace_layout(call.problem, v.path);
  // The kernels address the workspace's K rows and the TMA maps' rows in 32 bits.
  if (uint64_t(w.heads) * uint64_t(w.n_pad) >= (uint64_t(1) << 31))
    throw Error("max_seqlen_k", "batch x heads_kv x max_seqlen_k (padded to 128) must stay below "
                                "2^31 rows of the per-sequence workspace (got " +
                                    std::to_string(uint64_t(w.heads) * uint64_t(w.n_pad)) + ")");
  return {call, v, w.total};
}

}  // namespace

size_t varlen_workspace_bytes(const VarlenArgs& args) { return check_gpu_varlen(args).workspace; }

size_t varlen_workspace_bytes(int64_t batch, int64_t heads_kv, int64_t max_seqlen_k,
                              int64_t total_k, int64_t head_dim, const Recipe& recipe,
                              int64_t head_dim_v) {
  if (head_dim_v == -1) head_dim_v = head_dim;
  const struct {
    const char* name;
    int64_t value;
  } dims[] = {{"batch", batch}, {"heads_kv", heads_kv}, {"max_seqlen_k", max_seqlen_k},
              {"total_k", total_k}, {"head_dim", head_dim}, {"head_dim_v", head_dim_v}};
  for (const auto& d : dims)
    if (d.value < 0) throw Error(d.name, "must be >= 0 (got " + std::to_string(d.value) + ")");
  validate_recipe(recipe);
  const KernelVariant v = check_gpu_recipe(recipe);
  Problem pr;
  pr.batch = batch, pr.heads_kv = heads_kv, pr.heads_q = heads_kv;
  pr.n_kv = std::min(max_seqlen_k, total_k);  // as check_varlen_args_gpu
  pr.head_dim = head_dim;
  pr.head_dim_v = head_dim_v;
  return workspace_layout(pr, v.path).total;
}

void attention_varlen(const VarlenArgs& args, void* workspace, size_t workspace_size, void* stream) {
  const CheckedVarlen c = check_gpu_varlen(args);
  check_workspace(workspace, workspace_size, c.workspace);
  const Problem& pr = c.call.problem;
  if (pr.batch == 0 || pr.heads_q == 0 || pr.n_q == 0) return;
  auto* ws = static_cast<uint8_t*>(workspace);
  auto* s = static_cast<cudaStream_t>(stream);
  const VarlenOffsets offsets{static_cast<const int*>(args.cu_seqlens_q.data),
                              static_cast<const int*>(args.cu_seqlens_k.data)};
  run_step(Step::quantize_kv, c.call.dense, pr, c.variant, ws, s, nullptr, &offsets);
  run_step(Step::attention, c.call.dense, pr, c.variant, ws, s, nullptr, &offsets);
}

bool gpu_supports(const Recipe& recipe) {
  KernelVariant v{};
  try {
    validate_recipe(recipe);
  } catch (const Error&) {
    return false;
  }
  return gpu_variant(recipe, v).empty();
}

bool gpu_available() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    cudaGetLastError();  // clear the sticky "no device" error
    return false;
  }
  int dev = 0, major = 0, minor = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
  cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev);
  return major == 9 && minor == 0;
}

const char* gpu_kernel_head_dims() { return SAGE_HEAD_DIMS_STRING; }

}  // namespace sage
