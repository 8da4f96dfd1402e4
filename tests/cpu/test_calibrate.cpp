// Per-layer recipe selection (include/sage/calibrate.h): the selection rule end to end on
// layers whose right answer follows from how they are built, the choice file, the .npy
// reader, and the file path the `sage calibrate` command takes.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "reference/metrics.h"
#include "reference/synthetic.h"
#include "sage/attention.h"
#include "sage/calibrate.h"
#include "sage/error.h"
#include "numerics/formats.h"

namespace {

using namespace sage;
namespace fs = std::filesystem;

// Small enough that the whole file stays fast, large enough for stable error levels:
// two samples (batch entries) per layer.
reference::SyntheticShape layer_shape() {
  reference::SyntheticShape s;
  s.batch = 2;
  s.heads_q = s.heads_kv = 2;
  s.n_q = s.n_kv = 256;
  s.head_dim = 64;
  return s;
}

void scale(std::vector<uint16_t>& t, float f) {
  for (uint16_t& b : t) b = fmt::fp16_bits(fmt::fp16_from_bits(b) * f);
}

// A bias of +-800 on 8 channels of K, the same for every token, in batch entries
// [first, batch). q.b is then constant along each query row, which softmax ignores: the exact
// output does not change and K smoothing removes the bias, but a recipe without smoothing
// has to quantize K with a scale 40x too coarse.
void add_k_channel_bias(reference::SyntheticInputs& in, int64_t first_sample) {
  const int64_t d = in.shape.head_dim;
  const int64_t per_sample = in.shape.heads_kv * in.shape.n_kv * d;
  for (size_t i = static_cast<size_t>(first_sample * per_sample); i < in.k.size(); ++i) {
    const int64_t c = static_cast<int64_t>(i) % d;
    if (c < 8) in.k[i] = fmt::fp16_bits(fmt::fp16_from_bits(in.k[i]) + (c & 1 ? 800.f : -800.f));
  }
}

LayerSamples samples_of(const reference::SyntheticInputs& in) {
  return {in.q_view(), in.k_view(), in.v_view()};
}

// The known-answer model. Candidates sage2_4b > int_flash_q > sage2_8b in speed (a table made
// up for the test), threshold 0.998:
//   layer 0  v_bias: tiny scores, error dominated by V, which every candidate handles:
//            all pass, the fastest (sage2_4b) wins.
//   layer 1  normal: INT4 Q/K misses 99.8% (1 - cos ~2e-2), the INT8 ones pass:
//            int_flash_q, the faster INT8 one.
//   layer 2  normal in sample 0, sample 1 with a K channel bias: only the worst sample
//            disqualifies int_flash_q (no K smoothing): sage2_8b.
//   layer 3  scores 24x sharper than N(0,1) plus the K bias: INT8 Q/K misses 99.8% too, INT4
//            and unsmoothed K much more: nothing passes; sage2_8b is the most accurate.
struct KnownModel {
  std::vector<reference::SyntheticInputs> inputs;
  std::vector<LayerSamples> layers() const {
    std::vector<LayerSamples> v;
    for (const auto& in : inputs) v.push_back(samples_of(in));
    return v;
  }
};

KnownModel known_model() {
  KnownModel m;
  const auto sh = layer_shape();
  m.inputs.push_back(reference::make_synthetic("v_bias", sh, 1));
  m.inputs.push_back(reference::make_synthetic("normal", sh, 2));
  m.inputs.push_back(reference::make_synthetic("normal", sh, 3));
  add_k_channel_bias(m.inputs.back(), 1);
  m.inputs.push_back(reference::make_synthetic("sharp", sh, 4));
  scale(m.inputs.back().q, 8.f);
  add_k_channel_bias(m.inputs.back(), 0);
  return m;
}

const std::vector<std::string> kCandidates = {"sage2_4b", "int_flash_q", "sage2_8b"};

SpeedTable known_speeds() {
  SpeedTable t;
  for (const auto& [name, tops] :
       std::vector<std::pair<std::string, double>>{{"sage2_4b", 500}, {"int_flash_q", 400}, {"sage2_8b", 300}}) {
    t.add({name, 64, false, 1024, tops});
    // Farther from the samples' 256 tokens than 1024 on a log scale, so never used here.
    t.add({name, 64, false, 16384, 1000 - tops});
    // Causal and other head-dim records must not leak into a non-causal d = 64 lookup.
    t.add({name, 64, true, 256, 1000 - tops});
    t.add({name, 128, false, 256, 1000 - tops});
  }
  t.source = "test table";
  return t;
}

CalibrationOptions known_options() {
  CalibrationOptions o;
  o.candidates = kCandidates;
  return o;
}

const Calibration& known_result() {
  static const Calibration c = [] {
    const KnownModel m = known_model();
    return calibrate(m.layers(), known_speeds(), known_options());
  }();
  return c;
}

const CandidateScore& score(const LayerChoice& l, const std::string& recipe) {
  for (const CandidateScore& s : l.scores)
    if (s.recipe == recipe) return s;
  throw std::runtime_error("no score for " + recipe);
}

struct TempDir {
  fs::path path;
  explicit TempDir(const std::string& tag) {
    path = fs::temp_directory_path() /
           ("sage_calib_" + tag + "_" + std::to_string(static_cast<long>(getpid())));
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  std::string file(const std::string& name) const { return (path / name).string(); }
};

void write_text(const std::string& path, const std::string& text) {
  std::ofstream f(path, std::ios::binary);
  f << text;
}

// Expects `f` to throw sage::Error with this argument and every phrase in its message.
template <class F>
void expect_error(F&& f, const std::string& argument, const std::vector<std::string>& phrases) {
  try {
    f();
    ADD_FAILURE() << "no error; expected one on " << argument;
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), argument) << e.what();
    for (const std::string& p : phrases)
      EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << "'" << p << "' not in: " << e.what();
  }
}

