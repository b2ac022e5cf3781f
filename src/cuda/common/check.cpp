#include "cuda/common/check.h"

#include <fmt/format.h>

namespace sparse_attn::cuda {

void throw_cuda_error(cudaError_t err, const char* call, const char* file, int line) {
  throw Error(fmt::format("CUDA error {} ({}) in {} at {}:{}", cudaGetErrorName(err),
                          cudaGetErrorString(err), call, file, line));
}

}  // namespace sparse_attn::cuda
