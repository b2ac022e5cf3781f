// One explicit instantiation per file, so the kernels compile in parallel.
#include "cuda/indexer/mqa_decode_kernel.cuh"

template void sparse_attn::cuda::indexer::launch_mqa_decode<__nv_bfloat16, __nv_bfloat16>(
    const sparse_attn::cuda::indexer::DecodeProblem&, cudaStream_t);
