// QSA selection helpers: the steps between the indexer and sparse attention that the seed leaves
// to callers. qsa_topk_blocks keeps the best-scoring visible blocks of each query row;
// qsa_expand_blocks turns them into the token_indices (and block_indices hint) that
// qsa_sparse_attention takes. docs/qsa.md ("## Selection helpers") states the exact rules.
//
// Host tensors run on the CPU (OpenMP over rows); CUDA tensors run native CUDA kernels on
// `stream` (nullptr: the legacy default stream), asynchronously, with no host staging and no
// allocation except for selections above 16384 blocks per row (see docs/qsa.md). Both give the
// same ids, bit for bit.
//
// The fused selections (qsa_indexer_select, qsa_mqa_decode_select, at the end) take a score
// op's arguments and return what qsa_topk_blocks (and qsa_expand_blocks) give on its scores,
// without the full FP32 score matrix (docs/qsa.md, "Fused selection").
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>

#include "sparse_attn/common.h"
#include "sparse_attn/qsa.h"
#include "sparse_attn/tensor.h"

namespace sparse_attn {

// The QSA model keeps 512 blocks per query row (2048 in its long-context configuration).
inline constexpr int64_t kQsaTopkBlocks = 512;

// scores: FP32 [rows, N_B] or [B, Q, N_B], as qsa_indexer_mqa_score / qsa_mqa_decode write them.
// Returns scores.shape[:-1] + [k].
Shape qsa_topk_blocks_shape(const TensorView& scores, int64_t k = kQsaTopkBlocks);

// Per row, the ids of the k highest finite scores (a block is visible iff its score is finite:
// -inf, +inf and NaN are never selected), in descending score order, ties broken by the lower
// block id. Fewer than k visible blocks: all of them, then -1. Any k >= 1; k > N_B pads with -1.
// out: int32 with the shape above, positive strides, not overlapping scores.
void qsa_topk_blocks(const TensorView& scores, int64_t k, const TensorView& out,
                     StreamHandle stream = nullptr);

// block_ids: int [rows, k] or [B, Q, k] (e.g. qsa_topk_blocks' output); "int" is int32 or
// int64, read as stored.
// Returns block_ids.shape[:-1] + [4 * k + 3] (2051 for k = 512).
Shape qsa_expand_blocks_token_shape(const TensorView& block_ids);

// Expands selected blocks to request-local token ids for a query row at position
// p = query_positions[row] (int, block_ids.shape[:-1]; an int64 p above INT32_MAX reads as
// INT32_MAX, since the outputs hold int32 token ids):
//   block id b is kept iff b >= 0 and 4b + 3 <= p (a complete block at or before the query);
//   token_indices[row] = 4b, 4b+1, 4b+2, 4b+3 for each kept b in input order, then the tail of
//   the incomplete current block 4 * ((p + 1) / 4) .. p (0 to 3 tokens; none when p < 0),
//   then -1 up to the width 4k + 3;
//   block_indices[row] (optional, int32 block_ids.shape) = the kept ids in input order, then -1.
// Ids are not deduplicated (qsa_topk_blocks never repeats one). Outputs: positive strides, no
// overlap with the inputs or each other.
void qsa_expand_blocks(const TensorView& block_ids, const TensorView& query_positions,
                       const TensorView& token_indices,
                       const std::optional<TensorView>& block_indices = std::nullopt,
                       StreamHandle stream = nullptr);

// ---------------------------------------------------------------------------------------
// Fused selection: scores, top-k and (optionally) expansion in one op
// ---------------------------------------------------------------------------------------

// The default scratch budget of the fused selections (SelectOptions::max_workspace_bytes).
inline constexpr size_t kQsaSelectWorkspaceBytes = size_t{1} << 30;

// A padding row of a fused selection (the score op's padding rows; in decode also a row with
// context_lens <= 0 or a negative query position) gets block ids -1, token_indices all -1 and
// a valid count of 0. "rows.." below is the score op's row shape: [B, Q] (padded q_idx),
// [total_q] (varlen q_idx) or [B * R] (decode).
struct SelectOptions {
  // int32 [rows.., 4k + 3]: when given, the selection expanded as qsa_expand_blocks does at
  // each row's position; padding rows all -1.
  std::optional<TensorView> token_indices;
  // int32 [rows..]: when given, the number of entries >= 0 in each row's token_indices (written
  // whether or not token_indices is given).
  std::optional<TensorView> valid_counts;
  // Decode only: int [B, R] (or [B] when R == 1): the token position of each query row;
  // required by token_indices / valid_counts in qsa_mqa_decode_select; a ValueError in
  // qsa_indexer_select (whose positions come from IndexerScoreOptions::query_positions).
  std::optional<TensorView> query_positions;
  // The scratch budget: rows are scored and selected in chunks whose FP32 scores fit it. Must
  // hold one row's scores, 4 * N_B bytes (ValueError naming max_workspace_bytes and the
  // minimum otherwise). Every backend chunks by it (the CPU ones allocate that much at most),
  // except that native CUDA decode keeps a request's R rows in one chunk.
  size_t max_workspace_bytes = kQsaSelectWorkspaceBytes;
  // Native CUDA: uint8 scratch as SparseAttentionOptions::workspace (one contiguous axis,
  // 16-byte aligned, on the query's device, overlapping no input or output) of at least the
  // *_workspace_size below; omitted: the library's stream-ordered pool. Other backends check it
  // and do not use it.
  std::optional<TensorView> workspace;
};

// q_idx, block_keys, options: as qsa_indexer_mqa_score takes them. Returns the score shape
// qsa_indexer_mqa_score_shape gives, with the last axis k: [B, Q, k] or [total_q, k].
Shape qsa_indexer_select_shape(const TensorView& q_idx, const TensorView& block_keys,
                               int64_t k = kQsaTopkBlocks, const IndexerScoreOptions& options = {});

// Bytes of scratch (select.workspace) that qsa_indexer_select needs for these arguments: 0 for
// the reference backend, host tensors and builds without CUDA; decided on the host from shapes
// and options (the same for every call with the same shapes and options). Raises what the call
// raises for its inputs and options; of the outputs in `select` only their presence counts, and
// select.workspace is ignored.
size_t qsa_indexer_select_workspace_size(const TensorView& q_idx, const TensorView& block_keys,
                                         int64_t k, const IndexerScoreOptions& options = {},
                                         const SelectOptions& select = {});

// Per query row, exactly what qsa_topk_blocks(scores, k) gives on the scores
// qsa_indexer_mqa_score(q_idx, block_keys, options) would write (padding rows: all -1): the
// ids of the k best visible blocks, score descending, ties to the lower id, then -1. k: 1 to
// INT32_MAX (at most (INT32_MAX - 3) / 4 with token_indices or valid_counts; native CUDA: at
// most 16384).
// block_ids: int32 qsa_indexer_select_shape(...). token_indices / valid_counts (select): the
// expansion at each row's position and its count. Every output: positive strides, no two
// elements at one address, no byte shared with an input or another output. Runs on
// options.stream; options.backend chooses native (CUDA kernels, or the CPU backend on host
// tensors) or the reference. Writes nothing when it raises.
void qsa_indexer_select(const TensorView& q_idx, const TensorView& block_keys, int64_t k,
                        const TensorView& block_ids, const IndexerScoreOptions& options = {},
                        const SelectOptions& select = {});

// q: as qsa_mqa_decode takes it. Returns [B * R, k].
Shape qsa_mqa_decode_select_shape(const TensorView& q, int64_t k = kQsaTopkBlocks);

// As qsa_indexer_select_workspace_size, for qsa_mqa_decode_select.
size_t qsa_mqa_decode_select_workspace_size(const TensorView& q, const TensorView& k_cache,
                                            const TensorView& page_table,
                                            const TensorView& context_lens, int64_t max_model_len,
                                            int64_t k, const MqaScoreOptions& options = {},
                                            const SelectOptions& select = {});

// Per query row (request b's row r at row b * R + r), what qsa_topk_blocks(scores, k) gives on
// the scores qsa_mqa_decode(q, k_cache, page_table, context_lens, max_model_len) would write,
// except that a row at a negative select.query_positions is a padding row. k and the outputs
// as in qsa_indexer_select; block_ids int32 [B * R, k]; token_indices / valid_counts need
// select.query_positions. Native CUDA: H == 4, D == 128, R <= 4, as qsa_mqa_decode.
void qsa_mqa_decode_select(const TensorView& q, const TensorView& k_cache,
                           const TensorView& page_table, const TensorView& context_lens,
                           int64_t max_model_len, int64_t k, const TensorView& block_ids,
                           const MqaScoreOptions& options = {}, const SelectOptions& select = {});

}  // namespace sparse_attn
