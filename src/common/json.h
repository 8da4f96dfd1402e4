// The little JSON the project reads and writes (bench results, calibration files): a strict
// parser and number formatting that round-trips. One copy, in the library, used by the
// calibration code and by the `sage` command alike.
#pragma once

#include <string>
#include <utility>
#include <vector>

namespace sage {

struct JsonValue {
  enum Kind { null, boolean, number, string, array, object } kind = null;
  bool b = false;
  double num = 0;
  std::string str;
  std::vector<JsonValue> items;
  std::vector<std::pair<std::string, JsonValue>> members;
  const JsonValue* get(const std::string& key) const;
};

// Throws std::runtime_error("byte <offset>: <problem>") on malformed input. Also accepts the
// NaN, Infinity and -Infinity that Python's json module writes for non-finite floats.
JsonValue parse_json(const std::string& text);

std::string json_string(const std::string& s);
// Shortest decimal that reads back to the same double; non-finite values become null.
std::string json_number(double v);

// Whole file as a string; false when it cannot be opened.
bool read_text_file(const std::string& path, std::string* out);

}  // namespace sage
