// Deterministic synthetic attention inputs, the same bits on every platform and compiler.
//
// The generator is our own (SplitMix64 and the Marsaglia polar method with a logarithm
// written in plain IEEE arithmetic), not <random>'s distributions, whose output differs
// between standard libraries. Every (tensor, batch, head) draws from its own stream, so a
// head's values depend only on the seed, the distribution and the head's coordinates.
//
// Distributions (stable names, used by the CLI, tests and docs):
//   normal    Q, K, V ~ N(0, 1)
//   k_bias    K = b + N(0, 1) with one bias b_c ~ N(0, 5^2) per channel (SageAttention's K)
//   qk_bias   Q = a + N(0, 1), a_c ~ N(0, 2^2); K as in k_bias (where Q smoothing matters)
//   outliers  Q, K ~ N(0, 1) with d/32 (at least 1) channels scaled by x10..x20
//   sharp     Q, K ~ 3 N(0, 1): scores 9x sharper, P~ mostly tiny
//   v_bias    V = b + N(0, 1) with b_c ~ N(0, 5^2) per channel (where V smoothing matters)
//   sink      Q = u + N(0, 1) with |u_c| = 0.5 shared by all queries; key 0 = 20 u / |u|:
//             one key scores ~+10 everywhere above a diffuse N(0, 1.25) bulk, so over long
//             sequences most of P~ is ~1e-4 yet sums to O(1) (the papers' regime for P);
//             V = b + N(0, 1), b_c ~ N(0, 2^2), so that the bulk's mass shows in the output
//   channel_offset  Q, K ~ N(0, 1) with max(2, d/32) channels (the same ones in K and in the Q
//             heads of its group) whose mean is +-(10..50), drawn per head, K's varying
//             by N(0, 0.25^2) around it (bias-dominated): the Q/K channel
//             offsets that q/k projection biases give (Qwen2-like layers; issue 35). K
//             smoothing removes K's offsets, but Q's still set Q's INT8 scales.
// Unlisted tensors are N(0, 1). All values are rounded to fp16.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "sage/tensor.h"

namespace sage::reference {

// SplitMix64 with normal deviates from the Marsaglia polar method.
class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}
  uint64_t next();
  double uniform();  // [0, 1), 53 random bits
  double normal();   // N(0, 1)

 private:
  uint64_t state_;
  bool has_spare_ = false;
  double spare_ = 0;
};

// Natural logarithm from exact IEEE operations only (about 1 ulp): the reason Rng::normal is
// reproducible everywhere.
double portable_log(double x);

struct SyntheticShape {
  int64_t batch = 1, heads_q = 1, heads_kv = 1, n_q = 128, n_kv = 128, head_dim = 128;
  int64_t head_dim_v = 0;  // V's (and the output's) head dim; 0: head_dim
  int64_t v_dim() const { return head_dim_v > 0 ? head_dim_v : head_dim; }
};

// fp16 Q, K, V in HND layout, with views onto the buffers. The views are built on demand,
// so copies and moves of this struct stay valid.
struct SyntheticInputs {
  SyntheticShape shape;
  std::string distribution;
  uint64_t seed = 0;
  std::vector<uint16_t> q, k, v;  // fp16 bit patterns
  TensorView q_view() const;
  TensorView k_view() const;
  TensorView v_view() const;
};

// The built-in distributions, in a fixed order.
const std::vector<std::string>& synthetic_distributions();
// One line on what a distribution models.
std::string synthetic_description(const std::string& distribution);
// Throws sage::Error("distribution", ...) listing the names for an unknown one.
SyntheticInputs make_synthetic(const std::string& distribution, const SyntheticShape& shape,
                               uint64_t seed = 0);

// A gradient of the output for the backward: fp16 N(0, 1), HND [batch, heads_q, n_q, v_dim()],
// the same for every distribution (its streams depend on the seed and the head only).
std::vector<uint16_t> synthetic_output_gradient(const SyntheticShape& shape, uint64_t seed = 0);

// INT8 inputs with scales, as Inputs::prequantized_int8 takes them: Q and K per token
// (amax / 127), V per tensor or per channel; symmetric round-to-nearest-even codes.
struct PrequantizedInputs {
  SyntheticShape shape;
  bool v_per_channel = false;
  std::vector<int8_t> q, k, v;                // HND
  std::vector<float> q_scale, k_scale, v_scale;  // [b, hq, nq], [b, hkv, nkv], [b, hkv(, d_v)]
  TensorView q_view() const;
  TensorView k_view() const;
  TensorView v_view() const;
  TensorView q_scale_view() const;
  TensorView k_scale_view() const;
  TensorView v_scale_view() const;
};
PrequantizedInputs prequantize_int8(const SyntheticInputs& in, bool v_per_channel);

}  // namespace sage::reference
