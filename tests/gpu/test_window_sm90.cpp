// Sliding windows and fully masked rows on the sm_90 kernels (issue 34, sections 3 and 4):
// every GPU preset against the simulator within the harness's bounds, with no NaN, on
// windows causal and not, n_q above and below n_kv, GQA, windows narrower than a K/V tile and
// windows that leave the first rows with no key, at every built head dim; rows without a key
// give 0 and an LSE of -inf; a window covering every key and causal as window (-1, 0) give
// the same bits as no window and causal; and every order of the tile scheduler, chained
// items, give the same bits as one item per CTA.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "gpu_harness.h"

#ifdef SAGE_WITH_CUDA
#include "sm90/fwd/tile_scheduler.h"
#endif

namespace sage::testing {
namespace {

// Every GPU preset, and int_flash once more with a per-channel V scale.
std::vector<GpuCase> every_preset(const GpuCase& shape) {
  std::vector<GpuCase> out;
  for (const std::string& name : gpu_presets()) {
    if (!gpu_has_kernel(name, shape.head_dim)) continue;  // fp16 PV above d = 128
    GpuCase c = shape;
    c.recipe = name;
    out.push_back(c);
    if (preset(name).inputs == Inputs::prequantized_int8) {
      c.v_per_channel = true;
      out.push_back(c);
    }
  }
  return out;
}

GpuCase window_case(int64_t n_q, int64_t n_kv, bool causal, int64_t left, int64_t right, int64_t d,
                    uint64_t seed) {
  GpuCase c;
  c.n_q = n_q, c.n_kv = n_kv, c.causal = causal, c.head_dim = d, c.seed = seed;
  c.window_left = left, c.window_right = right;
  return c;
}

// The shapes of the window tests at head dim d.
std::vector<GpuCase> window_shapes(int64_t d) {
  std::vector<GpuCase> s;
  s.push_back(window_case(700, 700, true, 100, -1, d, 1));   // causal with a left window
  s.push_back(window_case(200, 900, true, 64, 0, d, 2));     // n_q < n_kv, causal
  GpuCase gqa = window_case(300, 500, false, 37, 200, d, 3);  // both bounds, GQA
  gqa.heads_q = 4, gqa.heads_kv = 2;
  s.push_back(gqa);
  s.push_back(window_case(400, 400, false, 5, 5, d, 4));     // narrower than a K/V tile
  s.push_back(window_case(500, 300, false, 20, 10, d, 5));   // rows 0..189 see no key
  GpuCase nhd = window_case(333, 1000, false, 300, -1, d, 6);  // a left bound alone
  nhd.layout = Layout::NHD, nhd.dtype = DType::bf16, nhd.heads_q = 3, nhd.heads_kv = 1;
  s.push_back(nhd);
  return s;
}

TEST(Sm90Window, EveryPresetMatchesTheSimulator) {
  SAGE_REQUIRE_GPU();
  std::vector<GpuCase> cases;
  for (int64_t d : harness_head_dims())
    for (const GpuCase& shape : window_shapes(d))
      for (const GpuCase& c : every_preset(shape)) cases.push_back(c);
  expect_cases_within_bounds(cases);
}

// n_q 500 > n_kv 300 + right 10: rows 0..189 see no key, in every Q tile that holds them
// (whole tiles, and the tile where the first rows with keys start).
TEST(Sm90Window, FullyMaskedRowsAreZeroWithLseMinusInf) {
  SAGE_REQUIRE_GPU();
  std::vector<GpuCase> cases;
  for (int64_t d : harness_head_dims())
    for (const auto& lr : {std::pair<int64_t, int64_t>{-1, 10}, {20, 10}})
      for (const GpuCase& c : every_preset(window_case(500, 300, false, lr.first, lr.second, d, 7)))
        cases.push_back(c);
  const std::vector<GpuResult> results = run_gpu_cases(cases);
  for (size_t k = 0; k < cases.size(); ++k) {
    const GpuCase& c = cases[k];
    const GpuResult& r = results[k];
    ASSERT_TRUE(r.error.empty()) << c.describe() << ": " << r.error;
    for (int64_t h = 0; h < c.heads_q; ++h)
      for (int64_t i = 0; i < c.n_q; ++i) {
        const float lse = r.lse[h * c.n_q + i];
        if (i < 190) {
          ASSERT_EQ(lse, -std::numeric_limits<float>::infinity()) << c.describe() << " row " << i;
          for (int64_t ch = 0; ch < c.head_dim; ++ch)  // HND, unpadded: +0 in f16 is bits 0
            ASSERT_EQ(r.out_bits[(h * c.n_q + i) * c.head_dim + ch], 0) << c.describe() << " row " << i;
        } else {
          ASSERT_TRUE(std::isfinite(lse)) << c.describe() << " row " << i;
        }
      }
  }
  for (size_t k = 0; k < cases.size(); ++k) expect_within_bounds(cases[k], results[k]);
}

// Bounds that mask nothing run as no window, and causal is the window (-1, 0): bit for bit.
TEST(Sm90Window, EquivalentMasksGiveTheSameBits) {
  SAGE_REQUIRE_GPU();
  for (int64_t d : harness_head_dims())
    for (const std::string& name : {std::string("sage2_8b"), std::string("sage1_t"), std::string("int_flash")}) {
      if (!gpu_has_kernel(name, d)) continue;  // fp16 PV above d = 128: Fp16PvIsRefusedAbove128
      GpuCase plain = window_case(300, 450, false, -1, -1, d, 8);
      plain.recipe = name;
      GpuCase covering = plain;
      covering.window_left = 449, covering.window_right = 299;
      GpuCase causal = plain;
      causal.causal = true;
      GpuCase right0 = plain;
      right0.window_right = 0;
      const GpuResult a = run_gpu_case(plain, false), b = run_gpu_case(covering, false);
      EXPECT_EQ(a.out_bits, b.out_bits) << covering.describe();
      EXPECT_EQ(a.lse, b.lse) << covering.describe();
      const GpuResult c = run_gpu_case(causal, false), e = run_gpu_case(right0, false);
      EXPECT_EQ(c.out_bits, e.out_bits) << right0.describe();
      EXPECT_EQ(c.lse, e.lse) << right0.describe();
    }
}

#ifdef SAGE_WITH_CUDA
// Pins the scheduler's items per CTA, order and Q stage for the test's lifetime.
class PinnedSchedule {
 public:
  PinnedSchedule(int items, sm90::WorkOrderOverride order) {
    sm90::ScheduleOverrides o;
    o.items_per_cta = items, o.order = order, o.q_stage = sm90::QStageOverride::on;
    sm90::set_schedule_overrides(o);
  }
  ~PinnedSchedule() { sm90::set_schedule_overrides(sm90::ScheduleOverrides{}); }
};
#endif

// Items of a window start at different K/V tiles; chained on one CTA (the producer's ring
// carries over), in each order, they must give the bits of one item per CTA. The Q stage is
// asked for and must not be taken under a left window (the left-window kernel has none).
TEST(Sm90Window, ChainedItemsInEveryOrderGiveTheSameBits) {
  SAGE_REQUIRE_GPU();
#ifdef SAGE_WITH_CUDA
  for (int64_t d : harness_head_dims()) {
    GpuCase c = window_case(1000, 1000, true, 200, -1, d, 9);
    c.heads_q = 4, c.heads_kv = 2, c.batch = 2, c.no_smooth_k = true;
    GpuCase both = window_case(600, 900, false, 150, 40, d, 10);
    for (const GpuCase& shape : {c, both}) {
      GpuResult single;
      {
        PinnedSchedule one(1, sm90::WorkOrderOverride::consecutive);
        single = run_gpu_case(shape, false);
      }
      const int64_t staged = sm90::q_stage_launches();
      for (const auto order : {sm90::WorkOrderOverride::consecutive, sm90::WorkOrderOverride::grouped,
                               sm90::WorkOrderOverride::strided})
        for (int items : {2, 5}) {
          PinnedSchedule chained(items, order);
          const GpuResult r = run_gpu_case(shape, false);
          EXPECT_EQ(r.out_bits, single.out_bits) << shape.describe() << ", " << items << " items per CTA";
          EXPECT_EQ(r.lse, single.lse) << shape.describe() << ", " << items << " items per CTA";
        }
      EXPECT_EQ(sm90::q_stage_launches(), staged) << shape.describe() << ": the Q stage ran";
    }
    PinnedSchedule chained(3, sm90::WorkOrderOverride::strided);
    expect_cases_within_bounds({c, both});
  }
#endif
}

}  // namespace
}  // namespace sage::testing
