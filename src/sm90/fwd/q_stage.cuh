// The Q stage: the producer warpgroup's three idle warps quantize each work item's Q tile,
// one item ahead of the consumers, so that a consumer item starts with a barrier wait instead
// of the Q prologue (q_operand.cuh).
//
// Why: at short N the prologue is a large share of the attention kernel, with both consumer
// warpgroups off the tensor cores while it runs (session 16's probe and v23 in
// docs/history/README.md). v14 gave these warps the same work and lost: each thread loaded Q
// from global memory itself, one 16-byte load in flight in its 24 registers, and spilled.
// Here one thread loads the whole tile with TMA (the fp16/bf16 rows, 128B swizzle) and the
// warps work from shared memory to shared memory in a few registers per value.
//
// The codes and scales are the consumer path's bits: the same group maxima (a maximum is
// exact in the input type), the same rules:: scale and inverse, the same rounding
// (round_to_low_bits). Granularities whose group one thread holds whole: per_thread (rows g
// and g + 8 of a warp slice, tile.h) and per_token.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

#include "common/vec_io.cuh"
#include "numerics/quant_rules.h"
#include "sm90/fwd/params.h"
#include "common/ptx.cuh"
#include "sm90/fwd/qk_layout.cuh"

namespace sage::sm90 {

// qk_channel_balance's s_c of a KV head for both Q paths (q_operand.cuh and the stage), or null
// where the recipe does not balance or the head's scales are all 1: its Q is then quantized
// as without the balance (the same bits: a division by 1), on the paths other recipes take.
template <int D>
__device__ __forceinline__ const float* balance_of_head(const AttentionParams& p, int64_t kv_head) {
  if (p.kv.qk_balance == nullptr || p.kv.qk_balance_active[kv_head] == 0) return nullptr;
  return p.kv.qk_balance + kv_head * quant::kv_layout_head_dim(D);  // the workspace's rows
}

template <int D, class T>
struct QStage {
  static constexpr int kBlockQ = sage::sm90::kBlockQ<D>;
  static constexpr int kThreads = 96;              // warps 1..3 of the producer warpgroup
  static constexpr int kGroups = kBlockQ / 2;      // row pairs (r, r + 8) of the tile
  // 128-byte TMA boxes of 64 elements per row; at d = 96 the second box's last 32 columns
  // and past a smaller caller's head dim, every column, lie outside the tensor map: zeros.
  static constexpr int kBoxes = (D + 63) / 64;
  static constexpr int kRawBytes = kBlockQ * kBoxes * 128;  // the fp16/bf16 tile (whole boxes)
  using L = QKLayout<D>;
  static_assert(sizeof(T) == 2, "Q is fp16 or bf16 here");

  // One thread: the raw tile of the Q tile at row q0 of (batch b, head h). Rows past n_q are
  // outside the tensor map and arrive as zeros, as the consumer path zeroes them.
  __device__ static void load(const CUtensorMap* map, uint8_t* raw, uint64_t* bar, int q0, int h,
                              int b) {
    mbar_expect_tx(bar, kRawBytes);
#pragma unroll
    for (int box = 0; box < kBoxes; ++box)
      tma_load_4d(raw + box * kBlockQ * 128, map, bar, 64 * box, q0, h, b);
  }

  // The raw tile into codes: q, this buffer's [consumer warpgroups][64 x D] INT8 tiles,
  // swizzled as the QK MMA reads them (q_operand.cuh writes the same layout); scale, its
  // [kBlockQ] per-row dequantization scales. stage_thread: 0 .. kThreads - 1.
  // balance: qk_channel_balance's s_c of the item's KV head (Q is divided by them before its
  // maxima and codes, as in q_operand.cuh), or null.
  __device__ static void quantize(uint32_t raw, uint32_t q, float* scale, bool per_token,
                                  float q_max, const float* balance, int stage_thread) {
    // Two loops, not a test per row: the balanced one's extra registers stay out of the other.
    if (balance != nullptr)
      quantize_groups<true>(raw, q, scale, per_token, q_max, balance, stage_thread);
    else
      quantize_groups<false>(raw, q, scale, per_token, q_max, nullptr, stage_thread);
  }

