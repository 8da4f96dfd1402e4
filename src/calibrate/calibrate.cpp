// Per-layer recipe selection: accuracy from the simulator, speed from measurements.
#include <algorithm>
#include <cmath>
#include <fstream>
#include <set>

#include "common/json.h"
#include "reference/metrics.h"
#include "reference/tensor_io.h"
#include "sage/attention.h"
#include "sage/calibrate.h"
#include "sage/error.h"

namespace sage {
namespace {

// NaN ranks below every number, so a broken candidate is never "most accurate".
double rank_cos(double c) { return std::isnan(c) ? -INFINITY : c; }

// The output of the layer's call: q's shape with V's head dim.
TensorView dense_out(void* data, DType dtype, const Problem& p, Layout layout) {
  if (layout == Layout::HND) return contiguous_view(data, dtype, {p.batch, p.heads_q, p.n_q, p.head_dim_v});
  return contiguous_view(data, dtype, {p.batch, p.n_q, p.heads_q, p.head_dim_v});
}

std::vector<const Recipe*> resolve_candidates(const std::vector<std::string>& names) {
  if (names.empty()) throw Error("candidates", "the list is empty");
  std::vector<const Recipe*> out;
  std::set<std::string> seen;
  for (const std::string& n : names) {
    const Recipe* r = nullptr;
    try {
      r = &preset(n);
    } catch (const Error& e) {
      throw Error("candidates", e.what());
    }
    if (r->inputs != Inputs::floating)
      throw Error("candidates", "'" + n + "' takes prequantized INT8 inputs; calibration samples "
                                "are floating point (use its floating-input twin)");
    if (!seen.insert(n).second) throw Error("candidates", "'" + n + "' is listed twice");
    out.push_back(r);
  }
  return out;
}

// A non-finite sample makes every candidate's score meaningless (a cosine of NaN, or one
// against the float64 reference's own NaN rows), so the layer is refused rather than given a
// choice. The error names the first such element as [batch, head, token, channel].
void require_finite(const TensorView& t, const char* name, Layout layout) {
  const reference::Dims4 d = reference::dims_of(t, layout);
  const std::vector<float> values = reference::read_bhnd_f32(t, layout);
  const auto bad =
      std::find_if(values.begin(), values.end(), [](float x) { return !std::isfinite(x); });
  if (bad == values.end()) return;
  const int64_t i = bad - values.begin();
  const int64_t index[4] = {i / (d.d * d.n * d.h), i / (d.d * d.n) % d.h, i / d.d % d.n, i % d.d};
  std::string at;
  for (int64_t x : index) at += (at.empty() ? "" : ", ") + std::to_string(x);
  throw Error(name, std::string("holds ") + (std::isnan(*bad) ? "NaN" : "Inf") +
                        " at [batch, head, token, channel] = [" + at +
                        "]; calibration scores finite attention, so every sample must be finite");
}

}  // namespace

std::vector<std::string> default_candidates() {
  std::vector<std::string> v;
  for (const Recipe& r : presets())
    if (r.inputs == Inputs::floating) v.push_back(r.name);
  return v;
}

size_t select_candidate(const std::vector<CandidateScore>& scores) {
  if (scores.empty()) throw Error("candidates", "no scores to select from");
  // Tier 0: passed and measured (fastest wins); 1: passed, not measured (most accurate wins);
  // 2: failed (most accurate wins). A lower tier always beats a higher one.
  auto tier = [](const CandidateScore& s) { return s.passed ? (s.tops ? 0 : 1) : 2; };
  size_t best = 0;
  for (size_t i = 1; i < scores.size(); ++i) {
    const CandidateScore& a = scores[i];
    const CandidateScore& b = scores[best];
    const int ta = tier(a), tb = tier(b);
    if (ta != tb) {
      if (ta < tb) best = i;
      continue;
    }
    if (ta == 0 && *a.tops != *b.tops) {
      if (*a.tops > *b.tops) best = i;
      continue;
    }
    // Strictly greater keeps the earlier candidate on an exact tie.
    if (rank_cos(a.cosine) > rank_cos(b.cosine)) best = i;
  }
  return best;
}

Calibration calibrate(const std::vector<LayerSamples>& layers, const SpeedTable& speeds,
                      const CalibrationOptions& options) {
  Calibration c;
  c.candidates = options.candidates.empty() ? default_candidates() : options.candidates;
  const std::vector<const Recipe*> recipes = resolve_candidates(c.candidates);
  if (!(options.threshold > 0 && options.threshold <= 1))
    throw Error("threshold", "must be in (0, 1] (got " + json_number(options.threshold) + ")");
  if (layers.empty()) throw Error("layers", "no layers to calibrate");
  if (options.speed_tokens < 0) throw Error("speed_tokens", "must be >= 0");
  c.threshold = options.threshold;
  c.causal = options.causal;
  c.speed_source = speeds.source;

  for (size_t li = 0; li < layers.size(); ++li) {
    const LayerSamples& s = layers[li];
    const std::string layer_name = "layer " + std::to_string(li);
    AttentionArgs args;
    args.q = s.q;
    args.k = s.k;
    args.v = s.v;
    args.layout = options.layout;
    args.causal = options.causal;
    args.sm_scale = options.sm_scale;
    // The GPU kernels take f16/bf16 only; f32 samples would measure numbers no kernel sees.
    if (s.q.dtype != DType::f16 && s.q.dtype != DType::bf16)
      throw Error("layers", layer_name + ": q: dtype must be f16 or bf16 (got " +
                                std::string(dtype_name(s.q.dtype)) + ")");
    Problem p;
    std::vector<double> exact_buf;
    std::vector<uint16_t> sim_buf;
    try {
      // check_args wants an output; give it the shape it will have (never written).
      Problem shape_only;
      {
        AttentionArgs probe = args;
        probe.out = contiguous_view(s.q.data, s.q.dtype,
                                    {s.q.shape[0], s.q.shape[1], s.q.shape[2], s.v.shape[3]});
        shape_only = check_args(probe, DeviceKind::cpu);
      }
      p = shape_only;
      require_finite(s.q, "q", options.layout);
      require_finite(s.k, "k", options.layout);
      require_finite(s.v, "v", options.layout);
      exact_buf.resize(static_cast<size_t>(p.batch * p.heads_q * p.n_q * p.head_dim_v));
      sim_buf.resize(exact_buf.size());
      args.out = dense_out(exact_buf.data(), DType::f64, p, options.layout);
      reference::exact(args);
    } catch (const Error& e) {
      throw Error("layers", layer_name + ": " + e.what());
    }
    const std::vector<double> ref = reference::read_bhnd_f64(args.out, options.layout);
    const int64_t per_sample = p.heads_q * p.n_q * p.head_dim_v;
    const int64_t speed_n = options.speed_tokens > 0 ? options.speed_tokens : p.n_kv;

    LayerChoice choice;
    choice.layer = static_cast<int64_t>(li);
    for (const Recipe* r : recipes) {
      if (options.on_step) options.on_step(choice.layer, r->name);
      AttentionArgs a = args;
      a.recipe = *r;
      // The kernels write the input dtype, so the score includes that final rounding.
      a.out = dense_out(sim_buf.data(), s.q.dtype, p, options.layout);
      reference::simulate(a);
      const std::vector<float> out = reference::read_bhnd_f32(a.out, options.layout);
      CandidateScore sc;
      sc.recipe = r->name;
      sc.cosine = INFINITY;
      sc.rel_l1 = -INFINITY;
      for (int64_t b = 0; b < p.batch; ++b) {
        const reference::ErrorStats st =
            reference::compare(out.data() + b * per_sample, ref.data() + b * per_sample, per_sample);
        // Written so that a NaN metric sticks instead of being skipped by min/max.
        if (!(st.cosine >= sc.cosine)) sc.cosine = st.cosine;
        if (!(st.rel_l1 <= sc.rel_l1)) sc.rel_l1 = st.rel_l1;
      }
      sc.passed = sc.cosine >= options.threshold;
      if (const auto e = speeds.lookup(r->name, p.head_dim, options.causal, speed_n)) {
        sc.tops = e->tops;
        sc.speed_n = e->n;
      }
      choice.scores.push_back(sc);
    }
    const CandidateScore& pick = choice.scores[select_candidate(choice.scores)];
    choice.recipe = pick.recipe;
    choice.cosine = pick.cosine;
    choice.rel_l1 = pick.rel_l1;
    choice.tops = pick.tops;
    choice.passed = pick.passed;
    c.layers.push_back(std::move(choice));
  }
  return c;
}

std::string calibration_json(const Calibration& c) {
  std::string o = "{\n";
  o += "  \"version\": 1,\n";
  o += "  \"threshold\": " + json_number(c.threshold) + ",\n";
  o += std::string("  \"causal\": ") + (c.causal ? "true" : "false") + ",\n";
  o += "  \"layers\": [";
  for (size_t i = 0; i < c.layers.size(); ++i) {
    const LayerChoice& l = c.layers[i];
    o += i ? ",\n    " : "\n    ";
    o += "{\"layer\": " + std::to_string(l.layer) + ", \"recipe\": " + json_string(l.recipe) +
         ", \"cosine\": " + json_number(l.cosine) + ", \"rel_l1\": " + json_number(l.rel_l1) +
         ", \"tops\": " + (l.tops ? json_number(*l.tops) : "null") +
         ", \"passed\": " + (l.passed ? "true" : "false") + "}";
  }
  o += c.layers.empty() ? "],\n" : "\n  ],\n";
  o += "  \"candidates\": [";
  for (size_t i = 0; i < c.candidates.size(); ++i)
    o += (i ? ", " : "") + json_string(c.candidates[i]);
  o += "],\n";
  o += "  \"speed_source\": " + json_string(c.speed_source) + "\n}\n";
  return o;
}

void save_calibration(const Calibration& c, const std::string& path) {
  std::ofstream f(path, std::ios::binary);
  if (!f) throw Error("out", path + ": cannot be opened for writing");
  f << calibration_json(c);
  f.close();
  if (!f) throw Error("out", path + ": write failed");
}

std::vector<Recipe> load_layer_choices(const std::string& path) {
  auto fail = [&](const std::string& field, const std::string& why) {
    throw Error("calibration_file", path + ": " + field + ": " + why);
  };
  std::string text;
  if (!read_text_file(path, &text)) throw Error("calibration_file", path + ": cannot be opened");
  JsonValue doc;
  try {
    doc = parse_json(text);
  } catch (const std::runtime_error& e) {
    fail("(file)", std::string("not valid JSON (") + e.what() + ")");
  }
  if (doc.kind != JsonValue::object) fail("(file)", "expected a JSON object");
  const JsonValue* version = doc.get("version");
  if (!version || version->kind != JsonValue::number) fail("version", "missing");
  if (version->num != 1) fail("version", "must be 1 (got " + json_number(version->num) + ")");
  const JsonValue* layers = doc.get("layers");
  if (!layers || layers->kind != JsonValue::array) fail("layers", "missing or not an array");
  if (layers->items.empty()) fail("layers", "is empty");
  std::vector<Recipe> out;
  for (size_t i = 0; i < layers->items.size(); ++i) {
    const JsonValue& l = layers->items[i];
    const std::string at = "layers[" + std::to_string(i) + "]";
    if (l.kind != JsonValue::object) fail(at, "not an object");
    const JsonValue* index = l.get("layer");
    // The position is the layer: a reordered or missing entry would shift every later layer.
    if (!index || index->kind != JsonValue::number || index->num != static_cast<double>(i))
      fail(at + ".layer", "must be " + std::to_string(i) + " (layers are listed in order, from 0)");
    const JsonValue* name = l.get("recipe");
    if (!name || name->kind != JsonValue::string) fail(at + ".recipe", "missing or not a string");
    try {
      out.push_back(preset(name->str));
    } catch (const Error& e) {
      fail(at + ".recipe", e.what());
    }
  }
  return out;
}

}  // namespace sage
