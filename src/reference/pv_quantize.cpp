#include "reference/pv_quantize.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "numerics/formats.h"
#include "numerics/quant_rules.h"

namespace sage::reference::sim {
namespace {

// Encoding and decoding of the statically scaled formats, chosen once per call.
struct StaticCodec {
  PVFormat f;
  float decode_encode(float x) const {
    switch (f) {
      case PVFormat::e4m3: return fmt::e4m3_decode(fmt::e4m3_encode(x));
      case PVFormat::e5m2: return fmt::e5m2_decode(fmt::e5m2_encode(x));
      default: return static_cast<float>(rules::round_clamp(x, rules::kInt8Max));
    }
  }
};

bool is_fp4(PVFormat f) { return f == PVFormat::nvfp4 || f == PVFormat::mxfp4; }

// FP4 microscaling of `count` values with stride `stride`, in consecutive groups of 16
// (NVFP4: E4M3 scale of amax/6) or 32 (MXFP4: E8M0 scale 2^(floor(log2 amax) - 2)).
// Writes the dequantized values (code * group scale, exact in float).
void microscale(const float* x, int64_t count, int64_t stride, bool nv, float* out) {
  const int64_t block = nv ? 16 : 32;
  for (int64_t g0 = 0; g0 < count; g0 += block) {
    const int64_t g1 = std::min(count, g0 + block);
    float a = 0.f;
    for (int64_t t = g0; t < g1; ++t) a = std::max(a, std::fabs(x[t * stride]));
    const float s = nv ? fmt::e4m3_decode(fmt::e4m3_encode(a / 6.f))
                       : fmt::e8m0_decode(fmt::e8m0_mx_scale(a, 2));
    for (int64_t t = g0; t < g1; ++t)
      out[t * stride] = s > 0.f ? fmt::e2m1_decode(fmt::e2m1_encode(x[t * stride] / s)) * s : 0.f;
  }
}

float sum_in_order(const float* x, int64_t n) {
  float s = 0.f;
  for (int64_t i = 0; i < n; ++i) s += x[i];
  return s;
}

}  // namespace


namespace {

// SageBwd's V: one scale per block of block_kv tokens over all channels (int8 only).
void quantize_v_per_block(const float* v, int64_t n, int64_t d, const Recipe& r,
                          int64_t block_kv, VOperand& op) {
  if (block_kv <= 0) throw std::logic_error("quantize_v: per_block V needs the KV tile size");
  const float target = rules::v_static_max(r);
  op.block = block_kv;
  op.block_scale.resize(static_cast<size_t>((n + block_kv - 1) / block_kv));
  op.int_codes.resize(static_cast<size_t>(n * d));
  for (int64_t t0 = 0; t0 < n; t0 += block_kv) {
    const int64_t t1 = std::min(n, t0 + block_kv);
    float amax = 0.f;
    // NaN-propagating, as every group maximum that sets a scale (docs/numerics.md, "Range
    // limits and special inputs"): std::max dropped a NaN and left its tile's scale finite.
    for (int64_t i = t0 * d; i < t1 * d; ++i) amax = rules::max_nan(amax, std::fabs(v[i]));
    op.block_scale[t0 / block_kv] = rules::symmetric_scale(amax, target);
    const float inv = rules::symmetric_inverse(amax, target);
    for (int64_t i = t0 * d; i < t1 * d; ++i) {
      const int32_t code = rules::round_clamp(v[i] * inv, rules::kInt8Max);
      op.int_codes[i] = static_cast<int8_t>(code);
      op.values[i] = static_cast<float>(code);
    }
  }
}

// SageBwd's P: per row and tile, the largest P~ (row_peak) maps to 127.
void quantize_p_per_token(const float* p, int64_t count, float row_peak, PTile& out) {
  const float fq = static_cast<float>(rules::kInt8Max);
  const float inv = rules::symmetric_inverse(row_peak, fq);
  out.row_scale = rules::symmetric_scale(row_peak, fq);
  out.int_codes.resize(static_cast<size_t>(count));
  for (int64_t j = 0; j < count; ++j) {
    // The clamp acts when a P~ rounds above row_peak (the integer row max forms them apart).
    const int32_t code = rules::round_clamp(p[j] * inv, rules::kInt8Max);
    out.int_codes[j] = static_cast<int8_t>(code);
    out.values[j] = static_cast<float>(code);
  }
  out.dequantized_sum = sum_in_order(out.values.data(), count) * out.row_scale;
}

}  // namespace

VOperand quantize_v(const float* v, int64_t n, int64_t d, const Recipe& r, int64_t block_kv) {
  VOperand op;
  op.format = r.pv_format;
  op.n = n;
  op.d = d;
  op.values.resize(static_cast<size_t>(n * d));
  if (r.pv_format == PVFormat::fp16) {
    for (int64_t i = 0; i < n * d; ++i) {
      op.values[i] = fmt::round_fp16_saturate_overflow(v[i]);
      op.nonfinite = op.nonfinite || !std::isfinite(op.values[i]);
    }
    return op;
  }
  if (r.v_scale == VScale::per_block) {
    quantize_v_per_block(v, n, d, r, block_kv, op);
    return op;
  }
  if (is_fp4(r.pv_format)) {
    // Groups run along tokens (the PV matmul's inner axis), per channel.
    for (int64_t c = 0; c < d; ++c)
      microscale(v + c, n, d, r.pv_format == PVFormat::nvfp4, op.values.data() + c);
    return op;
  }
  std::vector<float> vmax(static_cast<size_t>(d), 0.f);
  for (int64_t t = 0; t < n; ++t)
    for (int64_t c = 0; c < d; ++c) vmax[c] = rules::max_nan(vmax[c], std::fabs(v[t * d + c]));
  if (r.v_scale == VScale::per_tensor) {
    float all = 0.f;
    for (float m : vmax) all = rules::max_nan(all, m);
    std::fill(vmax.begin(), vmax.end(), all);
  }
  const float target = rules::v_static_max(r);
  const StaticCodec codec{r.pv_format};
  std::vector<float> mult(static_cast<size_t>(d));
  op.channel_scale.resize(static_cast<size_t>(d));
  for (int64_t c = 0; c < d; ++c) {
    op.channel_scale[c] = rules::symmetric_scale(vmax[c], target);
    mult[c] = vmax[c] > 0.f ? target / vmax[c] : 0.f;
  }
  for (int64_t t = 0; t < n; ++t)
    for (int64_t c = 0; c < d; ++c) op.values[t * d + c] = codec.decode_encode(v[t * d + c] * mult[c]);
  if (r.pv_format == PVFormat::int8) {
    op.int_codes.resize(op.values.size());
    for (size_t i = 0; i < op.values.size(); ++i) op.int_codes[i] = static_cast<int8_t>(op.values[i]);
  }
  return op;
}

VOperand prequantized_v(const float* codes, int64_t n, int64_t d, const double* scale,
                        bool per_channel) {
  VOperand op;
  op.format = PVFormat::int8;
  op.n = n;
  op.d = d;
  op.values.assign(codes, codes + n * d);
  op.int_codes.resize(static_cast<size_t>(n * d));
  for (int64_t i = 0; i < n * d; ++i) op.int_codes[i] = static_cast<int8_t>(codes[i]);
  op.channel_scale.resize(static_cast<size_t>(d));
  for (int64_t c = 0; c < d; ++c) op.channel_scale[c] = static_cast<float>(per_channel ? scale[c] : scale[0]);
  return op;
}

void quantize_p(const Recipe& r, const float* p, int64_t count, PTile& out, const float* scaled,
                float row_peak) {
  out.values.resize(static_cast<size_t>(count));
  out.row_scale = 1.f;
  float* q = out.values.data();
  if (r.p_scale == PScale::per_token) {
    quantize_p_per_token(p, count, row_peak, out);
    return;
  }
  if (r.pv_format == PVFormat::fp16) {
    for (int64_t j = 0; j < count; ++j) q[j] = fmt::round_fp16(p[j]);
    out.dequantized_sum = sum_in_order(q, count);
    return;
  }
  if (is_fp4(r.pv_format)) {
    const bool nv = r.pv_format == PVFormat::nvfp4;
    if (r.p_scale == PScale::two_level) {
      // Level one maps the row's largest P~ of this tile to the top of the fp4 grid times
      // the top of the scale format (NVFP4: 6 * 448, so every E4M3 group scale keeps its
      // full precision); MXFP4's power-of-two scales lose nothing at any magnitude, so its
      // first level only aligns the row max with 6 (see docs/numerics.md).
      float rowmax = 0.f;
      for (int64_t j = 0; j < count; ++j) rowmax = std::max(rowmax, p[j]);
      const float sr = rowmax / (nv ? 448.f * 6.f : 6.f);
      if (!(sr > 0.f)) {
        std::fill(q, q + count, 0.f);
        out.row_scale = 0.f;
        out.dequantized_sum = 0.f;
        return;
      }
      std::vector<float> p2(static_cast<size_t>(count));
      for (int64_t j = 0; j < count; ++j) p2[j] = p[j] / sr;
      microscale(p2.data(), count, 1, nv, q);
      out.row_scale = sr;
      out.dequantized_sum = sum_in_order(q, count) * sr;
    } else {
      microscale(p, count, 1, nv, q);
      out.dequantized_sum = sum_in_order(q, count);
    }
    return;
  }
  const float pmax = rules::p_static_max(r);
  const StaticCodec codec{r.pv_format};
  for (int64_t j = 0; j < count; ++j) q[j] = codec.decode_encode(scaled ? scaled[j] : p[j] * pmax);
  if (r.pv_format == PVFormat::int8) {
    out.int_codes.resize(static_cast<size_t>(count));
    for (int64_t j = 0; j < count; ++j) out.int_codes[j] = static_cast<int8_t>(q[j]);
  }
  out.dequantized_sum = sum_in_order(q, count) / pmax;
}

}  // namespace sage::reference::sim
