// Bit-identity probe for kernel refactors: runs every preset with a GPU kernel on a fixed set
// of shapes with seeded random inputs and prints one FNV-1a digest of the output (and LSE)
// bytes per case. Built against two trees (scripts/gpu_run.sh, stage `digest`), the two
// listings must be equal line for line. Only the public API is used, so the same file builds
// against any tree that has it.
//
//   nvcc -std=c++17 -O2 -I<tree>/include bench/output_digest.cpp <build>/src/libsage.a -o digest
//   ./digest > digests.txt
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "sage/attention.h"

namespace {

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

uint64_t fnv1a(const std::vector<uint8_t>& bytes, uint64_t h = 1469598103934665603ull) {
  for (uint8_t b : bytes) h = (h ^ b) * 1099511628211ull;
  return h;
}

uint16_t to_half_bits(float x) {
  const __half h = __float2half_rn(x);
  uint16_t bits;
  std::memcpy(&bits, &h, 2);
  return bits;
}
uint16_t to_bf16_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

struct Shape {
  int64_t batch, heads_q, heads_kv, n_q, n_kv, d;
  bool causal, lse;
  sage::Layout layout;
  sage::DType dtype;
};

struct Buffer {
  void* device = nullptr;
  size_t bytes = 0;
  explicit Buffer(const std::vector<uint8_t>& host) : bytes(host.size()) {
    check(cudaMalloc(&device, bytes ? bytes : 1), "cudaMalloc");
    if (bytes) check(cudaMemcpy(device, host.data(), bytes, cudaMemcpyHostToDevice), "upload");
  }
  explicit Buffer(size_t n) : bytes(n) {
    check(cudaMalloc(&device, n ? n : 1), "cudaMalloc");
    check(cudaMemset(device, 0xFF, n ? n : 1), "poison");
  }
  ~Buffer() { cudaFree(device); }
  std::vector<uint8_t> download() const {
    std::vector<uint8_t> host(bytes);
    if (bytes) check(cudaMemcpy(host.data(), device, bytes, cudaMemcpyDeviceToHost), "download");
    return host;
  }
};

// Random fp16/bf16 values (or int8 codes) for a [batch, heads, n, d] tensor, seeded.
std::vector<uint8_t> random_tensor(size_t count, sage::DType dtype, std::mt19937_64& rng, float spread) {
  std::normal_distribution<float> normal(0.f, spread);
  std::vector<uint8_t> out(count * sage::dtype_size(dtype));
  for (size_t i = 0; i < count; ++i) {
    const float x = normal(rng);
    if (dtype == sage::DType::i8) {
      out[i] = uint8_t(int8_t(std::max(-127.f, std::min(127.f, std::nearbyint(x * 40.f)))));
    } else {
      const uint16_t bits = dtype == sage::DType::bf16 ? to_bf16_bits(x) : to_half_bits(x);
      std::memcpy(&out[2 * i], &bits, 2);
    }
  }
  return out;
}
std::vector<uint8_t> positive_scales(size_t count, std::mt19937_64& rng) {
  std::uniform_real_distribution<float> u(0.002f, 0.02f);
  std::vector<uint8_t> out(count * 4);
  for (size_t i = 0; i < count; ++i) {
    const float x = u(rng);
    std::memcpy(&out[4 * i], &x, 4);
  }
  return out;
}

sage::TensorView view_of(void* data, sage::DType dt, const Shape& s, int64_t heads, int64_t n) {
  const sage::Device gpu = sage::Device::cuda(0);
  if (s.layout == sage::Layout::HND) return sage::contiguous_view(data, dt, {s.batch, heads, n, s.d}, gpu);
  return sage::contiguous_view(data, dt, {s.batch, n, heads, s.d}, gpu);
}

// One case: the digest of its output and LSE bytes, or the error it raised.
std::string run_case(const sage::Recipe& recipe, const Shape& s, uint64_t seed) {
  std::mt19937_64 rng(seed);
  const bool preq = recipe.inputs == sage::Inputs::prequantized_int8;
  const sage::DType in_dt = preq ? sage::DType::i8 : s.dtype;
  const size_t nq = size_t(s.batch * s.heads_q * s.n_q * s.d), nkv = size_t(s.batch * s.heads_kv * s.n_kv * s.d);
  Buffer q(random_tensor(nq, in_dt, rng, 1.f)), k(random_tensor(nkv, in_dt, rng, 1.f)),
      v(random_tensor(nkv, in_dt, rng, 1.f));
  Buffer out(nq * sage::dtype_size(s.dtype));
  Buffer lse(size_t(s.batch * s.heads_q * s.n_q) * 4);
  sage::AttentionArgs a;
  a.q = view_of(q.device, in_dt, s, s.heads_q, s.n_q);
  a.k = view_of(k.device, in_dt, s, s.heads_kv, s.n_kv);
  a.v = view_of(v.device, in_dt, s, s.heads_kv, s.n_kv);
  a.out = view_of(out.device, s.dtype, s, s.heads_q, s.n_q);
  const sage::Device gpu = sage::Device::cuda(0);
  if (s.lse) a.lse = sage::contiguous_view(lse.device, sage::DType::f32, {s.batch, s.heads_q, s.n_q}, gpu);
  a.layout = s.layout, a.causal = s.causal, a.recipe = recipe;
  Buffer qs(positive_scales(size_t(s.batch * s.heads_q * s.n_q), rng));
  Buffer ks(positive_scales(size_t(s.batch * s.heads_kv * s.n_kv), rng));
  Buffer vs(positive_scales(size_t(s.batch * s.heads_kv * s.d), rng));
  if (preq) {
    a.q_scale = sage::contiguous_view(qs.device, sage::DType::f32, {s.batch, s.heads_q, s.n_q}, gpu);
    a.k_scale = sage::contiguous_view(ks.device, sage::DType::f32, {s.batch, s.heads_kv, s.n_kv}, gpu);
    a.v_scale = recipe.v_scale == sage::VScale::per_tensor
                    ? sage::contiguous_view(vs.device, sage::DType::f32, {s.batch, s.heads_kv}, gpu)
                    : sage::contiguous_view(vs.device, sage::DType::f32, {s.batch, s.heads_kv, s.d}, gpu);
  }
  try {
    const size_t ws_bytes = sage::workspace_bytes(a);
    Buffer ws(ws_bytes);
    sage::attention(a, ws.device, ws_bytes, nullptr);
    check(cudaDeviceSynchronize(), "attention");
  } catch (const std::exception& e) {
    return std::string("error: ") + e.what();
  }
  uint64_t h = fnv1a(out.download());
  if (s.lse) h = fnv1a(lse.download(), h);
  char buf[32];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(h));
  return buf;
}

}  // namespace

