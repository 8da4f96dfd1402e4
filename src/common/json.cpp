#include "common/json.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <fstream>
#include <sstream>
#include <stdexcept>

namespace sage {

const JsonValue* JsonValue::get(const std::string& key) const {
  for (const auto& m : members)
    if (m.first == key) return &m.second;
  return nullptr;
}

namespace {

class Parser {
 public:
  explicit Parser(const std::string& t) : t_(t) {}

  JsonValue document() {
    JsonValue v = value(0);
    ws();
    if (i_ != t_.size()) fail("unexpected text after the value");
    return v;
  }

 private:
  [[noreturn]] void fail(const std::string& why) const {
    throw std::runtime_error("byte " + std::to_string(i_) + ": " + why);
  }
  void ws() {
    while (i_ < t_.size() && (t_[i_] == ' ' || t_[i_] == '\n' || t_[i_] == '\r' || t_[i_] == '\t'))
      ++i_;
  }
  bool eat(char c) {
    ws();
    if (i_ < t_.size() && t_[i_] == c) {
      ++i_;
      return true;
    }
    return false;
  }
  void expect(char c) {
    if (!eat(c)) fail(std::string("expected '") + c + "'");
  }
  bool word(const char* w) {
    const std::string s(w);
    if (t_.compare(i_, s.size(), s) != 0) return false;
    i_ += s.size();
    return true;
  }

  JsonValue value(int depth) {
    // Deep nesting only comes from a corrupt or hostile file; stop before the stack does.
    if (depth > 64) fail("nesting deeper than 64");
    ws();
    if (i_ >= t_.size()) fail("unexpected end of input");
    JsonValue v;
    const char c = t_[i_];
    if (c == '{') {
      ++i_;
      v.kind = JsonValue::object;
      if (eat('}')) return v;
      do {
        ws();
        if (i_ >= t_.size() || t_[i_] != '"') fail("expected a string key");
        std::string key = string_body();
        expect(':');
        v.members.emplace_back(std::move(key), value(depth + 1));
      } while (eat(','));
      expect('}');
    } else if (c == '[') {
      ++i_;
      v.kind = JsonValue::array;
      if (eat(']')) return v;
      do v.items.push_back(value(depth + 1));
      while (eat(','));
      expect(']');
    } else if (c == '"') {
      v.kind = JsonValue::string;
      v.str = string_body();
    } else if (word("true")) {
      v.kind = JsonValue::boolean;
      v.b = true;
    } else if (word("false")) {
      v.kind = JsonValue::boolean;
    } else if (word("null")) {
      v.kind = JsonValue::null;
    } else if (word("NaN")) {
      v.kind = JsonValue::number;
      v.num = std::numeric_limits<double>::quiet_NaN();
    } else if (word("Infinity")) {
      v.kind = JsonValue::number;
      v.num = std::numeric_limits<double>::infinity();
    } else if (word("-Infinity")) {
      v.kind = JsonValue::number;
      v.num = -std::numeric_limits<double>::infinity();
    } else if (c == '-' || (c >= '0' && c <= '9')) {
      const char* begin = t_.c_str() + i_;
      char* end = nullptr;
      v.kind = JsonValue::number;
      v.num = std::strtod(begin, &end);
      if (end == begin) fail("bad number");
      i_ += static_cast<size_t>(end - begin);
    } else {
      fail(std::string("unexpected character '") + c + "'");
    }
    return v;
  }

  std::string string_body() {
    ++i_;  // opening quote
    std::string s;
    while (true) {
      if (i_ >= t_.size()) fail("unterminated string");
      const char c = t_[i_++];
      if (c == '"') return s;
      if (c != '\\') {
        s += c;
        continue;
      }
      if (i_ >= t_.size()) fail("unterminated string");
      const char e = t_[i_++];
      switch (e) {
        case '"': s += '"'; break;
        case '\\': s += '\\'; break;
        case '/': s += '/'; break;
        case 'b': s += '\b'; break;
        case 'f': s += '\f'; break;
        case 'n': s += '\n'; break;
        case 'r': s += '\r'; break;
        case 't': s += '\t'; break;
        case 'u': {
          if (i_ + 4 > t_.size()) fail("short \\u escape");
          const unsigned cp = static_cast<unsigned>(std::strtoul(t_.substr(i_, 4).c_str(), nullptr, 16));
          i_ += 4;
          // UTF-8 for the basic plane; names and device strings never need surrogates.
          if (cp < 0x80) {
            s += static_cast<char>(cp);
          } else if (cp < 0x800) {
            s += static_cast<char>(0xC0 | (cp >> 6));
            s += static_cast<char>(0x80 | (cp & 0x3F));
          } else {
            s += static_cast<char>(0xE0 | (cp >> 12));
            s += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
            s += static_cast<char>(0x80 | (cp & 0x3F));
          }
          break;
        }
        default: fail(std::string("bad escape '\\") + e + "'");
      }
    }
  }

  const std::string& t_;
  size_t i_ = 0;
};

}  // namespace

JsonValue parse_json(const std::string& text) { return Parser(text).document(); }

std::string json_string(const std::string& s) {
  std::string o = "\"";
  for (const char c : s) {
    switch (c) {
      case '"': o += "\\\""; break;
      case '\\': o += "\\\\"; break;
      case '\n': o += "\\n"; break;
      case '\r': o += "\\r"; break;
      case '\t': o += "\\t"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", static_cast<unsigned>(c));
          o += buf;
        } else {
          o += c;
        }
    }
  }
  return o + "\"";
}

std::string json_number(double v) {
  if (!std::isfinite(v)) return "null";
  char buf[40];
  for (int prec = 6; prec <= 17; ++prec) {
    std::snprintf(buf, sizeof buf, "%.*g", prec, v);
    if (std::strtod(buf, nullptr) == v) break;
  }
  return buf;
}

bool read_text_file(const std::string& path, std::string* out) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return false;
  std::ostringstream ss;
  ss << f.rdbuf();
  *out = ss.str();
  return true;
}

}  // namespace sage
