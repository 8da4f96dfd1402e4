// The one place where the backward kernel's shape is decided (docs/numerics.md, "The backward",
// "Tiles"): 64 Q rows x 128 keys per tile at every head dim, one CTA per (K/V tile, query head)
// looping over the Q tiles, eight warps, and the shared-memory layout of one CTA.
//
// Plain constexpr C++ (no CUDA headers), like fwd/kernel_traits.h: the host dispatch sizes the
// launch and the workspace from the same answers as the kernel.
#pragma once

#include "numerics/tile.h"

namespace sage::sm90::bwd {

constexpr int kBlockQ = 64;    // Q rows per backward tile (one dO / dS scale group)
constexpr int kBlockKV = 128;  // keys per CTA: the forward's K/V tile (its K and V scales)
constexpr int kWarps = 8;      // warp w owns keys [16w, 16w + 16) for S^T, dP^T, dV and dK
constexpr int kThreads = 32 * kWarps;
static_assert(kBlockKV == 16 * kWarps, "one m16 slice of keys per warp");

// backward_tile_config (numerics/tile.h) is the contract's; the kernel is built on it.
constexpr bool tiles_match_the_contract(int d) {
  return backward_tile_config(d).block_q == kBlockQ && backward_tile_config(d).block_kv == kBlockKV;
}

// Byte offsets of one CTA's shared memory. Every matrix is stored with its MMA's k axis
// contiguous (row-major [m][k] for A, [n][k] for B), so that each fragment register is one
// aligned 32-bit load (int8: 4 codes; 16-bit: 2 values).
struct SmemLayout {
  int k8;     // [128 keys][D] int8: K' codes of the tile (S^T's A)
  int kt8;    // [D][128 keys] int8: the same, transposed (dQ's B)
  int v;      // [128 keys][D] 16-bit: V (dP^T's A)
  int q8;     // [64 rows][D] int8: Q codes (S^T's B)
  int qt8;    // [D][64 rows] int8 (dK's B)
  int dout;   // [64 rows][D] 16-bit: dO (dP^T's B)
  int dot8;   // [D][64 rows] int8: dO codes (dV's B)
  int pt8;    // [128 keys][64 rows] int8: P codes (dV's A)
  int dst8;   // [128 keys][64 rows] int8: dS codes (dK's A)
  int ds8;    // [64 rows][128 keys] int8: dS codes (dQ's A)
  int p_scale;  // [128] float: P's scale per key
  int l2;       // [64] float: the rows' L2
  int delta;    // [64] float: the rows' D
  int red;      // [kWarps] float: block reductions
  int dk;       // from d = 128: the warps' dK accumulators, [128 keys][D] float (accumulate.cuh)
  int total;
};

constexpr SmemLayout smem_layout(int d) {
  SmemLayout s{};
  int off = 0;
  auto take = [&off](int bytes) {
    const int at = off;
    off += (bytes + 127) / 128 * 128;
    return at;
  };
  s.k8 = take(kBlockKV * d);
  s.kt8 = take(kBlockKV * d);
  s.v = take(kBlockKV * d * 2);
  s.q8 = take(kBlockQ * d);
  s.qt8 = take(kBlockQ * d);
  s.dout = take(kBlockQ * d * 2);
  s.dot8 = take(kBlockQ * d);
  s.pt8 = take(kBlockKV * kBlockQ);
  s.dst8 = take(kBlockKV * kBlockQ);
  s.ds8 = take(kBlockKV * kBlockQ);
  s.p_scale = take(kBlockKV * 4);
  s.l2 = take(kBlockQ * 4);
  s.delta = take(kBlockQ * 4);
  s.red = take(kWarps * 4);
  s.dk = take(d >= 128 ? kBlockKV * d * 4 : 0);
  s.total = off;
  return s;
}
static_assert(smem_layout(128).total <= 227 * 1024, "fits an H100 CTA");
static_assert(tiles_match_the_contract(64) && tiles_match_the_contract(128), "backward tiles");

}  // namespace sage::sm90::bwd
