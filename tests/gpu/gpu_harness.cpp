#include "gpu_harness.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <numeric>
#include <sstream>
#include <stdexcept>
#include <thread>

#include "reference/synthetic.h"
#include "numerics/quant_rules.h"
#include "reference/tensor_io.h"
#include "numerics/formats.h"
#include "sage/recipe.h"

#ifdef SAGE_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace sage::testing {

bool gpu_ready() { return gpu_available(); }

std::string gpu_skip_reason() {
#ifdef SAGE_WITH_CUDA
  return "no CUDA GPU of compute capability 9.0 (sm_90) is visible";
#else
  return "this build has no CUDA kernels (SAGE_CUDA=OFF)";
#endif
}

const std::vector<std::string>& cpu_only_presets() {
  // SageAttention3's NVFP4 needs Blackwell's FP4 tensor cores; Hopper has none. (SageBwd's
  // forward runs on the int8_dynamic PV path.)
  static const std::vector<std::string> names = {"sage3_fp4"};
  return names;
}

std::vector<Variant> variants() {
  std::vector<Variant> out;
  for (const std::string& name : gpu_presets()) {
    out.push_back({name, false});
    if (preset(name).inputs == Inputs::prequantized_int8) out.push_back({name, true});
  }
  return out;
}

bool gpu_has_kernel(const std::string& recipe, int64_t head_dim) {
  // kernel_traits.h variant_has_kernel: fp16 PV and SageBwd's int8_dynamic stop at d = 128.
  // int8_dynamic is the dispatch's path for int8 P per token with V per block.
  const Recipe r = preset(recipe);
  const bool int8_dynamic = r.pv_format == PVFormat::int8 && r.p_scale == PScale::per_token &&
                            r.v_scale == VScale::per_block;
  return !((r.pv_format == PVFormat::fp16 || int8_dynamic) && kernel_head_dim(int(head_dim)) > 128);
}

std::vector<int64_t> harness_head_dims() {
  const std::vector<int64_t> accepted = gpu_head_dim_list();
  std::vector<int64_t> dims;
  for (int64_t k : gpu_kernel_head_dim_list()) {
    dims.push_back(k);
    // Two padded dims, not one per tile: padding is one mechanism (loads and stores bounded
    // by the caller's dim), and each padded dim multiplies every fixed test's cases (the
    // suite ran ~11 minutes on an H100 with four). 40: below the Q stage's 64-wide TMA box;
    // 224: the widest tile's second column block half used. The randomized test draws every
    // accepted dim.
    for (int64_t padded : {40, 224})
      if (kernel_head_dim(int(padded)) == k &&
          std::find(accepted.begin(), accepted.end(), padded) != accepted.end())
        dims.push_back(padded);
  }
  return dims;
}

const std::vector<std::string>& gpu_presets() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> out;
    const auto& cpu_only = cpu_only_presets();
    for (const Recipe& r : presets())
      if (std::find(cpu_only.begin(), cpu_only.end(), r.name) == cpu_only.end()) out.push_back(r.name);
    return out;
  }();
  return names;
}

Recipe GpuCase::recipe_options() const {
  Recipe r = preset(recipe);
  if (v_per_channel) {
    // The per-channel V scale AttentionArgs allows for prequantized inputs ([b, h_kv, d]).
    r.v_scale = VScale::per_channel;
    r.name = recipe + "+v_per_channel";
  }
  if (p_range > 0.f) {
    r.p_range = p_range;
    r.name += "+p_range";
  }
  if (float_row_sum) {
    r.row_sum = RowSum::float_p;
    r.name += "+float_row_sum";
  }
  if (balance) {
    r.qk_channel_balance = true;
    r.name += "+balance";
  }
  if (no_smooth_k) {
    r.smooth_k = false;
    r.name += "+no_smooth_k";
  }
  if (k_mean_stride > 0) {
    r.k_mean_stride = k_mean_stride;
    r.name += "+k_mean_stride";
  }
  return r;
}

bool GpuCase::prequantized() const { return preset(recipe).inputs == Inputs::prequantized_int8; }

namespace {

// "nan at k[b0 h1 n17 d5]": where a planted value sits, in (batch, head, token, channel).
std::string describe_planted(const GpuCase& c, const PlantedValue& p) {
  const int64_t heads = p.tensor == 'q' ? c.heads_q : c.heads_kv, n = p.tensor == 'q' ? c.n_q : c.n_kv;
  const int64_t dim = p.tensor == 'v' ? c.dv() : c.head_dim;
  const int64_t d = p.index % dim, token = p.index / dim % n, head = p.index / dim / n % heads,
                b = p.index / dim / n / heads;
  std::ostringstream os;
  if (std::isnan(p.value)) os << "nan";
  else os << (p.value > 0 ? "+" : "") << p.value;  // "+inf", "-inf"
  os << " at " << p.tensor << "[b" << b << " h" << head << " n" << token << " d" << d << "]";
  return os.str();
}

}  // namespace

