#include "reference/synthetic.h"

#include <algorithm>
#include <cmath>

#include "reference/rounding.h"
#include "sage/error.h"
#include "numerics/formats.h"
#include "numerics/quant_rules.h"

namespace sage::reference {
namespace {

struct Dist {
  const char* name;
  const char* description;
};

constexpr Dist kDists[] = {
    {"normal", "Q, K, V ~ N(0, 1)"},
    {"k_bias", "K with a large per-channel bias ~ N(0, 5^2) shared by all tokens"},
    {"qk_bias", "Q with a per-channel bias ~ N(0, 2^2), K with one ~ N(0, 5^2)"},
    {"outliers", "Q and K with d/32 channels scaled x10..x20"},
    {"sharp", "Q and K times 3: 9x sharper scores"},
    {"v_bias", "V with a large per-channel bias ~ N(0, 5^2)"},
    {"sink", "key 0 scores ~+10 for every query over a diffuse bulk (most P~ ~1e-4, summing to "
             "O(1)); V with a per-channel bias ~ N(0, 2^2)"},
    {"channel_offset", "Q and K with max(2, d/32) channels whose mean is 10..50 (x10..x50 the "
                       "other channels' RMS), as q/k projection biases give (Qwen2-like)"},
};

// Mixes coordinates into independent stream seeds (the SplitMix64 finalizer).
uint64_t mix(uint64_t a, uint64_t b) {
  uint64_t z = a ^ (b + 0x9E3779B97F4A7C15ull + (a << 6) + (a >> 2));
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

enum Tensor : uint64_t { kQ = 1, kK = 2, kV = 3, kBias = 4, kOutlier = 5, kSink = 6, kDout = 7,
                    kOffsetChannels = 8 };

uint64_t stream(uint64_t seed, uint64_t dist, uint64_t tensor, int64_t b, int64_t h) {
  return mix(mix(mix(mix(seed, dist), tensor), static_cast<uint64_t>(b)), static_cast<uint64_t>(h));
}

// channel_offset: the standard deviation of K's offset channels around their mean. With 1 the
// offsets (times K's spread) dominate the scores and make attention sharp, which hides Q's
// coarse INT8 steps (sage2_8b: cosine 0.9992 at d = 64); 0.25 leaves the ordinary channels
// carrying the attention, as on the layers issue 35 measured (0.9957).
constexpr double kOffsetChannelSpread = 0.25;

uint16_t to_fp16(double x) { return fmt::fp16_bits(round_double_to_fp16(x)); }

TensorView view4(const void* data, DType t, int64_t b, int64_t h, int64_t n, int64_t d) {
  return contiguous_view(const_cast<void*>(data), t, {b, h, n, d});
}

}  // namespace

uint64_t Rng::next() {
  uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

double Rng::uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }

double Rng::normal() {
  if (has_spare_) {
    has_spare_ = false;
    return spare_;
  }
  double u, v, s;
  do {
    u = 2.0 * uniform() - 1.0;
    v = 2.0 * uniform() - 1.0;
    s = u * u + v * v;
  } while (s >= 1.0 || s == 0.0);
  const double f = std::sqrt(-2.0 * portable_log(s) / s);  // sqrt is correctly rounded
  spare_ = v * f;
  has_spare_ = true;
  return u * f;
}

double portable_log(double x) {
  if (!(x > 0.0)) return x == 0.0 ? -HUGE_VAL : NAN;
  if (std::isinf(x)) return x;
  int e = 0;
  double m = std::frexp(x, &e);  // exact: x = m * 2^e, m in [0.5, 1)
  if (m < 0.70710678118654752) {
    m *= 2.0;
    e -= 1;
  }
  // log m = 2 atanh(t), t = (m - 1) / (m + 1), |t| <= 0.172: the odd series converges
  // below double precision by its 13th term.
  const double t = (m - 1.0) / (m + 1.0);
  const double t2 = t * t;
  double series = 0.0;
  for (int k = 25; k >= 1; k -= 2) series = series * t2 + 1.0 / k;
  return 2.0 * t * series + static_cast<double>(e) * 0.69314718055994530942;
}

TensorView SyntheticInputs::q_view() const {
  return view4(q.data(), DType::f16, shape.batch, shape.heads_q, shape.n_q, shape.head_dim);
}
TensorView SyntheticInputs::k_view() const {
  return view4(k.data(), DType::f16, shape.batch, shape.heads_kv, shape.n_kv, shape.head_dim);
}
TensorView SyntheticInputs::v_view() const {
  return view4(v.data(), DType::f16, shape.batch, shape.heads_kv, shape.n_kv, shape.v_dim());
}

const std::vector<std::string>& synthetic_distributions() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> v;
    for (const Dist& d : kDists) v.emplace_back(d.name);
    return v;
  }();
  return names;
}

