// The backward CTA's shared memory as the kernel's parts see it: typed pointers into the
// layout of kernel_traits.h (SmemLayout), the barriers, and the wgmma descriptors of every
// operand tile. One struct, built once per thread from the dynamic shared-memory base.
#pragma once

#include <cstdint>

#include "common/ptx.cuh"
#include "sm90/bwd/kernel_traits.h"

namespace sage::sm90::bwd {

// Named barriers (0 is __syncthreads): among the 256 consumer threads.
// kTurn: deterministic mode's turn taking (order.cuh). kDqStaged: the dQ tile is in shared
// memory, for the one thread that adds it to the workspace.
enum BwdBarrier : int { kDsAmax = 1, kDsStored = 2, kTurn = 3, kDqStaged = 4 };

template <int D>
struct Smem {
  static constexpr SmemLayout L = smem_layout(D);
  static constexpr int kKSpan = D;  // K' and Q rows: one swizzle span (64 or 128 bytes)
  uint8_t* base;

  __device__ __forceinline__ explicit Smem(uint8_t* b) : base(b) {}
  __device__ __forceinline__ uint8_t* k8() const { return base + L.k8; }
  __device__ __forceinline__ uint8_t* kt8() const { return base + L.kt8; }
  __device__ __forceinline__ uint8_t* v() const { return base + L.v; }
  __device__ __forceinline__ uint8_t* ds8() const { return base + L.ds8; }
  __device__ __forceinline__ float* dq() const { return reinterpret_cast<float*>(base + L.dq); }
  __device__ __forceinline__ uint8_t* stage(int s) const { return base + L.stages + s * L.stage.bytes; }
  __device__ __forceinline__ uint8_t* q8(int s) const { return stage(s) + L.stage.q8; }
  __device__ __forceinline__ uint8_t* qt8(int s) const { return stage(s) + L.stage.qt8; }
  __device__ __forceinline__ uint8_t* dout(int s) const { return stage(s) + L.stage.dout; }
  __device__ __forceinline__ uint8_t* dot8(int s) const { return stage(s) + L.stage.dot8; }
  __device__ __forceinline__ float* l2(int s) const { return reinterpret_cast<float*>(stage(s) + L.stage.l2); }
  __device__ __forceinline__ float* delta(int s) const { return reinterpret_cast<float*>(stage(s) + L.stage.delta); }
  // The dS amax slots of a tile parity (tile index & 1: a fast warpgroup's next tile never
  // writes what the other still reads).
  __device__ __forceinline__ float* red(int parity) const {
    return reinterpret_cast<float*>(base + L.red) + kBlockQ * parity;
  }
  __device__ __forceinline__ uint64_t* full(int s) const { return reinterpret_cast<uint64_t*>(base + L.bars) + s; }
  __device__ __forceinline__ uint64_t* empty(int s) const {
    return reinterpret_cast<uint64_t*>(base + L.bars) + kStages + s;
  }
  __device__ __forceinline__ uint64_t* kv_full() const {
    return reinterpret_cast<uint64_t*>(base + L.bars) + 2 * kStages;
  }

  // ---- descriptors (k slices of 32 bytes: k32 for INT8, k16 for 16-bit) ----
  // S^T's A: keys [64c, 64c + 64) of K', k slice kc (D-byte rows).
  __device__ __forceinline__ uint64_t k_desc(int c, int kc) const {
    return smem_desc<kKSpan>(smem_desc_lo(k8()), uint32_t(64 * c * kKSpan + 32 * kc));
  }
  // S^T's B: the Q codes, k slice kc.
  __device__ __forceinline__ uint64_t q_desc(int s, int kc) const {
    return smem_desc<kKSpan>(smem_desc_lo(q8(s)), uint32_t(32 * kc));
  }
  // dP^T's A: keys [64c, 64c + 64) of V, k16 slice kc (column block kc / 4 of [128][64]).
  __device__ __forceinline__ uint64_t v_desc(int c, int kc) const {
    return smem_desc<128>(smem_desc_lo(v()), uint32_t((kc / 4) * kBlockKV * 128 + 64 * c * 128 + 32 * (kc % 4)));
  }
  // dP^T's B: dO, k16 slice kc (column block kc / 4 of [64][64]).
  __device__ __forceinline__ uint64_t dout_desc(int s, int kc) const {
    return smem_desc<128>(smem_desc_lo(dout(s)), uint32_t((kc / 4) * kBlockQ * 128 + 32 * (kc % 4)));
  }
  // dV's and dK's B: channels from ch (a multiple of 8) of dO^T / Q^T ([D][64], 64-byte
  // rows), k32 slice ks of the rows.
  __device__ __forceinline__ uint64_t dot_desc(int s, int ch, int ks) const {
    return smem_desc<64>(smem_desc_lo(dot8(s)), uint32_t(ch * 64 + 32 * ks));
  }
  __device__ __forceinline__ uint64_t qt_desc(int s, int ch, int ks) const {
    return smem_desc<64>(smem_desc_lo(qt8(s)), uint32_t(ch * 64 + 32 * ks));
  }
  // dQ's A: the dS codes [64 rows][128 key positions], k32 slice ks.
  __device__ __forceinline__ uint64_t ds_desc(int ks) const {
    return smem_desc<128>(smem_desc_lo(ds8()), uint32_t(32 * ks));
  }
  // dQ's B: channels [c D/2, (c+1) D/2) of K'^T [D][128 key positions], k32 slice ks.
  __device__ __forceinline__ uint64_t kt_desc(int c, int ks) const {
    return smem_desc<128>(smem_desc_lo(kt8()), uint32_t(c * (D / 2) * 128 + 32 * ks));
  }
};

}  // namespace sage::sm90::bwd
