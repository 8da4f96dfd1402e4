#include "sm90/fwd/tile_scheduler.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>

#include "numerics/mask.h"
#include "numerics/tile.h"
#include "sage/error.h"
#include "sm90/fwd/tma_maps.h"

namespace sage::sm90 {
namespace {

// Each CTA pays a prologue (Q, the first K/V round trip) and an epilogue that its own tiles
// cannot hide; chained items pay them once per CTA. A CTA takes items until it has about this
// many K/V tiles (v11-v12 in docs/history/README.md).
constexpr int kDefaultCtaTiles = 64;
// Causal items carry 1 to n_q_tiles K/V tiles each: fewer per CTA even them out (v18).
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

// K/V tiles of an average work item: all of them, or about half under a causal mask; under
// a window, the mean of what its items visit (Mask::kv_tiles), so that the choices below
// follow the window rather than N.
int average_item_tiles(const AttentionParams& p, int head_dim) {
  const int kv_tiles = (p.n_kv + kBlockKV - 1) / kBlockKV;
  if (p.window_left < 0 && p.window_right <= 0)
    return std::max(1, p.causal ? (kv_tiles + 1) / 2 : kv_tiles);
  const int block_q = tile_config(head_dim).block_q;
  int64_t tiles = 0;
  for (int q0 = 0; q0 < p.n_q; q0 += block_q) {
    const TileRange r = visible_tiles<int>(q0, std::min(q0 + block_q, p.n_q), p.n_q, p.n_kv,
                                           p.window_left, p.window_right, kBlockKV);
    tiles += r.end - r.begin;
  }
  return int(std::max<int64_t>(1, tiles / std::max(1, p.n_q_tiles)));
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
int chunked_items_per_cta(const AttentionParams& p, int head_dim) {
  if (const int forced = g_items_override.load(); forced > 0) return forced;
  const int target = cta_tiles_target(p.causal);
  const int64_t items = int64_t(p.n_q_tiles) * p.heads_q * p.batch;
  const int per_item = average_item_tiles(p, head_dim);
  const int64_t by_tiles = std::max(1, target / per_item);
  const int64_t by_waves = std::max<int64_t>(1, items / (int64_t(kMinWaves) * sm_count()));
  return int(std::min(by_tiles, by_waves));
}

// The consecutive order re-reads a head's K/V from L2 for each of its Q tiles, if it is still
// there: when the resident CTAs' heads' K/V exceeds half the L2, the grouped order (a head's Q
// tiles on resident CTAs side by side) is taken. Causal launches keep the consecutive order,
// which balances the diagonal's uneven items (v13).
bool chunked_grouped(const AttentionParams& p, int per_cta, int head_dim, int v_bytes) {
  if (p.causal) return false;
  const int64_t resident_ctas = sm_count();
  const int64_t heads_in_flight = std::min<int64_t>(
      resident_ctas, std::max<int64_t>(1, resident_ctas * per_cta / p.n_q_tiles));
  const int64_t head_kv_bytes = int64_t(p.n_pad) * head_dim * (1 + v_bytes);  // INT8 K, V
  return heads_in_flight * head_kv_bytes > l2_bytes() / 2;
}

// The strided order (one CTA per SM, each paying a CTA's first item once) wins except where
// its units, run to the end with no dynamic scheduling, leave an uneven last round: causal
// launches with long items at d = 128 and the shortest at d = 64 keep the chunked orders (v28).
WorkOrder automatic_order(const AttentionParams& p, int per_cta, int head_dim, int v_bytes) {
  const int tiles = average_item_tiles(p, head_dim);
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
  const int per_cta = chunked_items_per_cta(p, head_dim);
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

// The Q stage saves each chained item its Q prologue, a fixed cost, while the staged kernel
// runs its K/V tiles 1-2% slower: it is taken for short items only (v23).
constexpr int kQStageMaxItemTiles128 = 16;
constexpr int kQStageMaxItemTiles64 = 8;

bool use_q_stage(const AttentionParams& p, bool capable, int head_dim) {
  const bool short_items =
      average_item_tiles(p, head_dim) <= (head_dim <= 64 ? kQStageMaxItemTiles64 : kQStageMaxItemTiles128);
  // One item per CTA leaves the stage nothing to do (it starts at a CTA's second item).
  // The left-window instantiation has no stage (kernel_config.cuh, kLeftWindow).
  const bool possible = capable && p.window_left < 0 && items_per_cta(p.work) > 1 &&
                        p.q_scale == nullptr && !p.smooth_q &&
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
