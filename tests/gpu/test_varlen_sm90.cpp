// Packed variable-length batches on sm_90 (issue 34, section 2): attention_varlen against
// reference::simulate_varlen (the harness's kernel-vs-simulator bounds) and exact_varlen, over
// lengths 0, 1, odd and random, causal and sliding windows per sequence, GQA/MQA, fp16/bf16,
// strided packed views, the head dims of the build; the no-leak proof (a sequence packed among
// different neighbours gives bit-identical output and LSE); CUDA-graph replay with new offsets
// in the same device buffers; the named refusals. Randomized cases: SAGE_VARLEN_RANDOM_CASES
// (default 120; the bar counts 500 over all randomized GPU tests).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "gpu_harness.h"
#include "numerics/formats.h"
#include "reference/metrics.h"
#include "reference/synthetic.h"
#include "sage/attention.h"
#include "sage/error.h"
#include "sage/recipe.h"
#include "sage/varlen.h"

#ifdef SAGE_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace sage::testing {
namespace {

#ifndef SAGE_WITH_CUDA

TEST(Sm90Varlen, SkippedWithoutCuda) { GTEST_SKIP() << "GPU test skipped: this build has no CUDA"; }

#else

constexpr float kMinusInf = -std::numeric_limits<float>::infinity();

void check_cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

struct Buffer {
  void* ptr = nullptr;
  size_t bytes = 0;
  explicit Buffer(size_t n, int fill = 0xFF) : bytes(std::max<size_t>(n, 256)) {
    check_cuda(cudaMalloc(&ptr, bytes), "cudaMalloc");
    check_cuda(cudaMemset(ptr, fill, bytes), "cudaMemset");
  }
  ~Buffer() { cudaFree(ptr); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  template <class T>
  void upload(const std::vector<T>& host) {
    check_cuda(cudaMemcpy(ptr, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice), "upload");
  }
  template <class T>
  void download(std::vector<T>& host) const {
    check_cuda(cudaMemcpy(host.data(), ptr, host.size() * sizeof(T), cudaMemcpyDeviceToHost), "download");
  }
};

struct VarlenCase {
  std::vector<std::pair<int64_t, int64_t>> lengths;  // (n_q, n_k) per sequence
  int64_t heads_q = 4, heads_kv = 2, head_dim = 128;
  DType dtype = DType::f16;
  bool causal = false;
  int64_t window_left = -1, window_right = -1;
  bool strided = false;     // padded token strides for q, k, v, out and the LSE
  int64_t extra_max = 0;    // max_seqlen_q / _k passed this much above the longest
  std::string recipe = "sage2_8b";
  uint64_t seed = 1;

