// Warp-level MMAs of the backward (mma.sync, m16n8): INT8 m16n8k32 with an exact s32
// accumulator, and fp16/bf16 m16n8k16 with an fp32 accumulator, their operands loaded from
// shared memory one 32-bit register at a time.
//
// Fragment layouts (PTX ISA, mma.m16n8k32 .s8 and mma.m16n8k16 .f16/.bf16), g = lane / 4,
// t = lane % 4:
//   C (16 x 8):  c[0], c[1] row g, cols 2t, 2t + 1;  c[2], c[3] row g + 8, same cols
//   A int8 (16 x 32, row):  a[0] row g, k 4t..4t+3;  a[1] row g+8;  a[2], a[3] k + 16
//   B int8 (32 x 8, col):   b[0] k 4t..4t+3, col g;  b[1] k + 16
//   A 16-bit (16 x 16):     a[0] row g, k 2t, 2t+1;  a[1] row g+8;  a[2], a[3] k + 8
//   B 16-bit (16 x 8):      b[0] k 2t, 2t+1, col g;  b[1] k + 8
// A is stored [m][k] and B [n][k] (k contiguous), so every register is one aligned load.
//
// Why mma.sync and not wgmma: a first, correct version (issue 33 asks for correctness first);
// the warpgroup MMAs with TMA-fed, swizzled tiles are the speed step (docs/design.md).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace sage::sm90::bwd {

__device__ __forceinline__ uint32_t lds32(const uint8_t* base, int byte_offset) {
  return *reinterpret_cast<const uint32_t*>(base + byte_offset);
}

__device__ __forceinline__ void mma_s8(int32_t (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

template <class T>
__device__ __forceinline__ void mma_16bit(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  if constexpr (std::is_same_v<T, __half>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
}

// The A fragment of rows m0.. m0 + 15, k slice k0.. of an int8 [m][ld] matrix.
__device__ __forceinline__ void load_a8(uint32_t (&a)[4], const uint8_t* s, int ld, int m0, int k0, int lane) {
  const int g = lane / 4, t = lane % 4;
  a[0] = lds32(s, (m0 + g) * ld + k0 + 4 * t);
  a[1] = lds32(s, (m0 + g + 8) * ld + k0 + 4 * t);
  a[2] = lds32(s, (m0 + g) * ld + k0 + 16 + 4 * t);
  a[3] = lds32(s, (m0 + g + 8) * ld + k0 + 16 + 4 * t);
}
// The B fragment of columns n0.. n0 + 7, k slice k0.. of an int8 [n][ld] matrix.
__device__ __forceinline__ void load_b8(uint32_t (&b)[2], const uint8_t* s, int ld, int n0, int k0, int lane) {
  const int g = lane / 4, t = lane % 4;
  b[0] = lds32(s, (n0 + g) * ld + k0 + 4 * t);
  b[1] = lds32(s, (n0 + g) * ld + k0 + 16 + 4 * t);
}
// The same for 16-bit [m][ld] / [n][ld] matrices (ld and k in elements).
__device__ __forceinline__ void load_a16(uint32_t (&a)[4], const uint8_t* s, int ld, int m0, int k0, int lane) {
  const int g = lane / 4, t = lane % 4;
  a[0] = lds32(s, 2 * ((m0 + g) * ld + k0 + 2 * t));
  a[1] = lds32(s, 2 * ((m0 + g + 8) * ld + k0 + 2 * t));
  a[2] = lds32(s, 2 * ((m0 + g) * ld + k0 + 8 + 2 * t));
  a[3] = lds32(s, 2 * ((m0 + g + 8) * ld + k0 + 8 + 2 * t));
}
__device__ __forceinline__ void load_b16(uint32_t (&b)[2], const uint8_t* s, int ld, int n0, int k0, int lane) {
  const int g = lane / 4, t = lane % 4;
  b[0] = lds32(s, 2 * ((n0 + g) * ld + k0 + 2 * t));
  b[1] = lds32(s, 2 * ((n0 + g) * ld + k0 + 8 + 2 * t));
}

}  // namespace sage::sm90::bwd
