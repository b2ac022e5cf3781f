#include "reference/qsa_select_ref.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <vector>

namespace sparse_attn::detail {
namespace {

// Tokens per QSA block: block b covers tokens 4b .. 4b + 3.
constexpr int64_t kBlockTokens = 4;

struct Candidate {
  float score;
  int32_t id;
};

}  // namespace

void reference_topk_blocks(const TopkBlocksParams& p) {
  const int64_t total_rows = p.batch * p.rows;
#pragma omp parallel
  {
    std::vector<Candidate> visible;
#pragma omp for schedule(dynamic, 16)
    for (int64_t r = 0; r < total_rows; ++r) {
      const int64_t b = r / p.rows;
      const int64_t i = r % p.rows;
      const float* row = p.scores + b * p.scores_batch_stride + i * p.scores_row_stride;
      int32_t* out = p.out + b * p.out_batch_stride + i * p.out_row_stride;
      visible.clear();
      for (int64_t j = 0; j < p.num_blocks; ++j) {
        const float s = row[j * p.scores_col_stride];
        if (std::isfinite(s)) visible.push_back({s, static_cast<int32_t>(j)});
      }
      // A strict total order (score descending, then id ascending) makes the result
      // independent of the sort algorithm.
      const auto before = [](const Candidate& a, const Candidate& c) {
        return a.score > c.score || (a.score == c.score && a.id < c.id);
      };
      const auto kept = std::min<int64_t>(p.k, static_cast<int64_t>(visible.size()));
      std::partial_sort(visible.begin(), visible.begin() + kept, visible.end(), before);
      for (int64_t j = 0; j < p.k; ++j) out[j * p.out_col_stride] = j < kept ? visible[j].id : -1;
    }
  }
}

void reference_expand_blocks(const ExpandBlocksParams& p) {
  const int64_t total_rows = p.batch * p.rows;
  const int64_t width = kBlockTokens * p.k + kBlockTokens - 1;
#pragma omp parallel for schedule(dynamic, 16)
  for (int64_t r = 0; r < total_rows; ++r) {
    const int64_t b = r / p.rows;
    const int64_t i = r % p.rows;
    const MetaPtr ids = p.block_ids + (b * p.block_ids_batch_stride + i * p.block_ids_row_stride);
    // The outputs hold int32 token ids, so an int64 position past INT32_MAX reads as INT32_MAX.
    const int64_t pos = std::min<int64_t>(
        p.query_positions[b * p.query_positions_batch_stride + i * p.query_positions_row_stride],
        INT32_MAX);
    int32_t* tokens =
        p.token_indices + b * p.token_indices_batch_stride + i * p.token_indices_row_stride;
    int32_t* blocks = p.block_indices ? p.block_indices + b * p.block_indices_batch_stride +
                                            i * p.block_indices_row_stride
                                      : nullptr;
    int64_t n_tokens = 0;
    int64_t n_blocks = 0;
    for (int64_t j = 0; j < p.k; ++j) {
      const int64_t id = ids[j * p.block_ids_col_stride];
      if (id < 0 || kBlockTokens * id + kBlockTokens - 1 > pos) continue;
      if (blocks) blocks[n_blocks * p.block_indices_col_stride] = static_cast<int32_t>(id);
      ++n_blocks;
      for (int64_t t = 0; t < kBlockTokens; ++t) {
        tokens[n_tokens++ * p.token_indices_col_stride] =
            static_cast<int32_t>(kBlockTokens * id + t);
      }
    }
    // The incomplete block holding the query: never compressed, so always attended.
    for (int64_t t = kBlockTokens * ((pos + 1) / kBlockTokens); t <= pos; ++t) {
      tokens[n_tokens++ * p.token_indices_col_stride] = static_cast<int32_t>(t);
    }
    for (; n_tokens < width; ++n_tokens) tokens[n_tokens * p.token_indices_col_stride] = -1;
    if (blocks) {
      for (; n_blocks < p.k; ++n_blocks) blocks[n_blocks * p.block_indices_col_stride] = -1;
    }
  }
}

}  // namespace sparse_attn::detail