// ---- the known-answer model -------------------------------------------------------------------

TEST(Calibrate, PicksTheKnownAnswerPerLayer) {
  const Calibration& c = known_result();
  ASSERT_EQ(c.layers.size(), 4u);
  const std::vector<std::string> want = {"sage2_4b", "int_flash_q", "sage2_8b", "sage2_8b"};
  const std::vector<bool> passed = {true, true, true, false};
  for (size_t i = 0; i < 4; ++i) {
    SCOPED_TRACE("layer " + std::to_string(i));
    const LayerChoice& l = c.layers[i];
    for (const CandidateScore& s : l.scores)
      if (std::getenv("SAGE_PRINT_MEASUREMENTS"))
        std::printf("layer %zu %-12s 1-cos %.3g rel_l1 %.3g\n", i, s.recipe.c_str(), 1 - s.cosine,
                  s.rel_l1);
    EXPECT_EQ(l.layer, static_cast<int64_t>(i));
    EXPECT_EQ(l.recipe, want[i]);
    EXPECT_EQ(l.passed, passed[i]);
    const CandidateScore& chosen = score(l, l.recipe);
    EXPECT_EQ(l.cosine, chosen.cosine);
    EXPECT_EQ(l.rel_l1, chosen.rel_l1);
    ASSERT_TRUE(l.tops.has_value());
    // Nearest measurement on a log scale: 1024 tokens, non-causal, d = 64.
    EXPECT_EQ(chosen.speed_n, 1024);
    EXPECT_EQ(*l.tops, l.recipe == "sage2_4b" ? 500 : l.recipe == "int_flash_q" ? 400 : 300);
  }
  // The reasons, not just the outcome: which candidates pass on each layer.
  auto passes = [&](size_t layer, const std::string& r) { return score(c.layers[layer], r).passed; };
  EXPECT_TRUE(passes(0, "sage2_4b") && passes(0, "int_flash_q") && passes(0, "sage2_8b"));
  EXPECT_TRUE(!passes(1, "sage2_4b") && passes(1, "int_flash_q") && passes(1, "sage2_8b"));
  EXPECT_TRUE(!passes(2, "sage2_4b") && !passes(2, "int_flash_q") && passes(2, "sage2_8b"));
  EXPECT_TRUE(!passes(3, "sage2_4b") && !passes(3, "int_flash_q") && !passes(3, "sage2_8b"));
  // The K bias costs the unsmoothed recipe far more than the threshold's margin, smoothing
  // takes it away: by construction, not by a near miss.
  EXPECT_LT(score(c.layers[2], "int_flash_q").cosine, 0.9);
  EXPECT_GT(score(c.layers[2], "sage2_8b").cosine, 0.999);
  EXPECT_GT(score(c.layers[3], "sage2_8b").cosine, score(c.layers[3], "sage2_4b").cosine + 0.1);
  EXPECT_EQ(c.speed_source, "test table");
  EXPECT_EQ(c.candidates, kCandidates);
}

