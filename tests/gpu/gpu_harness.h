// Test harness of the GPU kernels: builds inputs in any layout/strides on the host, runs
// sage::attention on the device, and compares with reference::simulate and exact.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "reference/metrics.h"
#include "sage/attention.h"

namespace sage::testing {

// Skips the calling test, visibly, when there is no sm_90 GPU or no CUDA in this build.
#define SAGE_REQUIRE_GPU()                                                                     \
  do {                                                                                         \
    if (!::sage::testing::gpu_ready())                                                         \
      GTEST_SKIP() << "GPU test skipped: " << ::sage::testing::gpu_skip_reason();              \
  } while (0)

bool gpu_ready();
std::string gpu_skip_reason();

struct GpuCase {
  int64_t batch = 1, heads_q = 2, heads_kv = 2, n_q = 128, n_kv = 128, head_dim = 128;
  bool causal = false;
  DType dtype = DType::f16;
  Layout layout = Layout::HND;
  bool strided = false;   // padded row/head/batch strides and a storage offset
  bool with_lse = true;
  std::string recipe = "sage2_8b";
  std::string distribution = "normal";  // a synthetic distribution, or "zeros", "huge"
  uint64_t seed = 0;
  std::string describe() const;
};

struct GpuResult {
  reference::ErrorStats vs_sim, vs_exact;
  reference::ErrorStats sim_vs_exact;  // the recipe's own error on these inputs
  double lse_max_abs_vs_sim = 0, lse_max_abs_vs_exact = 0, lse_sim_vs_exact = 0;
  int64_t unwritten = 0;           // output elements still holding the poison pattern
  std::vector<uint16_t> out_bits;  // the raw output, for bit-identity checks
};

// Runs one case; `repeat` > 1 runs the kernel that many times into the same output.
GpuResult run_gpu_case(const GpuCase& c, bool compute_references = true);

// The kernel-vs-simulator bounds, justified in docs/performance.md ("Correctness of the
// kernels"). Against exact attention the kernel may be no worse than the simulator's own
// error on the same inputs (the recipe's error, bounded per recipe in test_simulator.cpp)
// plus the kernel-vs-simulator deviation.
struct Bounds {
  double sim_cosine, sim_rel_l1, lse_sim;
};
Bounds bounds_for(const std::string& recipe);

// Asserts a result against the bounds, printing the metrics.
void expect_within_bounds(const GpuCase& c, const GpuResult& r);

}  // namespace sage::testing
