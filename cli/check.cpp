// `sage check`: accuracy of recipes on the built-in synthetic distributions.
//
// On the CPU it measures each recipe's own error (simulate vs exact). On a GPU it runs the
// kernels and reports GPU vs simulate (kernel bugs: should be near rounding level) and GPU vs
// exact (what a user gets). A recipe the GPU build cannot run is reported as such in the
// table; it is never skipped silently, nor replaced by something else.
#include <cmath>
#include <cstdio>
#include <memory>
#include <tuple>
#include <iostream>
#include <vector>

#include "accuracy.h"
#include "check_backward.h"
#include "common.h"
#include "gpu.h"
#include "recipe_text.h"
#include "sage/attention.h"

namespace sage::cli {
namespace {

using reference::ErrorStats;

// 3 significant digits, fixed notation when that stays short ("0.0190"), else scientific.
std::string sig3(double v) {
  if (!std::isfinite(v) || v == 0) return v == 0 ? "0" : fixed(v, 0);
  char buf[64];
  std::snprintf(buf, sizeof buf, "%#.3g", v);
  return buf;
}

std::vector<std::string> metric_cells(const ErrorStats& s) {
  return {fixed(s.cosine, 6), sig3(s.rel_l1), sig3(s.rmse), sig3(s.max_abs)};
}

JsonRecord& add_metrics(JsonRecord& r, const ErrorStats& s) {
  return r.num("cosine", s.cosine).num("rel_l1", s.rel_l1).num("rmse", s.rmse)
      .num("max_abs", s.max_abs).integer("nonfinite", s.nonfinite);
}

ErrorStats compare_f16(const DistributionCase& dc, std::vector<uint16_t>& a, const TensorView& ref) {
  return reference::compare(dc.out_view(a.data(), DType::f16), Layout::HND, ref, Layout::HND);
}

#ifdef SAGE_WITH_CUDA

// A device copy of a contiguous host view (undefined views stay undefined).
TensorView to_device(const TensorView& h, std::vector<DeviceBuffer>& keep) {
  if (!h.defined()) return h;
  const size_t bytes = static_cast<size_t>(h.numel()) * dtype_size(h.dtype);
  keep.emplace_back(bytes);
  keep.back().upload(h.data, bytes);
  TensorView d = h;
  d.data = keep.back().get();
  d.device = Device::cuda(0);
  return d;
}

// The kernel's fp16 output for one recipe on one input.
std::vector<uint16_t> run_on_gpu(DistributionCase& dc, const Recipe& recipe, const Stream& s) {
  std::vector<uint16_t> host(dc.exact().size());
  const AttentionArgs h = dc.args(recipe, dc.out_view(host.data(), DType::f16));
  std::vector<DeviceBuffer> keep;
  keep.reserve(8);
  AttentionArgs a = h;
  a.q = to_device(h.q, keep);
  a.k = to_device(h.k, keep);
  a.v = to_device(h.v, keep);
  a.q_scale = to_device(h.q_scale, keep);
  a.k_scale = to_device(h.k_scale, keep);
  a.v_scale = to_device(h.v_scale, keep);
  a.out = to_device(h.out, keep);  // uploads zeros; the kernel overwrites them
  const size_t ws = workspace_bytes(a);
  DeviceBuffer workspace(ws);
  attention(a, workspace.get(), ws, s.get());
  s.sync();
  keep[keep.size() - 1].download(host.data(), host.size() * sizeof(uint16_t));
  return host;
}

#endif

// The option flags change a preset; a change that leaves it invalid (--p-range 1000 on E4M3 P)
// is the flag's usage error, with the library's sentence naming the option and its range.
void validate_changed(const Recipe& r, const std::string& preset_name) {
  try {
    validate_recipe(r);
  } catch (const Error& e) {
    std::string flag = e.argument();
    if (flag.rfind("recipe.", 0) == 0) flag = flag.substr(7);
    for (char& c : flag) c = c == '_' ? '-' : c;
    throw UsageError("sage check: --" + flag + " does not suit " + preset_name + ": " + e.what());
  }
}

}  // namespace

int run_check(const std::vector<std::string>& args) {
  std::vector<std::string> names;
  for (const Recipe& r : presets()) names.push_back(r.name);
  const std::vector<std::string>& dists = reference::synthetic_distributions();
  Flags flags(
      "sage check",
      "Accuracy of recipes on the built-in synthetic distributions (" + join(dists, ", ") +
          ").\nWith a GPU: the kernels against the CPU simulator and against float64 attention.\n"
          "Without one (or --device cpu): the simulator against float64 attention, which is the\n"
          "recipe's own error. Metrics: cosine similarity, relative L1, RMSE, max abs error.",
      {{"recipe", "NAME[,NAME..]|all", "presets to check (default all)"},
       {"dist", "NAME[,NAME..]|all", "synthetic distributions (default all)"},
       {"n", "N", "tokens of Q and of K/V (default 1024)"},
       {"d", "D", "head dim (default 128)"},
       {"dv", "D", "V's head dim, which the output takes (default: --d; DeepSeek MLA's prefill: "
                   "--d 192 --dv 128)"},
       {"heads", "H", "query heads (default 2)"},
       {"kv-heads", "H", "key/value heads, dividing --heads (default: --heads)"},
       {"batch", "B", "batch size (default 1)"},
       {"causal", "", "causal masking"},
       {"window", "LEFT,RIGHT", "a sliding window: query i sees keys i - LEFT .. i + RIGHT, -1 "
                                "for an unbounded side (with --causal, RIGHT -1 or 0)"},
       {"seed", "S", "seed of the synthetic inputs (default 0)"},
       {"json", "FILE", "also write every result as a JSON record"},
       {"device", "auto|cpu|gpu", "where the recipe runs (default auto: gpu when one is usable)"},
       {"p-range", "P", "scale P~ to [0, P] before quantizing it, instead of the preset's range "
                        "(recipes whose P has a static scale)"},
       {"row-sum", "float_p|quantized_p|pv_mma", "what the softmax denominator sums, instead "
                                                 "of the preset's choice"},
       {"k-mean-stride", "S", "take K smoothing's mean over every S-th key (1: every key), "
                              "instead of the preset's stride (recipes that smooth K)"},
       {"qk-channel-balance", "", "migrate scale between Q and K per channel before "
                                  "quantizing them (docs/numerics.md)"},
       {"backward", "", "the gradients dQ, dK, dV instead of the output (CPU; the recipes with "
                        "a backward: sagebwd, sagebwd_block)"},
       {"dp-format", "fp16|int8", "with --backward: dP = dO V^T in this format instead of the "
                                  "preset's (int8: SageBwd's ablation)"}},
      args);
  if (flags.help()) {
    flags.print_help(std::cout);
    return 0;
  }
  const std::vector<std::string> recipes = flags.choices("recipe", "all", names);
  const std::vector<std::string> chosen = flags.choices("dist", "all", dists);
  CheckShape shape;
  shape.n = flags.integer("n", 1024, 1, int64_t(1) << 20);
  shape.d = flags.integer("d", 128, 1, 1024);
  shape.dv = flags.integer("dv", shape.d, 1, 1024);
  shape.heads = flags.integer("heads", 2, 1, 1024);
  shape.kv_heads = flags.integer("kv-heads", shape.heads, 1, shape.heads);
  if (shape.heads % shape.kv_heads != 0)
    throw UsageError("sage check: --kv-heads must divide --heads (got " +
                     std::to_string(shape.kv_heads) + " and " + std::to_string(shape.heads) + ")");
  shape.batch = flags.integer("batch", 1, 1, 1 << 16);
  shape.causal = flags.has("causal");
  const WindowFlag window = window_flag(flags, "sage check", shape.causal);
  shape.window_left = window.left, shape.window_right = window.right;
  shape.seed = static_cast<uint64_t>(flags.integer("seed", 0, 0, INT64_MAX / 1024));
  const std::string json = flags.str("json", "");
  if (flags.has("json") && json.empty()) throw UsageError("sage check: --json needs a file name");
  const std::string device_flag = flags.choice("device", "auto", {"auto", "cpu", "gpu"});
  if (flags.has("backward")) {
    if (device_flag == "gpu")
      throw UsageError("sage check: --backward runs on the CPU (no GPU backward exists yet)");
    // dv: the backward has no V head dim of its own.
    for (const char* f :
         {"p-range", "row-sum", "k-mean-stride", "qk-channel-balance", "window", "dv"})
      if (flags.has(f)) throw UsageError(std::string("sage check: --") + f + " does not apply with --backward");
    return run_check_backward(flags, shape, json);
  }
  if (flags.has("dp-format")) throw UsageError("sage check: --dp-format applies with --backward only");
  // Recipe options changed for every checked preset (experiments: is another P range or
  // row sum as accurate?). The table names the change next to the preset.
  const int64_t p_range = flags.has("p-range") ? flags.integer("p-range", 0, 1, 65504) : 0;
  const std::string row_sum = flags.has("row-sum")
                                  ? flags.choice("row-sum", "float_p", {"float_p", "quantized_p", "pv_mma"})
                                  : "";
  const int64_t k_mean_stride =
      flags.has("k-mean-stride") ? flags.integer("k-mean-stride", 0, 1, int64_t(1) << 20) : 0;
  const bool balance = flags.has("qk-channel-balance");
  std::string changed;
  if (balance) changed += " qk_channel_balance";
  if (p_range > 0) changed += " p_range=" + std::to_string(p_range);
  if (k_mean_stride > 0) changed += " k_mean_stride=" + std::to_string(k_mean_stride);
  if (!row_sum.empty()) changed += " row_sum=" + row_sum;
  auto checked_recipe = [&](const std::string& name) {
    Recipe r = preset(name);
    if (p_range > 0) {
      if (r.p_scale != PScale::static_max)
        throw UsageError("sage check: --p-range applies to recipes whose P has a static scale; " +
                         name + "'s has none");
      r.p_range = float(p_range);
    }
    if (k_mean_stride > 0) apply_k_mean_stride("sage check", r, k_mean_stride);
    r.qk_channel_balance = r.qk_channel_balance || balance;
    if (!row_sum.empty())
      r.row_sum = row_sum == "quantized_p" ? RowSum::quantized_p
                  : row_sum == "pv_mma"    ? RowSum::pv_mma
                                           : RowSum::float_p;
    validate_changed(r, name);
    return r;
  };
  for (const std::string& name : recipes) checked_recipe(name);  // usage errors before any work

  bool on_gpu = false;
  if (device_flag == "gpu") {
    if (!gpu_available())
      throw UsageError("sage check: --device gpu needs a CUDA GPU of compute capability 9.0, and "
                       "none is usable (this build: " + build_description() +
                       "); use --device cpu or auto");
    on_gpu = true;
  } else if (device_flag == "auto") {
    on_gpu = gpu_available();
  }
  if (!json.empty()) check_writable("sage check", "json", json);

  std::string device = "cpu";
#ifdef SAGE_WITH_CUDA
  std::unique_ptr<Stream> stream;
  if (on_gpu) {
    device = cuda_device_name();
    stream = std::make_unique<Stream>();
  }
#endif

  // The first input is made (and its exact output computed) before anything is printed, so
  // a shape the references reject ends the run with its one-line error and no half table.
  auto first = std::make_unique<DistributionCase>(chosen.front(), shape);

  std::cout << (on_gpu ? "GPU kernels (" + device + ") vs the CPU simulator and vs float64 exact"
                       : std::string("CPU simulator vs float64 exact (the recipes' own error)"))
            << "; " << shape.describe() << "; fp16 inputs, fp16 output\n";
  if (!on_gpu && device_flag == "auto")
    std::cout << "(no GPU used: this build: " << build_description()
              << (gpu_available() ? "" : "; no usable sm_90 GPU") << ")\n";
  std::cout << "\n";

  std::vector<std::string> header = {"recipe", "dist"};
  if (on_gpu) header.push_back("compared");
  for (const char* m : {"cosine", "rel L1", "RMSE", "max err"}) header.push_back(m);
  std::vector<bool> right(header.size(), true);
  right[0] = right[1] = false;
  if (on_gpu) right[2] = false;
  Table table(header, right);
  std::vector<JsonRecord> records;

  // Computed distribution by distribution (each one's exact output is made once), shown
  // recipe by recipe: rows[recipe][dist] holds that case's table rows, unsupported[recipe][dist]
  // the GPU build's refusal, if any.
  std::vector<std::vector<std::vector<std::vector<std::string>>>> rows(
      recipes.size(), std::vector<std::vector<std::vector<std::string>>>(chosen.size()));
  std::vector<std::vector<std::string>> refusal(recipes.size(),
                                                std::vector<std::string>(chosen.size()));
  const int total = static_cast<int>(recipes.size() * chosen.size());
  Progress progress(total, total > 1);
  int unsupported = 0, nonfinite = 0;
  for (size_t di = 0; di < chosen.size(); ++di) {
    const std::string& dist = chosen[di];
    std::unique_ptr<DistributionCase> owned =
        first ? std::move(first) : std::make_unique<DistributionCase>(dist, shape);
    DistributionCase& dc = *owned;
    for (size_t ri = 0; ri < recipes.size(); ++ri) {
      const std::string rn = recipes[ri] + changed;
      const Recipe recipe = checked_recipe(recipes[ri]);
      progress.step(rn + " " + dist);
      auto base = [&](const std::string& compared) {
        JsonRecord r;
        r.str("recipe", recipes[ri]).str("dist", dist).str("compared", compared).str("device", device)
            .integer("batch", shape.batch).integer("heads", shape.heads)
            .integer("kv_heads", shape.kv_heads).integer("n", shape.n).integer("d", shape.d)
            .integer("dv", shape.v_dim()).boolean("causal", shape.causal)
            .integer("seed", static_cast<int64_t>(shape.seed))
            .str("dtype", "fp16");
        if (window.given()) r.integers("window", {window.left, window.right});
        if (p_range > 0) r.integer("p_range", p_range);
        if (k_mean_stride > 0) r.integer("k_mean_stride", k_mean_stride);
        if (balance) r.boolean("qk_channel_balance", true);
        if (!row_sum.empty()) r.str("row_sum", row_sum);
        return r;
      };
      std::vector<uint16_t> sim = dc.simulate(recipe);
      if (!on_gpu) {
        const ErrorStats s = compare_f16(dc, sim, dc.exact_view());
        nonfinite += s.nonfinite > 0;
        std::vector<std::string> row = {rn, dist};
        for (auto& c : metric_cells(s)) row.push_back(c);
        rows[ri][di].push_back(row);
        JsonRecord r = base("simulate_vs_exact");
        records.push_back(add_metrics(r.str("status", "ok"), s));
        continue;
      }
#ifdef SAGE_WITH_CUDA
      try {
        std::vector<uint16_t> gpu = run_on_gpu(dc, recipe, *stream);
        const ErrorStats vs_sim = compare_f16(dc, gpu, dc.out_view(sim.data(), DType::f16));
        const ErrorStats vs_exact = compare_f16(dc, gpu, dc.exact_view());
        nonfinite += vs_exact.nonfinite > 0;
        for (const auto& [label, key, s] :
             {std::make_tuple("gpu vs sim", "gpu_vs_simulate", vs_sim),
              std::make_tuple("gpu vs exact", "gpu_vs_exact", vs_exact)}) {
          std::vector<std::string> row = {rn, dist, label};
          for (auto& c : metric_cells(s)) row.push_back(c);
          rows[ri][di].push_back(row);
          JsonRecord r = base(key);
          records.push_back(add_metrics(r.str("status", "ok"), s));
        }
      } catch (const sage::Error& e) {
        ++unsupported;
        refusal[ri][di] = e.what();
        rows[ri][di].push_back({rn, dist, std::string("unsupported on GPU: ") + e.what()});
        JsonRecord r = base("gpu");
        records.push_back(r.str("status", "unsupported").str("message", e.what()));
      }
#endif
    }
  }

  for (size_t ri = 0; ri < recipes.size(); ++ri) {
    // A recipe refused for the same reason on every input gets one row, not one per input.
    bool same = !refusal[ri][0].empty();
    for (const std::string& m : refusal[ri]) same = same && m == refusal[ri][0];
    if (same && chosen.size() > 1) {
      table.add({recipes[ri] + changed, "all", "unsupported on GPU: " + refusal[ri][0]});
      continue;
    }
    for (auto& per_dist : rows[ri])
      for (auto& row : per_dist) table.add(row);
  }
  table.print(std::cout);
  std::cout << "\n" << total << " case(s)";
  if (on_gpu) std::cout << ", " << total - unsupported << " ran on the GPU, " << unsupported
                        << " unsupported on GPU";
  std::cout << ", " << fixed(progress.elapsed_s(), 1) << " s.";
  if (nonfinite) std::cout << " " << nonfinite << " result(s) contain Inf or NaN.";
  std::cout << "\n";
  for (const std::string& rn : recipes)
    if (preset(rn).inputs == Inputs::prequantized_int8) {
      std::cout << rn << " takes INT8 inputs: they are quantized per token (V per tensor) from the "
                   "same fp16 inputs, and its error is measured against exact attention of the fp16 inputs.\n";
      break;
    }
  if (!json.empty()) {
    JsonRecord meta;
    meta.str("tool", "sage check").str("device", device).str("build", build_description())
        .str("shape", shape.describe());
    write_json_file("sage check", json, meta, records);
    std::cout << "wrote " << records.size() << " records to " << json << "\n";
  }
  return 0;
}

}  // namespace sage::cli
