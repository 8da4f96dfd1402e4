// `sage docs`: writes docs/recipes.md from the presets, the simulator and bench results.
//
// Everything in the page is computed here, so the page cannot drift from the code: the
// options come from presets(), the error from simulate() vs exact() at a fixed size and seed
// (so regenerating gives the same bytes), the speed from bench result files (cells without a
// record say "not measured").
#include <algorithm>
#include <cmath>
#include <fstream>
#include <iostream>
#include <map>
#include <sstream>
#include <tuple>

#include "accuracy.h"
#include "common.h"
#include "recipe_text.h"
#include "sage/recipe.h"
#include "numerics/tile.h"
#include "sm90/fwd/kernel_traits.h"

namespace sage::cli {
namespace {

// The documented size of the error tables: large enough for several KV blocks and Q tiles
// (128 tokens each), small enough that all presets on all distributions take well under two
// minutes on two cores.
CheckShape docs_shape() {
  CheckShape s;
  s.batch = 1;
  s.heads = 2;
  s.kv_heads = 2;
  s.n = 1024;
  s.d = 128;
  s.causal = false;
  s.seed = 0;
  return s;
}

// Group sizes are read off tile.h (at the documented head dim), so the words follow the
// kernel's tile configuration if it changes.
std::string qk_words(const Recipe& r, int head_dim) {
  const TileConfig tc = tile_config(head_dim);
  std::ostringstream os;
  switch (r.qk_format) {
    case QKFormat::fp16: os << "Q and K stay fp16 (not quantized)"; break;
    case QKFormat::int8: os << "Q and K are quantized to symmetric INT8 ([-127, 127])"; break;
    case QKFormat::int4:
      os << "Q and K are quantized to symmetric INT4 ([-7, 7], multiplied exactly on INT8 tensor "
            "cores)";
      break;
    case QKFormat::e4m3: os << "Q and K are quantized to FP8 E4M3 with a float scale"; break;
    case QKFormat::nvfp4:
      os << "Q and K are quantized to NVFP4: E2M1 values with one E4M3 scale per 16 consecutive "
            "channels";
      break;
    case QKFormat::mxfp4:
      os << "Q and K are quantized to MXFP4: E2M1 values with one E8M0 scale per 32 channels";
      break;
  }
  switch (r.qk_granularity) {
    case Granularity::per_tensor: os << ", one scale per (batch, head)"; break;
    case Granularity::per_block:
      os << ", one scale per kernel tile (" << tc.block_q << " Q tokens, " << tc.block_kv
         << " K tokens)";
      break;
    case Granularity::per_warp:
      os << ", one scale per " << kWarpRows << "-row warp slice of a Q tile (K: one per tile)";
      break;
    case Granularity::per_thread:
      os << ", one scale per tensor-core thread's tokens (" << tc.block_q / q_group_count(
                Granularity::per_thread, tc.block_q, tc)
         << " Q rows; " << tc.block_kv / k_group_count(Granularity::per_thread, tc.block_kv, tc)
         << " K tokens of a " << tc.block_kv << "-token tile)";
      break;
    case Granularity::per_token: os << ", one scale per token"; break;
    case Granularity::microscale: break;
  }
  os << ".";
  if (r.smooth_k) {
    os << " K is smoothed: its mean over ";
    if (r.k_mean_stride > 1) os << "every " << r.k_mean_stride << "th key";
    else os << "tokens";
    os << " is subtracted first (exact, since softmax is shift-invariant per row).";
  }
  if (r.smooth_q)
    os << " Q is smoothed: each Q tile's mean is subtracted, and its product with K is added "
          "back to the scores.";
  if (r.qk_channel_balance)
    os << " Scale migrates between Q and K per channel before quantization: q_c / s_c and "
          "k_c * s_c with s_c a power of two near sqrt(max|Q_c| / max|K'_c|), so q . k is "
          "unchanged.";
  return os.str();
}

std::string pv_words(const Recipe& r) {
  std::ostringstream os;
  switch (r.pv_format) {
    case PVFormat::fp16: os << "P and V stay fp16"; break;
    case PVFormat::e4m3: os << "P and V are quantized to FP8 E4M3"; break;
    case PVFormat::e5m2: os << "P and V are quantized to FP8 E5M2"; break;
    case PVFormat::int8: os << "P and V are quantized to INT8"; break;
    case PVFormat::nvfp4: os << "P and V are quantized to NVFP4 (E2M1, E4M3 scale per 16)"; break;
    case PVFormat::mxfp4: os << "P and V are quantized to MXFP4 (E2M1, E8M0 scale per 32)"; break;
  }
  switch (r.p_scale) {
    case PScale::none: break;
    case PScale::static_max:
      os << "; P (in [0, 1] after the online softmax) is multiplied by a static factor, "
         << (r.p_range > 0 ? std::to_string(static_cast<int>(r.p_range)) + " (a narrowed range)"
                           : std::string("the format's maximum"));
      break;
    case PScale::two_level:
      os << "; P gets a per-row scale to 448 x 6 first, then FP4 microscaling (two levels)";
      break;
    case PScale::per_token:
      os << "; P gets one scale per row and KV tile from the online softmax's own maxima "
            "(its largest value maps to 127)";
      break;
  }
  switch (r.v_scale) {
    case VScale::none: break;
    case VScale::per_channel: os << "; V has one scale per channel over all tokens"; break;
    case VScale::per_tensor: os << "; V has one scale per (batch, head)"; break;
    case VScale::microscale: os << "; V is microscaled along tokens"; break;
    case VScale::per_block: os << "; V has one scale per KV tile of tokens"; break;
  }
  if (r.v_range > 0) {
    std::ostringstream vr;
    vr << r.v_range;
    os << ", mapped to [-" << vr.str() << ", " << vr.str() << "]";
  }
  os << ".";
  if (r.smooth_v) os << " V is smoothed: its mean over tokens is subtracted and added to the output.";
  return os.str();
}

std::string accum_words(const Recipe& r) {
  switch (r.pv_accum) {
    case PVAccum::fp32: return "PV products accumulate in fp32.";
    case PVAccum::fp16: return "PV products accumulate in an fp16 accumulator.";
    case PVAccum::fp22:
      return "PV products accumulate in the FP8 MMA's internal accumulator (13 mantissa bits) over "
             "the whole row.";
    case PVAccum::two_level:
      return "PV products accumulate in the FP8 MMA's internal accumulator within one KV block, "
             "then into an fp32 buffer (two-level accumulation).";
    case PVAccum::fp16x2_fp32:
      return "Two FP8 MMAs accumulate in fp16, then their sum is added into fp32.";
  }
  return "";
}

// The backward's matmuls in words (recipes with a backward: sagebwd, sagebwd_block).
std::string backward_words(const Recipe& r) {
  auto fmt = [](BwdFormat f) { return f == BwdFormat::int8 ? "INT8" : "16 bits"; };
  auto per = [](Granularity g, const char* token) {
    return g == Granularity::per_token ? std::string(" (one scale per ") + token + ")"
                                       : std::string(" (one scale per backward tile)");
  };
  std::ostringstream os;
  os << "dV = P^T dO in " << fmt(r.dv_format);
  if (r.dv_format == BwdFormat::int8) os << per(r.bwd_p_granularity, "key of P's tile");
  os << ", dP = dO V^T in " << fmt(r.dp_format) << ", dQ = dS K in " << fmt(r.dq_format)
     << ", dK = dS^T Q in " << fmt(r.dk_format);
  if (r.dq_format == BwdFormat::int8 || r.dk_format == BwdFormat::int8)
    os << per(r.bwd_ds_granularity, "query row of dS's tile for dQ and per key for dK");
  os << "; docs/numerics.md, \"The backward\" (its \"Options\" say why sagebwd takes dS per token).";
  return os.str();
}

// ---- GPU speed from bench result files ----------------------------------------------------
//
// The speed table is generated from runs, never typed: a cell holds the TOPS of a record in a
// results file, "refused" where the run recorded the GPU path refusing the preset, and "not
// measured" otherwise. Its points are fixed (not taken from the files), so a preset or a point
// that no run covered shows as "not measured" instead of disappearing from the page.
// `bench/bench_sdpa.py --recipes all` (scripts/gpu_run.sh's "recipes" stage) times every
// preset at exactly these points.
#define SAGE_SPEED_DIM(D) D,
constexpr int kSpeedDims[] = {SAGE_SUPPORTED_HEAD_DIMS(SAGE_SPEED_DIM)};  // sm90/fwd/kernel_traits.h
#undef SAGE_SPEED_DIM
constexpr int kSpeedNs[] = {1024, 4096, 16384};

struct SpeedCell {
  double tops = NAN;
  std::string refusal;  // the GPU path's message when the run recorded a refusal
};

struct SpeedData {
  std::map<std::tuple<std::string, std::string, int, int>, SpeedCell> cells;  // impl, recipe, d, n
  std::vector<std::string> impls;                                              // baselines, in file order
  std::vector<std::string> devices;
  std::vector<std::string> notes;  // files that are missing or unreadable
};

void collect(const JsonValue& j, std::vector<const JsonValue*>& out) {
  if (j.kind == JsonValue::object) {
    if (j.get("d") && j.get("n") && (j.get("tops") || j.get("status"))) {
      out.push_back(&j);
      return;
    }
    for (const auto& m : j.members) collect(m.second, out);
  } else if (j.kind == JsonValue::array) {
    for (const auto& i : j.items) collect(i, out);
  }
}

bool is_false(const JsonValue* j) {
  if (!j) return false;
  if (j->kind == JsonValue::boolean) return !j->b;
  if (j->kind == JsonValue::number) return j->num == 0;
  if (j->kind == JsonValue::string) return j->str == "no" || j->str == "false" || j->str == "0";
  return false;
}

std::string text(const JsonValue* j) { return j && j->kind == JsonValue::string ? j->str : ""; }

int integer_of(const JsonValue* j) {
  return j && j->kind == JsonValue::number && j->num == std::floor(j->num) ? static_cast<int>(j->num) : -1;
}

// Whole-call, non-causal, fp16 records at the table's points, from each file in turn; a later
// record for the same cell (later in its file, or in a later file) replaces an earlier one.
// Kernel-only records (whole_call false) time the attention kernel without the K/V pre-pass;
// they are a different quantity and are left out.
SpeedData read_speed(const std::vector<std::string>& paths) {
  SpeedData data;
  for (const std::string& path : paths) {
    std::string content;
    if (!read_text_file(path, &content)) {
      data.notes.push_back("`" + path + "` does not exist yet.");
      continue;
    }
    JsonValue doc;
    try {
      doc = parse_json(content);
    } catch (const std::exception& e) {
      data.notes.push_back("`" + path + "` could not be read (" + e.what() + ").");
      continue;
    }
    std::vector<const JsonValue*> recs;
    collect(doc, recs);
    for (const JsonValue* r : recs) {
      const int d = integer_of(r->get("d")), n = integer_of(r->get("n"));
      if (!is_false(r->get("causal")) || is_false(r->get("whole_call"))) continue;
      const std::string dtype = text(r->get("dtype"));
      if (!(dtype.empty() || dtype == "fp16" || dtype == "float16")) continue;
      const std::string impl = r->get("impl") ? text(r->get("impl")) : "sagekit";
      const std::string recipe = impl == "sagekit" ? text(r->get("recipe")) : "";
      const JsonValue* t = r->get("tops");
      SpeedCell cell;
      if (t && t->kind == JsonValue::number && std::isfinite(t->num) && t->num > 0) {
        cell.tops = t->num;
      } else if (text(r->get("status")) == "unsupported") {
        cell.refusal = text(r->get("message"));
        if (cell.refusal.empty()) cell.refusal = "refused, no message recorded";
      } else {
        continue;  // a failed timing without a refusal (a baseline that rejected the shape)
      }
      bool at_point = false;
      for (int dd : kSpeedDims)
        for (int nn : kSpeedNs) at_point = at_point || (d == dd && n == nn);
      if (!at_point) continue;
      data.cells[{impl, recipe, d, n}] = cell;
      if (impl != "sagekit" && std::find(data.impls.begin(), data.impls.end(), impl) == data.impls.end())
        data.impls.push_back(impl);
      const std::string dev = text(r->get("device"));
      if (!dev.empty() && std::find(data.devices.begin(), data.devices.end(), dev) == data.devices.end())
        data.devices.push_back(dev);
    }
  }
  return data;
}

std::string kilo(int n) { return n % 1024 == 0 ? std::to_string(n / 1024) + "K" : std::to_string(n); }

void write_speed(std::ostream& os, const std::vector<std::string>& bench_paths) {
  std::vector<std::string> quoted;
  for (const std::string& p : bench_paths) quoted.push_back("`" + p + "`");
  std::vector<std::string> prequantized;
  for (const Recipe& r : presets())
    if (r.inputs == Inputs::prequantized_int8) prequantized.push_back("`" + r.name + "`");
  os << "## GPU speed\n\n"
     << "TOPS of the whole call (the K/V pre-pass and the attention kernel, as a user calls it; "
     << "for " << join(prequantized, ", ")
     << ", whose inputs are INT8 with scales, the call on those inputs), fp16, non-causal, 32 "
        "heads, batch = 32K / N, "
        "median of CUDA-event timings after warm-up (the protocol of "
        "[performance.md](performance.md)). TOPS = 4 B H N^2 d / time. Every cell is read from "
     << join(quoted, ", ")
     << " (records with keys `impl`, `recipe`, `d`, `causal`, `n`, `dtype`, `whole_call`, "
        "`tops`, as `bench/bench_sdpa.py` and `sage bench --json` write them; a later record "
        "for the same cell replaces an earlier one; kernel-only records are not used). "
        "`bash scripts/gpu_run.sh build python recipes` times every preset at these points "
        "(`bench/bench_sdpa.py --recipes all`). \"not measured\": no record; \"refused\": the "
        "GPU path refused the preset in that run (its message is below). Regenerate this page "
        "after a new measurement.\n\n";
  const SpeedData data = read_speed(bench_paths);
  for (const std::string& note : data.notes) os << note << "\n";
  if (!data.notes.empty()) os << "\n";

  std::vector<std::string> header = {"preset"};
  for (int d : kSpeedDims)
    for (int n : kSpeedNs) header.push_back("d " + std::to_string(d) + ", N " + kilo(n));
  std::vector<bool> right(header.size(), true);
  right[0] = false;
  Table t(header, right);
  std::vector<std::pair<std::string, std::string>> refused;  // preset, message
  auto row = [&](const std::string& label, const std::string& impl, const std::string& recipe) {
    std::vector<std::string> cells = {label};
    for (int d : kSpeedDims)
      for (int n : kSpeedNs) {
        auto it = data.cells.find({impl, recipe, d, n});
        if (it == data.cells.end()) {
          cells.push_back("not measured");
        } else if (!it->second.refusal.empty()) {
          cells.push_back("refused");
          if (refused.empty() || refused.back().first != recipe) refused.push_back({recipe, it->second.refusal});
        } else {
          cells.push_back(fixed(it->second.tops, 0));
        }
      }
    t.add(cells);
  };
  for (const Recipe& r : presets()) row(r.name, "sagekit", r.name);
  for (const std::string& impl : data.impls) row(impl + " (baseline)", impl, "");
  t.print_markdown(os);
  if (!refused.empty()) {
    os << "\nRefused on the GPU in the measured run:\n\n";
    for (const auto& rm : refused) os << "- " << rm.first << ": " << rm.second << "\n";
  }
  if (!data.devices.empty()) os << "\nMeasured on: " << join(data.devices, ", ") << ".\n";
  os << "\n";
}

// The result files behind the committed docs/recipes.md speed table (scripts/gen_docs.sh runs
// `sage docs` without --bench): the H200 grid of record (v30 code, median of three runs) for
// the baselines, then the every-preset run on the H200 (v29 code), both of 2026-11-25. A new
// measurement replaces them here.
constexpr const char* kDefaultBench =
    "bench/results/h200_v30_3runs_2026-11-25.json,bench/results/h200_recipes_v29_2026-11-25.json";

}  // namespace

int run_docs(const std::vector<std::string>& args) {
  Flags flags("sage docs",
              "Writes the recipe reference page: every preset's options, paper and simulated\n"
              "error on each synthetic distribution (simulate vs exact at a fixed size and seed),\n"
              "and the GPU speed section filled from bench result files (\"not measured\" where none\n"
              "has a record).",
              {{"out", "FILE", "where to write (default docs/recipes.md)"},
               {"bench", "FILE[,FILE..]",
                std::string("bench results to read, later files winning (default ") +
                    kDefaultBench + ")"}},
              args);
  if (flags.help()) {
    flags.print_help(std::cout);
    return 0;
  }
  const std::string out_path = flags.str("out", "docs/recipes.md");
  std::vector<std::string> bench_paths;
  {
    std::stringstream list(flags.str("bench", kDefaultBench));
    for (std::string p; std::getline(list, p, ',');)
      if (!p.empty()) bench_paths.push_back(p);
    if (bench_paths.empty()) throw UsageError("sage docs: --bench needs at least one file name");
  }
  if (out_path.empty()) throw UsageError("sage docs: --out needs a file name");
  check_writable("sage docs", "out", out_path);

  const CheckShape shape = docs_shape();
  const std::vector<std::string>& dists = reference::synthetic_distributions();
  const std::vector<Recipe>& all = presets();

  // error[recipe][dist]
  std::vector<std::vector<reference::ErrorStats>> error(all.size(),
                                                        std::vector<reference::ErrorStats>(dists.size()));
  Progress progress(static_cast<int>(dists.size() * all.size()), true);
  for (size_t j = 0; j < dists.size(); ++j) {
    DistributionCase dc(dists[j], shape);
    for (size_t i = 0; i < all.size(); ++i) {
      progress.step(all[i].name + " " + dists[j]);
      std::vector<uint16_t> sim = dc.simulate(all[i]);
      error[i][j] = reference::compare(dc.out_view(sim.data(), DType::f16), Layout::HND,
                                       dc.exact_view(), Layout::HND);
    }
  }

  std::ostringstream os;
  os << "<!-- Generated by `sage docs --out " << out_path
     << "` (run `bash scripts/gen_docs.sh`); do not edit by hand. -->\n\n"
     << "# Recipes\n\n"
     << "A recipe is a point in a small space of choices (Q/K format and scale granularity, "
        "smoothing, P/V format and scaling, PV accumulation, input kind); the presets below are "
        "the papers' configurations. The GPU kernels and the CPU simulator read the same "
        "`sage::Recipe`, so a preset means the same numerics in both. This page is generated by "
        "`sage docs` from the code: the options from `sage::presets()`, the errors from "
        "`sage::reference::simulate` against `sage::reference::exact`.\n\n"
     << "## Presets\n\n";
  recipe_table(false).print_markdown(os);

  os << "\n## Simulated error\n\n"
     << "Each preset's own error: `simulate` (the recipe's exact quantization, fp16 output) "
        "against float64 `exact` attention of the same fp16 inputs, at "
     << shape.describe()
     << ". Inputs come from `sage::reference::make_synthetic`; `sage check --device cpu "
        "--n 1024 --d 128 --heads 2` prints the same numbers with RMSE and max error. "
        "`int_flash` takes INT8 inputs, made per token (V per tensor) from the same fp16 "
        "inputs, so its error includes that input quantization.\n\n"
     << "Distributions:\n\n";
  for (const std::string& d : dists)
    os << "- `" << d << "`: " << reference::synthetic_description(d) << "\n";

  std::vector<std::string> header = {"preset"};
  for (const std::string& d : dists) header.push_back(d);
  std::vector<bool> right(header.size(), true);
  right[0] = false;
  Table cos(header, right), l1(header, right);
  for (size_t i = 0; i < all.size(); ++i) {
    std::vector<std::string> rc = {all[i].name}, rl = {all[i].name};
    for (size_t j = 0; j < dists.size(); ++j) {
      rc.push_back(fixed(error[i][j].cosine, 6));
      rl.push_back(fixed(error[i][j].rel_l1, 4));
    }
    cos.add(rc);
    l1.add(rl);
  }
  os << "\nCosine similarity (higher is better):\n\n";
  cos.print_markdown(os);
  os << "\nRelative L1 error, sum |sim - exact| / sum |exact| (lower is better):\n\n";
  l1.print_markdown(os);
  os << "\n";

  write_speed(os, bench_paths);

  // The one option the paper presets leave off, and the preset that takes it.
  os << "## The Q/K channel balance\n\n"
     << "- `qk_channel_balance` (GPU and simulator; on in `sage2_8b_balanced`, which Python's "
        "`recipe=\"auto\"` runs on Hopper, off in every paper preset): scale migrates between Q "
        "and K per channel before quantization, q_c / s_c and k'_c * s_c with s_c a power of two "
        "near sqrt(max|Q_c| / max|K'_c|) per (batch, KV head), the ranges taken over every "
        "k_mean_stride-th token. Exact in math; it recovers the accuracy the presets lose on "
        "`channel_offset` (issue 35; sage2_8b from cosine 0.994 to 0.9993 at d = 64-128). Only "
        "channels whose Q and K ranges differ by 4x or more move, so inputs without such "
        "offsets keep the recipe's bits. It costs a read of the sampled Q tokens before the K/V "
        "pre-pass (0.97x-1.0x of sage2_8b on an H100 where no head moves; 0.82x-0.90x at d = 128, "
        "N = 1K where every head does, 1.0x from 16K: docs/performance.md), and K quantized ahead "
        "of Q (`quantize_kv`) cannot take it. Calibration (`sage calibrate`) has "
        "sage2_8b_balanced among its candidates, so it picks sage2_8b where that is accurate "
        "enough and faster. "
        "[numerics](numerics.md#2-smoothing-once-per-kv-head-for-k-and-v-once-per-q-tile-for-q) "
        "states its arithmetic; `sage check --qk-channel-balance` measures it on any preset.\n\n";

  os << "## Each preset\n\n";
  for (size_t i = 0; i < all.size(); ++i) {
    const Recipe& r = all[i];
    os << "### " << r.name << (is_default_recipe(r) ? " (default)" : "") << "\n\n"
       << "From " << recipe_paper(r) << ". " << recipe_summary(r) << ".\n\n"
       << "- QK: " << qk_words(r, static_cast<int>(shape.d)) << "\n"
       << "- PV: " << pv_words(r) << "\n"
       << "- Accumulation: " << accum_words(r) << "\n"
       << "- Softmax denominator: "
       << (r.row_sum == RowSum::quantized_p ? "the sum of the quantized P."
           : r.row_sum == RowSum::pv_mma
               ? "from head dim 128 the sum of the quantized P, taken by the PV MMA (a V "
                 "channel of ones, with the accumulator's rounding); below, the sum of the "
                 "unquantized P."
               : "the sum of the unquantized P.")
       << "\n"
       << "- Inputs: "
       << (r.inputs == Inputs::prequantized_int8
               ? "already-quantized INT8 Q, K, V with f32 scales (Q, K per token; V per tensor or "
                 "per channel)."
               : "fp16 or bf16 Q, K, V, quantized by the library.")
       << "\n";
    if (has_backward(r)) os << "- Backward: " << backward_words(r) << "\n";
    os << "\n";
    Table t({"distribution", "cosine", "rel L1"}, {false, true, true});
    for (size_t j = 0; j < dists.size(); ++j)
      t.add({dists[j], fixed(error[i][j].cosine, 6), fixed(error[i][j].rel_l1, 4)});
    t.print_markdown(os);
    os << "\n";
  }

  std::ofstream f(out_path);
  if (!f) throw UsageError("sage docs: --out " + out_path + " cannot be opened for writing");
  f << os.str();
  if (!f) throw UsageError("sage docs: --out " + out_path + " could not be written completely");
  std::cout << "wrote " << out_path << " (" << all.size() << " presets x " << dists.size()
            << " distributions, " << fixed(progress.elapsed_s(), 1) << " s)\n";
  return 0;
}

}  // namespace sage::cli
