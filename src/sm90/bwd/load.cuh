// The backward CTA's shared-memory operands: once per CTA its K/V tile (K' codes, both
// orientations, and V), once per Q tile the Q and dO operands and the rows' L2 and D.
// Plain vector loads from global memory (any strides of the 16-bit views: rows are 16-byte
// aligned, which the dispatch checks); tokens past n_q / n_kv are zeros.
#pragma once

#include <cstdint>

#include "sm90/bwd/kernel_traits.h"
#include "sm90/bwd/params.h"

namespace sage::sm90::bwd {

// K' codes [128][D] and their transpose, V [128][D] (16-bit).
template <int D, class T>
__device__ __forceinline__ void load_kv_tile(const BackwardParams& p, uint8_t* smem, int64_t kvh,
                                             int hk, int b, int j0) {
  constexpr SmemLayout L = smem_layout(D);
  const uint4* k_src = reinterpret_cast<const uint4*>(p.k8 + (kvh * p.n_pad + j0) * D);
  uint4* k_dst = reinterpret_cast<uint4*>(smem + L.k8);
  for (int e = threadIdx.x; e < kBlockKV * D / 16; e += kThreads) k_dst[e] = k_src[e];
  const T* v = static_cast<const T*>(p.v) + b * p.v_sb + hk * p.v_sh;
  for (int e = threadIdx.x; e < kBlockKV * D / 8; e += kThreads) {
    const int r = e / (D / 8), c8 = e % (D / 8);
    uint4 x = make_uint4(0, 0, 0, 0);
    if (j0 + r < p.n_kv) x = *reinterpret_cast<const uint4*>(v + (int64_t)(j0 + r) * p.v_sn + 8 * c8);
    reinterpret_cast<uint4*>(smem + L.v)[e] = x;
  }
  __syncthreads();
  const int8_t* k8 = reinterpret_cast<const int8_t*>(smem + L.k8);
  int8_t* kt8 = reinterpret_cast<int8_t*>(smem + L.kt8);
  for (int e = threadIdx.x; e < kBlockKV * D; e += kThreads) {
    const int c = e / kBlockKV, j = e % kBlockKV;
    kt8[e] = k8[j * D + c];
  }
  // (the caller synchronizes before the first read)
}

// Q codes [64][D] and transposed, dO [64][D] (16-bit), dO codes transposed [D][64], L2 and D.
template <int D, class T>
__device__ __forceinline__ void load_q_tile(const BackwardParams& p, uint8_t* smem, int64_t bh,
                                            int h, int b, int i0) {
  constexpr SmemLayout L = smem_layout(D);
  const int8_t* q8 = p.q8 + (bh * p.n_q_pad + i0) * D;
  const int8_t* do8 = p.do8 + (bh * p.n_q_pad + i0) * D;
  for (int e = threadIdx.x; e < kBlockQ * D / 16; e += kThreads)
    reinterpret_cast<uint4*>(smem + L.q8)[e] = reinterpret_cast<const uint4*>(q8)[e];
  int8_t* qt8 = reinterpret_cast<int8_t*>(smem + L.qt8);
  int8_t* dot8 = reinterpret_cast<int8_t*>(smem + L.dot8);
  for (int e = threadIdx.x; e < kBlockQ * D; e += kThreads) {
    const int c = e / kBlockQ, a = e % kBlockQ;
    qt8[e] = q8[a * D + c];
    dot8[e] = do8[a * D + c];
  }
  const T* dout = static_cast<const T*>(p.dout) + b * p.do_sb + h * p.do_sh;
  for (int e = threadIdx.x; e < kBlockQ * D / 8; e += kThreads) {
    const int a = e / (D / 8), c8 = e % (D / 8);
    uint4 x = make_uint4(0, 0, 0, 0);
    if (i0 + a < p.n_q) x = *reinterpret_cast<const uint4*>(dout + (int64_t)(i0 + a) * p.do_sn + 8 * c8);
    reinterpret_cast<uint4*>(smem + L.dout)[e] = x;
  }
  if (threadIdx.x < kBlockQ) {
    const int a = threadIdx.x;
    const bool in = i0 + a < p.n_q;
    reinterpret_cast<float*>(smem + L.l2)[a] = in ? p.lse2[bh * p.n_q + i0 + a] : -INFINITY;
    reinterpret_cast<float*>(smem + L.delta)[a] = in ? p.delta[bh * p.n_q + i0 + a] : 0.f;
  }
}

}  // namespace sage::sm90::bwd