TEST(Calibrate, ScoreIsTheWorstSample) {
  // Layer 2 with only its clean sample: int_flash_q passes and, being faster, is chosen.
  KnownModel m = known_model();
  reference::SyntheticShape one = layer_shape();
  one.batch = 1;
  const reference::SyntheticInputs clean = reference::make_synthetic("normal", one, 3);
  const Calibration c = calibrate({samples_of(clean)}, known_speeds(), known_options());
  EXPECT_EQ(c.layers[0].recipe, "int_flash_q");
  // Each (batch, head) draws from its own stream, so sample 0 of layer 2 is this very input:
  // its score with both samples is no better than with the clean one alone.
  EXPECT_LT(score(known_result().layers[2], "int_flash_q").cosine,
            score(c.layers[0], "int_flash_q").cosine);
  EXPECT_LE(score(known_result().layers[2], "sage2_8b").cosine, score(c.layers[0], "sage2_8b").cosine);
}

TEST(Calibrate, ProgressCallbackSeesEveryLayerAndCandidate) {
  reference::SyntheticShape s = layer_shape();
  s.batch = 1;
  s.n_q = s.n_kv = 64;
  const auto a = reference::make_synthetic("normal", s, 1);
  CalibrationOptions o = known_options();
  std::vector<std::string> steps;
  o.on_step = [&](int64_t layer, const std::string& r) { steps.push_back(std::to_string(layer) + r); };
  calibrate({samples_of(a), samples_of(a)}, known_speeds(), o);
  EXPECT_EQ(steps, (std::vector<std::string>{"0sage2_4b", "0int_flash_q", "0sage2_8b", "1sage2_4b",
                                             "1int_flash_q", "1sage2_8b"}));
}

// ---- the selection rule -----------------------------------------------------------------------

CandidateScore sc(const std::string& r, double cos, std::optional<double> tops, bool passed) {
  CandidateScore s;
  s.recipe = r;
  s.cosine = cos;
  s.tops = tops;
  s.passed = passed;
  return s;
}

TEST(Calibrate, SelectionRuleAndTieBreaks) {
  // Fastest passing measured candidate, even when a more accurate one exists.
  EXPECT_EQ(select_candidate({sc("a", 0.9999, 100, true), sc("b", 0.9985, 200, true)}), 1u);
  // A failing candidate is never chosen while one passes, however fast.
  EXPECT_EQ(select_candidate({sc("a", 0.99, 900, false), sc("b", 0.999, 100, true)}), 1u);
  // A measured passing candidate beats an unmeasured one, even a more accurate one.
  EXPECT_EQ(select_candidate({sc("a", 0.9999, std::nullopt, true), sc("b", 0.999, 100, true)}), 1u);
  // Only unmeasured candidates pass: the most accurate of them.
  EXPECT_EQ(select_candidate({sc("a", 0.999, std::nullopt, true), sc("b", 0.9995, std::nullopt, true),
                              sc("c", 0.9, 900, false)}),
            1u);
  // None passes: the most accurate, measured or not.
  EXPECT_EQ(select_candidate({sc("a", 0.99, 900, false), sc("b", 0.995, std::nullopt, false)}), 1u);
  // Equal speed: the more accurate; equal in everything: the earlier candidate.
  EXPECT_EQ(select_candidate({sc("a", 0.999, 100, true), sc("b", 0.9995, 100, true)}), 1u);
  EXPECT_EQ(select_candidate({sc("a", 0.999, 100, true), sc("b", 0.999, 100, true)}), 0u);
  // NaN is never the most accurate.
  EXPECT_EQ(select_candidate({sc("a", NAN, std::nullopt, false), sc("b", 0.5, std::nullopt, false)}), 1u);
}

TEST(Calibrate, SpeedLookupIsNearestOnALogScale) {
  SpeedTable t;
  t.add({"sage2_8b", 128, false, 1024, 100});
  t.add({"sage2_8b", 128, false, 4096, 200});
  t.add({"sage2_8b", 128, false, 4096, 300});  // repeats average
  EXPECT_EQ(t.lookup("sage2_8b", 128, false, 1500)->n, 1024);
  EXPECT_EQ(t.lookup("sage2_8b", 128, false, 2048)->n, 4096);  // equidistant: the larger n
  EXPECT_EQ(t.lookup("sage2_8b", 128, false, 3000)->tops, 250);
  EXPECT_FALSE(t.lookup("sage2_8b", 128, true, 1024));
  EXPECT_FALSE(t.lookup("sage2_8b", 64, false, 1024));
  EXPECT_FALSE(t.lookup("sage1_b", 128, false, 1024));
  expect_error([&] { t.add({"x", 128, false, 1024, 0}); }, "speeds", {"tops"});
}

