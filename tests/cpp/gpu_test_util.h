// Helpers for the GPU cases (test_gpu_*.cpp, compiled only in CUDA builds): skipping cleanly
// without a device, and moving test tensors between host and device.
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <functional>

#include "sparse_attn/tensor.h"

namespace sparse_attn::testing {

// True when a CUDA device is usable (the driver is present and reports at least one device).
bool gpu_available();

// A device copy of a host tensor (contiguous).
Tensor to_device(const Tensor& host);
// A device tensor of `shape` filled with NaN / garbage (see poison()).
Tensor poisoned_device(const Shape& shape, DType dtype);

// A CUDA graph captured from one `call(stream)` on a stream of its own, after a warm-up call
// there (a captured call must not be a device's first: it would set the kernels' shared-memory
// limits and create pools inside the capture); destroyed with the object.
class CapturedGraph {
 public:
  explicit CapturedGraph(const std::function<void(cudaStream_t)>& call);
  ~CapturedGraph();
  CapturedGraph(const CapturedGraph&) = delete;
  CapturedGraph& operator=(const CapturedGraph&) = delete;

  bool ok() const { return exec_ != nullptr; }  // every step of the capture succeeded
  // Replays the graph and waits for it: the launch's error, else the wait's.
  cudaError_t replay() const;

 private:
  cudaStream_t stream_ = nullptr;
  cudaGraph_t graph_ = nullptr;
  cudaGraphExec_t exec_ = nullptr;
};

}  // namespace sparse_attn::testing

// First statement of every GPU case: a machine without a GPU reports the case as skipped.
#define SPARSE_ATTN_REQUIRE_GPU()                                                   \
  do {                                                                              \
    if (!::sparse_attn::testing::gpu_available()) GTEST_SKIP() << "no CUDA device"; \
  } while (0)