std::string GpuCase::describe() const {
  std::ostringstream os;
  os << recipe << (v_per_channel ? "+v_per_channel" : "");
  if (p_range > 0.f) os << " p_range " << p_range;
  if (float_row_sum) os << " float_row_sum";
  if (no_smooth_k) os << " no_smooth_k";
  if (k_mean_stride > 0) os << " k_mean_stride " << k_mean_stride;
  if (balance) os << " balance";
  os << " "
     << (prequantized() ? std::string("i8->") : std::string()) << dtype_name(dtype) << " "
     << layout_name(layout) << (strided ? " strided" : "") << " B" << batch << " Hq" << heads_q
     << " Hkv" << heads_kv << " Nq" << n_q << " Nkv" << n_kv << " D" << head_dim
     << (dv() != head_dim ? " Dv" + std::to_string(dv()) : std::string()) << (causal ? " causal" : "");
  if (window_left >= 0 || window_right >= 0) os << " window(" << window_left << "," << window_right << ")";
  os << (with_lse ? "" : " no-lse") << " " << distribution << " seed"
     << seed;
  if (magnitude > 0.f) os << " magnitude " << magnitude << " on " << magnified;
  for (const PlantedValue& p : planted) os << " " << describe_planted(*this, p);
  return os.str();
}

// ---- bounds ---------------------------------------------------------------------------------
//
// What separates kernel and simulator (docs/numerics.md, "GPU against the simulator"):
// summation order (K mean, Q tile mean, row sums, fp32 MMA), ex2.approx and FMA contraction.
// The scales, codes and accumulator structure are the same, so these only flip an occasional
// value that lies next to a rounding boundary of its format (a K or Q code, a P code) to the
// neighbouring code. Measured for sage2_8b / sage2_8b_vsmooth over 269 cases on an H100: worst
// rel L1 2.6e-3 (the "sink" distribution, where a few probabilities carry most of the mass),
// cosine 0.9999974, LSE 3.1e-5. Those set the base bounds below, with about 2x margin.
//
// How the other recipes relate to that base, flip by flip. A flip moves one value by one code
// step s; a perturbation e of the value before rounding flips it with probability ~ e / s. So
// the expected |change| (what rel L1 sums) is ~ e, whatever s is, while the expected squared
// change (what 1 - cosine sums) is ~ e * s: it grows with the step.
//   * INT4 Q/K (sage2_4b, sage2pp_4b): the code step is 127 / 7 = 18x an INT8 step, so 1 - cos
//     can grow up to 18x where codes flip (18 x 2.6e-6 = 4.7e-5): the cosine bound is 1 - 1e-4.
//     Against the simulator the H100 stayed at 0.9999975 over 992 cases (the Q tile mean is
//     exact in double and dS follows the simulator's order), but against exact attention a
//     bf16 `outliers` case (recipe cosine 0.90) came out 1.5e-5 below the simulator's own
//     cosine, more than a 1e-5 bound allows: the step size shows there.
//   * FP16-accumulated PV (sage1_t, sage1_b: fp16 accumulator over the tile's k16 steps;
//     sage2pp_8b/4b: fp16 over two k32 steps, then fp32): the accumulator rounds once per
//     k-step, so an upstream flip shows as one fp16 ulp of the partial sum (2^-11 relative)
//     with a probability proportional to its size: the same expected change, and a step of
//     2^-11 of the partial sum is below an E4M3 P step (2^-4 of a P value). No change. A
//     systematic difference is not a flip: if the hardware rounded the accumulator other than
//     as docs/numerics.md step 9 models it (one round-to-nearest from the exact sum per
//     k-step), each k16 step could lose up to half an ulp the same way, 8 x 2^-12 = 2e-3 of
//     the output at worst, on top of the flips. That would be a wrong accumulator model, to be
//     fixed in the simulator as FP22 truncation was, not absorbed here.
//   * INT8 P with fp32 accumulation (sage1_vt, sage1_vb, int_flash, int_flash_q): INT8 Q/K
//     codes as in sage2_8b (int_flash*: no smoothing mean, so Q/K codes are the same bits);
//     P's step is 1/127 of P~ while the only perturbation of P~ is ex2.approx's (~2^-22
//     relative), so P flips are rarer than E4M3 ones. No change.
//   * Quantized row sums (int_flash*, RowSum::quantized_p; the SageAttention2 presets from
//     head dim 128, RowSum::pv_mma): l sums the P codes themselves, so a P flip moves l, and
//     the LSE, where a float row sum would not see it. A flip of a large P in a sharp row
//     moved one LSE by 1.2e-3 of 3200 rows (sage2_8b, normal, seed 8, H200), and the rest of
//     that case stayed within 1e-6: such rows are counted, not bounded by lse_sim
//     (expect_within_bounds). With the old accumulator model (each k32 step's exact sum,
//     then FP22) l was 0.67% off on `sink`: every small P beside a large one loses its low
//     bits in the tensor core, which docs/numerics.md step 9 now models; a systematic
//     difference like that would show in every row and fail the count.
// The recipe error (1 - cosine against exact) up to which expect_within_bounds also bounds
// the kernel's cosine against exact by the simulator's plus the deviation bound.
constexpr double kAlignedErrorCheckMax = 1e-2;

Bounds bounds_for(const std::string& recipe) {
  const Bounds base{0.99999, 5e-3, 1e-3};
  Bounds b = base;
  if (preset(recipe).qk_format == QKFormat::int4) b.sim_cosine = 1 - 1e-4;
  return b;
}

