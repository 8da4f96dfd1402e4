// check_args: one test per rejection message, and the shapes it must accept.
//
// Views point at small host buffers; check_args never reads the data, so the same buffers
// can be labelled as cuda memory to exercise the GPU rules on a machine without a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "sage/attention.h"
#include "numerics/tile.h"
#include "quant/kv_layout.h"

namespace {

using namespace sage;

struct Shape {
  int64_t batch = 2, heads_q = 4, heads_kv = 2, n_q = 5, n_kv = 7, head_dim = 16;
  int64_t head_dim_v = 0;  // v's and out's head dim; 0: head_dim
  int64_t v_dim() const { return head_dim_v > 0 ? head_dim_v : head_dim; }
};

class ArgsTest : public ::testing::Test {
 protected:
  // Storage big enough for any dtype (8 bytes an element); kept alive by the fixture.
  void* alloc(int64_t elems) {
    buffers_.push_back(std::make_unique<double[]>(static_cast<size_t>(elems > 0 ? elems : 1)));
    return buffers_.back().get();
  }

  TensorView view4(int64_t b, int64_t h, int64_t n, int64_t d, DType dt, Layout l, Device dev) {
    void* p = alloc(b * h * n * d);
    return l == Layout::HND ? contiguous_view(p, dt, {b, h, n, d}, dev)
                            : contiguous_view(p, dt, {b, n, h, d}, dev);
  }

  AttentionArgs make(Shape s = {}, Layout l = Layout::HND, DType dt = DType::f16,
                     Device dev = Device::cpu()) {
    AttentionArgs a;
    a.layout = l;
    a.q = view4(s.batch, s.heads_q, s.n_q, s.head_dim, dt, l, dev);
    a.k = view4(s.batch, s.heads_kv, s.n_kv, s.head_dim, dt, l, dev);
    a.v = view4(s.batch, s.heads_kv, s.n_kv, s.v_dim(), dt, l, dev);
    a.out = view4(s.batch, s.heads_q, s.n_q, s.v_dim(), dt, l, dev);
    return a;
  }

  TensorView lse_for(const Shape& s, Device dev = Device::cpu()) {
    return contiguous_view(alloc(s.batch * s.heads_q * s.n_q), DType::f32,
                           {s.batch, s.heads_q, s.n_q}, dev);
  }

  // INT-FlashAttention inputs: int8 Q/K/V with per-token Q/K scales and a V scale.
  AttentionArgs make_prequantized(Shape s = {}, VScale vs = VScale::per_tensor,
                                  Device dev = Device::cpu()) {
    AttentionArgs a = make(s, Layout::HND, DType::i8, dev);
    a.out.dtype = DType::f16;
    a.recipe = preset("int_flash");
    a.recipe.v_scale = vs;
    a.q_scale = contiguous_view(alloc(s.batch * s.heads_q * s.n_q), DType::f32,
                                {s.batch, s.heads_q, s.n_q}, dev);
    a.k_scale = contiguous_view(alloc(s.batch * s.heads_kv * s.n_kv), DType::f32,
                                {s.batch, s.heads_kv, s.n_kv}, dev);
    a.v_scale = vs == VScale::per_channel
                    ? contiguous_view(alloc(s.batch * s.heads_kv * s.v_dim()), DType::f32,
                                      {s.batch, s.heads_kv, s.v_dim()}, dev)
                    : contiguous_view(alloc(s.batch * s.heads_kv), DType::f32,
                                      {s.batch, s.heads_kv}, dev);
    return a;
  }

