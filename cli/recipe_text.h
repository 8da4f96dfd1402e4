// How the CLI spells a recipe's options in tables (shared by `recipes` and `docs`).
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

}  // namespace sage::cli
