// The words for an unusable CUDA runtime (src/common/cuda_status.h). Runs in every CUDA build,
// with or without a GPU: the reasons are computed from given error codes and versions.
#include <gtest/gtest.h>

#include <string>

#ifdef SAGE_WITH_CUDA
#include "common/cuda_status.h"
#endif

namespace {

// Before, a CUDA build on a machine without a GPU (no driver installed) reported the runtime's
// "CUDA driver version is insufficient for CUDA runtime version".
TEST(CudaStatus, NoDriverMeansNoDevice) {
#ifndef SAGE_WITH_CUDA
  GTEST_SKIP() << "this build has no CUDA (configured with SAGE_CUDA=OFF)";
#else
  EXPECT_EQ(sage::cuda_unavailable_reason(cudaErrorInsufficientDriver, 0, 12040),
            "no CUDA device is present (no CUDA driver is installed)");
  EXPECT_EQ(sage::cuda_unavailable_reason(cudaErrorNoDevice, 12040, 12040),
            "no CUDA device is present");
  // An installed driver older than the runtime is what the runtime's sentence means.
  EXPECT_EQ(sage::cuda_unavailable_reason(cudaErrorInsufficientDriver, 11080, 12040),
            "the CUDA driver supports CUDA 11.8, older than this build's runtime 12.4; update "
            "the driver");
  EXPECT_EQ(sage::cuda_unavailable_reason(cudaErrorMemoryAllocation, 12040, 12040),
            std::string(cudaGetErrorString(cudaErrorMemoryAllocation)));
#endif
}

}  // namespace
