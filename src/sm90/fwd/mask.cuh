// Which keys each Q row sees (numerics/mask.h, docs/numerics.md step 5): none masked, or a
// window aligned bottom-right, row i seeing keys i + off - left .. i + off + right with
// off = n_kv - n_q and -1 an unbounded side; causal is right = 0 (the dispatch folds it in and
// normalizes the bounds: AttentionParams::window_left/right). Keys past n_kv are masked in
// every case (the last tile's padding).
//
// The window decides which K/V tiles an item visits at all (kv_tiles: the producer loads and
// the mainloop computes only those), and inside a visited tile which entries are masked
// (apply, only on tiles that tile_needs_mask: every other tile runs the loop unmasked).
#pragma once

#include <climits>
#include <cmath>

#include "numerics/mask.h"
#include "sm90/fwd/params.h"
#include "sm90/mma/fragment.cuh"

namespace sage::sm90 {

// The K/V tiles [begin, end) of one work item.
struct KvTiles {
  int begin, end;
};

// The lengths come from the parameter block at each use rather than from copies: kept in
// registers through the K/V loop, copies cost the loop's register budget (SASS).
// kVarlen (a packed variable-length batch): every item has its sequence's lengths, and the
// K/V loop holds none of them in registers: each tile reads the warpgroup's first tile that
// may need a mask (and a left window's first tile that needs none) from the warp's slot of a
// small static shared array (set_rows), and the masked tiles read n_kv and the diagonal from
// it (set_lengths). Held in registers through the loop, they cost spill reloads in every
// tile at d = 128 (SASS: one per tile in sage2_8b's kernel, ten in sage2_4b's).
constexpr int kMaxWarpsPerCta = 16;  // 512 threads: at most 3 consumer warpgroups
__shared__ int varlen_mask_slot[kMaxWarpsPerCta][4];  // {n_kv, n_kv - n_q, left_end, first_masked}

template <bool kVarlen = false>
struct MaskOf {
  const AttentionParams& p;
  int diagonal_;  // n_kv - n_q: row i's own key under bottom-right alignment
  int seq_n_q = 0, seq_n_kv = 0;  // kVarlen: the item's sequence's (prologue)

  __device__ __forceinline__ explicit MaskOf(const AttentionParams& p_)
      : p(p_), diagonal_(p_.n_kv - p_.n_q) {}

  // kWholeWarp: every lane of the warp calls it with the same lengths (the consumers, whose
  // K/V loop reads the slot); else one thread alone, which only asks for kv_tiles (the
  // producer).
  template <bool kWholeWarp = true>
  __device__ __forceinline__ void set_lengths(int n_q_, int n_kv_) {
    static_assert(kVarlen, "dense items have the parameter block's lengths");
    seq_n_q = n_q_, seq_n_kv = n_kv_, diagonal_ = n_kv_ - n_q_;
    if constexpr (kWholeWarp) {
      __syncwarp();  // every lane is done with the last item's
      int* slot = varlen_mask_slot[threadIdx.x / 32];
      slot[0] = n_kv_, slot[1] = n_kv_ - n_q_;
      __syncwarp();
    }
  }
  // The tiles of the 64 rows from row0 that may need a mask (tile_needs_mask): from
  // first_masked on (past n_kv or past row0's last key), and below left_end (kLeft: before
  // row0 + 63's first key). Arithmetic shifts: floors also below 0.
  __device__ __forceinline__ void set_rows(int row0) {
    static_assert(kVarlen, "dense items test the parameter block's lengths per tile");
    int first_masked = seq_n_kv >> 7;
    if (p.window_right >= 0) first_masked = min(first_masked, (row0 + diagonal_ + p.window_right + 1) >> 7);
    // In the warp's slot too, not in registers: one more register through the loop cost the
    // Q-smoothing kernel at d = 128 spill reloads in every tile (SASS).
    __syncwarp();
    int* slot = varlen_mask_slot[threadIdx.x / 32];
    slot[3] = first_masked;
    if (p.window_left >= 0) slot[2] = (row0 + 63 + diagonal_ - p.window_left + kBlockKV - 1) >> 7;
    __syncwarp();
    static_assert(kBlockKV == 128, "the shifts above");
  }
  __device__ __forceinline__ int n_q() const {
    if constexpr (kVarlen) return seq_n_q;
    else return p.n_q;
  }
  __device__ __forceinline__ int n_kv() const {
    if constexpr (kVarlen) return seq_n_kv;
    else return p.n_kv;
  }
  __device__ __forceinline__ int diagonal() const { return diagonal_; }
  // In the K/V loop (masked tiles only).
  __device__ __forceinline__ int loop_n_kv() const {
    if constexpr (kVarlen) return varlen_mask_slot[threadIdx.x / 32][0];
    else return p.n_kv;
  }
  __device__ __forceinline__ int loop_diagonal() const {
    if constexpr (kVarlen) return varlen_mask_slot[threadIdx.x / 32][1];
    else return diagonal_;
  }

