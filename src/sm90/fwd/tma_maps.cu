#include "sm90/fwd/tma_maps.h"

#include <cudaTypedefs.h>

#include <string>

#include "sage/error.h"

namespace sage::sm90 {

namespace {

// The driver entry point is looked up at run time so that no binary links libcuda: the
// library must load on machines without a GPU driver.
PFN_cuTensorMapEncodeTiled_v12000 encode_fn() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult status;
    const cudaError_t err =
        cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault, &status);
    if (err != cudaSuccess || status != cudaDriverEntryPointSuccess || ptr == nullptr)
      throw CudaError("cuTensorMapEncodeTiled is not available from the CUDA driver");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(ptr);
  }();
  return fn;
}

CUtensorMap encode_2d_u8(void* base, uint64_t inner, uint64_t outer, uint32_t box_inner,
                         uint32_t box_outer, CUtensorMapSwizzle swizzle) {
  CUtensorMap map;
  const cuuint64_t dims[2] = {inner, outer};
  const cuuint64_t strides[1] = {inner};  // bytes between rows
  const cuuint32_t box[2] = {box_inner, box_outer};
  const cuuint32_t elem_strides[2] = {1, 1};
  const CUresult r = encode_fn()(&map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, base, dims, strides, box,
                                 elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle,
                                 CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                                 CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    throw CudaError("cuTensorMapEncodeTiled failed with CUresult " + std::to_string(int(r)));
  return map;
}

// The stride of a dimension of extent 1 is never applied; TMA still wants a multiple of 16.
uint64_t q_stride_bytes(int64_t stride, int extent) {
  return extent > 1 ? uint64_t(stride) * 2 : 16;
}

}  // namespace

CUtensorMap encode_tensor_map(CUtensorMapDataType type, cuuint32_t rank, void* base, const cuuint64_t* dims,
                              const cuuint64_t* strides, const cuuint32_t* box, CUtensorMapSwizzle swizzle,
                              const char* what) {
  CUtensorMap map;
  const cuuint32_t elem_strides[5] = {1, 1, 1, 1, 1};
  const CUresult r = encode_fn()(&map, type, rank, base, dims, strides, box, elem_strides,
                                 CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                                 CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    throw CudaError(std::string("cuTensorMapEncodeTiled (") + what + ") failed with CUresult " +
                    std::to_string(int(r)));
  return map;
}

bool q_tma_compatible(const AttentionParams& p) {
  auto ok = [](int64_t stride, int extent) { return extent <= 1 || (stride > 0 && stride % 8 == 0); };
  return reinterpret_cast<uintptr_t>(p.q) % 16 == 0 && ok(p.q_stride_n, p.n_q) &&
         ok(p.q_stride_h, p.heads_q) && ok(p.q_stride_b, p.batch);
}

AttentionMaps make_attention_maps(const AttentionParams& p, int head_dim, int v_bytes) {
  const uint64_t kv_heads = uint64_t(p.batch) * p.heads_kv;
  AttentionMaps m;
  // K rows are the workspace's kv_layout_head_dim bytes; a box is one swizzle span of them
  // (the kernel loads row / span boxes per tile: qk_layout.cuh, kernel_traits k_swizzle_bytes).
  const KernelTraits t = kernel_traits(head_dim, Variant{});
  const uint32_t row = uint32_t(t.qk_row_bytes), span = uint32_t(t.k_swizzle_bytes);
  m.k = encode_2d_u8(p.kv.k, row, kv_heads * p.n_pad, span, kBlockKV,
                     span == 128 ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_64B);
  // V rows hold n_pad tokens of v_bytes each; a box is one 128-byte swizzle span (128 8-bit
  // tokens, or 64 fp16 ones: the kernel loads two boxes per fp16 tile) of the head's first
  // head_dim (the kernel's) of its `row` channel rows.
  m.v = encode_2d_u8(p.kv.vt, uint64_t(p.n_pad) * v_bytes, kv_heads * row, 128, head_dim,
                     CU_TENSOR_MAP_SWIZZLE_128B);
  m.q = CUtensorMap{};
  if (p.q_stage) {
    // The caller's head dim: columns past it (and past the tensor) arrive as zeros.
    const cuuint64_t dims[4] = {uint64_t(p.head_dim), uint64_t(p.n_q), uint64_t(p.heads_q),
                                uint64_t(p.batch)};
    const cuuint64_t strides[3] = {q_stride_bytes(p.q_stride_n, p.n_q),
                                   q_stride_bytes(p.q_stride_h, p.heads_q),
                                   q_stride_bytes(p.q_stride_b, p.batch)};
    const cuuint32_t box[4] = {64, uint32_t(tile_config(head_dim).block_q), 1, 1};
    const cuuint32_t elem_strides[4] = {1, 1, 1, 1};
    const CUresult r = encode_fn()(&m.q, CU_TENSOR_MAP_DATA_TYPE_UINT16, 4, const_cast<void*>(p.q),
                                   dims, strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                                   CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                                   CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS)
      throw CudaError("cuTensorMapEncodeTiled (Q) failed with CUresult " + std::to_string(int(r)));
  }
  return m;
}

}  // namespace sage::sm90
