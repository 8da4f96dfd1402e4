// The backward's recipe options (SageBwd): which recipes have a backward and which of its
// formats fit their forward. docs/numerics.md, "The backward", says why each rule exists.
#include <string>

#include "sage/error.h"
#include "sage/recipe.h"

namespace sage {
namespace {

bool integer_qk(const Recipe& r) {
  return r.qk_format == QKFormat::int8 || r.qk_format == QKFormat::int4;
}

// INT8 dQ = dS K sums over keys inside one backward K/V tile, so K's scale must be one number
// per tile: the forward's per_block (and per_warp, which is per_block for K) or per_tensor.
bool k_scale_uniform_per_kv_tile(Granularity g) {
  return g == Granularity::per_block || g == Granularity::per_warp || g == Granularity::per_tensor;
}

// INT8 dK = dS^T Q sums over the rows of a backward Q tile: Q's scale must be one number per
// tile. The forward's per_block groups are multiples of the backward's 64 rows (backward.h).
bool q_scale_uniform_per_q_tile(Granularity g) {
  return g == Granularity::per_block || g == Granularity::per_tensor;
}

void require_tile_granularity(Granularity g, const char* option) {
  if (g != Granularity::per_block && g != Granularity::per_token)
    throw Error(std::string("recipe.") + option,
                std::string("the backward quantizes its tiles per_block or per_token (got ") +
                    to_string(g) + ")");
}

void require_all_formats(const Recipe& r) {
  const struct {
    BwdFormat f;
    const char* name;
  } formats[] = {{r.dv_format, "dv_format"},
                 {r.dp_format, "dp_format"},
                 {r.dq_format, "dq_format"},
                 {r.dk_format, "dk_format"}};
  for (const auto& x : formats)
    if (x.f == BwdFormat::none)
      throw Error(std::string("recipe.") + x.name,
                  "a recipe with a backward sets all four of dv_format, dp_format, dq_format and "
                  "dk_format (fp16 or int8); this one is none");
}

}  // namespace

bool has_backward(const Recipe& r) {
  return r.dv_format != BwdFormat::none || r.dp_format != BwdFormat::none ||
         r.dq_format != BwdFormat::none || r.dk_format != BwdFormat::none;
}

void validate_backward(const Recipe& r) {
  if (!has_backward(r))
    throw Error("recipe.dv_format",
                "'" + r.name + "' has no backward (its backward formats are none); use sagebwd, "
                "or set dv_format, dp_format, dq_format and dk_format");
  require_all_formats(r);
  require_tile_granularity(r.bwd_p_granularity, "bwd_p_granularity");
  require_tile_granularity(r.bwd_ds_granularity, "bwd_ds_granularity");
  if (r.inputs != Inputs::floating)
    throw Error("recipe.inputs", "the backward needs floating inputs (prequantized INT8 inputs "
                                 "have no gradient)");
  if (r.smooth_q)
    throw Error("recipe.smooth_q", "the backward does not model Q smoothing (its per-tile mean "
                                   "would need a correction in dK)");
  if (r.qk_channel_balance)
    throw Error("recipe.qk_channel_balance",
                "the backward does not model the Q/K channel balance (dQ and dK would come out in "
                "the balanced channels' units and need the scales undone)");
  if (r.dq_format == BwdFormat::int8 &&
      !(integer_qk(r) && k_scale_uniform_per_kv_tile(r.qk_granularity)))
    throw Error("recipe.dq_format",
                std::string("int8 dQ = dS K takes the forward's integer K codes with one scale per "
                            "K/V tile: qk_format int8/int4 with qk_granularity per_block, per_warp "
                            "or per_tensor (got ") +
                    to_string(r.qk_format) + " " + to_string(r.qk_granularity) + ")");
  if (r.dk_format == BwdFormat::int8 &&
      !(integer_qk(r) && q_scale_uniform_per_q_tile(r.qk_granularity)))
    throw Error("recipe.dk_format",
                std::string("int8 dK = dS^T Q takes the forward's integer Q codes with one scale "
                            "per backward Q tile: qk_format int8/int4 with qk_granularity "
                            "per_block or per_tensor (got ") +
                    to_string(r.qk_format) + " " + to_string(r.qk_granularity) + ")");
}

const char* to_string(BwdFormat v) {
  switch (v) {
    case BwdFormat::none: return "none";
    case BwdFormat::fp16: return "fp16";
    case BwdFormat::int8: return "int8";
  }
  return "?";
}

}  // namespace sage
