#include "common/cuda_check.h"

#include <string>

#include "sage/error.h"

namespace sage {

void throw_cuda(const char* what, cudaError_t err) {
  throw CudaError(std::string(what) + " failed: " + cudaGetErrorString(err));
}

}  // namespace sage
