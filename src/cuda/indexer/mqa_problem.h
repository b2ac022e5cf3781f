// What the native indexer kernels compute, in the kernels' own terms. mqa_native.cpp turns the
// API's validated params (api/qsa_indexer_params.h) into these; one explicit instantiation per
// element type lives in instantiations/*.cu.
//
// All three ops are  score(row, key) = scale * sum_h ReLU(q[row, h, :] . k[key, :])  over
// 4 heads of 128 features. Prefill and every form of qsa_indexer_mqa_score share one kernel
// ("rows": many query rows against a key range, a visible interval per row); decode, one
// query per request against its paged keys, has its own.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "api/meta_ptr.h"
#include "api/qsa_indexer_params.h"
#include "cuda/select/topk_problem.h"

namespace sparse_attn::cuda::indexer {

inline constexpr int kHeads = 4;          // indexer heads: QSA's only native geometry
inline constexpr int kDim = 128;          // features per head and per compressed key
inline constexpr int kMaxDecodeRows = 4;  // query rows per request in one decode call

// How a flattened query row finds its request, position and visible key interval.
enum class RowMode : int {
  kPrefill,    // one request; keys [row_starts[r], row_ends[r])
  kPadded,     // q [batch, q_len]: row r is request r / q_len, index r % q_len
  kVarlenCu,   // q [total_q]: request found in cu_seqlens_q [batch + 1]
  kVarlenTok,  // q [total_q]: request token_to_req[r], position query_positions[r] (required)
};

// Strides in elements. Rows whose request metadata is broken (ids out of range, a row
// outside every cu_seqlens interval) are all -inf; nothing is read out of bounds.
struct RowsProblem {
  RowMode mode;
  int64_t num_rows;  // flattened query rows (padded: batch * q_len)
  int64_t q_len;     // padded: rows per request; otherwise unused
  int64_t batch;     // requests (score forms); 1 for prefill

  const void* q;  // rows of [heads, dim], 16-byte aligned rows and heads, unit feature stride
  int64_t q_batch_stride;  // padded only
  int64_t q_row_stride;
  int64_t q_head_stride;

  // kPrefill: [num_rows] each; visible keys [max(start, 0), min(end, num_keys)).
  MetaPtr row_starts;
  int64_t row_starts_stride;
  MetaPtr row_ends;
  int64_t row_ends_stride;

  // Score forms: visible keys b with 4b + 3 <= position (block_size 4).
  MetaPtr cu_seqlens_q;  // kVarlenCu: [batch + 1]
  int64_t cu_seqlens_q_stride;
  MetaPtr token_to_req;  // kVarlenTok: [num_rows]
  int64_t token_to_req_stride;
  MetaPtr query_positions;  // nullable; padded [batch, q_len], varlen [num_rows]
  int64_t query_positions_batch_stride;
  int64_t query_positions_row_stride;
  MetaPtr seq_lens_q;  // nullable, padded only: [batch] valid rows per request
  int64_t seq_lens_q_stride;

  // Keys: logical k [batch, num_keys, dim] (prefill: batch 1, batch stride 0), or, with a
  // block table, a paged cache [num_pages, page_size, dim]; pages < 0 or >= num_pages give
  // -inf columns.
  int64_t num_keys;        // output width
  const void* k;           // of the key element type; 16-byte aligned rows, unit stride
  int64_t k_batch_stride;  // logical: per request; paged: per page
  int64_t k_row_stride;    // logical: per key; paged: per slot
  MetaPtr block_table;     // nullable: [batch, max_pages]
  int64_t block_table_batch_stride;
  int64_t block_table_page_stride;
  int64_t page_size;
  int64_t num_pages;

  float scale;
  float* out;                // FP32; element (row, key) at row offset + key * out_col_stride
  int64_t out_batch_stride;  // padded only
  int64_t out_row_stride;
  int64_t out_col_stride;

  // A chunk of a fused selection: rows [row_begin, num_rows) only (0 otherwise). With
  // `windows` (nullable: the score ops), row r's scores go to out + (r - row_begin) *
  // out_row_stride, only its visible columns are written (the top-k reads no other), and
  // windows[r - row_begin] records them and the row's position.
  int64_t row_begin;
  select::RowWindow* windows;
};

// Decode: R query rows per request (multi-token decode), each against the request's paged keys.
struct DecodeProblem {
  int64_t batch;
  int rows;       // R, 1..kMaxDecodeRows: request b's row r is output row b * R + r
  const void* q;  // [batch, rows, heads, dim], any strides (broadcast allowed)
  int64_t q_batch_stride;
  int64_t q_row_stride;
  int64_t q_head_stride;
  int64_t q_dim_stride;

  const void* k_cache;  // [num_pages, page_size, dim] of the key element type
  int64_t k_page_stride;
  int64_t k_slot_stride;
  int64_t k_dim_stride;
  int64_t num_pages;
  int page_size;  // any size, clamped to INT32_MAX (columns are below 2^31: one page)

  MetaPtr page_table;  // [batch, max_pages], -1 = no page
  int64_t page_table_batch_stride;
  int64_t page_table_page_stride;
  int64_t max_pages;

  MetaPtr context_lens;  // [batch, rows] visible keys per row (row stride 0 for a [batch] one)
  int64_t context_lens_batch_stride;
  int64_t context_lens_row_stride;

  int64_t max_model_len;
  float scale;
  float* out;  // [batch * rows, max_model_len]
  int64_t out_row_stride;
  int64_t out_col_stride;

  // A chunk of a fused selection (nullable: the score op): windows[b * rows + r] records the
  // visible columns [0, min(context, max_model_len, table)) of request b's row r and its
  // position (query_positions[b, r]; -1 where that is null or the row is padding); columns no
  // row of the request sees are not written.
  select::RowWindow* windows;
  MetaPtr query_positions;  // [batch, rows], nullable
  int64_t query_positions_batch_stride;
  int64_t query_positions_row_stride;
};

// T: the query's __nv_bfloat16 or __half; KV: the keys' element type, T or __nv_fp8_e4m3 (used
// unscaled). Enqueue on `stream`; no host synchronisation, no allocation and no read of device
// memory, so both are safe under CUDA graph capture.
template <typename T, typename KV>
void launch_mqa_rows(const RowsProblem& problem, cudaStream_t stream);
template <typename T, typename KV>
void launch_mqa_decode(const DecodeProblem& problem, cudaStream_t stream);

// mqa_native.cpp: the problems of the score ops' params (the fused selections adjust them per
// chunk), and the launches with the one runtime-to-template dispatch of the element types.
RowsProblem score_problem(const detail::MqaScoreParams& params);
DecodeProblem decode_problem(const detail::MqaDecodeParams& params);
void launch_rows(const RowsProblem& problem, DType dtype, DType k_dtype, const char* op,
                 cudaStream_t stream);
void launch_decode(const DecodeProblem& problem, DType dtype, DType k_dtype, cudaStream_t stream);

}  // namespace sparse_attn::cuda::indexer
