// Test harness of the GPU kernels: builds inputs in any layout/strides on the host, runs
// sage::attention on the device, and compares with reference::simulate and exact.
//
// A case names a preset; for prequantized presets (int_flash) the harness makes the INT8
// inputs on the host from the same fp16 values (reference::prequantize_int8: Q and K per
// token, V per tensor or, with v_per_channel, per channel), uploads the codes and the f32
// scale tensors, and GpuCase::dtype is the output dtype (f16 or bf16).
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "numerics/tile.h"
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

// The presets that must run on sm_90: every preset but the CPU-only ones below. The list is
// derived from presets() rather than from gpu_supports(), so a preset the GPU path refuses
// fails its tests instead of dropping out of them.
const std::vector<std::string>& gpu_presets();
// Presets with no Hopper kernel by design (FP4 needs Blackwell): refused by name.
const std::vector<std::string>& cpu_only_presets();

// One entry per recipe the GPU must run: every GPU preset, and each prequantized one once more
// with the per-channel V scale its inputs may carry.
struct Variant {
  std::string recipe;
  bool v_per_channel;
};
std::vector<Variant> variants();

// The head dims the fixed GPU tests loop over: every kernel tile of the build
// (gpu_kernel_head_dim_list) and two smaller head dims that run zero-padded inside the kernel
// (issue 34): 40 on the 64 tile and 224 on the 256 one. The randomized test draws from every
// accepted head dim (gpu_head_dim_list).
std::vector<int64_t> harness_head_dims();
// Whether a recipe's PV path has a kernel at the tile of head_dim (sm90 kernel_traits.h,
// variant_has_kernel: none for fp16 PV or SageBwd's int8_dynamic above d = 128); the tests skip the others, and
// Sm90Attention.Fp16PvIsRefusedAbove128 checks their refusal.
bool gpu_has_kernel(const std::string& recipe, int64_t head_dim);

// A value written over one input element after the distribution (and the magnitude): NaN, +inf
// or -inf, for the non-finite cases (docs/numerics.md, "Non-finite inputs"). Only for recipes
// that take floating-point inputs: prequantized INT8 inputs are finite by construction.
struct PlantedValue {
  char tensor = 'q';  // 'q', 'k' or 'v'
  int64_t index = 0;  // into that tensor's HND-ordered [batch, heads, n, head_dim] values
  float value = 0.f;
};

struct GpuCase {
  int64_t batch = 1, heads_q = 2, heads_kv = 2, n_q = 128, n_kv = 128, head_dim = 128;
  int64_t head_dim_v = 0;  // V's and the output's head dim; 0: head_dim (MLA: 192 / 128)
  bool causal = false;
  int64_t window_left = -1, window_right = -1;  // the sliding window (AttentionArgs)
  DType dtype = DType::f16;  // of q, k, v and out; for prequantized recipes: of out only
  Layout layout = Layout::HND;
  bool strided = false;   // padded row/head/batch strides and a storage offset (scales too)
  bool with_lse = true;
  std::string recipe = "sage2_8b";
  bool v_per_channel = false;  // prequantized recipes: V scale per channel instead of per tensor
  float p_range = 0.f;         // > 0: the recipe's p_range instead of the preset's
  bool float_row_sum = false;  // row_sum float_p instead of the preset's
  bool no_smooth_k = false;    // K not smoothed (the Q stage then also runs with the LSE)
  int k_mean_stride = 0;       // > 0: the recipe's k_mean_stride instead of the preset's
  bool balance = false;        // qk_channel_balance on (floating inputs only)
  std::string distribution = "normal";  // a synthetic distribution, or "zeros", "huge"
  uint64_t seed = 0;
  // > 0: each tensor named in `magnified` is scaled so that its largest |value| is this (before
  // rounding to the input dtype): extreme magnitudes from any distribution's shape.
  float magnitude = 0.f;
  std::string magnified = "qkv";
  std::vector<PlantedValue> planted;  // non-empty: expect_within_bounds checks the NaN pattern
  std::string describe() const;
  int64_t dv() const { return head_dim_v > 0 ? head_dim_v : head_dim; }
  // The Recipe this case runs: the preset, with v_scale per channel when v_per_channel, and
  // p_range, row_sum float_p, smooth_k off, k_mean_stride and qk_channel_balance when set.
  Recipe recipe_options() const;
  bool prequantized() const;
};

// Non-finite outputs of a case against its references. A class is finite, NaN, +inf or -inf;
// the simulator's output is classed as the output dtype would store it.
struct NonFiniteStats {
  int64_t mismatched = 0;  // output elements and LSE rows whose class differs from the simulator's
  int64_t in_output = 0;   // output elements the kernel made non-finite
  int64_t absorbed = 0;    // output elements and LSE rows non-finite in float64 attention, finite here
  reference::ErrorStats vs_sim_finite;  // output elements finite in both, against the simulator
};