  std::string describe() const {
    std::string s = recipe + " d" + std::to_string(head_dim) + " h" + std::to_string(heads_q) + "/" +
                    std::to_string(heads_kv) + (dtype == DType::bf16 ? " bf16" : " f16") +
                    (causal ? " causal" : "") + " window(" + std::to_string(window_left) + "," +
                    std::to_string(window_right) + ")" + (strided ? " strided" : "") + " seed " +
                    std::to_string(seed) + " lengths";
    for (const auto& [q, k] : lengths) s += " " + std::to_string(q) + "/" + std::to_string(k);
    return s;
  }
};

// One sequence's values, token-major [n, heads, d], with channel biases of its own (a few Q/K
// channels far off zero, a V bias), so that a statistic taken across sequences would show.
struct Sequence {
  int64_t n_q = 0, n_k = 0;
  std::vector<float> q, k, v;
};

Sequence make_sequence(const VarlenCase& c, int64_t n_q, int64_t n_k, uint64_t seed) {
  reference::Rng rng(seed * 7919 + 17);
  const int64_t d = c.head_dim;
  std::vector<double> qb(d, 0.0), kb(d, 0.0), vb(d, 0.0);
  for (int64_t i = 0; i < d; ++i) kb[i] = 3.0 * rng.normal(), vb[i] = 2.0 * rng.normal();
  for (int64_t ch : {int64_t(3), d / 2 + 1}) qb[ch] = kb[ch] = 8.0 + 8.0 * rng.uniform();
  auto fill = [&](int64_t n, int64_t heads, const std::vector<double>& bias) {
    std::vector<float> x(size_t(n * heads * d));
    for (size_t i = 0; i < x.size(); ++i) x[i] = float(bias[i % d] + rng.normal());
    return x;
  };
  Sequence s;
  s.n_q = n_q, s.n_k = n_k;
  s.q = fill(n_q, c.heads_q, qb);
  s.k = fill(n_k, c.heads_kv, kb);
  s.v = fill(n_k, c.heads_kv, vb);
  return s;
}

uint16_t to_bits(DType t, float x) { return t == DType::bf16 ? fmt::bf16_bits(x) : fmt::fp16_bits(x); }
float from_bits(DType t, uint16_t b) { return t == DType::bf16 ? fmt::bf16_from_bits(b) : fmt::fp16_from_bits(b); }

// The sequences packed one after another into [total, heads, d] storage (token stride padded
// by 8 elements when strided), in the input dtype's bits.
struct Packed {
  std::vector<uint16_t> q, k, v;
  std::vector<int32_t> cu_q{0}, cu_k{0};
  int64_t total_q = 0, total_k = 0, max_q = 0, max_k = 0;
  int64_t q_tok = 0, kv_tok = 0, lse_tok = 0;  // token strides (elements)
};

Packed pack(const VarlenCase& c, const std::vector<Sequence>& seqs) {
  Packed p;
  const int64_t d = c.head_dim, pad = c.strided ? 8 : 0;
  p.q_tok = c.heads_q * d + pad;
  p.kv_tok = c.heads_kv * d + pad;
  for (const Sequence& s : seqs) {
    p.cu_q.push_back(p.cu_q.back() + int32_t(s.n_q));
    p.cu_k.push_back(p.cu_k.back() + int32_t(s.n_k));
    p.max_q = std::max(p.max_q, s.n_q);
    p.max_k = std::max(p.max_k, s.n_k);
  }
  p.total_q = p.cu_q.back(), p.total_k = p.cu_k.back();
  p.max_q += c.extra_max, p.max_k += c.extra_max;
  p.lse_tok = p.total_q + (c.strided ? 5 : 0);  // the LSE's head stride
  // Padding elements hold a value that would show if read (a large finite number).
  p.q.assign(size_t(std::max<int64_t>(p.total_q, 1) * p.q_tok), to_bits(c.dtype, 3000.f));
  p.k.assign(size_t(std::max<int64_t>(p.total_k, 1) * p.kv_tok), to_bits(c.dtype, 3000.f));
  p.v.assign(p.k.size(), to_bits(c.dtype, 3000.f));
  for (size_t b = 0; b < seqs.size(); ++b) {
    const Sequence& s = seqs[b];
    for (int64_t t = 0; t < s.n_q; ++t)
      for (int64_t i = 0; i < c.heads_q * d; ++i)
        p.q[size_t((p.cu_q[b] + t) * p.q_tok + i)] = to_bits(c.dtype, s.q[size_t(t * c.heads_q * d + i)]);
    for (int64_t t = 0; t < s.n_k; ++t)
      for (int64_t i = 0; i < c.heads_kv * d; ++i) {
        p.k[size_t((p.cu_k[b] + t) * p.kv_tok + i)] = to_bits(c.dtype, s.k[size_t(t * c.heads_kv * d + i)]);
        p.v[size_t((p.cu_k[b] + t) * p.kv_tok + i)] = to_bits(c.dtype, s.v[size_t(t * c.heads_kv * d + i)]);
      }
  }
  return p;
}

TensorView packed_view(void* data, DType t, int64_t tokens, int64_t heads, int64_t d, int64_t tok_stride,
                       Device dev) {
  return strided_view(data, t, {tokens, heads, d}, {tok_stride, d, 1}, dev);
}

// The call's arguments over some storage (device or host).
VarlenArgs varlen_args(const VarlenCase& c, const Packed& p, void* q, void* k, void* v, void* out, DType out_t,
                       void* lse, void* cu_q, void* cu_k, Device dev) {
  VarlenArgs a;
  a.q = packed_view(q, c.dtype, p.total_q, c.heads_q, c.head_dim, p.q_tok, dev);
  a.k = packed_view(k, c.dtype, p.total_k, c.heads_kv, c.head_dim, p.kv_tok, dev);
  a.v = packed_view(v, c.dtype, p.total_k, c.heads_kv, c.head_dim, p.kv_tok, dev);
  a.out = packed_view(out, out_t, p.total_q, c.heads_q, c.head_dim, p.q_tok, dev);
  a.lse = strided_view(lse, DType::f32, {c.heads_q, p.total_q}, {p.lse_tok, 1}, dev);
  const int64_t n = int64_t(p.cu_q.size());
  a.cu_seqlens_q = contiguous_view(cu_q, DType::i32, {n}, dev);
  a.cu_seqlens_k = contiguous_view(cu_k, DType::i32, {n}, dev);
  a.max_seqlen_q = p.max_q, a.max_seqlen_k = p.max_k;
  a.causal = c.causal;
  a.window_left = c.window_left, a.window_right = c.window_right;
  a.recipe = preset(c.recipe);
  return a;
}

struct Result {
  std::vector<uint16_t> out;  // [total_q, heads_q, d] through the token stride
  std::vector<float> lse;     // [heads_q, lse_tok]
};

// The packed batch on the device, in a workspace of garbage bytes; outputs start as NaN.
struct DeviceCall {
  const VarlenCase& c;
  const Packed& p;
  Buffer q, k, v, out, lse, cu_q, cu_k;
  VarlenArgs args;
  std::unique_ptr<Buffer> ws;
  DeviceCall(const VarlenCase& c_, const Packed& p_)
      : c(c_), p(p_), q(p.q.size() * 2), k(p.k.size() * 2), v(p.v.size() * 2), out(p.q.size() * 2),
        lse(size_t(c.heads_q * p.lse_tok) * 4), cu_q(p.cu_q.size() * 4), cu_k(p.cu_k.size() * 4) {
    q.upload(p.q), k.upload(p.k), v.upload(p.v), cu_q.upload(p.cu_q), cu_k.upload(p.cu_k);
    args = varlen_args(c, p, q.ptr, k.ptr, v.ptr, out.ptr, c.dtype, lse.ptr, cu_q.ptr, cu_k.ptr,
                       Device::cuda(0));
    ws = std::make_unique<Buffer>(varlen_workspace_bytes(args), 0xAB);  // garbage, not zeros
  }
  void run(cudaStream_t stream = nullptr) { attention_varlen(args, ws->ptr, ws->bytes, stream); }
  Result result() const {
    Result r;
    r.out.resize(p.q.size());
    r.lse.resize(size_t(c.heads_q * p.lse_tok));
    out.download(r.out);
    lse.download(r.lse);
    return r;
  }
};

Result run_gpu(const VarlenCase& c, const Packed& p) {
  DeviceCall call(c, p);
  call.run();
  device_sync("attention_varlen");
  return call.result();
}

struct References {
  std::vector<float> sim, exact, sim_lse, exact_lse;
};

References run_references(const VarlenCase& c, Packed& p) {
  References r;
  const size_t out_n = p.q.size(), lse_n = size_t(c.heads_q * p.lse_tok);
  r.sim.assign(out_n, 0.f), r.exact.assign(out_n, 0.f);
  r.sim_lse.assign(lse_n, 0.f), r.exact_lse.assign(lse_n, 0.f);
  reference::simulate_varlen(varlen_args(c, p, p.q.data(), p.k.data(), p.v.data(), r.sim.data(), DType::f32,
                                         r.sim_lse.data(), p.cu_q.data(), p.cu_k.data(), Device::cpu()));
  reference::exact_varlen(varlen_args(c, p, p.q.data(), p.k.data(), p.v.data(), r.exact.data(), DType::f32,
                                      r.exact_lse.data(), p.cu_q.data(), p.cu_k.data(), Device::cpu()));
  return r;
}

// The kernel against the references: the harness's bounds over the whole packed output, a
// looser per-sequence cosine (a wrong sequence offset shows there, not in the whole), zeros
// and -inf for a sequence with queries and no keys, and every output element written.
void expect_varlen_within_bounds(const VarlenCase& c, const Packed& p, const Result& got, const References& ref) {
  const Bounds b = bounds_for(c.recipe);
  const int64_t row = c.heads_q * c.head_dim;
  std::vector<float> g, s, e;  // the sequences' elements only (no stride padding)
  int64_t unwritten = 0;
  for (size_t bi = 0; bi + 1 < p.cu_q.size(); ++bi) {
    const int64_t n_q = p.cu_q[bi + 1] - p.cu_q[bi], n_k = p.cu_k[bi + 1] - p.cu_k[bi];
    std::vector<float> gs, ss;
    for (int64_t t = p.cu_q[bi]; t < p.cu_q[bi + 1]; ++t)
      for (int64_t i = 0; i < row; ++i) {
        const size_t at = size_t(t * p.q_tok + i);
        const float x = from_bits(c.dtype, got.out[at]);
        if (std::isnan(x) && !std::isnan(ref.sim[at])) ++unwritten;
        // The simulator rounded once to the output dtype, as the kernel stores it.
        const float sim = from_bits(c.dtype, to_bits(c.dtype, ref.sim[at]));
        gs.push_back(x), ss.push_back(sim);
        g.push_back(x), s.push_back(sim), e.push_back(ref.exact[at]);
      }
    if (n_q > 0 && n_k == 0) {
      for (float x : gs) EXPECT_EQ(x, 0.f) << c.describe() << ": sequence " << bi << " has no keys";
      for (int64_t h = 0; h < c.heads_q; ++h)
        for (int64_t t = p.cu_q[bi]; t < p.cu_q[bi + 1]; ++t)
          EXPECT_EQ(got.lse[size_t(h * p.lse_tok + t)], kMinusInf) << c.describe() << ": sequence " << bi;
    } else if (n_q > 0 && std::any_of(ss.begin(), ss.end(), [](float x) { return x != 0.f; })) {
      const reference::ErrorStats st = reference::compare(gs.data(), ss.data(), int64_t(gs.size()));
      EXPECT_GE(st.cosine, 0.999) << c.describe() << ": sequence " << bi << " (" << n_q << "/" << n_k << ")";
    }
  }
  EXPECT_EQ(unwritten, 0) << c.describe();
  if (g.empty()) return;
  const reference::ErrorStats vs_sim = reference::compare(g.data(), s.data(), int64_t(g.size()));
  const reference::ErrorStats vs_exact = reference::compare(g.data(), e.data(), int64_t(g.size()));
  const reference::ErrorStats sim_exact = reference::compare(s.data(), e.data(), int64_t(g.size()));
  std::printf("[varlen] %s | sim cos %.7f l1 %.2e | exact cos %.6f (sim's %.6f)\n", c.describe().c_str(),
              vs_sim.cosine, vs_sim.rel_l1, vs_exact.cosine, sim_exact.cosine);
  EXPECT_EQ(vs_sim.nonfinite, 0) << c.describe();
  EXPECT_GE(vs_sim.cosine, b.sim_cosine) << c.describe();
  EXPECT_LE(vs_sim.rel_l1, b.sim_rel_l1) << c.describe();
  if (1 - sim_exact.cosine <= 1e-2)
    EXPECT_GE(vs_exact.cosine, sim_exact.cosine - (1 - b.sim_cosine)) << c.describe();
  // The LSE: -inf exactly where the simulator's is; elsewhere the harness's quantized-row-sum
  // rule (a P code flip moves a row by at most log(1 + 1/8), one row in a thousand beyond 1e-3).
  int64_t rows = 0, beyond = 0;
  double worst = 0;
  for (int64_t h = 0; h < c.heads_q; ++h)
    for (int64_t t = 0; t < p.total_q; ++t) {
      const size_t at = size_t(h * p.lse_tok + t);
      const float x = got.lse[at], want = ref.sim_lse[at];
      ++rows;
      if (std::isinf(want)) {
        EXPECT_EQ(x, want) << c.describe() << ": LSE head " << h << " token " << t;
        continue;
      }
      const double diff = std::fabs(double(x) - double(want));
      if (!(diff <= b.lse_sim)) ++beyond;
      worst = std::max(worst, std::isnan(diff) ? 1e30 : diff);
    }
  EXPECT_LE(beyond, std::max<int64_t>(1, rows / 1000)) << c.describe();
  EXPECT_LE(worst, std::log1p(0.125)) << c.describe();
}

void run_and_check(const VarlenCase& c) {
  std::vector<Sequence> seqs;
  for (size_t i = 0; i < c.lengths.size(); ++i)
    seqs.push_back(make_sequence(c, c.lengths[i].first, c.lengths[i].second, c.seed * 1000 + i));
  Packed p = pack(c, seqs);
  Result got;
  try {
    got = run_gpu(c, p);
  } catch (const std::exception& e) {
    ADD_FAILURE() << c.describe() << ": the GPU path threw: " << e.what();
    return;
  }
  expect_varlen_within_bounds(c, p, got, run_references(c, p));
}

// Recipes the packed path takes: floating inputs, with a kernel at the head dim.
std::vector<std::string> varlen_recipes(int64_t head_dim) {
  std::vector<std::string> out;
  for (const std::string& r : gpu_presets())
    if (preset(r).inputs == Inputs::floating && gpu_has_kernel(r, head_dim)) out.push_back(r);
  return out;
}

const std::vector<std::pair<int64_t, int64_t>> kEdgeLengths = {
    {0, 5}, {1, 1}, {3, 0}, {1, 70}, {33, 130}, {97, 20}, {0, 0}, {129, 129}, {255, 257}, {64, 1}};

TEST(Sm90Varlen, EdgeLengthsEveryHeadDim) {
  SAGE_REQUIRE_GPU();
  for (int64_t d : harness_head_dims())
    for (DType t : {DType::f16, DType::bf16})
      for (bool causal : {false, true}) {
        VarlenCase c;
        c.lengths = kEdgeLengths;
        c.head_dim = d, c.dtype = t, c.causal = causal;
        c.seed = uint64_t(d) * 4 + (t == DType::bf16) * 2 + causal;
        run_and_check(c);
      }
}

TEST(Sm90Varlen, EveryRecipe) {
  SAGE_REQUIRE_GPU();
  for (int64_t d : {int64_t(64), int64_t(128)})
    for (const std::string& r : varlen_recipes(d)) {
      VarlenCase c;
      c.lengths = {{77, 90}, {150, 211}, {1, 1}, {0, 9}, {200, 64}};
      c.head_dim = d, c.recipe = r, c.causal = true;
      run_and_check(c);
    }
}

TEST(Sm90Varlen, WindowsGqaStridesAndLooseBounds) {
  SAGE_REQUIRE_GPU();
  struct W {
    bool causal;
    int64_t left, right;
  };
  for (const W w : {W{true, 16, -1}, W{false, 32, 8}, W{false, -1, 4}, W{false, 200, 0}, W{true, 0, -1}})
    for (const auto& [hq, hkv] : {std::pair<int64_t, int64_t>{8, 2}, {4, 1}, {2, 2}}) {
      VarlenCase c;
      c.lengths = {{300, 300}, {5, 40}, {129, 64}, {0, 3}, {1, 1}, {250, 511}};
      c.heads_q = hq, c.heads_kv = hkv;
      c.causal = w.causal, c.window_left = w.left, c.window_right = w.right;
      c.strided = hq == 8;
      c.extra_max = hq == 4 ? 1000 : 0;  // max_seqlen far above the longest
      c.seed = uint64_t(hq * 100 + w.left + 7);
      run_and_check(c);
    }
}

// The no-leak proof: one sequence packed alone and among different neighbours (other
// positions, batch sizes, max_seqlen, strides) gives the same output and LSE bits.
TEST(Sm90Varlen, NeighbourIndependenceIsBitExact) {
  SAGE_REQUIRE_GPU();
  for (const std::string recipe : {"sage2_8b", "sage2_8b_balanced", "sage2_4b", "sage1_t"})
    for (DType t : {DType::f16, DType::bf16})
      for (bool causal : {false, true}) {
        VarlenCase base;
        base.recipe = recipe, base.dtype = t, base.causal = causal;
        if (!gpu_has_kernel(recipe, base.head_dim)) continue;
        const Sequence target = make_sequence(base, 150, 211, 1);
        const std::vector<std::vector<Sequence>> contexts = {
            {target},
            {make_sequence(base, 77, 90, 2), target, make_sequence(base, 200, 64, 3)},
            {make_sequence(base, 0, 40, 4), make_sequence(base, 129, 3000, 5), make_sequence(base, 1, 1, 6), target},
            {make_sequence(base, 700, 9, 7), target, make_sequence(base, 3, 0, 8)}};
        const std::vector<size_t> at = {0, 1, 3, 1};
        std::vector<uint16_t> want_out;
        std::vector<float> want_lse;
        for (size_t ci = 0; ci < contexts.size(); ++ci) {
          VarlenCase c = base;
          c.strided = ci == 2;
          c.extra_max = ci == 3 ? 300 : 0;
          const Packed p = pack(c, contexts[ci]);
          const Result r = run_gpu(c, p);
          std::vector<uint16_t> out;
          std::vector<float> lse;
          const int64_t first = p.cu_q[at[ci]], row = c.heads_q * c.head_dim;
          for (int64_t tok = 0; tok < target.n_q; ++tok)
            for (int64_t i = 0; i < row; ++i) out.push_back(r.out[size_t((first + tok) * p.q_tok + i)]);
          for (int64_t h = 0; h < c.heads_q; ++h)
            for (int64_t tok = 0; tok < target.n_q; ++tok) lse.push_back(r.lse[size_t(h * p.lse_tok + first + tok)]);
          if (ci == 0) {
            want_out = out, want_lse = lse;
            continue;
          }
          EXPECT_EQ(out, want_out) << recipe << (causal ? " causal" : "") << ": context " << ci;
          EXPECT_EQ(0, std::memcmp(lse.data(), want_lse.data(), lse.size() * sizeof(float)))
              << recipe << (causal ? " causal" : "") << ": context " << ci << " LSE";
        }
      }
}

// CUDA-graph capture: the call reads the offsets only on the device, so a captured graph
// replays with new offsets written into the same buffers (same batch and totals, within
// max_seqlen) and gives what a direct call with those offsets gives.
TEST(Sm90Varlen, GraphReplayTakesNewOffsets) {
  SAGE_REQUIRE_GPU();
  VarlenCase c;
  c.lengths = {{100, 120}, {60, 80}, {40, 0}};
  c.causal = true;
  c.extra_max = 64;
  std::vector<Sequence> seqs;
  for (size_t i = 0; i < c.lengths.size(); ++i)
    seqs.push_back(make_sequence(c, c.lengths[i].first, c.lengths[i].second, 40 + i));
  const Packed p = pack(c, seqs);
  DeviceCall call(c, p);
  call.run();  // once outside the capture (the launch's one-time attribute setting)
  device_sync("attention_varlen");
  cudaStream_t stream;
  check_cuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  check_cuda(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), "begin capture");
  call.run(stream);
  check_cuda(cudaStreamEndCapture(stream, &graph), "end capture");
  check_cuda(cudaGraphInstantiate(&exec, graph, 0), "instantiate");
  // Other offsets over the same tokens: (130, 50), (10, 150), (60, 0).
  Packed moved = p;
  moved.cu_q = {0, 130, 140, 200};
  moved.cu_k = {0, 50, 200, 200};
  call.cu_q.upload(moved.cu_q), call.cu_k.upload(moved.cu_k);
  check_cuda(cudaGraphLaunch(exec, stream), "graph launch");
  check_cuda(cudaStreamSynchronize(stream), "graph sync");
  const Result replayed = call.result();
  const Result direct = run_gpu(c, moved);
  EXPECT_EQ(replayed.out, direct.out);
  EXPECT_EQ(0, std::memcmp(replayed.lse.data(), direct.lse.data(), direct.lse.size() * sizeof(float)));
  expect_varlen_within_bounds(c, moved, replayed, run_references(c, moved));
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

TEST(Sm90Varlen, RefusalsNameTheArgument) {
  SAGE_REQUIRE_GPU();
  VarlenCase c;
  c.lengths = {{10, 12}, {5, 7}};
  std::vector<Sequence> seqs = {make_sequence(c, 10, 12, 1), make_sequence(c, 5, 7, 2)};
  const Packed p = pack(c, seqs);
  DeviceCall call(c, p);
  auto expect_error = [&](const VarlenArgs& a, void* ws, size_t bytes, const char* arg) {
    try {
      attention_varlen(a, ws, bytes, nullptr);
      ADD_FAILURE() << "accepted; expected an error naming " << arg;
    } catch (const Error& e) {
      EXPECT_EQ(e.argument(), arg) << e.what();
    }
  };
  expect_error(call.args, call.ws->ptr, varlen_workspace_bytes(call.args) - 1, "workspace_size");
  VarlenArgs a = call.args;
  a.cu_seqlens_q.device = Device::cpu();
  expect_error(a, call.ws->ptr, call.ws->bytes, "cu_seqlens_q");
  a = call.args;
  a.recipe = preset("int_flash");
  expect_error(a, call.ws->ptr, call.ws->bytes, "recipe.inputs");
  a = call.args;
  a.max_seqlen_k = -3;
  expect_error(a, call.ws->ptr, call.ws->bytes, "max_seqlen_k");
}

// Randomized packings: batch 1-9, lengths with many 0s, 1s and odd values, GQA/MQA, windows,
// strides, dtypes, head dims of the build and recipes.
TEST(Sm90Varlen, Randomized) {
  SAGE_REQUIRE_GPU();
  const char* env = std::getenv("SAGE_VARLEN_RANDOM_CASES");
  const int cases = env ? std::atoi(env) : 120;
  const std::vector<int64_t> dims = gpu_head_dim_list();
  reference::Rng rng(20261127);
  auto pick = [&](int64_t n) { return int64_t(rng.next() % uint64_t(n)); };
  auto length = [&]() -> int64_t {
    switch (pick(6)) {
      case 0: return 0;
      case 1: return 1;
      case 2: return 2 * pick(40) + 1;
      case 3: return 128 * (1 + pick(3)) + pick(3) - 1;
      default: return pick(400);
    }
  };
  int run = 0;
  for (int i = 0; i < cases; ++i) {
    VarlenCase c;
    c.seed = 5000 + uint64_t(i);
    c.head_dim = dims[size_t(pick(int64_t(dims.size())))];
    const std::vector<std::string> recipes = varlen_recipes(c.head_dim);
    if (recipes.empty()) continue;
    c.recipe = pick(3) == 0 ? recipes[size_t(pick(int64_t(recipes.size())))] : "sage2_8b";
    const int64_t groups[][2] = {{1, 1}, {2, 2}, {4, 2}, {8, 1}, {6, 3}};
    const auto& gsel = groups[pick(5)];
    c.heads_q = gsel[0], c.heads_kv = gsel[1];
    c.dtype = pick(2) ? DType::bf16 : DType::f16;
    c.causal = pick(2) == 0;
    if (pick(3) == 0) c.window_left = pick(300);
    if (!c.causal && pick(4) == 0) c.window_right = pick(50);
    c.strided = pick(4) == 0;
    c.extra_max = pick(5) == 0 ? pick(500) : 0;
    const int64_t batch = 1 + pick(9);
    for (int64_t b = 0; b < batch; ++b) c.lengths.emplace_back(length(), length());
    run_and_check(c);
    ++run;
  }
  std::printf("[varlen] %d randomized cases\n", run);
}

#endif  // SAGE_WITH_CUDA

}  // namespace
}  // namespace sage::testing
