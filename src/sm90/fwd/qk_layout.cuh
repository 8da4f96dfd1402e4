// Where the INT8 Q and K tiles' bytes lie in shared memory, for every head dim: the one layout
// that the TMA loads of K, the consumers' and the Q stage's stores of Q codes, the QK MMA's
// descriptors, Q smoothing's reads of K and the epilogue's staging (in the Q tile) all use.
//
// A row holds kv_layout_head_dim(D) bytes (quant/kv_layout.h: 64, 128 or 256; the workspace's
// K rows, zero past the caller's head dim), in column blocks of one swizzle span each (64B at
// d = 64, else 128B): block b is the tile's [Rows x span] slice of bytes [b span, (b + 1) span)
// of every row, swizzled as TMA writes a box of that width and as the MMA descriptor reads it.
// One block for d <= 128 (the layout d = 64 and d = 128 always had); d = 96 takes a 128-byte
// row of which the MMAs read the first 96 bytes (96 is no swizzle span, and 32B swizzle's
// bank conflicts would hit every K read); d = 256 takes two 128-byte blocks. A k32 MMA slice
// (32 bytes) never crosses a block.
#pragma once

#include <cstdint>

#include "common/ptx.cuh"
#include "quant/kv_layout.h"

namespace sage::sm90 {

template <int D>
struct QKLayout {
  static constexpr int kRowBytes = quant::kv_layout_head_dim(D);  // bytes per row, padding included
  static constexpr int kSpan = kRowBytes < 128 ? kRowBytes : 128;  // the swizzle span
  static constexpr int kBlocks = kRowBytes / kSpan;
  static constexpr int kChunks = D / 32;  // k32 MMAs over the kernel's channels
  static_assert(D % 32 == 0 && D <= kRowBytes && kRowBytes % kSpan == 0, "QK layout");

  // Byte offset of (row, byte column col) in a tile of Rows rows; col % 16 == 0 or inside a
  // 16-byte piece.
  template <int Rows>
  __device__ __forceinline__ static int offset(int row, int col) {
    if constexpr (kBlocks == 1) return swizzled_offset(row, col, kSpan);
    return (col / kSpan) * (Rows * kSpan) + swizzled_offset(row, col % kSpan, kSpan);
  }
  // The descriptor of k32 slice kc of a tile of Rows rows whose low word is lo (smem_desc_lo).
  template <int Rows>
  __device__ __forceinline__ static uint64_t desc(uint32_t lo, int kc) {
    return smem_desc<kSpan>(lo, uint32_t((32 * kc / kSpan) * (Rows * kSpan) + (32 * kc) % kSpan));
  }
};

}  // namespace sage::sm90
