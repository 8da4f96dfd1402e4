// The sm_90 attention path against the CPU simulator (tight) and exact attention (the
// recipe's bound), over the shape list of the fast-path issue and a seeded random sweep.
#include <gtest/gtest.h>

#include <cmath>

#include "gpu_harness.h"
#include "reference/synthetic.h"

namespace sage::testing {
namespace {

TEST(Sm90Attention, SequenceLengths) {
  SAGE_REQUIRE_GPU();
  for (int64_t n : {1, 7, 64, 113, 127, 128, 129, 1000, 1023, 4097}) {
    for (bool causal : {false, true}) {
      GpuCase c;
      c.n_q = c.n_kv = n;
      c.heads_q = c.heads_kv = n > 2000 ? 1 : 2;
      c.causal = causal;
      c.seed = uint64_t(n);
      expect_within_bounds(c, run_gpu_case(c));
    }
  }
}

TEST(Sm90Attention, QueryAndKeyLengthsDiffer) {
  SAGE_REQUIRE_GPU();
  const int64_t pairs[][2] = {{64, 300}, {300, 64}, {1, 513}, {513, 1}, {200, 129}, {129, 1000}};
  for (const auto& nn : pairs)
    for (bool causal : {false, true}) {
      GpuCase c;
      c.n_q = nn[0], c.n_kv = nn[1], c.causal = causal;
      c.seed = uint64_t(nn[0] * 7 + nn[1]);
      expect_within_bounds(c, run_gpu_case(c));
    }
}

TEST(Sm90Attention, GroupedQueryAndMultiQuery) {
  SAGE_REQUIRE_GPU();
  for (int64_t ratio : {1, 4, 8}) {
    GpuCase c;
    c.heads_kv = 2, c.heads_q = 2 * ratio, c.n_q = c.n_kv = 200;
    c.seed = uint64_t(ratio);
    expect_within_bounds(c, run_gpu_case(c));
  }
  GpuCase mqa;
  mqa.heads_kv = 1, mqa.heads_q = 8, mqa.n_q = mqa.n_kv = 257, mqa.causal = true;
  expect_within_bounds(mqa, run_gpu_case(mqa));
}

TEST(Sm90Attention, BatchLayoutsDtypesHeadDims) {
  SAGE_REQUIRE_GPU();
  for (int64_t batch : {1, 3})
    for (Layout layout : {Layout::HND, Layout::NHD})
      for (DType dt : {DType::f16, DType::bf16})
        for (int64_t d : {64, 128}) {
          GpuCase c;
          c.batch = batch, c.layout = layout, c.dtype = dt, c.head_dim = d;
          c.n_q = 150, c.n_kv = 333, c.heads_q = 4, c.heads_kv = 2;
          c.seed = uint64_t(batch * 100 + d + (dt == DType::bf16) * 7 + (layout == Layout::NHD) * 3);
          expect_within_bounds(c, run_gpu_case(c));
        }
}

TEST(Sm90Attention, StridedViewsWithStorageOffsets) {
  SAGE_REQUIRE_GPU();
  for (Layout layout : {Layout::HND, Layout::NHD}) {
    GpuCase c;
    c.strided = true, c.layout = layout, c.batch = 2, c.heads_q = 4, c.heads_kv = 2;
    c.n_q = 190, c.n_kv = 260, c.causal = layout == Layout::NHD;
    expect_within_bounds(c, run_gpu_case(c));
  }
}

TEST(Sm90Attention, SyntheticDistributionsAndRecipeOptions) {
  SAGE_REQUIRE_GPU();
  for (const std::string& dist : reference::synthetic_distributions())
    for (const char* recipe : {"sage2_8b", "sage2_8b_vsmooth"}) {
      GpuCase c;
      c.distribution = dist, c.recipe = recipe, c.n_q = c.n_kv = 512;
      expect_within_bounds(c, run_gpu_case(c));
    }
}

TEST(Sm90Attention, NoNaNOnZerosAndNearFp16Limit) {
  SAGE_REQUIRE_GPU();
  for (const char* dist : {"zeros", "huge"})
    for (bool causal : {false, true}) {
      GpuCase c;
      c.distribution = dist, c.causal = causal, c.n_q = 130, c.n_kv = 250;
      const GpuResult r = run_gpu_case(c);
      EXPECT_EQ(r.unwritten, 0) << c.describe();
      EXPECT_EQ(r.vs_sim.nonfinite, 0) << c.describe();
      if (std::string(dist) == "zeros") {
        EXPECT_EQ(r.vs_exact.max_abs, 0.0) << c.describe();  // uniform attention over zero V
      }
    }
}

TEST(Sm90Attention, FullyMaskedRowsAreZero) {
  SAGE_REQUIRE_GPU();
  GpuCase c;  // n_q > n_kv with causal bottom-right: the first n_q - n_kv rows see no key
  c.n_q = 300, c.n_kv = 100, c.causal = true;
  expect_within_bounds(c, run_gpu_case(c));
}

TEST(Sm90Attention, RepeatedRunsAreBitIdentical) {
  SAGE_REQUIRE_GPU();
  GpuCase c;
  c.n_q = c.n_kv = 1000, c.causal = true, c.heads_q = 4, c.heads_kv = 2;
  const GpuResult a = run_gpu_case(c, false), b = run_gpu_case(c, false);
  EXPECT_EQ(a.out_bits, b.out_bits);
}

// A seeded sweep over shapes, strides, GQA ratios, causal, dtype and recipe options.
TEST(Sm90Attention, RandomizedAgainstSimulator) {
  SAGE_REQUIRE_GPU();
  reference::Rng rng(20261122);
  const int kCases = 200;
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
    c.recipe = pick(3) == 0 ? "sage2_8b_vsmooth" : "sage2_8b";
    c.distribution = reference::synthetic_distributions()[pick(int(reference::synthetic_distributions().size()))];
    c.seed = uint64_t(i);
    expect_within_bounds(c, run_gpu_case(c));
  }
}

TEST(Sm90Attention, UnsupportedRecipeIsRefusedByName) {
  SAGE_REQUIRE_GPU();
  GpuCase c;
  c.recipe = "sage3_fp4";
  try {
    run_gpu_case(c, false);
    FAIL() << "sage3_fp4 ran on the GPU path";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "recipe");
    EXPECT_NE(std::string(e.what()).find("sage3_fp4"), std::string::npos);
  }
}

}  // namespace
}  // namespace sage::testing
