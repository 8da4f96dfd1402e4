// Issue 35's randomized bar: at least 1,000 seeded random cases of the sm_90 kernels against
// the simulator, over every GPU preset (int_flash also with a per-channel V scale), both
// layouts, strided views, fp16 and bf16, the built head dims, causal or not, GQA and MQA,
// batch 1-2 and lengths from 1 (odd, unequal, mostly <= 300 tokens, a few up to 1200), in
// three families of inputs:
//   * distributions: the synthetic ones (channel_offset included) at their own scale;
//   * extreme magnitudes: a synthetic shape scaled so that Q, K and/or V reach +-60000 (fp16)
//     or +-1e4 (bf16);
//   * non-finite inputs: one to three NaN, +inf or -inf planted in Q, K or V, whose output
//     pattern must be the simulator's exactly (docs/numerics.md, "Non-finite inputs").
// The list is a pure function of kListSeed, so a failure names its case (GpuCase::describe,
// planted positions included) and the list seed, and reruns as it failed.
//
// Time: the host references dominate (run_gpu_cases computes them in parallel); the list's
// shapes keep them to seconds on a 16-core host. The RandomizedGpuCases tests run without a
// GPU: they check the list's coverage and run the simulator on its non-finite cases.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "gpu_harness.h"
#include "numerics/formats.h"
#include "reference/synthetic.h"

namespace sage::testing {
namespace {

constexpr uint64_t kListSeed = 35001;  // issue 35, list 1
constexpr int kCasesPerVariant = 125;
constexpr float kFp16Magnitude = 60000.f, kBf16Magnitude = 1e4f;

enum class Family { distribution, extreme, nonfinite };
const char* family_name(Family f) {
  return f == Family::distribution ? "distribution" : f == Family::extreme ? "extreme" : "nonfinite";
}
Family family_of(const GpuCase& c) {
  if (!c.planted.empty()) return Family::nonfinite;
  return c.magnitude > 0.f ? Family::extreme : Family::distribution;
}

// Draws from the list's one generator; every draw goes through here so the list is a pure
// function of the seed.
class Draw {
 public:
  explicit Draw(uint64_t seed) : rng_(seed) {}
  int below(int n) { return int(rng_.next() % uint64_t(n)); }
  bool one_in(int n) { return below(n) == 0; }
  double uniform() { return rng_.uniform(); }
  template <class T>
  const T& from(const std::vector<T>& items) { return items[size_t(below(int(items.size())))]; }

