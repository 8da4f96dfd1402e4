// Which work items (Q tiles of a (batch, head)) each CTA of the attention kernel runs, and in
// what order: shared by the kernel, its launch (the grid size) and the CPU tests.
//
// Items are numbered head-major, w = hb * n_q_tiles + q (hb = batch * heads_q + head). A CTA
// runs the items begin, begin + step, ... below end, in one of two orders
// (AttentionParams::grouped_order, chosen by schedule.cu):
//   - consecutive: a CTA runs `per_cta` consecutive items (step 1), e.g. all Q tiles of a
//     head in a row. Under a causal mask this keeps heavy and light tiles of the diagonal
//     together, so that CTAs carry similar work (the grouped order would give CTA j the same
//     tile of every head: up to n_q_tiles times the work of another CTA);
//   - grouped: CTAs go in groups of n_q_tiles; a group takes `per_cta` consecutive heads, one
//     per round, and its CTA j runs Q tile j of each (step = n_q_tiles). In every round the
//     CTAs of a group work on one head at the same time, so the CTAs resident together cover
//     few heads and a head's K/V comes from DRAM about once, then from L2 for its other Q tiles.
// With the consecutive order at d = 128, N = 1K (8 items per CTA) the resident CTAs work on
// as many heads as there are SMs, 35 MB of K/V, and re-read much of it from DRAM for every
// item (ncu, H100: 2.17 GB read against 0.54 GB of Q, K and V).
#pragma once

#include <cstdint>

#include "sage/config.h"

namespace sage::sm90 {

// The distance between the items a CTA runs one after the other. (A function of two kernel parameters
// rather than a field below, so that the kernel can re-read it instead of keeping it live:
// one more live register spilled the K/V loop of a d = 128 variant.)
SAGE_HD int item_step(int n_q_tiles, bool grouped) { return grouped ? n_q_tiles : 1; }

struct CtaItems {
  int begin, end;  // items begin, begin + item_step, ... below end
};

SAGE_HD CtaItems cta_items(int n_q_tiles, int head_batches, int per_cta, bool grouped, int cta) {
  if (!grouped) {
    const int items = n_q_tiles * head_batches, begin = cta * per_cta;
    return {begin, begin + per_cta < items ? begin + per_cta : items};
  }
  const int group = cta / n_q_tiles, j = cta % n_q_tiles;
  const int first_head = group * per_cta;
  const int end_head = first_head + per_cta < head_batches ? first_head + per_cta : head_batches;
  return {first_head * n_q_tiles + j, end_head * n_q_tiles};
}

// CTAs of the grid.
SAGE_HD int64_t cta_count(int n_q_tiles, int head_batches, int per_cta, bool grouped) {
  if (!grouped) return (int64_t(n_q_tiles) * head_batches + per_cta - 1) / per_cta;
  return (int64_t(head_batches) + per_cta - 1) / per_cta * n_q_tiles;
}

}  // namespace sage::sm90
