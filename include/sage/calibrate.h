// Per-layer recipe selection (SageAttention's "adaptive quantization", paper 1 section 4.5).
//
// For each layer of a model, given sample Q/K/V of that layer, calibrate() measures every
// candidate preset's accuracy against the float64 reference and looks its speed up in a
// SpeedTable; it then picks the fastest candidate whose worst cosine similarity over the
// layer's samples reaches the threshold (the paper's 99.8% by default). The choice is saved
// as a small JSON file that load_layer_choices() turns back into one Recipe per layer.
//
// Accuracy runs on the CPU through reference::simulate, which computes each recipe with the
// kernels' exact quantization (docs/numerics.md), so it is the GPU's accuracy up to the
// documented kernel-vs-simulator differences (1e-6..1e-4 relative). Speed is never estimated
// here: it comes from measurements (a bench JSON file or a caller-filled table).
// docs/calibration.md has the selection rule, the tie-breaks and the file formats.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "sage/recipe.h"
#include "sage/tensor.h"

namespace sage {

// ---- speed ---------------------------------------------------------------------------------

// Measured throughput of a recipe at one (head_dim, causal, tokens) point.
struct SpeedEntry {
  std::string recipe;
  int64_t head_dim = 0;
  bool causal = false;
  int64_t n = 0;  // tokens (queries = keys) of the measurement
  double tops = 0;
};

class SpeedTable {
 public:
  // Entries with the same (recipe, head_dim, causal, n) are averaged on lookup.
  void add(const SpeedEntry& e);
  // The measurement of `recipe` at this head_dim and mask whose n is nearest to `n` on a log
  // scale (a tie goes to the larger n); nullopt when the recipe was not measured there.
  std::optional<SpeedEntry> lookup(const std::string& recipe, int64_t head_dim, bool causal,
                                   int64_t n) const;
  const std::vector<SpeedEntry>& entries() const { return entries_; }

  // Where the numbers come from, copied into the calibration file ("speed_source").
  std::string source = "caller-provided table";

 private:
  std::vector<SpeedEntry> entries_;
};

// Reads a bench result file (bench/results/*.json: an array of records with impl, recipe, d,
// causal, n, tops, ...). Keeps records of impl "sagekit" (or without impl) timed as a whole
// call (whole_call true or absent); other implementations' baselines are not recipes.
// Throws sage::Error("speeds", ...) naming the file and the problem.
SpeedTable load_speed_table(const std::string& path);

// ---- inputs --------------------------------------------------------------------------------

// One layer's samples: 4-d Q, K, V on the CPU, f16 or bf16 (what the kernels take), in
// `layout`. Each batch entry counts as one sample: the layer's score is its worst one.
struct LayerSamples {
  TensorView q, k, v;
};

// A NumPy .npy array as read from disk (fp16 or fp32, C order).
struct NpyArray {
  DType dtype = DType::f32;  // f16 or f32
  std::vector<int64_t> shape;
  std::vector<uint8_t> data;  // little-endian element bytes, row-major
};
// Strict reader: format version 1.0 or 2.0, descr '<f2' or '<f4', fortran_order False.
// Throws sage::Error("npy", "<path>: <problem>").
NpyArray read_npy(const std::string& path);
// Writes a version 1.0 file ('<f2' for f16 data given as bit patterns, '<f4' for f32).
void write_npy(const std::string& path, const std::vector<int64_t>& shape, const float* data);
void write_npy_f16(const std::string& path, const std::vector<int64_t>& shape,
                   const uint16_t* bits);

// The samples of every layer of one model directory: layer<i>_q.npy, layer<i>_k.npy,
// layer<i>_v.npy for i = 0, 1, ... with no gap. Arrays are [batch, heads, tokens, head_dim]
// (HND) or [heads, tokens, head_dim] (batch 1), V's head dim possibly its own (MLA); fp32
// files are rounded to fp16, the dtype the kernels would be given. Move-only: `layers` views
// the owned buffers.
struct LayerFiles {
  std::string directory;
  std::vector<LayerSamples> layers;
  LayerFiles() = default;
  LayerFiles(LayerFiles&&) = default;
  LayerFiles& operator=(LayerFiles&&) = default;
  LayerFiles(const LayerFiles&) = delete;
  LayerFiles& operator=(const LayerFiles&) = delete;

  std::vector<std::vector<uint16_t>> buffers;  // fp16 bits, three per layer (q, k, v)
};
// Throws sage::Error("inputs", ...) naming the directory or file and the problem.
LayerFiles load_layer_files(const std::string& directory);

// ---- calibration ---------------------------------------------------------------------------

struct CalibrationOptions {
  // Preset names, in the order used for the last tie-break. Empty: default_candidates().
  std::vector<std::string> candidates;
  double threshold = 0.998;  // SageAttention's 99.8%: the worst similarity of SageAttn-B
  bool causal = false;
  Layout layout = Layout::HND;
  std::optional<float> sm_scale;  // default 1/sqrt(head_dim)
  // Tokens to look speeds up at; 0: the samples' key count. Calibration samples are often
  // shorter than the sequences the model will run.
  int64_t speed_tokens = 0;
  // Called before each (layer, candidate) evaluation; for progress lines.
  std::function<void(int64_t layer, const std::string& recipe)> on_step;
};

// The INT8/FP8 presets with floating inputs that the paper's rule chooses between.
std::vector<std::string> default_candidates();

struct CandidateScore {
  std::string recipe;
  double cosine = 0;  // worst over the samples
  double rel_l1 = 0;  // the worst (largest) over the samples
  std::optional<double> tops;  // nullopt: not measured
  int64_t speed_n = 0;         // n of the measurement used (0 when not measured)
  bool passed = false;         // cosine >= threshold
};

struct LayerChoice {
  int64_t layer = 0;
  std::string recipe;
  double cosine = 0, rel_l1 = 0;
  std::optional<double> tops;
  bool passed = false;  // false: no candidate reached the threshold; this is the most accurate
  std::vector<CandidateScore> scores;  // every candidate, in candidate order
};

struct Calibration {
  double threshold = 0.998;
  bool causal = false;
  std::vector<std::string> candidates;
  std::string speed_source;
  std::vector<LayerChoice> layers;
};

// Throws sage::Error("candidates", ...) for an unknown or prequantized-input preset or an
// empty list, sage::Error("threshold", ...) outside (0, 1], sage::Error("layers", ...) when
// there are none, and sage::Error("layers", "layer <i>: <argument>: ...") for bad samples:
// check_args' errors, and a sample holding NaN or Inf (its scores would mean nothing).
Calibration calibrate(const std::vector<LayerSamples>& layers, const SpeedTable& speeds,
                      const CalibrationOptions& options = {});

// Selection alone, on scores already measured (calibrate() calls it per layer):
//   1. candidates with cosine >= threshold and a measurement: the highest TOPS;
//   2. else passing candidates without a measurement: the highest cosine;
//   3. else (none passes): the highest cosine, with passed = false.
// Remaining ties: the higher cosine, then the earlier candidate. Returns the index.
size_t select_candidate(const std::vector<CandidateScore>& scores);

// {"version":1,"threshold":...,"causal":...,"layers":[...],"candidates":[...],"speed_source":...}
std::string calibration_json(const Calibration& c);
// Throws sage::Error("out", ...) when the file cannot be written.
void save_calibration(const Calibration& c, const std::string& path);
// One Recipe per layer, in layer order. Throws sage::Error("calibration_file",
// "<path>: <field>: <problem>") for a malformed file or an unknown recipe name.
std::vector<Recipe> load_layer_choices(const std::string& path);

}  // namespace sage
