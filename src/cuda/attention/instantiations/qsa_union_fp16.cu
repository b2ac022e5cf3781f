#include "cuda/attention/qsa_union_launch.cuh"

namespace sparse_attn::cuda {
template void launch_qsa_union<__half>(const QsaUnionParams&, cudaStream_t);
}  // namespace sparse_attn::cuda
