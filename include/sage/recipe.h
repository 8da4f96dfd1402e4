// Recipes: a quantized-attention system is a point in a small space of choices.
//
// Every system of the SageAttention family (and INT-FlashAttention) is a combination of
// the orthogonal options below. The papers' configurations are named presets over them
// (see presets()). Kernels, quantizers and the CPU simulator all read the same Recipe, so
// a preset means exactly the same numerics everywhere.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace sage {

// Format of Q and K in the QK^T matmul.
enum class QKFormat : uint8_t {
  fp16,   // no quantization (reference / FP16 path)
  int8,   // symmetric INT8, values in [-127, 127]
  int4,   // symmetric INT4 values in [-7, 7] (computed exactly on INT8 tensor cores on Hopper)
  e4m3,   // FP8 E4M3 with a float scale per group (max 448)
  nvfp4,  // E2M1 values, one E4M3 scale per 16 consecutive channels
  mxfp4,  // E2M1 values, one E8M0 scale per 32 consecutive channels
};

// Which tokens of Q (or K) share one quantization scale. The exact map from a token index
// to its group is a function of the kernel tile configuration: see tile.h.
// (nvfp4 / mxfp4 ignore this: their groups run along head_dim; they take `microscale`.)
enum class Granularity : uint8_t {
  per_tensor,  // one scale per (batch, head)
  per_block,   // one scale per kernel tile of tokens
  per_warp,    // one scale per 16-row warp slice of a Q tile (K: per block)
  per_thread,  // the tokens one tensor-core thread holds share a scale
  per_token,   // one scale per token
  microscale,  // FP4 block scaling along head_dim (1x16 NVFP4, 1x32 MXFP4)
};

// Format of P (the softmax numerator) and V in the PV matmul.
enum class PVFormat : uint8_t {
  fp16,   // P and V in FP16 (SageAttention 1 "T"/"B")
  e4m3,   // FP8 E4M3 P with a static scale, V per channel
  e5m2,   // FP8 E5M2 (for comparison; the papers choose E4M3)
  int8,   // INT8 P with static scale 1/127, INT8 V (SageAttention vT/vB, INT-FlashAttention)
  nvfp4,  // SageAttention3: NVFP4 P (two-level) and V (microscaled along tokens)
  mxfp4,  // MXFP4 P and V (for comparison with NVFP4)
};

// How P is scaled before it is quantized.
enum class PScale : uint8_t {
  none,       // fp16 P
  static_max, // P~ in [0,1] times a static factor: p_range when set, else the format max (E4M3: 256)
  two_level,  // SageAttention3: per-row scale to 448*6 first, then microscaling
  // SageBwd: one scale per row and KV tile from the online softmax's own maxima,
  // s_P = exp(rowmax_tile(S) - m) / 127 (int8 P only)
  per_token,
};

// Granularity of the V scale.
enum class VScale : uint8_t {
  none,         // fp16 V
  per_channel,  // one scale per head_dim channel over all tokens
  per_tensor,   // one scale per (batch, head)
  microscale,   // FP4 block scaling along tokens
  per_block,    // SageBwd: one scale per KV tile of tokens over all channels (int8 V only)
};

// How the PV products are accumulated.
enum class PVAccum : uint8_t {
  fp32,           // exact fp32 accumulation (what the FP16 wgmma with fp32 accumulator does)
  fp16,           // fp16 accumulator (SageAttention 1 on consumer GPUs)
  fp22,           // FP8 MMA's internal accumulator (13 mantissa bits) over the whole row
  two_level,      // fp22 inside one KV block, then added into an fp32 buffer (SageAttention2)
  fp16x2_fp32,    // SageAttention2++: two k32 MMAs accumulate in fp16, then added into fp32
};

// Where the softmax denominator comes from.
enum class RowSum : uint8_t {
  float_p,      // sum of the unquantized P~ (SageAttention 1/2/3)
  quantized_p,  // sum of the quantized P (INT-FlashAttention)
  // Where the Hopper kernel can (rules::row_sum_in_pv_mma: E4M3 P, two-level accumulation,
  // head dim >= 128) the quantized P summed by the PV MMA itself, as one more V channel of
  // ones, so with the PV accumulator's rounding; elsewhere float_p's sum.
  pv_mma,
};

// Whether the caller passes fp16/bf16 tensors or already-quantized INT8 ones with scales.
enum class Inputs : uint8_t { floating, prequantized_int8 };

// Operands of one matmul of the backward pass (training; docs/numerics.md, "The backward").
// A recipe has a backward when all four of its backward formats are set, and none otherwise.
enum class BwdFormat : uint8_t {
  none,  // the recipe has no backward (every preset but sagebwd, sagebwd_block)
  fp16,  // 16-bit floats in the inputs' dtype (fp16, bf16; f32 inputs: fp16), fp32 accumulation
  int8,  // symmetric INT8 with int32 accumulation; scale groups: backward.h, bwd_*_granularity
};

