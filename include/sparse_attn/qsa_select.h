// QSA selection helpers: the steps between the indexer and sparse attention that the seed leaves
// to callers. qsa_topk_blocks keeps the best-scoring visible blocks of each query row;
// qsa_expand_blocks turns them into the token_indices (and block_indices hint) that
// qsa_sparse_attention takes. docs/qsa.md ("## Selection helpers") states the exact rules.
//
// Host tensors run on the CPU (OpenMP over rows); CUDA tensors run native CUDA kernels on
// `stream` (nullptr: the legacy default stream), asynchronously, with no host staging and no
// allocation except for selections above 16384 blocks per row (see docs/qsa.md). Both give the
// same ids, bit for bit.
#pragma once

#include <cstdint>
#include <optional>

#include "sparse_attn/common.h"
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

}  // namespace sparse_attn
