// The GPU entry points' own argument checks (alignment, workspace, recipes without a kernel).
// They run before anything touches a device, so they are tested here on host buffers
// labelled as cuda memory; a CPU-only build skips them (its stub is tested in test_args.cpp).
#include <gtest/gtest.h>

#include <memory>
#include <string>

#include "expect_refusal.h"
#include "sage/attention.h"
#include "sage/backward.h"

namespace {

using namespace sage;

#ifdef SAGE_WITH_CUDA
class GpuArgs : public ::testing::Test {
 protected:
  static constexpr int64_t B = 1, H = 2, N = 16, D = 128;
  // 256-byte aligned host storage standing in for device memory (never dereferenced).
  void* storage() {
    buffers_.push_back(std::make_unique<uint8_t[]>(B * H * (N + 8) * D * 2 + 512));
    auto p = reinterpret_cast<uintptr_t>(buffers_.back().get());
    return reinterpret_cast<void*>((p + 255) / 256 * 256);
  }
  AttentionArgs make() {
    AttentionArgs a;
    const Device gpu = Device::cuda(0);
    a.q = contiguous_view(storage(), DType::f16, {B, H, N, D}, gpu);
    a.k = contiguous_view(storage(), DType::f16, {B, H, N, D}, gpu);
    a.v = contiguous_view(storage(), DType::f16, {B, H, N, D}, gpu);
    a.out = contiguous_view(storage(), DType::f16, {B, H, N, D}, gpu);
    return a;
  }
  BackwardArgs make_backward() {
    const AttentionArgs f = make();
    BackwardArgs a;
    a.q = f.q, a.k = f.k, a.v = f.v, a.dout = f.out;
    a.dq = contiguous_view(storage(), DType::f16, {B, H, N, D}, Device::cuda(0));
    a.dk = contiguous_view(storage(), DType::f16, {B, H, N, D}, Device::cuda(0));
    a.dv = contiguous_view(storage(), DType::f16, {B, H, N, D}, Device::cuda(0));
    return a;
  }
  static void expect_error(const AttentionArgs& a, const std::string& argument,
                           const std::string& phrase) {
    EXPECT_REFUSAL(workspace_bytes(a), argument, phrase);
  }
  std::vector<std::unique_ptr<uint8_t[]>> buffers_;
};

TEST_F(GpuArgs, ValidArgumentsGiveAWorkspaceSize) {
  const AttentionArgs a = make();
  const size_t bytes = workspace_bytes(a);
  // Quantized K and V (one byte each, padded to a 128-token tile) plus small scale arrays.
  EXPECT_GE(bytes, size_t(2 * B * H * 128 * D));
  EXPECT_LE(bytes, size_t(2 * B * H * 128 * D + 64 * 1024));
}

TEST_F(GpuArgs, RecipeWithoutKernelIsRefusedByName) {
  AttentionArgs a = make();
  a.recipe = preset("sage3_fp4");
  expect_error(a, "recipe", "'sage3_fp4' has no sm_90 kernel");
  // sagebwd with the paper's quantized row sum has no kernel: the int8_dynamic path sums P~.
  a.recipe = preset("sagebwd");
  a.recipe.name = "sagebwd_qsum";
  a.recipe.row_sum = RowSum::quantized_p;
  expect_error(a, "recipe", "'sagebwd_qsum' has no sm_90 kernel (the GPU path needs row_sum float_p");
  // A custom combination outside the kernels' policies is refused too, naming what is missing.
  a.recipe = preset("sage2_8b");
  a.recipe.name = "e5m2_pv";
  a.recipe.pv_format = PVFormat::e5m2;
  expect_error(a, "recipe", "'e5m2_pv' has no sm_90 kernel (the GPU path needs P V as e4m3");
}

// Every preset except SageAttention3's FP4 has a kernel (SageBwd's forward: the int8_dynamic
// PV path); the rule is the one attention() uses.
TEST_F(GpuArgs, EveryPresetButFp4HasAKernel) {
  for (const Recipe& r : presets()) EXPECT_EQ(gpu_supports(r), r.name != "sage3_fp4") << r.name;
  Recipe r = preset("sage2_8b");
  r.qk_granularity = Granularity::per_tensor;  // Q per tensor would need a grid-wide pass
  EXPECT_FALSE(gpu_supports(r));
}

// The workspace depends on the K/V shapes and the recipe's V format: fp16 V takes two bytes.
TEST_F(GpuArgs, KvWorkspaceBytesFollowTheVFormat) {
  const AttentionArgs a = make();
  EXPECT_EQ(kv_workspace_bytes(B, H, N, D, a.recipe), workspace_bytes(a));
  const size_t fp8 = kv_workspace_bytes(B, H, 4096, D, preset("sage2_8b"));
  const size_t fp16 = kv_workspace_bytes(B, H, 4096, D, preset("sage1_t"));
  EXPECT_EQ(fp16 - fp8, size_t(B * H * 4096 * D));
  EXPECT_EQ(kv_workspace_bytes(0, H, N, D, a.recipe), kv_workspace_bytes(0, 0, 0, D, a.recipe));
  EXPECT_REFUSAL(kv_workspace_bytes(B, H, -1, D, a.recipe), "n_kv", "");
  EXPECT_REFUSAL(kv_workspace_bytes(B, H, N, D, preset("sage3_fp4")), "recipe", "");
}

// quantize_kv checks only the K/V half: q and out may be undefined, and an error about k
// names k (its checks run as the self-attention call q = k would).
TEST_F(GpuArgs, QuantizeKvChecksOnlyTheKvHalf) {
  AttentionArgs a = make();
  a.q = TensorView{};
  a.out = TensorView{};
  EXPECT_EQ(check_kv_args(a, DeviceKind::cuda).heads_kv, H);
  a.k.dtype = DType::f32;
  a.v.dtype = DType::f32;
  EXPECT_REFUSAL(check_kv_args(a, DeviceKind::cuda), "k", "k: dtype must be f16 or bf16");
  a = make();
  a.q = TensorView{};
  a.v.shape[2] = N + 1;
  EXPECT_REFUSAL(quantize_kv(a, storage(), 1 << 20, nullptr), "v", "");
}

TEST_F(GpuArgs, MisalignedInputPointer) {
  AttentionArgs a = make();
  a.q.data = static_cast<uint16_t*>(a.q.data) + 1;  // a storage offset of one element
  expect_error(a, "q", "aligned to 16 bytes");
}

TEST_F(GpuArgs, InputStrideNotAMultipleOfEight) {
  AttentionArgs a = make();
  a.k = strided_view(a.k.data, DType::f16, {B, H, N, D}, {H * N * 68, N * 68, 68, 1}, Device::cuda(0));
  expect_error(a, "k", "strides[2] to be a multiple of 8");
}

TEST_F(GpuArgs, MisalignedOutputPointer) {
  AttentionArgs a = make();
  a.out.data = static_cast<uint16_t*>(a.out.data) + 1;
  expect_error(a, "out", "aligned to 4 bytes");
}

TEST_F(GpuArgs, HeadDimWithoutKernel) {
  // Issue 34: multiples of 8 from 32 to the largest tile run; 100 is none.
  AttentionArgs a = make();
  for (TensorView* t : {&a.q, &a.k, &a.v, &a.out}) t->shape[3] = 100;
  // A build of every tile names the range; one of some tiles (SAGE_HEAD_DIMS) lists them.
  const bool every_tile = std::string(gpu_kernel_head_dims()).find("96") != std::string::npos;
  expect_error(a, "q", every_tile ? "head_dim must be a multiple of 8 from 32 to" : "head_dim must be one of");
}

TEST_F(GpuArgs, VHeadDimOfItsOwn) {
  // MLA's kind: V (and out) with 64 channels beside Q/K's 128 run on the 128 tile, and the
  // workspace is the 128 tile's, whichever tensor is the wider.
  AttentionArgs a = make();
  a.v.shape[3] = a.out.shape[3] = 64;
  a.v.strides[2] = a.out.strides[2] = 64;
  a.v.strides[1] = a.out.strides[1] = N * 64;
  a.v.strides[0] = a.out.strides[0] = H * N * 64;
  const size_t narrow_v = workspace_bytes(a);
  EXPECT_EQ(narrow_v, workspace_bytes(make()));
  EXPECT_EQ(narrow_v, kv_workspace_bytes(B, H, N, D, a.recipe, 64));
  EXPECT_EQ(kv_workspace_bytes(B, H, N, 64, a.recipe, 128), kv_workspace_bytes(B, H, N, 128, a.recipe));
  // Prequantized INT8 inputs keep one head dim on the GPU, named.
  a.recipe = preset("int_flash");
  a.q.dtype = a.k.dtype = a.v.dtype = DType::i8;
  std::vector<float> scales(size_t(B * H * N * D), 1.f);
  a.q_scale = contiguous_view(scales.data(), DType::f32, {B, H, N}, Device::cuda(0));
  a.k_scale = contiguous_view(scales.data(), DType::f32, {B, H, N}, Device::cuda(0));
  a.v_scale = contiguous_view(scales.data(), DType::f32, {B, H}, Device::cuda(0));
  expect_error(a, "v", "for prequantized INT8 inputs on the GPU");
}

TEST_F(GpuArgs, WorkspaceTooSmallOrMissing) {
  const AttentionArgs a = make();
  const size_t need = workspace_bytes(a);
  EXPECT_REFUSAL(attention(a, storage(), need - 1, nullptr), "workspace_size", std::to_string(need));
  EXPECT_REFUSAL(attention(a, nullptr, need, nullptr), "workspace", "");
  EXPECT_REFUSAL(attention(a, static_cast<uint8_t*>(storage()) + 16, need, nullptr), "workspace", "");
}

// The sm_90 backward has a kernel for every preset with a backward: dS per token (sagebwd) and
// per tile (sagebwd_block), each its own instantiation; what it lacks (P per tile, the paper's,
// here) is refused by name before anything runs.
TEST_F(GpuArgs, BackwardPresetsHaveAKernelAndPTilesAreRefusedByName) {
  for (const Recipe& r : presets()) EXPECT_EQ(gpu_supports_backward(r), has_backward(r)) << r.name;
  BackwardArgs a = make_backward();
  for (const char* name : {"sagebwd", "sagebwd_block"}) {
    a.recipe = preset(name);
    EXPECT_GT(backward_workspace_bytes(a), size_t(0)) << name;
  }
  a.recipe = preset("sagebwd");
  a.recipe.name = "sagebwd_p_tile";
  a.recipe.bwd_p_granularity = Granularity::per_block;
  EXPECT_FALSE(gpu_supports_backward(a.recipe));
  EXPECT_REFUSAL(backward_workspace_bytes(a), "recipe",
                 "'sagebwd_p_tile' has no sm_90 backward (the kernel needs bwd_p_granularity per_token");
}
// Deterministic mode's turn counters, after the accumulators (one memset zeroes both): an int32
// per (batch, query head, 64-row Q tile) and per (batch, KV head, 128-key K/V tile), each array
// 256-byte aligned. The default mode's workspace has none.
TEST_F(GpuArgs, DeterministicBackwardAddsItsTurnCountersToTheWorkspace) {
  BackwardArgs a = make_backward();
  a.recipe = preset("sagebwd");
  const size_t fast = backward_workspace_bytes(a);
  a.deterministic = true;
  static_assert(B * H * 4 <= 256, "one Q tile and one K/V tile per head: 256 bytes each");
  EXPECT_EQ(backward_workspace_bytes(a), fast + 2 * 256);
}
#else
TEST(GpuArgs, NeedACudaBuild) {
  GTEST_SKIP() << "built without CUDA (SAGE_CUDA=OFF): the GPU argument checks are not linked";
}
#endif

}  // namespace
