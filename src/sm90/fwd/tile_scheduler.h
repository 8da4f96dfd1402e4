// The tile scheduler: which work items (Q tiles of a (batch, head)) each CTA of the attention
// kernel runs, and in what order. The device half (the orders as slot sequences) is shared by
// the kernel, its launch and the CPU tests; the host half (tile_scheduler.cu) picks the order,
// the grid and the Q stage for a launch.
//
// A CTA walks a sequence of slots (cta_slots, slot_step); item_at says
// which Q tile of which head a slot is. Items are numbered head-major, w = hb * n_q_tiles + q
// (hb = batch * heads_q + head); under a causal mask a head's Q tiles are taken heaviest first
// (the diagonal's far end carries the most K/V tiles). Three orders (WorkOrder, chosen by
// tile_scheduler.cu):
//   - consecutive: a CTA runs `per_cta` consecutive items (slot = item), e.g. all Q tiles of a
//     head in a row. Under a causal mask this keeps heavy and light tiles of the diagonal
//     together, so that CTAs carry similar work (the grouped order would give CTA j the same
//     tile of every head: up to n_q_tiles times the work of another CTA);
//   - grouped: CTAs go in groups of n_q_tiles; a group takes `per_cta` consecutive heads, one
//     per round, and its CTA j runs Q tile j of each (slot = item, step n_q_tiles). In every
//     round the CTAs of a group work on one head at the same time, so the CTAs resident together
//     cover few heads and a head's K/V comes from DRAM about once, then from L2 for its other
//     Q tiles;
//   - strided (persistent): one CTA per SM, CTA c runs units c, c + ctas, c + 2 ctas, ... A
//     unit is an item, or under a causal mask two Q tiles that together carry n_q_tiles + 1
//     K/V tiles: a head's heaviest with its lightest, its second heaviest with its second
//     lightest, ..., and with an odd n_q_tiles the middle tiles of two heads (a last, odd head's
//     middle tile is a unit alone). So every CTA carries the same work to within a unit (units
//     of uneven weight, e.g. middle tiles alone, would fall on the same CTAs round after round:
//     unit u goes to CTA u % ctas). The CTAs resident together run consecutive units, so they
//     cover few heads (as the grouped order does), and each CTA pays a CTA's first item (its
//     own Q prologue, the first K/V round trip) once, where the other orders pay it once per
//     per_cta items.
// With the consecutive order at d = 128, N = 1K (8 items per CTA) the resident CTAs work on
// as many heads as there are SMs, 35 MB of K/V, and re-read much of it from DRAM for every
// item (v13a, docs/history/README.md).
// Every order runs a CTA's slots as begin, begin + slot_step, ... below end (cta_slots), an
// arithmetic sequence like the item loops had before the strided order: written as a
// next-slot function with a branch for the causal units' halves, the same loops moved ptxas's
// K/V loop schedule and lost time where nothing else changed (v28, docs/history/README.md).
// So under a causal mask CTA c's k-th slot is k ctas + c, its unit (k / 2) ctas + c and its
// half k % 2 (heavy tile first).
#pragma once

#include <cstdint>

#include "numerics/config.h"


