// The sm_90 attention path against the CPU simulator (tight) and exact attention (the
// recipe's bound), for every preset that has a Hopper kernel, over the shape list of the
// fast-path issue and a seeded random sweep.
//
// Time: the GPU part of a case takes milliseconds; the host references (simulate and float64
// exact) take the time, so each test hands all its cases to run_gpu_cases, which computes the
// references in parallel. The full sequence-length list (up to 4097) runs for every preset at
// d = 128 fp16; the other axes (lengths that differ, GQA/MQA, batch, layouts, dtypes, head
// dims, strides, distributions) run for every preset on shorter sequences.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>

#include "gpu_harness.h"
#include "reference/synthetic.h"

#ifdef SAGE_WITH_CUDA
#include "sm90/fwd/tile_scheduler.h"
#endif

namespace sage::testing {
namespace {

// The cases `make` adds for one variant, for every variant.
std::vector<GpuCase> for_every_variant(const std::function<void(const GpuCase&, std::vector<GpuCase>&)>& make) {
  std::vector<GpuCase> cases;
  for (const Variant& v : variants()) {
    GpuCase base;
    base.recipe = v.recipe;
    base.v_per_channel = v.v_per_channel;
    make(base, cases);
  }
  // Not the PV paths without a kernel at a head dim (gpu_has_kernel): Fp16PvIsRefusedAbove128.
  cases.erase(std::remove_if(cases.begin(), cases.end(),
                             [](const GpuCase& c) {
                               return !gpu_has_kernel(c.recipe, call_head_dim(c.head_dim, c.dv())) ||
                                      (c.dv() != c.head_dim && c.prequantized());
                             }),
              cases.end());
  return cases;
}

// Issue 34: fp16 P and V have no kernel above d = 128 (shared memory), nor SageBwd's
// int8_dynamic path (no split PV MMA); the call is refused naming the recipe, on a tile's own
// head dim and on a padded one.
TEST(Sm90Attention, Fp16PvIsRefusedAbove128) {
  SAGE_REQUIRE_GPU();
  std::vector<GpuCase> cases;
  for (int64_t d : harness_head_dims())
    for (const char* recipe : {"sage1_t", "sage1_b", "sagebwd"}) {
      GpuCase c;
      c.recipe = recipe, c.head_dim = d, c.n_q = 100, c.n_kv = 130;
      if (!gpu_has_kernel(c.recipe, d)) cases.push_back(c);
    }
  if (cases.empty()) GTEST_SKIP() << "no head dim above 128 in this build";
  const std::vector<GpuResult> results = run_gpu_cases(cases);
  for (size_t i = 0; i < cases.size(); ++i)
    EXPECT_NE(results[i].error.find("has no sm_90 kernel at head_dim"), std::string::npos)
        << cases[i].describe() << ": " << results[i].error;
}

TEST(Sm90Attention, EveryPresetButFp4HasAKernel) {
  SAGE_REQUIRE_GPU();
  for (const Recipe& r : presets()) {
    const auto& cpu_only = cpu_only_presets();
    const bool want = std::find(cpu_only.begin(), cpu_only.end(), r.name) == cpu_only.end();
    EXPECT_EQ(gpu_supports(r), want) << r.name;
  }
  for (const Variant& v : variants()) {
    GpuCase c;
    c.recipe = v.recipe, c.v_per_channel = v.v_per_channel;
    EXPECT_TRUE(gpu_supports(c.recipe_options())) << c.describe();
  }
}

TEST(Sm90Attention, SequenceLengths) {
  SAGE_REQUIRE_GPU();
  expect_cases_within_bounds(for_every_variant([](const GpuCase& base, std::vector<GpuCase>& out) {
    for (int64_t n : {1, 7, 64, 113, 127, 128, 129, 1000, 1023, 4097})
      for (bool causal : {false, true}) {
        GpuCase c = base;
        c.n_q = c.n_kv = n;
        c.heads_q = c.heads_kv = n > 2000 ? 1 : 2;
        c.causal = causal;
        c.seed = uint64_t(n);
        out.push_back(c);
      }
  }));
}

TEST(Sm90Attention, QueryAndKeyLengthsDiffer) {
  SAGE_REQUIRE_GPU();
  expect_cases_within_bounds(for_every_variant([](const GpuCase& base, std::vector<GpuCase>& out) {
    const int64_t pairs[][2] = {{64, 300}, {300, 64}, {1, 513}, {513, 1}, {200, 129}, {129, 1000}};
    for (const auto& nn : pairs)
      for (bool causal : {false, true}) {
        GpuCase c = base;
        c.n_q = nn[0], c.n_kv = nn[1], c.causal = causal;
        c.seed = uint64_t(nn[0] * 7 + nn[1]);
        out.push_back(c);
      }
  }));
}

TEST(Sm90Attention, GroupedQueryAndMultiQuery) {
  SAGE_REQUIRE_GPU();
  expect_cases_within_bounds(for_every_variant([](const GpuCase& base, std::vector<GpuCase>& out) {
    for (int64_t ratio : {1, 4, 8}) {
      GpuCase c = base;
      c.heads_kv = 2, c.heads_q = 2 * ratio, c.n_q = c.n_kv = 200;
      c.seed = uint64_t(ratio);
      out.push_back(c);
    }
    GpuCase mqa = base;
    mqa.heads_kv = 1, mqa.heads_q = 8, mqa.n_q = mqa.n_kv = 257, mqa.causal = true;
    out.push_back(mqa);
  }));
}

TEST(Sm90Attention, BatchLayoutsDtypesHeadDims) {
  SAGE_REQUIRE_GPU();
  expect_cases_within_bounds(for_every_variant([](const GpuCase& base, std::vector<GpuCase>& out) {
    for (int64_t batch : {1, 3})
      for (Layout layout : {Layout::HND, Layout::NHD})
        for (DType dt : {DType::f16, DType::bf16})
          for (int64_t d : harness_head_dims()) {
            GpuCase c = base;
            c.batch = batch, c.layout = layout, c.dtype = dt, c.head_dim = d;
            c.n_q = 150, c.n_kv = 333, c.heads_q = 4, c.heads_kv = 2;
            c.seed = uint64_t(batch * 100 + d + (dt == DType::bf16) * 7 + (layout == Layout::NHD) * 3);
            out.push_back(c);
          }
  }));
}

// Issue 34's MLA shape and its kin: V with a head dim of its own, the kernel on the tile of the
// larger dim with the other tensor's channels zero-padded. 192 / 128 (DeepSeek's prefill), V
// narrower on its own tile (128 / 64) and wider than Q/K (64 / 128, 40 / 96), with GQA, causal
// and both layouts. Prequantized inputs are left out: their V scales have one head dim.
std::vector<GpuCase> v_head_dim_cases(bool strided) {
  struct Dims { int64_t d, dv; bool causal; };
  static const Dims kDims[] = {{192, 128, false}, {192, 128, true}, {128, 64, true}, {64, 128, false}, {40, 96, true}};
  const std::vector<int64_t> accepted = gpu_head_dim_list();  // a build of some tiles has fewer
  auto built = [&](int64_t d) { return std::find(accepted.begin(), accepted.end(), d) != accepted.end(); };
  return for_every_variant([strided, built](const GpuCase& base, std::vector<GpuCase>& out) {
    for (const Dims& x : kDims) {
      if (!built(x.d) || !built(x.dv)) continue;
      GpuCase c = base;
      c.head_dim = x.d, c.head_dim_v = x.dv, c.causal = x.causal;
      c.heads_q = 4, c.heads_kv = 2, c.n_q = 150, c.n_kv = 333;
      c.layout = x.causal ? Layout::NHD : Layout::HND, c.strided = strided;
      c.seed = uint64_t(x.d * 1000 + x.dv);
      out.push_back(c);
    }
  });
}

TEST(Sm90Attention, VHeadDimOfItsOwn) {
  SAGE_REQUIRE_GPU();
  const std::vector<GpuCase> cases = v_head_dim_cases(false);
  ASSERT_GE(cases.size(), 30u);  // every GPU recipe at 64 / 128 and 128 / 64, most at 192 / 128
  expect_cases_within_bounds(cases);
}

TEST(Sm90Attention, StridedViewsWithStorageOffsets) {
  SAGE_REQUIRE_GPU();
  // Padded strides and storage offsets on q, k, v, out, the LSE and (int_flash) the scales.
  expect_cases_within_bounds(for_every_variant([](const GpuCase& base, std::vector<GpuCase>& out) {
    for (Layout layout : {Layout::HND, Layout::NHD})
      for (DType dt : {DType::f16, DType::bf16}) {
        GpuCase c = base;
        c.strided = true, c.layout = layout, c.dtype = dt, c.batch = 2, c.heads_q = 4, c.heads_kv = 2;
        c.n_q = 190, c.n_kv = 260, c.causal = layout == Layout::NHD;
        c.seed = uint64_t(dt == DType::bf16);
        out.push_back(c);
      }
  }));
}

TEST(Sm90Attention, SyntheticDistributions) {
  SAGE_REQUIRE_GPU();
  expect_cases_within_bounds(for_every_variant([](const GpuCase& base, std::vector<GpuCase>& out) {
    for (const std::string& dist : reference::synthetic_distributions()) {
      GpuCase c = base;
      c.distribution = dist, c.n_q = c.n_kv = 512;
      out.push_back(c);
    }
  }));
}

// qk_channel_balance (docs/numerics.md step 2) on every GPU recipe with floating inputs: the
// Q channel-range pass, the balance scales of the statistics pass, the balanced K codes and
// the consumers' Q prologue, against the simulator (the Q stage's balanced path is held to
// the prologue's bits by ChainedWorkItemsPerCta and QStageMatchesConsumerPrologue, through
// sage2_8b_balanced). On channel_offset, where the scales are far from 1, and on normal;
// GQA (the ranges span the group's query heads), both head dims, causal or not, lengths that
// leave partial tiles and make the statistics sample stride-8 keys and tokens unevenly.
TEST(Sm90Attention, ChannelBalanceOnEveryRecipe) {
  SAGE_REQUIRE_GPU();
  std::vector<GpuCase> cases = for_every_variant([](const GpuCase& base, std::vector<GpuCase>& out) {
    // Prequantized inputs and recipes with a backward refuse the balance by name
    // (tests/cpu/test_channel_balance.cpp).
    if (base.prequantized() || has_backward(preset(base.recipe))) return;
    for (int64_t d : harness_head_dims())
      for (bool causal : {false, true})
        for (const char* dist : {"channel_offset", "normal"}) {
          GpuCase c = base;
          c.balance = true, c.head_dim = d, c.causal = causal, c.distribution = dist;
          c.heads_q = 8, c.heads_kv = 2, c.n_q = 777, c.n_kv = 1001;
          c.dtype = causal ? DType::bf16 : DType::f16;
          c.seed = uint64_t(d) + causal;
          out.push_back(c);
        }
  });
  expect_cases_within_bounds(cases);
}

// P's scale in the exponent (docs/numerics.md step 6) on the paths the presets' usual inputs
// leave alone: a P scale that is no power of two (the paper's 448: every exponent adds its
// rounded log2) or 64 (k = 6), and inputs near the fp16 limit, whose multipliers (~3e4) are
// far above the fold's limit, so every thread adds k after the FFMA (the default's 256
// included). Both head dims, full and causal; the huge inputs without the LSE, whose ~1e10
// magnitude makes an absolute bound meaningless.
TEST(Sm90Attention, PScaleInTheExponentOffThePresets) {
  SAGE_REQUIRE_GPU();
  std::vector<GpuCase> cases;
  for (int64_t d : harness_head_dims())
    for (bool causal : {false, true}) {
      GpuCase c;
      c.head_dim = d, c.causal = causal, c.n_q = 200, c.n_kv = 300, c.seed = uint64_t(d + causal);
      for (float p_range : {448.f, 64.f})
        for (const char* dist : {"normal", "outliers"}) {
          c.p_range = p_range, c.distribution = dist;
          cases.push_back(c);
        }
      for (float p_range : {0.f, 64.f}) {
        c.p_range = p_range, c.distribution = "huge", c.with_lse = false;
        cases.push_back(c);
      }
    }
  expect_cases_within_bounds(cases);
}

TEST(Sm90Attention, NoNaNOnZerosAndNearFp16Limit) {
  SAGE_REQUIRE_GPU();
  std::vector<GpuCase> cases = for_every_variant([](const GpuCase& base, std::vector<GpuCase>& out) {
    for (const char* dist : {"zeros", "huge"}) {
      // An fp16 PV accumulator (sage1_t, sage1_b) overflows on |V| ~ 6e4 by design, in the
      // hardware and in the simulator alike (docs/numerics.md, "fp16 accumulator overflow"):
      // those recipes assume |V| well inside fp16, so they get the zeros only.
      if (std::string(dist) == "huge" && preset(base.recipe).pv_accum == PVAccum::fp16) continue;
      for (bool causal : {false, true}) {
        GpuCase c = base;
        c.distribution = dist, c.causal = causal, c.n_q = 130, c.n_kv = 250;
        out.push_back(c);
      }
    }
  });
  const std::vector<GpuResult> results = run_gpu_cases(cases);
  for (size_t i = 0; i < cases.size(); ++i) {
    const GpuCase& c = cases[i];
    const GpuResult& r = results[i];
    ASSERT_TRUE(r.error.empty()) << c.describe() << ": " << r.error;
    EXPECT_EQ(r.unwritten, 0) << c.describe();
    EXPECT_EQ(r.vs_sim.nonfinite, 0) << c.describe();
    if (c.distribution == "zeros") {
      EXPECT_EQ(r.vs_exact.max_abs, 0.0) << c.describe();  // uniform attention over zero V
    }
  }
}

TEST(Sm90Attention, FullyMaskedRowsAreZero) {
  SAGE_REQUIRE_GPU();
  // n_q > n_kv with causal bottom-right: the first n_q - n_kv rows see no key (out 0, LSE -inf).
  expect_cases_within_bounds(for_every_variant([](const GpuCase& base, std::vector<GpuCase>& out) {
    GpuCase c = base;
    c.n_q = 300, c.n_kv = 100, c.causal = true;
    out.push_back(c);
  }));
}

TEST(Sm90Attention, RepeatedRunsAreBitIdentical) {
  SAGE_REQUIRE_GPU();
  for (const Variant& v : variants()) {
    GpuCase c;
    c.recipe = v.recipe, c.v_per_channel = v.v_per_channel;
    c.n_q = c.n_kv = 1000, c.causal = true, c.heads_q = 4, c.heads_kv = 2;
    const GpuResult a = run_gpu_case(c, false), b = run_gpu_case(c, false);
    EXPECT_EQ(a.out_bits, b.out_bits) << c.describe();
    EXPECT_EQ(a.lse, b.lse) << c.describe();
  }
}

#ifdef SAGE_WITH_CUDA
// Pins the number of work items per CTA and their order (sm90/fwd/tile_scheduler.h) for the
// test's lifetime.
class PinnedWorkItems {
 public:
  explicit PinnedWorkItems(int items,
                           sm90::WorkOrderOverride order = sm90::WorkOrderOverride::automatic) {
    sm90::ScheduleOverrides o = sm90::schedule_overrides();
    o.items_per_cta = items, o.order = order;
    sm90::set_schedule_overrides(o);
  }
  ~PinnedWorkItems() {
    sm90::ScheduleOverrides o = sm90::schedule_overrides();
    o.items_per_cta = 0, o.order = sm90::WorkOrderOverride::automatic;
    sm90::set_schedule_overrides(o);
  }
};

const char* order_name(sm90::WorkOrderOverride order) {
  switch (order) {
    case sm90::WorkOrderOverride::consecutive: return "consecutive";
    case sm90::WorkOrderOverride::grouped: return "grouped";
    case sm90::WorkOrderOverride::strided: return "strided";
    case sm90::WorkOrderOverride::automatic: break;
  }
  return "automatic";
}

// the tile scheduler's orders, for the tests that run each.
constexpr sm90::WorkOrderOverride kEveryOrder[] = {sm90::WorkOrderOverride::consecutive,
                                                   sm90::WorkOrderOverride::grouped,
                                                   sm90::WorkOrderOverride::strided};
#endif

// Several work items (Q tiles) per CTA: the producer's ring carries over from one item to the
// next, so each item must still see its own tiles, in order. The test shapes are too small
// for the launch to chain items by itself, so the count is pinned: every output and LSE bit
// must equal one item per CTA, and the chained run must stay within the simulator bounds
// (which also checks that every output element is written). Each of the tile scheduler's orders
// runs every shape (in the strided one the pinned count is rounded to whole units: pairs of
// causal items). The shapes give items of uneven length (causal), items with no K/V tile
// (n_q > n_kv, causal), heads changing inside a CTA's run (GQA, batch), and an item count
// that the items per CTA do not divide (in the grouped order, a last, partial group of
// heads).
TEST(Sm90Attention, ChainedWorkItemsPerCta) {
  SAGE_REQUIRE_GPU();
#ifdef SAGE_WITH_CUDA
  std::vector<GpuCase> shapes;
  {
    GpuCase c;
    c.n_q = c.n_kv = 1000, c.causal = true, c.heads_q = 4, c.heads_kv = 2, c.batch = 2;
    shapes.push_back(c);
    c = GpuCase{};
    c.n_q = 700, c.n_kv = 300, c.causal = true, c.heads_q = 3, c.heads_kv = 1;
    shapes.push_back(c);
    c = GpuCase{};
    c.n_q = 300, c.n_kv = 1100, c.head_dim = 64, c.layout = Layout::NHD, c.strided = true;
    c.batch = 3;
    shapes.push_back(c);
  }
  std::vector<GpuCase> chained_cases;
  for (const Variant& v : variants()) {
    for (GpuCase c : shapes) {
      c.recipe = v.recipe, c.v_per_channel = v.v_per_channel;
      GpuResult single;
      {
        PinnedWorkItems one(1, sm90::WorkOrderOverride::consecutive);
        single = run_gpu_case(c, false);
      }
      for (const auto order : kEveryOrder)
        for (int items : {2, 3, 5}) {
          PinnedWorkItems chained(items, order);
          const GpuResult r = run_gpu_case(c, false);
          EXPECT_EQ(r.out_bits, single.out_bits)
              << c.describe() << ", " << items << " items per CTA, " << order_name(order) << " order";
          EXPECT_EQ(r.lse, single.lse)
              << c.describe() << ", " << items << " items per CTA, " << order_name(order) << " order";
        }
      chained_cases.push_back(c);
    }
  }
  PinnedWorkItems chained(3, sm90::WorkOrderOverride::grouped);
  expect_cases_within_bounds(chained_cases);
#endif
}

// The Q stage (sm90/q_stage.cuh) against the consumers' prologue (q_operand.cuh): the same
// codes and scales by construction, so every output and LSE bit must agree. The stage takes a
// CTA's items after its first, one item ahead in two buffers, so items are chained (2, 3 and 5
// per CTA: one buffer, both reused, several rounds), in each of the tile scheduler's orders. The
// shapes give partial last Q tiles (rows past n_q arrive from TMA as zeros), items of uneven
// length and items with no K/V tile (causal, n_q > n_kv), heads changing inside a CTA's run
// (GQA, batch), d = 64 (192-row tiles, three consumer warpgroups) and 128, fp16 and bf16, HND
// and NHD, for every GPU preset (those without the stage must simply agree with themselves,
// once). The stage is not taken for the LSE under K smoothing (q . mean(K) needs raw Q), so
// the LSE goes through it with K smoothing off. The launches that took the stage are counted,
// so the comparison cannot pass with the stage never taken.
TEST(Sm90Attention, QStageMatchesConsumerPrologue) {
  SAGE_REQUIRE_GPU();
#ifdef SAGE_WITH_CUDA
  struct PinnedQStage {
    explicit PinnedQStage(sm90::QStageOverride mode) { set(mode); }
    ~PinnedQStage() { set(sm90::QStageOverride::automatic); }
    static void set(sm90::QStageOverride mode) {
      sm90::ScheduleOverrides o = sm90::schedule_overrides();
      o.q_stage = mode;
      sm90::set_schedule_overrides(o);
    }
  };
  std::vector<GpuCase> shapes;
  {
    GpuCase c;
    c.n_q = c.n_kv = 1000, c.causal = true, c.heads_q = 4, c.heads_kv = 2, c.batch = 2;
    c.with_lse = false;
    shapes.push_back(c);
    c.with_lse = true, c.no_smooth_k = true;
    shapes.push_back(c);
    c = GpuCase{};
    c.n_q = 700, c.n_kv = 300, c.head_dim = 64, c.dtype = DType::bf16, c.layout = Layout::NHD;
    c.heads_q = 3, c.heads_kv = 1, c.with_lse = false;
    shapes.push_back(c);
    c = GpuCase{};
    c.n_q = 700, c.n_kv = 300, c.causal = true, c.heads_q = 3, c.heads_kv = 1;
    c.with_lse = true, c.no_smooth_k = true;
    shapes.push_back(c);
    c.head_dim = 64;
    shapes.push_back(c);
    c = GpuCase{};
    c.n_q = 130, c.n_kv = 1100, c.head_dim = 64, c.batch = 3, c.with_lse = false;
    shapes.push_back(c);
  }
  const int64_t staged_before = sm90::q_stage_launches();
  for (const Variant& v : variants()) {
    for (GpuCase c : shapes) {
      c.recipe = v.recipe, c.v_per_channel = v.v_per_channel;
      bool staged = true;  // whether this recipe and shape take the stage (the first run says)
      for (const auto order : kEveryOrder)
        for (int items : {2, 3, 5}) {
          // A variant that did not take the stage runs the same kernel both ways: its first
          // comparison is all there is to check.
          if (!staged) continue;
          const int64_t launches_before = sm90::q_stage_launches();
          PinnedWorkItems pinned(items, order);
          GpuResult prologue, stage;
          {
            PinnedQStage off(sm90::QStageOverride::off);
            prologue = run_gpu_case(c, false);
          }
          {
            PinnedQStage on(sm90::QStageOverride::on);
            stage = run_gpu_case(c, false);
          }
          const std::string where = c.describe() + ", " + std::to_string(items) +
                                    " items per CTA, " + order_name(order) + " order";
          EXPECT_EQ(stage.out_bits, prologue.out_bits) << where;
          EXPECT_EQ(stage.lse, prologue.lse) << where;
          staged = sm90::q_stage_launches() > launches_before;
        }
      // sage2_8b (per-thread Q groups) takes the stage on every shape, the LSE ones included.
      if (c.recipe == "sage2_8b") EXPECT_TRUE(staged) << c.describe() << ": the Q stage was not taken";
    }
  }
  EXPECT_GE(sm90::q_stage_launches() - staged_before, 36);
#endif
}

// A seeded sweep over recipes, shapes, strides, GQA ratios, causal, dtype and distributions.
TEST(Sm90Attention, RandomizedAgainstSimulator) {
  SAGE_REQUIRE_GPU();
  reference::Rng rng(20261122);
  const std::vector<Variant> all = variants();
  const int kCases = 200;
  std::vector<GpuCase> cases;
  for (int i = 0; i < kCases; ++i) {
    GpuCase c;
    auto pick = [&](int n) { return int(rng.next() % uint64_t(n)); };
    c.batch = 1 + pick(3);
    c.heads_kv = 1 + pick(2);
    static const int64_t kRatios[] = {1, 2, 4, 8};
    c.heads_q = c.heads_kv * kRatios[pick(4)];
    c.n_q = 1 + pick(400);
    c.n_kv = pick(5) == 0 ? c.n_q : 1 + pick(400);
    c.head_dim = pick(2) ? 128 : 64;
    c.causal = pick(2);
    c.dtype = pick(2) ? DType::f16 : DType::bf16;
    c.layout = pick(2) ? Layout::HND : Layout::NHD;
    c.strided = pick(3) == 0;
    c.with_lse = pick(2);
    // Recipes in turn rather than drawn, so each gets 200 / 12 = 16 or 17 random cases.
    const Variant& v = all[size_t(i) % all.size()];
    c.recipe = v.recipe, c.v_per_channel = v.v_per_channel;
    c.distribution = reference::synthetic_distributions()[pick(int(reference::synthetic_distributions().size()))];
    // K smoothing's mean over other key strides than the preset's (1 for most, 8 for sage2_8b)
    // in a quarter of the cases that smooth K; 64 leaves one to seven sampled keys here.
    static const int kStrides[] = {1, 2, 8, 64};
    if (pick(4) == 0 && preset(c.recipe).smooth_k) c.k_mean_stride = kStrides[pick(4)];
    c.seed = uint64_t(i);
    cases.push_back(c);
  }
  expect_cases_within_bounds(cases);
}

// RowSum::pv_mma (the SageAttention2 presets): from d = 128 the kernel sums P in its PV MMA,
// which every preset case above checks against the simulator's model of that sum. Below d =
// 128 the recipe sums the float P~, so float_p runs there and gives the same bits; at d = 128
// float_p has no kernel and is refused by name, not run with the other sum.
TEST(Sm90Attention, RowSumFromThePvMma) {
  SAGE_REQUIRE_GPU();
  for (const char* name : {"sage2_8b", "sage2_4b"}) {
    GpuCase c;
    c.recipe = name, c.head_dim = 64, c.n_q = 300, c.n_kv = 333, c.causal = true;
    c.float_row_sum = true;
    const GpuResult float_sum = run_gpu_case(c, false);
    c.float_row_sum = false;
    const GpuResult mma_rule = run_gpu_case(c, false);
    EXPECT_EQ(float_sum.out_bits, mma_rule.out_bits) << c.describe();
    EXPECT_EQ(float_sum.lse, mma_rule.lse) << c.describe();
    c.head_dim = 128, c.float_row_sum = true;
    try {
      run_gpu_case(c, false);
      ADD_FAILURE() << c.describe() << " ran with the PV MMA's row sum";
    } catch (const Error& e) {
      EXPECT_EQ(e.argument(), "recipe.row_sum");
      EXPECT_NE(std::string(e.what()).find("pv_mma"), std::string::npos) << e.what();
    }
  }
}

TEST(Sm90Attention, UnsupportedRecipeIsRefusedByName) {
  SAGE_REQUIRE_GPU();
  for (const std::string& name : cpu_only_presets()) {
    GpuCase c;
    c.recipe = name;
    EXPECT_FALSE(gpu_supports(preset(name))) << name;
    try {
      run_gpu_case(c, false);
      ADD_FAILURE() << name << " ran on the GPU path";
    } catch (const Error& e) {
      EXPECT_EQ(e.argument(), "recipe");
      EXPECT_NE(std::string(e.what()).find(name), std::string::npos) << e.what();
    }
  }
}

// Two modest cases per recipe for the compute-sanitizer stage of scripts/gpu_run.sh: memcheck
// and racecheck run kernels 10-100x slower, so the lists above would not fit its time limit.
// Between them: GQA and MQA, n_q above and below n_kv with partial last tiles, causal and not,
// strided NHD and contiguous HND views, both head dims (two consumer warpgroups at d = 128,
// three at d = 64).
TEST(Sm90Sanitize, EveryRecipeTwice) {
  SAGE_REQUIRE_GPU();
  expect_cases_within_bounds(for_every_variant([](const GpuCase& base, std::vector<GpuCase>& out) {
    GpuCase a = base;
    a.heads_q = 4, a.heads_kv = 2, a.n_q = 200, a.n_kv = 333, a.causal = true;
    a.layout = Layout::NHD, a.strided = true, a.head_dim = 128;
    out.push_back(a);
    GpuCase b = base;
    b.heads_q = 8, b.heads_kv = 1, b.n_q = 300, b.n_kv = 100, b.dtype = DType::bf16, b.seed = 1;
    b.head_dim = 64;
    out.push_back(b);
  }));
}

// Issue 34 under the sanitizers: every kernel tile other than 64 and 128 on its own head dim,
// and a head dim zero-padded on each (the bounded Q loads and output stores, the padded
// workspace), strided NHD so that a load or store past the caller's head dim lands in the next
// head's row or the padding.
TEST(Sm90Sanitize, NewHeadDims) {
  SAGE_REQUIRE_GPU();
  expect_cases_within_bounds(for_every_variant([](const GpuCase& base, std::vector<GpuCase>& out) {
    for (int64_t d : harness_head_dims()) {
      if (d == 64 || d == 128) continue;  // EveryRecipeTwice has them
      GpuCase c = base;
      c.heads_q = 4, c.heads_kv = 2, c.n_q = 150, c.n_kv = 200, c.causal = d % 64 != 0;
      c.layout = Layout::NHD, c.strided = true, c.head_dim = d, c.seed = uint64_t(d);
      out.push_back(c);
    }
  }));
}

// V's own head dim under the sanitizers, strided: a V load or an output store past V's head
// dim lands in the next row or the padding.
TEST(Sm90Sanitize, VHeadDimOfItsOwn) {
  SAGE_REQUIRE_GPU();
  std::vector<GpuCase> cases = v_head_dim_cases(true);
  // One recipe of each PV path is enough under the tools (each case is slow there).
  cases.erase(std::remove_if(cases.begin(), cases.end(),
                             [](const GpuCase& c) { return c.recipe != "sage2_8b" && c.recipe != "sage1_b"; }),
              cases.end());
  ASSERT_GE(cases.size(), 4u);  // two recipes at 128 / 64 and 64 / 128 at least
  expect_cases_within_bounds(cases);
}

// Chained work items under the sanitizers: shared memory reused from one item to the next
// (the Q tile, Q statistics, Q smoothing's key biases) and the ring's phases across items.
TEST(Sm90Sanitize, ChainedWorkItems) {
  SAGE_REQUIRE_GPU();
#ifdef SAGE_WITH_CUDA
  // Causal items in the grouped order (not a choice the launch makes by itself): CTAs whose
  // items differ in length, from several heads; and in the strided order, pairs of items from
  // several heads per CTA.
  for (const auto order : {sm90::WorkOrderOverride::grouped, sm90::WorkOrderOverride::strided}) {
    PinnedWorkItems chained(order == sm90::WorkOrderOverride::strided ? 4 : 3, order);
    expect_cases_within_bounds(for_every_variant([](const GpuCase& base, std::vector<GpuCase>& out) {
      for (int64_t d : harness_head_dims()) {
        GpuCase c = base;
        c.heads_q = 4, c.heads_kv = 2, c.n_q = 700, c.n_kv = 300, c.causal = true, c.head_dim = d;
        out.push_back(c);
      }
    }));
  }
#endif
}

}  // namespace
}  // namespace sage::testing
