// Presets and recipe validation: every preset is consistent, and each inconsistency is
// reported under the name of the option that causes it.
#include <gtest/gtest.h>

#include <climits>
#include <cmath>
#include <limits>
#include <set>
#include <string>

#include "sage/error.h"
#include "sage/recipe.h"

namespace {

using namespace sage;

// Runs validate_recipe and checks the error names `argument` in one sentence.
void expect_invalid(const Recipe& r, const std::string& argument, const std::string& phrase) {
  try {
    validate_recipe(r);
    ADD_FAILURE() << "validate_recipe accepted a recipe that should fail on " << argument;
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), argument) << e.what();
    const std::string what = e.what();
    EXPECT_NE(what.find(phrase), std::string::npos) << what;
    EXPECT_EQ(what.rfind(argument + ": ", 0), 0u) << what;
    EXPECT_EQ(what.find('\n'), std::string::npos) << what;
  }
}

#define EXPECT_INVALID(recipe, argument, phrase) \
  do {                                           \
    SCOPED_TRACE(argument);                      \
    expect_invalid(recipe, argument, phrase);    \
  } while (0)

TEST(Recipes, EveryPresetValidates) {
  ASSERT_FALSE(presets().empty());
  for (const Recipe& r : presets()) {
    EXPECT_NO_THROW(validate_recipe(r)) << r.name;
    EXPECT_NE(recipe_paper(r), "custom") << r.name;
    EXPECT_FALSE(recipe_summary(r).empty()) << r.name;
  }
}

TEST(Recipes, PresetNamesAreUniqueAndFound) {
  std::set<std::string> names;
  for (const Recipe& r : presets()) {
    EXPECT_TRUE(names.insert(r.name).second) << "duplicate preset " << r.name;
    EXPECT_EQ(&preset(r.name), &r);
  }
  for (const char* n : {"sage1_t", "sage1_b", "sage1_vt", "sage1_vb", "sage2_8b", "sage2_4b",
                        "sage2pp_8b", "sage3_fp4", "int_flash"})
    EXPECT_TRUE(names.count(n)) << n;
}

TEST(Recipes, DefaultRecipeIsSage2_8bOptions) {
  const Recipe d{};
  const Recipe& p = preset("sage2_8b");
  EXPECT_EQ(d.qk_format, p.qk_format);
  EXPECT_EQ(d.qk_granularity, p.qk_granularity);
  EXPECT_EQ(d.smooth_k, p.smooth_k);
  EXPECT_EQ(d.pv_format, p.pv_format);
  EXPECT_EQ(d.p_scale, p.p_scale);
  EXPECT_EQ(d.v_scale, p.v_scale);
  EXPECT_EQ(d.pv_accum, p.pv_accum);
  EXPECT_EQ(d.k_mean_stride, p.k_mean_stride);
  EXPECT_NO_THROW(validate_recipe(d));
}

// sage2_8b (and sage2_8b_balanced, built on it) alone take K smoothing's mean over a stride of
// the keys (recipe.cpp says why); the other presets keep the papers' mean over every key, and
// the summary says which is which.
TEST(Recipes, OnlySage2_8bSamplesTheKeysForKsMean) {
  for (const Recipe& r : presets()) {
    const bool sampled = r.name == "sage2_8b" || r.name == "sage2_8b_balanced";
    EXPECT_EQ(r.k_mean_stride, sampled ? 8 : 1) << r.name;
    EXPECT_EQ(recipe_summary(r).find("every 8th key") != std::string::npos, sampled)
        << recipe_summary(r);
  }
}

TEST(Recipes, UnknownPresetListsTheNames) {
  try {
    preset("nope");
    FAIL() << "preset(\"nope\") returned";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "recipe");
    const std::string what = e.what();
    EXPECT_NE(what.find("'nope'"), std::string::npos) << what;
    for (const Recipe& r : presets()) EXPECT_NE(what.find(r.name), std::string::npos) << r.name;
  }
}

// ---- one test per validate_recipe branch --------------------------------------------------

Recipe base() { return preset("sage2_8b"); }

TEST(ValidateRecipe, MicroscaleGranularityWithoutFp4) {
  Recipe r = base();
  r.qk_granularity = Granularity::microscale;
  EXPECT_INVALID(r, "recipe.qk_granularity", "microscale");
}

