// Runtime values become template arguments here, and only here (STYLE.md: one place).
// dispatch_dtype hands the lambda the CUDA element type of a 16-bit floating dtype;
// dispatch_kv_dtype the K/V element type beside a query element type T.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

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

// K/V of the query's dtype (T itself) or FP8 e4m3 (__nv_fp8_e4m3).
template <typename T, typename F>
decltype(auto) dispatch_kv_dtype(DType dtype, DType kv_dtype, const char* what, F&& f) {
  if (kv_dtype == DType::kF8E4M3) return f(std::type_identity<__nv_fp8_e4m3>{});
  if (kv_dtype == dtype) return f(std::type_identity<T>{});
  throw NotSupportedError(std::string(what) + ": the native kernels take K/V of the query's " +
                          "dtype or float8_e4m3fn, got " + dtype_name(kv_dtype));
}

}  // namespace sparse_attn::cuda
