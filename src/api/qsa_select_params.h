// Params of the selection helpers (include/sparse_attn/qsa_select.h), filled by
// src/api/qsa_select.cpp after validation. A 2-D [rows, ..] input has batch = 1 and
// batch strides 0; strides are int64 in elements.
#pragma once

#include <cstdint>

#include <cstddef>

#include "api/meta_ptr.h"
#include "api/qsa_indexer_params.h"
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

// The fused selections (qsa_indexer_select, qsa_mqa_decode_select): the score op's params
// (their `out` is unused and null) and what the selection writes. Rows are the score op's
// flattened rows: padded [batch, q_len] (batch strides set), varlen [q_len] and decode
// [batch * rows] (batch strides 0).
struct SelectOutputs {
  int64_t k;           // blocks kept per row, 1..INT32_MAX (native: <= kNativeSelectMaxK)
  int32_t* block_ids;  // [.., k]: qsa_topk_blocks of the row's scores
  int64_t block_ids_batch_stride;
  int64_t block_ids_row_stride;
  int64_t block_ids_col_stride;
  // [.., 4k + 3], nullable: qsa_expand_blocks of block_ids at the row's position (a padding
  // row: all -1).
  int32_t* token_indices;
  int64_t token_indices_batch_stride;
  int64_t token_indices_row_stride;
  int64_t token_indices_col_stride;
  int32_t* valid_counts;  // [..], nullable: entries >= 0 of the row's token_indices
  int64_t valid_counts_batch_stride;
  int64_t valid_counts_row_stride;
  // Native scratch: >= the *_workspace_size below, 16-byte aligned, or null (the library's
  // stream-ordered pool). The rows are scored and selected in chunks that fit
  // max_workspace_bytes.
  void* workspace;
  size_t workspace_bytes;
  size_t max_workspace_bytes;
  int device_index;  // native only: the CUDA device of every pointer
};

struct IndexerSelectParams {
  MqaScoreParams score;
  SelectOutputs select;
};

struct DecodeSelectParams {
  MqaDecodeParams score;
  // [batch, rows] token position of each query row, nullable (then neither token_indices nor
  // valid_counts is set); rows with context_lens <= 0 or a negative position are padding.
  MetaPtr query_positions;
  int64_t query_positions_batch_stride;
  int64_t query_positions_row_stride;  // 0 for a [batch] tensor
  SelectOutputs select;
};

// Largest k the native fused selections take (their sort runs in shared memory).
inline constexpr int64_t kNativeSelectMaxK = 16384;


// Native (CUDA) entry points, used by the API for CUDA tensors. A CUDA build defines them in
// src/cuda/select; a CPU-only build (which cannot hold CUDA tensors) defines them to raise
// NotSupportedError (src/api/qsa_select_native_cpu_only.cpp). They accept every params value
// the API's checks let through, zero-sized dimensions included, and match the reference
// (src/reference/qsa_select_ref.cpp) bit for bit.
void native_topk_blocks(const TopkBlocksParams& params);
void native_expand_blocks(const ExpandBlocksParams& params);
// Scratch bytes of the native fused selections, from shapes only (0 when no row is scored);
// the same params give the same size. A CPU-only build returns 0.
size_t native_indexer_select_workspace_size(const IndexerSelectParams& params);
size_t native_decode_select_workspace_size(const DecodeSelectParams& params);
void native_indexer_select(const IndexerSelectParams& params);
void native_decode_select(const DecodeSelectParams& params);

}  // namespace sparse_attn::detail
