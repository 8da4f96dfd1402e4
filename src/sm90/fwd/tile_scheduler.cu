#include "sm90/fwd/tile_scheduler.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>

#include "sage/error.h"
#include "sm90/fwd/tma_maps.h"

namespace sage::sm90 {
namespace {

// Each CTA pays a prologue (Q load and quantization, the first K/V round trip through TMA)
// and an epilogue (normalization, stores) that its own tiles cannot hide, and one CTA fits
// per SM, so another CTA does not hide them either: at N = 1K (8 K/V tiles per Q tile) they
// took as long as the tiles (ncu, H100, v8, docs/performance.md). Chained items save the
// CTA exit and launch and the first K/V round trip of every item but the first (the producer
// loads the next item's tiles during the epilogue). A CTA takes items until it has about this
// many K/V tiles. Measured (H100, same-run A/B, docs/performance.md v11): +4-6% whole call at
// d = 64, N = 1K-2K; within 2% either way at d = 128. Targets of 48 and 72 measured within
// 2% of 64, going opposite ways at d = 64 and d = 128; 96 (5.2 waves at 1K) lost 7% at d = 128
// (v12 A/B, bench/results/h100_v12_ab_2026-11-23.md).
constexpr int kDefaultCtaTiles = 64;
// Under a causal mask items carry 1 to n_q_tiles K/V tiles and each pays the same prologue
// and epilogue: fewer per CTA (more CTAs, more waves) even them out. Measured (H200, same-run
// A/B, bench/results/h200_v18_ab_2026-11-24.md section 4): targets 16 and 32 against 64, causal
// whole call at N = 1K / 2K / 4K: d = 128 +7% / +4% / +2% (16), +9% / +3% / +1% (32); d = 64
// +9% / +6% / +3% (16), +8% / +4% / +3% (32). Non-causal launches lost up to 2.4% at d = 64,
// N <= 2K with either, so they keep 64.
constexpr int kDefaultCausalCtaTiles = 16;
// ... but the grid keeps at least this many waves of CTAs, so that the hardware's dynamic
// scheduling still evens out uneven (causal) items and the last wave stays short.
constexpr int kMinWaves = 4;

// Tests' overrides (set_schedule_overrides). One mutex-free copy: tests set them between
// launches, never during one.
std::atomic<int> g_items_override{0};
std::atomic<WorkOrderOverride> g_order_override{WorkOrderOverride::automatic};
std::atomic<QStageOverride> g_q_stage_override{QStageOverride::automatic};
std::atomic<int64_t> g_q_stage_launches{0};

// K/V tiles of an average work item: all of them, or about half under a causal mask.
int average_item_tiles(const AttentionParams& p) {
  const int kv_tiles = (p.n_kv + kBlockKV - 1) / kBlockKV;
  return std::max(1, p.causal ? (kv_tiles + 1) / 2 : kv_tiles);
}

int cta_tiles_target(bool causal) { return causal ? kDefaultCausalCtaTiles : kDefaultCtaTiles; }

// One of the current device's attributes, looked up once per device: this runs on every
// attention call, whose host time is part of what users measure (docs/performance.md).
template <cudaDeviceAttr kAttribute>
int device_attribute(const char* what) {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> known[kMaxDevices] = {};
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) throw_cuda("cudaGetDevice", err);
  if (device < kMaxDevices)
    if (const int value = known[device].load(std::memory_order_relaxed); value > 0) return value;
  int value = 0;
  err = cudaDeviceGetAttribute(&value, kAttribute, device);
  if (err != cudaSuccess) throw_cuda(what, err);
  if (device < kMaxDevices) known[device].store(value, std::memory_order_relaxed);
  return value;
}
int sm_count() { return device_attribute<cudaDevAttrMultiProcessorCount>("multiprocessor count"); }
int l2_bytes() { return device_attribute<cudaDevAttrL2CacheSize>("L2 cache size"); }

// The causal launches that take the strided order (automatic_order), by their average K/V
// tiles per item: at most this many at d = 128, at least this many at d = 64.
constexpr int kStridedCausalMaxTiles128 = 16;
constexpr int kStridedCausalMinTiles64 = 5;

// Items per CTA in the consecutive and grouped orders.
int chunked_items_per_cta(const AttentionParams& p) {
  if (const int forced = g_items_override.load(); forced > 0) return forced;
  const int target = cta_tiles_target(p.causal);
  const int64_t items = int64_t(p.n_q_tiles) * p.heads_q * p.batch;
  const int per_item = average_item_tiles(p);
  const int64_t by_tiles = std::max(1, target / per_item);
  const int64_t by_waves = std::max<int64_t>(1, items / (int64_t(kMinWaves) * sm_count()));
  return int(std::min(by_tiles, by_waves));
}

// The consecutive order (tile_scheduler.h) keeps a head's Q tiles on one CTA, which then re-reads
// the head's K/V from L2 for each of them, if it is still there: the CTAs resident together
// work on up to one head each. When their heads' K/V exceeds half the L2, the grouped order
// (a head's Q tiles on resident CTAs side by side) is taken. Measured (H100, 50 MB L2, 132
// SMs, same-run A/B, docs/performance.md v13): d = 128, N = 1K (35 MB): grouped +6% kernel
// only (+4% whole call); d = 64, N = 1K (17 MB): grouped -3% kernel only, so consecutive
// stays; N >= 4K (a few heads in flight either way): within 1%. Causal launches keep the
// consecutive order, which balances the diagonal's uneven items.
bool chunked_grouped(const AttentionParams& p, int per_cta, int head_dim, int v_bytes) {
  if (p.causal) return false;
  const int64_t resident_ctas = sm_count();
  const int64_t heads_in_flight = std::min<int64_t>(
      resident_ctas, std::max<int64_t>(1, resident_ctas * per_cta / p.n_q_tiles));
  const int64_t head_kv_bytes = int64_t(p.n_pad) * head_dim * (1 + v_bytes);  // INT8 K, V
  return heads_in_flight * head_kv_bytes > l2_bytes() / 2;
}

// The strided order (one CTA per SM, each paying a CTA's first item once) against the
// chunked ones, kernel alone, same-run A/B (H200, bench/results/h200_v28_ab_2026-11-25.md):
// d = 128 +2.9% / +3.6% / +0.6% / -0.3% at N = 1K / 2K / 4K / 16K, causal +5.3% / +6.6% /
// +4.4% / -1.9%; d = 64 +0.7% .. +2.4%, causal -4.0% / +0.5% / +2.2% / +1.6%. Its units run to
// the end with no dynamic scheduling to even out the last round (up to ~3% of the kernel where
// CTAs run 23-31 units, as in both losses), so the chunked orders keep the causal launches
// where it lost: long items at d = 128 (more than 16 K/V tiles on average: no Q stage, so little
// to save on first items) and the shortest at d = 64 (4 or fewer).
WorkOrder automatic_order(const AttentionParams& p, int per_cta, int head_dim, int v_bytes) {
  const int tiles = average_item_tiles(p);
  const bool chunked_wins =
      p.causal && (head_dim <= 64 ? tiles < kStridedCausalMinTiles64 : tiles > kStridedCausalMaxTiles128);
  if (!chunked_wins) return WorkOrder::strided;
  return chunked_grouped(p, per_cta, head_dim, v_bytes) ? WorkOrder::grouped : WorkOrder::consecutive;
}

}  // namespace

