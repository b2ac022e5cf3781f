// Definition of launch_sparse_attention<T, KV>; included only by instantiations/*.cu.
#pragma once

#include "cuda/attention/sparse_attention_kernel.cuh"
#include "cuda/attention/sparse_attention_launch.h"
#include "cuda/common/check.h"
#include "cuda/common/kernel_attributes.h"

namespace sparse_attn::cuda {

template <typename T, typename KV>
void launch_sparse_attention(const SparseAttentionParams& p, const SparseAttentionLaunch& x,
                             cudaStream_t stream) {
  using C = SparseAttentionConfig;
  constexpr size_t kSmem = sizeof(SparseAttentionSmem<KV>);
  static_assert(kSmem <= 227 * 1024, "one CTA must fit the 227 KB an sm90 block may use");
  opt_in_shared_memory<sparse_attention_fwd_kernel<T, KV>>(static_cast<int>(kSmem));
  const dim3 grid(static_cast<unsigned>(p.rows), static_cast<unsigned>(p.num_kv_heads),
                  static_cast<unsigned>(x.num_splits));
  sparse_attention_fwd_kernel<T, KV><<<grid, FwdShape::kThreads, kSmem, stream>>>(p, x);
  SPARSE_ATTN_CUDA_CHECK_LAUNCH();
  if (x.num_splits > 1) {
    // Programmatic dependent launch: the merge grid is set up while the forward grid runs
    // (which triggers it at its start) and waits for it in cudaGridDependencySynchronize,
    // which hides the launch gap in decode.
    cudaLaunchAttribute attr;
    const cudaLaunchConfig_t cfg = programmatic_launch_config(
        dim3(static_cast<unsigned>(p.rows), static_cast<unsigned>(p.num_q_heads)), C::kHeadDim, 0,
        stream, attr);
    SPARSE_ATTN_CUDA_CHECK(cudaLaunchKernelEx(&cfg, sparse_attention_merge_kernel<T>, p, x));
  }
}

}  // namespace sparse_attn::cuda
