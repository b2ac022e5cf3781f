// Definition of launch_sparse_attention<T>; included only by instantiations/*.cu.
#pragma once

#include "cuda/attention/sparse_attention_kernel.cuh"
#include "cuda/attention/sparse_attention_launch.h"
#include "cuda/common/check.h"
#include "cuda/common/once_per_device.h"

namespace sparse_attn::cuda {

template <typename T>
void launch_sparse_attention(const SparseAttentionParams& p, const SparseAttentionLaunch& x,
                             cudaStream_t stream) {
  using C = SparseAttentionConfig;
  constexpr size_t kSmem = sizeof(SparseAttentionSmem);
  static_assert(kSmem <= 227 * 1024, "one CTA must fit the 227 KB an sm90 block may use");
  // The opt-in limit is per function and device, set once per device (it is not a stream
  // operation, so the first call may also come during graph capture).
  static OncePerDevice smem_opt_in;
  smem_opt_in(p.device_index, [] {
    SPARSE_ATTN_CUDA_CHECK(cudaFuncSetAttribute(sparse_attention_fwd_kernel<T>,
                                                cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                static_cast<int>(kSmem)));
  });
  const dim3 grid(static_cast<unsigned>(p.rows), static_cast<unsigned>(p.num_kv_heads),
                  static_cast<unsigned>(x.num_splits));
  sparse_attention_fwd_kernel<T><<<grid, C::kThreads, kSmem, stream>>>(p, x);
  SPARSE_ATTN_CUDA_CHECK_LAUNCH();
  if (x.num_splits > 1) {
    // Programmatic dependent launch: the merge grid is set up while the forward grid drains
    // and waits for it in cudaGridDependencySynchronize, which hides one launch gap in decode.
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
