// Thin wrappers over the sm_90a instructions the Hopper kernels use: mbarriers, TMA bulk
// tensor loads, warpgroup MMA bookkeeping, register reallocation and packed conversions.
// Each wrapper is one instruction; the "why" of when to call them lives at the call sites.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>
#include <cstdint>

namespace sage::sm90 {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// ---- mbarrier ------------------------------------------------------------------------------

__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count));
}

__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)),
               "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}

__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t phase) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n"
      "}\n" ::"r"(smem_addr(bar)),
      "r"(phase)
      : "memory");
}

// A wait that costs no issue slots: a plain try_wait returns after a short system-defined
// time, so a spinning warp re-issues it every few cycles, slots taken from the consumer warps
// on its scheduler. With a suspend-time hint the thread sleeps until the phase completes (or
// the hint, in ns, runs out). The Q stage's warps wait so; the K/V producer's one thread
// spins, where a suspending wait was no faster (v9, v19g in docs/history/README.md).
__device__ __forceinline__ void mbar_wait_sleeping(uint64_t* bar, uint32_t phase) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1, %2;\n"
      "@!done bra WAIT_%=;\n"
      "}\n" ::"r"(smem_addr(bar)),
      "r"(phase), "r"(1000000u)
      : "memory");
}

__device__ __forceinline__ void fence_barrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// ---- split cluster barrier -------------------------------------------------------------------

// The two halves of cluster.sync(), for a CTA that must stay resident until its cluster
// peers have read its shared memory but has other work to do meanwhile.
__device__ __forceinline__ void cluster_arrive_release() {
  asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
}
__device__ __forceinline__ void cluster_wait_acquire() {
  asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// ---- programmatic dependent launch ----------------------------------------------------------

// Lets the next kernel in the stream, launched with programmatic stream serialization, start
// once every CTA of this grid has executed this (or exited).
__device__ __forceinline__ void launch_dependent_grids() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}
// Waits until the grids this one depends on have completed and their writes are visible;
// returns at once in a kernel launched without programmatic serialization.
__device__ __forceinline__ void grid_dependency_wait() {
  asm volatile("griddepcontrol.wait;" ::: "memory");
}

// ---- TMA -----------------------------------------------------------------------------------

// Brings a global line into L2 without waiting for it or holding a register.
__device__ __forceinline__ void prefetch_l2(const void* ptr) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(ptr));
}

__device__ __forceinline__ void prefetch_tma_descriptor(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

// 2-D tile load; coordinates are (innermost, outer) in elements.
__device__ __forceinline__ void tma_load_2d(void* dst, const CUtensorMap* map, uint64_t* bar,
                                            int x, int y) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4}], [%2];" ::"r"(smem_addr(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_addr(bar)), "r"(x), "r"(y)
      : "memory");
}

// 1-D bulk copy of `bytes` (a multiple of 16, both addresses 16-byte aligned) into shared
// memory, completing on the barrier's transaction count.
__device__ __forceinline__ void bulk_load_1d(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
          smem_addr(dst)),
      "l"(reinterpret_cast<uint64_t>(src)), "r"(bytes), "r"(smem_addr(bar))
      : "memory");
}

// 1-D bulk reduce: adds `bytes` (a multiple of 16, both addresses 16-byte aligned) of fp32
// from shared memory into global memory (the adds are performed at L2, element by element),
// in the thread's bulk async-group.
__device__ __forceinline__ void bulk_reduce_add_f32(float* dst, const float* src, uint32_t bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;" ::"l"(
                   reinterpret_cast<uint64_t>(dst)),
               "r"(smem_addr(src)), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
// The thread's bulk groups have read their shared-memory sources (which may then be reused).
__device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory"); }
// The thread's bulk groups are complete (their writes performed).
__device__ __forceinline__ void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }
// Orders the thread's generic-proxy global accesses with its async-proxy ones (bulk copies).
__device__ __forceinline__ void fence_proxy_async_global() {
  asm volatile("fence.proxy.async.global;" ::: "memory");
}

// 4-D tile load; coordinates innermost first, in elements.
__device__ __forceinline__ void tma_load_4d(void* dst, const CUtensorMap* map, uint64_t* bar,
                                            int x, int y, int z, int w) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5, %6}], [%2];" ::"r"(smem_addr(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_addr(bar)), "r"(x), "r"(y), "r"(z), "r"(w)
      : "memory");
}

// ---- warpgroup MMA bookkeeping ---------------------------------------------------------------

__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}

// wgmma reads its register operands and writes its accumulators asynchronously, but the
// compiler sees an ordinary asm statement: without these fences it may schedule reads of the
// accumulators before wgmma.wait_group, or reuse an A-operand register before the MMA has
// read it. Fence every accumulator before the MMA chain and after the wait, and every A
// operand after the wait.
__device__ __forceinline__ void reg_fence(float& r) { asm volatile("" : "+f"(r)::"memory"); }
__device__ __forceinline__ void reg_fence(int32_t& r) { asm volatile("" : "+r"(r)::"memory"); }
__device__ __forceinline__ void reg_fence(uint32_t& r) { asm volatile("" : "+r"(r)::"memory"); }
template <class T, int N>
__device__ __forceinline__ void reg_fence(T (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) reg_fence(r[i]);
}
template <class T, int N, int M>
__device__ __forceinline__ void reg_fence(T (&r)[N][M]) {
#pragma unroll
  for (int i = 0; i < N; ++i) reg_fence(r[i]);
}

