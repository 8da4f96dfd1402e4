// P V operand policies: how one K/V tile's probabilities (in the S accumulator layout) become
// the A operand of the PV MMA, which MMA multiplies them with the V tile in shared memory, and
// how the tile's product is folded into the fp32 output accumulator.
//
// A recipe's PV choices (format of P and V, P scale, accumulator) meet only here and in the
// K/V pre-pass that writes V in the format the policy reads (quant/kv_prepass.cu). Adding a
// format is one more specialization of PVOperand plus its V encoding; the kernel skeleton
// (kernel.cuh, mainloop.cuh) does not change (docs/recipes_on_gpu.md shows the diff of one).
//
// Every policy has the same shape, in three steps so that the kernel can run the MMAs of tile
// i - 1 while it computes the softmax of tile i (mainloop.cuh):
//   kVBytes                     bytes per V element in the shared-memory tile
//   Fragments                   P as the MMA's A operand (registers)
//   Accumulator                 the tile's product P V
//   pack(p, frags, code_sum)    p: P~ * p_max of the tile (P~ in [0, 1]; p_max the static P
//                               scale, 1 for fp16), [kBlockKV / 2] in the accumulator layout;
//                               code_sum: integer P only, the thread's code sums per row
//   issue(acc, frags, v_desc)   starts the MMAs of the tile on V (the stage's [D rows x
//                               kBlockKV tokens] tile, K-major, 128B swizzle; v_desc: the
//                               low word of its descriptor, smem_desc_lo) as ONE commit
//                               group; frags and acc belong to the MMA until it is waited for
//   fold(o, acc, frags, alpha)  after the wait: o = o * alpha (the online-softmax rescale of
//                               rows g, g + 8) + the tile's product
//   kSplits                     the PV MMA's n is split in this many column ranges of kSplitN
//                               channels (2 at d = 256: its whole fp32 product and O would take
//                               256 registers), each issued, waited for and folded in turn
//                               (issue<S>, fold<S>; S = 0 only where kSplits = 1). Each output
//                               column's sums are those of one MMA over all channels (the split
//                               is along n, not k), so the numerics are the same.
//   kOnesRows                   rows of ones under the V tile (kernel_traits.h, v_ones_rows):
//                               where > 0 the MMA's extra n8 block is the tile's row sum of
//                               the quantized P, and fold_row_sum(l, acc, alpha) folds it into
//                               the softmax's l (RowSum::pv_mma) in place of the softmax's sum

#pragma once

#include <cuda_fp16.h>

#include <cstdint>

#include "sm90/mma/fragment.cuh"
#include "sm90/fwd/params.h"
#include "common/ptx.cuh"
#include "sm90/mma/wgmma_ops.cuh"

namespace sage::sm90 {

// ---- P to 8-bit A fragments ------------------------------------------------------------------

// Two scaled probabilities to two bytes (`lo` in the low byte) of E4M3 or of INT8 codes.
struct E4m3Pair {
  __device__ __forceinline__ uint32_t operator()(float lo, float hi, int32_t&) const {
    return pack_e4m3x2(lo, hi);
  }
};
// Codes of P~ * p_max (given) in [0, 127], by round_to_low_bits: a float-to-int conversion
// per value made the INT8 path slower than E4M3's packed conversion.
struct Int8Pair {
  __device__ __forceinline__ uint32_t operator()(float lo, float hi, int32_t& sum) const {
    const uint32_t a = round_to_low_bits(lo) & 0xFFu;
    const uint32_t b = round_to_low_bits(hi) & 0xFFu;
    sum += int32_t(a + b);
    return a | (b << 8);
  }
};

// P~ * p_max, as the A fragments of the 8-bit PV MMA: slice kc takes the accumulator
// chunks 4kc..4kc+3. The bytes land in the permuted token order that the K/V pre-pass
// stored V in (quant::pv_position_of_token), so no register shuffles are needed.
template <int N, class Pair>
__device__ __forceinline__ void pack_p_8bit(const float (&p)[N / 2], uint32_t (&a)[N / 32][4],
                                            int32_t (&code_sum)[2],
                                            Pair pair) {
#pragma unroll
  for (int kc = 0; kc < N / 32; ++kc) {
    const int j = 16 * kc;  // first accumulator index of chunk 4kc
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      // row r of chunks (4kc, 4kc+1) -> a[r]; of chunks (4kc+2, 4kc+3) -> a[2 + r]
      const int e = 2 * r;
      int32_t& s = code_sum[r];
      const uint32_t lo0 = pair(p[j + e], p[j + e + 1], s);
      const uint32_t hi0 = pair(p[j + 4 + e], p[j + 4 + e + 1], s);
      const uint32_t lo1 = pair(p[j + 8 + e], p[j + 8 + e + 1], s);
      const uint32_t hi1 = pair(p[j + 12 + e], p[j + 12 + e + 1], s);
      a[kc][r] = lo0 | (hi0 << 16);
      a[kc][2 + r] = lo1 | (hi1 << 16);
    }
  }
}