std::string synthetic_description(const std::string& distribution) {
  for (const Dist& d : kDists)
    if (distribution == d.name) return d.description;
  return {};
}

SyntheticInputs make_synthetic(const std::string& distribution, const SyntheticShape& s,
                               uint64_t seed) {
  uint64_t id = 0;
  for (; id < std::size(kDists); ++id)
    if (distribution == kDists[id].name) break;
  if (id == std::size(kDists)) {
    std::string list;
    for (const Dist& d : kDists) list += (list.empty() ? "" : ", ") + std::string(d.name);
    throw Error("distribution", "unknown synthetic distribution '" + distribution +
                                    "'; allowed: " + list);
  }
  if (s.batch < 0 || s.heads_q < 0 || s.heads_kv < 0 || s.n_q < 0 || s.n_kv < 0 || s.head_dim < 1 ||
      s.head_dim_v < 0 || (s.heads_kv > 0 && s.heads_q % s.heads_kv != 0) ||
      (s.heads_kv == 0 && s.heads_q != 0))
    throw Error("shape", "synthetic shapes need sizes >= 0, head_dim >= 1, head_dim_v >= 0 (0: "
                         "head_dim) and heads_kv dividing heads_q");
  const std::string name = distribution;
  SyntheticInputs in;
  in.shape = s;
  in.distribution = distribution;
  in.seed = seed;
  const int64_t d = s.head_dim, dv = s.v_dim();
  in.q.resize(static_cast<size_t>(s.batch * s.heads_q * s.n_q * d));
  in.k.resize(static_cast<size_t>(s.batch * s.heads_kv * s.n_kv * d));
  in.v.resize(static_cast<size_t>(s.batch * s.heads_kv * s.n_kv * dv));
  const int64_t group = s.heads_kv > 0 ? s.heads_q / s.heads_kv : 1;

  // Per-head channel structure: biases and outlier factors (1 where a channel is ordinary).
  auto channel_bias = [&](uint64_t tensor, int64_t b, int64_t h, double sigma, int64_t channels) {
    std::vector<double> bias(static_cast<size_t>(channels), 0.0);
    Rng rng(stream(seed, id, kBias * 16 + tensor, b, h));
    for (auto& x : bias) x = sigma * rng.normal();
    return bias;
  };
  auto outlier_factors = [&](int64_t b, int64_t kvh) {
    std::vector<double> f(static_cast<size_t>(d), 1.0);
    Rng rng(stream(seed, id, kOutlier, b, kvh));
    const int64_t count = std::max<int64_t>(1, d / 32);
    for (int64_t i = 0; i < count; ++i) {
      int64_t c;
      do c = static_cast<int64_t>(rng.next() % static_cast<uint64_t>(d));
      while (f[c] != 1.0);
      f[c] = 10.0 + 10.0 * rng.uniform();
    }
    return f;
  };
  // channel_offset: which channels carry an offset, shared by K and the Q heads of one KV
  // group (a bias lands on the same channels of Q and K, as in Qwen2's q/k projections).
  auto offset_channels = [&](int64_t b, int64_t kvh) {
    std::vector<bool> chosen(static_cast<size_t>(d), false);
    Rng rng(stream(seed, id, kOffsetChannels, b, kvh));
    const int64_t count = std::min<int64_t>(d, std::max<int64_t>(2, d / 32));
    for (int64_t i = 0; i < count; ++i) {
      int64_t c;
      do c = static_cast<int64_t>(rng.next() % static_cast<uint64_t>(d));
      while (chosen[c]);
      chosen[c] = true;
    }
    return chosen;
  };
  // Each tensor's own offsets on those channels: magnitude 10..50 with a random sign.
  auto channel_offsets = [&](const std::vector<bool>& chosen, uint64_t tensor, int64_t b, int64_t h) {
    std::vector<double> offset(static_cast<size_t>(d), 0.0);
    Rng rng(stream(seed, id, kBias * 16 + tensor, b, h));
    for (int64_t c = 0; c < d; ++c)
      if (chosen[c]) offset[c] = ((rng.next() >> 63) ? 1.0 : -1.0) * (10.0 + 40.0 * rng.uniform());
    return offset;
  };
  // Rows of bias.size() channels.
  auto fill = [&](std::vector<uint16_t>& dst, uint64_t tensor, int64_t b, int64_t h, int64_t n,
                  int64_t offset, const std::vector<double>& bias, const std::vector<double>& gain) {
    const int64_t channels = static_cast<int64_t>(bias.size());
    Rng rng(stream(seed, id, tensor, b, h));
    for (int64_t t = 0; t < n; ++t)
      for (int64_t c = 0; c < channels; ++c)
        dst[offset + t * channels + c] = to_fp16(bias[c] + gain[c] * rng.normal());
  };

  const std::vector<double> zero(static_cast<size_t>(d), 0.0), one(static_cast<size_t>(d), 1.0);
  const std::vector<double> three(static_cast<size_t>(d), 3.0);
  const std::vector<double> v_zero(static_cast<size_t>(dv), 0.0), v_one(static_cast<size_t>(dv), 1.0);
  for (int64_t b = 0; b < s.batch; ++b) {
    for (int64_t kvh = 0; kvh < s.heads_kv; ++kvh) {
      const int64_t off = (b * s.heads_kv + kvh) * s.n_kv * d;
      const std::vector<double> outl = name == "outliers" ? outlier_factors(b, kvh) : one;
      const bool offsets = name == "channel_offset";
      const std::vector<bool> offset_at = offsets ? offset_channels(b, kvh) : std::vector<bool>{};
      const std::vector<double> kb = (name == "k_bias" || name == "qk_bias") ? channel_bias(kK, b, kvh, 5.0, d)
                                     : offsets ? channel_offsets(offset_at, kK, b, kvh) : zero;
      // K's offset channels vary little around their mean (the bias dominates them), so the
      // offsets do not make the scores sharp: the ordinary channels carry the attention.
      std::vector<double> k_gain = name == "sharp" ? three : outl;
      if (offsets)
        for (int64_t c = 0; c < d; ++c) k_gain[c] = offset_at[c] ? kOffsetChannelSpread : 1.0;
      fill(in.k, kK, b, kvh, s.n_kv, off, kb, k_gain);
      // The sink: queries share a small common direction u (|u_c| = 0.5) and key 0 points
      // along it, so q . k_0 / sqrt(d) ~ 10 for every query while other scores stay N(0, 1.25).
      std::vector<double> sink_dir(static_cast<size_t>(d), 0.0);
      if (name == "sink") {
        Rng rng(stream(seed, id, kSink, b, kvh));
        for (auto& x : sink_dir) x = (rng.next() >> 63) ? 0.5 : -0.5;
        const double gain = 20.0 / std::sqrt(0.25 * static_cast<double>(d));
        if (s.n_kv > 0)
          for (int64_t c = 0; c < d; ++c) in.k[off + c] = to_fp16(gain * sink_dir[c]);
      }
      const std::vector<double> vb = name == "v_bias" ? channel_bias(kV, b, kvh, 5.0, dv)
                                     : name == "sink" ? channel_bias(kV, b, kvh, 2.0, dv) : v_zero;
      fill(in.v, kV, b, kvh, s.n_kv, (b * s.heads_kv + kvh) * s.n_kv * dv, vb, v_one);
      for (int64_t g = 0; g < group; ++g) {
        const int64_t h = kvh * group + g;
        const int64_t qoff = (b * s.heads_q + h) * s.n_q * d;
        const std::vector<double> qb =
            name == "qk_bias" ? channel_bias(kQ, b, h, 2.0, d) : name == "sink" ? sink_dir
            : offsets ? channel_offsets(offset_at, kQ, b, h) : zero;
        fill(in.q, kQ, b, h, s.n_q, qoff, qb, name == "sharp" ? three : outl);
      }
    }
  }
  return in;
}

