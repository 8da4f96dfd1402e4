// CUDA runtime errors as sage::CudaError, for every host launcher.
#pragma once

#include <cuda_runtime.h>

namespace sage {

// Throws CudaError("<what> failed: <the runtime's message>").
[[noreturn]] void throw_cuda(const char* what, cudaError_t err);

}  // namespace sage