namespace sage::sm90 {

enum class WorkOrder : uint8_t { consecutive, grouped, strided };

struct WorkSchedule {
  int n_q_tiles, head_batches;
  int per_cta;  // items a CTA runs at most (consecutive, grouped); units (strided: the grid decides)
  int ctas;     // the grid
  WorkOrder order;
  bool causal;
};

struct WorkItemRef {
  int hb, q_tile;
};

namespace detail {
SAGE_HD bool pairs(const WorkSchedule& s) { return s.order == WorkOrder::strided && s.causal; }
// Pairs of one head's tiles per head (the middle one of an odd count left out).
SAGE_HD int head_pairs(int n_q_tiles) { return n_q_tiles / 2; }
}  // namespace detail

// Units of work the strided order spreads over its CTAs. Under a causal mask with an odd
// n_q_tiles, units come in blocks of two heads: the first head's pairs, the two middle tiles,
// the second head's pairs (n_q_tiles units); a last, odd head has its pairs and its middle.
SAGE_HD int64_t strided_units(const WorkSchedule& s) {
  const int n = s.n_q_tiles;
  if (!detail::pairs(s)) return int64_t(s.head_batches) * n;
  if (n % 2 == 0) return int64_t(s.head_batches) * detail::head_pairs(n);
  return int64_t(s.head_batches / 2) * n + (s.head_batches % 2) * (detail::head_pairs(n) + 1);
}

// The grid of the consecutive and grouped orders (per_cta set); the strided order's grid is
// the launch's choice (tile_scheduler.cu: one CTA per SM, at most one per unit).
SAGE_HD int64_t chunked_cta_count(const WorkSchedule& s) {
  const int64_t items = int64_t(s.n_q_tiles) * s.head_batches;
  return s.order == WorkOrder::grouped
             ? (int64_t(s.head_batches) + s.per_cta - 1) / s.per_cta * s.n_q_tiles
             : (items + s.per_cta - 1) / s.per_cta;
}

struct CtaSlots {
  int begin, end;  // slots begin, begin + slot_step, ... below end
};

// The distance between a CTA's consecutive slots. (A function of kernel parameters rather
// than a field, so that the kernel can re-read it instead of keeping it live: one more live
// register spilled the K/V loop of a d = 128 variant.)
SAGE_HD int slot_step(const WorkSchedule& s) {
  return s.order == WorkOrder::consecutive ? 1
         : s.order == WorkOrder::grouped   ? s.n_q_tiles
                                           : s.ctas;
}

SAGE_HD CtaSlots cta_slots(const WorkSchedule& s, int cta) {
  const int items = s.n_q_tiles * s.head_batches;
  switch (s.order) {
    case WorkOrder::consecutive: {
      const int begin = cta * s.per_cta;
      return {begin, begin + s.per_cta < items ? begin + s.per_cta : items};
    }
    case WorkOrder::grouped: {
      const int group = cta / s.n_q_tiles, j = cta % s.n_q_tiles;
      const int first_head = group * s.per_cta;
      const int end_head =
          first_head + s.per_cta < s.head_batches ? first_head + s.per_cta : s.head_batches;
      return {first_head * s.n_q_tiles + j, end_head * s.n_q_tiles};
    }
    case WorkOrder::strided: break;
  }
  if (!detail::pairs(s)) return {cta, items};
  // Units r ctas + cta for rounds r = 0 .. below `rounds`, two slots each.
  const int units = int(strided_units(s));
  const int rounds = units / s.ctas + (cta < units % s.ctas ? 1 : 0);
  int end = 2 * rounds * s.ctas;
  // A last, odd head's middle tile is a unit alone: no second slot.
  if (s.n_q_tiles % 2 == 1 && s.head_batches % 2 == 1 && cta == (units - 1) % s.ctas) end -= s.ctas;
  return {cta, end};
}

SAGE_HD WorkItemRef item_at(const WorkSchedule& s, int slot) {
  const int n = s.n_q_tiles;
  if (!detail::pairs(s)) {
    const int q = slot % n;
    return {slot / n, s.causal ? n - 1 - q : q};  // causal: heaviest first
  }
  const int round_half = slot / s.ctas;
  const int unit = round_half / 2 * s.ctas + slot % s.ctas, half = round_half % 2;
  const int pairs = detail::head_pairs(n);
  if (n % 2 == 0) {
    const int j = unit % pairs;
    return {unit / pairs, half == 0 ? n - 1 - j : j};
  }
  const int block = unit / n, r = unit % n;
  if (r == pairs) return {2 * block + half, pairs};  // the two middle tiles
  const int j = r < pairs ? r : r - pairs - 1;
  return {2 * block + (r > pairs), half == 0 ? n - 1 - j : j};
}


// ---- the launch's choices (host, tile_scheduler.cu) -------------------------------------------

struct AttentionParams;

// The launch's work order and grid (AttentionParams::work), for the current device, from the
// problem's fields of p (set them first). head_dim, v_bytes: the kernel's D and bytes per
// stored V element, which size a head's K/V.
WorkSchedule work_schedule(const AttentionParams& p, int head_dim, int v_bytes);

// The most items one CTA of the schedule runs.
int items_per_cta(const WorkSchedule& s);

// Whether the launch quantizes Q in the Q stage (q_stage.cuh; AttentionParams::q_stage) rather
// than in the consumers' prologue: the same codes and scales either way, so this is a choice of
// speed only. Taken where the variant has the stage (capable), CTAs run more than one item
// (AttentionParams::work: set it first), items are short (tile_scheduler.cu: the measured rule)
// and the launch allows it: Q in fp16/bf16 (not prequantized) with per-thread or per-token
// groups, a view TMA can read, and no LSE under K smoothing (q . mean(K) is computed from raw Q
// in the prologue).
bool use_q_stage(const AttentionParams& p, bool capable, int head_dim);
// use_q_stage for a launch about to happen: also counts it (q_stage_launches).
bool take_q_stage(const AttentionParams& p, bool capable, int head_dim);
// Launches that took the Q stage so far in this process (tests).
int64_t q_stage_launches();

// Overrides of the choices above, for tests that must reach every path on small shapes. The
// library never sets them itself and reads no environment variable.
enum class WorkOrderOverride { automatic, consecutive, grouped, strided };
enum class QStageOverride { automatic, off, on };
struct ScheduleOverrides {
  // > 0: every launch runs this many items per CTA (in the strided order: the grid is cut to
  // as few CTAs as take this many items each, rounded to whole units).
  int items_per_cta = 0;
  WorkOrderOverride order = WorkOrderOverride::automatic;
  // on: the Q stage wherever the launch allows it, whatever the item length.
  QStageOverride q_stage = QStageOverride::automatic;
};
void set_schedule_overrides(const ScheduleOverrides& overrides);
ScheduleOverrides schedule_overrides();

}  // namespace sage::sm90
