#include "cuda/attention/qsa_step_kernel.cuh"

namespace sparse_attn::cuda {
template void launch_qsa_step<__nv_bfloat16>(const QsaStepParams&, cudaStream_t);
}  // namespace sparse_attn::cuda
