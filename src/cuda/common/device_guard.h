// Makes a CUDA device current for a scope and restores the caller's device after it, on every
// exit path (entry points run on the device of their tensors, whatever the caller had set).
#pragma once

#include <cuda_runtime_api.h>

#include "cuda/common/check.h"

namespace sparse_attn::cuda {

class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    SPARSE_ATTN_CUDA_CHECK(cudaGetDevice(&previous_));
    if (device != previous_) {
      SPARSE_ATTN_CUDA_CHECK(cudaSetDevice(device));
      switched_ = true;
    }
  }
  // Restores only what it changed: a call on the current device costs no cudaSetDevice.
  ~DeviceGuard() {
    if (switched_) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
  bool switched_ = false;
};

}  // namespace sparse_attn::cuda
