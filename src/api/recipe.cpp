// The papers' configurations as presets over the recipe options, and their validation.
#include "sage/recipe.h"

#include <cstring>
#include <sstream>

#include "sage/error.h"
#include "numerics/quant_rules.h"

namespace sage {
namespace {

Recipe make(const char* name, QKFormat qf, Granularity qg, bool sk, bool sq, bool sv, PVFormat pf,
            PScale ps, VScale vs, PVAccum acc, float p_range = 0.f, float v_range = 0.f,
            RowSum rs = RowSum::float_p, Inputs in = Inputs::floating, int k_mean_stride = 1) {
  Recipe r;
  r.name = name;
  r.qk_format = qf;
  r.qk_granularity = qg;
  r.smooth_k = sk;
  r.smooth_q = sq;
  r.smooth_v = sv;
  r.pv_format = pf;
  r.p_scale = ps;
  r.v_scale = vs;
  r.pv_accum = acc;
  r.p_range = p_range;
  r.v_range = v_range;
  r.row_sum = rs;
  r.inputs = in;
  r.k_mean_stride = k_mean_stride;
  return r;
}

// SageBwd (the SageAttention3 paper's trainable INT8 attention): INT8 per-block Q, K, V with K
// smoothing; P quantized per token from the online softmax's maxima; INT8 for every backward
// matmul but dP = dO V^T, which stays 16-bit (docs/numerics.md, "The backward"). P per key of
// the tile: dV's error falls 5x from the paper's per-block scale on diffuse attention. dS with
// `ds` scales: per_token in sagebwd, since with the paper's per-tile dS (sagebwd_block) a small
// GPT pretrained on an H100 ends 19.7% above bf16 SDPA's loss, and per token 0.7% below
// (docs/numerics.md, "The backward", "Options").
Recipe sagebwd(const char* name, Granularity ds) {
  Recipe r = make(name, QKFormat::int8, Granularity::per_block, true, false, false,
                  PVFormat::int8, PScale::per_token, VScale::per_block, PVAccum::fp32);
  r.dv_format = BwdFormat::int8;
  r.dp_format = BwdFormat::fp16;
  r.dq_format = BwdFormat::int8;
  r.dk_format = BwdFormat::int8;
  r.bwd_p_granularity = Granularity::per_token;
  r.bwd_ds_granularity = ds;
  return r;
}

std::vector<Recipe> build_presets() {
  using G = Granularity;
  using Q = QKFormat;
  using P = PVFormat;
  std::vector<Recipe> v;
  // SageAttention (v1): INT8 QK with K smoothing; FP16 PV with an FP16 accumulator (T/B), or
  // INT8 P (static 1/127) and INT8 V per channel (vT/vB).
  v.push_back(make("sage1_t", Q::int8, G::per_token, true, false, false, P::fp16, PScale::none,
                   VScale::none, PVAccum::fp16));
  v.push_back(make("sage1_b", Q::int8, G::per_block, true, false, false, P::fp16, PScale::none,
                   VScale::none, PVAccum::fp16));
  v.push_back(make("sage1_vt", Q::int8, G::per_token, true, false, false, P::int8,
                   PScale::static_max, VScale::per_channel, PVAccum::fp32));
  v.push_back(make("sage1_vb", Q::int8, G::per_block, true, false, false, P::int8,
                   PScale::static_max, VScale::per_channel, PVAccum::fp32));
  // SageAttention2: per-thread INT8 (or INT4 with Q+K smoothing), FP8 E4M3 P (static, 256:
  // rules::p_default_max; the paper's 448 is p_range = 448) and V per channel, two-level
  // accumulation. sage2_8b is the Hopper default.
  // From head dim 128 their row sum comes from the PV MMA (RowSum::pv_mma; the paper sums the
  // unquantized P, row_sum = float_p, which the Hopper kernel does only below d = 128).
  // sage2_8b takes K smoothing's mean over every 8th key (the paper's, over every key, is
  // k_mean_stride 1): its output error is unchanged, since FP8 P's dominates, and the GPU's
  // statistics pass reads 1/8 of K. INT4 K and FP16 PV show the sampled mean (docs/numerics.md,
  // "K smoothing"), so the other presets keep every key.
  v.push_back(make("sage2_8b", Q::int8, G::per_thread, true, false, false, P::e4m3,
                   PScale::static_max, VScale::per_channel, PVAccum::two_level, 0.f, 0.f,
                   RowSum::pv_mma, Inputs::floating, 8));
  v.push_back(make("sage2_8b_vsmooth", Q::int8, G::per_thread, true, false, true, P::e4m3,
                   PScale::static_max, VScale::per_channel, PVAccum::two_level, 0.f, 0.f,
                   RowSum::pv_mma));
  // sagekit's own, not a paper's: sage2_8b with qk_channel_balance, what "auto" runs on
  // Hopper. Where Q's and K's channel ranges agree it computes sage2_8b's numerics; where a
  // few Q/K channels carry large means (q/k projection biases) it keeps the accuracy that
  // sage2_8b loses there (issue 35; docs/numerics.md, step 2).
  Recipe balanced = make("sage2_8b_balanced", Q::int8, G::per_thread, true, false, false, P::e4m3,
                         PScale::static_max, VScale::per_channel, PVAccum::two_level, 0.f, 0.f,
                         RowSum::pv_mma, Inputs::floating, 8);
  balanced.qk_channel_balance = true;
  v.push_back(balanced);
  v.push_back(make("sage2_4b", Q::int4, G::per_thread, true, true, false, P::e4m3,
                   PScale::static_max, VScale::per_channel, PVAccum::two_level, 0.f, 0.f,
                   RowSum::pv_mma));
  // SageAttention2++: FP8 PV accumulated in FP16 over two k32 MMAs, then in FP32; P and V
  // ranges narrowed to Pr = 112, Vr = 4.5 so that 64 products stay inside FP16.
  v.push_back(make("sage2pp_8b", Q::int8, G::per_thread, true, false, false, P::e4m3,
                   PScale::static_max, VScale::per_channel, PVAccum::fp16x2_fp32, 112.f, 4.5f));
  v.push_back(make("sage2pp_4b", Q::int4, G::per_thread, true, true, false, P::e4m3,
                   PScale::static_max, VScale::per_channel, PVAccum::fp16x2_fp32, 112.f, 4.5f));
  // SageAttention3: NVFP4 (1x16 groups, E4M3 scales) for both matmuls, two-level P.
  v.push_back(make("sage3_fp4", Q::nvfp4, G::microscale, true, false, false, P::nvfp4,
                   PScale::two_level, VScale::microscale, PVAccum::fp32));
  // INT-FlashAttention: INT8 Q/K per token, INT8 V per tensor, INT8 P with static 1/127 and
  // the row sum over quantized P. `int_flash` takes already-quantized INT8 inputs;
  // `int_flash_q` takes fp16/bf16 and quantizes per token first.
  v.push_back(make("int_flash", Q::int8, G::per_token, false, false, false, P::int8,
                   PScale::static_max, VScale::per_tensor, PVAccum::fp32, 0.f, 0.f,
                   RowSum::quantized_p, Inputs::prequantized_int8));
  v.push_back(make("int_flash_q", Q::int8, G::per_token, false, false, false, P::int8,
                   PScale::static_max, VScale::per_tensor, PVAccum::fp32, 0.f, 0.f,
                   RowSum::quantized_p, Inputs::floating));
  v.push_back(sagebwd("sagebwd", G::per_token));
  v.push_back(sagebwd("sagebwd_block", G::per_block));
  return v;
}

}  // namespace

const std::vector<Recipe>& presets() {
  static const std::vector<Recipe> all = build_presets();
  return all;
}

const Recipe& preset(const std::string& name) {
  for (const Recipe& r : presets())
    if (r.name == name) return r;
  std::ostringstream os;
  os << "unknown recipe '" << name << "'; allowed: ";
  bool first = true;
  for (const Recipe& r : presets()) {
    os << (first ? "" : ", ") << r.name;
    first = false;
  }
  throw Error("recipe", os.str());
}

std::string recipe_paper(const Recipe& r) {
  const std::string& n = r.name;
  if (n.rfind("sage1_", 0) == 0) return "SageAttention (ICLR 2025)";
  if (n == "sage2_8b_balanced") return "SageAttention2 with sagekit's Q/K channel balance";
  if (n.rfind("sage2pp_", 0) == 0) return "SageAttention2++";
  if (n.rfind("sage2_", 0) == 0) return "SageAttention2 (ICML 2025)";
  if (n.rfind("sage3_", 0) == 0) return "SageAttention3";
  if (n.rfind("int_flash", 0) == 0) return "INT-FlashAttention";
  if (n.rfind("sagebwd", 0) == 0) return "SageBwd (SageAttention3 paper)";
  return "custom";
}

std::string recipe_summary(const Recipe& r) {
  std::ostringstream os;
  os << "QK " << to_string(r.qk_format) << " " << to_string(r.qk_granularity);
  if (r.smooth_k || r.smooth_q) {
    os << " (smooth";
    if (r.smooth_q) os << " Q";
    if (r.smooth_k) os << " K";
    if (r.smooth_k && r.k_mean_stride > 1) os << ", K mean of every " << r.k_mean_stride << "th key";
    os << ")";
  }
  if (r.qk_channel_balance) os << " (Q/K channel balance)";
  os << "; PV " << to_string(r.pv_format);
  if (r.p_scale != PScale::none) os << ", P " << to_string(r.p_scale);
  if (r.p_range > 0) os << " to " << r.p_range;
  if (r.v_scale != VScale::none) os << ", V " << to_string(r.v_scale);
  if (r.v_range > 0) os << " to " << r.v_range;
  if (r.smooth_v) os << " (smooth V)";
  os << "; accumulate " << to_string(r.pv_accum);
  if (r.row_sum == RowSum::quantized_p) os << "; row sum of quantized P";
  if (r.row_sum == RowSum::pv_mma) os << "; row sum from the PV MMA from d = 128";
  if (r.inputs == Inputs::prequantized_int8) os << "; prequantized INT8 inputs";
  if (has_backward(r)) {
    const bool ds8 = r.dq_format == BwdFormat::int8 || r.dk_format == BwdFormat::int8;
    os << "; backward dV " << to_string(r.dv_format);
    if (r.dv_format == BwdFormat::int8) os << " (P " << to_string(r.bwd_p_granularity) << ")";
    os << ", dP " << to_string(r.dp_format) << ", dQ " << to_string(r.dq_format) << ", dK "
       << to_string(r.dk_format);
    if (ds8) os << " (dS " << to_string(r.bwd_ds_granularity) << ")";
  }
  return os.str();
}

namespace {

// An enum holding a value none of its enumerators has (a cast from an int, a corrupt
// struct) is refused by name: every rule below, and every kernel, assumes a known value.
// to_string is the one list of the values ("?" for anything else); an enum's values are
// found by asking it about each of the 256 codes of its uint8_t representation.
template <class E>
bool is_enumerator(E value) {
  return std::strcmp(to_string(value), "?") != 0;
}

template <class E>
std::string enum_values() {
  std::string list;
  for (int code = 0; code < 256; ++code)
    if (is_enumerator(static_cast<E>(code)))
      list += (list.empty() ? "" : ", ") + std::string(to_string(static_cast<E>(code)));
  return list;
}

template <class E>
void check_enum(const char* option, E value) {
  if (is_enumerator(value)) return;
  throw Error(std::string("recipe.") + option,
              "is not one of " + enum_values<E>() + " (got the code " +
                  std::to_string(static_cast<int>(value)) + ")");
}

void check_enums(const Recipe& r) {
  check_enum("qk_format", r.qk_format);
  check_enum("qk_granularity", r.qk_granularity);
  check_enum("pv_format", r.pv_format);
  check_enum("p_scale", r.p_scale);
  check_enum("v_scale", r.v_scale);
  check_enum("pv_accum", r.pv_accum);
  check_enum("row_sum", r.row_sum);
  check_enum("inputs", r.inputs);
  check_enum("dv_format", r.dv_format);
  check_enum("dp_format", r.dp_format);
  check_enum("dq_format", r.dq_format);
  check_enum("dk_format", r.dk_format);
  check_enum("bwd_p_granularity", r.bwd_p_granularity);
  check_enum("bwd_ds_granularity", r.bwd_ds_granularity);
}

std::string number(float x) {
  std::ostringstream os;
  os << x;
  return os.str();
}

// p_range / v_range: 0 (the format's default) or a value in [kMinRange, the format's max].
// P~ (in [0, 1]) or V' / max|V'| (in [-1, 1]) is multiplied by the range before it is encoded.
// Above the format's max the largest values saturate (P~ = 1 no longer encodes as p_range:
// p_range = 1000 on E4M3 gave a max error of 0.71). Below 1 nothing is gained and the small
// values go first: the FP formats' relative precision does not depend on the scale, so a
// smaller range only pushes more values into subnormals and zero, and INT8 has fewer codes
// (none at all below 0.5, where every value flushes to 0).
void check_range(const char* option, float range, PVFormat format) {
  const float max = rules::pv_format_max(format);
  if (range == 0.f || (range >= rules::kMinRange && range <= max)) return;
  throw Error(std::string("recipe.") + option,
              "must be 0 (the format's default) or from " + number(rules::kMinRange) + " to " +
                  number(max) + ", the largest value of pv_format " + to_string(format) +
                  " (got " + number(range) + ")");
}

// SageAttention2++'s FP16 accumulator sums 2 k32 steps of products of at most p * v before the
// FP32 add: 64 p v must stay within FP16's 65504, or the sum overflows to infinity on inputs
// that reach the bound (equal scores over a tile and a constant V channel).
void check_fp16x2_ranges(const Recipe& r) {
  if (r.pv_accum != PVAccum::fp16x2_fp32) return;
  const float p = rules::p_static_max(r), v = rules::v_static_max(r);
  if (double(p) * double(v) <= rules::kFp16x2MaxRangeProduct) return;
  const auto described = [](float given, float used) {
    return given == 0.f ? "0 (the format's default, " + number(used) + ")" : number(used);
  };
  throw Error("recipe.p_range",
              "times v_range must be at most " + number(float(rules::kFp16x2MaxRangeProduct)) +
                  " with pv_accum fp16x2_fp32, so that the FP16 sum of 64 products of P and V "
                  "stays below 65504 (got p_range " + described(r.p_range, p) + " and v_range " +
                  described(r.v_range, v) + ")");
}

void check_ranges(const Recipe& r, bool fp8_pv) {
  if (r.k_mean_stride < 1 || r.k_mean_stride > rules::kMaxKMeanStride)
    throw Error("recipe.k_mean_stride", "must be from 1 (every key) to " +
                                            std::to_string(rules::kMaxKMeanStride) + " (got " +
                                            std::to_string(r.k_mean_stride) + ")");
  const bool scaled_pv = fp8_pv || r.pv_format == PVFormat::int8;
  if (r.p_range != 0.f && !scaled_pv)
    throw Error("recipe.p_range", std::string("applies to fp8/int8 P only (pv_format ") +
                                      to_string(r.pv_format) + " takes 0, got " +
                                      number(r.p_range) + ")");
  if (r.v_range != 0.f && !scaled_pv)
    throw Error("recipe.v_range", std::string("applies to fp8/int8 V only (pv_format ") +
                                      to_string(r.pv_format) + " takes 0, got " +
                                      number(r.v_range) + ")");
  check_range("p_range", r.p_range, r.pv_format);
  check_range("v_range", r.v_range, r.pv_format);
  check_fp16x2_ranges(r);
}

}  // namespace

void validate_recipe(const Recipe& r) {
  check_enums(r);
  const bool fp4_qk = r.qk_format == QKFormat::nvfp4 || r.qk_format == QKFormat::mxfp4;
  if (fp4_qk != (r.qk_granularity == Granularity::microscale))
    throw Error("recipe.qk_granularity",
                std::string("microscale goes with qk_format nvfp4/mxfp4 and only with them (got ") +
                    to_string(r.qk_format) + " with " + to_string(r.qk_granularity) + ")");
  if (r.qk_format == QKFormat::fp16 && r.qk_granularity != Granularity::per_tensor)
    throw Error("recipe.qk_granularity", "qk_format fp16 is not quantized; use per_tensor");
  if (r.smooth_q && !(r.qk_format == QKFormat::int8 || r.qk_format == QKFormat::int4))
    throw Error("recipe.smooth_q", "Q smoothing is defined for int8/int4 Q/K only");
  if (r.qk_channel_balance && r.inputs == Inputs::prequantized_int8)
    throw Error("recipe.qk_channel_balance",
                "needs floating inputs: prequantized_int8 Q and K are already quantized");
  const bool fp4_pv = r.pv_format == PVFormat::nvfp4 || r.pv_format == PVFormat::mxfp4;
  if (r.pv_format == PVFormat::fp16 &&
      (r.p_scale != PScale::none || r.v_scale != VScale::none))
    throw Error("recipe.p_scale", "pv_format fp16 takes p_scale none and v_scale none");
  if (r.pv_format != PVFormat::fp16 && r.p_scale == PScale::none)
    throw Error("recipe.p_scale", std::string("pv_format ") + to_string(r.pv_format) +
                                      " needs p_scale static_max or two_level");
  if (r.p_scale == PScale::two_level && !fp4_pv)
    throw Error("recipe.p_scale", "two_level P scaling is defined for nvfp4/mxfp4 P only");
  if (fp4_pv != (r.v_scale == VScale::microscale))
    throw Error("recipe.v_scale", "microscale V goes with pv_format nvfp4/mxfp4 and only with them");
  if (r.pv_format != PVFormat::fp16 && r.v_scale == VScale::none)
    throw Error("recipe.v_scale", std::string("pv_format ") + to_string(r.pv_format) +
                                      " needs a V scale (per_channel, per_tensor or microscale)");
  const bool fp8_pv = r.pv_format == PVFormat::e4m3 || r.pv_format == PVFormat::e5m2;
  if ((r.pv_accum == PVAccum::fp22 || r.pv_accum == PVAccum::two_level ||
       r.pv_accum == PVAccum::fp16x2_fp32) && !fp8_pv)
    throw Error("recipe.pv_accum", std::string(to_string(r.pv_accum)) +
                                       " accumulation models the FP8 MMA and needs pv_format e4m3/e5m2");
  if (r.pv_accum == PVAccum::fp16 && r.pv_format != PVFormat::fp16)
    throw Error("recipe.pv_accum", "fp16 accumulation is defined for pv_format fp16 only");
  check_ranges(r, fp8_pv);
  if (r.inputs == Inputs::prequantized_int8 &&
      !(r.qk_format == QKFormat::int8 && r.qk_granularity == Granularity::per_token &&
        r.pv_format == PVFormat::int8 && !r.smooth_k && !r.smooth_q && !r.smooth_v))
    throw Error("recipe.inputs",
                "prequantized_int8 inputs need int8 per_token Q/K, int8 PV and no smoothing");
  if (r.p_scale == PScale::per_token && r.pv_format != PVFormat::int8)
    throw Error("recipe.p_scale", "per_token P scaling (SageBwd) is defined for int8 P only");
  if (r.p_scale == PScale::per_token && r.p_range > 0)
    throw Error("recipe.p_range", "p_range narrows a static P scale; per_token P takes none");
  if (r.v_scale == VScale::per_block && r.pv_format != PVFormat::int8)
    throw Error("recipe.v_scale", "per_block V (SageBwd) is defined for int8 V only");
  if (r.v_scale == VScale::per_block && r.inputs == Inputs::prequantized_int8)
    throw Error("recipe.v_scale", "prequantized_int8 inputs carry a V scale per tensor or per "
                                  "channel, not per_block");
  if (has_backward(r)) validate_backward(r);
}

const char* to_string(QKFormat v) {
  switch (v) {
    case QKFormat::fp16: return "fp16";
    case QKFormat::int8: return "int8";
    case QKFormat::int4: return "int4";
    case QKFormat::e4m3: return "e4m3";
    case QKFormat::nvfp4: return "nvfp4";
    case QKFormat::mxfp4: return "mxfp4";
  }
  return "?";
}
const char* to_string(Granularity v) {
  switch (v) {
    case Granularity::per_tensor: return "per_tensor";
    case Granularity::per_block: return "per_block";
    case Granularity::per_warp: return "per_warp";
    case Granularity::per_thread: return "per_thread";
    case Granularity::per_token: return "per_token";
    case Granularity::microscale: return "microscale";
  }
  return "?";
}
const char* to_string(PVFormat v) {
  switch (v) {
    case PVFormat::fp16: return "fp16";
    case PVFormat::e4m3: return "e4m3";
    case PVFormat::e5m2: return "e5m2";
    case PVFormat::int8: return "int8";
    case PVFormat::nvfp4: return "nvfp4";
    case PVFormat::mxfp4: return "mxfp4";
  }
  return "?";
}
const char* to_string(PScale v) {
  switch (v) {
    case PScale::none: return "none";
    case PScale::static_max: return "static";
    case PScale::two_level: return "two_level";
    case PScale::per_token: return "per_token";
  }
  return "?";
}
const char* to_string(VScale v) {
  switch (v) {
    case VScale::none: return "none";
    case VScale::per_channel: return "per_channel";
    case VScale::per_tensor: return "per_tensor";
    case VScale::microscale: return "microscale";
    case VScale::per_block: return "per_block";
  }
  return "?";
}
const char* to_string(PVAccum v) {
  switch (v) {
    case PVAccum::fp32: return "fp32";
    case PVAccum::fp16: return "fp16";
    case PVAccum::fp22: return "fp22";
    case PVAccum::two_level: return "two_level";
    case PVAccum::fp16x2_fp32: return "fp16x2_fp32";
  }
  return "?";
}
const char* to_string(RowSum v) {
  switch (v) {
    case RowSum::float_p: return "float_p";
    case RowSum::quantized_p: return "quantized_p";
    case RowSum::pv_mma: return "pv_mma";
  }
  return "?";
}
const char* to_string(Inputs v) {
  switch (v) {
    case Inputs::floating: return "floating";
    case Inputs::prequantized_int8: return "prequantized_int8";
  }
  return "?";
}

}  // namespace sage
