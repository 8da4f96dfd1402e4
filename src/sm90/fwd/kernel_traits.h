// The one place where the forward kernel's shape is decided: which head dims have a kernel,
// which kernel variants exist (PV operand path, K scale layout, Q smoothing), and, per
// variant, the tile sizes, warpgroups, pipeline depth, register budgets and swizzle.
//
// Plain constexpr C++ (no CUDA headers): the host dispatch, the argument checks of a build
// without CUDA, the CLI and the tests read the same answers as the kernel.
//
// What the numerics can see of the tile (which tokens share a quantization scale) is
// numerics/tile.h's tile_config; the traits build on it and never contradict it.
#pragma once

#include "numerics/quant_rules.h"
#include "numerics/tile.h"
#include "quant/kv_layout.h"

// The head dims with a Hopper kernel, the only list of them: src/sm90/fwd/instantiate.cmake
// reads this line to know what it may instantiate (SAGE_HEAD_DIMS picks a subset), and
// sage::gpu_head_dim_list() gives it in a build without CUDA. Each is a tile of
// numerics/tile.h's kernel_head_dim; the other multiples of 8 from 32 up run on the next one
// with zero channels (the kernel's Q loads and output stores are bounded by the caller's dim,
// the workspace is padded: quant/kv_layout.h). 96: the d = 128 kernel with n = 96 PV MMAs and
// three k32 QK MMAs over 128-byte K rows (sm90/fwd/qk_layout.cuh), two consumer warpgroups, no
// row sum from the PV MMA (as at 64: below rules::kRowSumMmaMinHeadDim), the Q stage. 256: two
// 128-byte column blocks per K/Q row, eight k32 QK MMAs, the PV MMA in two column ranges of
// 128 (pv_operand.cuh kSplits: O alone is 128 registers, the whole fp32 product would be 128
// more) with the row sum's ones block in the second (n = 136: no n = 264 MMA exists), one tile
// at a time, two stages and no Q stage (shared memory), no fp16-PV variant (variant_has_kernel).
// 192 (MLA's Q/K): the d = 256 kernel's shape on the same 256-byte workspace rows, with six
// k32 QK MMAs (the last two of 256 would only multiply zeros) and PV column ranges of 96 (the
// ones block in the second: n = 104).
#define SAGE_SUPPORTED_HEAD_DIMS(X) X(64) X(96) X(128) X(192) X(256)

