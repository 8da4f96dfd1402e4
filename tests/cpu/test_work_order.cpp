// The attention kernel's work order (src/sm90/fwd/tile_scheduler.h), checked on the host: every work
// item (a Q tile of a head) is run by exactly one CTA, no CTA runs more than its share, and
// the property each order is for holds: in the grouped order the CTAs of a round share a head
// (K/V served from L2), in the consecutive one each CTA runs consecutive items (a head's heavy
// and light tiles of a causal diagonal together), in the strided one the resident CTAs run
// consecutive units and, under a causal mask, carry the same K/V tiles to within one unit.
#include <gtest/gtest.h>

#include <algorithm>
#include <set>
#include <string>
#include <vector>

#include "sm90/fwd/tile_scheduler.h"

namespace sage::sm90 {
namespace {

struct Shape {
  int n_q_tiles, head_batches, per_cta;
};

const std::vector<Shape>& shapes() {
  static const std::vector<Shape> v = {
      {8, 1024, 8},  {16, 512, 4}, {32, 256, 2}, {128, 64, 1}, {8, 1024, 15},  // the grid's
      {1, 7, 3},     {3, 5, 2},    {4, 9, 16},   {9, 1, 5},    {2, 3, 1},      // odd ones
      {11, 40, 2},   {7, 3, 4},                                                // odd tile counts
  };
  return v;
}

// The schedule the launch would build, with `strided_ctas` CTAs (at most) in the strided order.
WorkSchedule schedule(const Shape& s, WorkOrder order, bool causal, int strided_ctas = 132) {
  WorkSchedule w{};
  w.n_q_tiles = s.n_q_tiles, w.head_batches = s.head_batches, w.per_cta = s.per_cta;
  w.order = order, w.causal = causal;
  if (order != WorkOrder::strided) {
    w.ctas = int(chunked_cta_count(w));
    return w;
  }
  const int units = int(strided_units(w));
  w.ctas = std::min(strided_ctas, units);
  w.per_cta = (units + w.ctas - 1) / w.ctas;
  return w;
}

std::string describe(const WorkSchedule& w) {
  const char* names[] = {"consecutive", "grouped", "strided"};
  return std::string(names[int(w.order)]) + (w.causal ? " causal " : " ") +
         std::to_string(w.n_q_tiles) + "x" + std::to_string(w.head_batches) + ", per CTA " +
         std::to_string(w.per_cta) + ", " + std::to_string(w.ctas) + " CTAs";
}

// The slots of every CTA, in its order.
std::vector<std::vector<int>> runs(const WorkSchedule& w) {
  std::vector<std::vector<int>> all;
  for (int c = 0; c < w.ctas; ++c) {
    std::vector<int> slots;
    const CtaSlots mine = cta_slots(w, c);
    for (int s = mine.begin; s < mine.end; s += slot_step(w)) slots.push_back(s);
    all.push_back(slots);
  }
  return all;
}

std::vector<WorkSchedule> every_schedule() {
  std::vector<WorkSchedule> v;
  for (const Shape& s : shapes())
    for (bool causal : {false, true}) {
      for (WorkOrder order : {WorkOrder::consecutive, WorkOrder::grouped, WorkOrder::strided})
        v.push_back(schedule(s, order, causal));
      // Fewer CTAs than units, and units that the CTAs do not divide.
      v.push_back(schedule(s, WorkOrder::strided, causal, 5));
    }
  return v;
}

TEST(WorkOrder, EveryItemOnceAndNoCtaOverItsShare) {
  for (const WorkSchedule& w : every_schedule()) {
    const int items = w.n_q_tiles * w.head_batches;
    std::vector<int> seen(static_cast<size_t>(items), 0);
    const bool pairs = w.order == WorkOrder::strided && w.causal;
    const int most = pairs ? 2 * w.per_cta : w.per_cta;
    for (const std::vector<int>& mine : runs(w)) {
      EXPECT_LE(static_cast<int>(mine.size()), most) << describe(w);
      for (int slot : mine) {
        const WorkItemRef item = item_at(w, slot);
        ASSERT_GE(item.hb, 0) << describe(w);
        ASSERT_LT(item.hb, w.head_batches) << describe(w);
        ASSERT_GE(item.q_tile, 0) << describe(w);
        ASSERT_LT(item.q_tile, w.n_q_tiles) << describe(w);
        ++seen[static_cast<size_t>(item.hb * w.n_q_tiles + item.q_tile)];
      }
    }
    for (int i = 0; i < items; ++i)
      ASSERT_EQ(seen[static_cast<size_t>(i)], 1) << "item " << i << ", " << describe(w);
  }
}

// No CTA of the grid is idle, except in the chunked orders' last, partial group of heads.
TEST(WorkOrder, GridHasNoEmptyCta) {
  for (const WorkSchedule& w : every_schedule()) {
    if (w.order != WorkOrder::strided && w.head_batches % w.per_cta != 0) continue;
    for (const std::vector<int>& mine : runs(w)) EXPECT_FALSE(mine.empty()) << describe(w);
  }
}

// Under a causal mask, a head's Q tiles come heaviest first in the chunked orders (the diagonal's
// far end has the most K/V tiles), so that a CTA's last items are its lightest.
TEST(WorkOrder, ChunkedCausalTilesHeaviestFirst) {
  for (const Shape& s : shapes()) {
    const WorkSchedule w = schedule(s, WorkOrder::consecutive, true);
    for (int q = 0; q < s.n_q_tiles; ++q) EXPECT_EQ(item_at(w, q).q_tile, s.n_q_tiles - 1 - q);
  }
}

// In the grouped order, round r of the CTAs of a group runs the Q tiles of one head, all of
// them: the heads in flight are as few as the groups (d = 128, N = 1K: 132 resident CTAs, 17
// heads, where the consecutive order had 132).
TEST(WorkOrder, GroupedRoundsOfAGroupShareOneHead) {
  for (const Shape& s : shapes()) {
    const WorkSchedule w = schedule(s, WorkOrder::grouped, false);
    const std::vector<std::vector<int>> all = runs(w);
    for (size_t g = 0; g * s.n_q_tiles < all.size(); ++g)
      for (int r = 0; r < s.per_cta; ++r) {
        std::set<int> heads, tiles;
        for (int j = 0; j < s.n_q_tiles; ++j) {
          const std::vector<int>& mine = all[g * s.n_q_tiles + j];
          if (r >= static_cast<int>(mine.size())) continue;
          const WorkItemRef item = item_at(w, mine[static_cast<size_t>(r)]);
          heads.insert(item.hb);
          tiles.insert(item.q_tile);
        }
        if (heads.empty()) continue;
        EXPECT_EQ(heads.size(), 1u) << "group " << g << " round " << r;
        EXPECT_EQ(static_cast<int>(tiles.size()), s.n_q_tiles) << "group " << g << " round " << r;
      }
  }
}

// In the consecutive order a CTA runs consecutive items.
TEST(WorkOrder, ConsecutiveCtasRunConsecutiveItems) {
  for (const Shape& s : shapes()) {
    const WorkSchedule w = schedule(s, WorkOrder::consecutive, false);
    int c = 0;
    for (const std::vector<int>& mine : runs(w)) {
      for (size_t i = 0; i < mine.size(); ++i) {
        const WorkItemRef item = item_at(w, mine[i]);
        EXPECT_EQ(item.hb * s.n_q_tiles + item.q_tile, c * s.per_cta + static_cast<int>(i));
      }
      ++c;
    }
  }
}

// In the strided order round r of the CTAs runs units r * ctas .. r * ctas + ctas - 1 (CTA c
// the (c + 1)-th of them): the resident CTAs cover a window of consecutive units, so few heads.
TEST(WorkOrder, StridedRoundsRunConsecutiveUnits) {
  for (const WorkSchedule& w : every_schedule()) {
    if (w.order != WorkOrder::strided) continue;
    const std::vector<std::vector<int>> all = runs(w);
    for (int c = 0; c < w.ctas; ++c) {
      int previous_unit = -1, round = -1;
      for (int slot : all[static_cast<size_t>(c)]) {
        const int unit = w.causal ? slot / w.ctas / 2 * w.ctas + slot % w.ctas : slot;
        if (unit != previous_unit) ++round;
        EXPECT_EQ(unit, c + round * w.ctas) << describe(w) << ", CTA " << c;
        previous_unit = unit;
      }
    }
  }
}

// Under a causal mask (Q tile q of n_q = n_kv tokens needs q + 1 K/V tiles when Q and K/V
// tiles are the same size) the strided order's units carry n_q_tiles + 1 tiles each (a last,
// odd head's middle tile alone half of that): every CTA's total is within one unit of every
// other's, and a CTA runs a unit's heavy tile first (or, for two middle tiles, the first
// head's).
TEST(WorkOrder, StridedCausalCtasCarryEqualWork) {
  for (const WorkSchedule& w : every_schedule()) {
    if (w.order != WorkOrder::strided || !w.causal) continue;
    int lightest = 1 << 30, heaviest = 0;
    for (const std::vector<int>& mine : runs(w)) {
      int tiles = 0;
      for (size_t i = 0; i < mine.size(); ++i) {
        const WorkItemRef item = item_at(w, mine[i]);
        tiles += item.q_tile + 1;
        if (i % 2 == 1) {  // the unit's second tile; its first came just before
          const WorkItemRef heavy = item_at(w, mine[i - 1]);
          EXPECT_EQ(heavy.q_tile + item.q_tile, w.n_q_tiles - 1) << describe(w);
          if (heavy.q_tile == item.q_tile) {
            EXPECT_EQ(heavy.hb + 1, item.hb) << describe(w);
          } else {
            EXPECT_EQ(heavy.hb, item.hb) << describe(w);
            EXPECT_GT(heavy.q_tile, item.q_tile) << describe(w);
          }
        }
      }
      lightest = std::min(lightest, tiles);
      heaviest = std::max(heaviest, tiles);
    }
    EXPECT_LE(heaviest - lightest, w.n_q_tiles + 1) << describe(w);
  }
}

}  // namespace
}  // namespace sage::sm90