  // The K/V tiles the Q tile of BlockQ rows starting at q0 visits: from the tile of its first
  // row's first key to the tile of its last row's last key (the last one partly). kLeft: the
  // launch has a left window (kernel_config.cuh, kLeftWindow); without one the first is 0.
  template <int BlockQ, bool kLeft>
  __device__ __forceinline__ KvTiles kv_tiles(int q0) const {
    const int row_end = min(q0 + BlockQ, n_q());
    if constexpr (kLeft) {
      const TileRange r = visible_tiles<int>(q0, row_end, n_q(), n_kv(), p.window_left,
                                             p.window_right, kBlockKV);
      return {r.begin, r.end};
    } else {
      const int end_key = end_visible_key<int>(row_end - 1, n_q(), n_kv(), p.window_right);
      return {0, (end_key + kBlockKV - 1) / kBlockKV};
    }
  }

  // Whether any entry of tile it may be masked for the 64 rows from row0: the tile reaches
  // past n_kv, past row0's last key, or (kLeft: the launch has a left window) before
  // row0 + 63's first key.
  template <bool kLeft>
  __device__ __forceinline__ bool tile_needs_mask(int it, int row0) const {
    if constexpr (kVarlen) {
      const int* slot = varlen_mask_slot[threadIdx.x / 32];
      return it >= slot[3] || (kLeft && it < slot[2]);
    }
    const int kv0 = it * kBlockKV;
    return kv0 + kBlockKV > n_kv() ||
           (p.window_right >= 0 && kv0 + kBlockKV - 1 > row0 + diagonal() + p.window_right) ||
           (kLeft && kv0 < row0 + 63 + diagonal() - p.window_left);
  }

  // Entry i of tile it is masked iff its column offset from this thread's first column,
  // 8 (i / 4) + i % 2 (a constant once unrolled), reaches the row's end limit or (kLeft) lies
  // below its begin limit: one compare per entry against two registers per limit. (Column
  // and row tests per entry made the INT32 mask pass of the integer row max spill, ptxas,
  // d = 128.)
  __device__ __forceinline__ void end_limits(int it, const int (&rows)[2], int t, int (&limit)[2]) const {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int end_key = p.window_right >= 0 ? min(loop_n_kv(), rows[r] + loop_diagonal() + p.window_right + 1)
                                              : loop_n_kv();
      limit[r] = end_key - (it * kBlockKV + 2 * t);
    }
  }
  __device__ __forceinline__ void begin_limits(int it, const int (&rows)[2], int t, int (&limit)[2]) const {
#pragma unroll
    for (int r = 0; r < 2; ++r) limit[r] = rows[r] + loop_diagonal() - p.window_left - (it * kBlockKV + 2 * t);
  }
  __device__ __forceinline__ static constexpr int column(int i) { return 8 * (i / 4) + i % 2; }

  // Masked entries of a tile's logits to -inf, or of its integer scores to INT32_MIN. The two
  // limits one after the other, so that only two of them are held at a time.
  template <bool kLeft, int N, class V>
  __device__ __forceinline__ void apply(int it, const int (&rows)[2], int t, V (&acc)[N], V masked) const {
    {
      int end[2];
      end_limits(it, rows, t, end);
#pragma unroll
      for (int i = 0; i < N; ++i)
        if (column(i) >= end[frag::acc_row(i)]) acc[i] = masked;
    }
    if constexpr (kLeft) {
      int begin[2];
      begin_limits(it, rows, t, begin);
#pragma unroll
      for (int i = 0; i < N; ++i)
        if (column(i) < begin[frag::acc_row(i)]) acc[i] = masked;
    }
  }
  template <bool kLeft, int N>
  __device__ __forceinline__ void apply(int it, const int (&rows)[2], int t, float (&sc)[N]) const {
    apply<kLeft>(it, rows, t, sc, -INFINITY);
  }
  template <bool kLeft, int N>
  __device__ __forceinline__ void apply(int it, const int (&rows)[2], int t, int32_t (&acc)[N]) const {
    apply<kLeft>(it, rows, t, acc, int32_t(INT32_MIN));
  }
};

using Mask = MaskOf<false>;

}  // namespace sage::sm90