namespace sage::sm90 {

// The P V operand policies (pv_operand.cuh): which formats P and V take and how their
// products accumulate. One kernel instantiation per path.
enum class PVPath : int {
  e4m3_two_level,  // SageAttention2: E4M3 P and V, FP8 MMA inside a tile, fp32 across tiles
  e4m3_fp16x2,     // SageAttention2++: E4M3 P and V, f16 accumulator over two k32 MMAs
  fp16,            // SageAttention (T/B): fp16 P and V, f16 accumulator over a tile
  int8,            // SageAttention (vT/vB), INT-FlashAttention: INT8 P and V, s32 per tile
  // SageBwd's forward: INT8 P with one scale per row and tile from the softmax's own maxima
  // (PScale::per_token) and INT8 V with one scale per K/V tile (VScale::per_block); s32 per
  // tile, both scales applied with one fma as the tile folds into O.
  int8_dynamic,
};

// How the K scales are stored: a few groups per 128-token tile (per_thread / per_block /
// per_tensor, quant::kKScalesPerTile slots) or one per token (per_token, prequantized inputs).
enum class KScales : int { per_tile, per_token };

// The V format the quantizer writes for a path (quant/kv_layout.h).
constexpr quant::VFormat v_format(PVPath path) {
  return path == PVPath::fp16 ? quant::VFormat::fp16
         : path == PVPath::int8 || path == PVPath::int8_dynamic ? quant::VFormat::int8
                                : quant::VFormat::e4m3;
}
// Bytes per element of the transposed V tile each path streams.
constexpr int v_bytes(PVPath path) { return quant::v_format_bytes(v_format(path)); }

// Rows of E4M3 ones under each V stage (RowSum::pv_mma: the PV MMA's extra n8 block sums P),
// where the kernel takes the row sum from the PV MMA: the two-level E4M3 path from head dim
// rules::kRowSumMmaMinHeadDim (the dispatch holds recipes to rules::row_sum_in_pv_mma).
constexpr int v_ones_rows(int head_dim, PVPath path) {
  return path == PVPath::e4m3_two_level && head_dim >= rules::kRowSumMmaMinHeadDim ? 8 : 0;
}

// Whether a variant has a second instantiation with the Q stage (q_stage.cuh): the
// SageAttention2 default path without Q smoothing (whose tile mean and dS the consumers
// compute). Only there, to keep the instantiations and compile time in check; the other
// variants always quantize Q in the consumers' prologue.
// Not above d = 128: the second Q buffer and the raw tile (96 KiB at d = 256) do not fit
// beside the K/V ring.
constexpr bool q_stage_capable(PVPath path, bool smooth_q, int head_dim) {
  return path == PVPath::e4m3_two_level && !smooth_q && head_dim <= 128;
}

// Whether a PV path has a kernel at a head dim (instantiate.cmake skips the others; the dispatch
// refuses their recipes by name): fp16 V at d = 256 takes 64 KiB per stage, and two stages, the
// K tiles and the Q tile exceed the 227 KiB of shared memory; SageBwd's int8_dynamic path has
// no split PV MMA (pv_operand.cuh) and its backward exists at d = 64 and 128 only.
constexpr bool variant_has_kernel(int head_dim, PVPath path) {
  return !(head_dim > 128 && (path == PVPath::fp16 || path == PVPath::int8_dynamic));
}

// A kernel variant: what a recipe maps onto (api/dispatch.cu) and what is instantiated.
struct Variant {
  PVPath path;
  KScales k_scales;
  bool smooth_q;
};

struct KernelTraits {
  int block_q;          // Q rows per CTA: 64 per consumer warpgroup
  int block_kv;         // K/V tokens per pipeline stage (the quantized layout's tile)
  int consumers;        // consumer warpgroups; warpgroup 0 is the producer
  int threads;          // 128 per warpgroup
  int stages;           // K/V ring depth
  int producer_regs;    // setmaxnreg budgets: the producer gives registers ...
  int consumer_regs;    // ... to the consumers, within the CTA's launch allocation
  int launch_regs;      // per thread at launch (__launch_bounds__(threads, 1))
  bool overlap_pv;      // the intra-warpgroup pipeline (QK of tile i beside PV of tile i-1)
  int v_ones_rows;      // see v_ones_rows()
  int v_bytes;          // bytes per V element in shared memory
  int qk_row_bytes;     // bytes per K and Q row in shared memory (quant::kv_layout_head_dim)
  int k_swizzle_bytes;  // the K and Q tiles' swizzle span: 64 at d = 64, else 128 (qk_layout.cuh)
  int v_swizzle_bytes;  // V tile rows are block_kv * v_bytes bytes, one 128-byte span per box
};

// The kernel's shape for one variant and head dim. The element type of Q and the output
// (fp16 or bf16) changes no choice here: both are two bytes.
constexpr KernelTraits kernel_traits(int head_dim, Variant v) {
  KernelTraits t{};
  const TileConfig tile = tile_config(head_dim);
  t.block_q = tile.block_q;
  t.block_kv = tile.block_kv;
  t.consumers = consumer_warpgroups(head_dim);
  t.threads = 128 * (1 + t.consumers);
  // 3: the pipelined consumers hold two stages (tile i's K, tile i-1's V), so the producer
  // runs one K/V tile ahead of them (deeper rings were no faster: v15, v19g in
  // docs/history/README.md).
  // 2 above d = 128: a stage is 64 KiB there (K 32 KiB, V 33 KiB with its ones rows), and the
  // tiles run one at a time anyway.
  t.stages = head_dim > 128 ? 2 : 3;
  t.launch_regs = 65536 / t.threads / 8 * 8;
  t.producer_regs = 24;
  // All that is left to the consumers: 240 at d = 128, 160 at d = 64.
  t.consumer_regs = (t.launch_regs * t.threads - t.producer_regs * 128) / (128 * t.consumers) / 8 * 8;
  // The software pipeline, except where ptxas (CUDA 13.0) spilled it heavily: at d = 128
  // INT8 and f16-pair PV; at d = 64 Q smoothing and per-token K scales (docs/design.md).
  // int8_dynamic (SageBwd) runs one tile at a time: its per-tile P and V scales would be one
  // more pending pair in the pipeline, not written yet (correctness first).
  t.overlap_pv = v.path == PVPath::int8_dynamic ? false
                 : head_dim > 128              ? false  // the split PV MMA (pv_operand.cuh)
                 : head_dim <= 64              ? v.k_scales == KScales::per_tile && !v.smooth_q
                                               : v.path == PVPath::e4m3_two_level || v.path == PVPath::fp16;
  t.v_ones_rows = v_ones_rows(head_dim, v.path);
  t.v_bytes = v_bytes(v.path);
  t.qk_row_bytes = quant::kv_layout_head_dim(head_dim);
  t.k_swizzle_bytes = t.qk_row_bytes < 128 ? t.qk_row_bytes : 128;
  t.v_swizzle_bytes = 128;
  return t;
}

// Tokens per K/V tile: the online-softmax block and the unit of the quantized K/V layout.
constexpr int kBlockKV = quant::kKVTile;
template <int D>
constexpr int kBlockQ = tile_config(D).block_q;
template <int D>
constexpr int kConsumerWarpgroups = consumer_warpgroups(D);

// setmaxnreg only moves registers within the CTA's launch allocation; an increase past it
// never returns (a 32-register producer beside 240-register consumers hung the GPU tests).
constexpr bool register_budgets_fit(const KernelTraits& t) {
  return t.producer_regs * 128 + t.consumer_regs * 128 * t.consumers <= t.launch_regs * t.threads;
}
#define SAGE_CHECK_TRAITS(D)                                                                    \
  static_assert(kernel_head_dim(D) == D, "an instantiated head dim must be a tile of kernel_head_dim"); \
  static_assert(tile_config(D).block_kv == kBlockKV, "the quantizer's K/V tile and tile.h differ"); \
  static_assert(register_budgets_fit(kernel_traits(D, {PVPath::int8, KScales::per_tile, false})), \
                "setmaxnreg budgets exceed the CTA's launch allocation");
SAGE_SUPPORTED_HEAD_DIMS(SAGE_CHECK_TRAITS)
#undef SAGE_CHECK_TRAITS

}  // namespace sage::sm90
