// How the attention kernel's work items (Q tiles of a (batch, head)) are split over CTAs.
#pragma once

#include <cstdint>

#include "sm90/kernel_params.h"

namespace sage::sm90 {

// The launch's work order and grid (AttentionParams::work; work_order.h), for the current
// device, from the problem's fields of p (set them first). head_dim, v_bytes: the kernel's D
// and bytes per stored V element, which size a head's K/V. Tuning overrides, read once: the
// environment variable SAGE_SM90_WORK_ORDER (strided, or chunked: the consecutive and grouped
// orders by the rule they had before the strided one) and, for the chunked orders,
// SAGE_SM90_CTA_TILES, the K/V tiles a CTA aims for (default 64, 16 under a causal mask:
// schedule.cu; 0 gives one item per CTA).
WorkSchedule work_schedule(const AttentionParams& p, int head_dim, int v_bytes);

// The most items one CTA of the schedule runs.
int items_per_cta(const WorkSchedule& s);

// Whether the launch quantizes Q in the Q stage (q_stage.cuh; AttentionParams::q_stage) rather
// than in the consumers' prologue: the same codes and scales either way, so this is a choice of
// speed only. Taken where the variant has the stage (capable), CTAs run more than one item
// (AttentionParams::work: set it first), items are short (schedule.cu: the measured rule) and the
// launch allows it: Q in
// fp16/bf16 (not prequantized) with per-thread or per-token groups, a view TMA can read, and
// no LSE under K smoothing (q . mean(K) is computed from raw Q in the prologue). Overrides: the
// environment variable SAGE_SM90_Q_STAGE (read once; A/B runs: 0 never, 2 regardless of item
// length) and set_q_stage_override (tests; `on` also regardless of item length).
bool use_q_stage(const AttentionParams& p, bool capable, int head_dim);
// use_q_stage for a launch about to happen: also counts it (q_stage_launches).
bool take_q_stage(const AttentionParams& p, bool capable, int head_dim);

// Tests: every later launch runs this many items per CTA (0 returns to the choice above), so
// that chained items can be checked on shapes too small to chain by themselves. In the strided
// order: the grid is cut to as few CTAs as take this many items each (rounded to whole units).
void set_items_per_cta_override(int items);

// Tests: every later launch uses this order (automatic returns to the choice above).
enum class WorkOrderOverride { automatic, consecutive, grouped, strided };
void set_work_order_override(WorkOrderOverride order);

// Tests: every later launch takes the Q stage where it can (on), never (off), or as
// use_q_stage decides (automatic).
enum class QStageOverride { automatic, off, on };
void set_q_stage_override(QStageOverride mode);
// Tests: launches that took the Q stage so far in this process.
int64_t q_stage_launches();

}  // namespace sage::sm90
