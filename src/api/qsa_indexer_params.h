// Params of the QSA MQA indexer ops, filled by src/api/qsa_indexer.cpp after validation and read
// by the reference (src/reference/qsa_indexer_ref.cpp) and the native kernels (src/cuda).
//
// Everything here has passed validation: shapes agree, dtypes are right, metadata is int32,
// `out` does not overlap any input. Metadata *contents* (cu_seqlens monotonic, request ids in
// range, page ids) were not read; docs/qsa.md says what each op does with bad contents.
//
// Conventions: strides are int64 in elements of the tensor they belong to; a stride may be 0
// (broadcast) on inputs, never on `out`. `scale` is already resolved to a multiplier
// (scale, or 1 / score_scale, or 1 / sqrt(dim)). Row indices are int64 so that
// rows * stride never overflows.
#pragma once

#include <cstdint>

#include "api/meta_ptr.h"
#include "sparse_attn/qsa.h"
#include "sparse_attn/tensor.h"

namespace sparse_attn::detail {

// qsa_indexer_mqa_score:
//   out[row, b] = scale * sum_h ReLU(q[row, h, :] . key(req(row), b)), b in [0, num_blocks),
//   -inf unless 4b + 3 <= pos(row), the key's page is valid, and the row is a valid query row.
// Three forms, any combination of query form and key form:
//   query padded [batch, q_len, heads, dim]  or varlen [q_len (= total_q), heads, dim]
//   keys  logical [key_batch, num_blocks, dim] or paged cache [num_pages, page_size, dim]
//         addressed through block_table (num_blocks = max_pages * page_size).
struct MqaScoreParams {
  DType dtype;    // of q: kBF16 or kF16
  DType k_dtype;  // of k: `dtype`, or kF8E4M3 (used unscaled)

  // --- queries ---
  bool varlen;    // false: padded q [batch, q_len, heads, dim]; true: q [q_len, heads, dim]
  int64_t batch;  // number of requests: padded q.shape[0]; varlen cu_seqlens_q.shape[0] - 1
                  // or num_requests (token_to_req ids must lie in [0, batch))
  int64_t q_len;  // padded: query rows per request (q.shape[1]); varlen: total_q
  int64_t heads;  // indexer heads H (4 for QSA)
  int64_t dim;    // feature size D (128 for QSA)
  const void* q;  // padded [batch, q_len, heads, dim] / varlen [q_len, heads, dim]
  int64_t q_batch_stride;  // padded: stride of axis 0; varlen: 0 (unused)
  int64_t q_row_stride;    // stride of the query-row axis (padded axis 1, varlen axis 0)
  int64_t q_head_stride;
  int64_t q_dim_stride;  // 1 on the native path (vector loads)

  // Varlen request mapping: exactly one of the two is non-null when varlen, both null when padded.
  MetaPtr cu_seqlens_q;  // [batch + 1] row offsets; request r owns rows [cu[r], cu[r+1])
  int64_t cu_seqlens_q_stride;
  MetaPtr token_to_req;  // [q_len] request id of each row
  int64_t token_to_req_stride;

  // [batch, q_len] (padded) or [q_len] (varlen): request-local position of each row. Null: the
  // row's index within its request (padded: i; cu_seqlens: row - cu[r]; token_to_req: the
  // number of earlier rows with the same request id).
  MetaPtr query_positions;
  int64_t query_positions_batch_stride;  // padded only; 0 for varlen
  int64_t query_positions_row_stride;
  // [batch], padded only: valid rows per request; rows i >= seq_lens_q[b] are all -inf.
  // Null: every row is valid (always null for varlen).
  MetaPtr seq_lens_q;
  int64_t seq_lens_q_stride;

  // --- keys ---
  int64_t num_blocks;  // N_B, the output width
  // Logical (block_table == null): k [key_batch, num_blocks, dim], request r reads k[r].
  // Paged (block_table != null): k [num_pages, page_size, dim] (a [.., 1, dim] cache has its
  // head axis dropped); block b of request r is slot b % page_size of page
  // block_table[r, b / page_size]; pages < 0 or >= num_pages give -inf columns.
  const void* k;
  int64_t k_batch_stride;  // logical: stride of the request axis; paged: stride of the page axis
  int64_t k_row_stride;    // logical: stride of the block axis; paged: stride of the slot axis
  int64_t k_dim_stride;    // 1 on the native path
  MetaPtr block_table;     // [key_batch, max_pages]; null for logical keys
  int64_t block_table_batch_stride;
  int64_t block_table_page_stride;
  int64_t max_pages;  // paged only (0 otherwise)
  int64_t page_size;  // paged only (0 otherwise)
  int64_t num_pages;  // paged only (0 otherwise)