template <int Regs>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(Regs));
}
template <int Regs>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(Regs));
}

// Named barrier among `threads` threads (ids 1.. are free: 0 is __syncthreads). `arrive`
// counts toward the barrier without waiting for it.
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// ---- shared-memory matrix descriptors --------------------------------------------------------

// A K-major operand tile whose rows are exactly one swizzle span wide (128 or 64 bytes),
// written by TMA with the matching swizzle. 8-row groups are `8 * row_bytes` apart (SBO);
// the leading offset is unused because one MMA's K slice stays inside a row.
//
// In two halves: the low word carries the start address (>> 4), the high word the stride and
// swizzle, a constant per row width. The K/V loop keeps one low word per tile and adds each
// k slice's byte offset to it. Rebuilt from a pointer for every MMA, the descriptors cost
// ~10 instructions each of address masking, shifts and moves on the warp's issue slots (v17,
// docs/history/README.md).
__device__ __forceinline__ uint32_t smem_desc_lo(const void* tile) {
  return ((smem_addr(tile) & 0x3FFFF) >> 4)  // start address
         | (1u << 16);                        // leading byte offset (unused)
}
// The descriptor `offset` bytes past the tile whose low word is `lo`. Shared memory ends below
// 256 KiB, so the 14-bit address field never carries into the next one.
template <int RowBytes>
__device__ __forceinline__ uint64_t smem_desc(uint32_t lo, uint32_t offset = 0) {
  static_assert(RowBytes == 128 || RowBytes == 64, "one 128B or 64B swizzle span per row");
  constexpr uint32_t hi = ((8 * RowBytes) >> 4)                         // stride byte offset
                          | (uint32_t(RowBytes == 128 ? 1 : 2) << 30);  // 128B or 64B swizzle
  return (uint64_t(hi) << 32) | (lo + (offset >> 4));
}

// Byte offset of (row, byte column) in a K-major tile with rows of `row_bytes` (64 or 128)
// under the matching TMA/wgmma swizzle: 16-byte chunks XORed with the row within the
// 8-row (128B) or 4-row-pair (64B) repeat. The tile base must be aligned to the repeat.
__device__ __forceinline__ int swizzled_offset(int row, int col, int row_bytes) {
  const int chunk = col / 16;
  const int xor_with = row_bytes == 128 ? row % 8 : (row / 2) % 4;
  return row * row_bytes + ((chunk ^ xor_with) * 16) + col % 16;
}

// ---- shared-memory stores and loads ----------------------------------------------------------

// Four 8x8 16-bit matrices into shared memory: piece[i] holds this lane's two elements of
// matrix i (row lane / 4, columns 2 (lane % 4), +1: an MMA accumulator's layout); lane l gives
// the address of row l % 8 of matrix l / 8.
__device__ __forceinline__ void stmatrix_x4(uint32_t addr, const uint32_t (&piece)[4]) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(addr),
               "r"(piece[0]), "r"(piece[1]), "r"(piece[2]), "r"(piece[3])
               : "memory");
}

__device__ __forceinline__ void st_shared_u32(uint32_t addr, uint32_t v) {
  asm volatile("st.shared.u32 [%0], %1;" ::"r"(addr), "r"(v) : "memory");
}

__device__ __forceinline__ void st_shared_v4(uint32_t addr, uint4 v) {
  asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(v.x), "r"(v.y),
               "r"(v.z), "r"(v.w)
               : "memory");
}

__device__ __forceinline__ uint4 ld_shared_v4(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(addr)
               : "memory");
  return v;
}

// ---- conversions -----------------------------------------------------------------------------

// Two floats to two E4M3 bytes: `lo` lands in the low byte (cvt puts its first source high).
__device__ __forceinline__ uint16_t pack_e4m3x2(float lo, float hi) {
  uint16_t r;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
  return r;
}

// x rounded to the nearest integer (ties to even, as rules::round_clamp) in the low mantissa
// bits of the returned word, so the low byte is the code in two's complement (|x| < 2^22):
// adding 1.5 * 2^23 leaves no fraction bits. One FADD instead of a float-to-int conversion,
// which runs at a quarter of the FADD rate. __fadd_rn: the add alone must round, never fused
// with the product that made x.
__device__ __forceinline__ uint32_t round_to_low_bits(float x) {
  return __float_as_uint(__fadd_rn(x, 12582912.f));
}

// The exact float of an integer |x| < 2^22 (an MMA's s32 sum of at most 256 products of two
// INT8 codes: 127 * 127 * 256 < 2^22) with an IADD and an FADD, both full rate, where a
// conversion (I2F) runs at a quarter: 1.5 * 2^23 + x is exact in the mantissa, and
// subtracting 1.5 * 2^23 again leaves x.
__device__ __forceinline__ float small_int_to_float(int32_t x) {
  return __fsub_rn(__int_as_float(x + 0x4B400000), 12582912.f);
}

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

}  // namespace sage::sm90
