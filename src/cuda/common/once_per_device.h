// Per-device one-time setup for a call site, e.g. a kernel's shared-memory opt-in: the first call
// on each device runs it, later calls pay one atomic load instead of a CUDA API call (about a
// microsecond of host time each for cudaFuncSetAttribute, on the path of every decode step).
#pragma once

#include <array>
#include <mutex>
#include <utility>

namespace sparse_attn::cuda {

class OncePerDevice {
 public:
  // Runs fn() unless it already returned normally for `device`; concurrent first calls on one
  // device wait for the one that runs it. An exception leaves the device unmarked (the next
  // call retries). Ordinals past the table run fn() every time.
  template <typename Fn>
  void operator()(int device, Fn&& fn) {
    if (device < 0 || device >= kMaxDevices) {
      fn();
      return;
    }
    std::call_once(flags_[device], std::forward<Fn>(fn));
  }

 private:
  static constexpr int kMaxDevices = 64;
  std::array<std::once_flag, kMaxDevices> flags_;
};

}  // namespace sparse_attn::cuda
