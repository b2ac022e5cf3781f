// Definition of launch_sparse_attention<T>; included only by instantiations/*.cu.
#pragma once

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
  // The opt-in limit is per function and device; setting it again is harmless, and it is not
  // a stream operation, so it is legal during graph capture.
  SPARSE_ATTN_CUDA_CHECK(cudaFuncSetAttribute(sparse_attention_fwd_kernel<T>,
                                              cudaFuncAttributeMaxDynamicSharedMemorySize,
                                              static_cast<int>(kSmem)));
  const dim3 grid(static_cast<unsigned>(p.rows), static_cast<unsigned>(p.num_kv_heads),
                  static_cast<unsigned>(x.num_splits));
  sparse_attention_fwd_kernel<T><<<grid, C::kThreads, kSmem, stream>>>(p, x);
  SPARSE_ATTN_CUDA_CHECK_LAUNCH();
  if (x.num_splits > 1) {
    sparse_attention_merge_kernel<T><<<static_cast<unsigned>(p.rows), 256, 0, stream>>>(p, x);
    SPARSE_ATTN_CUDA_CHECK_LAUNCH();
  }
}

}  // namespace sparse_attn::cuda
