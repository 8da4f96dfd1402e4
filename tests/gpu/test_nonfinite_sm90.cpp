// Non-finite inputs on the GPU (docs/numerics.md, "Non-finite inputs"): a NaN or an infinity
// planted in Q, K or V must reach the output as the simulator says, never be absorbed into a
// finite output. For every GPU preset, both head dims, causal or not: the kernel's NaN pattern
// (output and LSE) equals the simulator's element for element, every element float64
// attention makes non-finite is non-finite in ours, and the finite elements agree with the
// simulator.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "gpu_harness.h"
#include "numerics/formats.h"
#include "reference/metrics.h"

#ifdef SAGE_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace sage::testing {
namespace {

enum class Where { q, k, v };
const char* where_name(Where w) { return w == Where::q ? "q" : w == Where::k ? "k" : "v"; }

struct Planted {
  Where where;
  float value;  // NaN, +inf or -inf
};

struct Shape {
  int64_t heads_q = 4, heads_kv = 2, n_q = 200, n_kv = 333, d = 128;
  bool causal = false;
};

std::string describe(const std::string& recipe, const Shape& s, const Planted& p) {
  return recipe + " d=" + std::to_string(s.d) + (s.causal ? " causal" : "") + " " +
         std::to_string(p.value) + " in " + where_name(p.where);
}

#ifdef SAGE_WITH_CUDA
void check(cudaError_t e, const char* what) {
  ASSERT_EQ(e, cudaSuccess) << what << ": " << cudaGetErrorString(e);
}

// One case: fp16 inputs with one element set to the planted value, the kernel's output and
// LSE against simulate() and exact() on the same inputs.
void run_case(const std::string& recipe_name, const Shape& s, const Planted& planted, uint64_t seed) {
  SCOPED_TRACE(describe(recipe_name, s, planted));
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  const size_t nq = size_t(s.heads_q * s.n_q * s.d), nkv = size_t(s.heads_kv * s.n_kv * s.d);
  std::vector<uint16_t> q(nq), k(nkv), v(nkv);
  for (auto* t : {&q, &k, &v})
    for (auto& x : *t) x = fmt::fp16_bits(normal(rng));
  std::vector<uint16_t>& target = planted.where == Where::q ? q : planted.where == Where::k ? k : v;
  const size_t at = std::uniform_int_distribution<size_t>(0, target.size() - 1)(rng);
  target[at] = fmt::fp16_bits(planted.value);

  const Device gpu = Device::cuda(0);
  void *dq, *dk, *dv, *dout, *dlse;
  check(cudaMalloc(&dq, nq * 2), "malloc");
  check(cudaMalloc(&dk, nkv * 2), "malloc");
  check(cudaMalloc(&dv, nkv * 2), "malloc");
  check(cudaMalloc(&dout, nq * 2), "malloc");
  check(cudaMalloc(&dlse, size_t(s.heads_q * s.n_q) * 4), "malloc");
  check(cudaMemcpy(dq, q.data(), nq * 2, cudaMemcpyHostToDevice), "upload");
  check(cudaMemcpy(dk, k.data(), nkv * 2, cudaMemcpyHostToDevice), "upload");
  check(cudaMemcpy(dv, v.data(), nkv * 2, cudaMemcpyHostToDevice), "upload");
  AttentionArgs a;
  a.recipe = preset(recipe_name);
  a.causal = s.causal;
  a.q = contiguous_view(dq, DType::f16, {1, s.heads_q, s.n_q, s.d}, gpu);
  a.k = contiguous_view(dk, DType::f16, {1, s.heads_kv, s.n_kv, s.d}, gpu);
  a.v = contiguous_view(dv, DType::f16, {1, s.heads_kv, s.n_kv, s.d}, gpu);
  a.out = contiguous_view(dout, DType::f16, {1, s.heads_q, s.n_q, s.d}, gpu);
  a.lse = contiguous_view(dlse, DType::f32, {1, s.heads_q, s.n_q}, gpu);
  const size_t ws_bytes = workspace_bytes(a);
  DeviceWorkspace ws(ws_bytes);
  attention(a, ws.get(), ws_bytes, nullptr);
  check(cudaDeviceSynchronize(), "attention");
  std::vector<uint16_t> out(nq);
  std::vector<float> lse(size_t(s.heads_q * s.n_q));
  check(cudaMemcpy(out.data(), dout, nq * 2, cudaMemcpyDeviceToHost), "download");
  check(cudaMemcpy(lse.data(), dlse, lse.size() * 4, cudaMemcpyDeviceToHost), "download");
  for (void* p : {dq, dk, dv, dout, dlse}) cudaFree(p);

  // The references on the host copies.
  std::vector<float> sim(nq), ex(nq), sim_lse(lse.size()), ex_lse(lse.size());
  AttentionArgs h = a;
  h.q = contiguous_view(q.data(), DType::f16, {1, s.heads_q, s.n_q, s.d});
  h.k = contiguous_view(k.data(), DType::f16, {1, s.heads_kv, s.n_kv, s.d});
  h.v = contiguous_view(v.data(), DType::f16, {1, s.heads_kv, s.n_kv, s.d});
  h.out = contiguous_view(sim.data(), DType::f32, {1, s.heads_q, s.n_q, s.d});
  h.lse = contiguous_view(sim_lse.data(), DType::f32, {1, s.heads_q, s.n_q});
  reference::simulate(h);
  h.out = contiguous_view(ex.data(), DType::f32, {1, s.heads_q, s.n_q, s.d});
  h.lse = contiguous_view(ex_lse.data(), DType::f32, {1, s.heads_q, s.n_q});
  reference::exact(h);

  // Each disagreement is counted, and the first of each kind is described, so that a failure
  // says where the kernel and the simulator part.
  int64_t nan_mismatch = 0, absorbed = 0, nonfinite = 0, lse_mismatch = 0;
  std::string first_mismatch, first_absorbed, first_lse;
  auto where = [&](size_t i) {
    const size_t row = i / size_t(s.d);
    return "head " + std::to_string(row / size_t(s.n_q)) + " row " + std::to_string(row % size_t(s.n_q)) +
           " channel " + std::to_string(i % size_t(s.d));
  };
  std::vector<float> gf, sf;
  for (size_t i = 0; i < nq; ++i) {
    const float g = fmt::fp16_from_bits(out[i]);
    const bool g_bad = !std::isfinite(g), s_bad = !std::isfinite(sim[i]);
    if (g_bad != s_bad && nan_mismatch++ == 0)
      first_mismatch = where(i) + ": kernel " + std::to_string(g) + ", simulator " + std::to_string(sim[i]);
    if (!std::isfinite(ex[i]) && !g_bad && absorbed++ == 0)
      first_absorbed = where(i) + ": kernel " + std::to_string(g) + ", float64 " + std::to_string(ex[i]);
    nonfinite += g_bad;
    if (!g_bad && !s_bad) gf.push_back(g), sf.push_back(sim[i]);
  }
  for (size_t i = 0; i < lse.size(); ++i) {
    const bool differ = std::isnan(lse[i]) != std::isnan(sim_lse[i]);
    if (differ && lse_mismatch++ == 0)
      first_lse = "LSE head " + std::to_string(i / size_t(s.n_q)) + " row " + std::to_string(i % size_t(s.n_q)) +
                  ": kernel " + std::to_string(lse[i]) + ", simulator " + std::to_string(sim_lse[i]);
    absorbed += std::isnan(ex_lse[i]) && !std::isnan(lse[i]);
  }
  EXPECT_EQ(nan_mismatch, 0) << "output elements non-finite in one of kernel and simulator only; first: "
                             << first_mismatch;
  EXPECT_EQ(lse_mismatch, 0) << "LSE rows NaN in one of kernel and simulator only; first: " << first_lse;
  EXPECT_EQ(absorbed, 0) << "elements float64 attention makes non-finite, finite here; first: "
                         << first_absorbed;
  EXPECT_GT(nonfinite, 0) << "the planted value reached no output";
  if (!gf.empty()) {
    const reference::ErrorStats e = reference::compare(gf.data(), sf.data(), int64_t(gf.size()));
    EXPECT_GE(e.cosine, 0.9999) << "finite elements against the simulator (" << gf.size()
                                << " elements, max abs " << e.max_abs << ")";
  }
}
#endif

TEST(Sm90NonFinite, PropagatesAsTheSimulatorSays) {
  SAGE_REQUIRE_GPU();
#ifdef SAGE_WITH_CUDA
  const float nan = std::nanf(""), inf = INFINITY;
  const Planted planted[] = {{Where::q, nan}, {Where::q, inf},  {Where::q, -inf}, {Where::k, nan},
                             {Where::k, inf}, {Where::v, nan}, {Where::v, -inf}};
  uint64_t seed = 1;
  int cases = 0;
  for (const std::string& recipe : gpu_presets()) {
    if (preset(recipe).inputs == Inputs::prequantized_int8) continue;  // INT8 inputs are finite
    for (int64_t d : harness_head_dims()) {
      if (!gpu_has_kernel(recipe, d)) continue;  // fp16 PV above d = 128
      for (bool causal : {false, true})
        for (const Planted& p : planted) {
          Shape s;
          s.d = d, s.causal = causal;
          run_case(recipe, s, p, seed++);
          ++cases;
        }
    }
  }
  std::printf("[nonfinite] %d cases\n", cases);
#endif
}

}  // namespace
}  // namespace sage::testing
