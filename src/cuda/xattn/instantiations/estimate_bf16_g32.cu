#include "cuda/xattn/estimate_kernel.cuh"

namespace sparse_attn::cuda {
template void launch_xattn_estimate<cutlass::bfloat16_t, 32>(const XAttnEstimateKernelParams&,
                                                             int64_t, int, cudaStream_t);
}  // namespace sparse_attn::cuda
