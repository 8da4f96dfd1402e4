#include "reference/qk_quantize.h"

#include <algorithm>
#include <cassert>
#include <cmath>

#include "numerics/formats.h"
#include "numerics/quant_rules.h"

namespace sage::reference::sim {
namespace {

// Per-group scales for the integer formats and e4m3: every channel of every token of a
// group shares one scale.
void quantize_grouped(const float* x, int64_t n, int64_t d, QKFormat format,
                      Granularity granularity, bool is_q, TileConfig tc, QKOperand& op) {
  const int64_t groups = is_q ? q_group_count(granularity, n, tc) : k_group_count(granularity, n, tc);
  std::vector<int64_t> group_of(static_cast<size_t>(n));
  std::vector<float> amax(static_cast<size_t>(groups), 0.f);
  for (int64_t t = 0; t < n; ++t) {
    const int64_t g = is_q ? q_group_of(granularity, t, tc) : k_group_of(granularity, t, tc);
    group_of[t] = g;
    float a = amax[g];
    for (int64_t c = 0; c < d; ++c) a = rules::max_nan(a, std::fabs(x[t * d + c]));
    amax[g] = a;
  }
  op.scale.resize(static_cast<size_t>(n));
  if (format == QKFormat::e4m3) {
    op.values.resize(static_cast<size_t>(n * d));
    for (int64_t t = 0; t < n; ++t) {
      const float a = amax[group_of[t]];
      const float inv = a > 0.f ? 448.f / a : 0.f;
      op.scale[t] = rules::symmetric_scale(a, 448.f);
      for (int64_t c = 0; c < d; ++c)
        op.values[t * d + c] = fmt::e4m3_decode(fmt::e4m3_encode(x[t * d + c] * inv));
    }
    return;
  }
  const int qmax = format == QKFormat::int4 ? rules::kInt4Max : rules::kInt8Max;
  const float fq = static_cast<float>(qmax);
  op.codes.resize(static_cast<size_t>(n * d));
  for (int64_t t = 0; t < n; ++t) {
    const float a = amax[group_of[t]];
    const float inv = rules::symmetric_inverse(a, fq);
    op.scale[t] = rules::symmetric_scale(a, fq);
    for (int64_t c = 0; c < d; ++c)
      op.codes[t * d + c] = static_cast<int8_t>(rules::round_clamp(x[t * d + c] * inv, qmax));
  }
}

// FP4 microscaling along head_dim: each token's channels in consecutive blocks of 16
// (NVFP4, E4M3 scale of amax/6) or 32 (MXFP4, E8M0 scale 2^(floor(log2 amax) - 2)).
void quantize_fp4_channels(const float* x, int64_t n, int64_t d, bool nv, QKOperand& op) {
  const int64_t block = nv ? 16 : 32;
  op.values.resize(static_cast<size_t>(n * d));
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t c0 = 0; c0 < d; c0 += block) {
      const int64_t c1 = std::min(d, c0 + block);
      float a = 0.f;
      for (int64_t c = c0; c < c1; ++c) a = std::max(a, std::fabs(x[t * d + c]));
      const float s = nv ? fmt::e4m3_decode(fmt::e4m3_encode(a / 6.f))
                         : fmt::e8m0_decode(fmt::e8m0_mx_scale(a, 2));
      for (int64_t c = c0; c < c1; ++c) {
        const float v = s > 0.f ? fmt::e2m1_decode(fmt::e2m1_encode(x[t * d + c] / s)) : 0.f;
        op.values[t * d + c] = v * s;  // exact: <= 2 significant bits times a short scale
      }
    }
  }
}

// The dot in double is exact for E4M3 and FP4 operands (products of at most 12 significant
// bits whose lowest bits lie above 2^-20, far fewer than 53 bits of spread unless an MXFP4
// token mixes group scales ~2^30 apart), so the four partial sums give the same bits as any
// other order; fp16 operands are within 2^-53 relative of exact.
double dot_double(const float* a, const float* b, int64_t d) {
  double s0 = 0, s1 = 0, s2 = 0, s3 = 0;
  int64_t c = 0;
  for (; c + 4 <= d; c += 4) {
    s0 += static_cast<double>(a[c]) * b[c];
    s1 += static_cast<double>(a[c + 1]) * b[c + 1];
    s2 += static_cast<double>(a[c + 2]) * b[c + 2];
    s3 += static_cast<double>(a[c + 3]) * b[c + 3];
  }
  for (; c < d; ++c) s0 += static_cast<double>(a[c]) * b[c];
  return (s0 + s1) + (s2 + s3);
}

int32_t dot_int(const int8_t* a, const int8_t* b, int64_t d) {
  int32_t s = 0;
  for (int64_t c = 0; c < d; ++c) s += static_cast<int32_t>(a[c]) * static_cast<int32_t>(b[c]);
  return s;
}

}  // namespace

std::vector<float> channel_mean(const float* x, int64_t n, int64_t d, int stride) {
  std::vector<double> sum(static_cast<size_t>(d), 0.0);
  int64_t count = 0;
  for (int64_t t = 0; t < n; t += stride, ++count)
    for (int64_t c = 0; c < d; ++c) sum[c] += x[t * d + c];
  std::vector<float> mean(static_cast<size_t>(d), 0.f);
  if (count > 0)
    for (int64_t c = 0; c < d; ++c) mean[c] = static_cast<float>(sum[c] / static_cast<double>(count));
  return mean;
}

void subtract_channel_mean(float* x, int64_t n, int64_t d, const float* mean) {
  for (int64_t t = 0; t < n; ++t)
    for (int64_t c = 0; c < d; ++c) x[t * d + c] -= mean[c];
}

