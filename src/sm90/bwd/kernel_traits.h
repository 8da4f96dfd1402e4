// The one place where the backward kernel's shape is decided (docs/numerics.md, "The backward",
// "Tiles"; docs/design.md, "The backward kernel"): 64 Q rows x 128 keys per tile, one CTA per
// (128-key K/V tile, query head) looping over the Q tiles, warp-specialized like the forward:
//   warpgroup 0   the producer: one thread streams the CTA's K/V tile once and each Q tile's
//                 operands through a ring of kStages stages with TMA;
//   warpgroups 1, 2   consumers: warpgroup c owns keys [64c, 64c + 64) of the tile for S^T,
//                 dP^T, dV and dK (m64 of every warpgroup MMA: keys are the MMA's m), and
//                 channels [c D/2, (c+1) D/2) of the tile's dQ.
// dV and dK stay in registers across the Q loop: 64 keys x D per warpgroup, D/2 + D/2 floats
// a thread (128 at d = 128), under the consumers' setmaxnreg budget of 240.
//
// Plain constexpr C++ (no CUDA headers), like fwd/kernel_traits.h: the host dispatch sizes the
// launch and the workspace from the same answers as the kernel.
#pragma once

#include "numerics/tile.h"

namespace sage::sm90::bwd {

constexpr int kBlockQ = 64;    // Q rows per backward tile (one dO / dS scale group)
constexpr int kBlockKV = 128;  // keys per CTA: the forward's K/V tile (its K and V scales)
constexpr int kConsumers = 2;  // consumer warpgroups, 64 keys each
constexpr int kKeysPerWarpgroup = kBlockKV / kConsumers;
constexpr int kThreads = 128 * (1 + kConsumers);
constexpr int kStages = 2;     // Q-tile ring depth (3 fits at d = 128 too: see smem_layout)
constexpr int kLaunchRegs = 65536 / kThreads / 8 * 8;  // 168
constexpr int kProducerRegs = 24;
constexpr int kConsumerRegs = (kLaunchRegs * kThreads - kProducerRegs * 128) / (128 * kConsumers) / 8 * 8;  // 240
static_assert(kKeysPerWarpgroup == 64, "one m64 warpgroup MMA of keys per consumer");
static_assert(kProducerRegs * 128 + kConsumerRegs * 128 * kConsumers <= kLaunchRegs * kThreads,
              "setmaxnreg budgets within the launch allocation");

// The pre-pass (prep.cuh) writes the 64-row tiles of the transposed operands Q^T and dO^T
// (dK's and dV's B, [channel][row]) with the rows of each 32-row k slice permuted, so that the
// A operand P^T (dS^T) can be taken straight from the S^T (dP^T) accumulator without a shuffle:
// an INT8 wgmma A register holds k = 4t .. 4t + 3 (+16 for a[2], a[3]) while the accumulator
// holds rows 8j + 2t, 8j + 2t + 1 of chunks j. The sum over k of exact s32 products does not
// depend on the order, so permuting both operands' k alike changes no bit.
// Column kp (0..31) of a slice holds row kp_row(kp) of the slice.
constexpr int kp_row(int kp) {
  return 8 * (2 * (kp >> 4) + ((kp & 3) >> 1)) + 2 * ((kp >> 2) & 3) + (kp & 1);
}
// The same for dQ's k axis (the tile's 128 keys): the dS tile is stored [row][key position]
// from the dS^T accumulator in 16-bit pairs (keys g and g + 8 of a warp's 16), and K^T
// [channel][key position] with the same order. Key position kp holds key kp_key(kp).
constexpr int kp_key(int kp) { return (kp & ~15) + ((kp & 15) >> 1) + 8 * (kp & 1); }

// backward_tile_config (numerics/tile.h) is the contract's; the kernel is built on it.
constexpr bool tiles_match_the_contract(int d) {
  return backward_tile_config(d).block_q == kBlockQ && backward_tile_config(d).block_kv == kBlockKV;
}

// dS's INT8 scales (the recipe's bwd_ds_granularity; docs/numerics.md, "The backward", step 7):
// per_block, one scale per 64 x 128 tile for both products; per_token, one per query row for
// dQ's codes and one per key for dK's (the tile quantized twice). A kernel template parameter:
// each has its instantiations (bwd/instantiate.cmake).
enum class DsGranularity : int { per_block, per_token };

// The first Q tile the CTA of the K/V tile at key j0 (< n_kv) runs: 0, or under the bottom-right
// causal mask the first whose last row sees a key of the tile (row i sees keys below
// i + n_kv - n_q + 1). It runs every tile from there to the last.
constexpr int first_q_tile(int j0, int n_q, int n_kv, bool causal) {
  const int first_row_seeing_j0 = j0 + n_q - n_kv;
  return causal && first_row_seeing_j0 > 0 ? first_row_seeing_j0 / kBlockQ : 0;
}

// The K/V tiles that add into Q tile t's dQ are 0 .. last_kv_tile(t): first_q_tile never
// decreases with the K/V tile, so they are a prefix. kv_tiles: the grid's K/V tiles (each with
// j0 < n_kv). Only meaningful for a t that some K/V tile runs (t >= first_q_tile(0, ...)).
constexpr int last_kv_tile(int t, int n_q, int n_kv, int kv_tiles, bool causal) {
  if (!causal) return kv_tiles - 1;
  // The largest j with first_q_tile(kBlockKV j) <= t: kBlockKV j + n_q - n_kv < kBlockQ (t + 1).
  const int last = (kBlockQ * (t + 1) + n_kv - n_q - 1) / kBlockKV;
  return last < kv_tiles - 1 ? last : kv_tiles - 1;
}

// Deterministic mode's order (order.cuh): the grid's blockIdx.x runs the K/V tiles in
// decreasing order, and K/V tile j adds its dQ of Q tile t at turn dq_turn (0 first): the K/V
// tiles that add there, highest first.
constexpr int kv_tile_of_block(int block_x, int kv_tiles, bool deterministic) {
  return deterministic ? kv_tiles - 1 - block_x : block_x;
}
constexpr int dq_turn(int t, int kv_tile, int n_q, int n_kv, int kv_tiles, bool causal) {
  return last_kv_tile(t, n_q, n_kv, kv_tiles, causal) - kv_tile;
}

// Whether the backward has a kernel at a head dim: 64 and 128 (K' rows of exactly D bytes in
// the forward's workspace, quant/kv_layout.h; dK and dV in registers). Others are refused by
// name (api/backward.cu).
constexpr bool backward_has_kernel(int d) { return d == 64 || d == 128; }

// Byte offsets of one CTA's shared memory. Every MMA operand is K-major and swizzled as TMA
// writes it and the wgmma descriptor reads it (1024-byte aligned tiles):
//   K' codes [128 keys][D]         D-byte rows: 128B swizzle at d = 128, 64B at d = 64
//   K'^T codes [D][128 key pos]    128B (built by the consumers from K', kp_key order)
//   V [128 keys][D] 16-bit         D / 64 column blocks of [128][64 elements], 128B
//   dS codes [64 rows][128 key pos]  128B (written by the consumers, dQ's A)
// and per stage:
//   Q codes [64][D]                as K'
//   Q^T codes [D][64 row pos]      64B (kp_row order)
//   dO [64][D] 16-bit              D / 64 column blocks of [64][64 elements], 128B
//   dO^T codes [D][64 row pos]     64B (kp_row order)
//   L2 [64], D [64] floats         the rows' base-2 log-sum and dO . O
struct StageLayout {
  int q8, qt8, dout, dot8, l2, delta, bytes;
};
struct SmemLayout {
  int k8, kt8, v, ds8;
  int dq;           // dQ's scaled fp32 tile [kBlockQ * D] in fragment order (dq_fragment_index),
                    // added to the workspace by one bulk reduce per Q tile
  StageLayout stage;
  int stages;       // offset of stage 0; stage s at stages + s * stage.bytes
  int red;          // [2 parities][kBlockQ] floats: the dS tile's amax (per_block: one per
                    // consumer warp; per_token: one per query row)
  int bars;         // full[kStages], empty[kStages], kv_full: uint64_t each
  int total;
};

constexpr int align1k(int x) { return (x + 1023) / 1024 * 1024; }

constexpr SmemLayout smem_layout(int d) {
  SmemLayout s{};
  int off = 0;
  auto take = [&off](int bytes) {
    const int at = off;
    off = align1k(off + bytes);
    return at;
  };
  s.k8 = take(kBlockKV * d);
  s.kt8 = take(d * kBlockKV);
  s.v = take(kBlockKV * d * 2);
  s.ds8 = take(kBlockQ * kBlockKV);
  s.dq = take(kBlockQ * d * 4);
  int st = 0;
  auto take_stage = [&st](int bytes, int align) {
    st = (st + align - 1) / align * align;
    const int at = st;
    st += bytes;
    return at;
  };
  s.stage.q8 = take_stage(kBlockQ * d, 1024);
  s.stage.qt8 = take_stage(d * kBlockQ, 1024);
  s.stage.dout = take_stage(kBlockQ * d * 2, 1024);
  s.stage.dot8 = take_stage(d * kBlockQ, 1024);
  s.stage.l2 = take_stage(kBlockQ * 4, 128);
  s.stage.delta = take_stage(kBlockQ * 4, 128);
  s.stage.bytes = align1k(st);
  s.stages = off;
  off += kStages * s.stage.bytes;
  s.red = take(2 * kBlockQ * 4);
  s.bars = off;
  off += (2 * kStages + 1) * 8;
  s.total = align1k(off);
  return s;
}
// dQ's fp32 accumulator in the workspace is tile-major, [bh][Q tile][kBlockQ * D], each tile in
// the order the consumer threads hold it, so that a thread's values are one 16-byte store per
// group of four into the shared-memory staging tile (a warp's stores 512 contiguous bytes, no
// bank conflict) and the tile goes to global memory as one contiguous bulk reduce; the
// finalize kernel reads it through this index. Thread ct = 128 c + 32 w + 4 g + t (warpgroup c,
// warp w, lane 4 g + t) holds dQ's accumulator value x (0 .. D/4 - 1) at row 16 w + g (+8 for
// x % 4 >= 2) and channel c D/2 + 8 (x / 4) + 2 t + (x & 1), stored at float
// (x / 4) * (4 * 128 * kConsumers) + 4 ct + x % 4.
constexpr int dq_fragment_index(int row, int ch, int d) {
  const int half = d / 2, c = ch / half, r = ch % half;
  const int w = row / 16, g = row % 8, upper = (row % 16) / 8;
  const int ct = 128 * c + 32 * w + 4 * g + (r % 8) / 2;
  return (r / 8) * (4 * 128 * kConsumers) + 4 * ct + 2 * upper + (r & 1);
}

// Bytes the producer's TMA writes per Q stage and once per CTA (the barriers' transactions).
constexpr int stage_tx_bytes(int d) { return 5 * kBlockQ * d + 2 * kBlockQ * 4; }
constexpr int kv_tx_bytes(int d) { return 3 * kBlockKV * d; }

static_assert(smem_layout(128).total <= 227 * 1024, "fits an H100 CTA");
static_assert(tiles_match_the_contract(64) && tiles_match_the_contract(128), "backward tiles");

}  // namespace sage::sm90::bwd