// Descriptor of the k32 slice kc of an 8-bit V tile (rows of kBlockKV = 128 bytes), from V
// row (channel) row0 on.
__device__ __forceinline__ uint64_t v8_slice(uint32_t v_desc, int kc, int row0 = 0) {
  return smem_desc<kBlockKV>(v_desc, 32 * kc + row0 * kBlockKV);
}

// The PV MMA's column ranges at head dim D (pv_operand.cuh's kSplits).
template <int D>
constexpr int kPVSplits = D > 128 ? 2 : 1;

template <int D, PVPath Path>
struct PVOperand;

// SageAttention2: E4M3 P (static scale) and V (per channel). The FP8 MMA accumulates with
// ~fp22 precision inside the tile; the tile is then added into fp32 (two-level).
template <int D>
struct PVOperand<D, PVPath::e4m3_two_level> {
  static constexpr int kVBytes = 1;
  static constexpr int kOnesRows = v_ones_rows(D, PVPath::e4m3_two_level);
  static constexpr int kSplits = kPVSplits<D>, kSplitN = D / kSplits;
  // The last split's n: its V channels, then the ones (rows D .. D + 7, right below them).
  static constexpr int kN = kSplitN + kOnesRows;
  struct Fragments { uint32_t a[kBlockKV / 32][4]; };
  struct Accumulator { float c[kN / 2]; };
  __device__ __forceinline__ static void pack(const float (&p)[kBlockKV / 2], Fragments& f,
                                              int32_t (&code_sum)[2]) {
    pack_p_8bit<kBlockKV>(p, f.a, code_sum, E4m3Pair{});
  }
  template <int S = 0>
  __device__ __forceinline__ static void issue(Accumulator& acc, Fragments& f, uint32_t v_desc) {
    constexpr int n = S == kSplits - 1 ? kN : kSplitN;
    float(&c)[n / 2] = reinterpret_cast<float(&)[n / 2]>(acc.c);
    wgmma_fence();
    mma_e4m3_rs<n, false>(c, f.a[0], v8_slice(v_desc, 0, S * kSplitN));
#pragma unroll
    for (int kc = 1; kc < kBlockKV / 32; ++kc)
      mma_e4m3_rs<n, true>(c, f.a[kc], v8_slice(v_desc, kc, S * kSplitN));
    wgmma_commit();
  }
  template <int S = 0>
  __device__ __forceinline__ static void fold(float (&o)[D / 2], Accumulator& acc, Fragments& f,
                                              const float (&alpha)[2]) {
    reg_fence(acc.c);
    reg_fence(f.a);
#pragma unroll
    for (int i = 0; i < kSplitN / 2; ++i)
      o[S * kSplitN / 2 + i] = __fmaf_rn(o[S * kSplitN / 2 + i], alpha[frag::acc_row(i)], acc.c[i]);
  }
  // The ones block's entries kSplitN / 2 (row g) and kSplitN / 2 + 2 (row g + 8) of the last
  // split hold the whole row's sum (every column of the block is the same), so l needs no quad
  // reduction at the end. After the last split's fold (its register fence).
  __device__ __forceinline__ static void fold_row_sum(float (&l)[2], const Accumulator& acc,
                                                      const float (&alpha)[2]) {
    static_assert(kOnesRows > 0, "no row sum column");
#pragma unroll
    for (int r = 0; r < 2; ++r) l[r] = __fmaf_rn(l[r], alpha[r], acc.c[kSplitN / 2 + 2 * r]);
  }
};