std::vector<uint16_t> synthetic_output_gradient(const SyntheticShape& s, uint64_t seed) {
  const int64_t d = s.v_dim();
  std::vector<uint16_t> dout(static_cast<size_t>(s.batch * s.heads_q * s.n_q * d));
  for (int64_t b = 0; b < s.batch; ++b)
    for (int64_t h = 0; h < s.heads_q; ++h) {
      // Its own stream family (no distribution index): the same dO for every distribution.
      Rng rng(stream(seed, 0, kDout, b, h));
      uint16_t* dst = dout.data() + (b * s.heads_q + h) * s.n_q * d;
      for (int64_t i = 0; i < s.n_q * d; ++i) dst[i] = to_fp16(rng.normal());
    }
  return dout;
}

TensorView PrequantizedInputs::q_view() const {
  return view4(q.data(), DType::i8, shape.batch, shape.heads_q, shape.n_q, shape.head_dim);
}
TensorView PrequantizedInputs::k_view() const {
  return view4(k.data(), DType::i8, shape.batch, shape.heads_kv, shape.n_kv, shape.head_dim);
}
TensorView PrequantizedInputs::v_view() const {
  return view4(v.data(), DType::i8, shape.batch, shape.heads_kv, shape.n_kv, shape.v_dim());
}
TensorView PrequantizedInputs::q_scale_view() const {
  return contiguous_view(const_cast<float*>(q_scale.data()), DType::f32,
                         {shape.batch, shape.heads_q, shape.n_q});
}
TensorView PrequantizedInputs::k_scale_view() const {
  return contiguous_view(const_cast<float*>(k_scale.data()), DType::f32,
                         {shape.batch, shape.heads_kv, shape.n_kv});
}
TensorView PrequantizedInputs::v_scale_view() const {
  float* p = const_cast<float*>(v_scale.data());
  if (v_per_channel)
    return contiguous_view(p, DType::f32, {shape.batch, shape.heads_kv, shape.v_dim()});
  return contiguous_view(p, DType::f32, {shape.batch, shape.heads_kv});
}

