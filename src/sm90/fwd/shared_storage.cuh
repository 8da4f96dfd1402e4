// The attention CTA's shared memory: the Q tiles, the K/V ring, the Q stage's buffers, the
// barriers, and the consumers' scratch for Q statistics and Q smoothing.
#pragma once

#include <cstdint>

#include "common/ptx.cuh"
#include "sm90/fwd/kernel_traits.h"
#include "sm90/fwd/qk_layout.cuh"

namespace sage::sm90 {

// D: head dim; Stages: the K/V ring; VBytes: bytes per V element; QStage: the variant has the
// Q stage (q_stage.cuh), which needs two Q buffers (the stage fills one while the consumers
// read the other) and the raw tile; VOnesRows: v_ones_rows, written once per launch below each
// stage's V tile.
template <int D, int Stages, int VBytes, bool QStage, int VOnesRows>
struct SharedStorage {
  static constexpr int kConsumers = kConsumerWarpgroups<D>;
  static constexpr int kQBuffers = QStage ? 2 : 1;
  static constexpr int kQKRow = QKLayout<D>::kRowBytes;  // Q and K rows (qk_layout.cuh)
  static constexpr int kQRawBoxes = (D + 63) / 64;  // the Q stage's 64-element TMA boxes per row
  // Quantized Q tiles, one per consumer warpgroup (per buffer).
  alignas(1024) int8_t q[kQBuffers][kConsumers][64 * kQKRow];
  alignas(1024) int8_t k[Stages][kBlockKV * kQKRow];
  alignas(1024) uint8_t v[Stages][(D + VOnesRows) * kBlockKV * VBytes];
  alignas(1024) uint8_t q_raw[QStage ? kBlockQ<D> * kQRawBoxes * 128 : 16];  // the stage's fp16/bf16 tile
  alignas(8) uint64_t full[Stages];
  alignas(8) uint64_t empty[Stages];
  // The Q stage: raw tile landed; buffer i quantized (stage -> consumers); buffer i read
  // and its epilogue staging done (consumers -> stage).
  alignas(8) uint64_t q_raw_full;
  uint64_t q_full[2];
  uint64_t q_empty[2];
  float q_scale[2][QStage ? kBlockQ<D> : 1];  // per row of the tile, per buffer
  float reduce[4 * kConsumers];
  double q_sum[4 * kConsumers][D];  // Q smoothing: column sums per consumer warp
  float q_mean[kConsumers][D];      // Q smoothing: the tile mean, one copy per warpgroup
  float key_bias[kConsumers][2][kBlockKV];  // Q smoothing: dS per key, [warpgroup][tile parity]

  // Thread 0 initializes the barriers; every thread then writes the rows of ones (E4M3 1.0,
  // 0x38, in every byte) below each stage's V tile that the row sum's PV MMA reads
  // (RowSum::pv_mma; the TMA loads never write them). The caller syncs the CTA after.
  __device__ void init(int threads) {
    if (threadIdx.x == 0) {
      for (int i = 0; i < Stages; ++i) {
        mbar_init(&full[i], 1);
        mbar_init(&empty[i], 4 * kConsumers);  // one arrival per consumer warp
      }
      mbar_init(&q_raw_full, 1);
      for (int i = 0; i < 2; ++i) {
        mbar_init(&q_full[i], 1);
        mbar_init(&q_empty[i], 4 * kConsumers);
      }
      fence_barrier_init();
    }
    if constexpr (VOnesRows > 0) {
      constexpr int kWords = VOnesRows * kBlockKV / 4;
      for (int i = threadIdx.x; i < Stages * kWords; i += threads)
        reinterpret_cast<uint32_t*>(v[i / kWords] + D * kBlockKV)[i % kWords] = 0x38383838u;
      fence_proxy_async();  // the PV MMA reads them through the async proxy
    }
  }
};

// The dynamic shared memory, aligned to 1024 bytes (the launch adds the slack).
template <class Storage>
__device__ __forceinline__ Storage& shared_storage() {
  extern __shared__ uint8_t smem_raw[];
  return *reinterpret_cast<Storage*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
}

}  // namespace sage::sm90
