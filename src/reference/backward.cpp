// The simulator's backward pass (SageBwd): FlashAttention's backward over the tiles of
// backward_tile_config, each matmul in the format the recipe gives it. The contract is
// docs/numerics.md, "The backward"; the step numbers below are those of its "Steps".
#include "reference/backward.h"
#include "numerics/tile.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "reference/forward.h"
#include "reference/parallel.h"
#include "reference/tensor_io.h"
#include "numerics/formats.h"
#include "numerics/quant_rules.h"

namespace sage::reference {
namespace sim {
namespace {

constexpr float kInt8Max = static_cast<float>(rules::kInt8Max);

// Symmetric INT8 of n values sharing one scale (amax / 127); returns the scale.
float quantize_block(const float* x, int64_t n, int8_t* codes) {
  float amax = 0.f;
  for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float inv = rules::symmetric_inverse(amax, kInt8Max);
  for (int64_t i = 0; i < n; ++i)
    codes[i] = static_cast<int8_t>(rules::round_clamp(x[i] * inv, rules::kInt8Max));
  return rules::symmetric_scale(amax, kInt8Max);
}

// Keys [0, visible) of query row i (bottom-right causal alignment, as the forward).
int64_t visible_keys(const BackwardHeadInputs& in, int64_t i) {
  if (!in.causal) return in.n_kv;
  return std::clamp<int64_t>(i + in.n_kv - in.n_q + 1, 0, in.n_kv);
}

// One backward tile: Q rows [i0, i0 + rows) against keys [j0, j0 + cols). Its matrices are
// dense [rows][cols]; an entry its row does not see stays 0 in P and dS.
struct Tile {
  int64_t i0 = 0, rows = 0, j0 = 0, cols = 0;
  std::vector<float> p, ds, p16, ds16;
  std::vector<int8_t> p8, ds8, ds8_t;   // ds8_t: dS for dK where it has scales of its own
  std::vector<float> p8_scale, ds8_scale, ds8_t_scale;  // per token of the matmul's output
  std::vector<float> column;            // one column of a tile
  std::vector<int8_t> column8;
  std::vector<int32_t> acc;  // one row's QK accumulators
  std::vector<float> mult, s2;

