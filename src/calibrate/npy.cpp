// NumPy .npy files: a strict reader for the calibration inputs and a writer for tests and
// for tools that dump activations. Only what calibration needs is accepted (little-endian
// fp16/fp32, C order), and anything else is refused with the file and the reason rather than
// guessed at: a transposed or mistyped activation dump would calibrate the wrong numbers.
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <set>

#include "sage/calibrate.h"
#include "sage/error.h"
#include "numerics/formats.h"

namespace sage {
namespace {

const char kMagic[] = "\x93NUMPY";

[[noreturn]] void npy_fail(const std::string& path, const std::string& why) {
  throw Error("npy", path + ": " + why);
}

// The header is a Python dict literal; this reads exactly the three keys NumPy writes.
struct HeaderParser {
  const std::string& h;
  const std::string& path;
  size_t i = 0;

  void ws() {
    while (i < h.size() && (h[i] == ' ' || h[i] == '\n' || h[i] == '\t')) ++i;
  }
  [[noreturn]] void bad(const std::string& why) const {
    npy_fail(path, "malformed header (" + why + "): " + h.substr(0, h.find('\n')));
  }
  void expect(char c) {
    ws();
    if (i >= h.size() || h[i] != c) bad(std::string("expected '") + c + "'");
    ++i;
  }
  bool peek(char c) {
    ws();
    return i < h.size() && h[i] == c;
  }
  std::string quoted() {
    ws();
    if (i >= h.size() || (h[i] != '\'' && h[i] != '"')) bad("expected a quoted string");
    const char q = h[i++];
    const size_t end = h.find(q, i);
    if (end == std::string::npos) bad("unterminated string");
    std::string s = h.substr(i, end - i);
    i = end + 1;
    return s;
  }
  int64_t integer() {
    ws();
    size_t start = i;
    while (i < h.size() && h[i] >= '0' && h[i] <= '9') ++i;
    if (start == i || i - start > 15) bad("expected a dimension");
    return std::stoll(h.substr(start, i - start));
  }
};

void parse_header(const std::string& header, const std::string& path, NpyArray* out) {
  HeaderParser p{header, path};
  bool have_descr = false, have_order = false, have_shape = false;
  p.expect('{');
  while (!p.peek('}')) {
    const std::string key = p.quoted();
    p.expect(':');
    if (key == "descr") {
      const std::string d = p.quoted();
      if (d == "<f2") {
        out->dtype = DType::f16;
      } else if (d == "<f4") {
        out->dtype = DType::f32;
      } else {
        npy_fail(path, "dtype '" + d + "' is not supported (allowed: '<f2' float16, '<f4' float32)");
      }
      have_descr = true;
    } else if (key == "fortran_order") {
      p.ws();
      if (header.compare(p.i, 5, "False") == 0) {
        p.i += 5;
      } else if (header.compare(p.i, 4, "True") == 0) {
        npy_fail(path, "fortran_order True is not supported (write C-contiguous arrays, e.g. "
                       "numpy.ascontiguousarray)");
      } else {
        p.bad("fortran_order must be True or False");
      }
      have_order = true;
    } else if (key == "shape") {
      p.expect('(');
      out->shape.clear();
      while (!p.peek(')')) {
        out->shape.push_back(p.integer());
        if (!p.peek(')')) p.expect(',');
      }
      p.expect(')');
      have_shape = true;
    } else {
      p.bad("unknown key '" + key + "'");
    }
    if (!p.peek('}')) p.expect(',');
  }
  if (!have_descr || !have_order || !have_shape) p.bad("needs descr, fortran_order and shape");
}

void write_npy_bytes(const std::string& path, const std::vector<int64_t>& shape, const char* descr,
                     const void* data, size_t elem_size) {
  std::string dims;
  size_t count = 1;
  for (const int64_t s : shape) {
    dims += std::to_string(s) + ",";
    if (shape.size() > 1) dims += " ";
    count *= static_cast<size_t>(s);
  }
  if (shape.size() > 1) dims.resize(dims.size() - 2);
  std::string header = std::string("{'descr': '") + descr + "', 'fortran_order': False, 'shape': (" +
                       dims + "), }";
  // NumPy pads the header so the data starts on a 64-byte boundary, ending with '\n'.
  const size_t unpadded = 6 + 2 + 2 + header.size() + 1;
  header += std::string((64 - unpadded % 64) % 64, ' ') + "\n";
  std::ofstream f(path, std::ios::binary);
  if (!f) throw Error("npy", path + ": cannot be opened for writing");
  const uint16_t len = static_cast<uint16_t>(header.size());
  const unsigned char ver[2] = {1, 0};
  const unsigned char le[2] = {static_cast<unsigned char>(len & 0xFF),
                               static_cast<unsigned char>(len >> 8)};
  f.write(kMagic, 6);
  f.write(reinterpret_cast<const char*>(ver), 2);
  f.write(reinterpret_cast<const char*>(le), 2);
  f.write(header.data(), static_cast<std::streamsize>(header.size()));
  f.write(static_cast<const char*>(data), static_cast<std::streamsize>(count * elem_size));
  if (!f) throw Error("npy", path + ": write failed");
}

}  // namespace

NpyArray read_npy(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) npy_fail(path, "cannot be opened");
  char magic[6] = {};
  f.read(magic, 6);
  if (!f || std::memcmp(magic, kMagic, 6) != 0)
    npy_fail(path, "not a .npy file (bad magic: the file must start with \\x93NUMPY)");
  unsigned char ver[2] = {};
  f.read(reinterpret_cast<char*>(ver), 2);
  if (!f) npy_fail(path, "truncated header");
  uint32_t header_len = 0;
  if (ver[0] == 1 && ver[1] == 0) {
    unsigned char b[2] = {};
    f.read(reinterpret_cast<char*>(b), 2);
    header_len = b[0] | (b[1] << 8);
  } else if (ver[0] == 2 && ver[1] == 0) {
    unsigned char b[4] = {};
    f.read(reinterpret_cast<char*>(b), 4);
    header_len = b[0] | (b[1] << 8) | (b[2] << 16) | (static_cast<uint32_t>(b[3]) << 24);
  } else {
    npy_fail(path, "format version " + std::to_string(ver[0]) + "." + std::to_string(ver[1]) +
                       " is not supported (allowed: 1.0, 2.0)");
  }
  if (!f || header_len > (1u << 20)) npy_fail(path, "truncated or oversized header");
  std::string header(header_len, '\0');
  f.read(header.data(), header_len);
  if (!f) npy_fail(path, "truncated header");

