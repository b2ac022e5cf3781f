// What the subcommands of sparse-attn share: size parsing, device and backend choice, timing,
// the progress line, row sampling and host/device copies.
#pragma once

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "sparse_attn/common.h"
#include "sparse_attn/tensor.h"
#include "sparse_attn/workload.h"

namespace sparse_attn::cli {

// "4096", "32k" (x1024), "1m" (x1024^2); nullopt for anything else or a negative/overflowing
// value.
std::optional<int64_t> parse_size(std::string_view text);
// 32768 -> "32k", 1000 -> "1000".
std::string format_size(int64_t n);
// A CLI11 validator that turns a size into its plain integer (CLI11 names the flag on error).
CLI::Validator size_validator();

// The device a run uses: "auto" (the first GPU when one is usable, else the CPU), "cpu",
// "cuda" or "cuda:N" (an error when that GPU is not usable).
struct RunDevice {
  Device device;
  std::string why;  // e.g. "cuda:0 (auto: a GPU is present)"
};
RunDevice choose_device(const std::string& spec);
bool cuda_usable(int index);

// --backend auto|native|reference. auto runs each op natively (CUDA kernels or the CPU
// backend) and falls back to the reference, per op, when the native backend does not support
// the call (the fallback is reported, never silent).
class BackendPolicy {
 public:
  BackendPolicy(const std::string& flag, Device device);
  // Runs op(backend) and returns the backend that ran it; notes records fallbacks.
  Backend run(const std::string& op_name, const std::function<void(Backend)>& op);
  // Whether op runs natively here, found by calling it natively (validation rejects an
  // unsupported call before any work, so a small probe call costs one launch): false with
  // --backend reference, true without a probe with --backend native (the real call then
  // raises if it must). Used to avoid running the reference on whole prompts.
  bool native_supported(const std::string& op_name, const std::function<void(Backend)>& op);
  const std::vector<std::string>& notes() const { return notes_; }

 private:
  std::string flag_;
  Device device_;
  std::vector<std::string> notes_;
};

// Waits until work queued on the device is done (a one-element copy to the host: copies are
// synchronous), so host clocks time the GPU's work. Nothing to do on the CPU.
void synchronize(const TensorView& any_on_device);

class Stopwatch {
 public:
  void start() { t0_ = std::chrono::steady_clock::now(); }
  double seconds() const {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count();
  }

 private:
  std::chrono::steady_clock::time_point t0_ = std::chrono::steady_clock::now();
};

// A one-line progress report on stderr ("what: 12/64 rows, 3.1 s, about 13 s left"), shown
// once the work has taken more than a second, updated at most every 0.25 s.
class Progress {
 public:
  Progress(std::string what, int64_t total, std::string unit);
  void update(int64_t done);
  void finish();
  ~Progress() { finish(); }

 private:
  std::string what_, unit_;
  int64_t total_;
  Stopwatch clock_;
  double last_print_ = -1;
  bool shown_ = false, done_ = false;
};

// Query rows (indices into the workload's query rows) that the metrics are evaluated on:
// every row when count <= 0 or count >= query_len, else `count` rows evenly spaced over the
// query rows plus the middle row of each needle's span (so every needle is evaluated),
// sorted and unique.
std::vector<int64_t> sample_rows(const Workload& w, int64_t count);

// Host copy of rows `rows` of request b of a [B, L, ...] tensor, as [1, R, ...].
Tensor gather_rows(const TensorView& host, int64_t b, const std::vector<int64_t>& rows);
// Request b of a [B, L, ...] tensor as a [1, L, ...] view.
TensorView request(const TensorView& t, int64_t b);
// A copy on `device` (the tensor itself when it is already there).
Tensor to_device(const Tensor& t, Device device);
// int32 [1, n] tensor on the host.
Tensor int32_row(const std::vector<int64_t>& values);

// The compressed indexer keys [1, N_B, Di] of request b on `device`, made the way an engine
// makes them: qsa_compress_block_keys from the workload's raw keys (native on a GPU, through
// `policy`), with the workload's norm weight and RoPE. A workload without raw keys (files that
// hold compressed ones) or in fp32 (the op takes bf16/fp16) gives its own index_key instead.
Tensor compressed_index_keys(const Workload& w, int64_t b, Device device, BackendPolicy& policy);
// The same keys written through `block_table` [1, max_pages] into the paged cache `out`
// [pages, page_size, 1, Di] (both on the cache's device); the workload must have bf16/fp16 raw
// keys.
void compress_index_keys_into(const Workload& w, int64_t b, const TensorView& out,
                              const TensorView& block_table, BackendPolicy& policy);

// "12.3 ms", "4.56 s".
std::string format_seconds(double s);

}  // namespace sparse_attn::cli
