// Portability macros shared by host code, the CPU simulator and the CUDA kernels.
#pragma once

#if defined(__CUDACC__)
#define SAGE_HD __host__ __device__ __forceinline__
#else
#define SAGE_HD inline
#endif