// SageAttention2++: E4M3 P and V with narrowed ranges, each pair of k32 MMAs accumulating in
// an f16 accumulator, each pair's sum then added into the (already rescaled) fp32 output.
// The f16 accumulators take half the registers of the fp32 tile sum of two_level.
template <int D>
struct PVOperand<D, PVPath::e4m3_fp16x2> {
  static_assert(kBlockKV == 128, "two f16 accumulators cover the tile's two 64-token pairs");
  static constexpr int kVBytes = 1;
  static constexpr int kOnesRows = 0;
  static constexpr int kSplits = kPVSplits<D>, kSplitN = D / kSplits;
  struct Fragments { uint32_t a[kBlockKV / 32][4]; };
  struct Accumulator { uint32_t pair0[kSplitN / 4], pair1[kSplitN / 4]; };
  __device__ __forceinline__ static void pack(const float (&p)[kBlockKV / 2], Fragments& f,
                                              int32_t (&code_sum)[2]) {
    pack_p_8bit<kBlockKV>(p, f.a, code_sum, E4m3Pair{});
  }
  template <int S = 0>
  __device__ __forceinline__ static void issue(Accumulator& acc, Fragments& f, uint32_t v_desc) {
    constexpr int r0 = S * kSplitN;
    wgmma_fence();
    mma_e4m3_rs_f16acc<kSplitN, false>(acc.pair0, f.a[0], v8_slice(v_desc, 0, r0));
    mma_e4m3_rs_f16acc<kSplitN, true>(acc.pair0, f.a[1], v8_slice(v_desc, 1, r0));
    mma_e4m3_rs_f16acc<kSplitN, false>(acc.pair1, f.a[2], v8_slice(v_desc, 2, r0));
    mma_e4m3_rs_f16acc<kSplitN, true>(acc.pair1, f.a[3], v8_slice(v_desc, 3, r0));
    wgmma_commit();
  }
  template <int S = 0>
  __device__ __forceinline__ static void fold(float (&o)[D / 2], Accumulator& acc, Fragments& f,
                                              const float (&alpha)[2]) {
    reg_fence(acc.pair0);
    reg_fence(acc.pair1);
    reg_fence(f.a);
    // Rescale first, then add the pairs one at a time: numerics.md's order for fp16x2_fp32.
#pragma unroll
    for (int i = 0; i < kSplitN / 2; ++i) o[S * kSplitN / 2 + i] *= alpha[frag::acc_row(i)];
    add_f16_pairs<S>(o, acc.pair0);
    add_f16_pairs<S>(o, acc.pair1);
  }

 private:
  // f16 accumulator register i packs the fp32-layout values 2i (low half) and 2i + 1.
  template <int S>
  __device__ __forceinline__ static void add_f16_pairs(float (&o)[D / 2], const uint32_t (&h)[kSplitN / 4]) {
#pragma unroll
    for (int i = 0; i < kSplitN / 4; ++i) {
      const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&h[i]));
      o[S * kSplitN / 2 + 2 * i] += f.x;
      o[S * kSplitN / 2 + 2 * i + 1] += f.y;
    }
  }
};

