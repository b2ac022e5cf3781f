#include "cuda/attention/sparse_attention_launch.cuh"

namespace sparse_attn::cuda {
template void launch_sparse_attention<__half, __nv_fp8_e4m3>(const SparseAttentionParams&,
                                                             const SparseAttentionLaunch&,
                                                             cudaStream_t);
}  // namespace sparse_attn::cuda
