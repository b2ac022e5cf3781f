// The native top-k of QSA's selection, in the kernel's own terms: qsa_topk_blocks on a score
// matrix, and the fused selections (qsa_indexer_select, qsa_mqa_decode_select) on a chunk of
// scores their score kernel wrote, with the expansion to token ids done in the same kernel.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace sparse_attn::cuda::select {

// What a score kernel records of each row it scores for a fused selection: the visible
// columns [lo, hi) (the only ones it writes: the rest of the row's scratch is never read) and
// the row's token position, or -1 for a padding row.
struct RowWindow {
  int32_t lo, hi, pos, unused;
};

// Strides in elements. Row r of [row_begin, row_end) reads its scores at local row
// l = r - row_begin: scores + (l / score_rows) * scores_batch_stride + (l % score_rows) *
// scores_row_stride; outputs are at flattened row r: (r / rows) * batch + (r % rows) * row.
struct TopkProblem {
  int64_t row_begin, row_end;
  int64_t rows;        // rows per batch entry of the outputs
  int64_t score_rows;  // rows per batch entry of the scores
  int64_t num_blocks;  // score columns, at most INT32_MAX
  int64_t k;

  const float* scores;
  int64_t scores_batch_stride, scores_row_stride, scores_col_stride;
  // [row_end - row_begin], by local row; nullable: every row sees [0, num_blocks). Columns
  // outside a row's window are invisible whatever the scores hold there.
  const RowWindow* windows;

  int32_t* out;  // [.., k] block ids
  int64_t out_batch_stride, out_row_stride, out_col_stride;
  // [.., 4k + 3], nullable (needs windows: their positions): qsa_expand_blocks of the row.
  int32_t* tokens;
  int64_t tokens_batch_stride, tokens_row_stride, tokens_col_stride;
  int32_t* counts;  // [..], nullable (needs windows): entries >= 0 of the row's tokens
  int64_t counts_batch_stride, counts_row_stride;
};

// Largest selection sorted in shared memory; larger ones need a global sort buffer
// (topk_global_sort_bytes).
inline constexpr int64_t kTopkMaxSharedSort = 16384;

// Global sort scratch for this problem on `device` (0 when it sorts in shared memory).
size_t topk_global_sort_bytes(const TopkProblem& problem, int device);

// Enqueues the selection on `stream`; `global_sort` holds topk_global_sort_bytes bytes (or is
// null when they are 0). No allocation, no host synchronisation, no read of device memory.
// `programmatic`: launched as a programmatic dependent of the stream's previous kernel (the
// decode score kernel, which triggers at its start), so the top-k's CTAs are scheduled while
// it runs and wait for its results in cudaGridDependencySynchronize: no launch gap between
// the two.
void launch_topk(const TopkProblem& problem, void* global_sort, int device, cudaStream_t stream,
                 bool programmatic = false);

}  // namespace sparse_attn::cuda::select
