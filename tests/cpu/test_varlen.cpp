// Packed variable-length batches on the CPU (issue 34, section 2): the no-leak proof (a
// sequence packed among different neighbours gives bit-identical output and LSE), varlen
// against the dense call on each sequence alone, lengths 0 and 1, GQA, masks per sequence,
// the argument errors, and the GPU's named refusal.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "expect_refusal.h"
#include "numerics/formats.h"
#include "reference/synthetic.h"
#include "sage/attention.h"
#include "sage/error.h"
#include "sage/varlen.h"

namespace sage {
namespace {

constexpr float kMinusInf = -std::numeric_limits<float>::infinity();
// What out and lse hold before a call: no computed element has this value.
constexpr float kUnwritten = 12345.f;

struct Heads {
  int64_t q = 4, kv = 2, d = 64;
  int64_t dv = 0;  // V's and the output's head dim; 0: d
  int64_t v_dim() const { return dv > 0 ? dv : d; }
};

// One sequence's tokens, fp16 bits, token-major as packing stores them: q [n_q, heads_q, d],
// k [n_k, heads_kv, d] and v [n_k, heads_kv, d_v]. Each sequence has its own channel means (a few channels of Q
// and K far off zero, as q/k projection biases give, and a V bias), so that any statistic
// taken across sequences would change its neighbours' numbers.
struct Sequence {
  int64_t n_q = 0, n_k = 0;
  std::vector<uint16_t> q, k, v;
};

Sequence make_sequence(int64_t n_q, int64_t n_k, uint64_t seed, const Heads& h) {
  reference::Rng rng(seed);
  std::vector<double> q_bias(h.d, 0.0), k_bias(h.d, 0.0), v_bias(h.v_dim(), 0.0);
  for (int64_t c = 0; c < std::max(h.d, h.v_dim()); ++c) {
    if (c < h.d) k_bias[c] = 5.0 * rng.normal();
    if (c < h.v_dim()) v_bias[c] = 3.0 * rng.normal();
  }
  for (int64_t c : {int64_t(3), h.d / 2 + 1}) q_bias[c] = k_bias[c] = 20.0 + 20.0 * rng.uniform();
  // Rows of bias.size() channels.
  auto fill = [&](int64_t tokens, int64_t heads, const std::vector<double>& bias) {
    std::vector<uint16_t> x(static_cast<size_t>(tokens * heads) * bias.size());
    for (size_t i = 0; i < x.size(); ++i)
      x[i] = fmt::fp16_bits(static_cast<float>(bias[i % bias.size()] + rng.normal()));
    return x;
  };
  Sequence s;
  s.n_q = n_q, s.n_k = n_k;
  s.q = fill(n_q, h.q, q_bias);
  s.k = fill(n_k, h.kv, k_bias);
  s.v = fill(n_k, h.kv, v_bias);
  return s;
}

// Sequences packed one after another, with their offsets, and the varlen call on them.
struct Packed {
  Heads h;
  std::vector<uint16_t> q, k, v;
  std::vector<int32_t> cu_q{0}, cu_k{0};
  std::vector<float> out, lse;
  int64_t tokens_q = 0, tokens_k = 0;  // the packed tensors' lengths, kept when a test edits the offsets

  Packed(const std::vector<Sequence>& seqs, const Heads& heads) : h(heads) {
    for (const Sequence& s : seqs) {
      q.insert(q.end(), s.q.begin(), s.q.end());
      k.insert(k.end(), s.k.begin(), s.k.end());
      v.insert(v.end(), s.v.begin(), s.v.end());
      cu_q.push_back(cu_q.back() + static_cast<int32_t>(s.n_q));
      cu_k.push_back(cu_k.back() + static_cast<int32_t>(s.n_k));
    }
    tokens_q = cu_q.back(), tokens_k = cu_k.back();
    out.assign(static_cast<size_t>(total_q() * h.q * h.v_dim()), kUnwritten);
    lse.assign(static_cast<size_t>(h.q * total_q()), kUnwritten);
  }
  int64_t total_q() const { return tokens_q; }
  int64_t total_k() const { return tokens_k; }