TEST(Calibrate, UnmeasuredCandidateOnlyWhenNoMeasuredOnePasses) {
  reference::SyntheticShape s = layer_shape();
  s.batch = 1;
  s.n_q = s.n_kv = 128;
  const auto normal = reference::make_synthetic("normal", s, 5);
  SpeedTable t;
  t.add({"sage2_4b", 64, false, 128, 500});  // measured but fails on normal inputs
  t.add({"sage2_8b", 64, false, 128, 300});
  CalibrationOptions o;
  o.candidates = {"sage1_t", "sage2_4b", "sage2_8b"};  // sage1_t: most accurate, not measured
  Calibration c = calibrate({samples_of(normal)}, t, o);
  EXPECT_EQ(c.layers[0].recipe, "sage2_8b");
  EXPECT_FALSE(score(c.layers[0], "sage1_t").tops.has_value());
  // Without sage2_8b, no measured candidate passes: the unmeasured one is chosen, tops null.
  o.candidates = {"sage1_t", "sage2_4b"};
  c = calibrate({samples_of(normal)}, t, o);
  EXPECT_EQ(c.layers[0].recipe, "sage1_t");
  EXPECT_TRUE(c.layers[0].passed);
  EXPECT_FALSE(c.layers[0].tops.has_value());
  EXPECT_NE(calibration_json(c).find("\"tops\": null"), std::string::npos);
}

TEST(Calibrate, ArgumentErrors) {
  reference::SyntheticShape s = layer_shape();
  s.batch = 1;
  s.n_q = s.n_kv = 32;
  const auto in = reference::make_synthetic("normal", s, 1);
  const std::vector<LayerSamples> one = {samples_of(in)};
  CalibrationOptions o;
  o.candidates = {"sage9"};
  expect_error([&] { calibrate(one, {}, o); }, "candidates", {"sage9"});
  o.candidates = {"int_flash"};
  expect_error([&] { calibrate(one, {}, o); }, "candidates", {"int_flash", "prequantized"});
  o.candidates = {"sage2_8b", "sage2_8b"};
  expect_error([&] { calibrate(one, {}, o); }, "candidates", {"twice"});
  o.candidates = {"sage2_8b"};
  o.threshold = 1.5;
  expect_error([&] { calibrate(one, {}, o); }, "threshold", {"(0, 1]"});
  o.threshold = 0.998;
  expect_error([&] { calibrate({}, {}, o); }, "layers", {"no layers"});
  std::vector<float> f32(static_cast<size_t>(in.q_view().numel()));
  LayerSamples bad = one[0];
  bad.q = contiguous_view(f32.data(), DType::f32, {1, 2, 32, 64});
  expect_error([&] { calibrate({one[0], bad}, {}, o); }, "layers", {"layer 1", "f16 or bf16"});
  bad = one[0];
  bad.k.shape[3] = 32;  // head_dim mismatch, found by check_args
  expect_error([&] { calibrate({bad}, {}, o); }, "layers", {"layer 0", "k"});
  EXPECT_FALSE(default_candidates().empty());
  for (const std::string& n : default_candidates()) EXPECT_NE(n, "int_flash");
}

// A layer whose samples hold NaN or Inf used to get a recipe, scored with cosine 0 or NaN; it
// is refused, naming the layer, the tensor and the first non-finite element.
TEST(Calibrate, NonFiniteSamplesAreRefusedByName) {
  reference::SyntheticShape s = layer_shape();
  s.batch = 1;
  s.n_q = s.n_kv = 32;
  CalibrationOptions o;
  o.candidates = {"sage2_8b"};
  const uint16_t nan = 0x7E00, inf = 0x7C00;  // fp16
  auto in = reference::make_synthetic("normal", s, 1);
  in.q[5 * 64 + 3] = nan;  // head 0, token 5, channel 3
  expect_error([&] { calibrate({samples_of(in)}, {}, o); }, "layers",
               {"layer 0: q: holds NaN at [batch, head, token, channel] = [0, 0, 5, 3]", "finite"});
  in = reference::make_synthetic("normal", s, 1);
  in.v[(32 + 1) * 64] = inf;  // head 1, token 1, channel 0
  const auto good = reference::make_synthetic("normal", s, 2);
  expect_error([&] { calibrate({samples_of(good), samples_of(in)}, {}, o); }, "layers",
               {"layer 1: v: holds Inf at [batch, head, token, channel] = [0, 1, 1, 0]"});
}

// ---- the choice file --------------------------------------------------------------------------

