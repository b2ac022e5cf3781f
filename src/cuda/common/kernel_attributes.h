// A kernel's launch attributes, set once per device: they are per device and kernel, and
// setting them before every launch would cost a driver call on the hot path.
#pragma once

#include <cuda_runtime_api.h>

#include <mutex>

#include "cuda/common/check.h"

namespace sparse_attn::cuda {

// Opts Kernel (a __global__ function) in to `bytes` of dynamic shared memory on the current
// device, and, when prefer_max_shared, asks for the carveout that gives shared memory the most
// (so that several large CTAs fit one SM). One set of flags per Kernel.
template <auto Kernel>
void opt_in_shared_memory(int bytes, bool prefer_max_shared = false) {
  static std::once_flag set[64];
  int device = 0;
  SPARSE_ATTN_CUDA_CHECK(cudaGetDevice(&device));
  std::call_once(set[device % 64], [&] {
    SPARSE_ATTN_CUDA_CHECK(
        cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
    if (prefer_max_shared) {
      SPARSE_ATTN_CUDA_CHECK(cudaFuncSetAttribute(
          Kernel, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared));
    }
  });
}

// Lets Kernel launch in thread-block clusters of more than the portable 8 CTAs on the current
// device (whether a size fits is cudaOccupancyMaxActiveClusters's answer).
template <auto Kernel>
void allow_non_portable_clusters() {
  static std::once_flag set[64];
  int device = 0;
  SPARSE_ATTN_CUDA_CHECK(cudaGetDevice(&device));
  std::call_once(set[device % 64], [&] {
    SPARSE_ATTN_CUDA_CHECK(
        cudaFuncSetAttribute(Kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
  });
}

// A launch of `ctas` CTAs of `threads` threads in clusters of `cluster` along x, with `smem`
// bytes of dynamic shared memory; `attr` (the caller's, alive until the launch) holds the
// cluster shape the config points to.
inline cudaLaunchConfig_t cluster_launch_config(unsigned ctas, unsigned threads, unsigned cluster,
                                                size_t smem, cudaStream_t stream,
                                                cudaLaunchAttribute& attr) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(ctas);
  cfg.blockDim = dim3(threads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  attr = {};
  attr.id = cudaLaunchAttributeClusterDimension;
  attr.val.clusterDim.x = cluster;
  attr.val.clusterDim.y = 1;
  attr.val.clusterDim.z = 1;
  cfg.attrs = &attr;
  cfg.numAttrs = 1;
  return cfg;
}

// A launch of a `grid` of CTAs of `threads` threads with `smem` bytes of dynamic shared memory
// that, where `programmatic`, is the programmatic dependent of the kernel before it on `stream`:
// it may start once every CTA of that kernel has run griddepcontrol.launch_dependents (or
// exited), and its CTAs read that kernel's results only after griddepcontrol.wait. `attr` (the
// caller's, alive until the launch) holds the attribute the config points to.
inline cudaLaunchConfig_t programmatic_launch_config(dim3 grid, unsigned threads, size_t smem,
                                                     cudaStream_t stream, cudaLaunchAttribute& attr,
                                                     bool programmatic = true) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = dim3(threads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  attr = {};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = &attr;
  cfg.numAttrs = programmatic ? 1 : 0;
  return cfg;
}

}  // namespace sparse_attn::cuda
