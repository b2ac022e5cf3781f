#include "common.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <limits>

#include "sparse_attn/errors.h"
#include "sparse_attn/qsa_compress.h"

namespace sparse_attn::cli {

std::optional<int64_t> parse_size(std::string_view text) {
  if (text.empty()) return std::nullopt;
  int64_t mult = 1;
  const char last = text.back();
  if (last == 'k' || last == 'K') mult = 1024;
  if (last == 'm' || last == 'M') mult = 1024 * 1024;
  if (mult != 1) text.remove_suffix(1);
  if (text.empty()) return std::nullopt;
  int64_t v = 0;
  for (char c : text) {
    if (c < '0' || c > '9') return std::nullopt;
    if (v > (std::numeric_limits<int64_t>::max() / mult - 9) / 10) return std::nullopt;
    v = v * 10 + (c - '0');
  }
  return v * mult;
}

std::string format_size(int64_t n) {
  if (n >= 1024 * 1024 && n % (1024 * 1024) == 0) return fmt::format("{}m", n / (1024 * 1024));
  if (n >= 1024 && n % 1024 == 0) return fmt::format("{}k", n / 1024);
  return std::to_string(n);
}

CLI::Validator size_validator() {
  return CLI::Validator(
      [](std::string& s) -> std::string {
        const auto v = parse_size(s);
        if (!v) return "expected a size such as 4096, 32k or 1m, got '" + s + "'";
        s = std::to_string(*v);
        return "";
      },
      "SIZE");
}

bool cuda_usable(int index) {
  try {
    Tensor::empty({1}, DType::kF32, Device::cuda(index));
    return true;
  } catch (const Error&) {
    return false;
  }
}

RunDevice choose_device(const std::string& spec) {
  if (spec == "cpu") return {Device::cpu(), "cpu (--device cpu)"};
  if (spec == "auto") {
    if (cuda_usable(0)) return {Device::cuda(0), "cuda:0 (auto: a GPU is present)"};
    return {Device::cpu(), "cpu (auto: no usable GPU in this build or machine)"};
  }
  int index = 0;
  if (spec.rfind("cuda:", 0) == 0) {
    const auto n = parse_size(spec.substr(5));
    if (!n || spec.size() == 5 || *n > 1024)
      throw ValueError(fmt::format("--device: expected auto, cpu, cuda or cuda:N, got '{}'", spec));
    index = static_cast<int>(*n);
  } else if (spec != "cuda") {
    throw ValueError(fmt::format("--device: expected auto, cpu, cuda or cuda:N, got '{}'", spec));
  }
  if (!cuda_usable(index))
    throw ValueError(
        fmt::format("--device {}: no usable GPU (a CPU-only build, or no such "
                    "device); use --device cpu or auto",
                    spec));
  return {Device::cuda(index), fmt::format("cuda:{} (--device {})", index, spec)};
}

BackendPolicy::BackendPolicy(const std::string& flag, Device device)
    : flag_(flag), device_(device) {
  if (flag != "auto" && flag != "native" && flag != "reference" && flag != "tilelang")
    throw ValueError(fmt::format("--backend: expected auto, native or reference, got '{}'", flag));
}

Backend BackendPolicy::run(const std::string& op_name, const std::function<void(Backend)>& op) {
  if (flag_ != "auto") {
    const Backend b = parse_backend(flag_);
    op(b);
    return b;
  }
  try {
    op(Backend::kNative);
    return Backend::kNative;
  } catch (const NotSupportedError& e) {
    const std::string note =
        fmt::format("{}: native unavailable ({}); used the reference", op_name, e.what());
    if (std::find(notes_.begin(), notes_.end(), note) == notes_.end()) notes_.push_back(note);
    op(Backend::kReference);
    return Backend::kReference;
  }
}

bool BackendPolicy::native_supported(const std::string& op_name,
                                     const std::function<void(Backend)>& op) {
  if (flag_ == "reference") return false;
  if (flag_ != "auto") return true;
  try {
    op(Backend::kNative);
    return true;
  } catch (const NotSupportedError& e) {
    notes_.push_back(fmt::format("{}: native unavailable ({})", op_name, e.what()));
    return false;
  }
}

void synchronize(const TensorView& t) {
  if (!t.device().is_cuda() || t.numel() == 0) return;
  const int nd = t.dim();
  Shape ones(static_cast<size_t>(nd), 1);
  Tensor::to_host(t.as_strided(ones, Shape(static_cast<size_t>(nd), 0)));
}

Progress::Progress(std::string what, int64_t total, std::string unit)
    : what_(std::move(what)), unit_(std::move(unit)), total_(total) {}

void Progress::update(int64_t done) {
  // On a terminal the line is redrawn in place; in a log, a line every 10 seconds.
  static const bool tty = isatty(fileno(stderr));
  const double t = clock_.seconds();
  const double every = tty ? 0.25 : 10.0;
  if (t < 1.0 || (t - last_print_ < every) || done <= 0 || done >= total_) return;
  last_print_ = t;
  shown_ = true;
  const double left = t / double(done) * double(total_ - done);
  std::fprintf(stderr, "%s%s: %lld/%lld %s, %s, about %s left%s", tty ? "\r" : "", what_.c_str(),
               static_cast<long long>(done), static_cast<long long>(total_), unit_.c_str(),
               format_seconds(t).c_str(), format_seconds(left).c_str(), tty ? "   " : "\n");
  std::fflush(stderr);
}

void Progress::finish() {
  if (done_) return;
  done_ = true;
  static const bool tty = isatty(fileno(stderr));
  if (shown_)
    std::fprintf(stderr, "%s%s: done in %s%s\n", tty ? "\r" : "", what_.c_str(),
                 format_seconds(clock_.seconds()).c_str(), tty ? "                    " : "");
}

std::vector<int64_t> sample_rows(const Workload& w, int64_t count) {
  const int64_t lq = w.options.query_len;
  std::vector<int64_t> rows;
  if (count <= 0 || count >= lq) {
    rows.resize(static_cast<size_t>(lq));
    for (int64_t i = 0; i < lq; ++i) rows[i] = i;
    return rows;
  }
  // Evenly spaced, ending at the last row (the one that sees the whole context).
  for (int64_t i = 0; i < count; ++i) rows.push_back(lq - 1 - i * lq / count);
  const int64_t qoff = w.options.seq_len - lq;
  for (const Needle& n : w.needles) rows.push_back((n.query_begin + n.query_end) / 2 - qoff);
  std::sort(rows.begin(), rows.end());
  rows.erase(std::unique(rows.begin(), rows.end()), rows.end());
  return rows;
}

namespace {

bool has_raw_index_keys(const Workload& w) {
  return w.index_key_raw.numel() > 0 &&
         (w.index_key_raw.dtype() == DType::kBF16 || w.index_key_raw.dtype() == DType::kF16);
}

void run_compress(const Workload& w, int64_t b, const TensorView& out,
                  const std::optional<TensorView>& block_table, Device device,
                  BackendPolicy& policy) {
  const Tensor raw = to_device(Tensor::to_host(request(w.index_key_raw, b)), device);
  const Tensor weight = to_device(Tensor::to_host(w.index_norm_weight), device);
  policy.run("qsa_compress_block_keys", [&](Backend be) {
    CompressBlockKeysOptions co;
    co.eps = w.index_norm_eps;
    co.rope_theta = w.options.rope_theta;
    co.rope_dim = w.index_rotary_dims;
    co.block_table = block_table;
    co.backend = be;
    qsa_compress_block_keys(raw, weight, out, co);
  });
}

}  // namespace

Tensor compressed_index_keys(const Workload& w, int64_t b, Device device, BackendPolicy& policy) {
  if (!has_raw_index_keys(w)) return to_device(Tensor::to_host(request(w.index_key, b)), device);
  Tensor out = Tensor::empty(request(w.index_key, b).shape(), w.index_key.dtype(), device);
  run_compress(w, b, out, std::nullopt, device, policy);
  return out;
}

void compress_index_keys_into(const Workload& w, int64_t b, const TensorView& out,
                              const TensorView& block_table, BackendPolicy& policy) {
  if (!has_raw_index_keys(w)) {
    throw ValueError("compress_index_keys_into: the workload has no bf16/fp16 raw index keys");
  }
  run_compress(w, b, out, block_table, out.device(), policy);
}

TensorView request(const TensorView& t, int64_t b) {
  Shape shape = t.shape(), strides(t.strides(), t.strides() + t.dim());
  shape[0] = 1;
  return t.as_strided(shape, strides, b * t.stride(0));
}

Tensor gather_rows(const TensorView& host, int64_t b, const std::vector<int64_t>& rows) {
  Shape shape = host.shape();
  shape[0] = 1;
  shape[1] = static_cast<int64_t>(rows.size());
  Tensor out = Tensor::empty(shape, host.dtype());
  const TensorView rb = host.select(0, b);
  for (size_t i = 0; i < rows.size(); ++i)
    copy_into(out.view().select(0, 0).select(0, static_cast<int64_t>(i)), rb.select(0, rows[i]));
  return out;
}

Tensor to_device(const Tensor& t, Device device) {
  if (t.device() == device) return t;
  Tensor d = Tensor::empty(t.shape(), t.dtype(), device);
  copy_into(d.view(), t.view());
  return d;
}

Tensor int32_row(const std::vector<int64_t>& values) {
  Tensor t = Tensor::empty({1, static_cast<int64_t>(values.size())}, DType::kI32);
  for (size_t i = 0; i < values.size(); ++i) t.data_as<int32_t>()[i] = int32_t(values[i]);
  return t;
}

std::string format_seconds(double s) {
  if (s < 1e-3) return fmt::format("{:.1f} us", s * 1e6);
  if (s < 1.0) return fmt::format("{:.1f} ms", s * 1e3);
  if (s < 120) return fmt::format("{:.2f} s", s);
  return fmt::format("{:.0f} min {:.0f} s", std::floor(s / 60), std::fmod(s, 60));
}

}  // namespace sparse_attn::cli