TEST(Calibrate, ChoiceFileRoundTrip) {
  const Calibration& c = known_result();
  TempDir dir("roundtrip");
  const std::string path = dir.file("choices.json");
  save_calibration(c, path);
  const std::vector<Recipe> recipes = load_layer_choices(path);
  ASSERT_EQ(recipes.size(), c.layers.size());
  for (size_t i = 0; i < recipes.size(); ++i) {
    EXPECT_EQ(recipes[i].name, c.layers[i].recipe);
    EXPECT_EQ(recipes[i].smooth_k, preset(c.layers[i].recipe).smooth_k);
  }
  // Stable key order, top level and per layer.
  const std::string j = calibration_json(c);
  size_t at = 0;
  for (const char* key : {"\"version\": 1", "\"threshold\": 0.998", "\"causal\": false", "\"layers\"",
                          "\"layer\": 0", "\"recipe\": \"sage2_4b\"", "\"cosine\"", "\"rel_l1\"",
                          "\"tops\": 500", "\"passed\": true", "\"layer\": 3", "\"passed\": false",
                          "\"candidates\": [\"sage2_4b\", \"int_flash_q\", \"sage2_8b\"]",
                          "\"speed_source\": \"test table\""}) {
    const size_t p = j.find(key, at);
    ASSERT_NE(p, std::string::npos) << key << " after offset " << at << " in\n" << j;
    at = p;
  }
  // Numbers are written so that they read back exactly.
  const size_t cos_at = j.find("\"cosine\": ") + 10;
  EXPECT_EQ(std::strtod(j.c_str() + cos_at, nullptr), c.layers[0].cosine);
}

TEST(Calibrate, ChoiceFileErrorsNameTheFileAndField) {
  TempDir dir("loader");
  const std::string p = dir.file("c.json");
  auto with_layers = [&](const std::string& layers) {
    write_text(p, "{\"version\": 1, \"threshold\": 0.998, \"layers\": [" + layers + "]}");
  };
  with_layers("{\"layer\": 0, \"recipe\": \"sage2_8b\"}, {\"layer\": 1, \"recipe\": \"sage7\"}");
  expect_error([&] { load_layer_choices(p); }, "calibration_file", {p, "layers[1].recipe", "sage7"});
  with_layers("{\"layer\": 1, \"recipe\": \"sage2_8b\"}");
  expect_error([&] { load_layer_choices(p); }, "calibration_file", {p, "layers[0].layer", "must be 0"});
  with_layers("{\"layer\": 0}");
  expect_error([&] { load_layer_choices(p); }, "calibration_file", {"layers[0].recipe", "missing"});
  with_layers("");
  expect_error([&] { load_layer_choices(p); }, "calibration_file", {"layers", "empty"});
  write_text(p, "{\"version\": 2, \"layers\": []}");
  expect_error([&] { load_layer_choices(p); }, "calibration_file", {"version", "must be 1"});
  write_text(p, "{\"version\": 1, \"layers\": [");
  expect_error([&] { load_layer_choices(p); }, "calibration_file", {p, "not valid JSON"});
  expect_error([&] { load_layer_choices(dir.file("absent.json")); }, "calibration_file",
               {"absent.json", "cannot be opened"});
}

// ---- .npy files -------------------------------------------------------------------------------

// A hand-made .npy: magic, version, header (padded so data starts at 64), then `data_bytes`.
void write_raw_npy(const std::string& path, const std::string& header_dict, size_t data_bytes,
                   const char* magic = "\x93NUMPY", unsigned char major = 1) {
  std::string h = header_dict;
  const size_t base = 10 + h.size() + 1;
  h += std::string((64 - base % 64) % 64, ' ') + "\n";
  std::ofstream f(path, std::ios::binary);
  f.write(magic, 6);
  const char ver[2] = {static_cast<char>(major), 0};
  f.write(ver, 2);
  const char len[2] = {static_cast<char>(h.size() & 0xFF), static_cast<char>(h.size() >> 8)};
  f.write(len, 2);
  f << h << std::string(data_bytes, '\0');
}

