// Element access by a runtime dtype (float32, bfloat16 or float16), for kernels that are bound by
// their bytes and serve every dtype combination with one instantiation: the switch is uniform
// over the grid.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "sparse_attn/tensor.h"

namespace sparse_attn::cuda {

__device__ __forceinline__ float load_float(const void* base, DType dtype, int64_t i) {
  switch (dtype) {
    case DType::kBF16:
      return __bfloat162float(static_cast<const __nv_bfloat16*>(base)[i]);
    case DType::kF16:
      return __half2float(static_cast<const __half*>(base)[i]);
    default:
      return static_cast<const float*>(base)[i];
  }
}

// Rounded to nearest even for the 16-bit types.
__device__ __forceinline__ void store_float(void* base, DType dtype, int64_t i, float v) {
  switch (dtype) {
    case DType::kBF16:
      static_cast<__nv_bfloat16*>(base)[i] = __float2bfloat16_rn(v);
      break;
    case DType::kF16:
      static_cast<__half*>(base)[i] = __float2half_rn(v);
      break;
    default:
      static_cast<float*>(base)[i] = v;
  }
}

}  // namespace sparse_attn::cuda
