// GPU tests of the SageBwd backward (sage::attention_backward, sm_90a): the kernels against the
// simulator (reference::simulate_backward, the bit-level contract of docs/numerics.md, "The
// backward") and against float64 gradients (reference::exact_backward), on fixed shapes and on
// 300 randomized seeded cases (shapes, odd and tiny lengths, causal, GQA/MQA, fp16/bf16, HND and
// NHD, strided views, distributions, dS per token or per tile, a quarter in deterministic mode).
// Both dS granularities have a kernel each: sagebwd (per token) and sagebwd_block (per tile) run
// every fixed case. Deterministic mode also repeats its bits call after call. Skipped, visibly,
// without an sm_90 GPU.
//
// Bounds (docs/numerics.md, "GPU against the simulator (backward)": the kernel differs from the
// simulator only in the order of float additions, fp32 sums of its 16-bit MMA where the contract
// sums in double, and exp2f's last bits):
//   - dQ, dK, dV against the simulator: cosine >= 0.99999, no NaN or infinity, every element
//     written;
//   - against float64: 1 - cos no worse than the simulator's own 1 - cos (the recipe's error on
//     these inputs) times 1.02, plus 1e-5 (the kernel-vs-simulator allowance), where the
//     recipe's error is below 1e-2 (the harness's additive rule for the forward);
//   - the forward's out and LSE (when asked for): the forward tests' bounds.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "gpu_harness.h"
#include "numerics/formats.h"
#include "reference/metrics.h"
#include "reference/synthetic.h"
#include "sage/backward.h"
#include "sage/error.h"
#include "sage/recipe.h"

#ifdef SAGE_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace sage::testing {
namespace {

struct BwdCase {
  std::string recipe = "sagebwd";  // or sagebwd_block: dS per token or per tile
  int64_t batch = 1, heads_q = 2, heads_kv = 2, n_q = 256, n_kv = 256, head_dim = 128;
  bool causal = false;
  DType dtype = DType::f16;
  Layout layout = Layout::HND;
  bool strided = false;  // padded strides and a storage offset on every view
  bool with_out_lse = true;
  // The training step's path: attention_for_training (out, lse and L2), then the backward with
  // BackwardArgs::lse2, which does not re-run the forward. Needs with_out_lse.
  bool saved_forward = false;
  bool deterministic = false;  // BackwardArgs::deterministic
  std::string distribution = "normal";
  uint64_t seed = 0;
  std::string describe() const {
    char buf[256];
    std::snprintf(buf, sizeof buf, "%s b%lld hq%lld hkv%lld nq%lld nkv%lld d%lld %s %s %s%s%s%s %s seed %llu",
                  recipe.c_str(), (long long)batch, (long long)heads_q, (long long)heads_kv, (long long)n_q,
                  (long long)n_kv, (long long)head_dim, causal ? "causal" : "full",
                  dtype == DType::bf16 ? "bf16" : "f16", layout == Layout::HND ? "HND" : "NHD",
                  strided ? " strided" : "", with_out_lse ? (saved_forward ? " saved-fwd" : "") : " no-out",
                  deterministic ? " deterministic" : "", distribution.c_str(),
                  (unsigned long long)seed);
    return buf;
  }
};

// A [batch, heads, n, d] tensor stored in a layout, possibly with padded strides and an offset.
struct Stored {
  int64_t b = 0, h = 0, n = 0, d = 0;
  Layout layout = Layout::HND;
  int64_t offset = 0, sb = 0, sh = 0, sn = 0;
  std::vector<uint16_t> bits;  // 16-bit storage (fp16 or bf16)

