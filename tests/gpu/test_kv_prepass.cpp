// The K/V pre-pass on its own: its INT8 K codes and scales, and its transposed, permuted
// E4M3 V, against a CPU recomputation from the same formulas (quant_rules.h, formats.h).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <vector>

#include "gpu_harness.h"
#include "reference/synthetic.h"
#include "sage/formats.h"
#include "sage/quant_rules.h"

#ifdef SAGE_WITH_CUDA
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "quant/kv_prepass.cuh"
#endif

namespace sage::testing {
namespace {

#ifdef SAGE_WITH_CUDA
constexpr int D = 128;

// The pre-pass's outputs for `heads` heads of n tokens each (head i: synthetic seed 3 + i),
// copied back to the host.
struct PrepassRun {
  std::vector<int8_t> k_codes;
  std::vector<uint8_t> vt;
  std::vector<float> k_scale, k_mean, v_scale, v_inv, k_amax;
};
struct PrepassInputs {
  int heads, n, n_pad;
  std::vector<uint16_t> k, v;  // [heads, n, D] fp16 bits
};

PrepassInputs make_inputs(int heads, int n) {
  PrepassInputs in{heads, n, (n + 127) / 128 * 128, {}, {}};
  for (int i = 0; i < heads; ++i) {
    reference::SyntheticShape shape;
    shape.n_q = shape.n_kv = n, shape.head_dim = D;
    const reference::SyntheticInputs one = reference::make_synthetic("k_bias", shape, 3 + i);
    in.k.insert(in.k.end(), one.k.begin(), one.k.end());
    in.v.insert(in.v.end(), one.v.begin(), one.v.end());
  }
  return in;
}

PrepassRun run_prepass(const PrepassInputs& in) {
  const int heads = in.heads, n = in.n, n_pad = in.n_pad, tiles = n_pad / sm90::kBlockKV;
  std::vector<void*> allocations;
  // Every buffer starts as garbage bytes: the API does not promise a zeroed workspace.
  auto dev = [&](size_t bytes) {
    void* p = nullptr;
    EXPECT_EQ(cudaMalloc(&p, bytes), cudaSuccess);
    EXPECT_EQ(cudaMemset(p, 0xA5, bytes), cudaSuccess);
    allocations.push_back(p);
    return p;
  };
  const size_t in_bytes = size_t(heads) * n * D * 2;
  void* dk = dev(in_bytes);
  void* dv = dev(in_bytes);
  cudaMemcpy(dk, in.k.data(), in_bytes, cudaMemcpyHostToDevice);
  cudaMemcpy(dv, in.v.data(), in_bytes, cudaMemcpyHostToDevice);
  sm90::KVQuantParams p{};
  p.k = dk, p.v = dv;
  p.k_stride_b = p.v_stride_b = int64_t(heads) * n * D;
  p.k_stride_h = p.v_stride_h = int64_t(n) * D;
  p.k_stride_n = p.v_stride_n = D;
  p.batch = 1, p.heads_kv = heads, p.n_kv = n, p.n_pad = n_pad;
  p.k_granularity = Granularity::per_thread;
  p.k_max = 127, p.pv_path = sm90::PVPath::e4m3_two_level;
  p.smooth_k = true, p.smooth_v = false, p.v_max = 448.f;
  p.out.k = static_cast<int8_t*>(dev(size_t(heads) * n_pad * D));
  p.out.vt = static_cast<uint8_t*>(dev(size_t(heads) * n_pad * D));
  p.out.k_scale = static_cast<float*>(dev(size_t(heads) * tiles * 4 * 4));
  p.out.k_mean = static_cast<float*>(dev(size_t(heads) * D * 4));
  p.out.v_scale = static_cast<float*>(dev(size_t(heads) * D * 4));
  p.out.v_mean = static_cast<float*>(dev(size_t(heads) * D * 4));
  p.out.v_inv = static_cast<float*>(dev(size_t(heads) * D * 4));
  p.out.k_amax = static_cast<float*>(dev(size_t(heads) * 4));
  p.out.stat_partials = static_cast<float*>(dev(size_t(heads) * quant::kPrepassPartialFloats * D * 4));
  p.out.head_ready = static_cast<uint32_t*>(dev(size_t(heads) * 4));
  quant::launch_kv_prepass<D, __half>(p, nullptr);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);