struct Recipe {
  std::string name = "custom";
  QKFormat qk_format = QKFormat::int8;
  Granularity qk_granularity = Granularity::per_thread;
  bool smooth_k = true;   // subtract the mean of K over tokens (exact: softmax is shift-invariant)
  // K smoothing's mean over keys 0, s, 2s, ... for s = k_mean_stride (1: every key, as the
  // papers; sage2_8b takes 8). Any vector shared by all keys keeps softmax exact, so the stride
  // changes only how well K is centred before quantization, and the GPU's statistics pass
  // reads 1/s of K. A parameter of K smoothing: without smooth_k there is no mean and it does
  // nothing (the Python and spec parsers set it to 1 then, and refuse a stride > 1 given with
  // smooth_k false). From 1 to 2^20 (rules::kMaxKMeanStride): a larger stride takes key 0
  // alone on any sequence the kernels run, as 2^20 already does.
  int k_mean_stride = 8;
  bool smooth_q = false;  // subtract the per-Q-block mean; add back dS = mean(Q_blk) K^T
  bool smooth_v = false;  // subtract the mean of V over tokens; add it back to the output
  // Per-channel migration of scale between Q and K before they are quantized (issue 35):
  // q_c / s_c and k'_c * s_c, with s_c a power of two near sqrt(max|Q_c| / max|K'_c|) per
  // (batch, KV head) over the group's Q heads and the smoothed K. q . k is unchanged, so it
  // is exact in math; it keeps a few large-mean Q channels (Qwen2-like q/k biases) from setting
  // every token's Q scale. Simulator only: no sm_90 kernel yet (gpu_supports is false).
  bool qk_channel_balance = false;
  PVFormat pv_format = PVFormat::e4m3;
  PScale p_scale = PScale::static_max;
  VScale v_scale = VScale::per_channel;
  PVAccum pv_accum = PVAccum::two_level;
  // static_max: P~ (in [0, 1]) is scaled to [0, p_range] before it is encoded. 0 is the
  // format's default (E4M3 256, E5M2 57344, INT8 127); otherwise 1 <= p_range <= the format's
  // largest value (E4M3 448, E5M2 57344, INT8 127). Above it the largest P~ saturate (1000 on
  // E4M3 gave a max error of 0.71); below 1 no format gains precision and the small P~ flush
  // toward zero. fp8/int8 P only (fp16 and fp4 P take 0).
  float p_range = 0.f;
  // per_channel/per_tensor V is scaled to [-v_range, v_range]. 0 is the format's largest value;
  // otherwise 1 <= v_range <= that value, for the same reasons as p_range. With pv_accum
  // fp16x2_fp32, p_range * v_range (the defaults where 0) must be at most 65504 / 64 = 1023.5:
  // one FP16 accumulation sums 64 products of at most that size (SageAttention2++'s 112 * 4.5).
  float v_range = 0.f;
  RowSum row_sum = RowSum::pv_mma;  // the float sum wherever the PV path has no MMA row sum
  Inputs inputs = Inputs::floating;
  // The backward (SageBwd). A forward call ignores these; QK^T is recomputed from the
  // forward's own quantized Q and K, so it has no format of its own.
  BwdFormat dv_format = BwdFormat::none;  // dV = P^T dO
  BwdFormat dp_format = BwdFormat::none;  // dP = dO V^T (fp16 in SageBwd: its error reaches dQ, dK)
  BwdFormat dq_format = BwdFormat::none;  // dQ = dS K
  BwdFormat dk_format = BwdFormat::none;  // dK = dS^T Q
  // Which tokens share one scale where the backward quantizes P (for dV = P^T dO) and dS
  // (for dQ = dS K, dK = dS^T Q) to INT8: per_block, one per backward tile (the paper's), or
  // per_token, one per token the matmul's output row belongs to (P and dS for dK: per key of
  // the tile; dS for dQ: per query row of the tile, so dS is quantized twice). Either factors
  // out of the INT8 MMA; per_token follows the tile's spread of magnitudes.
  Granularity bwd_p_granularity = Granularity::per_block;
  Granularity bwd_ds_granularity = Granularity::per_block;
};

// The papers' configurations, and sagekit's default built on one.
//   sage1_t, sage1_b, sage1_vt, sage1_vb   SageAttention (INT8 QK, K smoothing)
//   sage2_8b (default on Hopper), sage2_4b SageAttention2 (per-thread, FP8 PV, two-level)
//   sage2_8b_vsmooth                        SageAttention2 with V smoothing
//   sage2_8b_balanced ("auto" on Hopper)     sage2_8b with qk_channel_balance (sagekit's own)
//   sage2pp_8b, sage2pp_4b                  SageAttention2++ (FP16-accumulated FP8 PV)
//   sage3_fp4                               SageAttention3 (NVFP4, two-level P)
//   int_flash, int_flash_q                  INT-FlashAttention (prequantized / fp16 inputs)
//   sagebwd                                 SageBwd (INT8 forward and backward, dO V^T in FP16;
//                                           dS per token)
//   sagebwd_block                           sagebwd with the paper's dS, one scale per tile
const std::vector<Recipe>& presets();
// Looks a preset up by name; throws sage::Error("recipe", ...) listing the names otherwise.
const Recipe& preset(const std::string& name);
// The paper a preset comes from and a one-line description (for docs and the CLI).
std::string recipe_paper(const Recipe& r);
std::string recipe_summary(const Recipe& r);
// Throws sage::Error naming the inconsistent option (e.g. "recipe.qk_granularity"): an enum
// field holding no enumerator's value, a number outside its range (p_range, v_range,
// k_mean_stride above), or a combination of options that has no defined numerics.
void validate_recipe(const Recipe& r);
// Whether the recipe has a backward (its backward formats are set; validate_recipe checks them).
bool has_backward(const Recipe& r);
// The backward's rules, which validate_recipe applies to a recipe with a backward; throws
// sage::Error("recipe.dv_format", ...) for a recipe without one (src/api/recipe_backward.cpp).
void validate_backward(const Recipe& r);

const char* to_string(QKFormat v);
const char* to_string(Granularity v);
const char* to_string(PVFormat v);
const char* to_string(PScale v);
const char* to_string(VScale v);
const char* to_string(PVAccum v);
const char* to_string(RowSum v);
const char* to_string(Inputs v);
const char* to_string(BwdFormat v);

}  // namespace sage
