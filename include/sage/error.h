// Errors raised by every public entry point.
//
// An argument error names the argument that is wrong and what is allowed, in one
// sentence, e.g. "q: head_dim must be one of 64, 128 (got 96)". The argument name is
// also available on its own so that bindings and tests can check it without parsing.
#pragma once

#include <stdexcept>
#include <string>

namespace sage {

class Error : public std::invalid_argument {
 public:
  Error(std::string argument, const std::string& message)
      : std::invalid_argument(argument + ": " + message), argument_(std::move(argument)) {}
  const std::string& argument() const noexcept { return argument_; }

 private:
  std::string argument_;
};

// A failure of the CUDA runtime or driver (not the caller's argument).
class CudaError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

}  // namespace sage
