// One explicit instantiation per file, so the kernels compile in parallel.
#include "cuda/indexer/mqa_rows_kernel.cuh"

template void sparse_attn::cuda::indexer::launch_mqa_rows<__half, __half>(
    const sparse_attn::cuda::indexer::RowsProblem&, cudaStream_t);