namespace {

// The kernel's LSE against the simulator's, rows both make NaN or the same infinity agreeing.
void expect_lse_near_simulator(const GpuCase& c, const GpuResult& r) {
  const Bounds b = bounds_for(c.recipe);
  const Recipe recipe = c.recipe_options();
  const bool quantized_sum =
      recipe.row_sum == RowSum::quantized_p ||
      rules::row_sum_in_pv_mma(recipe, call_head_dim(c.head_dim, c.dv()));
  if (quantized_sum) {
    // One P code flip (above) moves a quantized row sum by one code step of that P, at most
    // 1/8 of it (E4M3's 3 mantissa bits; INT8's 1/127 of p_max is less), so the row's LSE by
    // at most log(1 + 1/8); one row in a thousand may show it (at least one per case).
    const int64_t rows = int64_t(r.lse.size());
    EXPECT_LE(r.lse_rows_beyond, std::max<int64_t>(1, rows / 1000)) << c.describe();
    EXPECT_LE(r.lse_max_abs_vs_sim, std::log1p(0.125)) << c.describe();
  } else {
    EXPECT_LE(r.lse_max_abs_vs_sim, b.lse_sim) << c.describe();
  }
}

// A case with planted NaN/inf inputs (docs/numerics.md, "Non-finite inputs"): the output's and
// the LSE's non-finite pattern must be the simulator's exactly, nothing float64 attention makes
// non-finite may come out finite, and the finite rest keeps the simulator bounds. Metrics
// against float64 attention mean nothing here (its non-finite set is narrower by design).
void expect_nonfinite_as_simulated(const GpuCase& c, const GpuResult& r) {
  const Bounds b = bounds_for(c.recipe);
  const NonFiniteStats& n = r.nonfinite;
  std::printf("[nonfinite] %s | non-finite %lld mismatched %lld absorbed %lld | finite: sim cos %.7f l1 %.2e | lse sim %.2e\n",
              c.describe().c_str(), (long long)n.in_output, (long long)n.mismatched, (long long)n.absorbed,
              n.vs_sim_finite.cosine, n.vs_sim_finite.rel_l1, r.lse_max_abs_vs_sim);
  EXPECT_EQ(r.unwritten, 0) << c.describe();
  EXPECT_EQ(n.mismatched, 0) << c.describe()
                             << ": output elements or LSE rows finite, NaN, +inf or -inf unlike the simulator's";
  EXPECT_EQ(n.absorbed, 0) << c.describe() << ": non-finite in float64 attention, finite in the kernel";
  EXPECT_GT(n.in_output, 0) << c.describe() << ": the planted values reached no output";
  EXPECT_GE(n.vs_sim_finite.cosine, b.sim_cosine) << c.describe();
  EXPECT_LE(n.vs_sim_finite.rel_l1, b.sim_rel_l1) << c.describe();
  if (c.with_lse) expect_lse_near_simulator(c, r);
}

}  // namespace

void expect_within_bounds(const GpuCase& c, const GpuResult& r) {
  if (!r.error.empty()) {
    ADD_FAILURE() << c.describe() << ": the GPU path threw: " << r.error;
    return;
  }
  if (!c.planted.empty()) return expect_nonfinite_as_simulated(c, r);
  const Bounds b = bounds_for(c.recipe);
  std::printf("[metrics] %s | sim cos %.7f l1 %.2e max %.2e | exact cos %.6f l1 %.4f | lse sim %.2e exact %.2e\n",
              c.describe().c_str(), r.vs_sim.cosine, r.vs_sim.rel_l1, r.vs_sim.max_abs, r.vs_exact.cosine,
              r.vs_exact.rel_l1, r.lse_max_abs_vs_sim, r.lse_max_abs_vs_exact);
  EXPECT_EQ(r.unwritten, 0) << c.describe();
  EXPECT_EQ(r.vs_sim.nonfinite, 0) << c.describe();
  EXPECT_GE(r.vs_sim.cosine, b.sim_cosine) << c.describe();
  EXPECT_LE(r.vs_sim.rel_l1, b.sim_rel_l1) << c.describe();
  // Against exact attention: the kernel's cosine error may exceed the simulator's own by at
  // most the kernel-vs-simulator bound, 1 - cos(k, e) <= (1 - cos(s, e)) + (1 - bound). That is
  // not a theorem (the angle triangle inequality, which always holds once the simulator check
  // passes, adds a cross term 2 sqrt(both)), so it catches a kernel deviation aligned with the
  // recipe's own error. It is asserted where the recipe's error is below 1e-2 (cosine 0.99):
  // above it the cross term decides, and among 1,625 randomized cases the three with cosine
  // 0.93-0.99 (extreme magnitudes, channel_offset) landed 1e-7 to 4e-5 outside it while
  // matching the simulator; there the simulator check above is the kernel's bound.
  if (1 - r.sim_vs_exact.cosine <= kAlignedErrorCheckMax)
    EXPECT_GE(r.vs_exact.cosine, r.sim_vs_exact.cosine - (1 - b.sim_cosine))
        << c.describe() << ": exact cosine " << r.vs_exact.cosine << ", simulator's " << r.sim_vs_exact.cosine;
  EXPECT_LE(r.vs_exact.rel_l1, r.sim_vs_exact.rel_l1 + b.sim_rel_l1) << c.describe();
  if (c.with_lse) {
    expect_lse_near_simulator(c, r);
    EXPECT_LE(r.lse_max_abs_vs_exact, r.lse_sim_vs_exact + b.lse_sim) << c.describe();
  }
}

