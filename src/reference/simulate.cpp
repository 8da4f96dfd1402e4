// The recipe simulator's driver: runs the stages in the kernel's order for every
// (batch, head). The numerics contract it implements is docs/numerics.md.
#include <algorithm>
#include <cassert>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "reference/accumulate.h"
#include "reference/forward.h"
#include "reference/online_softmax.h"
#include "reference/parallel.h"
#include "reference/pv_quantize.h"
#include "reference/qk_quantize.h"
#include "reference/tensor_io.h"
#include "sage/attention.h"
#include "numerics/mask.h"
#include "numerics/quant_rules.h"
#include "numerics/tile.h"

namespace sage::reference {
namespace {

using sim::KVHead;

constexpr float kLn2 = 0.6931471805599453f;

// The head dim of the kernel tile that runs the call (tile.h, call_head_dim): what tile_config
// and the rules derived from the kernel's head dim (row_sum_in_pv_mma, p_scale_fold) take.
int tile_head_dim(const Problem& p) { return call_head_dim(p.head_dim, p.head_dim_v); }

// qk_channel_balance: the channel ranges of the group's Q heads (q_group: n_q_heads heads of
// n_q tokens) and of K', both over the tokens K's statistics sample (every k_mean_stride-th,
// as the GPU's statistics passes read) set s_c; K' takes * s_c here, Q / s_c in prepare_q. After K smoothing, so that
// s_c sees the K the quantizer sees, and before either is quantized.
void balance_k(float* k, const float* q_group, int64_t n_q_heads, const Problem& p, int stride,
               KVHead& h) {
  const int64_t d = p.head_dim;
  std::vector<float> q_amax(static_cast<size_t>(d), 0.f), k_amax(static_cast<size_t>(d), 0.f);
  for (int64_t g = 0; g < n_q_heads; ++g)
    sim::accumulate_channel_abs_max(q_group + g * p.n_q * d, p.n_q, d, q_amax.data(), stride);
  sim::accumulate_channel_abs_max(k, p.n_kv, d, k_amax.data(), stride);
  h.qk_balance = sim::qk_balance_scales(q_amax.data(), k_amax.data(), d);
  sim::scale_channels(k, p.n_kv, d, h.qk_balance.data(), /*divide=*/false);
}

KVHead prepare_kv(float* k, float* v, const float* q_group, const Problem& p, const Recipe& r,
                  TileConfig tc) {
  KVHead h;
  const int64_t n = p.n_kv, d = p.head_dim, dv = p.head_dim_v;
  if (r.smooth_k) {
    h.k_mean = sim::channel_mean(k, n, d, r.k_mean_stride);
    sim::subtract_channel_mean(k, n, d, h.k_mean.data());
  }
  if (r.qk_channel_balance) {
    const int64_t group = p.heads_kv > 0 ? p.heads_q / p.heads_kv : 1;
    balance_k(k, q_group, group, p, r.k_mean_stride, h);
  }
  h.k = sim::quantize_qk(k, n, d, r.qk_format, r.qk_granularity, /*is_q=*/false, tc);
  if (r.smooth_v) {
    h.v_mean = sim::channel_mean(v, n, dv);
    sim::subtract_channel_mean(v, n, dv, h.v_mean.data());
  }
  h.v = sim::quantize_v(v, n, dv, r, tc.block_kv);
  return h;
}

double dot(const float* a, const float* b, int64_t d) {
  double s = 0;
  for (int64_t c = 0; c < d; ++c) s += static_cast<double>(a[c]) * b[c];
  return s;
}

// Q of one head as the QK matmul takes it, and Q smoothing's per-tile means.
struct QHead {
  sim::QKOperand op;
  std::vector<float> q_mean;  // smooth_q: one mean per Q tile, [tiles][d]
};

QHead prepare_q(const float* q_orig, const KVHead& kvh, const Problem& p, const Recipe& r,
                TileConfig tc) {
  const int64_t nq = p.n_q, d = p.head_dim;
  QHead qh;
  std::vector<float> qs(q_orig, q_orig + nq * d);
  if (r.qk_channel_balance) sim::scale_channels(qs.data(), nq, d, kvh.qk_balance.data(), /*divide=*/true);
  if (r.smooth_q) {
    const int64_t tiles = ceil_div(nq, tc.block_q);
    qh.q_mean.resize(static_cast<size_t>(tiles * d));
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t r0 = t * tc.block_q, rows = std::min<int64_t>(tc.block_q, nq - r0);
      const std::vector<float> m = sim::channel_mean(qs.data() + r0 * d, rows, d);
      std::copy(m.begin(), m.end(), qh.q_mean.begin() + t * d);
      sim::subtract_channel_mean(qs.data() + r0 * d, rows, d, m.data());
    }
  }
  qh.op = sim::quantize_qk(qs.data(), nq, d, r.qk_format, r.qk_granularity, /*is_q=*/true, tc);
  return qh;
}

// What every row of a call shares: the recipe's choices, derived once.
struct RowPlan {
  const Recipe* r = nullptr;
  TileConfig tc{};
  float sl2 = 0.f;
  bool static_p = false;
  float pmax = 1.f;
  bool int_max = false;        // integer row max (docs/numerics.md, steps 4 and 6)
  bool p_in_exponent = false;  // P's scale in the exponent (step 6)
  float exp_scale = 1.f;       // the integer row max's exp2 yields P~ * exp_scale
  rules::PScaleFold p_fold;
  bool row_sum_mma = false;
};

RowPlan plan_rows(const Recipe& r, const Problem& p, TileConfig tc) {
  RowPlan pl;
  pl.r = &r;
  pl.tc = tc;
  pl.sl2 = rules::sm_scale_log2(p.sm_scale);
  pl.static_p = r.p_scale == PScale::static_max && r.pv_format != PVFormat::nvfp4 &&
                r.pv_format != PVFormat::mxfp4;
  pl.pmax = pl.static_p ? rules::p_static_max(r) : 1.f;
  pl.int_max = rules::integer_row_max(r);
  pl.p_in_exponent = rules::p_scale_in_exponent(r);
  pl.exp_scale = pl.p_in_exponent ? pl.pmax : 1.f;
  pl.p_fold = rules::p_scale_fold(pl.exp_scale, tile_head_dim(p));
  pl.row_sum_mma = rules::row_sum_in_pv_mma(r, tile_head_dim(p));
  return pl;
}

// Per-thread buffers of the row loop, sized to one KV tile.
struct RowScratch {
  std::vector<float> s2, pt;
  std::vector<int32_t> acc;  // integer row max: the accumulators
  std::vector<float> mult;   // and their multipliers
  std::vector<float> ps;     // P~ * exp_scale
  sim::PTile ptile;
  sim::AccumScratch accum;
  explicit RowScratch(int64_t block_kv) : s2(block_kv), pt(block_kv), acc(block_kv), mult(block_kv), ps(block_kv) {}
};

// INT-FlashAttention's denominator: the quantized P's sum, which is NaN where P~ is (the codes
// of a NaN are not: the float sum carries it, as the kernel's does).
float quantized_row_sum(const RowScratch& x, int64_t count) {
  const float float_sum = sim::softmax_row_sum(x.pt.data(), count);
  return x.ptile.dequantized_sum + (float_sum - float_sum);
}

// Steps 4-9 for one KV tile of row i: its logits, the online softmax, P's quantization and
// the PV accumulation into O. The tile's keys j0 .. j0 + count - 1, of which the first `first`
// lie before the row's window (step 5: masked, P = 0, as in the kernel's tile).
void attend_tile(const RowPlan& pl, const sim::QKOperand& qop, int64_t i, const KVHead& kvh,
                 const float* ds, int64_t j0, int64_t count, int64_t first, sim::RowState& st,
                 float* O, RowScratch& x) {
  const Recipe& r = *pl.r;
  float alpha;
  if (pl.int_max) {  // no smooth_q here: the rule excludes it
    sim::qk_int_accumulators(qop, i, kvh.k, j0, count, pl.sl2, x.acc.data(), x.mult.data());
    alpha = sim::softmax_enter_tile_integer_max(st, x.acc.data(), x.mult.data(), count, pl.p_fold,
                                                x.ps.data(), first);
    // P~ for the row sum; with P's scale in the exponent the codes come from ps itself, as on
    // the GPU.
    for (int64_t j = 0; j < count; ++j) x.pt[j] = x.ps[j] / pl.exp_scale;
  } else {
    sim::qk_logits(qop, i, kvh.k, j0, count, pl.sl2, x.s2.data());
    if (r.smooth_q)
      for (int64_t j = 0; j < count; ++j) x.s2[j] += ds[j0 + j];
    std::fill(x.s2.begin(), x.s2.begin() + first, -std::numeric_limits<float>::infinity());
    alpha = sim::softmax_enter_tile(st, x.s2.data(), count, x.pt.data());
  }
  // per_token P (SageBwd): the tile's largest P~ from the softmax's own maxima.
  const float row_peak = r.p_scale == PScale::per_token ? std::exp2(st.tile_max - st.m) : 0.f;
  sim::quantize_p(r, x.pt.data(), count, x.ptile, pl.p_in_exponent ? x.ps.data() : nullptr,
                  row_peak);
  // pv_mma: in P~ units like the others (pmax a power of two by default: exact).
  const float row_sum = pl.row_sum_mma ? sim::pv_mma_row_sum(r.pv_accum, x.ptile) / pl.pmax
                        : r.row_sum == RowSum::quantized_p ? quantized_row_sum(x, count)
                                                           : sim::softmax_row_sum(x.pt.data(), count);
  sim::accumulate_tile(r.pv_accum, x.ptile, kvh.v, j0, alpha, O, x.accum);
  sim::softmax_add_row_sum(st, alpha, row_sum);
}

// Step 10: the output row (V's head_dim_v channels) from O and l.
// Rows without keys (l = 0) stay 0; a NaN l (a non-finite input reached the row) gives NaN.
void finish_row(const RowPlan& pl, const KVHead& kvh, const sim::RowState& st, const float* O,
                int64_t dv, float* o) {
  if (st.l <= 0.f) return;
  const bool scale_at_end = pl.static_p || !kvh.v.channel_scale.empty();
  for (int64_t c = 0; c < dv; ++c) {
    // Static P and V scales fold into one multiplier per channel; the fp4, fp16 and per-tile
    // scaled (SageBwd) paths already carry dequantized values.
    const float vs = kvh.v.channel_scale.empty() ? 1.f : kvh.v.channel_scale[c];
    const float num = scale_at_end ? O[c] * (vs / pl.pmax) : O[c];
    o[c] = num / st.l;
    if (pl.r->smooth_v) o[c] += kvh.v_mean[c];
  }
}

// Per KV head: K smoothing and quantization (f.k becomes K') and V's, or the prequantized
// codes with their scales.
void prepare_kv_heads(const AttentionArgs& args, const Problem& p, const std::vector<float>& q,
                      sim::Forward& f) {
  const Recipe& r = args.recipe;
  const int64_t d = p.head_dim, dv = p.head_dim_v, nkv = p.n_kv;
  f.k = read_bhnd_f32(args.k, args.layout);
  std::vector<float> v = read_bhnd_f32(args.v, args.layout);
  f.kv.resize(static_cast<size_t>(p.batch * p.heads_kv));
  const bool preq = r.inputs == Inputs::prequantized_int8;
  const bool v_per_channel = r.v_scale == VScale::per_channel;
  const std::vector<double> k_scale = preq ? read_flat_f64(args.k_scale) : std::vector<double>{};
  const std::vector<double> v_scale = preq ? read_flat_f64(args.v_scale) : std::vector<double>{};
  parallel_for(p.batch * p.heads_kv, [&](int64_t x) {
    float* kh = f.k.data() + x * nkv * d;
    float* vh = v.data() + x * nkv * dv;
    if (preq) {
      f.kv[x].k = sim::prequantized_qk(kh, k_scale.data() + x * nkv, nkv, d);
      f.kv[x].v = sim::prequantized_v(vh, nkv, dv, v_scale.data() + x * (v_per_channel ? dv : 1),
                                      v_per_channel);
    } else {
      // The Q heads of KV head x are contiguous in the dense (b, h_q, n_q, d) copy.
      const int64_t group = p.heads_q / p.heads_kv;
      f.kv[x] = prepare_kv(kh, vh, q.data() + x * group * p.n_q * d, p, r, f.tc);
    }
  });
}

// The keys whose V the kernel multiplies into row i's output: every key of each K/V tile that
// row i's Q tile loads (sm90/fwd/mask.cuh, kv_tiles: under causal, up to the tile holding the
// Q tile's last row's last key), with P = 0 where row i masks them.
// The keys whose V the kernel multiplies into row i's output: every key of the K/V tiles row
// i's Q tile visits (numerics/mask.h, visible_tiles, as sm90/fwd/mask.cuh takes them), with
// P = 0 where row i masks them.
KeyRange keys_loaded(const Problem& p, int64_t i, TileConfig tc) {
  const int64_t row0 = i / tc.block_q * tc.block_q, row_end = std::min(p.n_q, row0 + tc.block_q);
  const TileRange t = visible_tiles<int64_t>(row0, row_end, p.n_q, p.n_kv, p.window_left,
                                             p.window_right, tc.block_kv);
  return {std::min<int64_t>(p.n_kv, int64_t(t.begin) * tc.block_kv),
          std::min<int64_t>(p.n_kv, int64_t(t.end) * tc.block_kv)};
}

// fp16 V with a NaN or an infinity (VOperand::nonfinite): the loaded keys row i masks still
// reach it through the MMA as 0 times their V, which is NaN for a non-finite V.
void reach_masked_keys(const sim::VOperand& v, KeyRange seen, KeyRange loaded, float* O) {
  for (int64_t j = loaded.begin; j < loaded.end; ++j) {
    if (j >= seen.begin && j < seen.end) continue;
    for (int64_t c = 0; c < v.d; ++c)
      if (!std::isfinite(v.values[j * v.d + c])) O[c] = std::numeric_limits<float>::quiet_NaN();
  }
}

// Steps 4-11 for every row of query head bh, into f.out, f.lse and f.lse2.
void attend_head(const AttentionArgs& args, const RowPlan& pl, const QHead& qh, const KVHead& kvh,
                 const float* q_orig, int64_t bh, sim::Forward& f) {
  const Recipe& r = args.recipe;
  const Problem& p = f.p;
  const TileConfig tc = f.tc;
  const int64_t d = p.head_dim, dv = p.head_dim_v, nq = p.n_q, nkv = p.n_kv;
  RowScratch x(tc.block_kv);
  std::vector<float> O(static_cast<size_t>(dv));
  std::vector<float> ds;  // smooth_q: the logit bias of the current Q tile, per key
  int64_t ds_tile = -1;
  const KeyWindow window{p.window_left, p.window_right};
  for (int64_t i = 0; i < nq; ++i) {
    // Step 5 (numerics/mask.h): the keys row i sees, one interval.
    const KeyRange keys = visible_keys(i, nq, nkv, window);
    if (keys.empty()) continue;  // out stays 0, lse -inf
    if (r.smooth_q && q_smooth_block_of(i, tc) != ds_tile) {
      ds_tile = q_smooth_block_of(i, tc);
      ds = sim::smooth_q_logit_bias(qh.q_mean.data() + ds_tile * d, kvh.k, pl.sl2);
    }
    sim::RowState st;
    std::fill(O.begin(), O.end(), 0.f);
    // The tiles the row's keys lie in; the kernel's other tiles hold no key of the row.
    for (int64_t j0 = keys.begin / tc.block_kv * tc.block_kv; j0 < keys.end; j0 += tc.block_kv)
      attend_tile(pl, qh.op, i, kvh, ds.data(), j0, std::min<int64_t>(tc.block_kv, keys.end - j0),
                  std::max<int64_t>(0, keys.begin - j0), st, O.data(), x);
    if (kvh.v.nonfinite) reach_masked_keys(kvh.v, keys, keys_loaded(p, i, tc), O.data());
    finish_row(pl, kvh, st, O.data(), dv, f.out.data() + (bh * nq + i) * dv);
    // K smoothing shifted every logit of this row by -sm_scale * q_i . mean(K); softmax
    // ignores that, the LSE must not.
    const bool shifted = r.smooth_k && r.inputs != Inputs::prequantized_int8;
    const float shift =
        shifted ? p.sm_scale * static_cast<float>(dot(q_orig + i * d, kvh.k_mean.data(), d)) : 0.f;
    f.lse2[bh * nq + i] = st.m + std::log2(st.l);
    f.lse[bh * nq + i] = f.lse2[bh * nq + i] * kLn2 + shift;
  }
}

}  // namespace

