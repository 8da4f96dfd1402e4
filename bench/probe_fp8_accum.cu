// Probe: how the sm_90 FP8 wgmma accumulates, against the simulator's model of it.
//
// The simulator (src/reference/accumulate.cpp) models the E4M3 MMA as: per k32 step the exact
// sum of the products, added to the accumulator, truncated to FP22 (13 mantissa bits). This
// program puts chosen rows of P (E4M3 codes) against a V of ones (m64n8k32, accumulator
// preloaded with C) and prints what the tensor core returns beside that model and beside
// models that align every product (and C) to the largest exponent of a k-chunk and truncate
// it to F fraction bits before summing. Each row of the 64 per CTA is one experiment.
//
//   nvcc -std=c++17 -arch=sm_90a -I include -I src bench/probe_fp8_accum.cu -o probe && ./probe
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "numerics/formats.h"
#include "common/ptx.cuh"

using namespace sage;

__global__ void probe_kernel(const uint8_t* a_rows, const float* c, float* out, int n) {
  __shared__ alignas(1024) uint8_t b[1024];
  for (int i = threadIdx.x; i < 1024; i += blockDim.x) b[i] = 0x38;  // E4M3 1.0: V of ones
  sm90::fence_proxy_async();
  __syncthreads();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int r0 = blockIdx.x * 64 + 16 * warp + g, r1 = r0 + 8;
  auto word = [&](int row, int k0) -> uint32_t {
    if (row >= n) return 0u;
    uint32_t w;
    memcpy(&w, a_rows + row * 32 + k0, 4);
    return w;
  };
  // The A fragment of an 8-bit k32 wgmma: a[0] row g, a[1] row g + 8 (k = 4t .. 4t + 3), a[2]
  // and a[3] the same rows at k = 16 + 4t .. (the layout of mma.m16n8k32).
  const uint32_t a0 = word(r0, 4 * t), a1 = word(r1, 4 * t), a2 = word(r0, 16 + 4 * t),
                 a3 = word(r1, 16 + 4 * t);
  float d0 = r0 < n ? c[r0] : 0.f, d1 = d0, d2 = r1 < n ? c[r1] : 0.f, d3 = d2;
  const uint64_t desc = sm90::smem_desc<128>(sm90::smem_desc_lo(b));
  sm90::wgmma_fence();
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "%8, p, 1, 1;\n}\n"
      : "+f"(d0), "+f"(d1), "+f"(d2), "+f"(d3)
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc));
  sm90::wgmma_commit();
  sm90::wgmma_wait<0>();
  if (t == 0) {
    if (r0 < n) out[r0] = d0;
    if (r1 < n) out[r1] = d2;
  }
}

struct Row {
  std::string what;
  float c = 0.f;
  uint8_t p[32] = {};
};

static float trunc_bits(double x, int mant) {  // toward zero, `mant` fraction bits
  if (x == 0) return 0.f;
  int e;
  std::frexp(x, &e);  // x = m 2^e, m in [0.5, 1)
  const double ulp = std::ldexp(1.0, e - 1 - mant);
  return float(std::trunc(x / ulp) * ulp);
}
// The simulator's model: exact step sum, then FP22.
static float model_step(const Row& r) {
  double s = r.c;
  for (uint8_t q : r.p) s += fmt::e4m3_decode(q);
  return trunc_bits(s, 13);
}
// Products and C aligned to the largest exponent within each chunk of `chunk` k values (the
// accumulator carried from chunk to chunk), each truncated to F fraction bits below it.
static bool g_floor = false;  // per-term rounding toward -inf instead of toward zero
static float model_align(const Row& r, int chunk, int frac) {
  double acc = r.c;
  for (int k0 = 0; k0 < 32; k0 += chunk) {
    int emax = -1000;
    auto upd = [&](double v) {
      if (v != 0) {
        int e;
        std::frexp(v, &e);
        emax = std::max(emax, e);
      }
    };
    upd(acc);
    for (int k = k0; k < k0 + chunk; ++k) upd(fmt::e4m3_decode(r.p[k]));
    if (emax == -1000) continue;
    const double grid = std::ldexp(1.0, emax - 1 - frac);
    auto cut = [&](double v) { return (g_floor ? std::floor(v / grid) : std::trunc(v / grid)) * grid; };
    double s = cut(acc);
    for (int k = k0; k < k0 + chunk; ++k) s += cut(fmt::e4m3_decode(r.p[k]));
    acc = trunc_bits(s, 13);
  }
  return float(acc);
}