// ---- inputs and the non-finite comparison (host only: the CPU-side tests use them too) ------

namespace {

// One tensor's values: "zeros", "huge" (uniform in +-60000), or a synthetic distribution's
// tensor (`which` picks it from the three make_synthetic returns).
std::vector<float> distribution_values(const GpuCase& c, const reference::SyntheticInputs* synthetic, char which,
                                       int64_t heads, int64_t n, int64_t d) {
  const int64_t count = c.batch * heads * n * d;
  std::vector<float> x(count, 0.f);
  if (c.distribution == "zeros") return x;
  if (c.distribution == "huge") {
    reference::Rng rng(c.seed * 7 + which);
    for (auto& e : x) e = float((rng.uniform() * 2 - 1) * 60000.0);
    return x;
  }
  const std::vector<uint16_t>& src = which == 'q' ? synthetic->q : which == 'k' ? synthetic->k : synthetic->v;
  for (int64_t i = 0; i < count; ++i) x[i] = fmt::fp16_from_bits(src[i]);
  return x;
}

// Scales x so that its largest |value| is `magnitude` (an all-zero tensor stays zero).
void scale_to_magnitude(std::vector<float>& x, float magnitude) {
  float amax = 0.f;
  for (float e : x) amax = std::max(amax, std::fabs(e));
  if (amax == 0.f) return;
  const double factor = double(magnitude) / double(amax);
  for (float& e : x) e = float(double(e) * factor);
}

}  // namespace

CaseValues case_values(const GpuCase& c) {
  // One make_synthetic call gives all three tensors: calling it per tensor would triple the
  // serial host time of a thousand-case list.
  std::unique_ptr<reference::SyntheticInputs> synthetic;
  if (c.distribution != "zeros" && c.distribution != "huge") {
    reference::SyntheticShape s;
    s.batch = c.batch, s.heads_q = c.heads_q, s.heads_kv = c.heads_kv, s.n_q = c.n_q, s.n_kv = c.n_kv;
    s.head_dim = c.head_dim, s.head_dim_v = c.dv();
    synthetic = std::make_unique<reference::SyntheticInputs>(reference::make_synthetic(c.distribution, s, c.seed));
  }
  CaseValues x;
  x.q = distribution_values(c, synthetic.get(), 'q', c.heads_q, c.n_q, c.head_dim);
  x.k = distribution_values(c, synthetic.get(), 'k', c.heads_kv, c.n_kv, c.head_dim);
  x.v = distribution_values(c, synthetic.get(), 'v', c.heads_kv, c.n_kv, c.dv());
  auto tensor = [&x](char which) -> std::vector<float>& { return which == 'q' ? x.q : which == 'k' ? x.k : x.v; };
  if (c.magnitude > 0.f)
    for (char which : c.magnified) scale_to_magnitude(tensor(which), c.magnitude);
  for (const PlantedValue& p : c.planted) tensor(p.tensor).at(size_t(p.index)) = p.value;
  return x;
}

namespace {

enum class ValueClass { finite, nan, plus_inf, minus_inf };

ValueClass class_of(float x) {
  if (std::isnan(x)) return ValueClass::nan;
  if (std::isinf(x)) return x > 0 ? ValueClass::plus_inf : ValueClass::minus_inf;
  return ValueClass::finite;
}

// The simulator's float output as the kernel's output dtype holds it (a finite float beyond
// that dtype's range is an infinity there).
float as_stored(float x, DType dtype) {
  if (dtype == DType::f16) return fmt::round_fp16(x);
  if (dtype == DType::bf16) return fmt::round_bf16(x);
  return x;
}

}  // namespace

NonFiniteStats compare_nonfinite(DType out_dtype, const std::vector<float>& got, const std::vector<float>& sim,
                                 const std::vector<float>& exact, const std::vector<float>& got_lse,
                                 const std::vector<float>& sim_lse, const std::vector<float>& exact_lse) {
  NonFiniteStats s;
  std::vector<float> got_finite, sim_finite;
  for (size_t i = 0; i < got.size(); ++i) {
    const ValueClass g = class_of(got[i]), m = class_of(as_stored(sim[i], out_dtype));
    s.mismatched += g != m;
    s.in_output += g != ValueClass::finite;
    s.absorbed += g == ValueClass::finite && !std::isfinite(exact[i]);
    if (g == ValueClass::finite && m == ValueClass::finite) got_finite.push_back(got[i]), sim_finite.push_back(sim[i]);
  }
  for (size_t i = 0; i < got_lse.size(); ++i) {
    s.mismatched += class_of(got_lse[i]) != class_of(sim_lse[i]);
    s.absorbed += std::isfinite(got_lse[i]) && !std::isfinite(exact_lse[i]);
  }
  s.vs_sim_finite = reference::compare(got_finite.data(), sim_finite.data(), int64_t(got_finite.size()));
  return s;
}

