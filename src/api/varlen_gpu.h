// The GPU side of packed variable-length batches: the argument checks that need no host read
// of the offsets (check_varlen_args.cpp), shared by the CUDA dispatch and the CPU-only build.
#pragma once

#include <cstdint>

#include "sage/attention.h"
#include "sage/error.h"
#include "sage/varlen.h"

namespace sage {

// A checked GPU varlen call as the dense kernels' shapes: batch = the sequences, n_q / n_kv =
// max_seqlen_q / max_seqlen_k (each cut to the packed token count, which no sequence exceeds),
// the window normalized over those (a bound that masks no key of the longest sequence masks
// none of any). dense: the packed tensors as 4-D NHD views [batch, max_seqlen, heads, d] with
// batch stride 0, the LSE as [batch, heads, max_seqlen_q] with batch stride 0; the sequence's
// first row is added by the kernels from the device offsets.
struct VarlenGpuCall {
  Problem problem;
  AttentionArgs dense;
  int64_t total_q = 0, total_k = 0;
};

// Every rule of check_varlen_args that does not read the offsets' contents, for offsets in
// device memory (named errors; cu_seqlens_* must be contiguous i32 on q's device).
VarlenGpuCall check_varlen_args_gpu(const VarlenArgs& args);

}  // namespace sage
