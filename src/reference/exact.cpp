// The float64 reference: plain softmax attention, the yardstick for every recipe's error.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "numerics/mask.h"
#include "reference/parallel.h"
#include "reference/tensor_io.h"
#include "sage/attention.h"
#include "sage/backward.h"

namespace sage::reference {
namespace {

// Prequantized inputs are compared against what they stand for: codes times their scales.
void dequantize_inputs(const AttentionArgs& a, const Problem& p, std::vector<double>& q,
                       std::vector<double>& k, std::vector<double>& v) {
  const std::vector<double> qs = read_flat_f64(a.q_scale);  // [b, hq, nq]
  const std::vector<double> ks = read_flat_f64(a.k_scale);  // [b, hkv, nkv]
  const std::vector<double> vs = read_flat_f64(a.v_scale);  // [b, hkv] or [b, hkv, d_v]
  const bool v_per_channel = a.v_scale.ndim == 3;
  const int64_t d = p.head_dim, dv = p.head_dim_v;
  for (size_t t = 0; t < qs.size(); ++t)
    for (int64_t c = 0; c < d; ++c) q[t * d + c] *= qs[t];
  for (size_t t = 0; t < ks.size(); ++t)
    for (int64_t c = 0; c < d; ++c) k[t * d + c] *= ks[t];
  const int64_t bh = p.batch * p.heads_kv;
  for (int64_t x = 0; x < bh; ++x)
    for (int64_t j = 0; j < p.n_kv; ++j)
      for (int64_t c = 0; c < dv; ++c)
        v[(x * p.n_kv + j) * dv + c] *= v_per_channel ? vs[x * dv + c] : vs[x];
}

// One query head's tensors for the exact backward, dense [tokens][d] in double.
struct ExactHead {
  const double *q, *k, *v, *dout;
  int64_t nq, nkv, d;
  bool causal;
  double scale;
};

// Softmax attention of row i and its gradients: dq_i, and the row's share of dk and dv
// (added). Writes out_i and lse_i. p is scratch of n_kv entries.
void exact_backward_row(const ExactHead& h, int64_t i, double* out_i, double* lse_i, double* dq_i,
                        double* dk, double* dv, std::vector<double>& p) {
  const int64_t d = h.d;
  const int64_t visible = h.causal ? std::min(h.nkv, std::max<int64_t>(0, i + h.nkv - h.nq + 1)) : h.nkv;
  if (visible == 0) return;  // no key: out, dq stay 0, lse -inf, no share of dk, dv
  const double* qi = h.q + i * d;
  const double* doi = h.dout + i * d;
  double m = -std::numeric_limits<double>::infinity();
  for (int64_t j = 0; j < visible; ++j) {
    double dot = 0;
    for (int64_t c = 0; c < d; ++c) dot += qi[c] * h.k[j * d + c];
    p[j] = h.scale * dot;
    m = std::max(m, p[j]);
  }
  double l = 0;
  for (int64_t j = 0; j < visible; ++j) l += (p[j] = std::exp(p[j] - m));
  for (int64_t j = 0; j < visible; ++j) p[j] /= l;
  for (int64_t j = 0; j < visible; ++j)
    for (int64_t c = 0; c < d; ++c) out_i[c] += p[j] * h.v[j * d + c];
  *lse_i = m + std::log(l);
  double D = 0;  // dO_i . O_i
  for (int64_t c = 0; c < d; ++c) D += doi[c] * out_i[c];
  for (int64_t j = 0; j < visible; ++j) {
    double dp = 0;
    for (int64_t c = 0; c < d; ++c) dp += doi[c] * h.v[j * d + c];
    const double ds = p[j] * (dp - D) * h.scale;  // the gradient of the unscaled dot q_i . k_j
    for (int64_t c = 0; c < d; ++c) {
      dq_i[c] += ds * h.k[j * d + c];
      dk[j * d + c] += ds * qi[c];
      dv[j * d + c] += p[j] * doi[c];
    }
  }
}

}  // namespace

void exact_backward(const BackwardArgs& args) {
  const Problem p = check_backward_args(args, DeviceKind::cpu);
  const std::vector<double> q = read_bhnd_f64(args.q, args.layout);
  const std::vector<double> k = read_bhnd_f64(args.k, args.layout);
  const std::vector<double> v = read_bhnd_f64(args.v, args.layout);
  const std::vector<double> dout = read_bhnd_f64(args.dout, args.layout);
  const int64_t d = p.head_dim, nq = p.n_q, nkv = p.n_kv;
  const int64_t group = p.heads_kv > 0 ? p.heads_q / p.heads_kv : 1;
  const double scale = args.sm_scale ? static_cast<double>(*args.sm_scale)
                                     : 1.0 / std::sqrt(static_cast<double>(d));
  std::vector<double> out(q.size(), 0.0), dq(q.size(), 0.0), dk(k.size(), 0.0), dv(v.size(), 0.0);
  std::vector<double> lse(static_cast<size_t>(p.batch * p.heads_q * nq),
                          -std::numeric_limits<double>::infinity());
  // One worker per KV head, over its query heads in turn: dK and dV sum over the group without
  // two workers writing one element.
  parallel_for(p.batch * p.heads_kv, [&](int64_t x) {
    const int64_t b = x / p.heads_kv, hk = x % p.heads_kv;
    std::vector<double> scratch(static_cast<size_t>(nkv));
    for (int64_t h = hk * group; h < (hk + 1) * group; ++h) {
      const int64_t bh = b * p.heads_q + h;
      const ExactHead eh{q.data() + bh * nq * d, k.data() + x * nkv * d, v.data() + x * nkv * d,
                         dout.data() + bh * nq * d, nq, nkv, d, args.causal, scale};
      for (int64_t i = 0; i < nq; ++i)
        exact_backward_row(eh, i, out.data() + (bh * nq + i) * d, lse.data() + bh * nq + i,
                           dq.data() + (bh * nq + i) * d, dk.data() + x * nkv * d,
                           dv.data() + x * nkv * d, scratch);
    }
  });
  write_bhnd(args.dq, args.layout, dq.data());
  write_bhnd(args.dk, args.layout, dk.data());
  write_bhnd(args.dv, args.layout, dv.data());
  if (args.out.defined()) write_bhnd(args.out, args.layout, out.data());
  if (args.lse.defined()) write_flat(args.lse, lse.data());
}

void exact(const AttentionArgs& args) {
  const Problem p = check_args(args, DeviceKind::cpu);
  std::vector<double> q = read_bhnd_f64(args.q, args.layout);
  std::vector<double> k = read_bhnd_f64(args.k, args.layout);
  std::vector<double> v = read_bhnd_f64(args.v, args.layout);
  if (args.recipe.inputs == Inputs::prequantized_int8) dequantize_inputs(args, p, q, k, v);

  const int64_t d = p.head_dim, dv = p.head_dim_v, nq = p.n_q, nkv = p.n_kv;
  const int64_t group = p.heads_kv > 0 ? p.heads_q / p.heads_kv : 1;
  // Without an explicit scale the reference uses 1/sqrt(d) in double, not its float rounding
  // (Problem::sm_scale), so that it is softmax(Q K^T / sqrt(d)) to float64 accuracy.
  const double scale = args.sm_scale ? static_cast<double>(*args.sm_scale)
                                     : 1.0 / std::sqrt(static_cast<double>(d));
  std::vector<double> out(static_cast<size_t>(p.batch * p.heads_q * nq * dv), 0.0);
  std::vector<double> lse(static_cast<size_t>(p.batch * p.heads_q * nq),
                          -std::numeric_limits<double>::infinity());
  const KeyWindow window{p.window_left, p.window_right};

  parallel_for(p.batch * p.heads_q, [&](int64_t bh) {
    const int64_t b = bh / p.heads_q, h = bh % p.heads_q;
    const double* qh = q.data() + bh * nq * d;
    const int64_t kvh = b * p.heads_kv + h / group;
    const double* kh = k.data() + kvh * nkv * d;
    const double* vh = v.data() + kvh * nkv * dv;
    std::vector<double> s(static_cast<size_t>(nkv));
    std::vector<double> acc(static_cast<size_t>(dv));
    for (int64_t i = 0; i < nq; ++i) {
      // Bottom-right alignment (numerics/mask.h): the keys row i sees are one interval.
      const KeyRange keys = visible_keys(i, nq, nkv, window);
      if (keys.empty()) continue;  // out stays 0, lse stays -inf
      double m = -std::numeric_limits<double>::infinity();
      for (int64_t j = keys.begin; j < keys.end; ++j) {
        double dot = 0;
        for (int64_t c = 0; c < d; ++c) dot += qh[i * d + c] * kh[j * d + c];
        s[j] = scale * dot;
        m = std::max(m, s[j]);
      }
      double l = 0;
      std::fill(acc.begin(), acc.end(), 0.0);
      for (int64_t j = keys.begin; j < keys.end; ++j) {
        const double e = std::exp(s[j] - m);
        l += e;
        for (int64_t c = 0; c < dv; ++c) acc[c] += e * vh[j * dv + c];
      }
      double* o = out.data() + (bh * nq + i) * dv;
      for (int64_t c = 0; c < dv; ++c) o[c] = acc[c] / l;
      lse[bh * nq + i] = m + std::log(l);
    }
  });

  write_bhnd(args.out, args.layout, out.data());
  if (args.lse.defined()) write_flat(args.lse, lse.data());
}

}  // namespace sage::reference