namespace sim {

Forward run_forward(const AttentionArgs& args, const Problem& p, bool keep_q_operands) {
  const Recipe& r = args.recipe;
  const bool preq = r.inputs == Inputs::prequantized_int8;
  Forward f;
  f.p = p;
  f.tc = tile_config(tile_head_dim(p));
  f.sl2 = rules::sm_scale_log2(p.sm_scale);
  const int64_t d = p.head_dim, nq = p.n_q;
  const int64_t group = p.heads_kv > 0 ? p.heads_q / p.heads_kv : 1;
  assert(f.tc.block_kv % 8 == 0);  // tiles start on a thread-group boundary (tile.h)
  // Q first: the Q/K channel balance prepares K from Q's channel ranges.
  const std::vector<float> q = read_bhnd_f32(args.q, args.layout);
  prepare_kv_heads(args, p, q, f);

  // ---- per Q head: Q smoothing and quantization, then the tiled attention loop ----
  const std::vector<double> q_scale = preq ? read_flat_f64(args.q_scale) : std::vector<double>{};
  f.out.assign(static_cast<size_t>(p.batch * p.heads_q * nq * p.head_dim_v), 0.f);
  f.lse.assign(static_cast<size_t>(p.batch * p.heads_q * nq), -std::numeric_limits<float>::infinity());
  f.lse2 = f.lse;
  if (keep_q_operands) f.q_ops.resize(static_cast<size_t>(p.batch * p.heads_q));
  const RowPlan pl = plan_rows(r, p, f.tc);
  parallel_for(p.batch * p.heads_q, [&](int64_t bh) {
    const int64_t b = bh / p.heads_q, h = bh % p.heads_q;
    const KVHead& kvh = f.kv[static_cast<size_t>(b * p.heads_kv + h / group)];
    const float* q_orig = q.data() + bh * nq * d;
    QHead qh;
    if (preq) qh.op = prequantized_qk(q_orig, q_scale.data() + bh * nq, nq, d);
    else qh = prepare_q(q_orig, kvh, p, r, f.tc);
    attend_head(args, pl, qh, kvh, q_orig, bh, f);
    if (keep_q_operands) f.q_ops[static_cast<size_t>(bh)] = std::move(qh.op);
  });
  return f;
}

}  // namespace sim

void simulate(const AttentionArgs& args) {
  const Problem p = check_args(args, DeviceKind::cpu);
  const sim::Forward f = sim::run_forward(args, p, /*keep_q_operands=*/false);
  write_bhnd(args.out, args.layout, f.out.data());
  if (args.lse.defined()) write_flat(args.lse, f.lse.data());
}

}  // namespace sage::reference
