// Kernel tile configuration and the group maps derived from it.
//
// Which tokens share one quantization scale is decided here, once, as a function of the
// tile shape the Hopper kernel uses. The quantization kernels, the attention kernel and the
// CPU simulator all call these functions, so a "per-thread" scale means the same set of
// tokens in all three.
//
// Why these maps (Hopper wgmma m64nNk32, one warpgroup = 4 warps owns 64 Q rows):
//  * The S accumulator gives lane l of warp w the rows 16w + l/4 and 16w + l/4 + 8 of its
//    64-row slice, so a per-thread Q group is those two rows: (row/16)*8 + row%8.
//  * The same lane holds the columns 8j + 2(l%4) + {0,1} for every j, so a per-thread K
//    group is the tokens whose index mod 8 is {0,1}, {2,3}, {4,5} or {6,7}: 4 per K tile.
//  * All four warps read the whole K tile, so per-warp K is per-block K.
#pragma once

#include <cstdint>

#include "numerics/config.h"
#include "sage/recipe.h"

namespace sage {

struct TileConfig {
  int block_q;   // Q rows per CTA tile (a multiple of 64: one or more warpgroups)
  int block_kv;  // K/V tokens per pipeline stage (the online-softmax block)
};

// Consumer warpgroups of 64 Q rows per CTA of the Hopper kernel. Three at d = 64, two at
// d = 128: the consumer warps' softmax waits on latency with two warps per scheduler (v18,
// docs/design.md), and at d = 64 the accumulators are small enough for a third warpgroup
// (160 registers each over 512 threads; FlashAttention-3 runs 192-row tiles there too). At
// d = 128, O, the PV product, S and P alone need ~210 registers.
// Ranges of head dims, so that every d shares its tile with kernel_head_dim(d); 96, 192 and 256
// take two (at 96 O, the PV product, S and P need ~180 registers, above the 160 of three).
constexpr SAGE_HD int consumer_warpgroups(int head_dim) { return head_dim <= 64 ? 3 : 2; }

// The head dim of the Hopper kernel that runs head dim d (issue 34): a head dim with no
// instantiated tile runs on the next one with zero channels inside the kernel (loads and stores
// bounded by d). What a kernel decides from its head dim and the numerics can see (the tile
// here, the row sum from the PV MMA, P's scale fold: quant_rules.h) is decided from this value,
// so the simulator at d models the kernel that really runs d. The tiles, one per range:
//   d <= 64: 64 (three consumer warpgroups), d <= 96: 96, d <= 128: 128, d <= 192: 192
//   (MLA's Q/K head dim), d <= 256: 256.
// sm90/fwd/kernel_traits.h instantiates these (SAGE_SUPPORTED_HEAD_DIMS) and static_asserts
// that each instantiated dim is a fixed point of this function.
constexpr SAGE_HD int kernel_head_dim(int head_dim) {
  return head_dim <= 64 ? 64 : head_dim <= 96 ? 96 : head_dim <= 128 ? 128 : head_dim <= 192 ? 192 : 256;
}

// The head dim a call's tile is chosen for (kernel_head_dim, tile_config, the rules above): one
// tile holds Q/K's channels (the QK product's depth) and V's (the PV product's width), so where
// V has a head dim of its own (MLA: 192 / 128) the larger one decides; the other tensor's
// channels are zero-padded in the kernel and the simulator alike.
constexpr SAGE_HD int call_head_dim(int64_t head_dim, int64_t head_dim_v) {
  return static_cast<int>(head_dim > head_dim_v ? head_dim : head_dim_v);
}

// One function decides the tiles, for every head dim and recipe.
constexpr SAGE_HD TileConfig tile_config(int head_dim) {
  return TileConfig{64 * consumer_warpgroups(head_dim), 128};
}

constexpr int kWarpRows = 16;        // Q rows per warp in a wgmma accumulator
constexpr int kQThreadGroupRows = 8; // rows r and r+8 of a warp slice share a thread
constexpr int kKThreadGroups = 4;    // per-thread K groups per K tile

SAGE_HD int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Number of scale groups over n tokens of Q, and the group of token t.
SAGE_HD int64_t q_group_count(Granularity g, int64_t n, TileConfig tc) {
  const int64_t blocks = ceil_div(n, tc.block_q);
  switch (g) {
    case Granularity::per_tensor: return 1;
    case Granularity::per_block: return blocks;
    case Granularity::per_warp: return blocks * (tc.block_q / kWarpRows);
    case Granularity::per_thread: return blocks * (tc.block_q / 2);
    case Granularity::per_token: return n;
    case Granularity::microscale: return n;  // per-token row; scales run along head_dim
  }
  return 0;
}

SAGE_HD int64_t q_group_of(Granularity g, int64_t t, TileConfig tc) {
  const int64_t b = t / tc.block_q;
  const int64_t r = t % tc.block_q;
  switch (g) {
    case Granularity::per_tensor: return 0;
    case Granularity::per_block: return b;
    case Granularity::per_warp: return b * (tc.block_q / kWarpRows) + r / kWarpRows;
    case Granularity::per_thread:
      return b * (tc.block_q / 2) + (r / kWarpRows) * kQThreadGroupRows + r % kQThreadGroupRows;
    case Granularity::per_token: return t;
    case Granularity::microscale: return t;
  }
  return 0;
}

SAGE_HD int64_t k_group_count(Granularity g, int64_t n, TileConfig tc) {
  const int64_t blocks = ceil_div(n, tc.block_kv);
  switch (g) {
    case Granularity::per_tensor: return 1;
    case Granularity::per_block: return blocks;
    case Granularity::per_warp: return blocks;
    case Granularity::per_thread: return blocks * kKThreadGroups;
    case Granularity::per_token: return n;
    case Granularity::microscale: return n;
  }
  return 0;
}

SAGE_HD int64_t k_group_of(Granularity g, int64_t t, TileConfig tc) {
  const int64_t b = t / tc.block_kv;
  const int64_t r = t % tc.block_kv;
  switch (g) {
    case Granularity::per_tensor: return 0;
    case Granularity::per_block: return b;
    case Granularity::per_warp: return b;
    case Granularity::per_thread: return b * kKThreadGroups + (r % 8) / 2;
    case Granularity::per_token: return t;
    case Granularity::microscale: return t;
  }
  return 0;
}

// Q smoothing subtracts one mean per Q tile: the tile index of token t.
SAGE_HD int64_t q_smooth_block_of(int64_t t, TileConfig tc) { return t / tc.block_q; }

// The tiles of the backward, one function for every head dim (as tile_config is for the
// forward). A Hopper backward in FlashAttention-3's style runs one CTA per K/V tile of
// block_kv keys, looping over Q tiles of block_q rows; INT8 P, dO and dS take one scale per
// such tile. block_kv is the forward's (tile_config(d).block_kv), so a per_block K or V scale
// of the forward is one scale per backward K/V tile. block_q is one warpgroup's 64 rows at
// every head dim (FlashAttention-3 takes 128 at d = 64): INT8 dK = dS^T Q sums over Q rows, so
// each backward Q tile must lie inside one Q scale group, and the forward's per_block groups
// (tile_config(d).block_q: 192 rows at d = 64, 128 at d = 128) are multiples of 64, not of 128.
struct BackwardTileConfig {
  int block_q;   // Q rows per backward tile
  int block_kv;  // K/V tokens per backward tile (one CTA's)
};
constexpr BackwardTileConfig backward_tile_config(int head_dim) {
  return BackwardTileConfig{64, tile_config(head_dim).block_kv};
}

}  // namespace sage
