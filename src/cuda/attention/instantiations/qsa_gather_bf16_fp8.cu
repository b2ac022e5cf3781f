#include "cuda/attention/qsa_gather_kernel.cuh"

namespace sparse_attn::cuda {
template void launch_qsa_gather<__nv_bfloat16, __nv_fp8_e4m3>(const SparseAttentionParams&,
                                                              const SparseAttentionLaunch&,
                                                              cudaStream_t);
}  // namespace sparse_attn::cuda
