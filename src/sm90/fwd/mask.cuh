// Which keys each Q row sees: no mask, or causal aligned bottom-right (row i sees keys
// j <= i + n_kv - n_q, FlashAttention's convention for n_q != n_kv). A sliding window is one
// more pair of limits here: kv_tiles would then also give a first tile, and limits a lower
// bound. Keys past n_kv are masked in every case (the last tile's padding).
#pragma once

#include <climits>
#include <cmath>

#include "sm90/fwd/params.h"
#include "sm90/mma/fragment.cuh"

namespace sage::sm90 {

// The lengths come from the parameter block at each use rather than from copies: kept in
// registers through the K/V loop, copies cost the loop's register budget (SASS).
struct Mask {
  const AttentionParams& p;
  int causal_offset;  // n_kv - n_q

  __device__ __forceinline__ explicit Mask(const AttentionParams& p_)
      : p(p_), causal_offset(p_.n_kv - p_.n_q) {}

  // How many K/V tiles the Q tile of BlockQ rows starting at q0 needs (the last one partly).
  template <int BlockQ>
  __device__ __forceinline__ int kv_tiles(int q0) const {
    const int all = (p.n_kv + kBlockKV - 1) / kBlockKV;
    if (!p.causal) return all;
    const int last_row = min(q0 + BlockQ, p.n_q) - 1;
    const int last_key = last_row + p.n_kv - p.n_q;
    if (last_key < 0) return 0;
    return min(all, last_key / kBlockKV + 1);
  }

  // Whether any entry of tile it may be masked for the 64 rows from row0.
  __device__ __forceinline__ bool tile_needs_mask(int it, int row0) const {
    const int kv0 = it * kBlockKV;
    return kv0 + kBlockKV > p.n_kv || (p.causal && kv0 + kBlockKV - 1 > row0 + causal_offset);
  }

  // Entry i of tile it is masked iff its column offset from this thread's first column,
  // 8 (i / 4) + i % 2 (a constant once unrolled), reaches the row's limit: one compare per
  // entry against two registers. (Column and row tests per entry made the INT32 mask pass of
  // the integer row max spill, ptxas, d = 128.)
  __device__ __forceinline__ void limits(int it, const int (&rows)[2], int t, int (&limit)[2]) const {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int first_masked = p.causal ? min(p.n_kv, rows[r] + causal_offset + 1) : p.n_kv;
      limit[r] = first_masked - (it * kBlockKV + 2 * t);
    }
  }
  __device__ __forceinline__ static bool is_masked(const int (&limit)[2], int i) {
    return 8 * (i / 4) + i % 2 >= limit[frag::acc_row(i)];
  }

  // Masked entries of a tile's logits to -inf, or of its integer scores to INT32_MIN.
  template <int N>
  __device__ __forceinline__ void apply(int it, const int (&rows)[2], int t, float (&sc)[N]) const {
    int limit[2];
    limits(it, rows, t, limit);
#pragma unroll
    for (int i = 0; i < N; ++i)
      if (is_masked(limit, i)) sc[i] = -INFINITY;
  }
  template <int N>
  __device__ __forceinline__ void apply(int it, const int (&rows)[2], int t, int32_t (&acc)[N]) const {
    int limit[2];
    limits(it, rows, t, limit);
#pragma unroll
    for (int i = 0; i < N; ++i)
      if (is_masked(limit, i)) acc[i] = INT32_MIN;
  }
};

}  // namespace sage::sm90
