// `sage calibrate`: per-layer recipe selection from sample Q/K/V files and measured speeds.
//
// A thin shell over include/sage/calibrate.h (so the tests exercise the same path without
// spawning the binary): load the layer files and the speed table, calibrate, print, save.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include "common.h"
#include "sage/calibrate.h"
#include "sage/error.h"

namespace sage::cli {
namespace {

const char kCommand[] = "sage calibrate";

// A library error about a file the user named is a usage error of the flag that named it;
// the message already says which file and what is wrong, minus the library's argument name.
[[noreturn]] void rethrow_as_flag(const Error& e, const std::string& flag) {
  std::string why = e.what();
  const std::string prefix = e.argument() + ": ";
  if (why.rfind(prefix, 0) == 0) why = why.substr(prefix.size());
  throw UsageError(std::string(kCommand) + ": --" + flag + " " + why);
}

// Fails before a long run rather than after it, without leaving an empty file behind.
void check_out_writable(const std::string& path) {
  const bool existed = static_cast<bool>(std::ifstream(path));
  {
    std::ofstream f(path, std::ios::app);
    if (!f) throw UsageError(std::string(kCommand) + ": --out " + path + " cannot be opened for writing");
  }
  if (!existed) std::remove(path.c_str());
}

std::string cosine_cell(double c) { return std::isfinite(c) ? fixed(c, 6) : "nan"; }

}  // namespace

int run_calibrate(const std::vector<std::string>& args) {
  const std::vector<std::string> names = default_candidates();
  Flags flags(
      kCommand,
      "Pick a recipe per layer (SageAttention's adaptive quantization): for each layer, the\n"
      "fastest candidate whose worst cosine similarity against float64 attention over the\n"
      "layer's samples reaches --threshold. Accuracy is computed on the CPU with the kernels'\n"
      "exact quantization; speed comes from a bench JSON file (never estimated). A candidate\n"
      "without a measurement is chosen only when no measured candidate passes. Inputs: a\n"
      "directory of layer<i>_q.npy, layer<i>_k.npy, layer<i>_v.npy (fp16/fp32, [batch, heads,\n"
      "tokens, head_dim] or [heads, tokens, head_dim]; each batch entry is one sample).\n"
      "See docs/calibration.md.",
      {{"inputs", "DIR", "directory of layer<i>_{q,k,v}.npy files (required)"},
       {"speeds", "FILE", "bench JSON with measured TOPS, e.g. bench/results/h100.json (required)"},
       {"recipes", "NAME[,NAME..]|all", "candidate presets (default all with floating inputs)"},
       {"threshold", "COS", "minimum worst-case cosine similarity (default 0.998, the paper's)"},
       {"causal", "", "causal masking (also selects causal speed records)"},
       {"tokens", "N", "sequence length to look speeds up at (default: the samples' keys)"},
       {"out", "FILE", "where to write the per-layer choice JSON (required)"}},
      args);
  if (flags.help()) {
    flags.print_help(std::cout);
    return 0;
  }
  for (const char* required : {"inputs", "speeds", "out"})
    if (!flags.has(required))
      throw UsageError(std::string(kCommand) + ": --" + required + " is required (see --help)");

  CalibrationOptions opt;
  opt.candidates = flags.choices("recipes", "all", names);
  const std::string threshold_text = flags.str("threshold", "0.998");
  {
    char* end = nullptr;
    opt.threshold = std::strtod(threshold_text.c_str(), &end);
    if (threshold_text.empty() || *end != '\0' || !(opt.threshold > 0 && opt.threshold <= 1))
      throw UsageError(std::string(kCommand) + ": --threshold must be a number in (0, 1] (got '" +
                       threshold_text + "')");
  }
  opt.causal = flags.has("causal");
  opt.speed_tokens = flags.integer("tokens", 0, 0, int64_t(1) << 24);
  const std::string out_path = flags.str("out", "");
  check_out_writable(out_path);

  SpeedTable speeds;
  try {
    speeds = load_speed_table(flags.str("speeds", ""));
  } catch (const Error& e) {
    rethrow_as_flag(e, "speeds");
  }
  LayerFiles files;
  try {
    files = load_layer_files(flags.str("inputs", ""));
  } catch (const Error& e) {
    rethrow_as_flag(e, "inputs");
  }

  Progress progress(static_cast<int>(files.layers.size() * opt.candidates.size()), true);
  opt.on_step = [&](int64_t layer, const std::string& recipe) {
    progress.step("layer " + std::to_string(layer) + " " + recipe);
  };
  Calibration c;
  try {
    c = calibrate(files.layers, speeds, opt);
  } catch (const Error& e) {
    // Bad samples are the input files' fault; everything else was checked above.
    const std::string& a = e.argument();
    rethrow_as_flag(e, a == "layers" ? "inputs" : a == "candidates" ? "recipes" : a);
  }

  std::cout << files.layers.size() << " layers from " << files.directory << "; threshold "
            << threshold_text << " (worst cosine over each layer's samples); "
            << (opt.causal ? "causal" : "non-causal") << "; speeds: " << c.speed_source << "\n\n";
  Table table({"layer", "recipe", "worst cosine", "worst rel L1", "TOPS", "passes", "chosen"},
              {true, false, true, true, true, false, false});
  int failed = 0;
  for (const LayerChoice& l : c.layers) {
    for (const CandidateScore& s : l.scores) {
      std::string tops = "not measured";
      if (s.tops) tops = fixed(*s.tops, 1) + " (n=" + std::to_string(s.speed_n) + ")";
      table.add({std::to_string(l.layer), s.recipe, cosine_cell(s.cosine), sci(s.rel_l1, 2), tops,
                 s.passed ? "yes" : "no",
                 s.recipe == l.recipe ? (l.passed ? "<- chosen" : "<- chosen (none passes)") : ""});
    }
    if (!l.passed) ++failed;
  }
  table.print(std::cout);
  std::cout << "\nchoices:";
  for (const LayerChoice& l : c.layers) std::cout << " " << l.layer << "=" << l.recipe;
  std::cout << "\n";
  if (failed)
    std::cout << failed << " layer(s) have no candidate reaching the threshold; each uses its "
                 "most accurate candidate and is marked \"passed\": false.\n";

  try {
    save_calibration(c, out_path);
  } catch (const Error& e) {
    rethrow_as_flag(e, "out");
  }
  std::cout << "wrote " << out_path << " (" << fixed(progress.elapsed_s(), 1) << " s)\n";
  return 0;
}

}  // namespace sage::cli