#ifdef SAGE_WITH_CUDA
namespace {

void check_cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

struct DeviceBuffer {
  void* ptr = nullptr;
  explicit DeviceBuffer(size_t bytes) { check_cuda(cudaMalloc(&ptr, std::max<size_t>(bytes, 256)), "cudaMalloc"); }
  ~DeviceBuffer() { cudaFree(ptr); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
};

// A host tensor of up to 4 dims with any strides and a storage offset, plus its device twin.
// The padding between rows (and before the first element) holds a fill pattern that a kernel
// reading out of bounds would pick up.
struct HostTensor {
  std::vector<uint8_t> storage;
  DType dtype = DType::f16;
  int64_t offset = 0;  // elements
  int ndim = 0;
  int64_t shape[4] = {0, 0, 0, 0}, strides[4] = {0, 0, 0, 0};
  std::unique_ptr<DeviceBuffer> device;

  size_t elem() const { return dtype_size(dtype); }
  TensorView view_at(void* base, Device dev) const {
    TensorView v;
    v.data = static_cast<uint8_t*>(base) + offset * int64_t(elem());
    v.dtype = dtype;
    v.ndim = ndim;
    for (int i = 0; i < ndim; ++i) v.shape[i] = shape[i], v.strides[i] = strides[i];
    v.device = dev;
    return v;
  }
  TensorView host_view() const { return view_at(const_cast<uint8_t*>(storage.data()), Device::cpu()); }
  TensorView device_view() const { return view_at(device->ptr, Device::cuda(0)); }
  void fill(uint32_t pattern) {
    const size_t e = elem();
    for (size_t i = 0; i + e <= storage.size(); i += e) std::memcpy(&storage[i], &pattern, e);
  }
  void upload() {
    if (!device) device = std::make_unique<DeviceBuffer>(storage.size());
    check_cuda(cudaMemcpy(device->ptr, storage.data(), storage.size(), cudaMemcpyHostToDevice), "upload");
  }
  void download() {
    check_cuda(cudaMemcpy(storage.data(), device->ptr, storage.size(), cudaMemcpyDeviceToHost), "download");
  }
};

// Row-major shape with, when `strided`, 16 bytes of padding after every row of every
// dimension and a storage offset of `offset_bytes` (by default 48: 16-byte steps, what the
// kernels' 16-byte vector loads need, so the padding tests the strides, not an alignment rule).
HostTensor make_tensor(DType dtype, const std::vector<int64_t>& shape, bool strided, uint32_t fill,
                       int64_t offset_bytes = 48) {
  HostTensor t;
  t.dtype = dtype;
  t.ndim = int(shape.size());
  const int64_t e = int64_t(dtype_size(dtype));
  const int64_t pad = strided ? 16 / e : 0;
  for (int i = 0; i < t.ndim; ++i) t.shape[i] = shape[i];
  t.strides[t.ndim - 1] = 1;
  for (int i = t.ndim - 2; i >= 0; --i) t.strides[i] = t.shape[i + 1] * t.strides[i + 1] + pad * (t.ndim - 1 - i);
  t.offset = strided ? offset_bytes / e : 0;
  t.storage.assign(size_t((t.offset + t.shape[0] * t.strides[0] + 16) * e), 0);
  t.fill(fill);
  return t;
}

// A q/k/v/out tensor in the case's layout: physical order HND b,h,n,d or NHD b,n,h,d.
HostTensor make_attention_tensor(const GpuCase& c, DType dtype, int64_t heads, int64_t n, int64_t d, uint32_t fill,
                                 int64_t offset_bytes = 48) {
  if (c.layout == Layout::HND) return make_tensor(dtype, {c.batch, heads, n, d}, c.strided, fill, offset_bytes);
  return make_tensor(dtype, {c.batch, n, heads, d}, c.strided, fill, offset_bytes);
}

uint16_t to_bits(float x, DType dt) { return dt == DType::f16 ? fmt::fp16_bits(x) : fmt::bf16_bits(x); }

// Writes HND-ordered values into a 4-d tensor of either layout; put(ptr, i) stores element i.
template <class Put>
void scatter(HostTensor& t, Layout layout, int64_t heads, int64_t n, int64_t d, Put put) {
  const TensorView v = t.host_view();
  for (int64_t b = 0; b < t.shape[0]; ++b)
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t i = 0; i < n; ++i)
        for (int64_t c = 0; c < d; ++c) {
          const int64_t hi = layout == Layout::HND ? h : i, ni = layout == Layout::HND ? i : h;
          const int64_t at = b * v.strides[0] + hi * v.strides[1] + ni * v.strides[2] + c;
          put(static_cast<uint8_t*>(v.data) + at * int64_t(t.elem()), ((b * heads + h) * n + i) * d + c);
        }
}

void scatter_float(HostTensor& t, Layout layout, const std::vector<float>& bhnd, int64_t heads, int64_t n, int64_t d) {
  scatter(t, layout, heads, n, d, [&](uint8_t* p, int64_t i) {
    const uint16_t bits = to_bits(bhnd[i], t.dtype);
    std::memcpy(p, &bits, 2);
  });
}

void scatter_i8(HostTensor& t, Layout layout, const std::vector<int8_t>& bhnd, int64_t heads, int64_t n, int64_t d) {
  scatter(t, layout, heads, n, d, [&](uint8_t* p, int64_t i) { std::memcpy(p, &bhnd[i], 1); });
}

// A row-major scale tensor (q_scale, k_scale, v_scale, or the LSE), padded when strided.
HostTensor make_rows(const GpuCase& c, const std::vector<int64_t>& shape, const std::vector<float>& values,
                     uint32_t fill) {
  HostTensor t = make_tensor(DType::f32, shape, c.strided, fill);
  const TensorView v = t.host_view();
  reference::write_flat(v, values.data());
  return t;
}

std::vector<uint16_t> fp16_bits_of(const std::vector<float>& x) {
  std::vector<uint16_t> out(x.size());
  for (size_t i = 0; i < x.size(); ++i) out[i] = fmt::fp16_bits(x[i]);
  return out;
}

constexpr uint32_t kInputFill16 = 0x7BFF;      // fp16 65504: huge if a kernel reads padding
constexpr uint32_t kInputFill8 = 0x80;         // INT8 -128: outside the symmetric code range
constexpr uint32_t kScaleFill = 0x7FC00001u;   // a NaN: poisons any output it reaches
// The LSE poison is finite on purpose: a NaN would drop out of the max-difference checks.
constexpr float kLsePoison = -12345.f;
uint32_t out_poison(DType dt) { return dt == DType::f16 ? 0x7E01 : 0x7FC1; }  // NaN payloads

}  // namespace

