// .npy and safetensors readers and writers; include/sparse_attn/io.h states the contract.
#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <string_view>

#include "sparse_attn/dtype.h"
#include "sparse_attn/errors.h"
#include "sparse_attn/io.h"

namespace sparse_attn {
namespace {

template <typename... Args>
[[noreturn]] void file_error(const std::string& path, fmt::format_string<Args...> f,
                             Args&&... args) {
  throw ValueError(fmt::format("{}: {}", path, fmt::format(f, std::forward<Args>(args)...)));
}

// An open input file that knows its size and reports short reads with its path.
class InputFile {
 public:
  explicit InputFile(const std::string& path) : path_(path), in_(path, std::ios::binary) {
    std::error_code ec;
    if (!std::filesystem::exists(path, ec)) file_error(path, "no such file");
    if (!std::filesystem::is_regular_file(path, ec)) file_error(path, "not a regular file");
    if (!in_) file_error(path, "cannot open ({})", std::strerror(errno));
    in_.seekg(0, std::ios::end);
    size_ = static_cast<uint64_t>(in_.tellg());
    in_.seekg(0);
  }
  uint64_t size() const { return size_; }
  void read(uint64_t offset, void* dst, uint64_t bytes, std::string_view what) {
    if (offset > size_ || bytes > size_ - offset)
      file_error(path_, "truncated: {} needs bytes {}..{} but the file has {}", what, offset,
                 offset + bytes, size_);
    in_.seekg(static_cast<std::streamoff>(offset));
    in_.read(static_cast<char*>(dst), static_cast<std::streamsize>(bytes));
    if (!in_) file_error(path_, "read error in {}", what);
  }

 private:
  std::string path_;
  std::ifstream in_;
  uint64_t size_ = 0;
};

// Elements of a shape, or nullopt when the count overflows.
std::optional<uint64_t> checked_numel(const Shape& shape) {
  uint64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0) return std::nullopt;
    if (d != 0 && n > std::numeric_limits<uint64_t>::max() / 8 / uint64_t(d)) return std::nullopt;
    n *= uint64_t(d);
  }
  return n;
}

// A file's dtype: the storage we read and the DType we load it as (float64 -> float32).
struct FileDType {
  DType dtype;
  size_t file_bytes;
  bool is_f64 = false;
};

Tensor read_tensor(InputFile& file, const std::string& path, const std::string& what, FileDType fd,
                   const Shape& shape, uint64_t offset) {
  if (shape.size() > size_t(TensorView::kMaxDims))
    file_error(path, "{} has {} dimensions; at most {} are supported", what, shape.size(),
               TensorView::kMaxDims);
  const auto n = checked_numel(shape);
  if (!n) file_error(path, "{} has an invalid shape {}", what, shape_str(shape));
  Tensor t = Tensor::empty(shape, fd.dtype);
  if (!fd.is_f64) {
    file.read(offset, t.data(), *n * fd.file_bytes, what);
    return t;
  }
  std::vector<double> tmp(*n);
  file.read(offset, tmp.data(), *n * 8, what);
  for (uint64_t i = 0; i < *n; ++i) t.data_as<float>()[i] = static_cast<float>(tmp[i]);
  return t;
}

std::optional<FileDType> safetensors_dtype(std::string_view s) {
  if (s == "BF16") return FileDType{DType::kBF16, 2};
  if (s == "F16") return FileDType{DType::kF16, 2};
  if (s == "F32") return FileDType{DType::kF32, 4};
  if (s == "F64") return FileDType{DType::kF32, 8, true};
  if (s == "I32") return FileDType{DType::kI32, 4};
  if (s == "I64") return FileDType{DType::kI64, 8};
  if (s == "BOOL") return FileDType{DType::kBool, 1};
  if (s == "U8") return FileDType{DType::kU8, 1};
  if (s == "F8_E4M3") return FileDType{DType::kF8E4M3, 1};  // safetensors' torch.float8_e4m3fn
  return std::nullopt;
}

const char* safetensors_name(DType d) {
  switch (d) {
    case DType::kBF16:
      return "BF16";
    case DType::kF16:
      return "F16";
    case DType::kF32:
      return "F32";
    case DType::kI32:
      return "I32";
    case DType::kI64:
      return "I64";
    case DType::kBool:
      return "BOOL";
    case DType::kU8:
      return "U8";
    case DType::kF8E4M3:
      return "F8_E4M3";
  }
  return "?";
}

struct SafetensorsEntry {
  TensorInfo info;
  FileDType fd;
  uint64_t begin = 0;  // absolute file offset
};