WorkSchedule work_schedule(const AttentionParams& p, int head_dim, int v_bytes) {
  WorkSchedule s{};
  s.n_q_tiles = p.n_q_tiles;
  s.head_batches = p.heads_q * p.batch;
  s.causal = p.causal;
  const int per_cta = chunked_items_per_cta(p);
  switch (g_order_override.load()) {
    case WorkOrderOverride::consecutive: s.order = WorkOrder::consecutive; break;
    case WorkOrderOverride::grouped: s.order = WorkOrder::grouped; break;
    case WorkOrderOverride::strided: s.order = WorkOrder::strided; break;
    case WorkOrderOverride::automatic: s.order = automatic_order(p, per_cta, head_dim, v_bytes); break;
  }
  if (s.order == WorkOrder::strided) {
    const int64_t units = strided_units(s);
    int64_t ctas = std::min<int64_t>(sm_count(), units);
    if (const int forced = g_items_override.load(); forced > 0) {
      const int items_per_unit = s.causal && s.n_q_tiles > 1 ? 2 : 1;
      const int64_t units_per_cta = std::max(1, forced / items_per_unit);
      ctas = (units + units_per_cta - 1) / units_per_cta;
    }
    s.ctas = int(std::max<int64_t>(1, ctas));
    s.per_cta = int((units + s.ctas - 1) / s.ctas);  // units
    return s;
  }
  s.per_cta = per_cta;
  s.ctas = int(chunked_cta_count(s));
  return s;
}

int items_per_cta(const WorkSchedule& s) {
  if (s.order != WorkOrder::strided) return s.per_cta;
  return s.per_cta * (s.causal && s.n_q_tiles > 1 ? 2 : 1);
}


// The stage saves each chained item its Q prologue, a fixed cost, while the staged kernel runs
// its K/V tiles 1-2% slower (h200_v23_ab_2026-11-24.md, section 3: d = 128, N = 4K, two items of
// 32 tiles per CTA, -1.0% kernel; d = 64, N = 2K / 4K, -0.6% / -2.3%). So it is taken for short
// items only: at most 16 K/V tiles per average item at d = 128 (N = 1K / 2K: +7.0% / +2.7%
// kernel, causal +6.9% / +3.2%) and 8 at d = 64 (N = 1K: +3.1%).
constexpr int kQStageMaxItemTiles128 = 16;
constexpr int kQStageMaxItemTiles64 = 8;

bool use_q_stage(const AttentionParams& p, bool capable, int head_dim) {
  const bool short_items =
      average_item_tiles(p) <= (head_dim <= 64 ? kQStageMaxItemTiles64 : kQStageMaxItemTiles128);
  // One item per CTA leaves the stage nothing to do (it starts at a CTA's second item).
  const bool possible = capable && items_per_cta(p.work) > 1 && p.q_scale == nullptr && !p.smooth_q &&
                        (p.q_granularity == Granularity::per_thread ||
                         p.q_granularity == Granularity::per_token) &&
                        !(p.lse != nullptr && p.smooth_k) && q_tma_compatible(p);
  if (!possible) return false;
  switch (g_q_stage_override.load()) {
    case QStageOverride::off: return false;
    case QStageOverride::on: return true;
    case QStageOverride::automatic: break;
  }
  return short_items;
}

bool take_q_stage(const AttentionParams& p, bool capable, int head_dim) {
  const bool take = use_q_stage(p, capable, head_dim);
  if (take) g_q_stage_launches.fetch_add(1, std::memory_order_relaxed);
  return take;
}

int64_t q_stage_launches() { return g_q_stage_launches.load(); }

void set_schedule_overrides(const ScheduleOverrides& o) {
  g_items_override.store(std::max(0, o.items_per_cta));
  g_order_override.store(o.order);
  g_q_stage_override.store(o.q_stage);
}

ScheduleOverrides schedule_overrides() {
  return {g_items_override.load(), g_order_override.load(), g_q_stage_override.load()};
}

}  // namespace sage::sm90