  NpyArray a;
  parse_header(header, path, &a);
  const size_t elem = a.dtype == DType::f16 ? 2 : 4;
  size_t count = 1;
  for (const int64_t s : a.shape) {
    if (s < 0 || (s > 0 && count > (size_t{1} << 40) / static_cast<size_t>(s)))
      npy_fail(path, "shape is too large");
    count *= static_cast<size_t>(s);
  }
  a.data.resize(count * elem);
  f.read(reinterpret_cast<char*>(a.data.data()), static_cast<std::streamsize>(a.data.size()));
  if (static_cast<size_t>(f.gcount()) != a.data.size())
    npy_fail(path, "data is shorter than the header's shape says (" + std::to_string(f.gcount()) +
                       " of " + std::to_string(a.data.size()) + " bytes)");
  f.peek();
  if (!f.eof()) npy_fail(path, "data is longer than the header's shape says");
  return a;
}

void write_npy(const std::string& path, const std::vector<int64_t>& shape, const float* data) {
  write_npy_bytes(path, shape, "<f4", data, 4);
}

void write_npy_f16(const std::string& path, const std::vector<int64_t>& shape,
                   const uint16_t* bits) {
  write_npy_bytes(path, shape, "<f2", bits, 2);
}

LayerFiles load_layer_files(const std::string& directory) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (!fs::is_directory(directory, ec))
    throw Error("inputs", directory + ": not a directory");

  // A file of a later layer behind a gap means a lost file, not a shorter model.
  const std::regex name_re(R"(layer(\d+)_([qkv])\.npy)");
  std::map<int64_t, std::set<char>> found;
  for (const auto& entry : fs::directory_iterator(directory, ec)) {
    std::smatch m;
    const std::string name = entry.path().filename().string();
    if (std::regex_match(name, m, name_re) && m[1].str().size() < 9)
      found[std::stoll(m[1].str())].insert(m[2].str()[0]);
  }
  if (ec) throw Error("inputs", directory + ": cannot be listed (" + ec.message() + ")");
  if (found.empty())
    throw Error("inputs", directory + ": no layer files (expected layer0_q.npy, layer0_k.npy, "
                                      "layer0_v.npy, layer1_q.npy, ...)");
  int64_t expect = 0;
  for (const auto& [index, parts] : found) {
    if (index != expect)
      throw Error("inputs", directory + ": layer" + std::to_string(index) +
                                "_*.npy exists but layer" + std::to_string(expect) +
                                "_*.npy does not (layers must be numbered 0, 1, ... without gaps)");
    for (const char t : {'q', 'k', 'v'})
      if (!parts.count(t))
        throw Error("inputs", directory + ": layer" + std::to_string(index) + "_" + t +
                                  ".npy is missing");
    ++expect;
  }

  LayerFiles out;
  out.directory = directory;
  for (int64_t layer = 0; layer < expect; ++layer) {
    int64_t shapes[3][4] = {};
    for (int t = 0; t < 3; ++t) {
      const std::string file = "layer" + std::to_string(layer) + "_" + "qkv"[t] + ".npy";
      const std::string path = (fs::path(directory) / file).string();
      const NpyArray a = read_npy(path);
      if (a.shape.size() != 3 && a.shape.size() != 4)
        throw Error("inputs", path + ": must be 4-d [batch, heads, tokens, head_dim] or 3-d "
                                     "[heads, tokens, head_dim] (got " +
                                  std::to_string(a.shape.size()) + "-d)");
      const size_t off = 4 - a.shape.size();
      shapes[t][0] = 1;
      for (size_t i = 0; i < a.shape.size(); ++i) shapes[t][off + i] = a.shape[i];
      for (int i = 0; i < 4; ++i)
        if (shapes[t][i] < 1) throw Error("inputs", path + ": every dimension must be >= 1");
      std::vector<uint16_t> bits(a.data.size() / (a.dtype == DType::f16 ? 2 : 4));
      if (a.dtype == DType::f16) {
        std::memcpy(bits.data(), a.data.data(), a.data.size());
      } else {
        for (size_t i = 0; i < bits.size(); ++i) {
          float x;
          std::memcpy(&x, a.data.data() + 4 * i, 4);
          bits[i] = fmt::fp16_bits(x);
        }
      }
      out.buffers.push_back(std::move(bits));
    }
    const std::string where = directory + ": layer" + std::to_string(layer) + ": ";
    if (shapes[1][0] != shapes[0][0] || shapes[2][0] != shapes[0][0])
      throw Error("inputs", where + "q, k and v must have the same batch (samples)");
    // V may have a head dim of its own (MLA: Q/K 192, V 128); its heads and tokens are K's.
    if (shapes[1][1] != shapes[2][1] || shapes[1][2] != shapes[2][2])
      throw Error("inputs", where + "k and v must have the same heads and tokens (the same shape "
                                    "but for v's head_dim)");
    if (shapes[0][3] != shapes[1][3])
      throw Error("inputs", where + "q and k must have the same head_dim");
    LayerSamples s;
    TensorView* views[3] = {&s.q, &s.k, &s.v};
    for (int t = 0; t < 3; ++t) {
      const int64_t* d = shapes[t];
      *views[t] = contiguous_view(out.buffers[out.buffers.size() - 3 + t].data(), DType::f16,
                                  {d[0], d[1], d[2], d[3]});
    }
    out.layers.push_back(s);
  }
  return out;
}

}  // namespace sage