TEST(ValidateRecipe, Fp4QKWithoutMicroscale) {
  Recipe r = preset("sage3_fp4");
  r.qk_granularity = Granularity::per_block;
  EXPECT_INVALID(r, "recipe.qk_granularity", "nvfp4/mxfp4");
  r.qk_format = QKFormat::mxfp4;
  EXPECT_INVALID(r, "recipe.qk_granularity", "mxfp4");
}

TEST(ValidateRecipe, Fp16QKMustBePerTensor) {
  Recipe r = base();
  r.qk_format = QKFormat::fp16;
  r.smooth_k = false;
  r.qk_granularity = Granularity::per_block;
  EXPECT_INVALID(r, "recipe.qk_granularity", "per_tensor");
  r.qk_granularity = Granularity::per_tensor;
  EXPECT_NO_THROW(validate_recipe(r));
}

TEST(ValidateRecipe, KMeanStrideIsFromOneTo2Pow20) {
  Recipe r = base();
  for (int stride : {0, -8, (1 << 20) + 1, INT32_MAX}) {
    r.k_mean_stride = stride;
    EXPECT_INVALID(r, "recipe.k_mean_stride", "from 1 (every key) to 1048576");
  }
  for (int stride : {1, 1 << 20}) {
    r.k_mean_stride = stride;
    EXPECT_NO_THROW(validate_recipe(r)) << stride;
  }
  // A parameter of K smoothing, inert without it: turning smoothing off in a preset with a
  // stride is a valid recipe (the Python parsers refuse only a stride given with it).
  r.k_mean_stride = 8;
  r.smooth_k = false;
  EXPECT_NO_THROW(validate_recipe(r));
}

TEST(ValidateRecipe, SmoothQNeedsIntegerQK) {
  Recipe r = base();
  r.qk_format = QKFormat::e4m3;
  r.smooth_q = true;
  EXPECT_INVALID(r, "recipe.smooth_q", "int8/int4");
}

TEST(ValidateRecipe, Fp16PVTakesNoScales) {
  Recipe r = preset("sage1_b");
  r.p_scale = PScale::static_max;
  EXPECT_INVALID(r, "recipe.p_scale", "pv_format fp16");
  r = preset("sage1_b");
  r.v_scale = VScale::per_channel;
  EXPECT_INVALID(r, "recipe.p_scale", "v_scale none");
}

TEST(ValidateRecipe, QuantizedPVNeedsPScale) {
  Recipe r = base();
  r.p_scale = PScale::none;
  EXPECT_INVALID(r, "recipe.p_scale", "static_max or two_level");
}

TEST(ValidateRecipe, TwoLevelPScaleNeedsFp4) {
  Recipe r = base();
  r.p_scale = PScale::two_level;
  EXPECT_INVALID(r, "recipe.p_scale", "nvfp4/mxfp4");
}

TEST(ValidateRecipe, MicroscaleVGoesWithFp4PV) {
  Recipe r = preset("sage3_fp4");
  r.v_scale = VScale::per_channel;
  EXPECT_INVALID(r, "recipe.v_scale", "microscale");
  r = base();
  r.v_scale = VScale::microscale;
  EXPECT_INVALID(r, "recipe.v_scale", "microscale");
}

TEST(ValidateRecipe, QuantizedPVNeedsVScale) {
  Recipe r = base();
  r.v_scale = VScale::none;
  EXPECT_INVALID(r, "recipe.v_scale", "needs a V scale");
}

TEST(ValidateRecipe, Fp8AccumulatorsNeedFp8PV) {
  for (PVAccum acc : {PVAccum::fp22, PVAccum::two_level, PVAccum::fp16x2_fp32}) {
    Recipe r = preset("sage1_vb");  // int8 PV
    r.pv_accum = acc;
    EXPECT_INVALID(r, "recipe.pv_accum", "e4m3/e5m2");
  }
}

TEST(ValidateRecipe, Fp16AccumulatorNeedsFp16PV) {
  Recipe r = base();
  r.pv_accum = PVAccum::fp16;
  EXPECT_INVALID(r, "recipe.pv_accum", "pv_format fp16");
}