struct CaseTensors::Impl {
  GpuCase c;
  HostTensor q, k, v, out, q_scale, k_scale, v_scale, lse;
  AttentionArgs dev, host;
};

CaseTensors::CaseTensors(const GpuCase& c) : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.c = c;
  const bool preq = c.prequantized();
  const int64_t d = c.head_dim, dv = c.dv();
  if (preq && dv != d)
    throw std::invalid_argument("a V head dim of its own needs floating-point inputs, not " + c.recipe + "'s INT8");
  if (preq && !c.planted.empty())
    throw std::invalid_argument("planted non-finite values need floating-point inputs, not " + c.recipe + "'s INT8");
  const CaseValues values = case_values(c);
  const std::vector<float>& qf = values.q;
  const std::vector<float>& kf = values.k;
  const std::vector<float>& vf = values.v;
  if (!preq) {
    m.q = make_attention_tensor(c, c.dtype, c.heads_q, c.n_q, d, kInputFill16);
    m.k = make_attention_tensor(c, c.dtype, c.heads_kv, c.n_kv, d, kInputFill16);
    m.v = make_attention_tensor(c, c.dtype, c.heads_kv, c.n_kv, dv, kInputFill16);
    scatter_float(m.q, c.layout, qf, c.heads_q, c.n_q, d);
    scatter_float(m.k, c.layout, kf, c.heads_kv, c.n_kv, d);
    scatter_float(m.v, c.layout, vf, c.heads_kv, c.n_kv, dv);
  } else {
    // INT8 codes and f32 scales as a caller of int_flash would bring them, made on the host by
    // the same function the CPU tests and `sage check` use, from the fp16-rounded values.
    reference::SyntheticInputs in;
    in.shape.batch = c.batch, in.shape.heads_q = c.heads_q, in.shape.heads_kv = c.heads_kv;
    in.shape.n_q = c.n_q, in.shape.n_kv = c.n_kv, in.shape.head_dim = d;
    in.q = fp16_bits_of(qf), in.k = fp16_bits_of(kf), in.v = fp16_bits_of(vf);
    const reference::PrequantizedInputs p = reference::prequantize_int8(in, c.v_per_channel);
    m.q = make_attention_tensor(c, DType::i8, c.heads_q, c.n_q, d, kInputFill8);
    m.k = make_attention_tensor(c, DType::i8, c.heads_kv, c.n_kv, d, kInputFill8);
    m.v = make_attention_tensor(c, DType::i8, c.heads_kv, c.n_kv, d, kInputFill8);
    scatter_i8(m.q, c.layout, p.q, c.heads_q, c.n_q, d);
    scatter_i8(m.k, c.layout, p.k, c.heads_kv, c.n_kv, d);
    scatter_i8(m.v, c.layout, p.v, c.heads_kv, c.n_kv, d);
    m.q_scale = make_rows(c, {c.batch, c.heads_q, c.n_q}, p.q_scale, kScaleFill);
    m.k_scale = make_rows(c, {c.batch, c.heads_kv, c.n_kv}, p.k_scale, kScaleFill);
    m.v_scale = c.v_per_channel ? make_rows(c, {c.batch, c.heads_kv, d}, p.v_scale, kScaleFill)
                                : make_rows(c, {c.batch, c.heads_kv}, p.v_scale, kScaleFill);
  }
  // A strided output starts 4 bytes past a 16-byte boundary (the API asks for 4): the
  // epilogue's 4-byte store path (sm90/epilogue.cuh); unstrided outputs take the 16-byte one.
  m.out = make_attention_tensor(c, c.dtype, c.heads_q, c.n_q, dv, out_poison(c.dtype), 52);
  uint32_t lse_fill;
  std::memcpy(&lse_fill, &kLsePoison, 4);
  if (c.with_lse) m.lse = make_tensor(DType::f32, {c.batch, c.heads_q, c.n_q}, c.strided, lse_fill);

  for (HostTensor* t : {&m.q, &m.k, &m.v, &m.out, &m.q_scale, &m.k_scale, &m.v_scale, &m.lse})
    if (t->ndim > 0) t->upload();

  auto fill_args = [&](AttentionArgs& a, bool device) {
    auto view = [device](const HostTensor& t) {
      if (t.ndim == 0) return TensorView{};
      return device ? t.device_view() : t.host_view();
    };
    a.q = view(m.q), a.k = view(m.k), a.v = view(m.v), a.out = view(m.out), a.lse = view(m.lse);
    a.q_scale = view(m.q_scale), a.k_scale = view(m.k_scale), a.v_scale = view(m.v_scale);
    a.layout = c.layout;
    a.causal = c.causal;
    a.window_left = c.window_left, a.window_right = c.window_right;
    a.recipe = c.recipe_options();
  };
  fill_args(m.dev, true);
  fill_args(m.host, false);
}

