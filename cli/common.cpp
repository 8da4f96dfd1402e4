#include "common.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <sstream>

#include "sage/attention.h"

namespace sage::cli {

// ---- flags --------------------------------------------------------------------------------

std::string join(const std::vector<std::string>& items, const std::string& sep) {
  std::string out;
  for (size_t i = 0; i < items.size(); ++i) out += (i ? sep : "") + items[i];
  return out;
}

bool parse_int(const std::string& s, int64_t* out) {
  if (s.empty()) return false;
  std::string digits = s;
  int64_t mult = 1;
  if (digits.back() == 'k' || digits.back() == 'K') {
    mult = 1024;
    digits.pop_back();
  }
  if (digits.empty()) return false;
  for (size_t i = 0; i < digits.size(); ++i)
    if (!(std::isdigit(static_cast<unsigned char>(digits[i])) || (i == 0 && digits[i] == '-')))
      return false;
  errno = 0;
  char* end = nullptr;
  long long v = std::strtoll(digits.c_str(), &end, 10);
  if (errno != 0 || *end != '\0') return false;
  if (v > INT64_MAX / 1024 || v < INT64_MIN / 1024) return false;
  *out = static_cast<int64_t>(v) * mult;
  return true;
}

Flags::Flags(std::string command, std::string summary, std::vector<FlagSpec> specs,
             const std::vector<std::string>& args)
    : command_(std::move(command)), summary_(std::move(summary)), specs_(std::move(specs)) {
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--help" || a == "-h") {
      help_ = true;
      continue;
    }
    if (a.rfind("--", 0) != 0 || a.size() == 2) {
      throw UsageError(command_ + ": unexpected argument '" + a +
                       "'; this command takes only flags (see " + command_ + " --help)");
    }
    std::string name = a.substr(2), value;
    bool has_value = false;
    const size_t eq = name.find('=');
    if (eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
      has_value = true;
    }
    const FlagSpec* spec = nullptr;
    for (const FlagSpec& s : specs_)
      if (s.name == name) spec = &s;
    if (!spec) {
      std::vector<std::string> names;
      for (const FlagSpec& s : specs_) names.push_back("--" + s.name);
      names.push_back("--help");
      throw UsageError(command_ + ": unknown flag '--" + name + "'; allowed: " +
                       join(names, ", "));
    }
    if (values_.count(name)) throw UsageError(command_ + ": --" + name + " is given twice");
    if (spec->value_name.empty()) {
      if (has_value)
        throw UsageError(command_ + ": --" + name + " is a switch and takes no value (got '" +
                         value + "')");
      values_[name] = "1";
      continue;
    }
    if (!has_value) {
      if (i + 1 >= args.size() || args[i + 1].rfind("--", 0) == 0)
        throw UsageError(command_ + ": --" + name + " needs a value: " + spec->value_name);
      value = args[++i];
    }
    values_[name] = value;
  }
}

void Flags::fail(const std::string& flag, const std::string& why) const {
  throw UsageError(command_ + ": --" + flag + " " + why);
}

std::string Flags::str(const std::string& name, const std::string& def) const {
  auto it = values_.find(name);
  return it == values_.end() ? def : it->second;
}

std::string Flags::choice(const std::string& name, const std::string& def,
                          const std::vector<std::string>& allowed) const {
  const std::string v = str(name, def);
  if (std::find(allowed.begin(), allowed.end(), v) == allowed.end())
    fail(name, "must be one of " + join(allowed, ", ") + " (got '" + v + "')");
  return v;
}

int64_t Flags::integer(const std::string& name, int64_t def, int64_t lo, int64_t hi) const {
  if (!has(name)) return def;
  int64_t v = 0;
  const std::string s = str(name, "");
  if (!parse_int(s, &v) || v < lo || v > hi)
    fail(name, "must be an integer from " + std::to_string(lo) + " to " + std::to_string(hi) +
                   " (got '" + s + "')");
  return v;
}

