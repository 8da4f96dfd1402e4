// The GPU's answer to a packed variable-length batch until its sm_90 kernel exists: a named
// refusal, shared by the CUDA build (dispatch.cu) and the CPU-only build (without_cuda), so
// that both say the same thing and neither runs anything else in its place.
#pragma once

#include "sage/error.h"

namespace sage {

[[noreturn]] inline void refuse_varlen_on_gpu() {
  throw Error("cu_seqlens_q",
              "packed variable-length batches have no sm_90 kernel yet; the CPU simulator runs "
              "them (reference::simulate_varlen, sagekit.simulate_varlen)");
}

}  // namespace sage
