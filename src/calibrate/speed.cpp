// Speed tables: measured TOPS by (recipe, head_dim, causal, tokens).
#include <algorithm>
#include <cmath>
#include <set>

#include "common/json.h"
#include "sage/calibrate.h"
#include "sage/error.h"

namespace sage {

void SpeedTable::add(const SpeedEntry& e) {
  if (e.recipe.empty()) throw Error("speeds", "an entry needs a recipe name");
  if (e.head_dim < 1 || e.n < 1)
    throw Error("speeds", e.recipe + ": head_dim and n must be >= 1");
  if (!(e.tops > 0) || !std::isfinite(e.tops))
    throw Error("speeds", e.recipe + ": tops must be a positive number");
  entries_.push_back(e);
}

std::optional<SpeedEntry> SpeedTable::lookup(const std::string& recipe, int64_t head_dim,
                                             bool causal, int64_t n) const {
  // Benchmark grids are spaced by powers of two, so distance is a ratio, not a difference.
  const double target = std::log(static_cast<double>(std::max<int64_t>(n, 1)));
  int64_t best_n = 0;
  double best_dist = 0;
  for (const SpeedEntry& e : entries_) {
    if (e.recipe != recipe || e.head_dim != head_dim || e.causal != causal) continue;
    const double dist = std::fabs(std::log(static_cast<double>(e.n)) - target);
    if (best_n == 0 || dist < best_dist || (dist == best_dist && e.n > best_n)) {
      best_n = e.n;
      best_dist = dist;
    }
  }
  if (best_n == 0) return std::nullopt;
  SpeedEntry out{recipe, head_dim, causal, best_n, 0};
  int count = 0;
  for (const SpeedEntry& e : entries_)
    if (e.recipe == recipe && e.head_dim == head_dim && e.causal == causal && e.n == best_n) {
      out.tops += e.tops;
      ++count;
    }
  out.tops /= count;
  return out;
}

SpeedTable load_speed_table(const std::string& path) {
  std::string text;
  if (!read_text_file(path, &text)) throw Error("speeds", path + ": cannot be opened");
  JsonValue doc;
  try {
    doc = parse_json(text);
  } catch (const std::runtime_error& e) {
    throw Error("speeds", path + ": not valid JSON (" + e.what() + ")");
  }
  // bench/results/*.json is a bare array; `sage bench --json` wraps it in {"records": [...]}.
  const JsonValue* records = &doc;
  if (doc.kind == JsonValue::object) records = doc.get("records");
  if (!records || records->kind != JsonValue::array)
    throw Error("speeds", path + ": expected an array of bench records (or an object with "
                                 "\"records\")");
  SpeedTable t;
  std::set<std::string> devices;
  for (size_t i = 0; i < records->items.size(); ++i) {
    const JsonValue& r = records->items[i];
    const std::string where = path + ": record " + std::to_string(i) + ": ";
    if (r.kind != JsonValue::object) throw Error("speeds", where + "not an object");
    const JsonValue* impl = r.get("impl");
    if (impl && (impl->kind != JsonValue::string || impl->str != "sagekit")) continue;
    const JsonValue* whole = r.get("whole_call");
    if (whole && whole->kind == JsonValue::boolean && !whole->b) continue;
    auto field = [&](const char* key, JsonValue::Kind kind) -> const JsonValue& {
      const JsonValue* v = r.get(key);
      if (!v || v->kind != kind)
        throw Error("speeds", where + "\"" + key + "\" is missing or has the wrong type");
      return *v;
    };
    SpeedEntry e;
    e.recipe = field("recipe", JsonValue::string).str;
    e.head_dim = static_cast<int64_t>(field("d", JsonValue::number).num);
    e.causal = field("causal", JsonValue::boolean).b;
    e.n = static_cast<int64_t>(field("n", JsonValue::number).num);
    const JsonValue* tops = r.get("tops");
    // A failed or skipped measurement is written as null: it is not a speed.
    if (!tops || tops->kind != JsonValue::number) continue;
    e.tops = tops->num;
    try {
      t.add(e);
    } catch (const Error& err) {
      throw Error("speeds", where + err.what());
    }
    const JsonValue* dev = r.get("device");
    if (dev && dev->kind == JsonValue::string) devices.insert(dev->str);
  }
  t.source = path;
  if (!devices.empty()) {
    std::string d;
    for (const std::string& s : devices) d += (d.empty() ? "" : ", ") + s;
    t.source += " (" + d + ")";
  }
  return t;
}

}  // namespace sage
