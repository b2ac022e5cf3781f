#include "cuda/attention/sparse_attention_launch.cuh"

namespace sparse_attn::cuda {
template void launch_sparse_attention<__nv_bfloat16, __nv_bfloat16>(const SparseAttentionParams&,
                                                                    const SparseAttentionLaunch&,
                                                                    cudaStream_t);
}  // namespace sparse_attn::cuda
