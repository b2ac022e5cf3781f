#include "cuda/xattn/block_sparse_launch.cuh"

namespace sparse_attn::cuda {
template void launch_block_sparse_fwd<cutlass::half_t, 128>(const BlockSparseFwdParams&, int64_t, int,
                                                            cudaStream_t);
}  // namespace sparse_attn::cuda