CaseTensors::~CaseTensors() = default;

const GpuCase& CaseTensors::spec() const { return impl_->c; }
AttentionArgs CaseTensors::device_args() const { return impl_->dev; }
AttentionArgs CaseTensors::host_args() const { return impl_->host; }

void CaseTensors::poison_outputs() {
  Impl& m = *impl_;
  m.out.fill(out_poison(m.c.dtype));
  m.out.upload();
  if (m.lse.ndim > 0) {
    uint32_t lse_fill;
    std::memcpy(&lse_fill, &kLsePoison, 4);
    m.lse.fill(lse_fill);
    m.lse.upload();
  }
}

void CaseTensors::download() {
  impl_->out.download();
  if (impl_->lse.ndim > 0) impl_->lse.download();
}

std::vector<uint16_t> CaseTensors::out_bits() const {
  const std::vector<uint8_t>& s = impl_->out.storage;
  std::vector<uint16_t> bits(s.size() / 2);
  std::memcpy(bits.data(), s.data(), bits.size() * 2);
  return bits;
}

std::vector<float> CaseTensors::lse() const {
  if (impl_->lse.ndim == 0) return {};
  const std::vector<double> dense = reference::read_flat_f64(impl_->lse.host_view());
  return std::vector<float>(dense.begin(), dense.end());
}

DeviceWorkspace::DeviceWorkspace(size_t bytes) : bytes_(bytes) {
  check_cuda(cudaMalloc(&ptr_, std::max<size_t>(bytes, 256)), "cudaMalloc workspace");
  check_cuda(cudaMemset(ptr_, 0xA5, std::max<size_t>(bytes, 256)), "cudaMemset workspace");
}
DeviceWorkspace::~DeviceWorkspace() { cudaFree(ptr_); }

void device_sync(const char* what) { check_cuda(cudaDeviceSynchronize(), what); }

namespace {

// The GPU half of a case: one attention() call on a garbage workspace.
void run_on_device(CaseTensors& t, GpuResult& res) {
  const AttentionArgs a = t.device_args();
  const size_t ws_bytes = workspace_bytes(a);
  DeviceWorkspace ws(ws_bytes);
  attention(a, ws.get(), ws_bytes, nullptr);
  device_sync("attention");
  t.download();
  res.out_bits = t.out_bits();
  res.lse = t.lse();
  // Every logical output element must have been written. The poison is a NaN with its own
  // payload, so the bits tell it from a NaN the kernel wrote (the canonical 0x7FFF).
  const DType dt = t.spec().dtype;
  const float poison = dt == DType::f16 ? fmt::fp16_from_bits(uint16_t(out_poison(dt)))
                                        : fmt::bf16_from_bits(uint16_t(out_poison(dt)));
  const std::vector<float> vals = reference::read_bhnd_f32(t.host_args().out, t.spec().layout);
  for (float x : vals) res.unwritten += std::memcmp(&x, &poison, sizeof x) == 0 ? 1 : 0;
}

// The host half: simulate and exact from the same strided host tensors, and the metrics.
void compute_references(const CaseTensors& t, GpuResult& res) {
  const GpuCase& c = t.spec();
  const int64_t dv = c.dv();
  const AttentionArgs got = t.host_args();
  AttentionArgs host = got;
  std::vector<float> sim(c.batch * c.heads_q * c.n_q * dv), ex(sim.size());
  std::vector<float> sim_lse(c.batch * c.heads_q * c.n_q), ex_lse(sim_lse.size());
  host.out = contiguous_view(sim.data(), DType::f32, {c.batch, c.heads_q, c.n_q, dv});
  // The reference output is HND-contiguous; q/k/v keep the case's layout, so the output view
  // is permuted to the same layout.
  if (c.layout == Layout::NHD)
    host.out = strided_view(sim.data(), DType::f32, {c.batch, c.n_q, c.heads_q, dv},
                            {c.heads_q * c.n_q * dv, dv, c.n_q * dv, 1});
  host.lse = c.with_lse ? contiguous_view(sim_lse.data(), DType::f32, {c.batch, c.heads_q, c.n_q}) : TensorView{};
  reference::simulate(host);
  AttentionArgs host_exact = host;
  host_exact.out.data = ex.data();
  if (c.with_lse) host_exact.lse.data = ex_lse.data();
  reference::exact(host_exact);

  const TensorView sim_view = contiguous_view(sim.data(), DType::f32, {c.batch, c.heads_q, c.n_q, dv});
  const TensorView ex_view = contiguous_view(ex.data(), DType::f32, {c.batch, c.heads_q, c.n_q, dv});
  res.vs_sim = reference::compare(got.out, c.layout, sim_view, Layout::HND);
  res.vs_exact = reference::compare(got.out, c.layout, ex_view, Layout::HND);
  res.sim_vs_exact = reference::compare(sim.data(), ex.data(), int64_t(sim.size()));
  res.nonfinite = compare_nonfinite(c.dtype, reference::read_bhnd_f32(got.out, c.layout), sim, ex, res.lse,
                                    c.with_lse ? sim_lse : std::vector<float>{}, ex_lse);
  if (c.with_lse) {
    // Rows both make NaN or the same infinity agree; a NaN in one only is infinitely far
    // (std::max would drop a NaN difference).
    const auto diff = [](float a, float b) {
      if (std::isinf(a) && std::isinf(b) && (a < 0) == (b < 0)) return 0.0;
      if (std::isnan(a) || std::isnan(b)) return std::isnan(a) && std::isnan(b) ? 0.0 : INFINITY;
      return std::fabs(double(a) - double(b));
    };
    const double bound = bounds_for(c.recipe).lse_sim;
    for (size_t i = 0; i < res.lse.size(); ++i) {
      const double vs_sim = diff(res.lse[i], sim_lse[i]);
      res.lse_max_abs_vs_sim = std::max(res.lse_max_abs_vs_sim, vs_sim);
      if (vs_sim > bound) {
        ++res.lse_rows_beyond;
        continue;
      }
      res.lse_max_abs_vs_exact = std::max(res.lse_max_abs_vs_exact, diff(res.lse[i], ex_lse[i]));
      res.lse_sim_vs_exact = std::max(res.lse_sim_vs_exact, diff(sim_lse[i], ex_lse[i]));
    }
  }
}

}  // namespace

