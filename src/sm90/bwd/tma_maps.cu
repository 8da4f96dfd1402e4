#include "sm90/bwd/tma_maps.h"

#include "sm90/bwd/kernel_traits.h"
#include "sm90/fwd/tma_maps.h"

namespace sage::sm90::bwd {

namespace {

CUtensorMap map_u8_2d(void* base, uint64_t inner, uint64_t outer, uint32_t box_inner, uint32_t box_outer,
                      const char* what) {
  const cuuint64_t dims[2] = {inner, outer};
  const cuuint64_t strides[1] = {inner};
  const cuuint32_t box[2] = {box_inner, box_outer};
  // The swizzle span is the box's row: 64 or 128 bytes.
  return encode_tensor_map(CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, base, dims, strides, box,
                           box_inner == 128 ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_64B, what);
}

uint64_t stride_bytes(int64_t stride, int extent) { return extent > 1 ? uint64_t(stride) * 2 : 16; }

// A 16-bit [b][h][n][D] view; boxes of `rows` x 64 elements (one 128-byte swizzle span).
CUtensorMap map_view(const void* base, int64_t sb, int64_t sh, int64_t sn, int batch, int heads, int n,
                     int d, uint32_t rows, const char* what) {
  const cuuint64_t dims[4] = {uint64_t(d), uint64_t(n), uint64_t(heads), uint64_t(batch)};
  const cuuint64_t strides[3] = {stride_bytes(sn, n), stride_bytes(sh, heads), stride_bytes(sb, batch)};
  const cuuint32_t box[4] = {64, rows, 1, 1};
  return encode_tensor_map(CU_TENSOR_MAP_DATA_TYPE_UINT16, 4, const_cast<void*>(base), dims, strides, box,
                           CU_TENSOR_MAP_SWIZZLE_128B, what);
}

}  // namespace

bool view_tma_compatible(const void* base, int64_t sb, int64_t sh, int64_t sn, int batch, int heads, int n) {
  auto ok = [](int64_t stride, int extent) { return extent <= 1 || (stride > 0 && stride % 8 == 0); };
  return reinterpret_cast<uintptr_t>(base) % 16 == 0 && ok(sn, n) && ok(sh, heads) && ok(sb, batch);
}

BackwardMaps make_backward_maps(const BackwardParams& p, int d) {
  BackwardMaps m;
  const uint64_t kvh = uint64_t(p.batch) * p.heads_kv, bh = uint64_t(p.batch) * p.heads_q;
  m.k8 = map_u8_2d(const_cast<int8_t*>(p.k8), uint64_t(d), kvh * p.n_pad, uint32_t(d), kBlockKV, "backward K'");
  m.v = map_view(p.v, p.v_sb, p.v_sh, p.v_sn, p.batch, p.heads_kv, p.n_kv, d, kBlockKV, "backward V");
  m.q8 = map_u8_2d(p.q8, uint64_t(d), bh * p.n_q_pad, uint32_t(d), kBlockQ, "backward Q codes");
  m.q8t = map_u8_2d(p.q8t, uint64_t(p.n_q_pad), bh * d, kBlockQ, uint32_t(d), "backward Q^T codes");
  m.dout = map_view(p.dout, p.do_sb, p.do_sh, p.do_sn, p.batch, p.heads_q, p.n_q, d, kBlockQ, "backward dO");
  m.do8t = map_u8_2d(p.do8t, uint64_t(p.n_q_pad), bh * d, kBlockQ, uint32_t(d), "backward dO^T codes");
  return m;
}

}  // namespace sage::sm90::bwd
