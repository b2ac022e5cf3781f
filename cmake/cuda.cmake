# CUDA backend switch. Sets SPARSE_ATTN_WITH_CUDA. The native kernels live in src/cuda and are
# compiled for sm_90a (Hopper); SPARSE_ATTN_CUDA_ARCHS may add architectures.
set(SPARSE_ATTN_WITH_CUDA OFF)