std::vector<int64_t> Flags::integers(const std::string& name, const std::vector<int64_t>& def,
                                     int64_t lo, int64_t hi) const {
  if (!has(name)) return def;
  const std::string s = str(name, "");
  std::vector<int64_t> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    int64_t v = 0;
    if (!parse_int(item, &v) || v < lo || v > hi)
      fail(name, "must be a comma-separated list of integers from " + std::to_string(lo) +
                     " to " + std::to_string(hi) + " (got '" + s + "')");
    out.push_back(v);
  }
  if (out.empty()) fail(name, "needs at least one value (got '" + s + "')");
  return out;
}

std::string WindowFlag::text() const { return std::to_string(left) + "," + std::to_string(right); }

WindowFlag window_flag(const Flags& flags, const std::string& command, bool causal) {
  WindowFlag w;
  if (!flags.has("window")) return w;
  const std::vector<int64_t> v = flags.integers("window", {}, -1, int64_t(1) << 30);
  if (v.size() != 2)
    throw UsageError(command + ": --window needs two values LEFT,RIGHT, -1 for an unbounded "
                     "side (got '" + flags.str("window", "") + "')");
  w.left = v[0], w.right = v[1];
  if (causal && w.right > 0)
    throw UsageError(command + ": --window's RIGHT must be -1 or 0 with causal masking, which is "
                     "RIGHT = 0 (got " + std::to_string(w.right) + ")");
  return w;
}

std::vector<std::string> Flags::choices(const std::string& name, const std::string& def,
                                        const std::vector<std::string>& allowed) const {
  const std::string s = str(name, def);
  if (s == "all") return allowed;
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    if (std::find(allowed.begin(), allowed.end(), item) == allowed.end())
      fail(name, "must be 'all' or a comma-separated list of " + join(allowed, ", ") +
                     " (got '" + item + "')");
    if (std::find(out.begin(), out.end(), item) == out.end()) out.push_back(item);
  }
  if (out.empty()) fail(name, "needs at least one value (got '" + s + "')");
  return out;
}

void Flags::print_help(std::ostream& os) const {
  os << "usage: " << command_ << " [flags]\n\n" << summary_ << "\n\nflags:\n";
  size_t width = std::string("--help").size();
  std::vector<std::string> lefts;
  for (const FlagSpec& s : specs_) {
    std::string left = "--" + s.name + (s.value_name.empty() ? "" : " " + s.value_name);
    width = std::max(width, left.size());
    lefts.push_back(left);
  }
  for (size_t i = 0; i < specs_.size(); ++i)
    os << "  " << lefts[i] << std::string(width - lefts[i].size() + 2, ' ') << specs_[i].help
       << "\n";
  os << "  --help" << std::string(width - 6 + 2, ' ') << "this text\n";
}

// ---- tables -------------------------------------------------------------------------------

Table::Table(std::vector<std::string> header, std::vector<bool> right_aligned)
    : header_(std::move(header)), right_(std::move(right_aligned)) {
  right_.resize(header_.size(), false);
}

void Table::add(std::vector<std::string> row) { rows_.push_back(std::move(row)); }

void Table::print(std::ostream& os) const {
  std::vector<size_t> w(header_.size());
  for (size_t c = 0; c < header_.size(); ++c) w[c] = header_[c].size();
  for (const auto& r : rows_) {
    const bool spans = r.size() < header_.size();
    for (size_t c = 0; c < r.size(); ++c)
      if (!(spans && c + 1 == r.size())) w[c] = std::max(w[c], r[c].size());
  }
  auto line = [&](const std::vector<std::string>& r) {
    std::string out;
    for (size_t c = 0; c < r.size(); ++c) {
      const bool last = c + 1 == r.size();
      const size_t pad = r[c].size() < w[c] ? w[c] - r[c].size() : 0;
      if (c) out += "  ";
      if (right_[c] && !(last && r.size() < header_.size()))
        out += std::string(pad, ' ') + r[c];
      else
        out += r[c] + (last ? "" : std::string(pad, ' '));
    }
    while (!out.empty() && out.back() == ' ') out.pop_back();
    os << out << "\n";
  };
  line(header_);
  std::vector<std::string> rule;
  for (size_t c = 0; c < header_.size(); ++c) rule.push_back(std::string(w[c], '-'));
  line(rule);
  for (const auto& r : rows_) line(r);
}