  std::vector<std::unique_ptr<double[]>> buffers_;
};

void expect_error(const AttentionArgs& a, DeviceKind dev, const std::string& argument,
                  const std::string& phrase) {
  try {
    check_args(a, dev);
    ADD_FAILURE() << "check_args accepted the arguments; expected an error on " << argument;
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_EQ(e.argument(), argument) << what;
    EXPECT_NE(what.find(phrase), std::string::npos) << "message: " << what;
    // One sentence naming the argument first.
    EXPECT_EQ(what.rfind(argument + ": ", 0), 0u) << what;
    EXPECT_EQ(what.find(". "), std::string::npos) << what;
    EXPECT_EQ(what.find('\n'), std::string::npos) << what;
  }
}

#define EXPECT_ARG_ERROR(args, dev, argument, phrase) \
  do {                                                \
    SCOPED_TRACE(argument);                           \
    expect_error(args, dev, argument, phrase);        \
  } while (0)

constexpr DeviceKind kCpu = DeviceKind::cpu;
constexpr DeviceKind kCuda = DeviceKind::cuda;

// ---- valid arguments ---------------------------------------------------------------------

TEST_F(ArgsTest, BaselineHNDIsValid) {
  const AttentionArgs a = make();
  const Problem p = check_args(a, kCpu);
  EXPECT_EQ(p.batch, 2);
  EXPECT_EQ(p.heads_q, 4);
  EXPECT_EQ(p.heads_kv, 2);
  EXPECT_EQ(p.n_q, 5);
  EXPECT_EQ(p.n_kv, 7);
  EXPECT_EQ(p.head_dim, 16);
  EXPECT_EQ(p.sm_scale, 0.25f);
}

TEST_F(ArgsTest, NHDReadsTokensFromDim1) {
  const AttentionArgs a = make({}, Layout::NHD);
  EXPECT_EQ(a.q.shape[1], 5);  // [batch, tokens, heads, head_dim]
  const Problem p = check_args(a, kCpu);
  EXPECT_EQ(p.heads_q, 4);
  EXPECT_EQ(p.heads_kv, 2);
  EXPECT_EQ(p.n_q, 5);
  EXPECT_EQ(p.n_kv, 7);
  EXPECT_EQ(p.head_dim, 16);
}

TEST_F(ArgsTest, DefaultAndExplicitSmScale) {
  Shape s;
  s.head_dim = 128;
  AttentionArgs a = make(s);
  EXPECT_EQ(check_args(a, kCpu).sm_scale, static_cast<float>(1.0 / std::sqrt(128.0)));
  a.sm_scale = 0.3f;
  EXPECT_EQ(check_args(a, kCpu).sm_scale, 0.3f);
}

TEST_F(ArgsTest, GQAAndMQA) {
  Shape s;
  s.heads_q = 8;
  s.heads_kv = 2;
  EXPECT_EQ(check_args(make(s), kCpu).heads_kv, 2);
  s.heads_kv = 1;
  EXPECT_EQ(check_args(make(s), kCpu).heads_kv, 1);
  s.heads_kv = 8;
  EXPECT_EQ(check_args(make(s), kCpu).heads_kv, 8);
}

TEST_F(ArgsTest, StridedViewsAreValid) {
  // Q and out are slices of wider buffers (padding between heads and tokens), K broadcasts
  // one head over heads_kv with stride 0, V is a transposed (NHD storage, HND view) tensor.
  const Shape s;
  AttentionArgs a = make(s);
  const int64_t D = s.head_dim, pad = 3;
  a.q = strided_view(alloc(s.batch * s.heads_q * s.n_q * (D + pad)), DType::f16,
                     {s.batch, s.heads_q, s.n_q, D},
                     {s.heads_q * s.n_q * (D + pad), s.n_q * (D + pad), D + pad, 1});
  a.out = strided_view(alloc(s.batch * s.heads_q * s.n_q * 2 * D), DType::f16,
                       {s.batch, s.heads_q, s.n_q, D},
                       {s.heads_q * s.n_q * 2 * D, s.n_q * 2 * D, 2 * D, 1});
  a.k = strided_view(alloc(s.batch * s.n_kv * D), DType::f16, {s.batch, s.heads_kv, s.n_kv, D},
                     {s.n_kv * D, 0, D, 1});
  a.v = strided_view(alloc(s.batch * s.n_kv * s.heads_kv * D), DType::f16,
                     {s.batch, s.heads_kv, s.n_kv, D},
                     {s.n_kv * s.heads_kv * D, D, s.heads_kv * D, 1});
  a.lse = strided_view(alloc(s.batch * s.heads_q * s.n_q * 2), DType::f32,
                       {s.batch, s.heads_q, s.n_q}, {s.heads_q * s.n_q * 2, s.n_q * 2, 2});
  const Problem p = check_args(a, kCpu);
  EXPECT_EQ(p.n_q, s.n_q);
  EXPECT_EQ(p.n_kv, s.n_kv);
}

TEST_F(ArgsTest, SizeOneHeadDimAcceptsAnyStride) {
  Shape s;
  s.head_dim = 1;
  AttentionArgs a = make(s);
  a.q.strides[3] = 7;
  EXPECT_NO_THROW(check_args(a, kCpu));
}

TEST_F(ArgsTest, EmptyProblemsAreValid) {
  for (int which = 0; which < 4; ++which) {
    Shape s;
    if (which == 0) s.n_q = 0;
    if (which == 1) s.batch = 0;
    if (which == 2) s.heads_q = s.heads_kv = 0;
    if (which == 3) s.n_kv = 0;  // every row fully masked: zeros out, -inf LSE
    AttentionArgs a = make(s);
    a.lse = lse_for(s);
    EXPECT_NO_THROW(check_args(a, kCpu)) << which;
  }
  // Zero elements need no data at all.
  Shape s;
  s.n_q = 0;
  AttentionArgs a = make(s);
  a.q.data = nullptr;
  a.out.data = nullptr;
  const Problem p = check_args(a, kCpu);
  EXPECT_EQ(p.n_q, 0);
  EXPECT_EQ(p.n_kv, 7);
}

// NumPy gives an empty array zero strides; no element is addressed, so the head_dim rule
// must not apply (before, sagekit.simulate on N = 0 NumPy arrays named q's head_dim stride).
TEST_F(ArgsTest, EmptyViewsWithZeroStridesAreValid) {
  for (Layout layout : {Layout::HND, Layout::NHD}) {
    Shape s;
    s.n_q = s.n_kv = 0;
    AttentionArgs a = make(s, layout);
    for (TensorView* t : {&a.q, &a.k, &a.v, &a.out})
      for (int i = 0; i < 4; ++i) t->strides[i] = 0;
    const Problem p = check_args(a, kCpu);
    EXPECT_EQ(p.n_q, 0);
    EXPECT_EQ(p.n_kv, 0);
  }
}

TEST_F(ArgsTest, CpuAcceptsF32InputsAndWideOutputs) {
  AttentionArgs a = make({}, Layout::HND, DType::f32);
  EXPECT_NO_THROW(check_args(a, kCpu));
  for (DType o : {DType::f16, DType::bf16, DType::f32, DType::f64}) {
    a.out.dtype = o;
    EXPECT_NO_THROW(check_args(a, kCpu)) << dtype_name(o);
  }
  AttentionArgs b = make({}, Layout::NHD, DType::bf16);
  EXPECT_NO_THROW(check_args(b, kCpu));
}

TEST_F(ArgsTest, CpuHeadDimUpTo256) {
  Shape s;
  s.head_dim = 256;
  EXPECT_EQ(check_args(make(s), kCpu).head_dim, 256);
  s.head_dim = 1;
  EXPECT_EQ(check_args(make(s), kCpu).head_dim, 1);
}

TEST_F(ArgsTest, CudaValid) {
  Shape s;
  s.head_dim = 128;
  AttentionArgs a = make(s, Layout::NHD, DType::bf16, Device::cuda(1));
  a.lse = lse_for(s, Device::cuda(1));
  EXPECT_EQ(check_args(a, kCuda).head_dim, 128);
  s.head_dim = 64;
  EXPECT_EQ(check_args(make(s, Layout::HND, DType::f16, Device::cuda(0)), kCuda).head_dim, 64);
}

TEST_F(ArgsTest, PrequantizedValid) {
  EXPECT_NO_THROW(check_args(make_prequantized({}, VScale::per_tensor), kCpu));
  EXPECT_NO_THROW(check_args(make_prequantized({}, VScale::per_channel), kCpu));
  Shape s;
  s.head_dim = 64;
  AttentionArgs a = make_prequantized(s, VScale::per_tensor, Device::cuda(0));
  a.out.dtype = DType::bf16;
  EXPECT_NO_THROW(check_args(a, kCuda));
}

// ---- recipe -------------------------------------------------------------------------------

TEST_F(ArgsTest, InvalidRecipe) {
  AttentionArgs a = make();
  a.recipe.pv_accum = PVAccum::fp16;
  EXPECT_ARG_ERROR(a, kCpu, "recipe.pv_accum", "fp16 accumulation");
}

// ---- presence and rank ----------------------------------------------------------------------

TEST_F(ArgsTest, UndefinedOperand) {
  for (const char* name : {"q", "k", "v", "out"}) {
    AttentionArgs a = make();
    TensorView& t = name == std::string("q") ? a.q : name == std::string("k") ? a.k
                    : name == std::string("v") ? a.v : a.out;
    t = TensorView{};
    EXPECT_ARG_ERROR(a, kCpu, name, "must be a 4-d view [batch, heads, tokens, head_dim] for layout HND (got an undefined view)");
  }
}

TEST_F(ArgsTest, OperandNot4d) {
  AttentionArgs a = make({}, Layout::NHD);
  a.k.ndim = 3;
  EXPECT_ARG_ERROR(a, kCpu, "k", "must be a 4-d view [batch, tokens, heads, head_dim] for layout NHD (got 3 dimensions)");
}

TEST_F(ArgsTest, LseNot3d) {
  AttentionArgs a = make();
  a.lse = contiguous_view(alloc(40), DType::f32, {2, 4, 5, 1});
  EXPECT_ARG_ERROR(a, kCpu, "lse", "must be a 3-d f32 view [batch, heads_q, n_q] (got 4 dimensions)");
}

TEST_F(ArgsTest, ScaleWithoutPrequantizedInputs) {
  const Shape s;
  for (const char* name : {"q_scale", "k_scale", "v_scale"}) {
    AttentionArgs a = make(s);
    TensorView t = contiguous_view(alloc(40), DType::f32, {2, 4, 5});
    if (name == std::string("q_scale")) a.q_scale = t;
    if (name == std::string("k_scale")) a.k_scale = t;
    if (name == std::string("v_scale")) a.v_scale = t;
    EXPECT_ARG_ERROR(a, kCpu, name, "only used with recipe.inputs = prequantized_int8; leave it undefined");
  }
}

TEST_F(ArgsTest, PrequantizedScaleMissing) {
  for (const char* name : {"q_scale", "k_scale", "v_scale"}) {
    AttentionArgs a = make_prequantized();
    if (name == std::string("q_scale")) a.q_scale = TensorView{};
    if (name == std::string("k_scale")) a.k_scale = TensorView{};
    if (name == std::string("v_scale")) a.v_scale = TensorView{};
    EXPECT_ARG_ERROR(a, kCpu, name, "is required with recipe.inputs = prequantized_int8");
  }
}

TEST_F(ArgsTest, PrequantizedScaleWrongRank) {
  AttentionArgs a = make_prequantized({}, VScale::per_tensor);
  a.v_scale = contiguous_view(alloc(64), DType::f32, {2, 2, 16});
  EXPECT_ARG_ERROR(a, kCpu, "v_scale", "must be a 2-d f32 view [batch, heads_kv] (got 3 dimensions)");
  a = make_prequantized({}, VScale::per_channel);
  a.v_scale = contiguous_view(alloc(4), DType::f32, {2, 2});
  EXPECT_ARG_ERROR(a, kCpu, "v_scale", "must be a 3-d f32 view [batch, heads_kv, head_dim_v] (got 2 dimensions)");
}

// ---- memory ---------------------------------------------------------------------------------

TEST_F(ArgsTest, NegativeDimension) {
  AttentionArgs a = make();
  a.v.shape[2] = -1;
  EXPECT_ARG_ERROR(a, kCpu, "v", "dimensions must be >= 0");
}

TEST_F(ArgsTest, NegativeStride) {
  AttentionArgs a = make();
  a.k.strides[2] = -16;
  EXPECT_ARG_ERROR(a, kCpu, "k", "strides must be >= 0");
  a = make();
  a.lse = lse_for({});
  a.lse.strides[0] = -1;
  EXPECT_ARG_ERROR(a, kCpu, "lse", "strides must be >= 0");
}

TEST_F(ArgsTest, HeadDimNotContiguous) {
  AttentionArgs a = make();
  a.q.strides[3] = 2;
  EXPECT_ARG_ERROR(a, kCpu, "q", "the last dimension (head_dim) must be contiguous, stride 1 (got stride 2)");
}

TEST_F(ArgsTest, NullDataWithElements) {
  AttentionArgs a = make();
  a.out.data = nullptr;
  EXPECT_ARG_ERROR(a, kCpu, "out", "data must not be null for a view of 640 elements");
  a = make_prequantized();
  a.k_scale.data = nullptr;
  EXPECT_ARG_ERROR(a, kCpu, "k_scale", "data must not be null");
}

// ---- device ---------------------------------------------------------------------------------

TEST_F(ArgsTest, WrongDeviceKind) {
  AttentionArgs a = make();
  a.v.device = Device::cuda(0);
  EXPECT_ARG_ERROR(a, kCpu, "v", "must be in cpu memory for this entry point (got cuda:0)");
  Shape s;
  s.head_dim = 64;
  a = make(s, Layout::HND, DType::f16, Device::cuda(0));
  a.lse = lse_for(s);  // host memory
  EXPECT_ARG_ERROR(a, kCuda, "lse", "must be in cuda memory for this entry point (got cpu)");
}

TEST_F(ArgsTest, DifferentCudaDevices) {
  Shape s;
  s.head_dim = 64;
  AttentionArgs a = make(s, Layout::HND, DType::f16, Device::cuda(0));
  a.out.device = Device::cuda(1);
  EXPECT_ARG_ERROR(a, kCuda, "out", "must be on the same device as q, cuda:0 (got cuda:1)");
}

// ---- dtypes ---------------------------------------------------------------------------------

TEST_F(ArgsTest, QDtypeOnCpu) {
  AttentionArgs a = make({}, Layout::HND, DType::f64);
  EXPECT_ARG_ERROR(a, kCpu, "q", "dtype must be f16, bf16 or f32 on cpu (got f64)");
}

TEST_F(ArgsTest, QDtypeOnCuda) {
  Shape s;
  s.head_dim = 64;
  AttentionArgs a = make(s, Layout::HND, DType::f32, Device::cuda(0));
  EXPECT_ARG_ERROR(a, kCuda, "q", "dtype must be f16 or bf16 on cuda (got f32)");
}

TEST_F(ArgsTest, PrequantizedQMustBeInt8) {
  AttentionArgs a = make_prequantized();
  a.q.dtype = DType::f16;
  EXPECT_ARG_ERROR(a, kCpu, "q", "dtype must be i8 with recipe.inputs = prequantized_int8 (got f16)");
}

TEST_F(ArgsTest, KVDtypeMustMatchQ) {
  AttentionArgs a = make();
  a.k.dtype = DType::bf16;
  EXPECT_ARG_ERROR(a, kCpu, "k", "dtype must equal q's dtype f16 (got bf16)");
  a = make_prequantized();
  a.v.dtype = DType::f16;
  EXPECT_ARG_ERROR(a, kCpu, "v", "dtype must equal q's dtype i8 (got f16)");
}

TEST_F(ArgsTest, OutDtypeOnCuda) {
  Shape s;
  s.head_dim = 64;
  AttentionArgs a = make(s, Layout::HND, DType::bf16, Device::cuda(0));
  a.out.dtype = DType::f32;
  EXPECT_ARG_ERROR(a, kCuda, "out", "dtype must equal q's dtype bf16 on cuda (got f32)");
}

TEST_F(ArgsTest, PrequantizedOutDtypeOnCuda) {
  Shape s;
  s.head_dim = 64;
  AttentionArgs a = make_prequantized(s, VScale::per_tensor, Device::cuda(0));
  a.out.dtype = DType::i8;
  EXPECT_ARG_ERROR(a, kCuda, "out", "dtype must be f16 or bf16 on cuda (got i8)");
}

TEST_F(ArgsTest, OutDtypeOnCpu) {
  AttentionArgs a = make();
  a.out.dtype = DType::i32;
  EXPECT_ARG_ERROR(a, kCpu, "out", "dtype must be one of f16, bf16, f32, f64 on cpu (got i32)");
}

// ---- shapes ---------------------------------------------------------------------------------

TEST_F(ArgsTest, HeadDimZero) {
  Shape s;
  s.head_dim = 0;
  EXPECT_ARG_ERROR(make(s), kCpu, "q", "head_dim must be >= 1 (got 0)");
}

TEST_F(ArgsTest, HeadDimTooLargeOnCpu) {
  Shape s;
  s.head_dim = 320;
  EXPECT_ARG_ERROR(make(s), kCpu, "q", "head_dim must be at most 256 on cpu (got 320)");
}

// Whether this build has every kernel tile (a CUDA build configured with SAGE_HEAD_DIMS may
// have fewer; a build without CUDA reports every tile of the source).
bool every_tile_built() { return gpu_kernel_head_dim_list() == std::vector<int64_t>{64, 96, 128, 192, 256}; }

TEST_F(ArgsTest, HeadDimNotInstantiatedOnCuda) {
  // Issue 34: every multiple of 8 from 32 to the largest kernel tile runs (a build without
  // CUDA reports what a CUDA build of this source takes: tiles 64, 96, 128, 192, 256); others are
  // refused.
  if (!every_tile_built()) GTEST_SKIP() << "a build of some kernel tiles (SAGE_HEAD_DIMS)";
  Shape s;
  for (int64_t d : {24, 36, 100, 260, 264}) {
    SCOPED_TRACE(d);
    s.head_dim = d;
    EXPECT_ARG_ERROR(make(s, Layout::HND, DType::f16, Device::cuda(0)), kCuda, "q",
                     "head_dim must be a multiple of 8 from 32 to 256 on cuda (got " + std::to_string(d) + ")");
  }
  for (int64_t d : {32, 40, 64, 72, 80, 96, 104, 120, 128, 136, 192, 256}) {
    s.head_dim = d;
    EXPECT_EQ(check_args(make(s, Layout::HND, DType::f16, Device::cuda(0)), kCuda).head_dim, d);
  }
}

TEST(GpuHeadDims, ListsAreConsistent) {
  // The kernel tiles (without CUDA: kernel_traits.h's; with, the build's), and what runs on
  // them: every multiple of 8 from 32 whose tile is built.
  const std::vector<int64_t> tiles = gpu_kernel_head_dim_list();
#ifndef SAGE_WITH_CUDA
  EXPECT_EQ(tiles, (std::vector<int64_t>{64, 96, 128, 192, 256}));
  EXPECT_STREQ(gpu_kernel_head_dims(), "");
  EXPECT_STREQ(gpu_head_dims(), "");
#endif
  std::vector<int64_t> want;
  for (int64_t d = 32; d <= 256; d += 8)
    if (std::find(tiles.begin(), tiles.end(), kernel_head_dim(int(d))) != tiles.end()) want.push_back(d);
  EXPECT_EQ(gpu_head_dim_list(), want);
  for (int64_t d : gpu_head_dim_list()) {
    const int k = kernel_head_dim(int(d));
    EXPECT_GE(k, d);
    EXPECT_EQ(quant::kv_layout_head_dim(int(d)), quant::kv_layout_head_dim(k)) << d;
    // The simulator's tile is the kernel's (group maps follow tile_config).
    EXPECT_EQ(tile_config(int(d)).block_q, tile_config(k).block_q) << d;
  }
}

TEST_F(ArgsTest, KBatchMismatch) {
  AttentionArgs a = make();
  a.k.shape[0] = 3;
  EXPECT_ARG_ERROR(a, kCpu, "k", "batch must equal q's batch 2 (got 3)");
}

TEST_F(ArgsTest, KHeadDimMismatch) {
  Shape s;
  s.head_dim = 128;
  AttentionArgs a = make(s);
  a.k.shape[3] = 64;
  EXPECT_ARG_ERROR(a, kCpu, "k", "head_dim must equal q's head_dim 128 (got 64)");
}

TEST_F(ArgsTest, HeadsKvMustDivideHeadsQ) {
  Shape s;
  s.heads_q = 8;
  s.heads_kv = 3;
  EXPECT_ARG_ERROR(make(s), kCpu, "k",
                   "heads_kv must divide heads_q (GQA/MQA), but heads_q 8 is not a multiple of heads_kv 3");
  s.heads_kv = 0;
  EXPECT_ARG_ERROR(make(s), kCpu, "k", "heads_q 8 is not a multiple of heads_kv 0");
  s.heads_q = 2;
  s.heads_kv = 4;
  EXPECT_ARG_ERROR(make(s), kCpu, "k", "heads_kv must divide heads_q");
}

TEST_F(ArgsTest, VBatchMismatch) {
  AttentionArgs a = make();
  a.v.shape[0] = 1;
  EXPECT_ARG_ERROR(a, kCpu, "v", "batch must equal q's batch 2 (got 1)");
}

TEST_F(ArgsTest, VHeadsMismatch) {
  AttentionArgs a = make({}, Layout::NHD);
  a.v.shape[2] = 4;  // NHD: heads are dim 2
  EXPECT_ARG_ERROR(a, kCpu, "v", "heads must equal k's heads 2 (got 4)");
}

TEST_F(ArgsTest, VTokensMismatch) {
  AttentionArgs a = make({}, Layout::NHD);
  a.v.shape[1] = 6;  // NHD: tokens are dim 1
  EXPECT_ARG_ERROR(a, kCpu, "v", "tokens must equal k's tokens 7 (got 6)");
}

// v may have its own head dim, and then out has it: an out of q's shape is refused by name.
TEST_F(ArgsTest, VHeadDimMismatch) {
  AttentionArgs a = make();
  a.v.shape[3] = 8;
  EXPECT_ARG_ERROR(a, kCpu, "out", "shape must equal q's shape with v's head_dim as its last dim, "
                                   "[2, 4, 5, 8] (got [2, 4, 5, 16])");
}

TEST_F(ArgsTest, OutShapeMismatch) {
  AttentionArgs a = make();
  a.out.shape[2] = 4;
  EXPECT_ARG_ERROR(a, kCpu, "out", "shape must equal q's shape with v's head_dim as its last dim, "
                                   "[2, 4, 5, 16] (got [2, 4, 4, 16])");
}

// ---- v's own head dim (DeepSeek MLA's prefill: 192 for Q and K, 128 for V) ------------------

Shape mla_shape() {
  Shape s;
  s.head_dim = 192;
  s.head_dim_v = 128;
  return s;
}

TEST_F(ArgsTest, VHeadDimOfItsOwnOnCpu) {
  for (Layout l : {Layout::HND, Layout::NHD}) {
    const Problem p = check_args(make(mla_shape(), l), kCpu);
    EXPECT_EQ(p.head_dim, 192);
    EXPECT_EQ(p.head_dim_v, 128);
    EXPECT_EQ(p.sm_scale, static_cast<float>(1.0 / std::sqrt(192.0)));  // q's head dim
  }
  // The usual case: both the same.
  const Problem p = check_args(make(), kCpu);
  EXPECT_EQ(p.head_dim_v, p.head_dim);
  // V larger than Q/K as well.
  Shape s;
  s.head_dim_v = 40;
  EXPECT_EQ(check_args(make(s), kCpu).head_dim_v, 40);
}

TEST_F(ArgsTest, VHeadDimOfItsOwnWrongOut) {
  AttentionArgs a = make(mla_shape());
  a.out = view4(2, 4, 5, 192, DType::f16, Layout::HND, Device::cpu());  // q's head dim
  EXPECT_ARG_ERROR(a, kCpu, "out", "shape must equal q's shape with v's head_dim as its last dim, "
                                   "[2, 4, 5, 128] (got [2, 4, 5, 192])");
  a = make(mla_shape(), Layout::NHD);
  a.out.shape[3] = 127;
  EXPECT_ARG_ERROR(a, kCpu, "out", "[2, 5, 4, 128] (got [2, 5, 4, 127])");
}

TEST_F(ArgsTest, VHeadDimLimits) {
  Shape s;
  s.head_dim_v = 320;
  EXPECT_ARG_ERROR(make(s), kCpu, "v", "head_dim must be at most 256 on cpu (got 320)");
  AttentionArgs a = make();
  a.v.shape[3] = 0;
  a.out.shape[3] = 0;
  EXPECT_ARG_ERROR(a, kCpu, "v", "head_dim must be >= 1 (got 0)");
  // On cuda, v's head dim is one a kernel tile runs, as q's.
  if (!every_tile_built()) GTEST_SKIP() << "a build of some kernel tiles (SAGE_HEAD_DIMS)";
  s = mla_shape();
  for (int64_t dv : {24, 100, 264}) {
    SCOPED_TRACE(dv);
    s.head_dim_v = dv;
    EXPECT_ARG_ERROR(make(s, Layout::HND, DType::f16, Device::cuda(0)), kCuda, "v",
                     "head_dim must be a multiple of 8 from 32 to 256 on cuda (got " + std::to_string(dv) + ")");
  }
  s.head_dim_v = 128;
  const Problem p = check_args(make(s, Layout::HND, DType::f16, Device::cuda(0)), kCuda);
  EXPECT_EQ(p.head_dim, 192);
  EXPECT_EQ(p.head_dim_v, 128);
}

TEST_F(ArgsTest, VHeadDimOfItsOwnPrequantized) {
  AttentionArgs a = make_prequantized(mla_shape(), VScale::per_channel);
  EXPECT_EQ(check_args(a, kCpu).head_dim_v, 128);
  a.v_scale.shape[2] = 192;  // q's head dim: wrong
  EXPECT_ARG_ERROR(a, kCpu, "v_scale", "shape must be [batch, heads_kv, head_dim_v] = [2, 2, 128] (got [2, 2, 192])");
  EXPECT_NO_THROW(check_args(make_prequantized(mla_shape(), VScale::per_tensor), kCpu));
}

// The K/V half alone: its stand-in output takes v's head dim, so the call stays valid.
TEST_F(ArgsTest, KvHalfWithVHeadDimOfItsOwn) {
  AttentionArgs a = make(mla_shape());
  a.q = a.out = TensorView{};
  const Problem p = check_kv_args(a, kCpu);
  EXPECT_EQ(p.head_dim, 192);
  EXPECT_EQ(p.head_dim_v, 128);
  a.v.shape[3] = 300;
  try {
    check_kv_args(a, kCpu);
    ADD_FAILURE() << "check_kv_args accepted v's head dim 300";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "v") << e.what();
    EXPECT_NE(std::string(e.what()).find("head_dim must be at most 256 on cpu (got 300)"),
              std::string::npos) << e.what();
  }
}