 private:
  template <bool kBalanced>
  __device__ __forceinline__ static void quantize_groups(uint32_t raw, uint32_t q, float* scale,
                                                         bool per_token, float q_max,
                                                         const float* balance, int stage_thread) {
#pragma unroll 1
    for (int gi = stage_thread; gi < kGroups; gi += kThreads) {
      // The group of lane 4g + t of warp `warp` of consumer warpgroup cw (fragment.cuh).
      const int cw = gi / 32, warp = (gi / 8) % 4, g = gi % 8;
      const int row0 = 64 * cw + 16 * warp + g;  // in the tile; row0 + 8 is the other row
      float amax[2];
#pragma unroll
      for (int r = 0; r < 2; ++r)
        amax[r] = kBalanced ? balanced_row_amax(raw, row0 + 8 * r, balance) : row_amax(raw, row0 + 8 * r);
      if (!per_token) amax[0] = amax[1] = rules::max_nan(amax[0], amax[1]);
      const uint32_t q_wg = q + cw * 64 * L::kRowBytes;
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = row0 + 8 * r;
        scale[row] = rules::symmetric_scale(amax[r], q_max);
        const float inv = rules::symmetric_inverse(amax[r], q_max);
#pragma unroll 1
        for (int col = 0; col < D; col += 16) {
          const int box = col / 64, chunk = (col % 64) / 8;
          const uint4 lo = ld_shared_v4(raw + raw_offset(row, box, chunk));
          const uint4 hi = ld_shared_v4(raw + raw_offset(row, box, chunk + 1));
          uint4 codes;
          if constexpr (kBalanced)
            codes = make_uint4(balanced_codes4(lo.x, lo.y, inv, balance + col),
                               balanced_codes4(lo.z, lo.w, inv, balance + col + 4),
                               balanced_codes4(hi.x, hi.y, inv, balance + col + 8),
                               balanced_codes4(hi.z, hi.w, inv, balance + col + 12));
          else
            codes = make_uint4(codes4(lo.x, lo.y, inv), codes4(lo.z, lo.w, inv),
                               codes4(hi.x, hi.y, inv), codes4(hi.z, hi.w, inv));
          st_shared_v4(q_wg + L::template offset<64>(row - 64 * cw, col), codes);
        }
      }
    }
  }

  // max |x| over a tile row, packed in the input type (exact).
  __device__ __forceinline__ static float row_amax(uint32_t raw, int row) {
    uint32_t m = 0;  // packed |x| maxima, +0 in both halves
#pragma unroll
    for (int box = 0; box < kBoxes; ++box)
#pragma unroll
      for (int chunk = 0; chunk < 8; ++chunk) {
        const uint4 w = ld_shared_v4(raw + raw_offset(row, box, chunk));
        m = max_abs2(max_abs2(m, w.x, w.y), w.z, w.w);
      }
    const float2 f = gpu::word_to_float2<T>(m);
    return rules::max_nan(f.x, f.y);
  }

  // max |x / s_c| over a tile row, in float (x / s_c can leave the input type's range).
  __device__ __forceinline__ static float balanced_row_amax(uint32_t raw, int row, const float* s) {
    float m = 0.f;
#pragma unroll 1
    for (int col = 0; col < D; col += 8) {
      const uint4 w = ld_shared_v4(raw + raw_offset(row, col / 64, (col % 64) / 8));
      const uint32_t words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float2 f = gpu::word_to_float2<T>(words[j]);
        m = rules::max_nan(m, fabsf(__fmul_rn(f.x, rules::reciprocal_pow2(s[col + 2 * j]))));
        m = rules::max_nan(m, fabsf(__fmul_rn(f.y, rules::reciprocal_pow2(s[col + 2 * j + 1]))));
      }
    }
    return m;
  }

  // Byte offset of 16-byte chunk `chunk` (elements 8 chunk .. 8 chunk + 7) of box `box` of a
  // tile row, under TMA's 128B swizzle (rows of one box are 128 bytes).
  __device__ __forceinline__ static uint32_t raw_offset(int row, int box, int chunk) {
    return uint32_t(box * kBlockQ * 128 + row * 128 + ((chunk ^ (row % 8)) << 4));
  }

  // max(m, |a|, |b|) per 16-bit half.
  __device__ __forceinline__ static uint32_t max_abs2(uint32_t m, uint32_t a, uint32_t b) {
    using T2 = std::conditional_t<std::is_same_v<T, __half>, __half2, __nv_bfloat162>;
    const T2 r = __hmax2_nan(__hmax2_nan(*reinterpret_cast<const T2*>(&m), __habs2(*reinterpret_cast<const T2*>(&a))),
                         __habs2(*reinterpret_cast<const T2*>(&b)));
    return *reinterpret_cast<const uint32_t*>(&r);
  }

  // Four values (two words) to four codes in one word, as q_operand.cuh's store.
  __device__ __forceinline__ static uint32_t codes4(uint32_t w0, uint32_t w1, float inv) {
    const float2 a = gpu::word_to_float2<T>(w0), b = gpu::word_to_float2<T>(w1);
    const uint32_t c0 = round_to_low_bits(__fmul_rn(a.x, inv)), c1 = round_to_low_bits(__fmul_rn(a.y, inv));
    const uint32_t c2 = round_to_low_bits(__fmul_rn(b.x, inv)), c3 = round_to_low_bits(__fmul_rn(b.y, inv));
    return __byte_perm(__byte_perm(c0, c1, 0x0040), __byte_perm(c2, c3, 0x0040), 0x5410);
  }
  // codes4 of x / s_c for the four channels from s (exact reciprocals: powers of two).
  __device__ __forceinline__ static uint32_t balanced_codes4(uint32_t w0, uint32_t w1, float inv,
                                                             const float* s) {
    const float2 a = gpu::word_to_float2<T>(w0), b = gpu::word_to_float2<T>(w1);
    const float x[4] = {a.x, a.y, b.x, b.y};
    uint32_t c[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) c[i] = round_to_low_bits(__fmul_rn(__fmul_rn(x[i], rules::reciprocal_pow2(s[i])), inv));
    return __byte_perm(__byte_perm(c[0], c[1], 0x0040), __byte_perm(c[2], c[3], 0x0040), 0x5410);
  }
};

}  // namespace sage::sm90
