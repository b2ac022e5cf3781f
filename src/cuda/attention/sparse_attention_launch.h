// Launchers of the sm90 sparse-attention kernels, one explicit instantiation per element type
// (instantiations/*.cu). The runtime dtype becomes T in sparse_attention_native.cu only.
#pragma once

#include <cuda_runtime_api.h>

#include "api/qsa_attention_params.h"

namespace sparse_attn::cuda {

struct SparseAttentionLaunch;

// Runs the forward kernel and, when x.num_splits > 1, the merge kernel on `stream`.
template <typename T>
void launch_sparse_attention(const SparseAttentionParams& p, const SparseAttentionLaunch& x,
                             cudaStream_t stream);

// Fills x.row_rank / x.request_rows (device buffers of rows and batch int32, the latter
// zeroed here) for token_to_req layouts without query positions.
void launch_sparse_attention_row_rank(const SparseAttentionParams& p, int32_t* row_rank,
                                      int32_t* request_rows, cudaStream_t stream);

}  // namespace sparse_attn::cuda
