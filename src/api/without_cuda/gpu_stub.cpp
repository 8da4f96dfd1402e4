// The GPU entry points of a CPU-only build (configured with SAGE_CUDA=OFF).
//
// They exist so that programs and bindings link against either build; a call explains why
// it cannot run instead of failing at link time or silently computing on the CPU.
#include "sage/attention.h"
#include "sage/backward.h"
#include "sage/error.h"
#include "sage/varlen.h"

namespace sage {
namespace {

[[noreturn]] void no_cuda() {
  throw Error("device",
              "this build has no CUDA kernels (configured with SAGE_CUDA=OFF); rebuild with "
              "SAGE_CUDA=ON on a machine with nvcc");
}

}  // namespace

size_t workspace_bytes(const AttentionArgs&) { no_cuda(); }

void attention(const AttentionArgs&, void*, size_t, void*) { no_cuda(); }

size_t kv_workspace_bytes(int64_t, int64_t, int64_t, int64_t, const Recipe&, int64_t) { no_cuda(); }

void quantize_kv(const AttentionArgs&, void*, size_t, void*) { no_cuda(); }

void attention_from_quantized_kv(const AttentionArgs&, const void*, size_t, void*) { no_cuda(); }

size_t varlen_workspace_bytes(const VarlenArgs&) { no_cuda(); }

size_t varlen_workspace_bytes(int64_t, int64_t, int64_t, int64_t, int64_t, const Recipe&, int64_t) {
  no_cuda();
}

void attention_varlen(const VarlenArgs&, void*, size_t, void*) { no_cuda(); }

bool gpu_supports(const Recipe&) { return false; }

size_t backward_workspace_bytes(const BackwardArgs&) { no_cuda(); }

void attention_backward(const BackwardArgs&, void*, size_t, void*) { no_cuda(); }

void attention_for_training(const AttentionArgs&, const TensorView&, void*, size_t, void*) { no_cuda(); }

bool gpu_supports_backward(const Recipe&) { return false; }

bool gpu_available() { return false; }

const char* gpu_kernel_head_dims() { return ""; }

}  // namespace sage