TEST(CalibrateNpy, RoundTripF16AndF32) {
  TempDir dir("npy");
  const std::vector<float> f = {1.5f, -2.25f, 3.0e-3f, 65504.f, -0.f, 7.f};
  write_npy(dir.file("a.npy"), {2, 3}, f.data());
  NpyArray a = read_npy(dir.file("a.npy"));
  EXPECT_EQ(a.dtype, DType::f32);
  EXPECT_EQ(a.shape, (std::vector<int64_t>{2, 3}));
  ASSERT_EQ(a.data.size(), 24u);
  EXPECT_EQ(std::memcmp(a.data.data(), f.data(), 24), 0);

  std::vector<uint16_t> h;
  for (float x : f) h.push_back(fmt::fp16_bits(x));
  write_npy_f16(dir.file("b.npy"), {1, 2, 3, 1}, h.data());
  NpyArray b = read_npy(dir.file("b.npy"));
  EXPECT_EQ(b.dtype, DType::f16);
  EXPECT_EQ(b.shape, (std::vector<int64_t>{1, 2, 3, 1}));
  ASSERT_EQ(b.data.size(), 12u);
  EXPECT_EQ(std::memcmp(b.data.data(), h.data(), 12), 0);

  // NumPy's own spellings: version 2.0, 1-d shape "(6,)", no trailing comma, reordered keys.
  // (version 2.0 has a 4-byte header length, hence no write_raw_npy)
  {
    std::string hdr = "{'shape': (6,), 'fortran_order': False, 'descr': '<f4'}";
    const size_t base = 12 + hdr.size() + 1;
    hdr += std::string((64 - base % 64) % 64, ' ') + "\n";
    std::ofstream o(dir.file("c.npy"), std::ios::binary);
    o.write("\x93NUMPY\x02\x00", 8);
    const char len[4] = {static_cast<char>(hdr.size()), 0, 0, 0};
    o.write(len, 4);
    o << hdr;
    o.write(reinterpret_cast<const char*>(f.data()), 24);
  }
  NpyArray c = read_npy(dir.file("c.npy"));
  EXPECT_EQ(c.shape, (std::vector<int64_t>{6}));
  EXPECT_EQ(std::memcmp(c.data.data(), f.data(), 24), 0);
}

TEST(CalibrateNpy, ErrorsNameTheFileAndTheProblem) {
  TempDir dir("npyerr");
  const std::string p = dir.file("x.npy");
  write_raw_npy(p, "{'descr': '<f4', 'fortran_order': False, 'shape': (2,), }", 8, "\x93NUMPZ");
  expect_error([&] { read_npy(p); }, "npy", {p, "bad magic"});
  write_raw_npy(p, "{'descr': '<f8', 'fortran_order': False, 'shape': (2,), }", 16);
  expect_error([&] { read_npy(p); }, "npy", {p, "'<f8'", "not supported"});
  write_raw_npy(p, "{'descr': '>f4', 'fortran_order': False, 'shape': (2,), }", 8);
  expect_error([&] { read_npy(p); }, "npy", {"'>f4'"});
  write_raw_npy(p, "{'descr': '<f4', 'fortran_order': True, 'shape': (2, 2), }", 16);
  expect_error([&] { read_npy(p); }, "npy", {p, "fortran_order True"});
  write_raw_npy(p, "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 2), }", 12);
  expect_error([&] { read_npy(p); }, "npy", {p, "shorter"});
  write_raw_npy(p, "{'descr': '<f4', 'fortran_order': False, 'shape': (2,), }", 12);
  expect_error([&] { read_npy(p); }, "npy", {p, "longer"});
  write_raw_npy(p, "{'descr': '<f4', 'fortran_order': False, 'shape': (2,), }", 8, "\x93NUMPY", 3);
  expect_error([&] { read_npy(p); }, "npy", {p, "version 3.0"});
  write_raw_npy(p, "{'descr': '<f4', 'shape': (2,), }", 8);
  expect_error([&] { read_npy(p); }, "npy", {p, "malformed header"});
  expect_error([&] { read_npy(dir.file("none.npy")); }, "npy", {"none.npy", "cannot be opened"});
}

// ---- the `sage calibrate` path: files in, files out ----------------------------------------------

// Writes `in` as layer<i>_{q,k,v}.npy: fp16 as given, or fp32 (which the loader rounds back
// to the same fp16 values), or 3-d when the batch is 1.
void write_layer(const TempDir& dir, int layer, const reference::SyntheticInputs& in, bool as_f32,
                 bool three_d = false) {
  const auto& s = in.shape;
  const std::vector<const std::vector<uint16_t>*> parts = {&in.q, &in.k, &in.v};
  const int64_t heads[3] = {s.heads_q, s.heads_kv, s.heads_kv};
  const int64_t tokens[3] = {s.n_q, s.n_kv, s.n_kv};
  for (int t = 0; t < 3; ++t) {
    std::vector<int64_t> shape = {s.batch, heads[t], tokens[t], t == 2 ? s.v_dim() : s.head_dim};
    if (three_d) shape.erase(shape.begin());
    const std::string path = dir.file("layer" + std::to_string(layer) + "_" + "qkv"[t] + ".npy");
    if (as_f32) {
      std::vector<float> f;
      for (uint16_t b : *parts[t]) f.push_back(fmt::fp16_from_bits(b));
      write_npy(path, shape, f.data());
    } else {
      write_npy_f16(path, shape, parts[t]->data());
    }
  }
}

