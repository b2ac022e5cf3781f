#include "cuda/attention/qsa_union_launch.cuh"

namespace sparse_attn::cuda {
template void launch_qsa_union<__nv_bfloat16>(const QsaUnionParams&, cudaStream_t);
}  // namespace sparse_attn::cuda
