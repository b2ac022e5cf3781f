// Helpers for the GPU cases (test_gpu_*.cpp, compiled only in CUDA builds): skipping cleanly
// without a device, and moving test tensors between host and device.
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include "sparse_attn/tensor.h"

namespace sparse_attn::testing {

// True when a CUDA device is usable (the driver is present and reports at least one device).
bool gpu_available();

// A device copy of a host tensor (contiguous).
Tensor to_device(const Tensor& host);
// A device tensor of `shape` filled with NaN / garbage (see poison()).
Tensor poisoned_device(const Shape& shape, DType dtype);

}  // namespace sparse_attn::testing

// First statement of every GPU case: a machine without a GPU reports the case as skipped.
#define SPARSE_ATTN_REQUIRE_GPU()                                                   \
  do {                                                                              \
    if (!::sparse_attn::testing::gpu_available()) GTEST_SKIP() << "no CUDA device"; \
  } while (0)
