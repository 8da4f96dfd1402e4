// How the CLI spells a recipe's options in tables (shared by `recipes` and `docs`), and the
// recipe option flags `check` and `bench` share.
#pragma once

#include <string>

#include "common.h"
#include "sage/recipe.h"

namespace sage::cli {

struct RecipeColumns {
  std::string qk, smoothing, p, v, accum, row_sum, inputs;
};

RecipeColumns recipe_columns(const Recipe& r);
// True for the preset whose options equal a default-constructed Recipe (what a caller gets
// without choosing), so the tables can mark it without naming it in code.
bool is_default_recipe(const Recipe& r);
// The preset table; `with_summary` adds recipe_summary() as a last column.
Table recipe_table(bool with_summary);
// --k-mean-stride: r's K smoothing over every `stride`-th key; a usage error naming `command`
// and the preset when r does not smooth K.
void apply_k_mean_stride(const std::string& command, Recipe& r, int64_t stride);

}  // namespace sage::cli