  void reset(int64_t i0_, int64_t rows_, int64_t j0_, int64_t cols_) {
    i0 = i0_, rows = rows_, j0 = j0_, cols = cols_;
    const size_t n = static_cast<size_t>(rows * cols);
    for (auto* m : {&p, &ds, &p16, &ds16}) m->assign(n, 0.f);
    for (auto* m : {&p8, &ds8, &ds8_t}) m->assign(n, 0);
    acc.resize(static_cast<size_t>(cols));
    mult.resize(static_cast<size_t>(cols));
    s2.resize(static_cast<size_t>(cols));
  }
  // How many of the tile's keys row a sees.
  int64_t seen(const BackwardHeadInputs& in, int64_t a) const {
    return std::clamp<int64_t>(visible_keys(in, i0 + a) - j0, 0, cols);
  }
};

// Step 3: P rebuilt from the forward's LSE and the forward's own Q and K codes. Integer Q/K:
// one fused multiply-add from the int32 accumulator; other formats: the forward's base-2
// logit minus the LSE.
void rebuild_p(const BackwardHeadInputs& in, Tile& t) {
  const bool integer = in.q->format == QKFormat::int8 || in.q->format == QKFormat::int4;
  for (int64_t a = 0; a < t.rows; ++a) {
    const int64_t i = t.i0 + a, n = t.seen(in, a);
    const float l2 = in.lse2[i];
    if (n == 0 || l2 == -std::numeric_limits<float>::infinity()) continue;
    float* p = t.p.data() + a * t.cols;
    if (integer) {
      qk_int_accumulators(*in.q, i, *in.k, t.j0, n, in.sm_scale_log2, t.acc.data(), t.mult.data());
      for (int64_t b = 0; b < n; ++b) p[b] = std::exp2(std::fma(float(t.acc[b]), t.mult[b], -l2));
    } else {
      qk_logits(*in.q, i, *in.k, t.j0, n, in.sm_scale_log2, t.s2.data());
      for (int64_t b = 0; b < n; ++b) p[b] = std::exp2(t.s2[b] - l2);
    }
  }
}

// The exact products of two 16-bit rows summed in double, rounded once to float.
float dot16(const float* a, const float* b, int64_t d) {
  double s = 0;
  for (int64_t c = 0; c < d; ++c) s += double(a[c]) * b[c];
  return static_cast<float>(s);
}

int32_t dot8(const int8_t* a, const int8_t* b, int64_t d) {
  int32_t s = 0;
  for (int64_t c = 0; c < d; ++c) s += int32_t(a[c]) * int32_t(b[c]);
  return s;
}

// Which tokens of a tile own a per_token scale: its rows (queries) or its columns (keys).
enum class TileAxis { rows, cols };

// INT8 codes of a tile and the scale of each token along `axis`: one per token (per_token),
// or the tile's one scale repeated (per_block). What factors out of the INT8 MMA is a scale per
// output row, and `axis` names the tokens the output rows belong to.
void quantize_tile(Tile& t, const std::vector<float>& x, Granularity g, TileAxis axis,
                   std::vector<int8_t>& codes, std::vector<float>& scale) {
  const int64_t tokens = axis == TileAxis::rows ? t.rows : t.cols;
  if (g == Granularity::per_block) {
    scale.assign(static_cast<size_t>(tokens), quantize_block(x.data(), t.rows * t.cols, codes.data()));
    return;
  }
  scale.resize(static_cast<size_t>(tokens));
  if (axis == TileAxis::rows) {
    for (int64_t a = 0; a < t.rows; ++a)
      scale[a] = quantize_block(x.data() + a * t.cols, t.cols, codes.data() + a * t.cols);
    return;
  }
  t.column.resize(static_cast<size_t>(t.rows));
  t.column8.resize(t.column.size());
  for (int64_t b = 0; b < t.cols; ++b) {
    for (int64_t a = 0; a < t.rows; ++a) t.column[a] = x[a * t.cols + b];
    scale[b] = quantize_block(t.column.data(), t.rows, t.column8.data());
    for (int64_t a = 0; a < t.rows; ++a) codes[a * t.cols + b] = t.column8[a];
  }
}

// Steps 4-5: dP = dO V^T on the entries the rows see, then dS = P * (dP - D).
void compute_ds(const Recipe& r, const BackwardHeadInputs& in, const Int8Rows& do8,
                const std::vector<float>& D, Tile& t) {
  const int64_t d = in.d;
  for (int64_t a = 0; a < t.rows; ++a) {
    const int64_t i = t.i0 + a, n = t.seen(in, a);
    for (int64_t b = 0; b < n; ++b) {
      const int64_t j = t.j0 + b;
      float dp;
      if (r.dp_format == BwdFormat::int8) {
        const float s = do8.scale[i / do8.rows] * in.v8->scale[j / in.v8->rows];
        dp = float(dot8(do8.codes.data() + i * d, in.v8->codes.data() + j * d, d)) * s;
      } else {
        dp = dot16(in.do16 + i * d, in.v16 + j * d, d);
      }
      const int64_t e = a * t.cols + b;
      t.ds[e] = t.p[e] * (dp - D[i]);
    }
  }
}

// sum over the tile's rows a of A[a][b] * B[i0 + a][c], for each key b and channel c (the
// products P^T dO and dS^T Q), handed to emit(b, c, sum). Acc: int32_t for INT8 codes
// (exact), double for 16-bit values.
template <class Acc, class A, class B, class Emit>
void sum_over_rows(const Tile& t, const A* a_mat, const B* b_rows, int64_t d, std::vector<Acc>& acc,
                   Emit emit) {
  acc.assign(static_cast<size_t>(t.cols * d), Acc(0));
  for (int64_t a = 0; a < t.rows; ++a)
    for (int64_t b = 0; b < t.cols; ++b) {
      const Acc x = Acc(a_mat[a * t.cols + b]);
      if (x == Acc(0)) continue;
      const B* row = b_rows + (t.i0 + a) * d;
      Acc* out = acc.data() + b * d;
      for (int64_t c = 0; c < d; ++c) out[c] += x * Acc(row[c]);
    }
  for (int64_t b = 0; b < t.cols; ++b)
    for (int64_t c = 0; c < d; ++c) emit(b, c, acc[b * d + c]);
}

// sum over the tile's keys b of A[a][b] * B[j0 + b][c] (the product dS K), to emit(a, c, sum).
template <class Acc, class A, class B, class Emit>
void sum_over_keys(const Tile& t, const A* a_mat, const B* b_rows, int64_t d, std::vector<Acc>& acc,
                   Emit emit) {
  acc.assign(static_cast<size_t>(t.rows * d), Acc(0));
  for (int64_t a = 0; a < t.rows; ++a)
    for (int64_t b = 0; b < t.cols; ++b) {
      const Acc x = Acc(a_mat[a * t.cols + b]);
      if (x == Acc(0)) continue;
      const B* row = b_rows + (t.j0 + b) * d;
      Acc* out = acc.data() + a * d;
      for (int64_t c = 0; c < d; ++c) out[c] += x * Acc(row[c]);
    }
  for (int64_t a = 0; a < t.rows; ++a)
    for (int64_t c = 0; c < d; ++c) emit(a, c, acc[a * d + c]);
}

// The accumulators of one head and the scratch of its tile products.
struct Grads {
  std::vector<float> dq, dk, dv;
  std::vector<int32_t> iacc;
  std::vector<double> facc;
};

// Step 6: dV[j] += P^T dO. INT8: P per tile or per key (bwd_p_granularity), dO per Q tile;
// 16-bit: P rounded to 16 bits.
void accumulate_dv(const Recipe& r, const BackwardHeadInputs& in, const Int8Rows& do8, Tile& t,
                   Grads& g) {
  const int64_t d = in.d;
  float* dv = g.dv.data() + t.j0 * d;
  if (r.dv_format == BwdFormat::int8) {
    quantize_tile(t, t.p, r.bwd_p_granularity, TileAxis::cols, t.p8, t.p8_scale);
    const float do_scale = do8.scale[t.i0 / do8.rows];
    sum_over_rows(t, t.p8.data(), do8.codes.data(), d, g.iacc, [&](int64_t b, int64_t c, int32_t x) {
      dv[b * d + c] = std::fma(float(x), t.p8_scale[b] * do_scale, dv[b * d + c]);
    });
    return;
  }
  for (size_t e = 0; e < t.p.size(); ++e) t.p16[e] = round16(t.p[e], in.bf16);
  sum_over_rows(t, t.p16.data(), in.do16, d, g.facc,
                [&](int64_t b, int64_t c, double x) { dv[b * d + c] += float(x); });
}

// Steps 7-8: dS to INT8 where an INT8 matmul takes it (per_block: once, for both; per_token:
// per query row for dQ and per key for dK), to 16 bits otherwise; dQ += dS K, dK += dS^T Q.
void accumulate_dq_dk(const Recipe& r, const BackwardHeadInputs& in, Tile& t, Grads& g) {
  const int64_t d = in.d;
  const bool int8_dq = r.dq_format == BwdFormat::int8, int8_dk = r.dk_format == BwdFormat::int8;
  const bool per_block = r.bwd_ds_granularity == Granularity::per_block;
  if (int8_dq || (int8_dk && per_block))
    quantize_tile(t, t.ds, r.bwd_ds_granularity, TileAxis::rows, t.ds8, t.ds8_scale);
  if (int8_dk && per_block) {
    t.ds8_t = t.ds8;
    t.ds8_t_scale.assign(static_cast<size_t>(t.cols), t.ds8_scale[0]);
  } else if (int8_dk) {
    quantize_tile(t, t.ds, r.bwd_ds_granularity, TileAxis::cols, t.ds8_t, t.ds8_t_scale);
  }
  if (!int8_dq || !int8_dk)
    for (size_t e = 0; e < t.ds.size(); ++e) t.ds16[e] = round16(t.ds[e], in.bf16);
  float* dq = g.dq.data() + t.i0 * d;
  float* dk = g.dk.data() + t.j0 * d;
  if (int8_dq) {
    const float k_scale = in.k->scale[t.j0];  // one K scale per K/V tile (validate_backward)
    sum_over_keys(t, t.ds8.data(), in.k->codes.data(), d, g.iacc, [&](int64_t a, int64_t c, int32_t x) {
      dq[a * d + c] = std::fma(float(x), t.ds8_scale[a] * k_scale, dq[a * d + c]);
    });
  } else {
    sum_over_keys(t, t.ds16.data(), in.k16, d, g.facc,
                  [&](int64_t a, int64_t c, double x) { dq[a * d + c] += float(x); });
  }
  if (int8_dk) {
    const float q_scale = in.q->scale[t.i0];  // one Q scale per Q tile (validate_backward)
    sum_over_rows(t, t.ds8_t.data(), in.q->codes.data(), d, g.iacc, [&](int64_t b, int64_t c, int32_t x) {
      dk[b * d + c] = std::fma(float(x), t.ds8_t_scale[b] * q_scale, dk[b * d + c]);
    });
  } else {
    sum_over_rows(t, t.ds16.data(), in.q16, d, g.facc,
                  [&](int64_t b, int64_t c, double x) { dk[b * d + c] += float(x); });
  }
}

// Step 2: D_i = dO_i . O_i (16-bit values, exact products summed in double, rounded to float).
std::vector<float> row_dots(const BackwardHeadInputs& in) {
  std::vector<float> D(static_cast<size_t>(in.n_q));
  for (int64_t i = 0; i < in.n_q; ++i) D[i] = dot16(in.do16 + i * in.d, in.o16 + i * in.d, in.d);
  return D;
}

}  // namespace

float round16(float x, bool bf16) { return bf16 ? fmt::round_bf16(x) : fmt::round_fp16_saturate_overflow(x); }

Int8Rows quantize_row_blocks(const float* x, int64_t n, int64_t cols, int64_t rows_per_block) {
  Int8Rows q;
  q.rows = rows_per_block;
  q.codes.resize(static_cast<size_t>(n * cols));
  for (int64_t r0 = 0; r0 < n; r0 += rows_per_block) {
    const int64_t r1 = std::min(n, r0 + rows_per_block);
    q.scale.push_back(quantize_block(x + r0 * cols, (r1 - r0) * cols, q.codes.data() + r0 * cols));
  }
  return q;
}

HeadGradients backward_head(const Recipe& r, const BackwardHeadInputs& in, BackwardTileConfig bt) {
  const int64_t d = in.d;
  const std::vector<float> D = row_dots(in);
  const bool int8_do = r.dv_format == BwdFormat::int8 || r.dp_format == BwdFormat::int8;
  const Int8Rows do8 = int8_do ? quantize_row_blocks(in.do16, in.n_q, d, bt.block_q) : Int8Rows{};
  Grads g;
  g.dq.assign(static_cast<size_t>(in.n_q * d), 0.f);
  g.dk.assign(static_cast<size_t>(in.n_kv * d), 0.f);
  g.dv.assign(g.dk.size(), 0.f);
  Tile t;
  // Step 1: one CTA per K/V tile, over the Q tiles in order; a tile no row of which sees a key of
  // is skipped (causal: the visible keys of row i grow with i).
  for (int64_t j0 = 0; j0 < in.n_kv; j0 += bt.block_kv) {
    for (int64_t i0 = 0; i0 < in.n_q; i0 += bt.block_q) {
      const int64_t rows = std::min<int64_t>(bt.block_q, in.n_q - i0);
      if (visible_keys(in, i0 + rows - 1) <= j0) continue;
      t.reset(i0, rows, j0, std::min<int64_t>(bt.block_kv, in.n_kv - j0));
      rebuild_p(in, t);
      compute_ds(r, in, do8, D, t);
      accumulate_dv(r, in, do8, t, g);
      accumulate_dq_dk(r, in, t, g);
    }
  }
  // Step 9: sm_scale, the derivative of the scores' scale, once at the end.
  for (float& x : g.dq) x *= in.sm_scale;
  for (float& x : g.dk) x *= in.sm_scale;
  return {std::move(g.dq), std::move(g.dk), std::move(g.dv)};
}

}  // namespace sim

namespace {

std::vector<float> rounded16(std::vector<float> x, bool bf16) {
  for (float& v : x) v = sim::round16(v, bf16);
  return x;
}

// Every tensor the backward reads, dense (b, h, n, d) in float, as the kernels would hold it.
struct BackwardOperands {
  bool bf16 = false;
  std::vector<float> q16, k16, v16, o16, do16;
  std::vector<sim::Int8Rows> v8;  // per KV head, int8 dP only
};

BackwardOperands prepare_operands(const BackwardArgs& a, const Problem& p, const sim::Forward& f,
                                  BackwardTileConfig bt) {
  BackwardOperands ops;
  ops.bf16 = a.q.dtype == DType::bf16;
  ops.q16 = rounded16(read_bhnd_f32(a.q, a.layout), ops.bf16);
  ops.k16 = rounded16(f.k, ops.bf16);  // K' (smoothed), as dQ = dS K' takes it
  const std::vector<float> v = read_bhnd_f32(a.v, a.layout);
  ops.v16 = rounded16(v, ops.bf16);
  ops.o16 = rounded16(f.out, ops.bf16);
  ops.do16 = rounded16(read_bhnd_f32(a.dout, a.layout), ops.bf16);
  if (a.recipe.dp_format == BwdFormat::int8) {
    const int64_t per_head = p.n_kv * p.head_dim;
    for (int64_t x = 0; x < p.batch * p.heads_kv; ++x)
      ops.v8.push_back(sim::quantize_row_blocks(v.data() + x * per_head, p.n_kv, p.head_dim, bt.block_kv));
  }
  return ops;
}

// dK and dV of each KV head: its query heads' in increasing order, summed in float.
void sum_over_groups(const Problem& p, const std::vector<std::vector<float>>& per_head,
                     std::vector<float>& out) {
  const int64_t group = p.heads_kv > 0 ? p.heads_q / p.heads_kv : 1, per_kv = p.n_kv * p.head_dim;
  out.assign(static_cast<size_t>(p.batch * p.heads_kv * per_kv), 0.f);
  for (int64_t bh = 0; bh < p.batch * p.heads_q; ++bh) {
    const int64_t kv = (bh / p.heads_q) * p.heads_kv + (bh % p.heads_q) / group;
    float* o = out.data() + kv * per_kv;
    for (int64_t e = 0; e < per_kv; ++e) o[e] += per_head[bh][e];
  }
}

}  // namespace

void simulate_backward(const BackwardArgs& args) {
  const Problem p = check_backward_args(args, DeviceKind::cpu);
  validate_backward(args.recipe);
  const sim::Forward f = sim::run_forward(sage::forward_args(args), p, /*keep_q_operands=*/true);
  const BackwardTileConfig bt = backward_tile_config(static_cast<int>(p.head_dim));
  const BackwardOperands ops = prepare_operands(args, p, f, bt);
  const int64_t d = p.head_dim, per_q = p.n_q * d, per_kv = p.n_kv * d;
  const int64_t group = p.heads_kv > 0 ? p.heads_q / p.heads_kv : 1;

  std::vector<float> dq(static_cast<size_t>(p.batch * p.heads_q * per_q));
  std::vector<std::vector<float>> dk_head(static_cast<size_t>(p.batch * p.heads_q));
  std::vector<std::vector<float>> dv_head(dk_head.size());
  parallel_for(p.batch * p.heads_q, [&](int64_t bh) {
    const int64_t kv = (bh / p.heads_q) * p.heads_kv + (bh % p.heads_q) / group;
    sim::BackwardHeadInputs in;
    in.n_q = p.n_q, in.n_kv = p.n_kv, in.d = d;
    in.causal = args.causal;
    in.bf16 = ops.bf16;
    in.sm_scale = p.sm_scale;
    in.sm_scale_log2 = f.sl2;
    in.q = &f.q_ops[bh];
    in.k = &f.kv[kv].k;
    in.q16 = ops.q16.data() + bh * per_q;
    in.k16 = ops.k16.data() + kv * per_kv;
    in.v16 = ops.v16.data() + kv * per_kv;
    in.v8 = ops.v8.empty() ? nullptr : &ops.v8[kv];
    in.o16 = ops.o16.data() + bh * per_q;
    in.do16 = ops.do16.data() + bh * per_q;
    in.lse2 = f.lse2.data() + bh * p.n_q;
    sim::HeadGradients g = sim::backward_head(args.recipe, in, bt);
    std::copy(g.dq.begin(), g.dq.end(), dq.begin() + bh * per_q);
    dk_head[bh] = std::move(g.dk);
    dv_head[bh] = std::move(g.dv);
  });
  std::vector<float> dk, dv;
  sum_over_groups(p, dk_head, dk);
  sum_over_groups(p, dv_head, dv);
  write_bhnd(args.dq, args.layout, dq.data());
  write_bhnd(args.dk, args.layout, dk.data());
  write_bhnd(args.dv, args.layout, dv.data());
  if (args.out.defined()) write_bhnd(args.out, args.layout, f.out.data());
  if (args.lse.defined()) write_flat(args.lse, f.lse.data());
}

}  // namespace sage::reference