// ---- lse ------------------------------------------------------------------------------------

TEST_F(ArgsTest, LseDtype) {
  AttentionArgs a = make();
  a.lse = lse_for({});
  a.lse.dtype = DType::f16;
  EXPECT_ARG_ERROR(a, kCpu, "lse", "dtype must be f32 (got f16)");
}

TEST_F(ArgsTest, LseShape) {
  AttentionArgs a = make({}, Layout::NHD);
  a.lse = contiguous_view(alloc(40), DType::f32, {2, 5, 4});  // token-major: wrong
  EXPECT_ARG_ERROR(a, kCpu, "lse", "shape must be [batch, heads_q, n_q] = [2, 4, 5] (got [2, 5, 4])");
}

// ---- prequantized scales ------------------------------------------------------------------

TEST_F(ArgsTest, ScaleDtype) {
  AttentionArgs a = make_prequantized();
  a.q_scale.dtype = DType::f16;
  EXPECT_ARG_ERROR(a, kCpu, "q_scale", "dtype must be f32 (got f16)");
}

TEST_F(ArgsTest, ScaleShape) {
  AttentionArgs a = make_prequantized();
  a.q_scale.shape[2] = 7;
  EXPECT_ARG_ERROR(a, kCpu, "q_scale", "shape must be [batch, heads_q, n_q] = [2, 4, 5] (got [2, 4, 7])");
  a = make_prequantized();
  a.k_scale.shape[1] = 4;
  EXPECT_ARG_ERROR(a, kCpu, "k_scale", "shape must be [batch, heads_kv, n_kv] = [2, 2, 7] (got [2, 4, 7])");
  a = make_prequantized({}, VScale::per_channel);
  a.v_scale.shape[2] = 8;
  EXPECT_ARG_ERROR(a, kCpu, "v_scale", "shape must be [batch, heads_kv, head_dim_v] = [2, 2, 16] (got [2, 2, 8])");
  a = make_prequantized({}, VScale::per_tensor);
  a.v_scale.shape[0] = 1;
  EXPECT_ARG_ERROR(a, kCpu, "v_scale", "shape must be [batch, heads_kv] = [2, 2] (got [1, 2])");
}

