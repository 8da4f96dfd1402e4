// The float64 reference: plain softmax attention, the yardstick for every recipe's error.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "reference/parallel.h"
#include "reference/tensor_io.h"
#include "sage/attention.h"

namespace sage::reference {
namespace {

// Prequantized inputs are compared against what they stand for: codes times their scales.
void dequantize_inputs(const AttentionArgs& a, const Problem& p, std::vector<double>& q,
                       std::vector<double>& k, std::vector<double>& v) {
  const std::vector<double> qs = read_flat_f64(a.q_scale);  // [b, hq, nq]
  const std::vector<double> ks = read_flat_f64(a.k_scale);  // [b, hkv, nkv]
  const std::vector<double> vs = read_flat_f64(a.v_scale);  // [b, hkv] or [b, hkv, d]
  const bool v_per_channel = a.v_scale.ndim == 3;
  const int64_t d = p.head_dim;
  for (size_t t = 0; t < qs.size(); ++t)
    for (int64_t c = 0; c < d; ++c) q[t * d + c] *= qs[t];
  for (size_t t = 0; t < ks.size(); ++t)
    for (int64_t c = 0; c < d; ++c) k[t * d + c] *= ks[t];
  const int64_t bh = p.batch * p.heads_kv;
  for (int64_t x = 0; x < bh; ++x)
    for (int64_t j = 0; j < p.n_kv; ++j)
      for (int64_t c = 0; c < d; ++c)
        v[(x * p.n_kv + j) * d + c] *= v_per_channel ? vs[x * d + c] : vs[x];
}

}  // namespace

void exact(const AttentionArgs& args) {
  const Problem p = check_args(args, DeviceKind::cpu);
  std::vector<double> q = read_bhnd_f64(args.q, args.layout);
  std::vector<double> k = read_bhnd_f64(args.k, args.layout);
  std::vector<double> v = read_bhnd_f64(args.v, args.layout);
  if (args.recipe.inputs == Inputs::prequantized_int8) dequantize_inputs(args, p, q, k, v);

  const int64_t d = p.head_dim, nq = p.n_q, nkv = p.n_kv;
  const int64_t group = p.heads_kv > 0 ? p.heads_q / p.heads_kv : 1;
  // Without an explicit scale the reference uses 1/sqrt(d) in double, not its float rounding
  // (Problem::sm_scale), so that it is softmax(Q K^T / sqrt(d)) to float64 accuracy.
  const double scale = args.sm_scale ? static_cast<double>(*args.sm_scale)
                                     : 1.0 / std::sqrt(static_cast<double>(d));
  std::vector<double> out(static_cast<size_t>(p.batch * p.heads_q * nq * d), 0.0);
  std::vector<double> lse(static_cast<size_t>(p.batch * p.heads_q * nq),
                          -std::numeric_limits<double>::infinity());

  parallel_for(p.batch * p.heads_q, [&](int64_t bh) {
    const int64_t b = bh / p.heads_q, h = bh % p.heads_q;
    const double* qh = q.data() + bh * nq * d;
    const int64_t kvh = b * p.heads_kv + h / group;
    const double* kh = k.data() + kvh * nkv * d;
    const double* vh = v.data() + kvh * nkv * d;
    std::vector<double> s(static_cast<size_t>(nkv));
    std::vector<double> acc(static_cast<size_t>(d));
    for (int64_t i = 0; i < nq; ++i) {
      // Bottom-right alignment: the last query sees the last key.
      const int64_t visible = args.causal ? std::min(nkv, std::max<int64_t>(0, i + nkv - nq + 1)) : nkv;
      if (visible == 0) continue;  // out stays 0, lse stays -inf
      double m = -std::numeric_limits<double>::infinity();
      for (int64_t j = 0; j < visible; ++j) {
        double dot = 0;
        for (int64_t c = 0; c < d; ++c) dot += qh[i * d + c] * kh[j * d + c];
        s[j] = scale * dot;
        m = std::max(m, s[j]);
      }
      double l = 0;
      std::fill(acc.begin(), acc.end(), 0.0);
      for (int64_t j = 0; j < visible; ++j) {
        const double e = std::exp(s[j] - m);
        l += e;
        for (int64_t c = 0; c < d; ++c) acc[c] += e * vh[j * d + c];
      }
      double* o = out.data() + (bh * nq + i) * d;
      for (int64_t c = 0; c < d; ++c) o[c] = acc[c] / l;
      lse[bh * nq + i] = m + std::log(l);
    }
  });

  write_bhnd(args.out, args.layout, out.data());
  if (args.lse.defined()) write_flat(args.lse, lse.data());
}

}  // namespace sage::reference
