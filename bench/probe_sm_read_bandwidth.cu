// Probe: how fast can a few SMs stream from DRAM, one CTA per SM? The question behind the
// pre-pass in the attention launch (v31 in docs/history/README.md): its CTAs must read the K/V
// pre-pass's bytes on a few SMs while the others run attention.
//
// Two ways of reading, each CTA its own contiguous 32 MiB, one CTA per SM (the shared memory
// request keeps a second one off): `ldg` has 256 threads with 16 loads of 16 bytes in flight
// each (64 KiB per CTA, like v31's statistics loop); `bulk` has one thread keep a ring of
// 32 KiB bulk copies (cp.async.bulk into shared memory, mbarrier completion) in flight, 6
// stages (192 KiB). Reports GB/s of the grid and per CTA, median of 5 runs.
//
// Build and run (sm_90): nvcc -O3 -arch=sm_90a -o probe bench/probe_sm_read_bandwidth.cu && ./probe
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

#define CHECK(x)                                                                   \
  do {                                                                             \
    cudaError_t e = (x);                                                           \
    if (e != cudaSuccess) {                                                        \
      std::printf("%s: %s\n", #x, cudaGetErrorString(e));                          \
      return 1;                                                                    \
    }                                                                              \
  } while (0)

constexpr size_t kPerCta = size_t(32) << 20;
constexpr int kChunk = 32 << 10;
constexpr int kStages = 6;
constexpr int kUnroll = 16;

__global__ void __launch_bounds__(256) ldg_read(const uint4* src, unsigned* sink) {
  const uint4* base = src + blockIdx.x * (kPerCta / 16);
  uint32_t acc = 0;
  for (size_t i = threadIdx.x; i < kPerCta / 16; i += size_t(kUnroll) * blockDim.x) {
    uint4 r[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) r[u] = base[i + u * blockDim.x];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) acc ^= r[u].x ^ r[u].w;
  }
  if (acc == 0x9e3779b9u) sink[0] = acc;  // keeps the loads
}

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__global__ void __launch_bounds__(256) bulk_read(const uint8_t* src, unsigned* sink) {
  extern __shared__ __align__(128) uint8_t ring[];
  __shared__ __align__(8) uint64_t full[kStages];
  const uint8_t* base = src + blockIdx.x * kPerCta;
  constexpr int n = int(kPerCta / kChunk);
  auto issue = [&](int i) {
    const int s = i % kStages;
    const uint32_t bar = smem_u32(&full[s]);
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(kChunk) : "memory");
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
            smem_u32(ring + s * kChunk)),
        "l"(base + size_t(i) * kChunk), "r"(kChunk), "r"(bar)
        : "memory");
  };
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s)
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_u32(&full[s])) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (threadIdx.x == 0)
    for (int i = 0; i < kStages; ++i) issue(i);
  uint32_t acc = 0;
  for (int i = 0; i < n; ++i) {
    const int s = i % kStages;
    const uint32_t phase = (i / kStages) & 1;
    const uint32_t bar = smem_u32(&full[s]);
    asm volatile(
        "{ .reg .pred p; W: mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1; @!p bra W; }" ::"r"(bar),
        "r"(phase)
        : "memory");
    acc ^= reinterpret_cast<const uint32_t*>(ring + s * kChunk)[threadIdx.x];
    __syncthreads();  // every thread has read stage s before it is refilled
    if (threadIdx.x == 0 && i + kStages < n) issue(i + kStages);
  }
  if (acc == 0x9e3779b9u) sink[0] = acc;
}

int main() {
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  uint8_t* buf = nullptr;
  unsigned* sink = nullptr;
  CHECK(cudaMalloc(&buf, kPerCta * sms));
  CHECK(cudaMalloc(&sink, 4));
  CHECK(cudaMemset(buf, 1, kPerCta * sms));
  const int ring_bytes = kStages * kChunk;
  CHECK(cudaFuncSetAttribute(bulk_read, cudaFuncAttributeMaxDynamicSharedMemorySize, ring_bytes));
  CHECK(cudaFuncSetAttribute(ldg_read, cudaFuncAttributeMaxDynamicSharedMemorySize, ring_bytes));
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  std::printf("method  ctas  GB/s  GB/s per CTA\n");
  for (const char* method : {"ldg", "bulk"})
    for (int ctas : {1, 4, 8, 16, 32, 66, sms}) {
      std::vector<float> ms;
      for (int rep = 0; rep < 6; ++rep) {
        CHECK(cudaEventRecord(a));
        if (method[0] == 'l')
          ldg_read<<<ctas, 256, ring_bytes>>>(reinterpret_cast<const uint4*>(buf), sink);
        else
          bulk_read<<<ctas, 256, ring_bytes>>>(buf, sink);
        CHECK(cudaEventRecord(b));
        CHECK(cudaEventSynchronize(b));
        float t = 0;
        CHECK(cudaEventElapsedTime(&t, a, b));
        if (rep > 0) ms.push_back(t);
      }
      std::sort(ms.begin(), ms.end());
      const double gbs = double(kPerCta) * ctas / (ms[ms.size() / 2] * 1e-3) / 1e9;
      std::printf("%-6s  %4d  %6.0f  %6.1f\n", method, ctas, gbs, gbs / ctas);
    }
  return 0;
}
