// Device memory hooks used by Tensor and copy_into. A CPU-only build defines them to raise;
// the CUDA build (src/cuda/common) defines them with the CUDA runtime.
#pragma once

#include <cstddef>
#include <memory>

#include "sparse_attn/tensor.h"

namespace sparse_attn::detail {

// Allocates `bytes` on `device`; the deleter frees it.
std::shared_ptr<void> device_alloc(size_t bytes, Device device);

// Copies src into dst (same shape and dtype), at least one of them on a CUDA device.
// Synchronous: returns when the copy is complete.
void device_copy(const TensorView& dst, const TensorView& src);

}  // namespace sparse_attn::detail
