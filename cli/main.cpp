// The `sage` command: one subcommand per file (recipes, check, bench, docs).
#include <exception>
#include <iostream>
#include <string>
#include <vector>

#include "common.h"
#include "sage/error.h"

namespace sage::cli {
int run_calibrate(const std::vector<std::string>& args);  // cli/calibrate.cpp
}

namespace {

struct Command {
  const char* name;
  const char* summary;
  int (*run)(const std::vector<std::string>&);
};

const Command kCommands[] = {
    {"recipes", "list the presets (the papers' configurations) and their options",
     sage::cli::run_recipes},
    {"check", "accuracy of recipes on synthetic inputs (GPU vs simulate vs exact)",
     sage::cli::run_check},
    {"bench", "time the GPU kernels over the benchmark grid (whole call, TOPS)",
     sage::cli::run_bench},
    {"docs", "write docs/recipes.md (presets, simulated error, GPU speed)", sage::cli::run_docs},
    {"calibrate", "pick a recipe per layer from sample Q/K/V and measured speeds",
     sage::cli::run_calibrate},
};

void usage(std::ostream& os) {
  os << "usage: sage <command> [flags]\n\n"
        "Quantized attention (the SageAttention family): presets, accuracy, speed.\n\n"
        "commands:\n";
  for (const Command& c : kCommands)
    os << "  " << c.name << std::string(11 - std::string(c.name).size(), ' ') << c.summary << "\n";
  os << "\n'sage <command> --help' lists a command's flags.\n";
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    usage(std::cerr);
    return 2;
  }
  const std::string name = argv[1];
  if (name == "--help" || name == "-h" || name == "help") {
    usage(std::cout);
    return 0;
  }
  const std::vector<std::string> args(argv + 2, argv + argc);
  try {
    for (const Command& c : kCommands)
      if (name == c.name) return c.run(args);
    std::string names;
    for (const Command& c : kCommands) names += std::string(names.empty() ? "" : ", ") + c.name;
    std::cerr << "sage: unknown command '" << name << "'; allowed: " << names
              << " (see sage --help)\n";
    return 2;
  } catch (const sage::cli::UsageError& e) {
    std::cerr << e.what() << "\n";
    return 2;
  } catch (const sage::Error& e) {
    std::cerr << "sage: " << e.what() << "\n";
    return 2;
  } catch (const sage::CudaError& e) {
    std::cerr << "sage: CUDA error: " << e.what() << "\n";
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "sage: " << e.what() << "\n";
    return 1;
  }
}
