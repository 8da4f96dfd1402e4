// Which keys a query row sees: the attention mask of docs/numerics.md, step 5, as one set of
// functions that the exact reference, the simulator, the kernel's mask (sm90/fwd/mask.cuh)
// and the tile scheduler's work estimate all call.
//
// FlashAttention's convention, aligned bottom-right: with off = n_kv - n_q, query row i sees
// key j iff
//     i + off - left <= j <= i + off + right,
// where a bound of -1 is unbounded on that side. Causal masking is right = 0 (with or
// without a left window). The visible keys of a row are one interval of [0, n_kv), possibly
// empty (a fully masked row: out = 0, lse = -inf), and both of its ends grow with the row.
#pragma once

#include <cstdint>

#include "numerics/config.h"

namespace sage {

// The window as the mask functions take it: -1 or a bound that masks at least one key of some
// row (normalized_window), so that i + off -/+ bound stays far from overflow.
struct KeyWindow {
  int64_t left = -1, right = -1;
};

// The window a call's arguments mean (validated: each bound -1 or >= 0; causal only with
// right -1 or 0): causal becomes right = 0, and a bound that masks no key of any row becomes
// -1, so that a window covering every key runs exactly as no window. The left bound masks
// something iff some row's first visible key is past 0 (the last row's, n_kv - 1 - left > 0);
// the right bound iff some row's last visible key is before n_kv - 1 (the first row's,
// n_kv - n_q + right < n_kv - 1).
SAGE_HD KeyWindow normalized_window(bool causal, int64_t left, int64_t right, int64_t n_q,
                                    int64_t n_kv) {
  KeyWindow w;
  if (causal) right = 0;
  w.left = left >= 0 && left < n_kv - 1 ? left : -1;
  w.right = right >= 0 && right < n_q - 1 ? right : -1;
  return w;
}

template <class I>
SAGE_HD I clamp_key(I key, I n_kv) {
  return key < 0 ? I(0) : key > n_kv ? n_kv : key;
}

// The first key row `row` sees, in [0, n_kv]. left: normalized (-1 or a real bound).
template <class I>
SAGE_HD I first_visible_key(I row, I n_q, I n_kv, I left) {
  return left < 0 ? I(0) : clamp_key<I>(row + (n_kv - n_q) - left, n_kv);
}

// One past the last key row `row` sees, in [0, n_kv]. right: normalized.
template <class I>
SAGE_HD I end_visible_key(I row, I n_q, I n_kv, I right) {
  return right < 0 ? n_kv : clamp_key<I>(row + (n_kv - n_q) + right + 1, n_kv);
}

// The keys [begin, end) row `row` sees; end <= begin: none.
struct KeyRange {
  int64_t begin, end;
  SAGE_HD bool empty() const { return end <= begin; }
};
SAGE_HD KeyRange visible_keys(int64_t row, int64_t n_q, int64_t n_kv, KeyWindow w) {
  return {first_visible_key<int64_t>(row, n_q, n_kv, w.left),
          end_visible_key<int64_t>(row, n_q, n_kv, w.right)};
}

// The K/V tiles of `block_kv` keys that rows [row0, row_end) visit: [begin, end), empty when
// no row of them sees a key. The rows' intervals overlap or touch (each bound steps by one key
// per row, and a window holds at least one key), so their union is one interval.
struct TileRange {
  int begin, end;
};
template <class I>
SAGE_HD TileRange visible_tiles(I row0, I row_end, I n_q, I n_kv, I left, I right, int block_kv) {
  const I first = first_visible_key<I>(row0, n_q, n_kv, left);
  const I end = end_visible_key<I>(row_end - 1, n_q, n_kv, right);
  if (end <= first) return {0, 0};
  return {int(first / block_kv), int((end + block_kv - 1) / block_kv)};
}

}  // namespace sage
