// The little JSON the calibration files need: a strict parser for bench results and choice
// files, and number formatting that round-trips. The library cannot use the CLI's reader
// (the CLI links the library, not the other way round).
#pragma once

#include <string>
#include <utility>
#include <vector>

namespace sage::calib {

struct JsonValue {
  enum Kind { null, boolean, number, string, array, object } kind = null;
  bool b = false;
  double num = 0;
  std::string str;
  std::vector<JsonValue> items;
  std::vector<std::pair<std::string, JsonValue>> members;
  const JsonValue* get(const std::string& key) const;
};

// Throws std::runtime_error("byte <offset>: <problem>") on malformed input.
JsonValue parse_json(const std::string& text);

std::string json_string(const std::string& s);
// Shortest decimal that reads back to the same double; non-finite values become null.
std::string json_number(double v);

// Whole file as a string; false when it cannot be opened.
bool read_text_file(const std::string& path, std::string* out);

}  // namespace sage::calib