int main() {
  if (!sage::gpu_available()) {
    std::fprintf(stderr, "output_digest: no sm_90 GPU\n");
    return 2;
  }
  using L = sage::Layout;
  using T = sage::DType;
  const Shape shapes[] = {
      {2, 4, 4, 1000, 1000, 128, false, true, L::HND, T::f16},
      {1, 8, 2, 1500, 2300, 128, true, true, L::NHD, T::bf16},
      {3, 6, 3, 333, 777, 64, false, false, L::HND, T::bf16},
      {1, 4, 1, 2100, 2100, 64, true, true, L::NHD, T::f16},
      {1, 32, 32, 4096, 4096, 128, true, false, L::HND, T::f16},
      {1, 32, 32, 4096, 4096, 64, false, false, L::HND, T::f16},
      {8, 16, 16, 1024, 1024, 128, false, false, L::HND, T::bf16},
      {1, 2, 2, 65, 190, 64, true, true, L::HND, T::f16},
  };
  int cases = 0;
  for (const sage::Recipe& r : sage::presets()) {
    if (!sage::gpu_supports(r)) continue;
    for (size_t i = 0; i < sizeof(shapes) / sizeof(shapes[0]); ++i) {
      const Shape& s = shapes[i];
      std::printf("%-18s shape%zu d=%lld n=%lld/%lld causal=%d lse=%d  %s\n", r.name.c_str(), i,
                  (long long)s.d, (long long)s.n_q, (long long)s.n_kv, int(s.causal), int(s.lse),
                  run_case(r, s, 1000 + 17 * i).c_str());
      ++cases;
    }
  }
  std::fprintf(stderr, "output_digest: %d cases\n", cases);
  return 0;
}