void Table::print_markdown(std::ostream& os) const {
  auto esc = [](const std::string& s) {
    std::string out;
    for (char ch : s) {
      if (ch == '|') out += '\\';
      out += ch;
    }
    return out;
  };
  os << "|";
  for (const auto& h : header_) os << " " << esc(h) << " |";
  os << "\n|";
  for (size_t c = 0; c < header_.size(); ++c) os << (right_[c] ? "---:|" : "---|");
  os << "\n";
  for (const auto& r : rows_) {
    os << "|";
    for (size_t c = 0; c < header_.size(); ++c) os << " " << (c < r.size() ? esc(r[c]) : "") << " |";
    os << "\n";
  }
}

std::string fixed(double v, int digits) {
  if (!std::isfinite(v)) return std::isnan(v) ? "nan" : (v > 0 ? "inf" : "-inf");
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", digits, v);
  return buf;
}

std::string sci(double v, int digits) {
  if (!std::isfinite(v)) return std::isnan(v) ? "nan" : (v > 0 ? "inf" : "-inf");
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*e", digits, v);
  return buf;
}

// ---- JSON ---------------------------------------------------------------------------------


JsonRecord& JsonRecord::str(const std::string& key, const std::string& v) {
  fields_.emplace_back(key, json_string(v));
  return *this;
}

JsonRecord& JsonRecord::num(const std::string& key, double v) {
  if (!std::isfinite(v)) {
    fields_.emplace_back(key, "null");
  } else {
    char buf[64];
    std::snprintf(buf, sizeof buf, "%.9g", v);
    fields_.emplace_back(key, buf);
  }
  return *this;
}

JsonRecord& JsonRecord::integer(const std::string& key, int64_t v) {
  fields_.emplace_back(key, std::to_string(v));
  return *this;
}

JsonRecord& JsonRecord::integers(const std::string& key, const std::vector<int64_t>& v) {
  std::string text = "[";
  for (size_t i = 0; i < v.size(); ++i) text += (i ? ", " : "") + std::to_string(v[i]);
  fields_.emplace_back(key, text + "]");
  return *this;
}

JsonRecord& JsonRecord::boolean(const std::string& key, bool v) {
  fields_.emplace_back(key, v ? "true" : "false");
  return *this;
}

std::string JsonRecord::dump() const {
  std::string out = "{";
  for (size_t i = 0; i < fields_.size(); ++i)
    out += (i ? ", " : "") + json_string(fields_[i].first) + ": " + fields_[i].second;
  return out + "}";
}

void check_writable(const std::string& command, const std::string& flag, const std::string& path) {
  std::ofstream f(path, std::ios::app);
  if (!f) throw UsageError(command + ": --" + flag + " " + path + " cannot be opened for writing");
}

void write_json_file(const std::string& command, const std::string& path, const JsonRecord& meta,
                     const std::vector<JsonRecord>& records) {
  std::ofstream f(path);
  if (!f) throw UsageError(command + ": --json " + path + " cannot be opened for writing");
  std::string head = meta.dump();
  head.pop_back();  // reopen the object to append the records
  f << head << (head.size() > 1 ? ", " : "") << "\"records\": [\n";
  for (size_t i = 0; i < records.size(); ++i)
    f << "  " << records[i].dump() << (i + 1 < records.size() ? ",\n" : "\n");
  f << "]}\n";
  if (!f) throw UsageError(command + ": --json " + path + " could not be written completely");
}


// ---- progress -----------------------------------------------------------------------------

Progress::Progress(int total, bool enabled)
    : total_(total), enabled_(enabled), start_(std::chrono::steady_clock::now()) {}

double Progress::elapsed_s() const {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
}

void Progress::step(const std::string& what) {
  ++done_;
  if (!enabled_) return;
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f s", elapsed_s());
  std::cerr << "[" << done_ << "/" << total_ << "] " << what << " ... (" << buf << ")"
            << std::endl;
}

std::string build_description() {
#ifdef SAGE_WITH_CUDA
  return std::string("CUDA on, sm_90a kernels for head dims ") + sage::gpu_head_dims();
#else
  return "CUDA off, configured with -DSAGE_CUDA=OFF";
#endif
}

}  // namespace sage::cli
