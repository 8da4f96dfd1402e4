// `sage check --backward` (check_backward.cpp), which `sage check` hands its parsed flags.
#pragma once

#include <string>

#include "accuracy.h"
#include "common.h"

namespace sage::cli {

// The gradients of the recipes with a backward against float64, on the CPU: --recipe (among
// those), --dist, --dp-format and the shape flags; --json writes one record per gradient.
int run_check_backward(const Flags& flags, const CheckShape& shape, const std::string& json);

}  // namespace sage::cli