void accumulate_channel_abs_max(const float* x, int64_t n, int64_t d, float* amax, int stride) {
  for (int64_t t = 0; t < n; t += stride)
    for (int64_t c = 0; c < d; ++c) amax[c] = rules::max_nan(amax[c], std::fabs(x[t * d + c]));
}

std::vector<float> qk_balance_scales(const float* q_amax, const float* k_amax, int64_t d) {
  std::vector<float> s(static_cast<size_t>(d));
  for (int64_t c = 0; c < d; ++c) s[c] = rules::qk_balance_scale(q_amax[c], k_amax[c]);
  return s;
}

void scale_channels(float* x, int64_t n, int64_t d, const float* s, bool divide) {
  for (int64_t t = 0; t < n; ++t)
    for (int64_t c = 0; c < d; ++c) x[t * d + c] = divide ? x[t * d + c] / s[c] : x[t * d + c] * s[c];
}

QKOperand quantize_qk(const float* x, int64_t n, int64_t d, QKFormat format,
                      Granularity granularity, bool is_q, TileConfig tc) {
  QKOperand op;
  op.format = format;
  op.n = n;
  op.d = d;
  switch (format) {
    case QKFormat::int8:
    case QKFormat::int4:
    case QKFormat::e4m3:
      quantize_grouped(x, n, d, format, granularity, is_q, tc, op);
      break;
    case QKFormat::nvfp4:
    case QKFormat::mxfp4:
      quantize_fp4_channels(x, n, d, format == QKFormat::nvfp4, op);
      break;
    case QKFormat::fp16:
      // The 16-bit MMA takes fp16 operands: a smoothed K (or a bf16 input) is stored as
      // fp16, saturating rather than overflowing.
      op.values.resize(static_cast<size_t>(n * d));
      for (int64_t i = 0; i < n * d; ++i) op.values[i] = fmt::round_fp16_saturate_overflow(x[i]);
      break;
  }
  return op;
}

QKOperand prequantized_qk(const float* codes, const double* token_scale, int64_t n, int64_t d) {
  QKOperand op;
  op.format = QKFormat::int8;
  op.n = n;
  op.d = d;
  op.codes.resize(static_cast<size_t>(n * d));
  for (int64_t i = 0; i < n * d; ++i) op.codes[i] = static_cast<int8_t>(codes[i]);
  op.scale.resize(static_cast<size_t>(n));
  for (int64_t t = 0; t < n; ++t) op.scale[t] = static_cast<float>(token_scale[t]);
  return op;
}

void qk_logits(const QKOperand& q, int64_t i, const QKOperand& k, int64_t j0, int64_t count,
               float sm_scale_log2, float* s2) {
  const int64_t d = q.d;
  switch (q.format) {
    case QKFormat::int8:
    case QKFormat::int4: {
      const int8_t* qi = q.codes.data() + i * d;
      const float qs = q.scale[i];
      for (int64_t j = 0; j < count; ++j) {
        const int32_t acc = dot_int(qi, k.codes.data() + (j0 + j) * d, d);
        s2[j] = static_cast<float>(acc) * rules::score_multiplier(qs, k.scale[j0 + j], sm_scale_log2);
      }
      break;
    }
    case QKFormat::e4m3: {
      const float* qi = q.values.data() + i * d;
      const float qs = q.scale[i];
      for (int64_t j = 0; j < count; ++j) {
        const float dot = static_cast<float>(dot_double(qi, k.values.data() + (j0 + j) * d, d));
        s2[j] = dot * rules::score_multiplier(qs, k.scale[j0 + j], sm_scale_log2);
      }
      break;
    }
    case QKFormat::nvfp4:
    case QKFormat::mxfp4:
    case QKFormat::fp16: {
      const float* qi = q.values.data() + i * d;
      for (int64_t j = 0; j < count; ++j)
        s2[j] = static_cast<float>(dot_double(qi, k.values.data() + (j0 + j) * d, d)) * sm_scale_log2;
      break;
    }
  }
}

void qk_int_accumulators(const QKOperand& q, int64_t i, const QKOperand& k, int64_t j0,
                         int64_t count, float sm_scale_log2, int32_t* acc, float* mult) {
  assert(q.format == QKFormat::int8 || q.format == QKFormat::int4);
  const int64_t d = q.d;
  const int8_t* qi = q.codes.data() + i * d;
  const float qs = q.scale[i];
  for (int64_t j = 0; j < count; ++j) {
    acc[j] = dot_int(qi, k.codes.data() + (j0 + j) * d, d);
    mult[j] = rules::score_multiplier(qs, k.scale[j0 + j], sm_scale_log2);
  }
}

std::vector<float> smooth_q_logit_bias(const float* qm, const QKOperand& k, float sm_scale_log2) {
  const int64_t d = k.d;
  std::vector<float> bias(static_cast<size_t>(k.n));
  for (int64_t j = 0; j < k.n; ++j) {
    const int8_t* kj = k.codes.data() + j * d;
    // Eight interleaved partial sums (channel c goes to c % 8), combined as a tree: the GPU
    // kernel's order, which keeps its dependency chain at d / 8 additions.
    float part[kSmoothQPartials] = {};
    for (int64_t c = 0; c < d; ++c)
      part[c % kSmoothQPartials] += qm[c] * static_cast<float>(kj[c]);
    const float acc = ((part[0] + part[1]) + (part[2] + part[3])) +
                      ((part[4] + part[5]) + (part[6] + part[7]));
    bias[j] = (k.scale[j] * acc) * sm_scale_log2;
  }
  return bias;
}

}  // namespace sage::reference::sim
