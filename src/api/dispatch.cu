// GPU entry points: argument checks specific to the kernels, workspace layout, and the
// dispatch of a recipe to its pre-pass and attention kernel.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <sstream>
#include <string>

#include "quant/kv_prepass.cuh"
#include "sage/attention.h"
#include "sage/quant_rules.h"
#include "sage/tile.h"
#include "sm90/head_dims.h"
#include "sm90/kernel_params.h"
#include "sm90/tma_maps.h"

namespace sage {
namespace sm90 {
template <int D, class T>
void launch_attention(const AttentionParams& p, const AttentionMaps& maps, cudaStream_t stream);
}

namespace {

constexpr size_t kAlign = 256;
size_t align_up(size_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

// Which recipes have an sm_90 kernel today. Anything else is refused by name: no fallback.
void check_gpu_recipe(const Recipe& r) {
  std::string missing;
  if (r.qk_format != QKFormat::int8) missing = "qk_format int8";
  else if (!(r.qk_granularity == Granularity::per_thread || r.qk_granularity == Granularity::per_warp ||
             r.qk_granularity == Granularity::per_block))
    missing = "qk_granularity per_thread, per_warp or per_block";
  else if (r.smooth_q) missing = "smooth_q off";
  else if (r.pv_format != PVFormat::e4m3) missing = "pv_format e4m3";
  else if (r.p_scale != PScale::static_max) missing = "p_scale static";
  else if (r.v_scale != VScale::per_channel) missing = "v_scale per_channel";
  else if (r.pv_accum != PVAccum::two_level) missing = "pv_accum two_level";
  else if (r.row_sum != RowSum::float_p) missing = "row_sum float_p";
  else if (r.inputs != Inputs::floating) missing = "fp16/bf16 inputs";
  if (!missing.empty())
    throw Error("recipe", "'" + r.name + "' has no sm_90 kernel yet (the GPU path needs " + missing +
                              "); GPU recipes now: sage2_8b, sage2_8b_vsmooth and custom int8 "
                              "per_thread/per_warp/per_block QK with e4m3 PV, two_level accumulation");
}

// TMA-free global accesses of Q, K, V use 16-byte vectors (8 channels) and the output uses
// 4-byte pairs: the rows they start at must be aligned accordingly.
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

struct WorkspaceLayout {
  size_t k, vt, k_scale, k_mean, v_scale, v_mean, partials, total;
  int n_pad, chunks;
};

WorkspaceLayout workspace_layout(const Problem& pr) {
  WorkspaceLayout w{};
  w.n_pad = int(std::max<int64_t>(1, ceil_div(pr.n_kv, sm90::kBlockKV)) * sm90::kBlockKV);
  w.chunks = int(ceil_div(pr.n_kv, sm90::kStatsChunk));
  const size_t heads = size_t(pr.batch) * pr.heads_kv;
  const size_t d = size_t(pr.head_dim);
  size_t off = 0;
  auto take = [&](size_t bytes) {
    const size_t at = off;
    off = align_up(off + bytes);
    return at;
  };
  w.k = take(heads * w.n_pad * d);
  w.vt = take(heads * w.n_pad * d);
  w.k_scale = take(heads * (w.n_pad / sm90::kBlockKV) * sm90::kKScalesPerTile * sizeof(float));
  w.k_mean = take(heads * d * sizeof(float));
  w.v_scale = take(heads * d * sizeof(float));
  w.v_mean = take(heads * d * sizeof(float));
  w.partials = take(size_t(sm90::kNumStats) * heads * w.chunks * d * sizeof(float));
  w.total = off;
  return w;
}

Problem check_gpu_args(const AttentionArgs& args) {
  const Problem pr = check_args(args, DeviceKind::cuda);
  check_gpu_recipe(args.recipe);
  check_alignment("q", args.q, 8);
  check_alignment("k", args.k, 8);
  check_alignment("v", args.v, 8);
  check_alignment("out", args.out, 2);
  return pr;
}

template <int D, class T>
void run(const AttentionArgs& args, const Problem& pr, uint8_t* ws, cudaStream_t stream) {
  const WorkspaceLayout w = workspace_layout(pr);
  const Recipe& r = args.recipe;
  sm90::QuantizedKV kv;
  kv.k = reinterpret_cast<int8_t*>(ws + w.k);
  kv.vt = ws + w.vt;
  kv.k_scale = reinterpret_cast<float*>(ws + w.k_scale);
  kv.k_mean = reinterpret_cast<float*>(ws + w.k_mean);
  kv.v_scale = reinterpret_cast<float*>(ws + w.v_scale);
  kv.v_mean = reinterpret_cast<float*>(ws + w.v_mean);
  kv.partials = reinterpret_cast<float*>(ws + w.partials);

  if (pr.n_kv > 0) {
    sm90::KVQuantParams qp{};
    qp.k = args.k.data;
    qp.v = args.v.data;
    const Dims ks = strides_of(args.k, args.layout), vs = strides_of(args.v, args.layout);
    qp.k_stride_b = ks.b, qp.k_stride_h = ks.h, qp.k_stride_n = ks.n;
    qp.v_stride_b = vs.b, qp.v_stride_h = vs.h, qp.v_stride_n = vs.n;
    qp.batch = int(pr.batch), qp.heads_kv = int(pr.heads_kv), qp.n_kv = int(pr.n_kv);
    qp.n_pad = w.n_pad, qp.chunks = w.chunks;
    qp.k_granularity = r.qk_granularity;
    qp.smooth_k = r.smooth_k, qp.smooth_v = r.smooth_v;
    qp.v_max = r.v_range > 0 ? r.v_range : 448.f;
    qp.out = kv;
    quant::launch_kv_prepass<D, T>(qp, stream);
  }

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
  ap.batch = int(pr.batch), ap.heads_q = int(pr.heads_q), ap.heads_kv = int(pr.heads_kv);
  ap.n_q = int(pr.n_q), ap.n_kv = int(pr.n_kv), ap.n_pad = w.n_pad;
  ap.n_q_tiles = int(ceil_div(pr.n_q, sm90::kBlockQ));
  ap.sm_scale = pr.sm_scale;
  ap.sm_scale_log2 = rules::sm_scale_log2(pr.sm_scale);
  ap.p_max = r.p_range > 0 ? r.p_range : 448.f;
  ap.q_granularity = r.qk_granularity;
  ap.causal = args.causal, ap.smooth_k = r.smooth_k, ap.smooth_v = r.smooth_v;
  ap.kv = kv;
  const sm90::AttentionMaps maps = sm90::make_attention_maps(ap, D);
  sm90::launch_attention<D, T>(ap, maps, stream);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) sm90::throw_cuda("attention launch", err);
}

}  // namespace

size_t workspace_bytes(const AttentionArgs& args) {
  return workspace_layout(check_gpu_args(args)).total;
}

void attention(const AttentionArgs& args, void* workspace, size_t workspace_size, void* stream) {
  const Problem pr = check_gpu_args(args);
  const size_t need = workspace_layout(pr).total;
  if (workspace_size < need)
    throw Error("workspace_size", "must be at least workspace_bytes(args) = " + std::to_string(need) +
                                      " bytes (got " + std::to_string(workspace_size) + ")");
  if (workspace == nullptr || reinterpret_cast<uintptr_t>(workspace) % kAlign != 0)
    throw Error("workspace", "must be a device pointer aligned to 256 bytes");
  if (pr.batch == 0 || pr.heads_q == 0 || pr.n_q == 0) return;
  auto* ws = static_cast<uint8_t*>(workspace);
  auto* s = static_cast<cudaStream_t>(stream);
  const bool bf16 = args.q.dtype == DType::bf16;
#define SAGE_DISPATCH_DIM(D)                                                   \
  if (pr.head_dim == D) {                                                      \
    if (bf16) run<D, __nv_bfloat16>(args, pr, ws, s);                          \
    else run<D, __half>(args, pr, ws, s);                                      \
    return;                                                                    \
  }
  SAGE_FOR_EACH_HEAD_DIM(SAGE_DISPATCH_DIM)
#undef SAGE_DISPATCH_DIM
  throw Error("q", "head_dim " + std::to_string(pr.head_dim) + " has no kernel in this build (built: " +
                       SAGE_HEAD_DIMS_STRING + ")");
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

const char* gpu_head_dims() { return SAGE_HEAD_DIMS_STRING; }

}  // namespace sage
