// Runtime values become template arguments here, and only here (STYLE.md: one place).
// dispatch_dtype hands the lambda the CUDA element type of a 16-bit floating dtype.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

#include "sparse_attn/errors.h"
#include "sparse_attn/tensor.h"

namespace sparse_attn::cuda {

template <typename F>
decltype(auto) dispatch_dtype(DType dtype, const char* what, F&& f) {
  switch (dtype) {
    case DType::kBF16:
      return f(std::type_identity<__nv_bfloat16>{});
    case DType::kF16:
      return f(std::type_identity<__half>{});
    default:
      throw NotSupportedError(std::string(what) + ": the native kernels take bfloat16 or " +
                              "float16 inputs, got " + dtype_name(dtype));
  }
}

}  // namespace sparse_attn::cuda