// Parses and checks the whole header: every entry well formed, inside the data, and its byte
// count equal to its shape's.
std::vector<SafetensorsEntry> read_safetensors_header(InputFile& file, const std::string& path) {
  unsigned char len_bytes[8];
  if (file.size() < 8)
    file_error(path, "not a safetensors file: {} bytes, shorter than the 8-byte header length",
               file.size());
  file.read(0, len_bytes, 8, "the header length");
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | len_bytes[i];
  if (header_len > file.size() - 8)
    file_error(path,
               "not a safetensors file or truncated: header length {} exceeds the {} bytes "
               "after it",
               header_len, file.size() - 8);
  std::string header(header_len, '\0');
  file.read(8, header.data(), header_len, "the header");
  const uint64_t data_start = 8 + header_len, data_len = file.size() - data_start;

  nlohmann::json j;
  try {
    j = nlohmann::json::parse(header);
  } catch (const nlohmann::json::parse_error& e) {
    file_error(path, "malformed safetensors header (invalid JSON: {})", e.what());
  }
  if (!j.is_object()) file_error(path, "malformed safetensors header: not a JSON object");

  std::vector<SafetensorsEntry> entries;
  for (const auto& [name, e] : j.items()) {
    if (name == "__metadata__") continue;
    auto bad = [&](std::string_view why) {
      file_error(path, "malformed safetensors header: tensor \"{}\" {}", name, why);
    };
    if (!e.is_object() || !e.contains("dtype") || !e.contains("shape") ||
        !e.contains("data_offsets"))
      bad("needs an object with dtype, shape and data_offsets");
    if (!e["dtype"].is_string()) bad("has a dtype that is not a string");
    const auto fd = safetensors_dtype(e["dtype"].get<std::string>());
    if (!fd)
      throw TypeError(
          fmt::format("{}: tensor \"{}\" has dtype {}; supported: BF16, F16, F32, "
                      "F64, I32, I64, BOOL, U8, F8_E4M3",
                      path, name, e["dtype"].get<std::string>()));
    Shape shape;
    if (!e["shape"].is_array()) bad("has a shape that is not a list");
    for (const auto& d : e["shape"]) {
      if (!d.is_number_unsigned()) bad("has a shape entry that is not a non-negative integer");
      if (d.get<uint64_t>() > uint64_t(std::numeric_limits<int64_t>::max()))
        bad("has a shape entry that is too large");
      shape.push_back(d.get<int64_t>());
    }
    const auto& off = e["data_offsets"];
    if (!off.is_array() || off.size() != 2 || !off[0].is_number_unsigned() ||
        !off[1].is_number_unsigned())
      bad("needs data_offsets [begin, end] of non-negative integers");
    const uint64_t begin = off[0].get<uint64_t>(), end = off[1].get<uint64_t>();
    if (begin > end || end > data_len)
      bad(fmt::format("has data_offsets [{}, {}] outside the {} data bytes", begin, end, data_len));
    const auto n = checked_numel(shape);
    if (!n) bad("has a shape whose element count overflows");
    if (end - begin != *n * fd->file_bytes)
      bad(fmt::format("has {} data bytes but its shape {} and dtype {} need {}", end - begin,
                      shape_str(shape), e["dtype"].get<std::string>(), *n * fd->file_bytes));
    entries.push_back({{name, fd->dtype, shape}, *fd, data_start + begin});
  }
  std::sort(entries.begin(), entries.end(),
            [](const auto& a, const auto& b) { return a.begin < b.begin; });
  return entries;
}

std::optional<FileDType> npy_dtype(std::string_view d) {
  if (d == "<f2") return FileDType{DType::kF16, 2};
  if (d == "<f4") return FileDType{DType::kF32, 4};
  if (d == "<f8") return FileDType{DType::kF32, 8, true};
  if (d == "<i4") return FileDType{DType::kI32, 4};
  if (d == "<i8") return FileDType{DType::kI64, 8};
  if (d == "|b1") return FileDType{DType::kBool, 1};
  if (d == "|u1") return FileDType{DType::kU8, 1};
  return std::nullopt;
}

// Value of `key` in the header dict, as the raw text up to the next top-level comma or brace.
std::optional<std::string_view> npy_field(std::string_view header, std::string_view key) {
  const std::string quoted = fmt::format("'{}'", key);
  auto p = header.find(quoted);
  if (p == std::string_view::npos) return std::nullopt;
  p = header.find(':', p + quoted.size());
  if (p == std::string_view::npos) return std::nullopt;
  ++p;
  while (p < header.size() && header[p] == ' ') ++p;
  size_t e = p;
  int depth = 0;
  for (; e < header.size(); ++e) {
    const char c = header[e];
    if (c == '(') ++depth;
    if (c == ')') --depth;
    if (depth < 0 || (depth == 0 && (c == ',' || c == '}'))) break;
  }
  if (depth > 0) return std::nullopt;
  if (e < header.size() && header[e] == ')') ++e;
  return header.substr(p, e - p);
}

