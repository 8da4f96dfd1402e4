// Recipe parsing for the bindings. The option names and value spellings are the ones the
// C++ headers use (field names of sage::Recipe, sage::to_string of each enum), so a recipe
// reads the same in C++, in the CLI and in Python.
#include "recipes.h"

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <sstream>
#include <vector>

#include "sage/error.h"

namespace sagepy {
namespace {

// The enum values are listed here because C++ cannot enumerate them; to_string gives the
// spelling, so adding a value to recipe.h means adding it to one list below.
template <class E>
struct Values;
template <>
struct Values<sage::QKFormat> {
  static constexpr sage::QKFormat all[] = {sage::QKFormat::fp16,  sage::QKFormat::int8,
                                           sage::QKFormat::int4,  sage::QKFormat::e4m3,
                                           sage::QKFormat::nvfp4, sage::QKFormat::mxfp4};
};
template <>
struct Values<sage::Granularity> {
  static constexpr sage::Granularity all[] = {
      sage::Granularity::per_tensor, sage::Granularity::per_block, sage::Granularity::per_warp,
      sage::Granularity::per_thread, sage::Granularity::per_token, sage::Granularity::microscale};
};
template <>
struct Values<sage::PVFormat> {
  static constexpr sage::PVFormat all[] = {sage::PVFormat::fp16, sage::PVFormat::e4m3,
                                           sage::PVFormat::e5m2, sage::PVFormat::int8,
                                           sage::PVFormat::nvfp4, sage::PVFormat::mxfp4};
};
template <>
struct Values<sage::PScale> {
  static constexpr sage::PScale all[] = {sage::PScale::none, sage::PScale::static_max,
                                         sage::PScale::two_level, sage::PScale::per_token};
};
template <>
struct Values<sage::VScale> {
  static constexpr sage::VScale all[] = {sage::VScale::none, sage::VScale::per_channel,
                                         sage::VScale::per_tensor, sage::VScale::microscale,
                                         sage::VScale::per_block};
};
template <>
struct Values<sage::PVAccum> {
  static constexpr sage::PVAccum all[] = {sage::PVAccum::fp32, sage::PVAccum::fp16,
                                          sage::PVAccum::fp22, sage::PVAccum::two_level,
                                          sage::PVAccum::fp16x2_fp32};
};
template <>
struct Values<sage::RowSum> {
  static constexpr sage::RowSum all[] = {sage::RowSum::float_p, sage::RowSum::quantized_p,
                                         sage::RowSum::pv_mma};
};
template <>
struct Values<sage::Inputs> {
  static constexpr sage::Inputs all[] = {sage::Inputs::floating, sage::Inputs::prequantized_int8};
};
template <>
struct Values<sage::BwdFormat> {
  static constexpr sage::BwdFormat all[] = {sage::BwdFormat::none, sage::BwdFormat::fp16,
                                            sage::BwdFormat::int8};
};

// A value as it arrives: from a dict it keeps its Python type, from a spec string it is text.
struct Value {
  enum Kind { text, boolean, number } kind;
  std::string s;
  bool b = false;
  double x = 0;
};

std::string describe(const Value& v) {
  switch (v.kind) {
    case Value::text: return "'" + v.s + "'";
    case Value::boolean: return v.b ? "True" : "False";
    case Value::number: {
      std::ostringstream os;
      os << v.x;
      return os.str();
    }
  }
  return "?";
}

template <class E>
E parse_enum(const std::string& key, const Value& v) {
  if (v.kind == Value::text) {
    for (E e : Values<E>::all)
      if (v.s == sage::to_string(e)) return e;
    // PScale::static_max prints as "static"; the enumerator's own name is accepted too.
    if constexpr (std::is_same_v<E, sage::PScale>)
      if (v.s == "static_max") return sage::PScale::static_max;
  }
  std::string allowed;
  for (E e : Values<E>::all) allowed += std::string(allowed.empty() ? "" : ", ") + sage::to_string(e);
  throw sage::Error("recipe." + key, "must be one of " + allowed + " (got " + describe(v) + ")");
}

bool parse_bool(const std::string& key, const Value& v) {
  if (v.kind == Value::boolean) return v.b;
  if (v.kind == Value::text) {
    if (v.s == "true" || v.s == "True" || v.s == "1") return true;
    if (v.s == "false" || v.s == "False" || v.s == "0") return false;
  }
  throw sage::Error("recipe." + key, "must be True or False (got " + describe(v) + ")");
}

// A number as it arrives (a Python number, or text from a spec string); false when it is not one.
bool as_number(const Value& v, double& x) {
  x = v.x;
  if (v.kind == Value::number) return true;
  if (v.kind != Value::text || v.s.empty()) return false;
  char* end = nullptr;
  x = std::strtod(v.s.c_str(), &end);
  return end && *end == '\0';
}

int parse_positive_int(const std::string& key, const Value& v) {
  double x = 0;
  if (!as_number(v, x) || !(x >= 1 && x <= double(INT32_MAX)) || x != std::floor(x))
    throw sage::Error("recipe." + key, "must be a whole number >= 1 (got " + describe(v) + ")");
  return static_cast<int>(x);
}

// Ranges are float32 in the recipe; a number float cannot hold is refused here, before it
// would become an infinity (or a zero) that the range check would then report.
float parse_float(const std::string& key, const Value& v) {
  double x = 0;
  if (!as_number(v, x) || !std::isfinite(x))
    throw sage::Error("recipe." + key, "must be a finite number (got " + describe(v) + ")");
  if (std::fabs(x) > double(std::numeric_limits<float>::max()))
    throw sage::Error("recipe." + key, "must be a finite float32 (got " + describe(v) +
                                           ", beyond float32's largest value)");
  return static_cast<float>(x);
}

const char* const kOptions[] = {"qk_format", "qk_granularity", "smooth_k", "k_mean_stride",
                                "smooth_q",  "smooth_v",       "pv_format", "p_scale",
                                "v_scale",   "pv_accum",       "p_range",  "v_range",
                                "row_sum",   "inputs",         "dv_format", "dp_format",
                                "dq_format", "dk_format",      "bwd_p_granularity",
                                "bwd_ds_granularity", "qk_channel_balance"};

// Sets one option; returns false for an unknown key.
bool set_option(sage::Recipe& r, const std::string& key, const Value& v) {
  if (key == "qk_format") r.qk_format = parse_enum<sage::QKFormat>(key, v);
  else if (key == "qk_granularity") r.qk_granularity = parse_enum<sage::Granularity>(key, v);
  else if (key == "smooth_k") r.smooth_k = parse_bool(key, v);
  else if (key == "k_mean_stride") r.k_mean_stride = parse_positive_int(key, v);
  else if (key == "smooth_q") r.smooth_q = parse_bool(key, v);
  else if (key == "smooth_v") r.smooth_v = parse_bool(key, v);
  else if (key == "qk_channel_balance") r.qk_channel_balance = parse_bool(key, v);
  else if (key == "pv_format") r.pv_format = parse_enum<sage::PVFormat>(key, v);
  else if (key == "p_scale") r.p_scale = parse_enum<sage::PScale>(key, v);
  else if (key == "v_scale") r.v_scale = parse_enum<sage::VScale>(key, v);
  else if (key == "pv_accum") r.pv_accum = parse_enum<sage::PVAccum>(key, v);
  else if (key == "p_range") r.p_range = parse_float(key, v);
  else if (key == "v_range") r.v_range = parse_float(key, v);
  else if (key == "row_sum") r.row_sum = parse_enum<sage::RowSum>(key, v);
  else if (key == "inputs") r.inputs = parse_enum<sage::Inputs>(key, v);
  else if (key == "dv_format") r.dv_format = parse_enum<sage::BwdFormat>(key, v);
  else if (key == "dp_format") r.dp_format = parse_enum<sage::BwdFormat>(key, v);
  else if (key == "dq_format") r.dq_format = parse_enum<sage::BwdFormat>(key, v);
  else if (key == "dk_format") r.dk_format = parse_enum<sage::BwdFormat>(key, v);
  else if (key == "bwd_p_granularity") r.bwd_p_granularity = parse_enum<sage::Granularity>(key, v);
  else if (key == "bwd_ds_granularity") r.bwd_ds_granularity = parse_enum<sage::Granularity>(key, v);
  else return false;
  return true;
}

bool same_backward(const sage::Recipe& a, const sage::Recipe& b) {
  return a.dv_format == b.dv_format && a.dp_format == b.dp_format && a.dq_format == b.dq_format &&
         a.dk_format == b.dk_format && a.bwd_p_granularity == b.bwd_p_granularity &&
         a.bwd_ds_granularity == b.bwd_ds_granularity;
}

bool same_options(const sage::Recipe& a, const sage::Recipe& b) {
  return a.qk_format == b.qk_format && a.qk_granularity == b.qk_granularity &&
         a.smooth_k == b.smooth_k && a.k_mean_stride == b.k_mean_stride &&
         a.smooth_q == b.smooth_q && a.smooth_v == b.smooth_v && a.pv_format == b.pv_format &&
         a.p_scale == b.p_scale && a.v_scale == b.v_scale &&
         a.pv_accum == b.pv_accum && a.p_range == b.p_range && a.v_range == b.v_range &&
         a.row_sum == b.row_sum && a.inputs == b.inputs &&
         a.qk_channel_balance == b.qk_channel_balance && same_backward(a, b);
}

std::string option_list() {
  std::string s = "base, name";
  for (const char* o : kOptions) s += std::string(", ") + o;
  return s;
}

// Applies base first, then the options in the order given; a recipe that ends up equal to
// a preset takes the preset's name unless the caller named it.
sage::Recipe build(const std::string* base, const std::string* name,
                   const std::vector<std::pair<std::string, Value>>& options) {
  sage::Recipe r = base ? sage::preset(*base) : sage::Recipe{};
  std::vector<std::string> seen;
  for (const auto& [key, value] : options) {
    for (const std::string& s : seen)
      if (s == key) throw sage::Error("recipe." + key, "is given twice");
    seen.push_back(key);
    if (!set_option(r, key, value))
      throw sage::Error("recipe", "unknown option '" + key + "' (options: " + option_list() + ")");
  }
  // k_mean_stride is a parameter of K smoothing: with smoothing off, the base's stride (e.g.
  // sage2_8b's 8) lapses to 1, and a stride > 1 given here would do nothing, so it is refused.
  if (!r.smooth_k) {
    bool stride_given = false;
    for (const std::string& s : seen) stride_given = stride_given || s == "k_mean_stride";
    if (stride_given && r.k_mean_stride > 1)
      throw sage::Error("recipe.k_mean_stride",
                        "applies to K smoothing's mean, and this recipe has smooth_k false (got " +
                            std::to_string(r.k_mean_stride) + ")");
    r.k_mean_stride = 1;
  }
  if (name) {
    r.name = *name;
  } else {
    r.name = "custom";
    for (const sage::Recipe& p : sage::presets())
      if (same_options(p, r)) {
        r.name = p.name;
        break;
      }
  }
  sage::validate_recipe(r);
  return r;
}

std::string trim(const std::string& s) {
  size_t b = s.find_first_not_of(" \t"), e = s.find_last_not_of(" \t");
  return b == std::string::npos ? std::string() : s.substr(b, e - b + 1);
}

bool is_option(const std::string& key) {
  for (const char* o : kOptions)
    if (key == o) return true;
  return false;
}

// A bare item (no '=') is the base preset, and only as the first item: an option name there
// lacks its value ("sage2_8b,pv_accum"), and a later bare item is not an option at all.
void refuse_bare_option(const std::string& spec, const std::string& item, bool after_first) {
  if (is_option(item))
    throw sage::Error("recipe." + item, "needs a value: " + item + "=VALUE (in '" + spec + "')");
  if (after_first)
    throw sage::Error("recipe", "'" + item + "' in '" + spec +
                                    "' is not key=value; only the first item may be a bare "
                                    "preset name (the base)");
}

sage::Recipe from_string(const std::string& spec) {
  std::string base, name;
  bool has_base = false, has_name = false;
  std::vector<std::pair<std::string, Value>> options;
  std::stringstream ss(spec);
  std::string item;
  while (std::getline(ss, item, ',')) {
    item = trim(item);
    if (item.empty()) continue;
    size_t eq = item.find('=');
    if (eq == std::string::npos) refuse_bare_option(spec, item,
                                                  has_base || has_name || !options.empty());
    std::string key = eq == std::string::npos ? "base" : trim(item.substr(0, eq));
    std::string val = eq == std::string::npos ? item : trim(item.substr(eq + 1));
    if (key == "base" || key == "name") {
      bool& has = key == "base" ? has_base : has_name;
      if (has) throw sage::Error("recipe", "'" + spec + "' gives " + key + " twice");
      has = true;
      (key == "base" ? base : name) = val;
    } else {
      options.push_back({key, Value{Value::text, val}});
    }
  }
  if (!has_base && options.empty() && !has_name)
    throw sage::Error("recipe", "is empty; give a preset name, a spec string or a dict");
  return build(has_base ? &base : nullptr, has_name ? &name : nullptr, options);
}

Value value_of(const std::string& key, nb::handle h) {
  // bool before int: Python's bool is an int.
  if (nb::isinstance<nb::bool_>(h)) return Value{Value::boolean, {}, nb::cast<bool>(h)};
  if (nb::isinstance<nb::str>(h)) return Value{Value::text, nb::cast<std::string>(h)};
  if (nb::isinstance<nb::int_>(h) || nb::isinstance<nb::float_>(h))
    return Value{Value::number, {}, false, nb::cast<double>(h)};
  throw sage::Error("recipe." + key, std::string("must be a str, bool or number (got ") +
                                         nb::type_name(h.type()).c_str() + ")");
}

sage::Recipe from_dict(nb::dict d) {
  std::string base, name;
  bool has_base = false, has_name = false;
  std::vector<std::pair<std::string, Value>> options;
  for (auto [k, v] : d) {
    if (!nb::isinstance<nb::str>(k))
      throw sage::Error("recipe", "option names must be strings");
    std::string key = nb::cast<std::string>(k);
    // The descriptive keys of presets() are accepted so that a listed preset, edited,
    // can be passed back; they are derived from the options, so nothing is lost.
    if (key == "paper" || key == "summary") continue;
    if (key == "base" || key == "name") {
      if (!nb::isinstance<nb::str>(v))
        throw sage::Error("recipe." + key, "must be a str");
      (key == "base" ? base : name) = nb::cast<std::string>(v);
      (key == "base" ? has_base : has_name) = true;
    } else {
      options.push_back({key, value_of(key, v)});
    }
  }
  if (!has_base && !has_name && options.empty())
    throw sage::Error("recipe", "is an empty dict; give at least one option or a base");
  return build(has_base ? &base : nullptr, has_name ? &name : nullptr, options);
}

std::string format_float(float x) {
  std::ostringstream os;
  os.precision(9);
  os << x;
  return os.str();
}

}  // namespace

sage::Recipe recipe_from(nb::handle spec) {
  if (nb::isinstance<nb::str>(spec)) {
    std::string s = nb::cast<std::string>(spec);
    // The common case, and the one whose error should list the presets.
    if (s.find_first_of(",=") == std::string::npos && !is_option(trim(s))) {
      sage::Recipe r = sage::preset(trim(s));
      sage::validate_recipe(r);
      return r;
    }
    return from_string(s);
  }
  if (nb::isinstance<nb::dict>(spec)) return from_dict(nb::borrow<nb::dict>(spec));
  throw sage::Error("recipe", std::string("must be a preset name, a spec string or a dict of "
                                          "options (got ") +
                                  nb::type_name(spec.type()).c_str() + ")");
}

nb::dict recipe_to_dict(const sage::Recipe& r) {
  nb::dict d;
  d["name"] = r.name;
  d["paper"] = sage::recipe_paper(r);
  d["summary"] = sage::recipe_summary(r);
  d["qk_format"] = sage::to_string(r.qk_format);
  d["qk_granularity"] = sage::to_string(r.qk_granularity);
  d["smooth_k"] = r.smooth_k;
  d["k_mean_stride"] = r.k_mean_stride;
  d["smooth_q"] = r.smooth_q;
  d["smooth_v"] = r.smooth_v;
  d["qk_channel_balance"] = r.qk_channel_balance;
  d["pv_format"] = sage::to_string(r.pv_format);
  d["p_scale"] = sage::to_string(r.p_scale);
  d["v_scale"] = sage::to_string(r.v_scale);
  d["pv_accum"] = sage::to_string(r.pv_accum);
  d["p_range"] = r.p_range;
  d["v_range"] = r.v_range;
  d["row_sum"] = sage::to_string(r.row_sum);
  d["inputs"] = sage::to_string(r.inputs);
  d["dv_format"] = sage::to_string(r.dv_format);
  d["dp_format"] = sage::to_string(r.dp_format);
  d["dq_format"] = sage::to_string(r.dq_format);
  d["dk_format"] = sage::to_string(r.dk_format);
  d["bwd_p_granularity"] = sage::to_string(r.bwd_p_granularity);
  d["bwd_ds_granularity"] = sage::to_string(r.bwd_ds_granularity);
  return d;
}

std::string recipe_to_spec(const sage::Recipe& r) {
  std::ostringstream os;
  os << "name=" << r.name << ",qk_format=" << sage::to_string(r.qk_format)
     << ",qk_granularity=" << sage::to_string(r.qk_granularity)
     << ",smooth_k=" << (r.smooth_k ? "true" : "false") << ",k_mean_stride=" << r.k_mean_stride
     << ",smooth_q=" << (r.smooth_q ? "true" : "false")
     << ",smooth_v=" << (r.smooth_v ? "true" : "false")
     << ",qk_channel_balance=" << (r.qk_channel_balance ? "true" : "false")
     << ",pv_format=" << sage::to_string(r.pv_format) << ",p_scale=" << sage::to_string(r.p_scale)
     << ",v_scale=" << sage::to_string(r.v_scale) << ",pv_accum=" << sage::to_string(r.pv_accum)
     << ",p_range=" << format_float(r.p_range) << ",v_range=" << format_float(r.v_range)
     << ",row_sum=" << sage::to_string(r.row_sum) << ",inputs=" << sage::to_string(r.inputs)
     << ",dv_format=" << sage::to_string(r.dv_format) << ",dp_format=" << sage::to_string(r.dp_format)
     << ",dq_format=" << sage::to_string(r.dq_format) << ",dk_format=" << sage::to_string(r.dk_format)
     << ",bwd_p_granularity=" << sage::to_string(r.bwd_p_granularity)
     << ",bwd_ds_granularity=" << sage::to_string(r.bwd_ds_granularity);
  return os.str();
}

}  // namespace sagepy