// SageAttention T/B: fp16 P and fp16 V on the 16-bit MMA with an f16 accumulator over the
// tile (the paper's consumer-GPU choice; on Hopper it runs at the 16-bit rate, half the 8-bit
// one). The S accumulator layout is already the k16 A layout, so P needs no permutation and V
// is stored in token order, as two 64-token halves of 128-byte rows.
template <int D>
struct PVOperand<D, PVPath::fp16> {
  static constexpr int kVBytes = 2;
  static constexpr int kOnesRows = 0;
  static constexpr int kSlices = kBlockKV / 16;
  static constexpr int kSplits = kPVSplits<D>, kSplitN = D / kSplits;
  struct Fragments { uint32_t a[kSlices][4]; };
  struct Accumulator { uint32_t c[kSplitN / 4]; };
  __device__ __forceinline__ static void pack(const float (&p)[kBlockKV / 2], Fragments& f,
                                              int32_t (&)[2]) {
#pragma unroll
    for (int kc = 0; kc < kSlices; ++kc)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const __half2 h = __floats2half2_rn(p[8 * kc + 2 * r], p[8 * kc + 2 * r + 1]);
        f.a[kc][r] = *reinterpret_cast<const uint32_t*>(&h);
      }
  }
  template <int S = 0>
  __device__ __forceinline__ static void issue(Accumulator& acc, Fragments& f, uint32_t v_desc) {
    wgmma_fence();
    mma_f16_rs_f16acc<kSplitN, false>(acc.c, f.a[0], v16_slice(v_desc, 0, S * kSplitN));
#pragma unroll
    for (int kc = 1; kc < kSlices; ++kc)
      mma_f16_rs_f16acc<kSplitN, true>(acc.c, f.a[kc], v16_slice(v_desc, kc, S * kSplitN));
    wgmma_commit();
  }
  template <int S = 0>
  __device__ __forceinline__ static void fold(float (&o)[D / 2], Accumulator& acc, Fragments& f,
                                              const float (&alpha)[2]) {
    reg_fence(acc.c);
    reg_fence(f.a);
    constexpr int o0 = S * kSplitN / 2;
#pragma unroll
    for (int i = 0; i < kSplitN / 4; ++i) {
      const float2 h = __half22float2(*reinterpret_cast<const __half2*>(&acc.c[i]));
      o[o0 + 2 * i] = __fmaf_rn(o[o0 + 2 * i], alpha[frag::acc_row(2 * i)], h.x);
      o[o0 + 2 * i + 1] = __fmaf_rn(o[o0 + 2 * i + 1], alpha[frag::acc_row(2 * i + 1)], h.y);
    }
  }

 private:
  // k16 slice kc: 32 bytes into the row of its 64-token half (each half a box of D rows of
  // 128 bytes), from V row (channel) row0 on.
  __device__ __forceinline__ static uint64_t v16_slice(uint32_t v_desc, int kc, int row0) {
    return smem_desc<128>(v_desc, (kc / 4) * (D * 128) + row0 * 128 + (kc % 4) * 32);
  }
};

// SageAttention vT/vB and INT-FlashAttention: INT8 P (static 1/127) and INT8 V on the
// integer MMA, exact in s32 within a tile, converted once per tile. pack returns the thread's
// code sums per row for the quantized row sum.
template <int D>
struct PVOperand<D, PVPath::int8> {
  static constexpr int kVBytes = 1;
  static constexpr int kOnesRows = 0;
  static constexpr int kSplits = kPVSplits<D>, kSplitN = D / kSplits;
  struct Fragments { uint32_t a[kBlockKV / 32][4]; };
  struct Accumulator { int32_t c[kSplitN / 2]; };
  __device__ __forceinline__ static void pack(const float (&p)[kBlockKV / 2], Fragments& f,
                                              int32_t (&code_sum)[2]) {
    pack_p_8bit<kBlockKV>(p, f.a, code_sum, Int8Pair{});
  }
  template <int S = 0>
  __device__ __forceinline__ static void issue(Accumulator& acc, Fragments& f, uint32_t v_desc) {
    wgmma_fence();
    mma_s8_rs<kSplitN, false>(acc.c, f.a[0], v8_slice(v_desc, 0, S * kSplitN));
#pragma unroll
    for (int kc = 1; kc < kBlockKV / 32; ++kc)
      mma_s8_rs<kSplitN, true>(acc.c, f.a[kc], v8_slice(v_desc, kc, S * kSplitN));
    wgmma_commit();
  }
  template <int S = 0>
  __device__ __forceinline__ static void fold(float (&o)[D / 2], Accumulator& acc, Fragments& f,
                                              const float (&alpha)[2]) {
    reg_fence(acc.c);
    reg_fence(f.a);
#pragma unroll
    for (int i = 0; i < kSplitN / 2; ++i)
      o[S * kSplitN / 2 + i] = __fmaf_rn(o[S * kSplitN / 2 + i], alpha[frag::acc_row(i)], float(acc.c[i]));
  }
};