  PrepassRun r;
  auto back = [](auto& v, const void* src, size_t count) {
    v.resize(count);
    cudaMemcpy(v.data(), src, count * sizeof(v[0]), cudaMemcpyDeviceToHost);
  };
  back(r.k_codes, p.out.k, size_t(heads) * n_pad * D);
  back(r.vt, p.out.vt, size_t(heads) * n_pad * D);
  back(r.k_scale, p.out.k_scale, size_t(heads) * tiles * 4);
  back(r.k_mean, p.out.k_mean, size_t(heads) * D);
  back(r.v_scale, p.out.v_scale, size_t(heads) * D);
  back(r.v_inv, p.out.v_inv, size_t(heads) * D);
  back(r.k_amax, p.out.k_amax, size_t(heads));
  for (void* a : allocations) cudaFree(a);
  return r;
}

// Head `head` of a run against a CPU recomputation from the same formulas.
void expect_head_matches_cpu(const PrepassInputs& in, const PrepassRun& r, int head) {
  const int n = in.n, n_pad = in.n_pad, tiles = n_pad / 128;
  const float* k_mean = &r.k_mean[size_t(head) * D];
  std::vector<float> k(n * D), v(n * D);
  for (int i = 0; i < n * D; ++i) {
    k[i] = fmt::fp16_from_bits(in.k[size_t(head) * n * D + i]);
    v[i] = fmt::fp16_from_bits(in.v[size_t(head) * n * D + i]);
  }
  std::vector<float> km(D), vmax(D, 0.f);
  for (int c = 0; c < D; ++c) {
    double s = 0;
    for (int t = 0; t < n; ++t) s += k[t * D + c], vmax[c] = std::fmax(vmax[c], std::fabs(v[t * D + c]));
    km[c] = float(s / n);
    EXPECT_NEAR(k_mean[c], km[c], 1e-5 * (1 + std::fabs(km[c]))) << "head " << head << " channel " << c;
    EXPECT_EQ(r.v_scale[head * D + c], rules::symmetric_scale(vmax[c], 448.f)) << "head " << head << " channel " << c;
    EXPECT_EQ(r.v_inv[head * D + c], rules::symmetric_inverse(vmax[c], 448.f)) << "head " << head << " channel " << c;
  }
  // The per-tensor K amax about the GPU's own mean: exact (rounding is monotonic).
  float want_k_amax = 0.f;
  for (int t = 0; t < n; ++t)
    for (int c = 0; c < D; ++c) want_k_amax = std::fmax(want_k_amax, std::fabs(k[t * D + c] - k_mean[c]));
  EXPECT_EQ(r.k_amax[head], want_k_amax) << "head " << head;
  int64_t k_mismatch = 0, v_mismatch = 0, scale_mismatch = 0;
  const int8_t* k_codes = &r.k_codes[size_t(head) * n_pad * D];
  const uint8_t* vt = &r.vt[size_t(head) * n_pad * D];
  const float* k_scale = &r.k_scale[size_t(head) * tiles * 4];
  for (int tile = 0; tile < tiles; ++tile) {
    float amax[4] = {0, 0, 0, 0};
    for (int row = 0; row < 128; ++row) {
      const int t = tile * 128 + row;
      if (t >= n) continue;
      for (int c = 0; c < D; ++c) amax[(row % 8) / 2] = std::fmax(amax[(row % 8) / 2], std::fabs(k[t * D + c] - k_mean[c]));
    }
    for (int g = 0; g < 4; ++g)
      if (std::fabs(k_scale[tile * 4 + g] - rules::symmetric_scale(amax[g], 127.f)) > 1e-6f * amax[g]) {
        if (scale_mismatch++ < 5)
          std::printf("head %d k_scale tile %d group %d: gpu %g cpu %g\n", head, tile, g, k_scale[tile * 4 + g], amax[g] / 127.f);
      }
    for (int row = 0; row < 128; ++row) {
      const int t = tile * 128 + row;
      const float inv = rules::symmetric_inverse(amax[(row % 8) / 2], 127.f);
      for (int c = 0; c < D; ++c) {
        const int want = t < n ? rules::round_clamp((k[t * D + c] - k_mean[c]) * inv, 127) : 0;
        const int got = k_codes[int64_t(t) * D + c];
        if (std::abs(want - got) > (t < n ? 1 : 0) && k_mismatch++ < 5)
          std::printf("head %d K tile %d row %d ch %d: gpu %d cpu %d\n", head, tile, row, c, got, want);
        const float vin = rules::symmetric_inverse(vmax[c], 448.f);
        const uint8_t vwant = t < n ? fmt::e4m3_encode(v[t * D + c] * vin) : 0;
        const int pos = 32 * (row / 32) + quant::pv_position_of_token(row % 32);
        const uint8_t vgot = vt[int64_t(c) * n_pad + tile * 128 + pos];
        if (vwant != vgot && v_mismatch++ < 5)
          std::printf("head %d V tile %d row %d ch %d: gpu %02x cpu %02x\n", head, tile, row, c, vgot, vwant);
      }
    }
  }
  EXPECT_EQ(scale_mismatch, 0) << "head " << head;
  EXPECT_EQ(k_mismatch, 0) << "head " << head;
  EXPECT_EQ(v_mismatch, 0) << "head " << head;
}

template <class V>
int64_t differing(const V& a, const V& b) {
  int64_t n = 0;
  for (size_t i = 0; i < a.size(); ++i) n += std::memcmp(&a[i], &b[i], sizeof(a[i])) != 0;
  return n;
}
#endif

TEST(KVPrepass, MatchesCpuQuantization) {
  SAGE_REQUIRE_GPU();
#ifdef SAGE_WITH_CUDA
  const PrepassInputs in = make_inputs(1, 300);
  expect_head_matches_cpu(in, run_prepass(in), 0);
#endif
}

// The one-launch pre-pass quantizes a head `lag` heads after measuring it. Whatever the lag
// (all heads measured first, or statistics and quantize items interleaved, with several
// statistics chunks of several tiles per head at n = 2100), every output is bit-identical and
// every head matches the CPU.
TEST(KVPrepass, LagDoesNotChangeResults) {
  SAGE_REQUIRE_GPU();
#ifdef SAGE_WITH_CUDA
  for (int n : {300, 2100}) {
    const PrepassInputs in = make_inputs(6, n);
    const PrepassRun automatic = run_prepass(in);
    for (int h = 0; h < in.heads; ++h) expect_head_matches_cpu(in, automatic, h);
    for (int lag : {1, 2, 5}) {
      quant::set_prepass_lag_override(lag);
      const PrepassRun forced = run_prepass(in);
      quant::set_prepass_lag_override(0);
      EXPECT_EQ(differing(forced.k_codes, automatic.k_codes), 0) << "n " << n << " lag " << lag;
      EXPECT_EQ(differing(forced.vt, automatic.vt), 0) << "n " << n << " lag " << lag;
      EXPECT_EQ(differing(forced.k_scale, automatic.k_scale), 0) << "n " << n << " lag " << lag;
      EXPECT_EQ(differing(forced.k_mean, automatic.k_mean), 0) << "n " << n << " lag " << lag;
      EXPECT_EQ(differing(forced.v_scale, automatic.v_scale), 0) << "n " << n << " lag " << lag;
      EXPECT_EQ(differing(forced.k_amax, automatic.k_amax), 0) << "n " << n << " lag " << lag;
    }
  }
#endif
}

}  // namespace
}  // namespace sage::testing
