#include "cuda/attention/sparse_attention_common.cuh"
#include "cuda/attention/sparse_attention_launch.h"
#include "cuda/common/check.h"

namespace sparse_attn::cuda {

// kTokenToReq: row i of a request is its i-th row in row order; the default position and
// seq_lens_q need i and each request's row count. One CTA walks the rows in chunks of
// its size; `request_rows` ([batch], zeroed by the caller) carries the counts across chunks.
// Padding rows (an id outside [0, batch), -1 by contract) belong to no request and get no rank.
__global__ void __launch_bounds__(1024)
    sparse_attention_row_rank_kernel(const __grid_constant__ SparseAttentionParams p,
                                     int32_t* row_rank, int32_t* request_rows) {
  __shared__ int32_t req[1024];
  for (int64_t c0 = 0; c0 < p.rows; c0 += blockDim.x) {
    const int64_t r = c0 + threadIdx.x;
    const bool live = r < p.rows;
    const int64_t id = live ? p.token_to_req[r * p.token_to_req_stride] : -1;
    const int32_t b = id >= 0 && id < p.batch ? static_cast<int32_t>(id) : -1;
    req[threadIdx.x] = b;
    __syncthreads();
    const int n = static_cast<int>(min(static_cast<int64_t>(blockDim.x), p.rows - c0));
    int before = 0;
    bool last = live;
    for (int t = 0; t < n; ++t) {
      if (req[t] != b) continue;
      if (t < static_cast<int>(threadIdx.x)) ++before;
      if (t > static_cast<int>(threadIdx.x)) last = false;
    }
    const bool counted = live && b >= 0;
    if (counted) row_rank[r] = request_rows[b] + before;
    __syncthreads();  // every rank read request_rows before the last rows advance it
    if (counted && last) request_rows[b] += before + 1;
    __syncthreads();
  }
}

void launch_sparse_attention_row_rank(const SparseAttentionParams& p, int32_t* row_rank,
                                      int32_t* request_rows, cudaStream_t stream) {
  SPARSE_ATTN_CUDA_CHECK(
      cudaMemsetAsync(request_rows, 0, static_cast<size_t>(p.batch) * sizeof(int32_t), stream));
  sparse_attention_row_rank_kernel<<<1, 1024, 0, stream>>>(p, row_rank, request_rows);
  SPARSE_ATTN_CUDA_CHECK_LAUNCH();
}

}  // namespace sparse_attn::cuda