// P~ * inv (inv: the row's 127 / peak) to INT8 codes: round to nearest even, clamped to 127,
// which acts where the integer row max forms a P~ a rounding above the peak
// (rules::round_clamp on values >= 0: min(rint(x), 127) = rint(min(x, 127))).
struct Int8ClampPair {
  __device__ __forceinline__ uint32_t operator()(float lo, float hi, int32_t& sum) const {
    const uint32_t a = round_to_low_bits(fminf(lo, 127.f)) & 0xFFu;
    const uint32_t b = round_to_low_bits(fminf(hi, 127.f)) & 0xFFu;
    sum += int32_t(a + b);
    return a | (b << 8);
  }
};

// SageBwd's forward (docs/numerics.md steps 7-9): INT8 P with one scale per row and tile,
// s_P = peak / 127 from the softmax's maxima (pack takes 127 / peak per row), INT8 V with one
// scale per K/V tile; the exact s32 tile product enters O as
// O = fmaf(float(acc), s_P * s_V, O * alpha) (fold takes s_P * s_V per row).
template <int D>
struct PVOperand<D, PVPath::int8_dynamic> {
  static_assert(D <= 128, "no split PV MMA on this path (kernel_traits.h, variant_has_kernel)");
  static constexpr int kVBytes = 1;
  static constexpr int kOnesRows = 0;
  static constexpr int kSplits = 1;
  struct Fragments { uint32_t a[kBlockKV / 32][4]; };
  struct Accumulator { int32_t c[D / 2]; };
  __device__ __forceinline__ static void pack(const float (&p)[kBlockKV / 2], Fragments& f,
                                              int32_t (&code_sum)[2], const float (&inv)[2]) {
    float x[kBlockKV / 2];
#pragma unroll
    for (int i = 0; i < kBlockKV / 2; ++i) x[i] = __fmul_rn(p[i], inv[frag::acc_row(i)]);
    pack_p_8bit<kBlockKV>(x, f.a, code_sum, Int8ClampPair{});
  }
  __device__ __forceinline__ static void issue(Accumulator& acc, Fragments& f, uint32_t v_desc) {
    wgmma_fence();
    mma_s8_rs<D, false>(acc.c, f.a[0], v8_slice(v_desc, 0));
#pragma unroll
    for (int kc = 1; kc < kBlockKV / 32; ++kc)
      mma_s8_rs<D, true>(acc.c, f.a[kc], v8_slice(v_desc, kc));
    wgmma_commit();
  }
  __device__ __forceinline__ static void fold(float (&o)[D / 2], Accumulator& acc, Fragments& f,
                                              const float (&alpha)[2], const float (&factor)[2]) {
    reg_fence(acc.c);
    reg_fence(f.a);
#pragma unroll
    for (int i = 0; i < D / 2; ++i) {
      const int r = frag::acc_row(i);
      o[i] = __fmaf_rn(float(acc.c[i]), factor[r], __fmul_rn(o[i], alpha[r]));
    }
  }
};

}  // namespace sage::sm90