TEST(CalibrateCli, FilesInChoiceFileOut) {
  TempDir dir("cli");
  const KnownModel m = known_model();
  for (int i = 0; i < 4; ++i) write_layer(dir, i, m.inputs[i], /*as_f32=*/i % 2 == 1);
  // The bench file format (bench/results/h100.json): other implementations' baselines and
  // kernel-only timings are not the recipes' speed and must be skipped.
  std::string bench = "[\n";
  for (const auto& [name, tops] :
       std::vector<std::pair<std::string, double>>{{"sage2_4b", 500}, {"int_flash_q", 400}, {"sage2_8b", 300}}) {
    bench += "{\"impl\": \"sagekit\", \"recipe\": \"" + name + "\", \"d\": 64, \"causal\": false, "
             "\"n\": 1024, \"batch\": 16, \"heads\": 32, \"dtype\": \"float16\", \"whole_call\": true, "
             "\"ms\": 1.0, \"tops\": " + std::to_string(tops) + ", \"device\": \"Test GPU\"},\n";
    bench += "{\"impl\": \"sagekit\", \"recipe\": \"" + name + "\", \"d\": 64, \"causal\": false, "
             "\"n\": 1024, \"whole_call\": false, \"tops\": 9999},\n";
  }
  bench += "{\"impl\": \"torch-flash\", \"recipe\": \"sage2_8b\", \"d\": 64, \"causal\": false, "
           "\"n\": 1024, \"whole_call\": true, \"tops\": 9999, \"device\": \"Other\"}\n]\n";
  write_text(dir.file("bench.json"), bench);

  const SpeedTable speeds = load_speed_table(dir.file("bench.json"));
  EXPECT_EQ(speeds.entries().size(), 3u);
  EXPECT_EQ(speeds.source, dir.file("bench.json") + " (Test GPU)");
  const LayerFiles files = load_layer_files(dir.path.string());
  ASSERT_EQ(files.layers.size(), 4u);
  const Calibration c = calibrate(files.layers, speeds, known_options());
  const Calibration& mem = known_result();
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(c.layers[i].recipe, mem.layers[i].recipe) << i;
    EXPECT_EQ(c.layers[i].passed, mem.layers[i].passed) << i;
    // fp32 files hold the fp16 values exactly, so the scores are bit-identical.
    EXPECT_EQ(c.layers[i].cosine, mem.layers[i].cosine) << i;
  }
  save_calibration(c, dir.file("choices.json"));
  const std::vector<Recipe> r = load_layer_choices(dir.file("choices.json"));
  ASSERT_EQ(r.size(), 4u);
  EXPECT_EQ(r[2].name, "sage2_8b");
}

TEST(CalibrateCli, ThreeDimensionalFilesAreBatchOne) {
  TempDir dir("cli3d");
  reference::SyntheticShape s = layer_shape();
  s.batch = 1;
  s.heads_q = 4;  // GQA: 4 query heads over 2 KV heads
  s.n_q = 64;
  s.n_kv = 96;
  const auto in = reference::make_synthetic("normal", s, 9);
  write_layer(dir, 0, in, false, /*three_d=*/true);
  const LayerFiles files = load_layer_files(dir.path.string());
  ASSERT_EQ(files.layers.size(), 1u);
  const TensorView& q = files.layers[0].q;
  EXPECT_EQ(q.ndim, 4);
  EXPECT_EQ(q.shape[0], 1);
  EXPECT_EQ(q.shape[1], 4);
  EXPECT_EQ(q.shape[2], 64);
  EXPECT_EQ(files.layers[0].k.shape[2], 96);
  CalibrationOptions o;
  o.candidates = {"sage2_8b"};
  o.causal = true;
  const Calibration c = calibrate(files.layers, SpeedTable{}, o);
  EXPECT_TRUE(c.layers[0].passed);
  EXPECT_TRUE(c.causal);
}

// MLA's kind of layer (V with a head dim of its own) calibrates from its files: the scores are
// taken on V's channels, and each equals a direct comparison of simulate with exact.
TEST(CalibrateCli, VHeadDimOfItsOwn) {
  TempDir dir("clidv");
  reference::SyntheticShape s = layer_shape();
  s.batch = 1, s.n_q = s.n_kv = 64, s.head_dim = 96, s.head_dim_v = 48;
  const auto in = reference::make_synthetic("normal", s, 5);
  write_layer(dir, 0, in, false);
  const LayerFiles files = load_layer_files(dir.path.string());
  ASSERT_EQ(files.layers.size(), 1u);
  EXPECT_EQ(files.layers[0].v.shape[3], 48);
  CalibrationOptions o;
  o.candidates = {"sage2_8b"};
  const Calibration c = calibrate(files.layers, SpeedTable{}, o);
  AttentionArgs a;
  a.q = in.q_view(), a.k = in.k_view(), a.v = in.v_view();
  std::vector<float> sim(size_t(s.heads_q * s.n_q * 48)), ex(sim.size());
  a.out = contiguous_view(ex.data(), DType::f32, {1, s.heads_q, s.n_q, 48});
  reference::exact(a);
  std::vector<uint16_t> sim16(sim.size());
  a.out = contiguous_view(sim16.data(), DType::f16, {1, s.heads_q, s.n_q, 48});
  a.recipe = preset("sage2_8b");
  reference::simulate(a);
  for (size_t i = 0; i < sim.size(); ++i) sim[i] = fmt::fp16_from_bits(sim16[i]);
  const reference::ErrorStats st = reference::compare(sim.data(), ex.data(), int64_t(sim.size()));
  EXPECT_NEAR(score(c.layers[0], "sage2_8b").cosine, st.cosine, 1e-9);  // its exact is float64
  EXPECT_GT(st.cosine, 0.999);
}