  Stored(int64_t b_, int64_t h_, int64_t n_, int64_t d_, Layout l, bool strided)
      : b(b_), h(h_), n(n_), d(d_), layout(l) {
    const int64_t pad = strided ? 8 : 0;  // multiples of 8 elements: the GPU's row alignment
    offset = strided ? 8 : 0;
    const int64_t row = d + pad;
    if (l == Layout::HND) {
      sn = row, sh = n * row + pad, sb = h * sh + pad;
    } else {
      sh = row, sn = h * row + pad, sb = n * sn + pad;
    }
    sh = (sh + 7) / 8 * 8, sn = (sn + 7) / 8 * 8, sb = (sb + 7) / 8 * 8;
    const int64_t span = offset + (b - 1) * sb + (h - 1) * sh + (n - 1) * sn + d;
    bits.assign(size_t(std::max<int64_t>(span, 8)), 0xFFFF);  // NaN in fp16 and bf16
  }
  int64_t at(int64_t bi, int64_t hi, int64_t ni, int64_t c) const {
    return offset + bi * sb + hi * sh + ni * sn + c;
  }
  TensorView view(void* base, DType t, Device dev) const {
    void* p = static_cast<uint16_t*>(base) + offset;
    if (layout == Layout::HND) return strided_view(p, t, {b, h, n, d}, {sb, sh, sn, 1}, dev);
    return strided_view(p, t, {b, n, h, d}, {sb, sn, sh, 1}, dev);
  }
  // Logical HND-ordered values as floats.
  std::vector<float> values(DType t) const {
    std::vector<float> out(size_t(b * h * n * d));
    size_t e = 0;
    for (int64_t bi = 0; bi < b; ++bi)
      for (int64_t hi = 0; hi < h; ++hi)
        for (int64_t ni = 0; ni < n; ++ni)
          for (int64_t c = 0; c < d; ++c) {
            const uint16_t x = bits[size_t(at(bi, hi, ni, c))];
            out[e++] = t == DType::bf16 ? fmt::bf16_from_bits(x) : fmt::fp16_from_bits(x);
          }
    return out;
  }
  void fill(const std::vector<float>& hnd, DType t) {
    size_t e = 0;
    for (int64_t bi = 0; bi < b; ++bi)
      for (int64_t hi = 0; hi < h; ++hi)
        for (int64_t ni = 0; ni < n; ++ni)
          for (int64_t c = 0; c < d; ++c) {
            const float x = hnd[e++];
            bits[size_t(at(bi, hi, ni, c))] = t == DType::bf16 ? fmt::bf16_bits(x) : fmt::fp16_bits(x);
          }
  }
};

// A dense f32 array in a layout, for the references' gradients.
struct DenseF32 {
  int64_t b, h, n, d;
  Layout layout;
  std::vector<float> data;
  DenseF32(int64_t b_, int64_t h_, int64_t n_, int64_t d_, Layout l)
      : b(b_), h(h_), n(n_), d(d_), layout(l), data(size_t(std::max<int64_t>(1, b_ * h_ * n_ * d_))) {}
  TensorView view() {
    if (layout == Layout::HND) return contiguous_view(data.data(), DType::f32, {b, h, n, d});
    return contiguous_view(data.data(), DType::f32, {b, n, h, d});
  }
  std::vector<float> hnd() const {
    std::vector<float> out(size_t(b * h * n * d));
    size_t e = 0;
    for (int64_t bi = 0; bi < b; ++bi)
      for (int64_t hi = 0; hi < h; ++hi)
        for (int64_t ni = 0; ni < n; ++ni)
          for (int64_t c = 0; c < d; ++c) {
            const int64_t i = layout == Layout::HND ? ((bi * h + hi) * n + ni) * d + c
                                                    : ((bi * n + ni) * h + hi) * d + c;
            out[e++] = data[size_t(i)];
          }
    return out;
  }
};

struct Inputs {
  Stored q, k, v, dout;
};

// Synthetic fp16 values (HND), rounded to bf16 for bf16 cases.
Inputs make_inputs(const BwdCase& c) {
  reference::SyntheticShape s;
  s.batch = c.batch, s.heads_q = c.heads_q, s.heads_kv = c.heads_kv, s.n_q = c.n_q, s.n_kv = c.n_kv;
  s.head_dim = c.head_dim;
  const reference::SyntheticInputs in = reference::make_synthetic(c.distribution, s, c.seed);
  const std::vector<uint16_t> dout = reference::synthetic_output_gradient(s, c.seed + 7);
  auto floats = [](const std::vector<uint16_t>& h) {
    std::vector<float> f(h.size());
    for (size_t i = 0; i < h.size(); ++i) f[i] = fmt::fp16_from_bits(h[i]);
    return f;
  };
  Inputs x{Stored(c.batch, c.heads_q, c.n_q, c.head_dim, c.layout, c.strided),
           Stored(c.batch, c.heads_kv, c.n_kv, c.head_dim, c.layout, c.strided),
           Stored(c.batch, c.heads_kv, c.n_kv, c.head_dim, c.layout, c.strided),
           Stored(c.batch, c.heads_q, c.n_q, c.head_dim, c.layout, c.strided)};
  x.q.fill(floats(in.q), c.dtype);
  x.k.fill(floats(in.k), c.dtype);
  x.v.fill(floats(in.v), c.dtype);
  x.dout.fill(floats(dout), c.dtype);
  return x;
}

struct Reference {
  std::vector<float> dq, dk, dv, out, lse;
};

Reference run_reference(const BwdCase& c, Inputs& x, void (*fn)(const BackwardArgs&)) {
  DenseF32 dq(c.batch, c.heads_q, c.n_q, c.head_dim, c.layout);
  DenseF32 dk(c.batch, c.heads_kv, c.n_kv, c.head_dim, c.layout);
  DenseF32 dv(c.batch, c.heads_kv, c.n_kv, c.head_dim, c.layout);
  DenseF32 out(c.batch, c.heads_q, c.n_q, c.head_dim, c.layout);
  std::vector<float> lse(size_t(std::max<int64_t>(1, c.batch * c.heads_q * c.n_q)));
  BackwardArgs a;
  a.q = x.q.view(x.q.bits.data(), c.dtype, Device::cpu());
  a.k = x.k.view(x.k.bits.data(), c.dtype, Device::cpu());
  a.v = x.v.view(x.v.bits.data(), c.dtype, Device::cpu());
  a.dout = x.dout.view(x.dout.bits.data(), c.dtype, Device::cpu());
  a.dq = dq.view(), a.dk = dk.view(), a.dv = dv.view(), a.out = out.view();
  a.lse = contiguous_view(lse.data(), DType::f32, {c.batch, c.heads_q, c.n_q});
  a.layout = c.layout;
  a.causal = c.causal;
  a.recipe = preset(c.recipe);
  fn(a);
  Reference r{dq.hnd(), dk.hnd(), dv.hnd(), out.hnd(), lse};
  r.lse.resize(size_t(c.batch * c.heads_q * c.n_q));
  return r;
}

struct Kernel {
  std::vector<float> dq, dk, dv, out, lse;
};

#ifdef SAGE_WITH_CUDA
void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

struct DeviceCopy {
  void* ptr = nullptr;
  explicit DeviceCopy(const Stored& s) {
    check(cudaMalloc(&ptr, s.bits.size() * 2), "cudaMalloc");
    check(cudaMemcpy(ptr, s.bits.data(), s.bits.size() * 2, cudaMemcpyHostToDevice), "cudaMemcpy");
  }
  DeviceCopy(const DeviceCopy&) = delete;
  ~DeviceCopy() { cudaFree(ptr); }
  void download(Stored& s) const {
    check(cudaMemcpy(s.bits.data(), ptr, s.bits.size() * 2, cudaMemcpyDeviceToHost), "cudaMemcpy");
  }
};

Kernel run_kernel(const BwdCase& c, Inputs& x) {
  const Device gpu = Device::cuda(0);
  // Outputs start as NaN (the Stored constructor's poison), so an element left unwritten shows.
  Stored dq(c.batch, c.heads_q, c.n_q, c.head_dim, c.layout, c.strided);
  Stored dk(c.batch, c.heads_kv, c.n_kv, c.head_dim, c.layout, c.strided);
  Stored dv(c.batch, c.heads_kv, c.n_kv, c.head_dim, c.layout, c.strided);
  Stored out(c.batch, c.heads_q, c.n_q, c.head_dim, c.layout, c.strided);
  DeviceCopy q_d(x.q), k_d(x.k), v_d(x.v), do_d(x.dout), dq_d(dq), dk_d(dk), dv_d(dv), out_d(out);
  const size_t lse_n = size_t(std::max<int64_t>(1, c.batch * c.heads_q * c.n_q));
  std::vector<float> lse(lse_n, NAN);
  float* lse_d = nullptr;
  check(cudaMalloc(&lse_d, lse_n * 4), "cudaMalloc lse");
  check(cudaMemcpy(lse_d, lse.data(), lse_n * 4, cudaMemcpyHostToDevice), "cudaMemcpy lse");
  BackwardArgs a;
  a.q = x.q.view(q_d.ptr, c.dtype, gpu);
  a.k = x.k.view(k_d.ptr, c.dtype, gpu);
  a.v = x.v.view(v_d.ptr, c.dtype, gpu);
  a.dout = x.dout.view(do_d.ptr, c.dtype, gpu);
  a.dq = dq.view(dq_d.ptr, c.dtype, gpu);
  a.dk = dk.view(dk_d.ptr, c.dtype, gpu);
  a.dv = dv.view(dv_d.ptr, c.dtype, gpu);
  if (c.with_out_lse) {
    a.out = out.view(out_d.ptr, c.dtype, gpu);
    a.lse = contiguous_view(lse_d, DType::f32, {c.batch, c.heads_q, c.n_q}, gpu);
  }
  a.layout = c.layout;
  a.causal = c.causal;
  a.recipe = preset(c.recipe);
  a.deterministic = c.deterministic;
  float* lse2_d = nullptr;
  if (c.saved_forward) {
    check(cudaMalloc(&lse2_d, lse_n * 4), "cudaMalloc lse2");
    AttentionArgs f = forward_args(a);
    f.out = a.out, f.lse = a.lse;
    const TensorView lse2 = contiguous_view(lse2_d, DType::f32, {c.batch, c.heads_q, c.n_q}, gpu);
    const size_t fwd_bytes = workspace_bytes(f);
    DeviceWorkspace fwd_ws(fwd_bytes);
    attention_for_training(f, lse2, fwd_ws.get(), fwd_bytes, nullptr);
    device_sync("attention_for_training");
    a.lse = TensorView{};
    a.lse2 = lse2;
  }
  const size_t bytes = backward_workspace_bytes(a);
  DeviceWorkspace ws(bytes);
  attention_backward(a, ws.get(), bytes, nullptr);
  device_sync("attention_backward");
  if (lse2_d) cudaFree(lse2_d);
  dq_d.download(dq), dk_d.download(dk), dv_d.download(dv), out_d.download(out);
  check(cudaMemcpy(lse.data(), lse_d, lse_n * 4, cudaMemcpyDeviceToHost), "cudaMemcpy lse");
  cudaFree(lse_d);
  Kernel k{dq.values(c.dtype), dk.values(c.dtype), dv.values(c.dtype), {}, {}};
  if (c.with_out_lse) {
    k.out = out.values(c.dtype);
    k.lse = lse;
    k.lse.resize(size_t(c.batch * c.heads_q * c.n_q));
  }
  return k;
}
#else
Kernel run_kernel(const BwdCase&, Inputs&) { throw std::logic_error("no CUDA in this build"); }
#endif

// Where a gradient differs most from the simulator's, in words (batch, head, token, channel and
// the token's 64-row Q tile or 128-key K/V tile), to localize a failure to a stage.
std::string worst_element(const BwdCase& c, const std::string& name, const std::vector<float>& got,
                          const std::vector<float>& sim) {
  size_t at = 0;
  double worst = -1;
  for (size_t i = 0; i < got.size(); ++i) {
    const double e = std::isfinite(got[i]) ? std::fabs(double(got[i]) - sim[i]) : INFINITY;
    if (e > worst) worst = e, at = i;
  }
  if (got.empty()) return "empty";
  const bool q_side = name == "dq";
  const int64_t n = q_side ? c.n_q : c.n_kv, heads = q_side ? c.heads_q : c.heads_kv;
  const int64_t ch = int64_t(at) % c.head_dim, row = int64_t(at) / c.head_dim;
  const int64_t tok = row % n, h = (row / n) % heads, b = row / n / heads;
  char buf[200];
  std::snprintf(buf, sizeof buf, "worst at b %lld h %lld %s %lld (tile %lld) channel %lld: kernel %g, simulator %g",
                (long long)b, (long long)h, q_side ? "row" : "key", (long long)tok,
                (long long)(tok / (q_side ? 64 : 128)), (long long)ch, double(got[at]), double(sim[at]));
  return buf;
}

int64_t nonfinite(const std::vector<float>& x) {
  return std::count_if(x.begin(), x.end(), [](float v) { return !std::isfinite(v); });
}

// The whole check of one case; returns false (with gtest failures recorded) on any miss.
void expect_case(const BwdCase& c) {
  SCOPED_TRACE(c.describe());
  Inputs x = make_inputs(c);
  const Kernel k = run_kernel(c, x);
  // The simulator's gradients and output rounded once to the views' dtype, as the kernel
  // stores them (docs/numerics.md, step 10; the references write f32 here).
  Reference sim = run_reference(c, x, &reference::simulate_backward);
  for (std::vector<float>* t : {&sim.dq, &sim.dk, &sim.dv, &sim.out})
    for (float& v : *t) v = c.dtype == DType::bf16 ? fmt::round_bf16(v) : fmt::round_fp16(v);
  const Reference ex = run_reference(c, x, &reference::exact_backward);
  const struct {
    const char* name;
    const std::vector<float>& got;
    const std::vector<float>& sim;
    const std::vector<float>& exact;
  } grads[] = {{"dq", k.dq, sim.dq, ex.dq}, {"dk", k.dk, sim.dk, ex.dk}, {"dv", k.dv, sim.dv, ex.dv}};
  std::string line;
  for (const auto& g : grads) {
    if (g.got.empty()) continue;
    const int64_t n = int64_t(g.got.size());
    EXPECT_EQ(nonfinite(g.got), 0) << g.name << ": NaN, infinity or an unwritten element";
    const reference::ErrorStats vs_sim = reference::compare(g.got.data(), g.sim.data(), n);
    const reference::ErrorStats vs_exact = reference::compare(g.got.data(), g.exact.data(), n);
    const reference::ErrorStats sim_exact = reference::compare(g.sim.data(), g.exact.data(), n);
    // All-zero gradients (no key seen anywhere) compare as equal: cosine 1 both ways.
    EXPECT_GE(vs_sim.cosine, 0.99999) << g.name << " against the simulator; "
                                      << worst_element(c, g.name, g.got, g.sim);
    const double recipe_err = 1 - sim_exact.cosine;
    if (recipe_err < 1e-2)
      EXPECT_LE(1 - vs_exact.cosine, 1.02 * recipe_err + 1e-5) << g.name << " against float64";
    char buf[200];
    std::snprintf(buf, sizeof buf, " | %s sim cos %.7f l1 %.1e, exact 1-cos %.2e (sim %.2e)", g.name,
                  vs_sim.cosine, vs_sim.rel_l1, 1 - vs_exact.cosine, recipe_err);
    line += buf;
  }
  if (c.with_out_lse && !k.out.empty()) {
    const int64_t n = int64_t(k.out.size());
    const reference::ErrorStats o = reference::compare(k.out.data(), sim.out.data(), n);
    EXPECT_GE(o.cosine, 0.99999) << "forward out against the simulator";
    EXPECT_EQ(nonfinite(k.out), 0) << "forward out";
    double lse_max = 0;
    for (size_t i = 0; i < k.lse.size(); ++i) {
      if (std::isinf(sim.lse[i]) && k.lse[i] == sim.lse[i]) continue;
      lse_max = std::max(lse_max, double(std::fabs(k.lse[i] - sim.lse[i])));
    }
    EXPECT_LE(lse_max, 1e-3) << "forward LSE against the simulator";
  }
  std::printf("[backward] %s%s\n", c.describe().c_str(), line.c_str());
}

std::vector<BwdCase> fixed_cases() {
  std::vector<BwdCase> v;
  for (int64_t d : {64, 128})
    for (bool causal : {false, true})
      for (DType t : {DType::f16, DType::bf16}) {
        BwdCase c;
        c.head_dim = d, c.causal = causal, c.dtype = t;
        v.push_back(c);  // 256 x 256
        c.n_q = 200, c.n_kv = 333;  // partial tiles, n_q < n_kv (bottom-right causal)
        v.push_back(c);
        c.n_q = 333, c.n_kv = 200;
        v.push_back(c);
      }
  for (int64_t d : {64, 128}) {
    BwdCase c;
    c.head_dim = d, c.heads_q = 4, c.heads_kv = 2;  // GQA
    v.push_back(c);
    c.heads_kv = 1, c.causal = true, c.layout = Layout::NHD;  // MQA
    v.push_back(c);
    c.strided = true, c.dtype = DType::bf16, c.with_out_lse = false;
    v.push_back(c);
    c.with_out_lse = true, c.saved_forward = true;  // the backward on the saved out and L2
    v.push_back(c);
  }
  // The wgmma kernel's Q-tile ring (kStages stages) wraps many times and its barrier phases
  // flip: 16 and 17 Q tiles per CTA, causal CTAs that skip leading tiles, several K/V tiles.
  for (int64_t d : {64, 128})
    for (bool causal : {false, true}) {
      BwdCase c;
      c.head_dim = d, c.causal = causal, c.n_q = 1024, c.n_kv = 1024;
      c.dtype = causal ? DType::bf16 : DType::f16;
      v.push_back(c);
      c.n_q = 1088, c.n_kv = 700, c.batch = 2, c.heads_q = 2, c.heads_kv = 1;  // GQA, n_q > n_kv
      v.push_back(c);
    }
  return v;
}

void run_fixed(const std::string& recipe) {
  for (BwdCase c : fixed_cases()) {
    c.recipe = recipe;
    expect_case(c);
  }
}
TEST(Sm90Backward, FixedShapesMatchTheSimulatorAndExactGradients) { SAGE_REQUIRE_GPU(); run_fixed("sagebwd"); }
TEST(Sm90Backward, FixedShapesDsPerTileMatchTheSimulatorAndExactGradients) {
  SAGE_REQUIRE_GPU();
  run_fixed("sagebwd_block");
}

// (memcmp is not given an empty vector's data(), which may be null: undefined behaviour.)
bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

// Deterministic mode: the bounds of expect_case, the same bits on every call, and against the
// default mode the same additions in another order: dK and dV without GQA (one addition per
// element either way) bit for bit, dQ within a rounding of each fp32 sum.
void expect_deterministic(BwdCase c) {
  c.deterministic = true;
  expect_case(c);
  SCOPED_TRACE(c.describe());
  Inputs x = make_inputs(c);
  const Kernel first = run_kernel(c, x);
  for (int call = 2; call <= 4; ++call) {
    const Kernel again = run_kernel(c, x);
    EXPECT_TRUE(same_bits(again.dq, first.dq)) << "dq differs on call " << call;
    EXPECT_TRUE(same_bits(again.dk, first.dk)) << "dk differs on call " << call;
    EXPECT_TRUE(same_bits(again.dv, first.dv)) << "dv differs on call " << call;
  }
  BwdCase fast = c;
  fast.deterministic = false;
  const Kernel k = run_kernel(fast, x);
  if (c.heads_q == c.heads_kv) {
    EXPECT_TRUE(same_bits(k.dk, first.dk)) << "dk: the default mode's bits";
    EXPECT_TRUE(same_bits(k.dv, first.dv)) << "dv: the default mode's bits";
  }
  const int64_t n = int64_t(first.dq.size());
  EXPECT_GE(reference::compare(first.dq.data(), k.dq.data(), n).cosine, 0.999999) << "dq against the default mode";
}

// Many K/V tiles add into each Q tile's dQ (n_kv = 1024: 8 of them; 16 Q tiles per K/V tile), so
// their order shows; GQA's group of 4 adds into each dK and dV.
TEST(Sm90Backward, DeterministicModeRepeatsItsBits) {
  SAGE_REQUIRE_GPU();
  for (int64_t d : {64, 128})
    for (bool causal : {false, true})
      for (int64_t group : {1, 4}) {
        BwdCase c;
        c.head_dim = d, c.causal = causal, c.n_q = 1024, c.n_kv = 1024;
        c.heads_kv = group == 1 ? 2 : 1, c.heads_q = c.heads_kv * group;
        c.dtype = d == 64 ? DType::f16 : DType::bf16;
        expect_deterministic(c);
      }
  // Causal with n_q < n_kv (the first K/V tiles all start at Q tile 0) and n_q > n_kv (rows that
  // see no key), partial tiles, GQA, dS per tile, NHD and the saved forward.
  BwdCase c;
  c.n_q = 700, c.n_kv = 1088, c.causal = true, c.heads_q = 4, c.heads_kv = 2, c.recipe = "sagebwd_block";
  expect_deterministic(c);
  c.n_q = 1088, c.n_kv = 700, c.layout = Layout::NHD, c.saved_forward = true;
  expect_deterministic(c);
}

// Every synthetic distribution at one shape (K bias exercises K smoothing's invariance), with
// dS per token and per tile.
TEST(Sm90Backward, Distributions) {
  SAGE_REQUIRE_GPU();
  for (const char* recipe : {"sagebwd", "sagebwd_block"})
    for (const std::string& dist : reference::synthetic_distributions()) {
      BwdCase c;
      c.recipe = recipe, c.distribution = dist, c.n_q = 192, c.n_kv = 320, c.causal = true;
      expect_case(c);
    }
}

// Randomized seeded cases: shapes (odd and tiny lengths), causal, GQA/MQA, dtypes, layouts,
// strides, distributions, dS granularities. 300 in all, in three tests so that a failure names
// its third.
BwdCase random_case(uint64_t seed) {
  reference::Rng rng(0x5A6EB3D + seed * 7919);
  auto pick = [&](std::initializer_list<int64_t> xs) {
    const int64_t i = int64_t(rng.uniform() * double(xs.size()));
    return *(xs.begin() + std::min<int64_t>(i, int64_t(xs.size()) - 1));
  };
  BwdCase c;
  c.seed = seed;
  c.head_dim = pick({64, 128});
  c.batch = pick({1, 1, 2});
  c.heads_kv = pick({1, 2});
  c.heads_q = c.heads_kv * pick({1, 1, 2, 3, 4});
  const std::initializer_list<int64_t> lengths = {1, 2, 7, 31, 63, 64, 65, 100, 127, 128, 129, 191, 192, 193, 255, 257, 320};
  c.n_q = pick(lengths);
  c.n_kv = pick(lengths);
  c.causal = rng.uniform() < 0.5;
  c.dtype = rng.uniform() < 0.5 ? DType::f16 : DType::bf16;
  c.layout = rng.uniform() < 0.5 ? Layout::HND : Layout::NHD;
  c.strided = rng.uniform() < 0.4;
  c.with_out_lse = rng.uniform() < 0.7;
  c.saved_forward = c.with_out_lse && seed % 3 == 1;  // not from rng: the other draws stay
  c.deterministic = seed % 4 == 2;
  const std::vector<std::string>& dists = reference::synthetic_distributions();
  c.distribution = rng.uniform() < 0.6 ? "normal" : dists[size_t(rng.uniform() * dists.size()) % dists.size()];
  c.recipe = rng.uniform() < 0.5 ? "sagebwd" : "sagebwd_block";  // drawn last: the draws above stay
  return c;
}

void run_random(uint64_t first, uint64_t count) {
  for (uint64_t s = first; s < first + count; ++s) expect_case(random_case(s));
}
TEST(Sm90BackwardRandom, Cases000To099) { SAGE_REQUIRE_GPU(); run_random(0, 100); }
TEST(Sm90BackwardRandom, Cases100To199) { SAGE_REQUIRE_GPU(); run_random(100, 100); }
TEST(Sm90BackwardRandom, Cases200To299) { SAGE_REQUIRE_GPU(); run_random(200, 100); }

// Recipes the sm_90 backward does not implement are refused by name before anything runs.
TEST(Sm90Backward, RecipesWithoutAKernelAreRefusedByName) {
  SAGE_REQUIRE_GPU();
  BwdCase c;
  c.n_q = c.n_kv = 64;
  Inputs x = make_inputs(c);
  BackwardArgs a;
  const Device gpu = Device::cuda(0);
  // Host memory labelled cuda: the checks never dereference it.
  a.q = x.q.view(x.q.bits.data(), c.dtype, gpu), a.k = x.k.view(x.k.bits.data(), c.dtype, gpu);
  a.v = x.v.view(x.v.bits.data(), c.dtype, gpu), a.dout = x.dout.view(x.dout.bits.data(), c.dtype, gpu);
  Stored dq(1, 2, 64, 128, Layout::HND, false), dkv(1, 2, 64, 128, Layout::HND, false);
  a.dq = dq.view(dq.bits.data(), c.dtype, gpu);
  a.dk = dkv.view(dkv.bits.data(), c.dtype, gpu);
  a.dv = dkv.view(dkv.bits.data(), c.dtype, gpu);
  auto expect_refused = [&](const Recipe& r, const std::string& argument, const std::string& text) {
    a.recipe = r;
    try {
      backward_workspace_bytes(a);
      ADD_FAILURE() << r.name << " was accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.argument(), argument) << e.what();
      EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << e.what();
    }
  };
  expect_refused(preset("sage2_8b"), "recipe.dv_format", "has no backward");
  Recipe r = preset("sagebwd");
  r.name = "sagebwd_int8_dp";
  r.dp_format = BwdFormat::int8;
  expect_refused(r, "recipe", "'sagebwd_int8_dp' has no sm_90 backward (the kernel needs dp_format fp16");
  r = preset("sagebwd");
  r.name = "sagebwd_p_tile";
  r.bwd_p_granularity = Granularity::per_block;
  expect_refused(r, "recipe", "'sagebwd_p_tile' has no sm_90 backward (the kernel needs bwd_p_granularity per_token");
  // Both dS granularities have a kernel.
  for (const char* name : {"sagebwd", "sagebwd_block"}) {
    a.recipe = preset(name);
    EXPECT_GT(backward_workspace_bytes(a), size_t(0)) << name;
  }
}

// The backward kernel exists at head_dim 64 and 128 (kernel_traits.h, backward_has_kernel):
// other dims are refused by name, whatever the build's forward dims (a dim the build has no
// forward tile for is refused earlier, by the forward's check).
TEST(Sm90Backward, HeadDimsWithoutABackwardKernelAreRefusedByName) {
  SAGE_REQUIRE_GPU();
  for (int64_t d : {32, 96}) {
    BwdCase c;
    c.n_q = c.n_kv = 64, c.head_dim = d;
    Inputs x = make_inputs(c);
    BackwardArgs a;
    const Device gpu = Device::cuda(0);
    a.q = x.q.view(x.q.bits.data(), c.dtype, gpu), a.k = x.k.view(x.k.bits.data(), c.dtype, gpu);
    a.v = x.v.view(x.v.bits.data(), c.dtype, gpu), a.dout = x.dout.view(x.dout.bits.data(), c.dtype, gpu);
    Stored dq(1, 2, 64, d, Layout::HND, false), dkv(1, 2, 64, d, Layout::HND, false);
    a.dq = dq.view(dq.bits.data(), c.dtype, gpu);
    a.dk = dkv.view(dkv.bits.data(), c.dtype, gpu);
    a.dv = dkv.view(dkv.bits.data(), c.dtype, gpu);
    a.recipe = preset("sagebwd");
    try {
      backward_workspace_bytes(a);
      ADD_FAILURE() << "head_dim " << d << " was accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.argument(), "q") << e.what();
      // A build without the dim's forward tile (SAGE_HEAD_DIMS) refuses it at the forward's
      // check, which names the dims it has; otherwise the backward's own refusal names it.
      const std::vector<int64_t> built = gpu_head_dim_list();
      const bool forward_has_dim = std::find(built.begin(), built.end(), d) != built.end();
      const std::string expected = forward_has_dim ? "head_dim " + std::to_string(d) : "(got " + std::to_string(d) + ")";
      EXPECT_NE(std::string(e.what()).find(expected), std::string::npos) << e.what();
    }
  }
}

}  // namespace

// For compute-sanitizer (scripts/gpu_run.sh, stage `sanitize`): one small causal GQA case with
// partial tiles at each head dim and dS granularity. The first K/V tile's CTAs run 3 Q tiles,
// so that per token a shared-memory slot of the rows' maxima is zeroed and used again
// (quantize.cuh, quantize_ds_per_token).
TEST(Sm90Sanitize, Backward) {
  SAGE_REQUIRE_GPU();
  for (const char* recipe : {"sagebwd", "sagebwd_block"})
    for (int64_t d : {64, 128}) {
      BwdCase c;
      c.recipe = recipe, c.head_dim = d, c.heads_q = 4, c.heads_kv = 2, c.n_q = 200, c.n_kv = 130;
      c.causal = true, c.strided = true, c.layout = Layout::NHD;
      expect_case(c);
    }
}

}  // namespace sage::testing