  float scale;  // multiplier

  // --- output, FP32 ---
  float* out;                // padded [batch, q_len, num_blocks] / varlen [q_len, num_blocks]
  int64_t out_batch_stride;  // padded only; 0 for varlen
  int64_t out_row_stride;
  int64_t out_col_stride;

  StreamHandle stream;  // cudaStream_t of the native path; unused by the reference
};

// qsa_mqa_prefill / qsa_mqa:
//   out[r, j] = scale * sum_h ReLU(q[r, h, :] . k[j, :]) for j in
//   [max(row_starts[r], 0), min(row_ends[r], keys)), -inf elsewhere (empty when start >= end).
struct MqaPrefillParams {
  DType dtype;    // of q: kBF16 or kF16
  DType k_dtype;  // of k: `dtype`, or kF8E4M3 (used unscaled)
  int64_t rows;
  int64_t heads;
  int64_t dim;
  const void* q;  // [rows, heads, dim]
  int64_t q_row_stride;
  int64_t q_head_stride;
  int64_t q_dim_stride;  // 1 on the native path

  int64_t keys;
  const void* k;  // [keys, dim] (a [keys, 1, dim] input has its head axis dropped)
  int64_t k_row_stride;
  int64_t k_dim_stride;  // 1 on the native path

  MetaPtr row_starts;  // [rows], inclusive first visible key
  int64_t row_starts_stride;
  MetaPtr row_ends;  // [rows], exclusive end of the visible keys
  int64_t row_ends_stride;

  float scale;  // multiplier

  float* out;  // [rows, keys], FP32
  int64_t out_row_stride;
  int64_t out_col_stride;

  StreamHandle stream;
};

// qsa_mqa_decode, row r < rows of request b:
//   out[b * rows + r, c] = scale * sum_h ReLU(q[b, r, h, :] . k_cache[page, c % page_size, :])
//   with page = page_table[b, c / page_size], for every c in [0, max_model_len); -inf when
//   c >= context_lens[b, r], c / page_size >= max_pages, or page < 0 or >= num_pages.
struct MqaDecodeParams {
  DType dtype;    // of q: kBF16 or kF16
  DType k_dtype;  // of k_cache: `dtype`, or kF8E4M3 (used unscaled)
  int64_t batch;
  int64_t rows;  // query rows per request R (multi-token decode); native: 1..4
  int64_t heads;
  int64_t dim;
  // [batch, rows, heads, dim] (a [batch, heads, dim] input has rows == 1 and q_row_stride 0).
  // Any stride may be 0: decode accepts broadcast queries, so the native path must not assume
  // unit/aligned strides.
  const void* q;
  int64_t q_batch_stride;
  int64_t q_row_stride;
  int64_t q_head_stride;
  int64_t q_dim_stride;

  const void* k_cache;  // [num_pages, page_size, dim] (a [.., 1, dim] cache drops its head axis)
  int64_t k_page_stride;
  int64_t k_slot_stride;
  int64_t k_dim_stride;
  int64_t num_pages;
  int64_t page_size;  // any positive size

  MetaPtr page_table;  // [batch, max_pages], -1 = no page
  int64_t page_table_batch_stride;
  int64_t page_table_page_stride;
  int64_t max_pages;

  // [batch] (rows == 1) or [batch, rows]: visible compressed keys of each query row; <= 0 is a
  // padding row (all -inf, no key read).
  MetaPtr context_lens;
  int64_t context_lens_batch_stride;
  int64_t context_lens_row_stride;  // 0 for a [batch] tensor

  int64_t max_model_len;  // output width; every column is written
  float scale;            // multiplier

  float* out;  // [batch * rows, max_model_len], FP32: request b's row r is out row b * rows + r
  int64_t out_row_stride;
  int64_t out_col_stride;

  StreamHandle stream;
};

// Native (CUDA) entry points. A CUDA build defines them in src/cuda; a CPU-only build defines
// them to raise NotSupportedError (src/api/qsa_indexer_native_cpu_only.cpp). The API has already
// checked everything the native path requires of the *call* (CUDA tensors, heads == 4,
// dim == 128, the vector-load layout of score/prefill inputs, decode rows <= 4); the launchers
// must accept every params value those checks let through, including each form of
// MqaScoreParams (padded/varlen queries, logical/paged keys) and zero-sized dimensions.
void native_mqa_score(const MqaScoreParams& params);
void native_mqa_prefill(const MqaPrefillParams& params);
void native_mqa_decode(const MqaDecodeParams& params);

}  // namespace sparse_attn::detail