Tensor copy_contiguous_host(const TensorView& v, const std::string& path) {
  if (v.device().is_cuda()) file_error(path, "cannot write a CUDA tensor; copy it to the host");
  return Tensor::to_host(v);
}

}  // namespace

std::vector<TensorInfo> list_safetensors(const std::string& path) {
  InputFile file(path);
  std::vector<TensorInfo> out;
  for (auto& e : read_safetensors_header(file, path)) out.push_back(e.info);
  return out;
}

Tensor load_safetensors(const std::string& path, const std::string& name) {
  InputFile file(path);
  const auto entries = read_safetensors_header(file, path);
  std::string names;
  for (const auto& e : entries) {
    if (e.info.name == name)
      return read_tensor(file, path, fmt::format("tensor \"{}\"", name), e.fd, e.info.shape,
                         e.begin);
    names += (names.empty() ? "" : ", ") + e.info.name;
  }
  file_error(path, "no tensor named \"{}\" (the file has: {})", name,
             names.empty() ? "no tensors" : names);
}

Tensor load_npy(const std::string& path) {
  InputFile file(path);
  static constexpr char kMagic[] = "\x93NUMPY";
  char pre[10];
  if (file.size() < 10) file_error(path, "not a .npy file: only {} bytes", file.size());
  file.read(0, pre, 10, "the preamble");
  if (std::memcmp(pre, kMagic, 6) != 0) file_error(path, "not a .npy file (bad magic bytes)");
  const int major = static_cast<unsigned char>(pre[6]);
  uint64_t header_len, header_start;
  if (major == 1) {
    header_len = static_cast<unsigned char>(pre[8]) | (static_cast<unsigned char>(pre[9]) << 8);
    header_start = 10;
  } else if (major == 2 || major == 3) {
    unsigned char b[4];
    file.read(8, b, 4, "the header length");
    header_len = b[0] | (b[1] << 8) | (b[2] << 16) | (uint64_t(b[3]) << 24);
    header_start = 12;
  } else {
    file_error(path, ".npy format version {} is not supported (1, 2 or 3)", major);
  }
  std::string header(header_len, '\0');
  file.read(header_start, header.data(), header_len, "the header");

  const auto descr = npy_field(header, "descr");
  const auto fortran = npy_field(header, "fortran_order");
  const auto shape_text = npy_field(header, "shape");
  if (!descr || !fortran || !shape_text)
    file_error(path, "malformed .npy header (needs descr, fortran_order and shape): {}", header);
  if (*fortran != "False")
    file_error(path,
               "Fortran-order arrays are not supported; save a C-contiguous array "
               "(np.ascontiguousarray)");
  std::string d(*descr);
  if (d.size() < 3 || (d.front() != '\'' && d.front() != '"') || d.back() != d.front())
    file_error(path, "malformed .npy header: descr {} is not a quoted string", d);
  d = d.substr(1, d.size() - 2);
  const auto fd = npy_dtype(d);
  if (!fd)
    throw TypeError(
        fmt::format("{}: .npy dtype '{}' is not supported (little-endian <f2, <f4, "
                    "<f8, <i4, <i8 or |b1; bfloat16 needs safetensors)",
                    path, d));

  std::string_view st = *shape_text;
  if (st.size() < 2 || st.front() != '(' || st.back() != ')')
    file_error(path, "malformed .npy header: shape {} is not a tuple", st);
  Shape shape;
  st = st.substr(1, st.size() - 2);
  while (!st.empty()) {
    while (!st.empty() && (st.front() == ' ' || st.front() == ',')) st.remove_prefix(1);
    if (st.empty()) break;
    int64_t v = 0;
    size_t i = 0;
    for (; i < st.size() && st[i] >= '0' && st[i] <= '9'; ++i) {
      if (v > (std::numeric_limits<int64_t>::max() - 9) / 10)
        file_error(path, "malformed .npy header: shape entry too large");
      v = v * 10 + (st[i] - '0');
    }
    if (i == 0)
      file_error(path, "malformed .npy header: shape {} has a non-integer entry", *shape_text);
    shape.push_back(v);
    st.remove_prefix(i);
  }
  const auto n = checked_numel(shape);
  if (!n) file_error(path, "malformed .npy header: shape {} overflows", *shape_text);
  const uint64_t data = header_start + header_len, need = *n * fd->file_bytes;
  if (file.size() - data != need)
    file_error(path, "{} data bytes, but shape {} of {} needs {}", file.size() - data,
               shape_str(shape), d, need);
  return read_tensor(file, path, "the array", *fd, shape, data);
}

