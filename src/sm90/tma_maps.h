// TMA descriptors of the quantized K and transposed V tensors in the workspace.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include "sm90/kernel_params.h"

namespace sage::sm90 {

struct AttentionMaps {
  CUtensorMap k;  // [B*Hkv*n_pad rows, D] int8, boxes of 128 x D, swizzled to the row width
  CUtensorMap v;  // [B*Hkv*D rows, n_pad * v_bytes bytes], boxes of D x 128 bytes, 128B swizzle
};

AttentionMaps make_attention_maps(const AttentionParams& p, int head_dim, int v_bytes);

[[noreturn]] void throw_cuda(const char* what, cudaError_t err);

}  // namespace sage::sm90