GpuResult run_gpu_case(const GpuCase& c, bool compute_references_too) {
  GpuResult res;
  CaseTensors t(c);
  run_on_device(t, res);
  if (compute_references_too) compute_references(t, res);
  return res;
}

std::vector<GpuResult> run_gpu_cases(const std::vector<GpuCase>& cases) {
  std::vector<GpuResult> results(cases.size());
  std::vector<std::unique_ptr<CaseTensors>> tensors(cases.size());
  for (size_t i = 0; i < cases.size(); ++i) {
    try {
      tensors[i] = std::make_unique<CaseTensors>(cases[i]);
      run_on_device(*tensors[i], results[i]);
    } catch (const std::exception& e) {
      results[i].error = e.what();
      tensors[i].reset();
      cudaGetLastError();  // a failed launch must not be reported again by the next case
    }
  }
  // Largest first, so one long case does not start last and run alone.
  std::vector<size_t> order(cases.size());
  std::iota(order.begin(), order.end(), size_t(0));
  auto cost = [&](size_t i) {
    const GpuCase& c = cases[i];
    return double(c.batch) * double(c.heads_q) * double(c.n_q) * double(c.n_kv) * double(c.head_dim + c.dv());
  };
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return cost(a) > cost(b); });
  std::atomic<size_t> next{0};
  auto work = [&] {
    for (size_t k = next.fetch_add(1); k < order.size(); k = next.fetch_add(1)) {
      const size_t i = order[k];
      if (!tensors[i]) continue;
      try {
        compute_references(*tensors[i], results[i]);
      } catch (const std::exception& e) {
        results[i].error = std::string("references: ") + e.what();
      }
      tensors[i].reset();  // frees this case's host and device memory early
    }
  };
  const size_t workers = std::max<size_t>(1, std::min<size_t>(std::thread::hardware_concurrency(), cases.size()));
  std::vector<std::thread> pool;
  for (size_t w = 1; w < workers; ++w) pool.emplace_back(work);
  work();
  for (auto& th : pool) th.join();
  return results;
}

#else  // no CUDA in this build: every GPU test skips before calling these

struct CaseTensors::Impl {};
CaseTensors::CaseTensors(const GpuCase&) { throw std::logic_error("no CUDA in this build"); }
CaseTensors::~CaseTensors() = default;
const GpuCase& CaseTensors::spec() const { throw std::logic_error("no CUDA in this build"); }
AttentionArgs CaseTensors::device_args() const { throw std::logic_error("no CUDA in this build"); }
AttentionArgs CaseTensors::host_args() const { throw std::logic_error("no CUDA in this build"); }
void CaseTensors::poison_outputs() { throw std::logic_error("no CUDA in this build"); }
void CaseTensors::download() { throw std::logic_error("no CUDA in this build"); }
std::vector<uint16_t> CaseTensors::out_bits() const { throw std::logic_error("no CUDA in this build"); }
std::vector<float> CaseTensors::lse() const { throw std::logic_error("no CUDA in this build"); }
DeviceWorkspace::DeviceWorkspace(size_t) { throw std::logic_error("no CUDA in this build"); }
DeviceWorkspace::~DeviceWorkspace() = default;
void device_sync(const char*) { throw std::logic_error("no CUDA in this build"); }
GpuResult run_gpu_case(const GpuCase&, bool) { throw std::logic_error("no CUDA in this build"); }
std::vector<GpuResult> run_gpu_cases(const std::vector<GpuCase>&) { throw std::logic_error("no CUDA in this build"); }

#endif

void expect_cases_within_bounds(const std::vector<GpuCase>& cases) {
  const std::vector<GpuResult> results = run_gpu_cases(cases);
  for (size_t i = 0; i < cases.size(); ++i) expect_within_bounds(cases[i], results[i]);
}

}  // namespace sage::testing
