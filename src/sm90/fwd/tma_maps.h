// TMA descriptors of the quantized K and transposed V tensors in the workspace.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include "common/cuda_check.h"
#include "sm90/fwd/params.h"

namespace sage::sm90 {

struct AttentionMaps {
  CUtensorMap k;  // [B*Hkv*n_pad rows, D] int8, boxes of 128 x D, swizzled to the row width
  CUtensorMap v;  // [B*Hkv*D rows, n_pad * v_bytes bytes], boxes of D x 128 bytes, 128B swizzle
  // The fp16/bf16 Q input for the Q stage (p.q_stage; zeros otherwise): [B, Hq, n_q, D] by
  // its strides, boxes of block_q rows x 64 elements, 128B swizzle.
  CUtensorMap q;
};

// Whether Q's view can be read by TMA: 16-byte aligned base and row, head and batch strides
// (a dimension of extent 1 is exempt: its stride is never applied).
bool q_tma_compatible(const AttentionParams& p);

AttentionMaps make_attention_maps(const AttentionParams& p, int head_dim, int v_bytes);

// cuTensorMapEncodeTiled through the run-time driver entry point, elements strides 1, no
// interleave, L2 promotion 256B, no OOB fill (zeros); throws CudaError naming `what` on failure.
// Shared with the backward's maps (sm90/bwd/tma_maps.cu).
CUtensorMap encode_tensor_map(CUtensorMapDataType type, cuuint32_t rank, void* base, const cuuint64_t* dims,
                              const cuuint64_t* strides, const cuuint32_t* box, CUtensorMapSwizzle swizzle,
                              const char* what);

}  // namespace sage::sm90