// ---- sm_scale ----------------------------------------------------------------------------

TEST_F(ArgsTest, SmScaleMustBeFinitePositive) {
  for (float bad : {0.f, -0.5f, std::numeric_limits<float>::infinity(),
                    std::numeric_limits<float>::quiet_NaN()}) {
    AttentionArgs a = make();
    a.sm_scale = bad;
    EXPECT_ARG_ERROR(a, kCpu, "sm_scale", "must be finite and > 0 (got ");
  }
}

// ---- outputs must not overlap themselves -------------------------------------------------

TEST_F(ArgsTest, OverlappingOutput) {
  AttentionArgs a = make();
  a.out.strides[1] = 0;  // every head writes the same rows
  EXPECT_ARG_ERROR(a, kCpu, "out", "is written, so its strides must give every element its own address");
  a = make();
  a.out.strides[2] = 8;  // tokens 8 apart but 16 channels wide
  EXPECT_ARG_ERROR(a, kCpu, "out", "its own address");
  a = make();
  a.lse = lse_for({});
  a.lse.strides[1] = 0;
  EXPECT_ARG_ERROR(a, kCpu, "lse", "its own address");
}

// ---- the other tensor.h helpers -------------------------------------------------------------

TEST(Tensor, NamesSizesAndViews) {
  EXPECT_STREQ(dtype_name(DType::e2m1x2), "e2m1x2");
  EXPECT_EQ(dtype_size(DType::f16), 2u);
  EXPECT_EQ(dtype_size(DType::bf16), 2u);
  EXPECT_EQ(dtype_size(DType::f32), 4u);
  EXPECT_EQ(dtype_size(DType::f64), 8u);
  EXPECT_EQ(dtype_size(DType::i8), 1u);
  EXPECT_EQ(dtype_size(DType::i32), 4u);
  for (DType t : {DType::e4m3, DType::e5m2, DType::e2m1x2, DType::e8m0}) EXPECT_EQ(dtype_size(t), 1u);
  EXPECT_EQ(device_name(Device::cpu()), "cpu");
  EXPECT_EQ(device_name(Device::cuda(3)), "cuda:3");
  EXPECT_STREQ(layout_name(Layout::NHD), "NHD");
  EXPECT_STREQ(layout_name(Layout::HND), "HND");

  float buf[24];
  const TensorView t = contiguous_view(buf, DType::f32, {2, 3, 4});
  EXPECT_EQ(t.ndim, 3);
  EXPECT_EQ(t.numel(), 24);
  EXPECT_EQ(t.strides[0], 12);
  EXPECT_EQ(t.strides[1], 4);
  EXPECT_EQ(t.strides[2], 1);
  EXPECT_EQ(TensorView{}.numel(), 0);
  const TensorView e = contiguous_view(nullptr, DType::f16, {2, 0, 4});
  EXPECT_EQ(e.numel(), 0);
  EXPECT_TRUE(e.defined());
  const TensorView s = strided_view(buf, DType::f32, {3, 2}, {1, 3});
  EXPECT_EQ(s.strides[0], 1);
  EXPECT_EQ(s.strides[1], 3);
  try {
    strided_view(buf, DType::f32, {3, 2}, {1});
    ADD_FAILURE() << "mismatched strides accepted";
  } catch (const Error& err) {
    EXPECT_EQ(err.argument(), "strides");
  }
  try {
    contiguous_view(buf, DType::f32, {1, 2, 3, 4, 5});
    ADD_FAILURE() << "5 dimensions accepted";
  } catch (const Error& err) {
    EXPECT_EQ(err.argument(), "shape");
  }
  try {
    contiguous_view(buf, DType::f32, {2, -1});
    ADD_FAILURE() << "negative dimension accepted";
  } catch (const Error& err) {
    EXPECT_EQ(err.argument(), "shape");
  }
}

TEST(GpuEntryPoints, WithoutCudaTheyExplain) {
#ifndef SAGE_WITH_CUDA
  EXPECT_FALSE(gpu_available());
  EXPECT_STREQ(gpu_head_dims(), "");
  AttentionArgs a;
  try {
    workspace_bytes(a);
    ADD_FAILURE() << "workspace_bytes returned";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "device");
    EXPECT_NE(std::string(e.what()).find("SAGE_CUDA=OFF"), std::string::npos);
  }
  try {
    attention(a, nullptr, 0, nullptr);
    ADD_FAILURE() << "attention returned";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "device");
  }
#else
  GTEST_SKIP() << "built with CUDA: the stub is not linked";
#endif
}

}  // namespace