  VarlenArgs args(const std::string& recipe = "sage2_8b") {
    VarlenArgs a;
    a.q = contiguous_view(q.data(), DType::f16, {total_q(), h.q, h.d});
    a.k = contiguous_view(k.data(), DType::f16, {total_k(), h.kv, h.d});
    a.v = contiguous_view(v.data(), DType::f16, {total_k(), h.kv, h.v_dim()});
    a.out = contiguous_view(out.data(), DType::f32, {total_q(), h.q, h.v_dim()});
    a.lse = contiguous_view(lse.data(), DType::f32, {h.q, total_q()});
    a.cu_seqlens_q = contiguous_view(cu_q.data(), DType::i32, {int64_t(cu_q.size())});
    a.cu_seqlens_k = contiguous_view(cu_k.data(), DType::i32, {int64_t(cu_k.size())});
    for (size_t b = 1; b < cu_q.size(); ++b) {
      a.max_seqlen_q = std::max<int64_t>(a.max_seqlen_q, cu_q[b] - cu_q[b - 1]);
      a.max_seqlen_k = std::max<int64_t>(a.max_seqlen_k, cu_k[b] - cu_k[b - 1]);
    }
    a.recipe = preset(recipe);
    return a;
  }

  // Sequence b's output [n_q, heads_q, d_v] and LSE [heads_q, n_q], copied out.
  std::vector<float> out_of(size_t b) const {
    const size_t row = static_cast<size_t>(h.q * h.v_dim());
    return {out.begin() + cu_q[b] * row, out.begin() + cu_q[b + 1] * row};
  }
  std::vector<float> lse_of(size_t b) const {
    std::vector<float> x;
    for (int64_t head = 0; head < h.q; ++head)
      for (int64_t t = cu_q[b]; t < cu_q[b + 1]; ++t) x.push_back(lse[head * total_q() + t]);
    return x;
  }
};

// (memcmp is not given an empty vector's data(), which may be null: undefined behaviour.)
bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

struct Mask {
  bool causal;
  int64_t left, right;
};
const Mask kMasks[] = {{false, -1, -1}, {true, -1, -1}, {true, 37, 0}, {false, 5, 9}};

void set_mask(VarlenArgs& a, const Mask& m) {
  a.causal = m.causal;
  a.window_left = m.left;
  a.window_right = m.right;
}

// ---- the no-leak proof ---------------------------------------------------------------------

// The recipes whose statistics span tokens: K smoothing's mean (sampled every 8th key in
// sage2_8b), V's per-channel and per-tensor scales, per-block Q/K scales, per-token INT8,
// Q smoothing's block means, V smoothing, the Q/K channel balance's ranges.
const char* const kLeakRecipes[] = {"sage2_8b", "sage2_8b_balanced", "sage1_b", "int_flash_q",
                                    "sage2_4b", "sage2_8b_vsmooth"};

TEST(Varlen, SameSequenceAmongDifferentNeighboursGivesTheSameBits) {
  const Heads h;
  const Sequence target = make_sequence(150, 211, 1, h);
  // Neighbours with other lengths (one ends mid-tile, one is empty of queries) and other
  // channel means, before and after the target, so that its tokens start on different rows.
  const std::vector<std::vector<Sequence>> packings = {
      {target},
      {make_sequence(77, 90, 2, h), target, make_sequence(200, 64, 3, h)},
      {make_sequence(0, 40, 4, h), make_sequence(129, 300, 5, h), make_sequence(1, 1, 6, h), target}};
  const size_t where[] = {0, 1, 3};
  for (const char* recipe : kLeakRecipes)
    for (const Mask& m : {kMasks[0], kMasks[2]}) {
      std::vector<float> out0, lse0;
      for (size_t i = 0; i < packings.size(); ++i) {
        Packed p(packings[i], h);
        VarlenArgs a = p.args(recipe);
        set_mask(a, m);
        reference::simulate_varlen(a);
        const std::vector<float> out = p.out_of(where[i]), lse = p.lse_of(where[i]);
        if (i == 0) {  // the reference bits, which must be computed ones
          for (float x : out) ASSERT_TRUE(std::isfinite(x) && x != kUnwritten) << recipe;
          for (float x : lse) ASSERT_TRUE(std::isfinite(x) && x != kUnwritten) << recipe;
          out0 = out, lse0 = lse;
          continue;
        }
        EXPECT_TRUE(same_bits(out, out0)) << recipe << " causal " << m.causal << " packing " << i;
        EXPECT_TRUE(same_bits(lse, lse0)) << recipe << " causal " << m.causal << " packing " << i;
      }
    }
}

// The proof above can fail: treating the whole packed batch as one sequence (a statistic, or
// the mask, spanning neighbours) does change the target's bits.
TEST(Varlen, OneLongSequenceIsNotTheSameAsPacking) {
  const Heads h;
  Packed packed({make_sequence(77, 90, 2, h), make_sequence(150, 211, 1, h)}, h);
  VarlenArgs a = packed.args();
  reference::simulate_varlen(a);
  const std::vector<float> separate = packed.out_of(1);
  Packed merged = packed;
  merged.cu_q = {0, merged.cu_q.back()};
  merged.cu_k = {0, merged.cu_k.back()};
  VarlenArgs m = merged.args();
  reference::simulate_varlen(m);
  const std::vector<float> together(merged.out.end() - separate.size(), merged.out.end());
  EXPECT_FALSE(same_bits(separate, together));
}

// ---- varlen is the dense call on each sequence ---------------------------------------------

// A sequence as a dense call of its own: contiguous NHD [1, n, heads, d] buffers.
struct Dense {
  std::vector<float> out, lse;
};
Dense dense_call(const Sequence& s, const Heads& h, const VarlenArgs& like, bool exact) {
  std::vector<uint16_t> q = s.q, k = s.k, v = s.v;
  Dense r;
  r.out.assign(static_cast<size_t>(s.n_q * h.q * h.v_dim()), 0.f);
  r.lse.assign(static_cast<size_t>(h.q * s.n_q), 0.f);
  AttentionArgs a;
  a.q = contiguous_view(q.data(), DType::f16, {1, s.n_q, h.q, h.d});
  a.k = contiguous_view(k.data(), DType::f16, {1, s.n_k, h.kv, h.d});
  a.v = contiguous_view(v.data(), DType::f16, {1, s.n_k, h.kv, h.v_dim()});
  a.out = contiguous_view(r.out.data(), DType::f32, {1, s.n_q, h.q, h.v_dim()});
  a.lse = contiguous_view(r.lse.data(), DType::f32, {1, h.q, s.n_q});
  a.layout = Layout::NHD;
  a.causal = like.causal;
  a.window_left = like.window_left;
  a.window_right = like.window_right;
  a.recipe = like.recipe;
  if (exact) reference::exact(a);
  else reference::simulate(a);
  return r;
}

// Lengths 0 and 1, odd lengths, n_q above and below n_k, a sequence with queries and no key.
std::vector<Sequence> mixed_batch(const Heads& h) {
  return {make_sequence(33, 130, 11, h), make_sequence(0, 5, 12, h), make_sequence(1, 1, 13, h),
          make_sequence(97, 20, 14, h),  make_sequence(3, 0, 15, h), make_sequence(1, 70, 16, h),
          make_sequence(0, 0, 17, h),    make_sequence(130, 129, 18, h)};
}

// Each sequence of the packed batch, simulated (or exact) for every recipe and mask given,
// is its dense call bit for bit, and every output element is written.
void expect_each_sequence_is_its_dense_call(const Heads& h, std::initializer_list<const char*> recipes,
                                           std::initializer_list<Mask> masks) {
  const std::vector<Sequence> seqs = mixed_batch(h);
  for (const char* recipe : recipes)
    for (const Mask& m : masks)
      for (bool exact : {false, true}) {
        if (exact && std::string(recipe) != "sage2_8b") continue;  // exact ignores the recipe
        Packed p(seqs, h);
        VarlenArgs a = p.args(recipe);
        set_mask(a, m);
        if (exact) reference::exact_varlen(a);
        else reference::simulate_varlen(a);
        for (size_t b = 0; b < seqs.size(); ++b) {
          const Dense d = dense_call(seqs[b], h, a, exact);
          EXPECT_TRUE(same_bits(p.out_of(b), d.out))
              << recipe << " exact " << exact << " d " << h.d << " d_v " << h.dv << " mask ("
              << m.left << ", " << m.right << ") causal " << m.causal << " sequence " << b;
          EXPECT_TRUE(same_bits(p.lse_of(b), d.lse)) << recipe << " sequence " << b;
        }
        for (float x : p.out) EXPECT_NE(x, kUnwritten);
      }
}

TEST(Varlen, EqualsTheDenseCallOnEachSequence) {
  for (const Heads& h : {Heads{4, 2, 64}, Heads{3, 1, 40}, Heads{2, 2, 128}})
    expect_each_sequence_is_its_dense_call(h, {"sage2_8b", "sage1_b", "int_flash_q"},
                                           {kMasks[0], kMasks[1], kMasks[2], kMasks[3]});
}

// V with a head dim of its own (DeepSeek MLA's prefill shape, d = 192 and d_v = 128, and a V
// wider than Q/K): each sequence of the packed batch is still its dense call, bit for bit.
TEST(Varlen, VHeadDimOfItsOwnEqualsTheDenseCallOnEachSequence) {
  for (const Heads& h : {Heads{4, 2, 192, 128}, Heads{3, 1, 40, 72}})
    expect_each_sequence_is_its_dense_call(h, {"sage2_8b", "sage2_8b_vsmooth", "sage1_b"},
                                           {kMasks[0], kMasks[2]});
}

// ---- short sequences and fully masked rows -------------------------------------------------

TEST(Varlen, QueriesWithoutKeysGiveZeroAndMinusInfinity) {
  const Heads h;
  Packed p({make_sequence(5, 9, 1, h), make_sequence(3, 0, 2, h), make_sequence(4, 6, 3, h)}, h);
  for (bool exact : {false, true}) {
    VarlenArgs a = p.args();
    if (exact) reference::exact_varlen(a);
    else reference::simulate_varlen(a);
    for (float x : p.out_of(1)) EXPECT_EQ(x, 0.f);
    for (float x : p.lse_of(1)) EXPECT_EQ(x, kMinusInf);
    for (size_t b : {size_t(0), size_t(2)}) {
      for (float x : p.out_of(b)) EXPECT_TRUE(std::isfinite(x) && x != kUnwritten);
      for (float x : p.lse_of(b)) EXPECT_TRUE(std::isfinite(x) && x != kUnwritten);
    }
  }
}

// One key: softmax is 1 on it, so the exact output is that key's V (per KV head).
TEST(Varlen, OneQueryOneKeyReturnsTheValue) {
  const Heads h;
  const Sequence one = make_sequence(1, 1, 5, h);
  Packed p({make_sequence(7, 8, 4, h), one}, h);
  VarlenArgs a = p.args();
  reference::exact_varlen(a);
  const std::vector<float> out = p.out_of(1);
  for (int64_t head = 0; head < h.q; ++head)
    for (int64_t c = 0; c < h.d; ++c)
      EXPECT_EQ(out[head * h.d + c], fmt::fp16_from_bits(one.v[(head / (h.q / h.kv)) * h.d + c]));
}

// Bottom-right causal per sequence: with n_q > n_k the first n_q - n_k rows see no key.
TEST(Varlen, CausalIsAlignedBottomRightPerSequence) {
  const Heads h;
  Packed p({make_sequence(10, 10, 1, h), make_sequence(9, 4, 2, h)}, h);
  VarlenArgs a = p.args();
  a.causal = true;
  reference::simulate_varlen(a);
  const std::vector<float> lse = p.lse_of(1);  // [heads, 9]
  for (int64_t head = 0; head < h.q; ++head)
    for (int64_t i = 0; i < 9; ++i)
      EXPECT_EQ(std::isinf(lse[head * 9 + i]), i < 5) << "head " << head << " row " << i;
}

TEST(Varlen, EmptyBatchesRun) {
  const Heads h;
  for (const std::vector<Sequence>& seqs :
       {std::vector<Sequence>{}, {make_sequence(0, 0, 1, h)}, {make_sequence(0, 3, 1, h)}}) {
    Packed p(seqs, h);
    VarlenArgs a = p.args();
    EXPECT_NO_THROW(reference::simulate_varlen(a));
    EXPECT_NO_THROW(reference::exact_varlen(a));
  }
}

// ---- argument errors -----------------------------------------------------------------------

void expect_error(const VarlenArgs& a, const std::string& argument, const std::string& phrase) {
  EXPECT_REFUSAL(reference::simulate_varlen(a), argument, phrase);
}

struct VarlenArgsCheck : ::testing::Test {
  Packed p{{make_sequence(5, 7, 1, Heads{}), make_sequence(3, 2, 2, Heads{})}, Heads{}};
};

TEST_F(VarlenArgsCheck, Offsets) {
  p.cu_q = {1, 5, 8};
  expect_error(p.args(), "cu_seqlens_q", "start at 0");
  p.cu_q = {0, 6, 5, 8};
  p.cu_k = {0, 7, 9, 9};
  expect_error(p.args(), "cu_seqlens_q", "must not decrease");
  p.cu_q = {0, 5, 7};
  p.cu_k = {0, 7, 9};
  expect_error(p.args(), "cu_seqlens_q", "must end at q's token count 8");
  p.cu_q = {0, 5, 8};
  p.cu_k = {0, 9};
  expect_error(p.args(), "cu_seqlens_k", "must have cu_seqlens_q's length");
  p.cu_k = {0, 7, 8};
  expect_error(p.args(), "cu_seqlens_k", "must end at k's token count 9");
}

TEST_F(VarlenArgsCheck, OffsetViews) {
  VarlenArgs a = p.args();
  a.cu_seqlens_q.dtype = DType::f32;
  expect_error(a, "cu_seqlens_q", "dtype must be i32");
  a = p.args();
  a.cu_seqlens_k = TensorView{};
  expect_error(a, "cu_seqlens_k", "1-d view");
  a = p.args();
  a.cu_seqlens_q.device = Device::cuda(0);
  expect_error(a, "cu_seqlens_q", "cpu memory");
}

TEST_F(VarlenArgsCheck, MaxSeqlen) {
  VarlenArgs a = p.args();
  a.max_seqlen_q = 4;
  expect_error(a, "max_seqlen_q", "at least the longest sequence, 5 tokens");
  a = p.args();
  a.max_seqlen_k = -1;
  expect_error(a, "max_seqlen_k", "at least the longest sequence, 7 tokens");
  a = p.args();
  a.max_seqlen_q = 1000;  // an upper bound, as FlashAttention accepts
  EXPECT_NO_THROW(reference::simulate_varlen(a));
}

TEST_F(VarlenArgsCheck, TensorsAndOptions) {
  VarlenArgs a = p.args();
  a.q.ndim = 4;
  expect_error(a, "q", "3-d view [total_q, heads_q, head_dim]");
  a = p.args();
  a.lse.shape[0] = 3;
  expect_error(a, "lse", "[heads_q, total_q] = [4, 8]");
  a = p.args();
  a.out.shape[0] = 7;
  expect_error(a, "out", "q's shape");
  a = p.args();
  a.v.shape[0] = 8;
  expect_error(a, "v", "k's shape");
  a = p.args();
  a.k.dtype = DType::bf16;
  a.v.dtype = DType::bf16;
  expect_error(a, "k", "dtype must equal q's dtype");
  a = p.args();
  a.q.shape[1] = 3;  // 3 query heads over 2 KV heads
  a.out.shape[1] = 3;
  a.lse.shape[0] = 3;
  expect_error(a, "k", "heads_kv must divide heads_q");
  a = p.args();
  a.causal = true;
  a.window_right = 4;
  expect_error(a, "window_right", "causal");
  a = p.args();
  a.window_left = -2;
  expect_error(a, "window_left", "-1 (unbounded)");
  a = p.args("int_flash");
  expect_error(a, "recipe.inputs", "floating inputs only");
}

TEST(Varlen, VHeadDimOfItsOwnShapesAreChecked) {
  const Heads h{4, 2, 64, 32};
  Packed p({make_sequence(5, 7, 1, h), make_sequence(3, 2, 2, h)}, h);
  const VarlenProblem vp = check_varlen_args(p.args());
  EXPECT_EQ(vp.head_dim, 64);
  EXPECT_EQ(vp.head_dim_v, 32);
  VarlenArgs a = p.args();
  a.out.shape[2] = 64;  // q's head dim
  expect_error(a, "out", "q's shape with v's head_dim as its last dim, [total_q, heads_q, "
                         "head_dim_v] = [8, 4, 32] (got [8, 4, 64])");
}

// The GPU entry point takes the offsets in device memory: host offsets are refused by name
// (the CPU references are the host path). A build without CUDA says so first.
TEST(VarlenGpu, HostOffsetsAreRefusedByName) {
  const Heads h;
  Packed p({make_sequence(5, 7, 1, h)}, h);
  try {
    attention_varlen(p.args(), nullptr, 0, nullptr);
    FAIL() << "the GPU path took host offsets";
  } catch (const Error& e) {
#ifdef SAGE_WITH_CUDA
    EXPECT_EQ(e.argument(), "cu_seqlens_q");
    EXPECT_NE(std::string(e.what()).find("device memory"), std::string::npos) << e.what();
#else
    EXPECT_EQ(e.argument(), "device");
#endif
  }
  try {
    varlen_workspace_bytes(p.args());
    FAIL() << "varlen_workspace_bytes took host offsets";
  } catch (const Error& e) {
#ifdef SAGE_WITH_CUDA
    EXPECT_EQ(e.argument(), "cu_seqlens_q");
#else
    EXPECT_EQ(e.argument(), "device");
#endif
  }
}

#ifdef SAGE_WITH_CUDA
// The GPU path's checks need no device and no read of the offsets: views that claim device
// memory (never dereferenced here) are enough to reach each named refusal.
TEST(VarlenGpu, DeviceArgumentChecksNameTheArgument) {
  const Heads h;
  Packed p({make_sequence(5, 7, 1, h), make_sequence(3, 9, 2, h)}, h);
  auto on_gpu = [&](VarlenArgs a) {
    for (TensorView* t : {&a.q, &a.k, &a.v, &a.out, &a.lse, &a.cu_seqlens_q, &a.cu_seqlens_k})
      t->device = Device::cuda(0);
    a.out.dtype = DType::f16;  // the GPU writes q's dtype (the float buffer is never touched)
    return a;
  };
  auto expect_error = [](const VarlenArgs& a, const char* arg, const char* part) {
    EXPECT_REFUSAL(varlen_workspace_bytes(a), arg, part);
  };
  VarlenArgs a = on_gpu(p.args());
  a.max_seqlen_q = -1;
  expect_error(a, "max_seqlen_q", ">= 0");
  a = on_gpu(p.args());
  a.cu_seqlens_k.shape[0] = 2;
  expect_error(a, "cu_seqlens_k", "length");
  a = on_gpu(p.args());
  a.cu_seqlens_q.strides[0] = 2;
  expect_error(a, "cu_seqlens_q", "contiguous");
  a = on_gpu(p.args());
  a.cu_seqlens_k.device = Device::cpu();
  expect_error(a, "cu_seqlens_k", "device memory");
  a = on_gpu(p.args("int_flash"));
  expect_error(a, "recipe.inputs", "floating inputs only");
  // Host-known sizes only: the workspace of batch entries of max_seqlen_k (cut to total_k).
  a = on_gpu(p.args());
  const size_t from_call = varlen_workspace_bytes(a);
  EXPECT_EQ(from_call, varlen_workspace_bytes(2, h.kv, a.max_seqlen_k, a.k.shape[0], a.q.shape[2],
                                              a.recipe));
  a.max_seqlen_k = 1 << 20;  // an upper bound far past the tokens costs nothing more
  EXPECT_EQ(varlen_workspace_bytes(a), varlen_workspace_bytes(2, h.kv, a.k.shape[0], a.k.shape[0],
                                                               a.q.shape[2], a.recipe));
}
#endif

}  // namespace
}  // namespace sage