int main() {
  std::vector<Row> rows;
  auto code = [](float v) { return fmt::e4m3_encode(v); };
  // 1. one large product among small ones: are the small ones' low bits kept?
  for (float big : {448.f, 256.f, 16.f})
    for (float x : {0.001953125f, 0.0078125f, 0.03125f, 0.125f, 0.375f, 1.f})
      for (int pos : {0, 31}) {
        Row r;
        r.what = "big " + std::to_string(big) + " @" + std::to_string(pos) + " + 31 x " + std::to_string(x);
        for (int k = 0; k < 32; ++k) r.p[k] = code(k == pos ? big : x);
        rows.push_back(r);
      }
  // 2. the large product and the small ones in different parts of the step
  for (int lo : {1, 4, 8, 16, 24}) {
    Row r;
    r.what = "448 @0 + x=0.375 at k >= " + std::to_string(lo);
    for (int k = 0; k < 32; ++k) r.p[k] = code(k == 0 ? 448.f : k >= lo ? 0.375f : 0.f);
    rows.push_back(r);
  }
  for (int hi : {2, 4, 8, 16}) {
    Row r;
    r.what = "448 @0 + x=0.375 at 1 <= k < " + std::to_string(hi);
    for (int k = 0; k < 32; ++k) r.p[k] = code(k == 0 ? 448.f : k < hi ? 0.375f : 0.f);
    rows.push_back(r);
  }
  // 3. a large accumulator and small products
  for (float c : {256.f, 4096.f, 65536.f, 1048576.f})
    for (float x : {0.375f, 1.f, 3.f}) {
      Row r;
      r.what = "C " + std::to_string(c) + " + 32 x " + std::to_string(x);
      r.c = c;
      for (int k = 0; k < 32; ++k) r.p[k] = code(x);
      rows.push_back(r);
    }
  // 4. signs: negative small products, a negative large one, a negative accumulator
  for (float x : {-0.001953125f, -0.0078125f, -0.375f}) {
    Row r;
    r.what = "448 @0 + 31 x " + std::to_string(x);
    for (int k = 0; k < 32; ++k) r.p[k] = code(k == 0 ? 448.f : x);
    rows.push_back(r);
    r.what = "-448 @0 + 31 x " + std::to_string(-x);
    for (int k = 0; k < 32; ++k) r.p[k] = code(k == 0 ? -448.f : -x);
    rows.push_back(r);
    r.what = "C -4096 + 32 x " + std::to_string(-x);
    r.c = -4096.f;
    for (int k = 0; k < 32; ++k) r.p[k] = code(-x);
    rows.push_back(r);
  }
  for (int i = 0; i < 32; ++i) {  // mixed signs, random magnitudes
    Row r;
    r.what = "mixed " + std::to_string(i);
    std::mt19937 g2(100 + i);
    std::uniform_real_distribution<float> v(-1.f, 1.f);
    for (int k = 0; k < 32; ++k) r.p[k] = code(448.f * v(g2) * std::exp2(-12.f * std::fabs(v(g2))));
    r.c = i % 3 ? 0.f : 1000.f * v(g2);
    rows.push_back(r);
  }
  // 5. rows like a softmax's P~ * 256 (E4M3), random
  std::mt19937 gen(1);
  std::uniform_real_distribution<float> u(0.f, 1.f);
  for (int i = 0; i < 64; ++i) {
    Row r;
    r.what = "random P " + std::to_string(i);
    const float sharp = 2.f + 10.f * u(gen);
    for (int k = 0; k < 32; ++k) r.p[k] = code(256.f * std::exp2(-sharp * u(gen)));
    if (i % 2) r.c = 256.f * float(1 + i);
    rows.push_back(r);
  }
  const int n = int(rows.size());
  std::vector<uint8_t> a(size_t(n) * 32);
  std::vector<float> c(n), out(n, -1.f);
  for (int i = 0; i < n; ++i) {
    std::memcpy(&a[size_t(i) * 32], rows[i].p, 32);
    c[i] = rows[i].c;
  }
  uint8_t* da;
  float *dc, *dout;
  cudaMalloc(&da, a.size());
  cudaMalloc(&dc, n * 4);
  cudaMalloc(&dout, n * 4);
  cudaMemcpy(da, a.data(), a.size(), cudaMemcpyHostToDevice);
  cudaMemcpy(dc, c.data(), n * 4, cudaMemcpyHostToDevice);
  probe_kernel<<<(n + 63) / 64, 128>>>(da, dc, dout, n);
  const cudaError_t e = cudaMemcpy(out.data(), dout, n * 4, cudaMemcpyDeviceToHost);
  if (e != cudaSuccess) {
    std::printf("CUDA error: %s\n", cudaGetErrorString(e));
    return 1;
  }
  // Which models reproduce every row?
  const int chunks[] = {4, 8, 16, 32};
  std::printf("rows: %d\n", n);
  for (int chunk : chunks)
    for (int f = 10; f <= 30; ++f) {
      int ok = 0;
      for (int i = 0; i < n; ++i) ok += model_align(rows[i], chunk, f) == out[i];
      if (ok >= n * 9 / 10) std::printf("align chunk %2d frac %2d: %d / %d rows match\n", chunk, f, ok, n);
    }
  for (bool fl : {false, true}) {
    g_floor = fl;
    int ok = 0;
    for (int i = 0; i < n; ++i) ok += model_align(rows[i], 32, 13) == out[i];
    std::printf("align chunk 32 frac 13, terms rounded %s: %d / %d rows match\n",
                fl ? "toward -inf" : "toward zero", ok, n);
  }
  g_floor = false;
  int step_ok = 0;
  for (int i = 0; i < n; ++i) step_ok += model_step(rows[i]) == out[i];
  std::printf("simulator's step model: %d / %d rows match\n", step_ok, n);
  std::printf("%-44s %14s %14s %14s %14s %14s\n", "row", "gpu", "exact", "step model", "align32 f13",
              "align32 f23");
  // Only the rows that the aligned model (chunk 32, 13 bits, toward zero) does not reproduce.
  for (int i = 0; i < n; ++i) {
    if (model_align(rows[i], 32, 13) == out[i]) continue;
    double exact = rows[i].c;
    for (uint8_t q : rows[i].p) exact += fmt::e4m3_decode(q);
    std::printf("%-44s %14.6f %14.6f %14.6f %14.6f %14.6f\n", rows[i].what.c_str(), out[i], exact,
                model_step(rows[i]), model_align(rows[i], 32, 13), model_align(rows[i], 32, 23));
  }
  return 0;
}
