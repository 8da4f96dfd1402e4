// Why the CUDA runtime cannot be used, in words a user acts on. CUDA builds only.
//
// With no GPU driver installed (the usual machine without a GPU) the runtime reports
// cudaErrorInsufficientDriver, "CUDA driver version is insufficient for CUDA runtime
// version", which reads as "update your driver" when the truth is that no device is present.
// The driver's version tells the two apart: it is 0 when no driver is installed.
#pragma once

#include <cuda_runtime.h>

#include <string>

namespace sage {

// "12.4" for the runtime's and driver's encoding 12040.
inline std::string cuda_version_text(int version) {
  return std::to_string(version / 1000) + "." + std::to_string(version % 1000 / 10);
}

// The reason for `err`, given the installed driver's CUDA version (0: none) and the runtime's.
inline std::string cuda_unavailable_reason(cudaError_t err, int driver_version,
                                           int runtime_version) {
  if (err == cudaErrorNoDevice) return "no CUDA device is present";
  if (err == cudaErrorInsufficientDriver) {
    if (driver_version == 0) return "no CUDA device is present (no CUDA driver is installed)";
    return "the CUDA driver supports CUDA " + cuda_version_text(driver_version) +
           ", older than this build's runtime " + cuda_version_text(runtime_version) +
           "; update the driver";
  }
  return cudaGetErrorString(err);
}

// The same, asking the runtime for both versions.
inline std::string cuda_unavailable_reason(cudaError_t err) {
  int driver = 0, runtime = 0;
  if (cudaDriverGetVersion(&driver) != cudaSuccess) driver = 0;
  if (cudaRuntimeGetVersion(&runtime) != cudaSuccess) runtime = 0;
  return cuda_unavailable_reason(err, driver, runtime);
}

}  // namespace sage
