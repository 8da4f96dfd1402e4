// `sage check --backward`: the gradients of the recipes that have a backward (sagebwd,
// sagebwd_block), the CPU simulator against float64 (docs/numerics.md, "The backward"), on the
// synthetic inputs with an fp16 N(0, 1) output gradient.
#include <cmath>
#include <cstdio>
#include <iostream>
#include <vector>

#include "accuracy.h"
#include "check_backward.h"
#include "reference/metrics.h"
#include "reference/synthetic.h"
#include "sage/backward.h"

namespace sage::cli {
namespace {

using reference::ErrorStats;

std::vector<std::string> presets_with_backward() {
  std::vector<std::string> names;
  for (const Recipe& r : presets())
    if (has_backward(r)) names.push_back(r.name);
  return names;
}

std::string sig3(double v) {
  if (!std::isfinite(v) || v == 0) return v == 0 ? "0" : fixed(v, 0);
  char buf[64];
  std::snprintf(buf, sizeof buf, "%#.3g", v);
  return buf;
}

// One distribution's inputs, dO and exact gradients (f64, HND), shared by every recipe.
struct GradientCase {
  reference::SyntheticInputs in;
  std::vector<uint16_t> dout;
  std::vector<double> grads[3];  // dq, dk, dv

  GradientCase(const std::string& dist, const CheckShape& shape)
      : in(reference::make_synthetic(dist, shape.synthetic(), shape.seed)),
        dout(reference::synthetic_output_gradient(shape.synthetic(), shape.seed)) {
    grads[0].resize(in.q.size());
    grads[1].resize(in.k.size());
    grads[2].resize(in.v.size());
    reference::exact_backward(args(shape, Recipe{}, grads, DType::f64));
  }

  // The backward call of `recipe` on these inputs, writing dq, dk, dv of dtype `t` into out.
  template <class T>
  BackwardArgs args(const CheckShape& shape, const Recipe& recipe, std::vector<T>* out, DType t) {
    const reference::SyntheticShape& s = in.shape;
    BackwardArgs a;
    a.q = in.q_view(), a.k = in.k_view(), a.v = in.v_view();
    a.dout = contiguous_view(dout.data(), DType::f16, {s.batch, s.heads_q, s.n_q, s.head_dim});
    a.dq = contiguous_view(out[0].data(), t, {s.batch, s.heads_q, s.n_q, s.head_dim});
    a.dk = contiguous_view(out[1].data(), t, {s.batch, s.heads_kv, s.n_kv, s.head_dim});
    a.dv = contiguous_view(out[2].data(), t, {s.batch, s.heads_kv, s.n_kv, s.head_dim});
    a.causal = shape.causal;
    a.recipe = recipe;
    return a;
  }
};

}  // namespace

int run_check_backward(const Flags& flags, const CheckShape& shape, const std::string& json) {
  const std::vector<std::string> recipes = flags.choices("recipe", "all", presets_with_backward());
  const std::vector<std::string> dists =
      flags.choices("dist", "all", reference::synthetic_distributions());
  const std::string dp = flags.has("dp-format") ? flags.choice("dp-format", "fp16", {"fp16", "int8"}) : "";
  const std::string changed = dp.empty() ? "" : " dp_format=" + dp;
  if (!json.empty()) check_writable("sage check", "json", json);
  std::cout << "CPU simulator's gradients vs float64 exact (the recipes' own error); "
            << shape.describe() << "; fp16 inputs and dO, f32 gradients\n\n";
  Table table({"recipe", "dist", "grad", "cosine", "rel L1", "RMSE", "max err"},
              {false, false, false, true, true, true, true});
  std::vector<JsonRecord> records;
  const int total = static_cast<int>(recipes.size() * dists.size());
  Progress progress(total, total > 1);
  int nonfinite = 0;
  for (const std::string& dist : dists) {
    GradientCase c(dist, shape);
    for (const std::string& name : recipes) {
      progress.step(name + changed + " " + dist);
      Recipe r = preset(name);
      if (!dp.empty()) r.dp_format = dp == "int8" ? BwdFormat::int8 : BwdFormat::fp16;
      std::vector<float> got[3] = {std::vector<float>(c.grads[0].size()),
                                   std::vector<float>(c.grads[1].size()),
                                   std::vector<float>(c.grads[2].size())};
      reference::simulate_backward(c.args(shape, r, got, DType::f32));
      const char* grad_names[3] = {"dq", "dk", "dv"};
      for (int g = 0; g < 3; ++g) {
        const ErrorStats e = reference::compare(got[g].data(), c.grads[g].data(),
                                                static_cast<int64_t>(got[g].size()));
        nonfinite += e.nonfinite > 0;
        table.add({name + changed, dist, grad_names[g], fixed(e.cosine, 6), sig3(e.rel_l1),
                   sig3(e.rmse), sig3(e.max_abs)});
        JsonRecord rec;
        rec.str("recipe", name).str("dist", dist).str("grad", grad_names[g])
            .str("compared", "simulate_backward_vs_exact").str("device", "cpu")
            .integer("batch", shape.batch).integer("heads", shape.heads)
            .integer("kv_heads", shape.kv_heads).integer("n", shape.n).integer("d", shape.d)
            .boolean("causal", shape.causal).integer("seed", static_cast<int64_t>(shape.seed))
            .str("dtype", "fp16");
        if (!dp.empty()) rec.str("dp_format", dp);
        rec.str("status", "ok").num("cosine", e.cosine).num("rel_l1", e.rel_l1)
            .num("rmse", e.rmse).num("max_abs", e.max_abs).integer("nonfinite", e.nonfinite);
        records.push_back(rec);
      }
    }
  }
  table.print(std::cout);
  std::cout << "\n" << total << " case(s), " << fixed(progress.elapsed_s(), 1) << " s.";
  if (nonfinite) std::cout << " " << nonfinite << " result(s) contain Inf or NaN.";
  std::cout << "\n";
  if (!json.empty()) {
    JsonRecord meta;
    meta.str("tool", "sage check --backward").str("device", "cpu").str("shape", shape.describe());
    write_json_file("sage check", json, meta, records);
    std::cout << "wrote " << records.size() << " records to " << json << "\n";
  }
  return 0;
}

}  // namespace sage::cli