// The pattern comparison on dense HND arrays (`got` already in the output dtype; `lse*` may be
// empty when the case has no LSE). Host-only: the CPU tests check it too.
NonFiniteStats compare_nonfinite(DType out_dtype, const std::vector<float>& got, const std::vector<float>& sim,
                                 const std::vector<float>& exact, const std::vector<float>& got_lse,
                                 const std::vector<float>& sim_lse, const std::vector<float>& exact_lse);

// The case's q, k and v values, HND-ordered [batch, heads, n, head_dim] floats (v: dv()) before rounding
// to the input dtype: the distribution, then the magnitude, then the planted values.
struct CaseValues {
  std::vector<float> q, k, v;
};
CaseValues case_values(const GpuCase& c);

struct GpuResult {
  reference::ErrorStats vs_sim, vs_exact;
  reference::ErrorStats sim_vs_exact;  // the recipe's own error on these inputs
  double lse_max_abs_vs_sim = 0, lse_max_abs_vs_exact = 0, lse_sim_vs_exact = 0;
  // Rows whose LSE is further than bounds_for(recipe).lse_sim from the simulator's; the two
  // vs-exact maxima above leave them out (expect_within_bounds says when any may exist).
  int64_t lse_rows_beyond = 0;
  int64_t unwritten = 0;           // output elements still holding the poison pattern
  std::vector<uint16_t> out_bits;  // the raw output storage, for bit-identity checks
  std::vector<float> lse;          // the raw LSE (when the case asks for it)
  std::string error;               // run_gpu_cases only: what the GPU path threw, if anything
  NonFiniteStats nonfinite;        // the output's and LSE's non-finite pattern against the references
};

// Runs one case on the GPU and, when asked, computes both references on the host. Throws
// what the GPU entry points throw (sage::Error for a refused recipe).
GpuResult run_gpu_case(const GpuCase& c, bool compute_references = true);

// Runs the cases on the GPU one after the other, then computes their references on the host
// in parallel (the float64 and simulated references of long sequences dominate the test time;
// the GPU part is milliseconds). A case whose GPU call throws gets `error` set instead of
// ending the batch. Results are in the order of `cases`.
std::vector<GpuResult> run_gpu_cases(const std::vector<GpuCase>& cases);

// run_gpu_cases, then expect_within_bounds on each case in order.
void expect_cases_within_bounds(const std::vector<GpuCase>& cases);

// The kernel-vs-simulator bounds, justified per recipe family in gpu_harness.cpp and in
// docs/numerics.md ("Correctness of the kernels"). Against exact attention the kernel may be
// no worse than the simulator's own error on the same inputs (the recipe's error, bounded
// per recipe in test_simulator.cpp) plus the kernel-vs-simulator deviation (the cosine where
// the recipe's error is below 1e-2; gpu_harness.cpp says why).
struct Bounds {
  double sim_cosine, sim_rel_l1, lse_sim;
};
Bounds bounds_for(const std::string& recipe);

// Asserts a result against the bounds, printing the metrics.
void expect_within_bounds(const GpuCase& c, const GpuResult& r);

// One case's tensors, on the host (for the references) and on the device (for the kernels),
// for tests that drive the entry points themselves (the two-step API). The output and LSE
// start as a NaN poison pattern; workspaces from make_workspace start as garbage bytes.
class CaseTensors {
 public:
  explicit CaseTensors(const GpuCase& c);  // throws std::logic_error in a build without CUDA
  ~CaseTensors();
  CaseTensors(const CaseTensors&) = delete;
  CaseTensors& operator=(const CaseTensors&) = delete;

  const GpuCase& spec() const;
  AttentionArgs device_args() const;  // views onto the device copies
  AttentionArgs host_args() const;    // the same views onto the host copies (out/lse: device
                                      // results after download())
  void poison_outputs();              // writes the poison into the device out and LSE again
  void download();                    // copies the device out and LSE into the host copies
  std::vector<uint16_t> out_bits() const;  // the host copy of out's storage (after download)
  std::vector<float> lse() const;          // the host copy of the LSE (after download)

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Device memory filled with a garbage byte pattern (the API never promises a zeroed
// workspace: cudaMallocAsync and caching allocators return used memory).
class DeviceWorkspace {
 public:
  explicit DeviceWorkspace(size_t bytes);
  ~DeviceWorkspace();
  DeviceWorkspace(const DeviceWorkspace&) = delete;
  DeviceWorkspace& operator=(const DeviceWorkspace&) = delete;
  void* get() const { return ptr_; }
  size_t bytes() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

// Waits for the device and turns a CUDA error into a test-visible exception.
void device_sync(const char* what);

}  // namespace sage::testing
