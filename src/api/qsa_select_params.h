// Params of the selection helpers (include/sparse_attn/qsa_select.h), filled by
// src/api/qsa_select.cpp after validation. A 2-D [rows, ..] input has batch = 1 and
// batch strides 0; strides are int64 in elements.
#pragma once

#include <cstdint>

#include "api/meta_ptr.h"
#include "sparse_attn/common.h"

namespace sparse_attn::detail {

struct TopkBlocksParams {
  int64_t batch;
  int64_t rows;        // per batch entry
  int64_t num_blocks;  // N_B, at most INT32_MAX (checked at the API)
  int64_t k;
  const float* scores;  // [batch, rows, num_blocks]
  int64_t scores_batch_stride;
  int64_t scores_row_stride;
  int64_t scores_col_stride;
  int32_t* out;  // [batch, rows, k]
  int64_t out_batch_stride;
  int64_t out_row_stride;
  int64_t out_col_stride;
  int device_index;     // native only: the CUDA device of every pointer
  StreamHandle stream;  // native only
};

struct ExpandBlocksParams {
  int64_t batch;
  int64_t rows;  // per batch entry
  int64_t k;
  MetaPtr block_ids;  // [batch, rows, k], -1 (any negative) = nothing selected
  int64_t block_ids_batch_stride;
  int64_t block_ids_row_stride;
  int64_t block_ids_col_stride;
  MetaPtr query_positions;  // [batch, rows]
  int64_t query_positions_batch_stride;
  int64_t query_positions_row_stride;
  int32_t* token_indices;  // [batch, rows, 4k + 3]
  int64_t token_indices_batch_stride;
  int64_t token_indices_row_stride;
  int64_t token_indices_col_stride;
  int32_t* block_indices;  // [batch, rows, k]; null when the caller wants no block hint
  int64_t block_indices_batch_stride;
  int64_t block_indices_row_stride;
  int64_t block_indices_col_stride;
  int device_index;     // native only: the CUDA device of every pointer
  StreamHandle stream;  // native only
};

// Native (CUDA) entry points, used by the API for CUDA tensors. A CUDA build defines them in
// src/cuda/select; a CPU-only build (which cannot hold CUDA tensors) defines them to raise
// NotSupportedError (src/api/qsa_select_native_cpu_only.cpp). They accept every params value
// the API's checks let through, zero-sized dimensions included, and match the reference
// (src/reference/qsa_select_ref.cpp) bit for bit.
void native_topk_blocks(const TopkBlocksParams& params);
void native_expand_blocks(const ExpandBlocksParams& params);

}  // namespace sparse_attn::detail
