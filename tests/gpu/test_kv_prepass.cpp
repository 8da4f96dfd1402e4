// The K/V pre-pass on its own: its INT8 K codes and scales, and its transposed, permuted
// E4M3 V, against a CPU recomputation from the same formulas (quant_rules.h, formats.h), with
// K's mean over every key and over every 8th (recipe.k_mean_stride).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "gpu_harness.h"
#include "reference/synthetic.h"
#include "numerics/formats.h"
#include "numerics/quant_rules.h"

#ifdef SAGE_WITH_CUDA
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "quant/kv_prepass.cuh"
#endif

namespace sage::testing {
namespace {

TEST(KVPrepass, MatchesCpuQuantization) {
  SAGE_REQUIRE_GPU();
#ifdef SAGE_WITH_CUDA
  // 300 keys (half a statistics cluster: up to 2048 keys) and 2500 (a whole one); stride 8
  // samples 38 of 300 (0, 8, ..., 296), fewer than a CTA's first round.
  for (const int n : {300, 2500})
  for (const int stride : {1, 8}) {
    SCOPED_TRACE("n " + std::to_string(n) + ", k_mean_stride " + std::to_string(stride));
    constexpr int D = 128;
    const int n_pad = (n + quant::kKVTile - 1) / quant::kKVTile * quant::kKVTile;
    const int tiles = n_pad / quant::kKVTile;
    reference::SyntheticShape shape;
    shape.n_q = shape.n_kv = n, shape.head_dim = D;
    const reference::SyntheticInputs in = reference::make_synthetic("k_bias", shape, 3);

    auto dev = [](size_t bytes) {
      void* p = nullptr;
      EXPECT_EQ(cudaMalloc(&p, bytes), cudaSuccess);
      EXPECT_EQ(cudaMemset(p, 0, bytes), cudaSuccess);
      return p;
    };
    void* dk = dev(n * D * 2);
    void* dv = dev(n * D * 2);
    cudaMemcpy(dk, in.k.data(), n * D * 2, cudaMemcpyHostToDevice);
    cudaMemcpy(dv, in.v.data(), n * D * 2, cudaMemcpyHostToDevice);
    quant::KVQuantParams p{};
    p.k = dk, p.v = dv;
    p.k_stride_b = p.v_stride_b = int64_t(n) * D;
    p.k_stride_h = p.v_stride_h = int64_t(n) * D;
    p.k_stride_n = p.v_stride_n = D;
    p.batch = 1, p.heads_kv = 1, p.n_kv = n, p.n_pad = n_pad;
    p.head_dim = D;  // the caller's head dim bounds every read (0 would read nothing)
    p.k_granularity = Granularity::per_thread;
    p.k_max = 127, p.v_format = quant::VFormat::e4m3;
    p.smooth_k = true, p.smooth_v = false, p.v_max = 448.f;
    p.k_mean_stride = stride;
    p.out.k = static_cast<int8_t*>(dev(n_pad * D));
    p.out.vt = static_cast<uint8_t*>(dev(n_pad * D));
    p.out.k_scale = static_cast<float*>(dev(tiles * 4 * 4));
    p.out.k_mean = static_cast<float*>(dev(D * 4));
    p.out.v_scale = static_cast<float*>(dev(D * 4));
    p.out.v_mean = static_cast<float*>(dev(D * 4));
    p.out.v_inv = static_cast<float*>(dev(D * 4));
    p.out.k_amax = static_cast<float*>(dev(4));
    quant::launch_kv_prepass<D, __half>(p, nullptr);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);

    std::vector<int8_t> k_codes(n_pad * D);
    std::vector<uint8_t> vt(n_pad * D);
    std::vector<float> k_scale(tiles * 4), k_mean(D), v_scale(D), v_inv(D);
    float k_amax = -1.f;
    cudaMemcpy(k_codes.data(), p.out.k, k_codes.size(), cudaMemcpyDeviceToHost);
    cudaMemcpy(vt.data(), p.out.vt, vt.size(), cudaMemcpyDeviceToHost);
    cudaMemcpy(k_scale.data(), p.out.k_scale, k_scale.size() * 4, cudaMemcpyDeviceToHost);
    cudaMemcpy(k_mean.data(), p.out.k_mean, D * 4, cudaMemcpyDeviceToHost);
    cudaMemcpy(v_scale.data(), p.out.v_scale, D * 4, cudaMemcpyDeviceToHost);
    cudaMemcpy(v_inv.data(), p.out.v_inv, D * 4, cudaMemcpyDeviceToHost);
    cudaMemcpy(&k_amax, p.out.k_amax, 4, cudaMemcpyDeviceToHost);

    // CPU recomputation.
    std::vector<float> k(n * D), v(n * D);
    for (int i = 0; i < n * D; ++i) k[i] = fmt::fp16_from_bits(in.k[i]), v[i] = fmt::fp16_from_bits(in.v[i]);
    std::vector<float> km(D), vmax(D, 0.f);
    const int samples = int(rules::k_mean_samples(n, stride));
    for (int c = 0; c < D; ++c) {
      double s = 0;
      for (int t = 0; t < n; ++t) vmax[c] = std::fmax(vmax[c], std::fabs(v[t * D + c]));
      for (int t = 0; t < n; t += stride) s += k[t * D + c];
      km[c] = float(s / samples);
      EXPECT_NEAR(k_mean[c], km[c], 1e-5 * (1 + std::fabs(km[c]))) << "channel " << c;
      EXPECT_EQ(v_scale[c], rules::symmetric_scale(vmax[c], 448.f)) << "channel " << c;
      EXPECT_EQ(v_inv[c], rules::symmetric_inverse(vmax[c], 448.f)) << "channel " << c;
    }
    // The per-tensor K amax about the GPU's own mean, over the sampled keys: exact (rounding is
    // monotonic).
    float want_k_amax = 0.f;
    for (int t = 0; t < n; t += stride)
      for (int c = 0; c < D; ++c) want_k_amax = std::fmax(want_k_amax, std::fabs(k[t * D + c] - k_mean[c]));
    EXPECT_EQ(k_amax, want_k_amax);
    int64_t k_mismatch = 0, v_mismatch = 0, scale_mismatch = 0;
    for (int tile = 0; tile < tiles; ++tile) {
      float amax[4] = {0, 0, 0, 0};
      for (int r = 0; r < 128; ++r) {
        const int t = tile * 128 + r;
        if (t >= n) continue;
        for (int c = 0; c < D; ++c) amax[(r % 8) / 2] = std::fmax(amax[(r % 8) / 2], std::fabs(k[t * D + c] - k_mean[c]));
      }
      for (int g = 0; g < 4; ++g)
        if (std::fabs(k_scale[tile * 4 + g] - rules::symmetric_scale(amax[g], 127.f)) > 1e-6f * amax[g]) {
          if (scale_mismatch++ < 5)
            std::printf("k_scale tile %d group %d: gpu %g cpu %g\n", tile, g, k_scale[tile * 4 + g], amax[g] / 127.f);
        }
      for (int r = 0; r < 128; ++r) {
        const int t = tile * 128 + r;
        const float inv = rules::symmetric_inverse(amax[(r % 8) / 2], 127.f);
        for (int c = 0; c < D; ++c) {
          const int want = t < n ? rules::round_clamp((k[t * D + c] - k_mean[c]) * inv, 127) : 0;
          const int got = k_codes[int64_t(t) * D + c];
          if (std::abs(want - got) > (t < n ? 1 : 0) && k_mismatch++ < 5)
            std::printf("K tile %d row %d ch %d: gpu %d cpu %d\n", tile, r, c, got, want);
          const float vin = rules::symmetric_inverse(vmax[c], 448.f);
          const uint8_t vwant = t < n ? fmt::e4m3_encode(v[t * D + c] * vin) : 0;
          const int pos = 32 * (r / 32) + quant::pv_position_of_token(r % 32);
          const uint8_t vgot = vt[int64_t(c) * n_pad + tile * 128 + pos];
          if (vwant != vgot && v_mismatch++ < 5)
            std::printf("V tile %d row %d ch %d: gpu %02x cpu %02x\n", tile, r, c, vgot, vwant);
        }
      }
    }
    EXPECT_EQ(scale_mismatch, 0);
    EXPECT_EQ(k_mismatch, 0);
    EXPECT_EQ(v_mismatch, 0);
    for (void* ptr : {dk, dv, static_cast<void*>(p.out.k), static_cast<void*>(p.out.vt),
                      static_cast<void*>(p.out.k_scale), static_cast<void*>(p.out.k_mean),
                      static_cast<void*>(p.out.v_scale), static_cast<void*>(p.out.v_mean),
                      static_cast<void*>(p.out.v_inv), static_cast<void*>(p.out.k_amax)})
      cudaFree(ptr);
  }
#endif
}

}  // namespace
}  // namespace sage::testing