 private:
  reference::Rng rng_;
};

// Mostly short (tile boundaries and odd lengths), sometimes a single token, a few long.
int64_t draw_length(Draw& draw) {
  static const std::vector<int64_t> kTileEdges = {63, 64, 65, 127, 128, 129, 191, 192, 193, 255, 256, 257};
  const int kind = draw.below(100);
  if (kind < 8) return 1;
  if (kind < 13) return 301 + draw.below(900);
  if (kind < 30) return draw.from(kTileEdges);
  return 2 + draw.below(299);
}

void draw_shape(Draw& draw, GpuCase& c) {
  static const std::vector<int64_t> kGroupRatios = {1, 2, 4, 8};
  c.batch = draw.one_in(4) ? 2 : 1;
  c.heads_kv = 1 + draw.below(2);
  c.heads_q = c.heads_kv * draw.from(kGroupRatios);  // heads_kv 1 with a ratio > 1: MQA
  c.n_q = draw_length(draw);
  c.n_kv = draw.one_in(5) ? c.n_q : draw_length(draw);
  if (std::max(c.n_q, c.n_kv) > 300) {
    // The long cases cost their references n_q * n_kv each: one batch, few heads.
    c.batch = 1;
    c.heads_q = std::min<int64_t>(c.heads_q, 2 * c.heads_kv);
  }
  // Half on a kernel tile's own head dim, half on any the GPU takes (most of those run
  // zero-padded on the next tile: issue 34).
  // fp16 PV has no kernel above d = 128 (gpu_has_kernel): such a draw is drawn again.
  // One floating-input case in six gives V a head dim of its own (MLA's kind), on the tile of
  // the larger dim.
  const bool own_v = !c.prequantized() && draw.one_in(6);
  do {
    c.head_dim = draw.one_in(2) ? draw.from(gpu_kernel_head_dim_list()) : draw.from(gpu_head_dim_list());
    c.head_dim_v = own_v ? draw.from(gpu_head_dim_list()) : 0;
  } while (!gpu_has_kernel(c.recipe, call_head_dim(c.head_dim, c.dv())));
  c.causal = draw.one_in(2);
  c.dtype = draw.one_in(2) ? DType::f16 : DType::bf16;
  c.layout = draw.one_in(2) ? Layout::HND : Layout::NHD;
  c.strided = draw.one_in(3);
  c.with_lse = draw.one_in(2);
}

// K smoothing's mean over another key stride than the preset's, in some cases that smooth K.
void draw_recipe_options(Draw& draw, GpuCase& c) {
  static const std::vector<int> kStrides = {1, 2, 8, 64};
  if (preset(c.recipe).smooth_k && draw.one_in(8)) c.k_mean_stride = draw.from(kStrides);
}

// The dtype's extreme magnitude most of the time, else log-uniform from 256 up to it. V is
// magnified only where its accumulator can hold it: an fp16 PV accumulator (sage1_t/b)
// overflows on near-uniform attention over |V| ~ 6e4 by design (docs/numerics.md, "fp16
// accumulator overflow"), while magnified Q and K make the attention one-hot. The LSE of
// magnified Q and K is ~1e9, where an absolute LSE bound means nothing: no LSE there.
void draw_extreme(Draw& draw, GpuCase& c) {
  const float top = c.dtype == DType::f16 ? kFp16Magnitude : kBf16Magnitude;
  c.magnitude = draw.below(3) < 2 ? top : float(256.0 * std::pow(double(top) / 256.0, draw.uniform()));
  const bool fp16_accumulator = preset(c.recipe).pv_accum == PVAccum::fp16;
  static const std::vector<std::string> kAll = {"qkv", "qk", "v"}, kQkFirst = {"qkv", "qk"};
  c.magnified = draw.from(fp16_accumulator ? kQkFirst : kAll);
  if (c.magnified != "v") c.with_lse = false;
}

// The rows of a causal (bottom-right) case below n_q - n_kv see no key: their output is 0
// whatever their Q holds, so a value planted there could reach nothing.
int64_t first_row_with_keys(const GpuCase& c) { return c.causal ? std::max<int64_t>(0, c.n_q - c.n_kv) : 0; }

PlantedValue draw_planted(Draw& draw, const GpuCase& c) {
  static const std::vector<float> kValues = {std::nanf(""), INFINITY, -INFINITY};
  PlantedValue p;
  p.tensor = "qkv"[draw.below(3)];
  p.value = draw.from(kValues);
  const bool q = p.tensor == 'q';
  const int64_t heads = q ? c.heads_q : c.heads_kv, n = q ? c.n_q : c.n_kv;
  const int64_t first = q ? first_row_with_keys(c) : 0;
  const int64_t b = draw.below(int(c.batch)), h = draw.below(int(heads));
  const int64_t dim = p.tensor == 'v' ? c.dv() : c.head_dim;
  const int64_t token = first + draw.below(int(n - first)), channel = draw.below(int(dim));
  p.index = ((b * heads + h) * n + token) * dim + channel;
  return p;
}

void draw_nonfinite(Draw& draw, GpuCase& c) {
  const int count = draw.below(10) < 7 ? 1 : draw.below(2) ? 2 : 3;
  for (int i = 0; i < count; ++i) c.planted.push_back(draw_planted(draw, c));
}

// Three in ten cases per variant draw a distribution (the other GPU tests run those widely),
// three extreme magnitudes, four planted values. Prequantized INT8 inputs cannot hold a NaN,
// so int_flash takes the first two families in those slots.
Family family_for_slot(int slot, const Variant& v) {
  const int kind = slot % 10;
  if (kind < 3) return Family::distribution;
  if (kind < 6) return Family::extreme;
  if (preset(v.recipe).inputs == Inputs::prequantized_int8) return slot % 2 ? Family::extreme : Family::distribution;
  return Family::nonfinite;
}

// The list: kCasesPerVariant cases per variant, the variants in turn.
std::vector<GpuCase> randomized_cases() {
  Draw draw(kListSeed);
  const std::vector<Variant> all = variants();
  std::vector<GpuCase> cases;
  for (int i = 0; i < kCasesPerVariant * int(all.size()); ++i) {
    const Variant& v = all[size_t(i) % all.size()];
    GpuCase c;
    c.recipe = v.recipe, c.v_per_channel = v.v_per_channel;
    c.seed = uint64_t(i);
    draw_shape(draw, c);
    draw_recipe_options(draw, c);
    c.distribution = draw.from(reference::synthetic_distributions());
    const Family family = family_for_slot(i / int(all.size()), v);
    if (family == Family::extreme) draw_extreme(draw, c);
    if (family == Family::nonfinite) draw_nonfinite(draw, c);
    cases.push_back(c);
  }
  return cases;
}

std::string where(const std::vector<GpuCase>& cases, size_t i) {
  return "randomized case " + std::to_string(i) + " of list seed " + std::to_string(kListSeed) + " (" +
         family_name(family_of(cases[i])) + "): " + cases[i].describe();
}

void expect_all_within_bounds(const std::vector<GpuCase>& cases, const std::vector<size_t>& which) {
  std::vector<GpuCase> chosen;
  for (size_t i : which) chosen.push_back(cases[i]);
  const std::vector<GpuResult> results = run_gpu_cases(chosen);
  size_t checked = 0;
  for (size_t k = 0; k < which.size(); ++k) {
    SCOPED_TRACE(where(cases, which[k]));
    checked += results[k].error.empty();
    expect_within_bounds(chosen[k], results[k]);
  }
  // A case the GPU path refused is a failure above; none may drop out of the count either.
  EXPECT_EQ(checked, which.size()) << "cases that did not run on the GPU";
}

TEST(Sm90Randomized, ThousandCasesAgainstTheSimulator) {
  SAGE_REQUIRE_GPU();
  const std::vector<GpuCase> cases = randomized_cases();
  ASSERT_GE(cases.size(), 1000u);
  std::vector<size_t> every(cases.size());
  for (size_t i = 0; i < every.size(); ++i) every[i] = i;
  expect_all_within_bounds(cases, every);
  std::printf("[randomized] %zu cases of list seed %llu compared with the simulator\n", cases.size(),
              (unsigned long long)kListSeed);
}

// For the compute-sanitizer stage (scripts/gpu_run.sh sanitize): the whole list would not fit
// its time limit, so the first short case of each variant in the two families the other
// Sm90Sanitize tests lack (extreme magnitudes and non-finite inputs).
std::vector<size_t> sanitizer_sample(const std::vector<GpuCase>& cases) {
  std::set<std::string> seen;
  std::vector<size_t> sample;
  for (size_t i = 0; i < cases.size(); ++i) {
    const GpuCase& c = cases[i];
    const Family family = family_of(c);
    const std::string key = c.recipe + (c.v_per_channel ? "+v_per_channel " : " ") + family_name(family);
    if (family != Family::distribution && std::max(c.n_q, c.n_kv) <= 200 && seen.insert(key).second)
      sample.push_back(i);
  }
  return sample;
}

TEST(Sm90Sanitize, RandomizedSample) {
  SAGE_REQUIRE_GPU();
  const std::vector<GpuCase> cases = randomized_cases();
  expect_all_within_bounds(cases, sanitizer_sample(cases));
}

// ---- without a GPU: the list itself, and the simulator on its non-finite cases ---------------

// How many cases have each value of an axis, printed for the record and checked for holes.
using Tally = std::map<std::string, int>;

void print_tally(const char* axis, const Tally& t) {
  std::printf("[randomized list] %s:", axis);
  for (const auto& [value, count] : t) std::printf(" %s %d", value.c_str(), count);
  std::printf("\n");
}

TEST(RandomizedGpuCases, ListCoversEveryAxis) {
  const std::vector<GpuCase> cases = randomized_cases();
  ASSERT_GE(cases.size(), 1000u);
  std::map<std::string, Tally> axes;
  for (const GpuCase& c : cases) {
    const std::string variant = c.recipe + (c.v_per_channel ? "+v_per_channel" : "");
    axes["variant"][variant]++;
    axes["family"][family_name(family_of(c))]++;
    axes["variant x family"][variant + "/" + family_name(family_of(c))]++;
    axes["layout"][layout_name(c.layout)]++;
    axes["dtype"][dtype_name(c.dtype)]++;
    axes["strided"][c.strided ? "yes" : "no"]++;
    axes["causal"][c.causal ? "yes" : "no"]++;
    axes["lse"][c.with_lse ? "yes" : "no"]++;
    axes["head_dim"][std::to_string(c.head_dim)]++;
    axes["v head dim"][c.dv() == c.head_dim ? "q's" : c.dv() < c.head_dim ? "narrower" : "wider"]++;
    axes["batch"][std::to_string(c.batch)]++;
    axes["heads"][c.heads_q == c.heads_kv ? "MHA" : c.heads_kv == 1 ? "MQA" : "GQA"]++;
    axes["distribution"][c.distribution]++;
    axes["lengths"][c.n_q == c.n_kv ? "equal" : c.n_q < c.n_kv ? "n_q<n_kv" : "n_q>n_kv"]++;
    axes["length 1"][c.n_q == 1 ? (c.n_kv == 1 ? "both" : "n_q") : c.n_kv == 1 ? "n_kv" : "neither"]++;
    axes["odd length"][(c.n_q % 2 || c.n_kv % 2) ? "yes" : "no"]++;
    axes["longest"][std::max(c.n_q, c.n_kv) > 300 ? "301-1200" : "<=300"]++;
    axes["k_mean_stride"][std::to_string(c.k_mean_stride)]++;
    if (c.magnitude > 0.f) {
      const bool top = c.magnitude == (c.dtype == DType::f16 ? kFp16Magnitude : kBf16Magnitude);
      axes["magnitude"][std::string(dtype_name(c.dtype)) + (top ? " at the limit" : " below")]++;
      axes["magnified"][c.magnified]++;
    }
    for (const PlantedValue& p : c.planted)
      axes["planted"][std::string(1, p.tensor) + (std::isnan(p.value) ? " nan" : p.value > 0 ? " +inf" : " -inf")]++;
    if (!c.planted.empty()) axes["planted per case"][std::to_string(c.planted.size())]++;
  }
  for (const auto& [axis, tally] : axes) print_tally(axis.c_str(), tally);

  const std::vector<Variant> all = variants();
  for (const Variant& v : all) {
    const std::string name = v.recipe + (v.v_per_channel ? "+v_per_channel" : "");
    EXPECT_EQ(axes["variant"][name], kCasesPerVariant) << name;
    EXPECT_GE(axes["variant x family"][name + "/extreme"], 20) << name;
    const int nonfinite = axes["variant x family"][name + "/nonfinite"];
    if (preset(v.recipe).inputs == Inputs::prequantized_int8) {
      EXPECT_EQ(nonfinite, 0) << name << ": INT8 inputs cannot hold a NaN";
    } else {
      EXPECT_GE(nonfinite, 20) << name;
    }
  }
  for (const char* axis : {"layout", "dtype", "strided", "causal", "lse"}) EXPECT_EQ(axes[axis].size(), 2u) << axis;
  EXPECT_EQ(axes["head_dim"].size(), gpu_head_dim_list().size());
  EXPECT_EQ(axes["v head dim"].size(), 3u);
  EXPECT_EQ(axes["batch"].size(), 2u);
  EXPECT_EQ(axes["heads"].size(), 3u);
  EXPECT_EQ(axes["distribution"].size(), reference::synthetic_distributions().size());
  EXPECT_GT(axes["distribution"]["channel_offset"], 0);
  EXPECT_EQ(axes["lengths"].size(), 3u);
  EXPECT_EQ(axes["length 1"].size(), 4u);
  EXPECT_GT(axes["odd length"]["yes"], 0);
  EXPECT_GT(axes["longest"]["301-1200"], 0);
  EXPECT_GT(axes["longest"]["<=300"], 9 * axes["longest"]["301-1200"]) << "mostly short sequences";
  EXPECT_GT(axes["magnitude"]["f16 at the limit"], 0);
  EXPECT_GT(axes["magnitude"]["bf16 at the limit"], 0);
  EXPECT_EQ(axes["magnified"].size(), 3u);
  EXPECT_EQ(axes["planted"].size(), 9u) << "NaN, +inf and -inf in each of q, k and v";
  // Both families for every variant but int_flash's two, which take no NaN.
  EXPECT_EQ(sanitizer_sample(cases).size(), 2 * all.size() - 2);
}

// One tensor of case_values against the case: the planted values where the case puts them and
// no other non-finite value; when magnified, its largest |value| at the magnitude and inside
// the input dtype's range.
void expect_tensor_as_planned(const GpuCase& c, char name, const std::vector<float>& x) {
  std::set<int64_t> planted_here;
  for (const PlantedValue& p : c.planted) {
    if (p.tensor != name) continue;
    planted_here.insert(p.index);
    const float got = x[size_t(p.index)];
    EXPECT_TRUE(std::isnan(p.value) ? std::isnan(got) : got == p.value) << name << " at " << p.index;
  }
  int64_t nonfinite = 0;
  float amax = 0.f;
  for (float e : x) {
    nonfinite += !std::isfinite(e);
    if (std::isfinite(e)) amax = std::max(amax, std::fabs(e));
  }
  EXPECT_EQ(nonfinite, int64_t(planted_here.size())) << name;
  if (c.magnitude > 0.f && c.magnified.find(name) != std::string::npos) {
    EXPECT_NEAR(amax, c.magnitude, c.magnitude * 1e-6) << name;
    const float stored = c.dtype == DType::f16 ? fmt::round_fp16(amax) : fmt::round_bf16(amax);
    EXPECT_LE(stored, c.dtype == DType::f16 ? kFp16Magnitude : kBf16Magnitude) << name;
  }
}

// The inputs the harness builds for the list's extreme and non-finite cases (a sample).
TEST(RandomizedGpuCases, InputsHoldThePlantedValuesAndMagnitudes) {
  const std::vector<GpuCase> cases = randomized_cases();
  int checked = 0;
  for (size_t i = 0; i < cases.size() && checked < 60; ++i) {
    const GpuCase& c = cases[i];
    if (family_of(c) == Family::distribution || std::max(c.n_q, c.n_kv) > 300) continue;
    SCOPED_TRACE(where(cases, i));
    ++checked;
    const CaseValues x = case_values(c);
    expect_tensor_as_planned(c, 'q', x.q);
    expect_tensor_as_planned(c, 'k', x.k);
    expect_tensor_as_planned(c, 'v', x.v);
  }
  EXPECT_EQ(checked, 60);
}

// The simulator's output for one case, from contiguous HND inputs in the case's dtype.
struct HostRun {
  std::vector<float> out, lse, exact_out, exact_lse;
};

std::vector<uint16_t> stored_bits(const std::vector<float>& x, DType dtype) {
  std::vector<uint16_t> bits(x.size());
  for (size_t i = 0; i < x.size(); ++i) bits[i] = dtype == DType::f16 ? fmt::fp16_bits(x[i]) : fmt::bf16_bits(x[i]);
  return bits;
}

HostRun simulate_on_host(const GpuCase& c) {
  const CaseValues x = case_values(c);
  std::vector<uint16_t> q = stored_bits(x.q, c.dtype), k = stored_bits(x.k, c.dtype), v = stored_bits(x.v, c.dtype);
  HostRun r;
  r.out.resize(size_t(c.batch * c.heads_q * c.n_q * c.dv())), r.exact_out.resize(r.out.size());
  if (c.with_lse) r.lse.resize(size_t(c.batch * c.heads_q * c.n_q)), r.exact_lse.resize(r.lse.size());
  AttentionArgs a;
  a.recipe = c.recipe_options();
  a.causal = c.causal;
  a.layout = Layout::HND;
  a.q = contiguous_view(q.data(), c.dtype, {c.batch, c.heads_q, c.n_q, c.head_dim});
  a.k = contiguous_view(k.data(), c.dtype, {c.batch, c.heads_kv, c.n_kv, c.head_dim});
  a.v = contiguous_view(v.data(), c.dtype, {c.batch, c.heads_kv, c.n_kv, c.dv()});
  a.out = contiguous_view(r.out.data(), DType::f32, {c.batch, c.heads_q, c.n_q, c.dv()});
  if (c.with_lse) a.lse = contiguous_view(r.lse.data(), DType::f32, {c.batch, c.heads_q, c.n_q});
  reference::simulate(a);
  a.out.data = r.exact_out.data();
  if (c.with_lse) a.lse.data = r.exact_lse.data();
  reference::exact(a);
  return r;
}

// The list's non-finite cases on the simulator, two per recipe: each planted value reaches the
// output, and nothing float64 attention makes non-finite comes out finite (the specification's
// "never absorbed"; its exact pattern per recipe is tests/cpu's). The kernel's side of the same
// comparison is compare_nonfinite with the kernel's output, here the simulator's own as the
// output dtype stores it, which must match itself.
TEST(RandomizedGpuCases, PlantedValuesReachTheSimulatorOutput) {
  const std::vector<GpuCase> cases = randomized_cases();
  std::map<std::string, int> per_recipe;
  int checked = 0;
  for (size_t i = 0; i < cases.size(); ++i) {
    const GpuCase& c = cases[i];
    if (family_of(c) != Family::nonfinite || std::max(c.n_q, c.n_kv) > 300 || per_recipe[c.recipe] >= 2) continue;
    per_recipe[c.recipe]++;
    SCOPED_TRACE(where(cases, i));
    ++checked;
    const HostRun r = simulate_on_host(c);
    std::vector<float> as_kernel(r.out.size());
    for (size_t e = 0; e < r.out.size(); ++e)
      as_kernel[e] = c.dtype == DType::f16 ? fmt::round_fp16(r.out[e]) : fmt::round_bf16(r.out[e]);
    const NonFiniteStats s = compare_nonfinite(c.dtype, as_kernel, r.out, r.exact_out, r.lse, r.lse, r.exact_lse);
    EXPECT_EQ(s.mismatched, 0);
    EXPECT_GT(s.in_output, 0) << "the planted values reached no output of the simulator";
    EXPECT_EQ(s.absorbed, 0) << "non-finite in float64 attention, finite in the simulator";
  }
  size_t floating_presets = 0;
  for (const std::string& name : gpu_presets()) floating_presets += preset(name).inputs == Inputs::floating;
  EXPECT_EQ(per_recipe.size(), floating_presets) << "every GPU preset with floating-point inputs";
  EXPECT_EQ(checked, 2 * int(per_recipe.size()));
}

}  // namespace
}  // namespace sage::testing
