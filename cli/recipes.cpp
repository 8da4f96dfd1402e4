// `sage recipes`: the presets and the options each one sets.
#include <iostream>
#include <sstream>

#include "common.h"
#include "recipe_text.h"
#include "sage/recipe.h"

namespace sage::cli {
namespace {

std::string range_text(float r) {
  std::ostringstream os;
  os << r;
  return os.str();
}

}  // namespace

bool is_default_recipe(const Recipe& r) {
  const Recipe d{};
  return r.qk_format == d.qk_format && r.qk_granularity == d.qk_granularity &&
         r.smooth_k == d.smooth_k && r.k_mean_stride == d.k_mean_stride &&
         r.smooth_q == d.smooth_q && r.smooth_v == d.smooth_v &&
         r.pv_format == d.pv_format && r.p_scale == d.p_scale && r.v_scale == d.v_scale &&
         r.pv_accum == d.pv_accum && r.p_range == d.p_range && r.v_range == d.v_range &&
         r.row_sum == d.row_sum && r.inputs == d.inputs &&
         r.qk_channel_balance == d.qk_channel_balance;
}

RecipeColumns recipe_columns(const Recipe& r) {
  RecipeColumns c;
  c.qk = std::string(to_string(r.qk_format)) + " " + to_string(r.qk_granularity);
  std::vector<std::string> sm;
  if (r.smooth_q) sm.push_back("Q");
  if (r.smooth_k)
    sm.push_back(r.k_mean_stride > 1
                     ? "K (mean of every " + std::to_string(r.k_mean_stride) + "th key)"
                     : "K");
  if (r.smooth_v) sm.push_back("V");
  c.smoothing = sm.empty() ? "none" : join(sm, "+");
  c.p = std::string(to_string(r.pv_format));
  if (r.p_scale != PScale::none) {
    c.p += std::string(" ") + to_string(r.p_scale);
    if (r.p_range > 0) c.p += " to " + range_text(r.p_range);
  }
  c.v = std::string(to_string(r.pv_format));
  if (r.v_scale != VScale::none) {
    c.v += std::string(" ") + to_string(r.v_scale);
    if (r.v_range > 0) c.v += " to " + range_text(r.v_range);
  }
  c.accum = to_string(r.pv_accum);
  c.row_sum = to_string(r.row_sum);
  c.inputs = to_string(r.inputs);
  return c;
}

void apply_k_mean_stride(const std::string& command, Recipe& r, int64_t stride) {
  if (!r.smooth_k)
    throw UsageError(command + ": --k-mean-stride applies to recipes that smooth K; " + r.name +
                     " does not");
  r.k_mean_stride = int(stride);
}

Table recipe_table(bool with_summary) {
  std::vector<std::string> header = {"preset", "paper", "Q/K",  "smoothing", "P",
                                     "V",      "PV accumulation", "row sum", "inputs"};
  if (with_summary) header.push_back("summary");
  Table t(header, {});
  for (const Recipe& r : presets()) {
    const RecipeColumns c = recipe_columns(r);
    std::vector<std::string> row = {r.name + (is_default_recipe(r) ? " (default)" : ""),
                                    recipe_paper(r), c.qk, c.smoothing, c.p, c.v, c.accum,
                                    c.row_sum, c.inputs};
    if (with_summary) row.push_back(recipe_summary(r));
    t.add(row);
  }
  return t;
}

int run_recipes(const std::vector<std::string>& args) {
  Flags flags("sage recipes",
              "Lists the presets: the papers' configurations expressed in the library's recipe\n"
              "options. Every preset means the same numerics in the GPU kernels and in the CPU\n"
              "simulator.",
              {{"markdown", "", "print a Markdown table (this is what README.md embeds)"}}, args);
  if (flags.help()) {
    flags.print_help(std::cout);
    return 0;
  }
  if (flags.has("markdown")) {
    recipe_table(true).print_markdown(std::cout);
    return 0;
  }
  recipe_table(false).print(std::cout);
  std::cout << "\n";
  for (const Recipe& r : presets()) std::cout << r.name << ": " << recipe_summary(r) << "\n";
  return 0;
}

}  // namespace sage::cli
