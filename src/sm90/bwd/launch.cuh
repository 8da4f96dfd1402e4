// Host-side launch of the backward for one head dim, dtype and dS granularity: pre-pass,
// kernel, finalize. The instantiations are generated (bwd/instantiate.cmake), one per .cu file. The caller has
// zeroed the fp32 accumulators (api/backward.cu).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <mutex>

#include "common/cuda_check.h"
#include "sm90/bwd/finalize.cuh"
#include "sm90/bwd/kernel.cuh"
#include "sm90/bwd/prep.cuh"
#include "sm90/bwd/tma_maps.h"

namespace sage::sm90::bwd {

inline unsigned finalize_blocks(int64_t total) {
  return unsigned(std::max<int64_t>(1, std::min<int64_t>((total + 255) / 256, 132 * 16)));
}

template <int D, class T, DsGranularity G>
void launch_backward(const BackwardParams& p, cudaStream_t stream) {
  static_assert(backward_has_kernel(D), "the backward kernel exists at d = 64 and 128");
  if (p.batch == 0 || p.heads_q == 0) return;
  cudaError_t err = cudaSuccess;
  if (p.n_q > 0) {
    backward_prep_kernel<D, T><<<dim3(p.n_q_pad / kBlockQ, p.heads_q, p.batch), kPrepThreads, 0, stream>>>(p);
    err = cudaGetLastError();
    if (err != cudaSuccess) throw_cuda("backward pre-pass launch", err);
  }
  if (p.n_q > 0 && p.n_kv > 0) {
    const BackwardMaps maps = make_backward_maps(p, D);
    auto* kernel = backward_kernel<D, T, G>;
    constexpr int smem = smem_layout(D).total + 1024;  // + the alignment slack
    static std::once_flag attribute_set;
    static cudaError_t attribute_error = cudaSuccess;
    std::call_once(attribute_set, [&] {
      attribute_error = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    });
    if (attribute_error != cudaSuccess) throw_cuda("cudaFuncSetAttribute(backward)", attribute_error);
    kernel<<<dim3(p.n_pad / kBlockKV, p.heads_q, p.batch), kThreads, smem, stream>>>(maps, p);
    err = cudaGetLastError();
    if (err != cudaSuccess) throw_cuda("backward launch", err);
  }
  const FinalizeView views[3] = {
      {p.dq_acc, p.dq, p.dq_sb, p.dq_sh, p.dq_sn, p.heads_q, p.n_q, p.sm_scale, true, p.n_q_pad},
      {p.dk_acc, p.dk, p.dk_sb, p.dk_sh, p.dk_sn, p.heads_kv, p.n_kv, 1.f, false, p.n_kv},
      {p.dv_acc, p.dv, p.dv_sb, p.dv_sh, p.dv_sn, p.heads_kv, p.n_kv, 1.f, false, p.n_kv}};
  for (const FinalizeView& v : views) {
    const int64_t total = int64_t(p.batch) * v.heads * v.n * D;
    if (total == 0) continue;
    backward_finalize_kernel<D, T><<<finalize_blocks(total), 256, 0, stream>>>(v, total);
    err = cudaGetLastError();
    if (err != cudaSuccess) throw_cuda("backward finalize launch", err);
  }
}

}  // namespace sage::sm90::bwd