// The cases: p_range 1e40 (inf as a float) returned zeros, 1000 a max error of 0.71,
// 1e-45 and v_range 1e40 NaN; all validated before.
TEST(ValidateRecipe, RangesOutsideTheFormatAreRefused) {
  const float inf = std::numeric_limits<float>::infinity();
  for (float bad : {1e38f, 1000.f, 448.5f, 1e-45f, 0.5f, -1.f, inf, std::nanf("")}) {
    Recipe r = base();  // E4M3 P and V: 1 .. 448
    r.p_range = bad;
    EXPECT_INVALID(r, "recipe.p_range", "from 1 to 448, the largest value of pv_format e4m3");
    r = base();
    r.v_range = bad;
    EXPECT_INVALID(r, "recipe.v_range", "from 1 to 448");
  }
  Recipe r = preset("sage1_vb");  // INT8 P and V: 1 .. 127
  r.p_range = 128.f;
  EXPECT_INVALID(r, "recipe.p_range", "from 1 to 127, the largest value of pv_format int8");
  r.p_range = 0.f;
  r.v_range = 200.f;
  EXPECT_INVALID(r, "recipe.v_range", "from 1 to 127");
  r = base();
  r.pv_format = PVFormat::e5m2;  // E5M2: 1 .. 57344
  r.p_range = 60000.f;
  EXPECT_INVALID(r, "recipe.p_range", "from 1 to 57344");
}

TEST(ValidateRecipe, RangesInsideTheFormatAreAccepted) {
  for (float good : {0.f, 1.f, 64.f, 256.f, 448.f}) {
    Recipe r = base();
    r.p_range = good;
    r.v_range = good;
    EXPECT_NO_THROW(validate_recipe(r)) << good;
  }
  Recipe r = preset("sage1_vb");
  r.p_range = r.v_range = 127.f;
  EXPECT_NO_THROW(validate_recipe(r));
}

// SageAttention2++'s FP16 accumulator: 64 products of at most p_range * v_range must fit 65504.
TEST(ValidateRecipe, Fp16x2AccumulationBoundsTheRangeProduct) {
  Recipe r = preset("sage2pp_8b");  // 112 * 4.5 = 504
  EXPECT_NO_THROW(validate_recipe(r));
  r.p_range = 448.f;  // 448 * 4.5 = 2016
  EXPECT_INVALID(r, "recipe.p_range", "at most 1023.5 with pv_accum fp16x2_fp32");
  r = preset("sage2pp_8b");
  r.p_range = r.v_range = 0.f;  // the defaults, 256 * 448
  EXPECT_INVALID(r, "recipe.p_range", "p_range 0 (the format's default, 256) and v_range 0");
  r.p_range = 1.f;
  r.v_range = 448.f;  // 448: exactly within
  EXPECT_NO_THROW(validate_recipe(r));
}

TEST(ValidateRecipe, NarrowedRangesNeedFp8OrInt8PV) {
  Recipe r = preset("sage1_b");  // fp16 PV
  r.p_range = 100.f;
  EXPECT_INVALID(r, "recipe.p_range", "fp8/int8 P only");
  r = preset("sage3_fp4");
  r.v_range = 2.f;
  EXPECT_INVALID(r, "recipe.v_range", "fp8/int8 V only");
}

// Enum fields holding no enumerator (a cast from an int) are refused under their own names;
// before, static_cast<PVAccum>(42) passed validation.
TEST(ValidateRecipe, EnumValuesOutsideTheEnumAreRefused) {
  const auto expect_refused = [](auto set, const std::string& option, const std::string& values) {
    Recipe r = base();
    set(r);
    EXPECT_INVALID(r, "recipe." + option, "is not one of " + values + " (got the code 42)");
  };
  expect_refused([](Recipe& r) { r.qk_format = static_cast<QKFormat>(42); }, "qk_format",
                 "fp16, int8, int4, e4m3, nvfp4, mxfp4");
  expect_refused([](Recipe& r) { r.qk_granularity = static_cast<Granularity>(42); },
                 "qk_granularity",
                 "per_tensor, per_block, per_warp, per_thread, per_token, microscale");
  expect_refused([](Recipe& r) { r.pv_format = static_cast<PVFormat>(42); }, "pv_format",
                 "fp16, e4m3, e5m2, int8, nvfp4, mxfp4");
  expect_refused([](Recipe& r) { r.p_scale = static_cast<PScale>(42); }, "p_scale",
                 "none, static, two_level, per_token");
  expect_refused([](Recipe& r) { r.v_scale = static_cast<VScale>(42); }, "v_scale",
                 "none, per_channel, per_tensor, microscale, per_block");
  expect_refused([](Recipe& r) { r.pv_accum = static_cast<PVAccum>(42); }, "pv_accum",
                 "fp32, fp16, fp22, two_level, fp16x2_fp32");
  expect_refused([](Recipe& r) { r.row_sum = static_cast<RowSum>(42); }, "row_sum",
                 "float_p, quantized_p, pv_mma");
  expect_refused([](Recipe& r) { r.inputs = static_cast<Inputs>(42); }, "inputs",
                 "floating, prequantized_int8");
  expect_refused([](Recipe& r) { r.dq_format = static_cast<BwdFormat>(42); }, "dq_format",
                 "none, fp16, int8");
  expect_refused([](Recipe& r) { r.bwd_ds_granularity = static_cast<Granularity>(42); },
                 "bwd_ds_granularity", "per_tensor, per_block, per_warp, per_thread, per_token, microscale");
}