Tensor load_tensor(const std::string& spec) {
  auto ends_with = [](std::string_view s, std::string_view suffix) {
    return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
  };
  if (ends_with(spec, ".npy")) return load_npy(spec);
  if (ends_with(spec, ".safetensors")) {
    const auto infos = list_safetensors(spec);
    if (infos.size() != 1)
      file_error(spec, "holds {} tensors; name one as {}:NAME", infos.size(), spec);
    return load_safetensors(spec, infos[0].name);
  }
  const auto colon = spec.rfind(':');
  if (colon != std::string::npos && ends_with(spec.substr(0, colon), ".safetensors"))
    return load_safetensors(spec.substr(0, colon), spec.substr(colon + 1));
  file_error(spec,
             "unknown tensor file format: expected FILE.npy, FILE.safetensors or "
             "FILE.safetensors:NAME");
}

void save_npy(const std::string& path, const TensorView& tensor) {
  const char* descr = nullptr;
  switch (tensor.dtype()) {
    case DType::kF16:
      descr = "<f2";
      break;
    case DType::kF32:
      descr = "<f4";
      break;
    case DType::kI32:
      descr = "<i4";
      break;
    case DType::kI64:
      descr = "<i8";
      break;
    case DType::kBool:
      descr = "|b1";
      break;
    case DType::kU8:
      descr = "|u1";
      break;
    case DType::kBF16:
      throw TypeError(fmt::format("{}: numpy has no bfloat16; save it as safetensors", path));
    case DType::kF8E4M3:
      throw TypeError(fmt::format("{}: numpy has no float8_e4m3fn; save it as safetensors", path));
  }
  const Tensor host = copy_contiguous_host(tensor, path);
  std::string shape = "(";
  for (int64_t d : tensor.shape()) shape += fmt::format("{}, ", d);
  if (tensor.dim() > 1)
    shape.resize(shape.size() - 2);
  else if (tensor.dim() == 1)
    shape.resize(shape.size() - 1);
  shape += ")";
  std::string header =
      fmt::format("{{'descr': '{}', 'fortran_order': False, 'shape': {}, }}", descr, shape);
  // Pad with spaces so the data starts 64-byte aligned; the header ends with a newline.
  header.append(63 - (10 + header.size()) % 64, ' ');
  header += '\n';
  std::ofstream out(path, std::ios::binary);
  if (!out) file_error(path, "cannot open for writing ({})", std::strerror(errno));
  const unsigned char pre[10] = {0x93,
                                 'N',
                                 'U',
                                 'M',
                                 'P',
                                 'Y',
                                 1,
                                 0,
                                 static_cast<unsigned char>(header.size() & 0xff),
                                 static_cast<unsigned char>(header.size() >> 8)};
  out.write(reinterpret_cast<const char*>(pre), 10);
  out << header;
  out.write(static_cast<const char*>(host.data()),
            static_cast<std::streamsize>(host.numel() * dtype_size(host.dtype())));
  if (!out) file_error(path, "write error");
}

void save_safetensors(const std::string& path,
                      const std::vector<std::pair<std::string, TensorView>>& tensors) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  std::vector<Tensor> hosts;
  uint64_t offset = 0;
  for (const auto& [name, view] : tensors) {
    if (name.empty() || name == "__metadata__" || header.contains(name))
      file_error(path, "tensor name \"{}\" is empty, reserved or repeated", name);
    hosts.push_back(copy_contiguous_host(view, path));
    const uint64_t bytes = uint64_t(view.numel()) * dtype_size(view.dtype());
    header[name] = {{"dtype", safetensors_name(view.dtype())},
                    {"shape", view.shape()},
                    {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // keeps the data 8-byte aligned
  std::ofstream out(path, std::ios::binary);
  if (!out) file_error(path, "cannot open for writing ({})", std::strerror(errno));
  unsigned char len[8];
  for (int i = 0; i < 8; ++i) len[i] = static_cast<unsigned char>(uint64_t(text.size()) >> (8 * i));
  out.write(reinterpret_cast<const char*>(len), 8);
  out << text;
  for (const Tensor& t : hosts)
    out.write(static_cast<const char*>(t.data()),
              static_cast<std::streamsize>(t.numel() * dtype_size(t.dtype())));
  if (!out) file_error(path, "write error");
}

}  // namespace sparse_attn
