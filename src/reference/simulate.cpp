// The recipe simulator's driver: runs the stages in the kernel's order for every
// (batch, head). The numerics contract it implements is docs/numerics.md.
#include <algorithm>
#include <cassert>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "reference/accumulate.h"
#include "reference/online_softmax.h"
#include "reference/parallel.h"
#include "reference/pv_quantize.h"
#include "reference/qk_quantize.h"
#include "reference/tensor_io.h"
#include "sage/attention.h"
#include "numerics/quant_rules.h"
#include "numerics/tile.h"

namespace sage::reference {
namespace {

constexpr float kLn2 = 0.6931471805599453f;

// Everything the kernels prepare once per KV head before attention runs.
struct KVHead {
  sim::QKOperand k;
  std::vector<float> k_mean;  // smooth_k: the subtracted mean (for the LSE), else empty
  sim::VOperand v;
  std::vector<float> v_mean;  // smooth_v: added back to the output, else empty
};

KVHead prepare_kv(float* k, float* v, const Problem& p, const Recipe& r, TileConfig tc) {
  KVHead h;
  const int64_t n = p.n_kv, d = p.head_dim;
  if (r.smooth_k) {
    h.k_mean = sim::channel_mean(k, n, d, r.k_mean_stride);
    sim::subtract_channel_mean(k, n, d, h.k_mean.data());
  }
  h.k = sim::quantize_qk(k, n, d, r.qk_format, r.qk_granularity, /*is_q=*/false, tc);
  if (r.smooth_v) {
    h.v_mean = sim::channel_mean(v, n, d);
    sim::subtract_channel_mean(v, n, d, h.v_mean.data());
  }
  h.v = sim::quantize_v(v, n, d, r);
  return h;
}

double dot(const float* a, const float* b, int64_t d) {
  double s = 0;
  for (int64_t c = 0; c < d; ++c) s += static_cast<double>(a[c]) * b[c];
  return s;
}

}  // namespace

void simulate(const AttentionArgs& args) {
  const Problem p = check_args(args, DeviceKind::cpu);
  const Recipe& r = args.recipe;
  const bool preq = r.inputs == Inputs::prequantized_int8;
  const TileConfig tc = tile_config(static_cast<int>(p.head_dim));
  const float sl2 = rules::sm_scale_log2(p.sm_scale);
  const int64_t d = p.head_dim, nq = p.n_q, nkv = p.n_kv;
  const int64_t group = p.heads_kv > 0 ? p.heads_q / p.heads_kv : 1;

  std::vector<float> q = read_bhnd_f32(args.q, args.layout);
  std::vector<float> k = read_bhnd_f32(args.k, args.layout);
  std::vector<float> v = read_bhnd_f32(args.v, args.layout);

  // ---- per KV head: smoothing and quantization of K and V ----
  std::vector<KVHead> kv(static_cast<size_t>(p.batch * p.heads_kv));
  std::vector<double> q_scale, k_scale, v_scale;
  const bool v_per_channel = r.v_scale == VScale::per_channel;
  if (preq) {
    q_scale = read_flat_f64(args.q_scale);
    k_scale = read_flat_f64(args.k_scale);
    v_scale = read_flat_f64(args.v_scale);
  }
  parallel_for(p.batch * p.heads_kv, [&](int64_t x) {
    float* kh = k.data() + x * nkv * d;
    float* vh = v.data() + x * nkv * d;
    if (preq) {
      kv[x].k = sim::prequantized_qk(kh, k_scale.data() + x * nkv, nkv, d);
      kv[x].v = sim::prequantized_v(vh, nkv, d, v_scale.data() + x * (v_per_channel ? d : 1),
                                    v_per_channel);
    } else {
      kv[x] = prepare_kv(kh, vh, p, r, tc);
    }
  });

  // ---- per Q head: Q smoothing and quantization, then the tiled attention loop ----
  std::vector<float> out(static_cast<size_t>(p.batch * p.heads_q * nq * d), 0.f);
  std::vector<float> lse(static_cast<size_t>(p.batch * p.heads_q * nq),
                         -std::numeric_limits<float>::infinity());
  const bool static_p = r.p_scale == PScale::static_max && r.pv_format != PVFormat::nvfp4 &&
                        r.pv_format != PVFormat::mxfp4;
  const float pmax = static_p ? rules::p_static_max(r) : 1.f;
  // The integer row max's exp2 yields P~ * exp_scale: pmax where P's scale is in the
  // exponent, else 1 (P~, multiplied by pmax when quantized).
  const bool p_in_exponent = rules::p_scale_in_exponent(r);
  const float exp_scale = p_in_exponent ? pmax : 1.f;
  const rules::PScaleFold p_fold = rules::p_scale_fold(exp_scale, static_cast<int>(d));
  const bool row_sum_mma = rules::row_sum_in_pv_mma(r, static_cast<int>(d));

  parallel_for(p.batch * p.heads_q, [&](int64_t bh) {
    const int64_t b = bh / p.heads_q, h = bh % p.heads_q;
    const KVHead& kvh = kv[static_cast<size_t>(b * p.heads_kv + h / group)];
    const float* q_orig = q.data() + bh * nq * d;

    sim::QKOperand qop;
    std::vector<float> q_mean;  // smooth_q: one mean per Q tile, [tiles][d]
    if (preq) {
      qop = sim::prequantized_qk(q_orig, q_scale.data() + bh * nq, nq, d);
    } else {
      std::vector<float> qs(q_orig, q_orig + nq * d);
      if (r.smooth_q) {
        const int64_t tiles = ceil_div(nq, tc.block_q);
        q_mean.resize(static_cast<size_t>(tiles * d));
        for (int64_t t = 0; t < tiles; ++t) {
          const int64_t r0 = t * tc.block_q, rows = std::min<int64_t>(tc.block_q, nq - r0);
          const std::vector<float> m = sim::channel_mean(qs.data() + r0 * d, rows, d);
          std::copy(m.begin(), m.end(), q_mean.begin() + t * d);
          sim::subtract_channel_mean(qs.data() + r0 * d, rows, d, m.data());
        }
      }
      qop = sim::quantize_qk(qs.data(), nq, d, r.qk_format, r.qk_granularity, /*is_q=*/true, tc);
    }

    std::vector<float> s2(static_cast<size_t>(tc.block_kv)), pt(static_cast<size_t>(tc.block_kv));
    // Integer row max recipes (docs/numerics.md, steps 4 and 6) keep the accumulators and the
    // multipliers instead of the logits.
    const bool int_max = rules::integer_row_max(r);
    assert(tc.block_kv % 8 == 0);  // tiles start on a thread-group boundary (tile.h)
    std::vector<int32_t> acc(int_max ? static_cast<size_t>(tc.block_kv) : 0);
    std::vector<float> mult(int_max ? static_cast<size_t>(tc.block_kv) : 0);
    std::vector<float> ps(int_max ? static_cast<size_t>(tc.block_kv) : 0);  // P~ * exp_scale
    std::vector<float> O(static_cast<size_t>(d));
    std::vector<float> ds;  // smooth_q: the logit bias of the current Q tile, per key
    int64_t ds_tile = -1;
    sim::PTile ptile;
    sim::AccumScratch scratch;

    for (int64_t i = 0; i < nq; ++i) {
      // Bottom-right causal alignment: query i sees keys j <= i + nkv - nq.
      const int64_t visible = args.causal ? std::clamp<int64_t>(i + nkv - nq + 1, 0, nkv) : nkv;
      if (visible == 0) continue;  // out stays 0, lse -inf
      if (r.smooth_q && q_smooth_block_of(i, tc) != ds_tile) {
        ds_tile = q_smooth_block_of(i, tc);
        ds = sim::smooth_q_logit_bias(q_mean.data() + ds_tile * d, kvh.k, sl2);
      }
      sim::RowState st;
      std::fill(O.begin(), O.end(), 0.f);
      for (int64_t j0 = 0; j0 < visible; j0 += tc.block_kv) {
        const int64_t count = std::min<int64_t>(tc.block_kv, visible - j0);
        float alpha;
        if (int_max) {  // no smooth_q here: the rule excludes it
          sim::qk_int_accumulators(qop, i, kvh.k, j0, count, sl2, acc.data(), mult.data());
          alpha = sim::softmax_enter_tile_integer_max(st, acc.data(), mult.data(), count, p_fold,
                                                      ps.data());
          // P~ for the row sum; with P's scale in the exponent the codes come from ps itself,
          // as on the GPU.
          for (int64_t j = 0; j < count; ++j) pt[j] = ps[j] / exp_scale;
        } else {
          sim::qk_logits(qop, i, kvh.k, j0, count, sl2, s2.data());
          if (r.smooth_q)
            for (int64_t j = 0; j < count; ++j) s2[j] += ds[j0 + j];
          alpha = sim::softmax_enter_tile(st, s2.data(), count, pt.data());
        }
        sim::quantize_p(r, pt.data(), count, ptile, p_in_exponent ? ps.data() : nullptr);
        // pv_mma: in P~ units like the others (pmax a power of two by default: exact).
        const float row_sum = row_sum_mma ? sim::pv_mma_row_sum(r.pv_accum, ptile) / pmax
                              : r.row_sum == RowSum::quantized_p ? ptile.dequantized_sum
                                                                 : sim::softmax_row_sum(pt.data(), count);
        sim::accumulate_tile(r.pv_accum, ptile, kvh.v, j0, alpha, O.data(), scratch);
        sim::softmax_add_row_sum(st, alpha, row_sum);
      }

      float* o = out.data() + (bh * nq + i) * d;
      if (st.l > 0.f) {
        for (int64_t c = 0; c < d; ++c) {
          // Static P and V scales fold into one multiplier per channel; the fp4 and fp16
          // paths already carry dequantized values.
          const float num = static_p ? O[c] * (kvh.v.channel_scale[c] / pmax) : O[c];
          o[c] = num / st.l;
          if (r.smooth_v) o[c] += kvh.v_mean[c];
        }
      }
      // K smoothing shifted every logit of this row by -sm_scale * q_i . mean(K); softmax
      // ignores that, the LSE must not.
      const float shift = r.smooth_k && !preq
                              ? p.sm_scale * static_cast<float>(dot(q_orig + i * d, kvh.k_mean.data(), d))
                              : 0.f;
      lse[bh * nq + i] = (st.m + std::log2(st.l)) * kLn2 + shift;
    }
  });

  write_bhnd(args.out, args.layout, out.data());
  if (args.lse.defined()) write_flat(args.lse, lse.data());
}

}  // namespace sage::reference