TEST(CalibrateCli, InputDirectoryErrors) {
  TempDir dir("clierr");
  expect_error([&] { load_layer_files(dir.file("nope")); }, "inputs", {"nope", "not a directory"});
  expect_error([&] { load_layer_files(dir.path.string()); }, "inputs", {"no layer files"});
  reference::SyntheticShape s = layer_shape();
  s.batch = 1;
  s.n_q = s.n_kv = 16;
  const auto in = reference::make_synthetic("normal", s, 1);
  write_layer(dir, 0, in, false);
  write_layer(dir, 2, in, false);
  expect_error([&] { load_layer_files(dir.path.string()); }, "inputs", {"layer2_*.npy", "layer1_*.npy"});
  write_layer(dir, 1, in, false);
  fs::remove(dir.file("layer1_v.npy"));
  expect_error([&] { load_layer_files(dir.path.string()); }, "inputs", {"layer1_v.npy is missing"});
  // Wrong rank: a 2-d V.
  const std::vector<float> flat(16 * 64, 0.f);
  write_npy(dir.file("layer1_v.npy"), {16, 64}, flat.data());
  expect_error([&] { load_layer_files(dir.path.string()); }, "inputs", {"layer1_v.npy", "got 2-d"});
  // K and V that disagree.
  write_npy(dir.file("layer1_v.npy"), {1, 2, 8, 64}, flat.data());
  expect_error([&] { load_layer_files(dir.path.string()); }, "inputs", {"layer1", "same shape"});
  // A file that is not .npy at all reports the reader's reason.
  write_text(dir.file("layer1_v.npy"), "not numpy");
  expect_error([&] { load_layer_files(dir.path.string()); }, "npy", {"layer1_v.npy", "bad magic"});
}

TEST(CalibrateCli, SpeedFileErrorsAndTheCommittedBenchFile) {
  TempDir dir("speeds");
  const std::string p = dir.file("s.json");
  write_text(p, "{\"records\": [{\"recipe\": \"sage2_8b\", \"d\": 64, \"n\": 1024, \"tops\": 1}]}");
  expect_error([&] { load_speed_table(p); }, "speeds", {p, "record 0", "\"causal\""});
  write_text(p, "[1, 2");
  expect_error([&] { load_speed_table(p); }, "speeds", {p, "not valid JSON"});
  write_text(p, "{\"x\": 1}");
  expect_error([&] { load_speed_table(p); }, "speeds", {p, "array"});
  // `sage bench --json` wraps records in an object; a null tops (failed run) is no speed.
  write_text(p, "{\"device\": \"x\", \"records\": [{\"recipe\": \"sage2_8b\", \"d\": 64, \"causal\": true, "
                "\"n\": 1024, \"tops\": null}, {\"recipe\": \"sage2_8b\", \"d\": 64, \"causal\": true, "
                "\"n\": 2048, \"tops\": 7.5}]}");
  const SpeedTable t = load_speed_table(p);
  ASSERT_EQ(t.entries().size(), 1u);
  EXPECT_EQ(t.lookup("sage2_8b", 64, true, 1024)->n, 2048);

  const fs::path h100 = fs::path(__FILE__).parent_path() / ".." / ".." / "bench" / "results" / "h100.json";
  if (!fs::exists(h100)) GTEST_SKIP() << "no " << h100;
  const SpeedTable real = load_speed_table(h100.string());
  EXPECT_NE(real.source.find("H100"), std::string::npos) << real.source;
  const auto e = real.lookup("sage2_8b", 128, false, 4096);
  ASSERT_TRUE(e.has_value());
  EXPECT_EQ(e->n, 4096);
  EXPECT_GT(e->tops, 0);
  for (const SpeedEntry& s : real.entries()) EXPECT_NE(s.recipe, "fp16");  // torch baselines
}

}  // namespace
