// Definition of launch_sparse_attention<T>; included only by instantiations/*.cu.
#pragma once

#include <array>
#include <atomic>

#include "cuda/attention/sparse_attention_kernel.cuh"
#include "cuda/attention/sparse_attention_launch.h"
#include "cuda/common/check.h"

namespace sparse_attn::cuda {

template <typename T>
void launch_sparse_attention(const SparseAttentionParams& p, const SparseAttentionLaunch& x,
                             cudaStream_t stream) {
  using C = SparseAttentionConfig;
  constexpr size_t kSmem = sizeof(SparseAttentionSmem);
  static_assert(kSmem <= 227 * 1024, "one CTA must fit the 227 KB an sm90 block may use");
  // The opt-in limit is per function and device: set on a device's first call only, since a
  // driver call on every decode step is host time the GPU may wait for. (It is not a stream
  // operation, so the first call may also be under graph capture; a lost race sets it twice,
  // which is harmless. Like the workspace pools, this assumes the device is not reset.)
  static std::array<std::atomic<bool>, 64> opted_in{};
  const bool cached = p.device_index >= 0 && p.device_index < static_cast<int>(opted_in.size());
  if (!cached || !opted_in[p.device_index].load(std::memory_order_acquire)) {
    SPARSE_ATTN_CUDA_CHECK(cudaFuncSetAttribute(sparse_attention_fwd_kernel<T>,
                                                cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                static_cast<int>(kSmem)));
    if (cached) opted_in[p.device_index].store(true, std::memory_order_release);
  }
  const dim3 grid(static_cast<unsigned>(p.rows), static_cast<unsigned>(p.num_kv_heads),
                  static_cast<unsigned>(x.num_splits));
  sparse_attention_fwd_kernel<T><<<grid, FwdShape::kThreads, kSmem, stream>>>(p, x);
  SPARSE_ATTN_CUDA_CHECK_LAUNCH();
  if (x.num_splits > 1) {
    // Programmatic dependent launch: the merge grid is set up while the forward grid runs
    // (which triggers it at its start) and waits for it in cudaGridDependencySynchronize,
    // which hides the launch gap in decode.
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(static_cast<unsigned>(p.rows), static_cast<unsigned>(p.num_q_heads));
    cfg.blockDim = dim3(C::kHeadDim);
    cfg.stream = stream;
    cudaLaunchAttribute attr = {};
    attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr.val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = &attr;
    cfg.numAttrs = 1;
    SPARSE_ATTN_CUDA_CHECK(cudaLaunchKernelEx(&cfg, sparse_attention_merge_kernel<T>, p, x));
  }
}

}  // namespace sparse_attn::cuda
