#include "cuda/attention/qsa_step_kernel.cuh"

namespace sparse_attn::cuda {
template void launch_qsa_step<__half>(const QsaStepParams&, cudaStream_t);
}  // namespace sparse_attn::cuda
