// How the attention kernel's work items (Q tiles of a (batch, head)) are split over CTAs.
#pragma once

#include <cstdint>

#include "sm90/kernel_params.h"

namespace sage::sm90 {

// Work items one CTA runs one after the other (AttentionParams::items_per_cta), for the
// current device. Tuning override: the environment variable SAGE_SM90_CTA_TILES (read once)
// sets the K/V tiles a CTA aims for (default 64, 16 under a causal mask: schedule.cu); 0 gives
// one item per CTA.
int items_per_cta(const AttentionParams& p);

// Whether the launch uses work_order.h's grouped order (else the consecutive one), for the
// current device: call after items_per_cta is set. head_dim, v_bytes: the kernel's D and
// bytes per stored V element, which size a head's K/V.
bool use_grouped_order(const AttentionParams& p, int head_dim, int v_bytes);

// Whether the launch quantizes Q in the Q stage (q_stage.cuh; AttentionParams::q_stage) rather
// than in the consumers' prologue: the same codes and scales either way, so this is a choice of
// speed only. Taken where the variant has the stage (capable), CTAs run more than one item
// (items_per_cta: set it first), items are short (schedule.cu: the measured rule) and the
// launch allows it: Q in
// fp16/bf16 (not prequantized) with per-thread or per-token groups, a view TMA can read, and
// no LSE under K smoothing (q . mean(K) is computed from raw Q in the prologue). Overrides: the
// environment variable SAGE_SM90_Q_STAGE (read once; A/B runs: 0 never, 2 regardless of item
// length) and set_q_stage_override (tests; `on` also regardless of item length).
bool use_q_stage(const AttentionParams& p, bool capable, int head_dim);
// use_q_stage for a launch about to happen: also counts it (q_stage_launches).
bool take_q_stage(const AttentionParams& p, bool capable, int head_dim);

// Tests: every later launch runs this many items per CTA (0 returns to the choice above), so
// that chained items can be checked on shapes too small to chain by themselves.
void set_items_per_cta_override(int items);

// Tests: every later launch uses this order (automatic returns to the choice above).
enum class WorkOrderOverride { automatic, consecutive, grouped };
void set_work_order_override(WorkOrderOverride order);

// Tests: every later launch takes the Q stage where it can (on), never (off), or as
// use_q_stage decides (automatic).
enum class QStageOverride { automatic, off, on };
void set_q_stage_override(QStageOverride mode);
// Tests: launches that took the Q stage so far in this process.
int64_t q_stage_launches();

}  // namespace sage::sm90
