// The CPU references of packed variable-length batches: each sequence runs as the dense call
// on its own tokens (sequence_args: views into the packed tensors, no copy), so every
// statistic the recipe takes over tokens, the mask's bottom-right alignment and the Q tiles'
// starting row are the sequence's own, and no value of one sequence reaches another.
#include "sage/attention.h"
#include "sage/varlen.h"

namespace sage::reference {
namespace {

template <class DenseCall>
void run_per_sequence(const VarlenArgs& args, DenseCall dense) {
  const VarlenProblem p = check_varlen_args(args);
  for (int64_t b = 0; b < p.batch; ++b) {
    // No query token: nothing to write (its keys, if any, serve no row).
    if (p.seqlen_q(b) == 0) continue;
    dense(sequence_args(args, p, b));
  }
}

}  // namespace

void exact_varlen(const VarlenArgs& args) { run_per_sequence(args, exact); }

void simulate_varlen(const VarlenArgs& args) { run_per_sequence(args, simulate); }

}  // namespace sage::reference
