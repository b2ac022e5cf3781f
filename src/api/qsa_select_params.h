// Params of the selection helpers (include/sparse_attn/qsa_select.h), filled by
// src/api/qsa_select.cpp after validation. A 2-D [rows, ..] input has batch = 1 and
// batch strides 0; strides are int64 in elements.
#pragma once

#include <cstdint>

namespace sparse_attn::detail {

struct TopkBlocksParams {
  int64_t batch;
  int64_t rows;        // per batch entry
  int64_t num_blocks;  // N_B
  int64_t k;
  const float* scores;  // [batch, rows, num_blocks]
  int64_t scores_batch_stride;
  int64_t scores_row_stride;
  int64_t scores_col_stride;
  int32_t* out;  // [batch, rows, k]
  int64_t out_batch_stride;
  int64_t out_row_stride;
  int64_t out_col_stride;
};

struct ExpandBlocksParams {
  int64_t batch;
  int64_t rows;  // per batch entry
  int64_t k;
  const int32_t* block_ids;  // [batch, rows, k], -1 (any negative) = nothing selected
  int64_t block_ids_batch_stride;
  int64_t block_ids_row_stride;
  int64_t block_ids_col_stride;
  const int32_t* query_positions;  // [batch, rows]
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
};

}  // namespace sparse_attn::detail
