#include "cuda/attention/sparse_attention_rows_kernel.cuh"

namespace sparse_attn::cuda {
template void launch_sparse_attention_rows<__nv_bfloat16>(const SparseAttentionParams&,
                                                          const SparseAttentionLaunch&,
                                                          cudaStream_t);
}  // namespace sparse_attn::cuda
