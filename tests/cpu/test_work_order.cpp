// The attention kernel's work order (src/sm90/work_order.h), checked on the host: every work
// item is run by exactly one CTA, no CTA runs more than items_per_cta, the grid has the CTAs
// the order needs, and the property each order is for holds: in the grouped order the CTAs of
// a round share a head (K/V served from L2), in the consecutive one each CTA runs consecutive
// items (a head's heavy and light tiles of a causal diagonal together).
#include <gtest/gtest.h>

#include <set>
#include <vector>

#include "sm90/work_order.h"

namespace sage::sm90 {
namespace {

struct Shape {
  int n_q_tiles, head_batches, per_cta;
};

// The items of every CTA, in its order.
std::vector<std::vector<int>> runs(const Shape& s, bool grouped) {
  std::vector<std::vector<int>> all;
  const int64_t ctas = cta_count(s.n_q_tiles, s.head_batches, s.per_cta, grouped);
  for (int c = 0; c < ctas; ++c) {
    const CtaItems mine = cta_items(s.n_q_tiles, s.head_batches, s.per_cta, grouped, c);
    std::vector<int> items;
    for (int w = mine.begin; w < mine.end; w += item_step(s.n_q_tiles, grouped)) items.push_back(w);
    all.push_back(items);
  }
  return all;
}

const std::vector<Shape>& shapes() {
  static const std::vector<Shape> v = {
      {8, 1024, 8},  {16, 512, 4}, {32, 256, 2}, {128, 64, 1}, {8, 1024, 15},  // the grid's
      {1, 7, 3},     {3, 5, 2},    {4, 9, 16},   {9, 1, 5},    {2, 3, 1},      // odd ones
  };
  return v;
}

TEST(WorkOrder, EveryItemOnceAndAtMostPerCtaItemsPerCta) {
  for (bool grouped : {false, true})
    for (const Shape& s : shapes()) {
      const int items = s.n_q_tiles * s.head_batches;
      std::vector<int> seen(static_cast<size_t>(items), 0);
      for (const std::vector<int>& mine : runs(s, grouped)) {
        EXPECT_LE(static_cast<int>(mine.size()), s.per_cta);
        for (int w : mine) {
          ASSERT_GE(w, 0);
          ASSERT_LT(w, items);
          ++seen[static_cast<size_t>(w)];
        }
      }
      for (int w = 0; w < items; ++w)
        ASSERT_EQ(seen[static_cast<size_t>(w)], 1)
            << "item " << w << " grouped " << grouped << " shape " << s.n_q_tiles << "x"
            << s.head_batches << " per CTA " << s.per_cta;
    }
}

// No CTA of the grid is idle except in a last, partial group of heads.
TEST(WorkOrder, GridHasNoEmptyCtaWhenTheHeadsDivide) {
  for (bool grouped : {false, true})
    for (const Shape& s : shapes()) {
      if (s.head_batches % s.per_cta != 0) continue;
      for (const std::vector<int>& mine : runs(s, grouped)) EXPECT_FALSE(mine.empty());
    }
}

// In the grouped order, round r of the CTAs of a group runs the Q tiles of one head, all of
// them: the heads in flight are as few as the groups (d = 128, N = 1K: 132 resident CTAs, 17
// heads, where the consecutive order had 132).
TEST(WorkOrder, GroupedRoundsOfAGroupShareOneHead) {
  for (const Shape& s : shapes()) {
    const std::vector<std::vector<int>> all = runs(s, true);
    for (size_t g = 0; g * s.n_q_tiles < all.size(); ++g)
      for (int r = 0; r < s.per_cta; ++r) {
        std::set<int> heads, tiles;
        for (int j = 0; j < s.n_q_tiles; ++j) {
          const std::vector<int>& mine = all[g * s.n_q_tiles + j];
          if (r >= static_cast<int>(mine.size())) continue;
          heads.insert(mine[static_cast<size_t>(r)] / s.n_q_tiles);
          tiles.insert(mine[static_cast<size_t>(r)] % s.n_q_tiles);
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
    int c = 0;
    for (const std::vector<int>& mine : runs(s, false)) {
      for (size_t i = 0; i < mine.size(); ++i)
        EXPECT_EQ(mine[i], c * s.per_cta + static_cast<int>(i));
      ++c;
    }
  }
}

}  // namespace
}  // namespace sage::sm90
