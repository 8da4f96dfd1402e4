// Host-side launch of the sm90 attention kernel for one (head dim, dtype, PV path, K scale
// layout, Q smoothing); the instantiations are generated (instantiate.cmake), one per .cu file.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <mutex>

#include "sm90/attention_kernel.cuh"
#include "sm90/tma_maps.h"
#include "sm90/work_order.h"

namespace sage::sm90 {

#if SAGE_SM90_TRACE
// Measurement builds (trace.cuh): after every launch, the timeline of its recorded CTAs into
// the file SAGE_TRACE_OUT names (the last launch's stays), then cleared for the next launch.
// Layout: six int32 (magic 0x53414745, D, the grid's CTAs, recorded CTAs, roles, events per
// role), then the events.
inline void write_trace(int d, unsigned grid_ctas, cudaStream_t stream) {
  const char* path = std::getenv("SAGE_TRACE_OUT");
  if (!path) return;
  static unsigned long long host[trace::kCtas][trace::kRoles][trace::kEvents];
  void* device = nullptr;
  cudaError_t e = cudaStreamSynchronize(stream);
  if (e == cudaSuccess) e = cudaMemcpyFromSymbol(host, trace::g_events, sizeof(host));
  if (e == cudaSuccess) e = cudaGetSymbolAddress(&device, trace::g_events);
  if (e == cudaSuccess) e = cudaMemset(device, 0, sizeof(host));
  if (e != cudaSuccess) throw_cuda("SAGE_TRACE_OUT: reading the trace", e);
  FILE* f = std::fopen(path, "wb");
  if (!f) {
    std::fprintf(stderr, "SAGE_TRACE_OUT: cannot write %s\n", path);
    return;
  }
  const int header[6] = {0x53414745, d, int(grid_ctas), trace::kCtas, trace::kRoles, trace::kEvents};
  std::fwrite(header, sizeof(header), 1, f);
  std::fwrite(host, sizeof(host), 1, f);
  std::fclose(f);
}
#endif

template <int D, class T, PVPath Path, KScales KS, bool SmoothQ, bool QStage>
void launch_attention_kernel(const AttentionParams& p, const AttentionMaps& maps, cudaStream_t stream) {
  auto* kernel = attention_kernel<D, T, Path, KS, SmoothQ, QStage>;
  // + slack to align the base to 1024
  const size_t smem = sizeof(SharedStorage<D, v_bytes(Path), QStage, v_ones_rows(D, Path)>) + 1024;
  static std::once_flag attribute_set;
  static cudaError_t attribute_error = cudaSuccess;
  std::call_once(attribute_set, [&] {
    attribute_error =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
  });
  if (attribute_error != cudaSuccess) throw_cuda("cudaFuncSetAttribute(attention)", attribute_error);
  const dim3 grid(unsigned(p.work.ctas));
  kernel<<<grid, CtaShape<D>::kThreads, smem, stream>>>(maps.k, maps.v, maps.q, p);
#if SAGE_SM90_TRACE
  write_trace(D, grid.x, stream);
#endif
}

// p.q_stage picks the instantiation with the Q stage (the dispatch sets it only where
// q_stage_capable holds).
template <int D, class T, PVPath Path, KScales KS, bool SmoothQ>
void launch_attention(const AttentionParams& p, const AttentionMaps& maps, cudaStream_t stream) {
  if constexpr (q_stage_capable(Path, SmoothQ)) {
    if (p.q_stage) return launch_attention_kernel<D, T, Path, KS, SmoothQ, true>(p, maps, stream);
  }
  launch_attention_kernel<D, T, Path, KS, SmoothQ, false>(p, maps, stream);
}

}  // namespace sage::sm90
