// The two-step GPU API (attention.h): quantize_kv then attention_from_quantized_kv must give
// exactly what attention() gives (attention() is documented as those two steps on one
// workspace), and one quantized K/V must serve any number of query sets.
#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <vector>

#include "gpu_harness.h"

namespace sage::testing {
namespace {

struct Output {
  std::vector<uint16_t> out;
  std::vector<float> lse;
};

Output collect(CaseTensors& t) {
  device_sync("attention");
  t.download();
  Output o{t.out_bits(), t.lse()};
  t.poison_outputs();  // the next call must write everything again
  return o;
}

size_t kv_bytes(const GpuCase& c) {
  return kv_workspace_bytes(c.batch, c.heads_kv, c.n_kv, c.head_dim, c.recipe_options(), c.dv());
}

// attention() on its own workspace.
Output one_call(CaseTensors& t, const AttentionArgs& a) {
  const size_t bytes = workspace_bytes(a);
  DeviceWorkspace ws(bytes);
  attention(a, ws.get(), bytes, nullptr);
  return collect(t);
}

// quantize_kv as the header allows calling it: only K, V (their scales), layout and recipe.
void quantize_only_kv(const AttentionArgs& full, const DeviceWorkspace& ws) {
  AttentionArgs kv = full;
  kv.q = TensorView{};
  kv.out = TensorView{};
  kv.lse = TensorView{};
  quantize_kv(kv, ws.get(), ws.bytes(), nullptr);
}

// Shapes with GQA, n_q != n_kv, partial last tiles, causal masking; one strided NHD case.
std::vector<GpuCase> cases_for(const std::string& recipe) {
  GpuCase a;
  a.recipe = recipe, a.batch = 2, a.heads_q = 4, a.heads_kv = 2, a.n_q = 300, a.n_kv = 500, a.causal = true;
  a.distribution = "k_bias", a.seed = 11;
  GpuCase b = a;
  b.layout = Layout::NHD, b.strided = true, b.dtype = DType::bf16, b.causal = false, b.head_dim = 64;
  b.n_q = 129, b.n_kv = 1000, b.seed = 12;
  return {a, b};
}

// Issue 34: the padded workspace (kv_layout_head_dim channels per head) sized by
// kv_workspace_bytes, filled by quantize_kv and read by the kernel of each tile, as in one call.
TEST(Sm90TwoStep, NewHeadDimsBitForBit) {
  SAGE_REQUIRE_GPU();
  for (int64_t d : harness_head_dims())
    for (const char* recipe : {"sage2_8b", "sage2pp_8b", "int_flash"}) {
      if (d == 64 || d == 128) continue;  // QuantizeThenAttendEqualsOneCallBitForBit
      GpuCase c = cases_for(recipe)[1];
      c.head_dim = d;
      CaseTensors t(c);
      const AttentionArgs a = t.device_args();
      const size_t bytes = workspace_bytes(a);
      EXPECT_EQ(bytes, kv_bytes(c)) << c.describe();
      const Output want = one_call(t, a);
      DeviceWorkspace ws(bytes);
      quantize_only_kv(a, ws);
      attention_from_quantized_kv(a, ws.get(), ws.bytes(), nullptr);
      const Output got = collect(t);
      EXPECT_TRUE(got.out == want.out) << c.describe() << ": output differs from attention()";
      EXPECT_TRUE(got.lse == want.lse) << c.describe() << ": LSE differs from attention()";
    }
}

TEST(Sm90TwoStep, QuantizeThenAttendEqualsOneCallBitForBit) {
  SAGE_REQUIRE_GPU();
  // One preset of each kernel family: per-thread INT8 with FP8 PV, per-token INT8 with fp16 PV
  // and an fp16 accumulator, INT4 with Q smoothing, fp16x2 accumulation, INT8 PV with
  // internal quantization, prequantized INT8 inputs.
  for (const char* recipe : {"sage2_8b", "sage1_t", "sage2_4b", "sage2pp_8b", "int_flash_q", "int_flash"})
    for (const GpuCase& c : cases_for(recipe)) {
      CaseTensors t(c);
      const AttentionArgs a = t.device_args();
      const size_t bytes = workspace_bytes(a);
      EXPECT_EQ(bytes, kv_bytes(c)) << c.describe() << ": workspace_bytes is kv_workspace_bytes of the shapes";
      const Output want = one_call(t, a);

      DeviceWorkspace ws(bytes);
      quantize_only_kv(a, ws);
      attention_from_quantized_kv(a, ws.get(), ws.bytes(), nullptr);
      const Output got = collect(t);
      EXPECT_TRUE(got.out == want.out) << c.describe() << ": output differs from attention()";
      EXPECT_TRUE(got.lse == want.lse) << c.describe() << ": LSE differs from attention()";
    }
}

TEST(Sm90TwoStep, OneQuantizedKVServesTwoQuerySets) {
  SAGE_REQUIRE_GPU();
  for (const char* recipe : {"sage2_8b", "sage2_4b", "int_flash"}) {
    GpuCase first;
    first.recipe = recipe, first.batch = 2, first.heads_q = 8, first.heads_kv = 2;
    first.n_q = 200, first.n_kv = 700, first.causal = true, first.seed = 21;
    // Other queries: another seed (so other values) and another length. Its own K/V are not
    // used: both query sets attend to `first`'s K/V.
    GpuCase second = first;
    second.n_q = 333, second.seed = 22;
    CaseTensors t1(first), t2(second);
    const AttentionArgs a1 = t1.device_args();
    AttentionArgs a2 = a1;
    const AttentionArgs own2 = t2.device_args();
    a2.q = own2.q, a2.q_scale = own2.q_scale, a2.out = own2.out, a2.lse = own2.lse;

    const Output want1 = one_call(t1, a1), want2 = one_call(t2, a2);

    DeviceWorkspace ws(kv_bytes(first));
    quantize_only_kv(a1, ws);
    attention_from_quantized_kv(a1, ws.get(), ws.bytes(), nullptr);
    const Output got1 = collect(t1);
    attention_from_quantized_kv(a2, ws.get(), ws.bytes(), nullptr);
    const Output got2 = collect(t2);
    // The first query set once more: the attention step must leave the workspace as it was.
    attention_from_quantized_kv(a1, ws.get(), ws.bytes(), nullptr);
    const Output again1 = collect(t1);

    EXPECT_TRUE(got1.out == want1.out && got1.lse == want1.lse) << recipe << ": first query set";
    EXPECT_TRUE(got2.out == want2.out && got2.lse == want2.lse) << recipe << ": second query set";
    EXPECT_TRUE(again1.out == want1.out && again1.lse == want1.lse) << recipe << ": first set, again";
  }
}

// The balanced K depends on Q: each two-step entry point refuses the balance by name rather
// than quantize K against no Q (or attend with codes balanced for another Q).
TEST(Sm90TwoStep, RefusesTheChannelBalanceByName) {
  SAGE_REQUIRE_GPU();
  GpuCase c;
  c.recipe = "sage2_8b_balanced";
  CaseTensors t(c);
  const AttentionArgs a = t.device_args();
  DeviceWorkspace ws(workspace_bytes(a));
  const auto expect_refusal = [](const char* entry, const std::function<void()>& call) {
    try {
      call();
      ADD_FAILURE() << entry << " accepted qk_channel_balance";
    } catch (const Error& e) {
      EXPECT_EQ(e.argument(), "recipe.qk_channel_balance") << entry << ": " << e.what();
      EXPECT_NE(std::string(e.what()).find(entry), std::string::npos) << e.what();
    }
  };
  expect_refusal("kv_workspace_bytes", [&] { kv_bytes(c); });
  expect_refusal("quantize_kv", [&] { quantize_only_kv(a, ws); });
  expect_refusal("attention_from_quantized_kv",
                 [&] { attention_from_quantized_kv(a, ws.get(), ws.bytes(), nullptr); });
}

}  // namespace
}  // namespace sage::testing
