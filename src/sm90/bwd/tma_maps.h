// TMA descriptors of the backward's operands (kernel_traits.h, SmemLayout, says the tiles):
// the forward's K' codes and the pre-pass's Q, Q^T and dO^T codes in the workspace, and the
// caller's 16-bit V and dO views through their strides.
#pragma once

#include <cuda.h>

#include "sm90/bwd/params.h"

namespace sage::sm90::bwd {

struct BackwardMaps {
  CUtensorMap k8;    // [kvh * n_pad rows][D] int8, boxes of 128 rows x D, D-byte swizzle
  CUtensorMap v;     // [b][h_kv][n_kv][D] 16-bit, boxes of 128 rows x 64 elements, 128B
  CUtensorMap q8;    // [bh * n_q_pad rows][D] int8, boxes of 64 rows x D, D-byte swizzle
  CUtensorMap q8t;   // [bh * D rows][n_q_pad] int8, boxes of D rows x 64, 64B swizzle
  CUtensorMap dout;  // [b][h_q][n_q][D] 16-bit, boxes of 64 rows x 64 elements, 128B
  CUtensorMap do8t;  // as q8t
};

// Whether a 16-bit view [b, h, n, D] (strides in elements) can be read by TMA: 16-byte aligned
// base and strides (a dimension of extent 1 is exempt).
bool view_tma_compatible(const void* base, int64_t sb, int64_t sh, int64_t sn, int batch, int heads, int n);

BackwardMaps make_backward_maps(const BackwardParams& p, int head_dim);

}  // namespace sage::sm90::bwd
