// Shared pieces of the `sage` command: flag parsing, aligned tables, JSON, progress lines.
#pragma once

#include "common/json.h"  // JsonValue, parse_json, json_string: the library's one JSON

#include <chrono>
#include <cstdint>
#include <iosfwd>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace sage::cli {

// A bad flag or value. main() prints it as one line and exits with status 2, the same
// status as a sage::Error, so scripts can tell "you asked wrong" (2) from "it ran and
// failed" (1).
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// ---- flags --------------------------------------------------------------------------------

struct FlagSpec {
  std::string name;        // without the leading "--"
  std::string value_name;  // empty for a boolean switch
  std::string help;
};

class Flags {
 public:
  // Parses args (everything after the subcommand). Accepts "--name value" and
  // "--name=value"; throws UsageError for an unknown flag, a missing value, a repeated flag
  // or a positional argument.
  Flags(std::string command, std::string summary, std::vector<FlagSpec> specs,
        const std::vector<std::string>& args);

  bool help() const { return help_; }
  bool has(const std::string& name) const { return values_.count(name) != 0; }
  // The value as given, or `def` when the flag is absent.
  std::string str(const std::string& name, const std::string& def) const;
  // One of `allowed`; otherwise a UsageError naming the flag and listing them.
  std::string choice(const std::string& name, const std::string& def,
                     const std::vector<std::string>& allowed) const;
  // An integer in [lo, hi]; "16K" / "16k" mean 16 * 1024.
  int64_t integer(const std::string& name, int64_t def, int64_t lo, int64_t hi) const;
  // A comma-separated list of integers, each in [lo, hi].
  std::vector<int64_t> integers(const std::string& name, const std::vector<int64_t>& def,
                                int64_t lo, int64_t hi) const;
  // A comma-separated list drawn from `allowed`; "all" expands to every allowed value.
  std::vector<std::string> choices(const std::string& name, const std::string& def,
                                   const std::vector<std::string>& allowed) const;

  void print_help(std::ostream& os) const;
  const std::string& command() const { return command_; }

 private:
  [[noreturn]] void fail(const std::string& flag, const std::string& why) const;
  std::string command_, summary_;
  std::vector<FlagSpec> specs_;
  std::map<std::string, std::string> values_;
  bool help_ = false;
};

// --window LEFT,RIGHT: a sliding window (FlashAttention's window_size, -1 an unbounded side).
struct WindowFlag {
  int64_t left = -1, right = -1;
  bool given() const { return left >= 0 || right >= 0; }
  std::string text() const;  // "LEFT,RIGHT"
};
// The --window flag of `command` (absent: no window); with causal masking (`causal`) the
// right bound must be -1 or 0, as the library requires.
WindowFlag window_flag(const Flags& flags, const std::string& command, bool causal);

std::string join(const std::vector<std::string>& items, const std::string& sep);
// Parses an integer with an optional K (x1024) suffix; false when it is not one.
bool parse_int(const std::string& s, int64_t* out);

// ---- tables -------------------------------------------------------------------------------

// Columns are sized to their widest cell. A row with fewer cells than the header lets its
// last cell run across the remaining columns (used for "unsupported on GPU: ..." rows), and
// such a cell does not widen any column.
class Table {
 public:
  Table(std::vector<std::string> header, std::vector<bool> right_aligned);
  void add(std::vector<std::string> row);
  void print(std::ostream& os) const;
  void print_markdown(std::ostream& os) const;
  bool empty() const { return rows_.empty(); }

 private:
  std::vector<std::string> header_;
  std::vector<bool> right_;
  std::vector<std::vector<std::string>> rows_;
};

// Fixed-point and scientific formatting for table cells.
std::string fixed(double v, int digits);
std::string sci(double v, int digits);

// ---- JSON ---------------------------------------------------------------------------------

// One flat JSON object whose keys keep the order they were added in (records read better
// in the order a person expects: what ran, then what was measured).
class JsonRecord {
 public:
  JsonRecord& str(const std::string& key, const std::string& v);
  JsonRecord& num(const std::string& key, double v);  // non-finite numbers become null
  JsonRecord& integer(const std::string& key, int64_t v);
  JsonRecord& boolean(const std::string& key, bool v);
  JsonRecord& integers(const std::string& key, const std::vector<int64_t>& v);  // a JSON array
  std::string dump() const;

 private:
  std::vector<std::pair<std::string, std::string>> fields_;  // key, serialized value
};

// Fails before a long run rather than after it when a flag (`flag`, without "--": "json",
// "out") names a place that cannot be written.
void check_writable(const std::string& command, const std::string& flag, const std::string& path);
// Writes {<meta fields>, "records": [...]} to `path`, one record per line; throws UsageError
// when the file cannot be written (the path came from the user's --json flag).
void write_json_file(const std::string& command, const std::string& path, const JsonRecord& meta,
                     const std::vector<JsonRecord>& records);


// ---- progress -----------------------------------------------------------------------------

// "[3/60] sage2_8b k_bias ... (12.4 s)" on stderr, so stdout stays a clean table.
class Progress {
 public:
  Progress(int total, bool enabled);
  void step(const std::string& what);
  double elapsed_s() const;

 private:
  int total_, done_ = 0;
  bool enabled_;
  std::chrono::steady_clock::time_point start_;
};

// ---- subcommands --------------------------------------------------------------------------

int run_recipes(const std::vector<std::string>& args);
int run_check(const std::vector<std::string>& args);
int run_bench(const std::vector<std::string>& args);
int run_docs(const std::vector<std::string>& args);

// "CUDA on (head dims 64,128)" or "CUDA off": printed where a GPU was asked for and none
// could be used, so the reader sees whether the build or the machine is missing.
std::string build_description();

}  // namespace sage::cli
