// How the attention kernel's work items (Q tiles of a (batch, head)) are split over CTAs.
#pragma once

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

// Tests: every later launch runs this many items per CTA (0 returns to the choice above), so
// that chained items can be checked on shapes too small to chain by themselves.
void set_items_per_cta_override(int items);

// Tests: every later launch uses this order (automatic returns to the choice above).
enum class WorkOrderOverride { automatic, consecutive, grouped };
void set_work_order_override(WorkOrderOverride order);

}  // namespace sage::sm90
