// Recipes from Python: a preset name, a spec string or a dict of options, and back.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <string>

#include "sage/recipe.h"

namespace sagepy {

namespace nb = nanobind;

// Accepts
//   * a preset name:                 "sage2_8b"
//   * a spec string:                 "sage2_8b,pv_accum=fp32" (a bare item names the preset
//                                    to start from; key=value items override options)
//   * a dict of options:             {"base": "sage2_8b", "pv_accum": "fp32", ...}
// Options left out keep the base preset's values (or, without a base, the Recipe
// defaults, which are sage2_8b's). The result is checked by sage::validate_recipe.
// Errors are sage::Error naming "recipe" or the option ("recipe.pv_accum").
sage::Recipe recipe_from(nb::handle spec);

// Every option with the spelling recipe_from accepts, plus name, paper and summary.
nb::dict recipe_to_dict(const sage::Recipe& r);

// The canonical spec string of a recipe: recipe_from(recipe_to_spec(r)) == r.
std::string recipe_to_spec(const sage::Recipe& r);

}  // namespace sagepy
