// K scale policies: how the quantized layout stores K's dequantization scales (quant/kv_layout.h)
// and how the consumers turn a tile's integer QK^T into logits with them. Shaped like the PV
// operand policies (pv_operand.cuh): one specialization per KScales, chosen at compile time.
//
//   head(all, kv_head, n_pad)     the head's scales
//   head_bytes(n_pad)             their size (the prologue prefetches them into L2)
//   key_scale(ks, it, j)          the scale of key j of tile it (Q smoothing's key bias)
//   scores(acc, q_scale, ...)     the tile's logits in the base-2 domain, unmasked
#pragma once

#include <cstdint>

#include "numerics/quant_rules.h"
#include "sm90/fwd/params.h"
#include "sm90/mma/fragment.cuh"

namespace sage::sm90 {

template <KScales KS>
struct KScaleOperand;

// A few groups per tile (per_thread: kKScalesPerTile, tile.h; per_block / per_tensor: the same
// scale in every slot). This thread's columns of a tile all fall in group t.
template <>
struct KScaleOperand<KScales::per_tile> {
  __device__ __forceinline__ static const float* head(const float* all, int64_t kv_head, int n_pad) {
    return all + kv_head * (n_pad / kBlockKV) * kKScalesPerTile;
  }
  __device__ __forceinline__ static int64_t head_bytes(int n_pad) {
    return int64_t((n_pad / kBlockKV) * kKScalesPerTile) * 4;
  }
  __device__ __forceinline__ static float key_scale(const float* ks, int it, int j) {
    return ks[it * kKScalesPerTile + (j % 8) / 2];
  }
  __device__ __forceinline__ static float tile_scale(const float* ks, int it, int t) {
    return ks[it * kKScalesPerTile + t];
  }
  template <int N>
  __device__ __forceinline__ static void scores(const int32_t (&acc)[N], const float (&q_scale)[2],
                                                float sm_scale_log2, const float* ks, int it, int t,
                                                float (&sc)[N]) {
    const float ks_tile = tile_scale(ks, it, t);
    const float mult[2] = {rules::score_multiplier(q_scale[0], ks_tile, sm_scale_log2),
                           rules::score_multiplier(q_scale[1], ks_tile, sm_scale_log2)};
#pragma unroll
    for (int i = 0; i < N; ++i) sc[i] = float(acc[i]) * mult[frag::acc_row(i)];
  }
};

// One scale per token (prequantized inputs).
template <>
struct KScaleOperand<KScales::per_token> {
  __device__ __forceinline__ static const float* head(const float* all, int64_t kv_head, int n_pad) {
    return all + kv_head * n_pad;
  }
  __device__ __forceinline__ static int64_t head_bytes(int n_pad) { return int64_t(n_pad) * 4; }
  __device__ __forceinline__ static float key_scale(const float* ks, int it, int j) {
    return ks[it * kBlockKV + j];
  }
  template <int N>
  __device__ __forceinline__ static void scores(const int32_t (&acc)[N], const float (&q_scale)[2],
                                                float sm_scale_log2, const float* ks, int it, int t,
                                                float (&sc)[N]) {
#pragma unroll
    for (int j = 0; j < N / 4; ++j) {
      // Straight from global memory (L1/L2): a copy into the stage's shared memory by the
      // producer's bulk copy was reported as a race by compute-sanitizer racecheck, which
      // does not follow mbarrier ordering into the async proxy.
      const float2 k2 = *reinterpret_cast<const float2*>(ks + it * kBlockKV + 8 * j + 2 * t);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = 4 * j + e;
        sc[i] = float(acc[i]) *
                rules::score_multiplier(q_scale[frag::acc_row(i)], e % 2 ? k2.y : k2.x, sm_scale_log2);
      }
    }
  }
};

}  // namespace sage::sm90
