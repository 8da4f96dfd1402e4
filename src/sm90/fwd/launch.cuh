// Host-side launch of the forward attention kernel for one variant; the instantiations are
// generated (instantiate.cmake), one per .cu file.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <mutex>

#include "common/cuda_check.h"
#include "sm90/fwd/kernel.cuh"
#include "sm90/fwd/tma_maps.h"

namespace sage::sm90 {

template <class K>
void launch_attention_kernel(const AttentionParams& p, const AttentionMaps& maps, cudaStream_t stream) {
  auto* kernel = attention_kernel<K>;
  const size_t smem = sizeof(typename K::Storage) + 1024;  // + slack to align the base to 1024
  static std::once_flag attribute_set;
  static cudaError_t attribute_error = cudaSuccess;
  std::call_once(attribute_set, [&] {
    attribute_error =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
  });
  if (attribute_error != cudaSuccess) throw_cuda("cudaFuncSetAttribute(attention)", attribute_error);
  kernel<<<dim3(unsigned(p.work.ctas)), K::kThreads, smem, stream>>>(maps.k, maps.v, maps.q, p);
}

// A left window bound picks the instantiation that has it (kernel_config.cuh, kLeftWindow;
// the dispatch then takes no Q stage); p.q_stage the one with the Q stage (set only where
// q_stage_capable holds).
template <int D, class T, PVPath Path, KScales KS, bool SmoothQ>
void launch_attention(const AttentionParams& p, const AttentionMaps& maps, cudaStream_t stream) {
  if (p.window_left >= 0)
    return launch_attention_kernel<KernelConfig<D, T, Path, KS, SmoothQ, false, true>>(p, maps, stream);
  if constexpr (q_stage_capable(Path, SmoothQ, D)) {
    if (p.q_stage)
      return launch_attention_kernel<KernelConfig<D, T, Path, KS, SmoothQ, true>>(p, maps, stream);
  }
  launch_attention_kernel<KernelConfig<D, T, Path, KS, SmoothQ, false>>(p, maps, stream);
}

// Packed variable-length batches (p.cu_seqlens_q/_k set): the kVarlen instantiations, with and
// without a left window bound, never the Q stage. Generated in files of their own
// (instantiate.cmake, *_varlen.cu), so that a build without them compiles none.
template <int D, class T, PVPath Path, KScales KS, bool SmoothQ>
void launch_attention_varlen(const AttentionParams& p, const AttentionMaps& maps, cudaStream_t stream) {
  if (p.window_left >= 0)
    return launch_attention_kernel<KernelConfig<D, T, Path, KS, SmoothQ, false, true, true>>(p, maps, stream);
  launch_attention_kernel<KernelConfig<D, T, Path, KS, SmoothQ, false, false, true>>(p, maps, stream);
}

}  // namespace sage::sm90