TEST(ValidateRecipe, PrequantizedInputsNeedIntFlashOptions) {
  Recipe r = base();
  r.inputs = Inputs::prequantized_int8;
  EXPECT_INVALID(r, "recipe.inputs", "prequantized_int8");
  r = preset("int_flash");
  r.smooth_k = true;
  EXPECT_INVALID(r, "recipe.inputs", "no smoothing");
  r = preset("int_flash");
  r.qk_granularity = Granularity::per_block;
  EXPECT_INVALID(r, "recipe.inputs", "per_token");
}

TEST(Recipes, ToStringCoversEveryValue) {
  for (auto v : {QKFormat::fp16, QKFormat::int8, QKFormat::int4, QKFormat::e4m3, QKFormat::nvfp4,
                 QKFormat::mxfp4})
    EXPECT_STRNE(to_string(v), "?");
  for (auto v : {Granularity::per_tensor, Granularity::per_block, Granularity::per_warp,
                 Granularity::per_thread, Granularity::per_token, Granularity::microscale})
    EXPECT_STRNE(to_string(v), "?");
  for (auto v : {PVFormat::fp16, PVFormat::e4m3, PVFormat::e5m2, PVFormat::int8, PVFormat::nvfp4,
                 PVFormat::mxfp4})
    EXPECT_STRNE(to_string(v), "?");
  for (auto v : {PScale::none, PScale::static_max, PScale::two_level}) EXPECT_STRNE(to_string(v), "?");
  for (auto v : {VScale::none, VScale::per_channel, VScale::per_tensor, VScale::microscale})
    EXPECT_STRNE(to_string(v), "?");
  for (auto v : {PVAccum::fp32, PVAccum::fp16, PVAccum::fp22, PVAccum::two_level,
                 PVAccum::fp16x2_fp32})
    EXPECT_STRNE(to_string(v), "?");
  EXPECT_STREQ(to_string(RowSum::quantized_p), "quantized_p");
  EXPECT_STREQ(to_string(Inputs::prequantized_int8), "prequantized_int8");
  EXPECT_STREQ(to_string(static_cast<Inputs>(7)), "?");
}

// ---- SageBwd: its forward's P and V scales and the backward's options -------------------

TEST(Recipes, SagebwdIsThePapersTrainingRecipe) {
  const Recipe& r = preset("sagebwd");
  EXPECT_EQ(r.qk_format, QKFormat::int8);
  EXPECT_EQ(r.qk_granularity, Granularity::per_block);
  EXPECT_TRUE(r.smooth_k);
  EXPECT_EQ(r.pv_format, PVFormat::int8);
  EXPECT_EQ(r.p_scale, PScale::per_token);
  EXPECT_EQ(r.v_scale, VScale::per_block);
  EXPECT_TRUE(has_backward(r));
  EXPECT_EQ(r.dp_format, BwdFormat::fp16);  // the one 16-bit matmul of the seven
  for (BwdFormat f : {r.dv_format, r.dq_format, r.dk_format}) EXPECT_EQ(f, BwdFormat::int8);
  EXPECT_NO_THROW(validate_backward(r));
  EXPECT_NE(recipe_summary(r).find("backward dV int8 (P per_token), dP fp16"), std::string::npos)
      << recipe_summary(r);
  for (const Recipe& other : presets())
    if (other.name != "sagebwd" && other.name != "sagebwd_block") EXPECT_FALSE(has_backward(other)) << other.name;
}