PrequantizedInputs prequantize_int8(const SyntheticInputs& in, bool v_per_channel) {
  PrequantizedInputs out;
  out.shape = in.shape;
  out.v_per_channel = v_per_channel;
  const int64_t d = in.shape.head_dim;
  const float qmax = static_cast<float>(rules::kInt8Max);
  // One scale per row of head_dim values (per token).
  auto quantize_rows = [&](const std::vector<uint16_t>& src, std::vector<int8_t>& codes,
                           std::vector<float>& scales) {
    const int64_t rows = static_cast<int64_t>(src.size()) / d;
    codes.resize(src.size());
    scales.resize(static_cast<size_t>(rows));
    for (int64_t r = 0; r < rows; ++r) {
      float amax = 0.f;
      for (int64_t c = 0; c < d; ++c) amax = std::max(amax, std::fabs(fmt::fp16_from_bits(src[r * d + c])));
      const float inv = rules::symmetric_inverse(amax, qmax);
      scales[r] = rules::symmetric_scale(amax, qmax);
      for (int64_t c = 0; c < d; ++c)
        codes[r * d + c] = static_cast<int8_t>(
            rules::round_clamp(fmt::fp16_from_bits(src[r * d + c]) * inv, rules::kInt8Max));
    }
  };
  quantize_rows(in.q, out.q, out.q_scale);
  quantize_rows(in.k, out.k, out.k_scale);

  const int64_t heads = in.shape.batch * in.shape.heads_kv, n = in.shape.n_kv;
  const int64_t dv = in.shape.v_dim();
  out.v.resize(in.v.size());
  out.v_scale.assign(static_cast<size_t>(heads * (v_per_channel ? dv : 1)), 0.f);
  for (int64_t x = 0; x < heads; ++x) {
    std::vector<float> amax(static_cast<size_t>(dv), 0.f);
    for (int64_t t = 0; t < n; ++t)
      for (int64_t c = 0; c < dv; ++c)
        amax[c] = std::max(amax[c], std::fabs(fmt::fp16_from_bits(in.v[(x * n + t) * dv + c])));
    if (!v_per_channel) std::fill(amax.begin(), amax.end(), *std::max_element(amax.begin(), amax.end()));
    for (int64_t c = 0; c < dv; ++c) {
      out.v_scale[x * (v_per_channel ? dv : 1) + (v_per_channel ? c : 0)] = rules::symmetric_scale(amax[c], qmax);
      const float inv = rules::symmetric_inverse(amax[c], qmax);
      for (int64_t t = 0; t < n; ++t) {
        const int64_t i = (x * n + t) * dv + c;
        out.v[i] = static_cast<int8_t>(rules::round_clamp(fmt::fp16_from_bits(in.v[i]) * inv, rules::kInt8Max));
      }
    }
  }
  return out;
}

}  // namespace sage::reference
