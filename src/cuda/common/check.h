// Error checking for CUDA runtime calls: every call goes through SPARSE_ATTN_CUDA_CHECK, which
// turns a failure into sparse_attn::Error naming the call, the error and the source location.
#pragma once

#include <cuda_runtime_api.h>

#include "sparse_attn/errors.h"

namespace sparse_attn::cuda {

[[noreturn]] void throw_cuda_error(cudaError_t err, const char* call, const char* file, int line);

inline void check(cudaError_t err, const char* call, const char* file, int line) {
  if (err != cudaSuccess) throw_cuda_error(err, call, file, line);
}

}  // namespace sparse_attn::cuda

#define SPARSE_ATTN_CUDA_CHECK(call) ::sparse_attn::cuda::check((call), #call, __FILE__, __LINE__)

// After a kernel launch: launch-configuration errors surface here, not at the next sync.
#define SPARSE_ATTN_CUDA_CHECK_LAUNCH() \
  ::sparse_attn::cuda::check(cudaGetLastError(), "kernel launch", __FILE__, __LINE__)