// sagebwd quantizes dS per token (per query row for dQ, per key for dK); sagebwd_block is the
// same recipe with the paper's one dS scale per backward tile, and nothing else differs.
TEST(Recipes, SagebwdTakesDsPerTokenAndSagebwdBlockPerTile) {
  const Recipe& token = preset("sagebwd");
  const Recipe& block = preset("sagebwd_block");
  EXPECT_EQ(token.bwd_ds_granularity, Granularity::per_token);
  EXPECT_EQ(block.bwd_ds_granularity, Granularity::per_block);
  EXPECT_NE(recipe_summary(token).find("(dS per_token)"), std::string::npos) << recipe_summary(token);
  EXPECT_NE(recipe_summary(block).find("(dS per_block)"), std::string::npos) << recipe_summary(block);
  EXPECT_EQ(recipe_paper(block), recipe_paper(token));
  Recipe same = block;
  same.name = token.name;
  same.bwd_ds_granularity = Granularity::per_token;
  EXPECT_EQ(recipe_summary(same), recipe_summary(token));
  EXPECT_NO_THROW(validate_recipe(block));
}

TEST(ValidateRecipe, PerTokenPAndPerBlockVAreInt8Only) {
  Recipe r = preset("sagebwd");
  r.pv_format = PVFormat::e4m3;
  r.pv_accum = PVAccum::two_level;
  r.v_scale = VScale::per_channel;
  EXPECT_INVALID(r, "recipe.p_scale", "per_token P scaling");
  r = preset("sagebwd");
  r.p_range = 100.f;
  EXPECT_INVALID(r, "recipe.p_range", "per_token P takes none");
  r = base();
  r.v_scale = VScale::per_block;
  EXPECT_INVALID(r, "recipe.v_scale", "per_block V");
  r = preset("int_flash");
  r.v_scale = VScale::per_block;
  EXPECT_INVALID(r, "recipe.v_scale", "per tensor or per channel");
}

TEST(ValidateRecipe, BackwardFormatsAreSetTogether) {
  Recipe r = preset("sagebwd");
  r.dk_format = BwdFormat::none;
  EXPECT_INVALID(r, "recipe.dk_format", "all four");
  EXPECT_THROW(validate_backward(base()), Error);  // no backward at all
}

TEST(ValidateRecipe, Int8GradientsNeedOneQKScalePerBackwardTile) {
  Recipe r = preset("sagebwd");
  r.qk_granularity = Granularity::per_thread;
  EXPECT_INVALID(r, "recipe.dq_format", "per_block, per_warp or per_tensor");
  r.dq_format = BwdFormat::fp16;
  EXPECT_INVALID(r, "recipe.dk_format", "per_block or per_tensor");
  r.dk_format = BwdFormat::fp16;
  EXPECT_NO_THROW(validate_recipe(r));  // 16-bit dQ and dK take Q and K as they are
  r = preset("sagebwd");
  r.qk_granularity = Granularity::per_warp;  // per_block for K, 16-row groups for Q
  EXPECT_INVALID(r, "recipe.dk_format", "per_block or per_tensor");
  r = preset("sagebwd");
  r.qk_format = QKFormat::e4m3;
  EXPECT_INVALID(r, "recipe.dq_format", "int8/int4");
}

TEST(ValidateRecipe, BackwardRefusesWhatItDoesNotModel) {
  Recipe r = preset("sagebwd");
  r.smooth_q = true;
  EXPECT_INVALID(r, "recipe.smooth_q", "Q smoothing");
  r = preset("sagebwd");
  r.bwd_ds_granularity = Granularity::per_thread;
  EXPECT_INVALID(r, "recipe.bwd_ds_granularity", "per_block or per_token");
  r = preset("sagebwd");
  r.bwd_p_granularity = Granularity::per_tensor;
  EXPECT_INVALID(r, "recipe.bwd_p_granularity", "per_block or per_token");
}

TEST(Recipes, ToStringCoversTheBackwardsValues) {
  EXPECT_STREQ(to_string(PScale::per_token), "per_token");
  EXPECT_STREQ(to_string(VScale::per_block), "per_block");
  for (auto v : {BwdFormat::none, BwdFormat::fp16, BwdFormat::int8}) EXPECT_STRNE(to_string(v), "?");
}

}  // namespace
