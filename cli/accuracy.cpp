#include "accuracy.h"

#include <sstream>

namespace sage::cli {

reference::SyntheticShape CheckShape::synthetic() const {
  reference::SyntheticShape s;
  s.batch = batch;
  s.heads_q = heads;
  s.heads_kv = kv_heads;
  s.n_q = n;
  s.n_kv = n;
  s.head_dim = d;
  s.head_dim_v = v_dim();
  return s;
}

std::string CheckShape::describe() const {
  std::ostringstream os;
  os << "batch " << batch << ", heads " << heads;
  if (kv_heads != heads) os << " (kv " << kv_heads << ")";
  os << ", N " << n << ", d " << d;
  if (v_dim() != d) os << ", d_v " << v_dim();
  os << ", " << (causal ? "causal" : "non-causal");
  if (window_left >= 0 || window_right >= 0)
    os << ", window (" << window_left << ", " << window_right << ")";
  os << ", seed " << seed;
  return os.str();
}

DistributionCase::DistributionCase(const std::string& distribution, const CheckShape& shape)
    : shape_(shape), inputs_(reference::make_synthetic(distribution, shape.synthetic(), shape.seed)) {
  exact_.resize(static_cast<size_t>(shape.batch * shape.heads * shape.n * shape.v_dim()));
  AttentionArgs a;
  a.q = inputs_.q_view();
  a.k = inputs_.k_view();
  a.v = inputs_.v_view();
  a.out = exact_view();
  a.causal = shape.causal;
  a.window_left = shape.window_left, a.window_right = shape.window_right;
  reference::exact(a);
}

TensorView DistributionCase::out_view(void* data, DType dtype) const {
  return contiguous_view(data, dtype, {shape_.batch, shape_.heads, shape_.n, shape_.v_dim()});
}

TensorView DistributionCase::exact_view() const {
  return out_view(const_cast<double*>(exact_.data()), DType::f64);
}

const reference::PrequantizedInputs& DistributionCase::prequantized(bool v_per_channel) {
  auto& slot = preq_[v_per_channel ? 1 : 0];
  if (!slot)
    slot = std::make_unique<reference::PrequantizedInputs>(
        reference::prequantize_int8(inputs_, v_per_channel));
  return *slot;
}

AttentionArgs DistributionCase::args(const Recipe& recipe, const TensorView& out) {
  AttentionArgs a;
  if (recipe.inputs == Inputs::prequantized_int8) {
    const auto& p = prequantized(recipe.v_scale == VScale::per_channel);
    a.q = p.q_view();
    a.k = p.k_view();
    a.v = p.v_view();
    a.q_scale = p.q_scale_view();
    a.k_scale = p.k_scale_view();
    a.v_scale = p.v_scale_view();
  } else {
    a.q = inputs_.q_view();
    a.k = inputs_.k_view();
    a.v = inputs_.v_view();
  }
  a.out = out;
  a.causal = shape_.causal;
  a.window_left = shape_.window_left, a.window_right = shape_.window_right;
  a.recipe = recipe;
  return a;
}

std::vector<uint16_t> DistributionCase::simulate(const Recipe& recipe) {
  std::vector<uint16_t> out(exact_.size());
  reference::simulate(args(recipe, out_view(out.data(), DType::f16)));
  return out;
}

}  // namespace sage::cli
