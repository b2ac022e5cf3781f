#include "cuda/common/check.h"

#include <fmt/format.h>

namespace sparse_attn::cuda {

void throw_cuda_error(cudaError_t err, const char* call, const char* file, int line) {
  // This exception reports the error: clear the runtime's last-error state, which a failed call
  // (a cudaMalloc out of memory) leaves set, or the next launch check anywhere reports it again
  // as its own (measured: a native op after a caught allocation failure threw "out of memory in
  // kernel launch"). A sticky error (a faulted context) stays, as it must.
  cudaGetLastError();
  throw Error(fmt::format("CUDA error {} ({}) in {} at {}:{}", cudaGetErrorName(err),
                          cudaGetErrorString(err), call, file, line));
}

}  // namespace sparse_attn::cuda
