#include "reference/qsa_select_ref.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <vector>

#include "reference/qsa_indexer_ref.h"
#include "sparse_attn/dtype.h"

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

// ---------------------------------------------------------------------------------------
// Fused selections
// ---------------------------------------------------------------------------------------

namespace {

// Where the selection of row (b, r) of a [batch, rows] grid of query rows goes: element j of it
// at ptr + b * batch_stride + r * row_stride + j * col_stride (no column for valid_counts).
struct GridOut {
  int32_t* ptr;
  int64_t batch_stride, row_stride, col_stride;

  int32_t* at(int64_t b, int64_t r) const { return ptr + b * batch_stride + r * row_stride; }
};

// The outputs of a selection on the grid: `rows_flat` says that the outputs' rows are the
// grid's flattened rows b * rows + r (decode, varlen), not [batch, rows] (padded).
struct GridOutputs {
  GridOut block_ids, token_indices, valid_counts;  // ptr null: not wanted
  int64_t k;
};

GridOutputs grid_outputs(const SelectOutputs& s, int64_t rows, bool rows_flat) {
  auto grid = [&](int32_t* ptr, int64_t batch_stride, int64_t row_stride, int64_t col_stride) {
    return GridOut{ptr, rows_flat ? rows * row_stride : batch_stride, row_stride, col_stride};
  };
  return {
      grid(s.block_ids, s.block_ids_batch_stride, s.block_ids_row_stride, s.block_ids_col_stride),
      grid(s.token_indices, s.token_indices_batch_stride, s.token_indices_row_stride,
           s.token_indices_col_stride),
      grid(s.valid_counts, s.valid_counts_batch_stride, s.valid_counts_row_stride, 0), s.k};
}

// Rows per chunk: as many as have their FP32 scores [n, num_blocks] within `budget` (the API
// checked that one row's fit), at least one, at most `total`.
int64_t chunk_rows(size_t budget, int64_t num_blocks, int64_t total) {
  if (num_blocks == 0 || total == 0) return std::max<int64_t>(total, 1);
  const size_t fit = budget / (sizeof(float) * static_cast<size_t>(num_blocks));
  return std::clamp<int64_t>(static_cast<int64_t>(std::min<size_t>(fit, INT64_MAX)), 1, total);
}

// Visits a [batch, rows] grid in row-major order in chunks of at most max_rows rows: whole
// requests while one fits (r0 = 0, nr = rows), else rows of one request (nb = 1). Either way a
// chunk is the sub-grid [b0, b0 + nb) x [r0, r0 + nr), whose inputs (queries, keys) lie at
// uniform strides, as the score ops' params need.
template <class Fn>
void for_each_chunk(int64_t batch, int64_t rows, int64_t max_rows, Fn fn) {
  if (rows == 0) return;
  const int64_t nr = std::min(rows, max_rows);
  const int64_t nb = std::max<int64_t>(max_rows / rows, 1);
  for (int64_t b0 = 0; b0 < batch; b0 += nb) {
    for (int64_t r0 = 0; r0 < rows; r0 += nr) {
      fn(b0, std::min(nb, batch - b0), r0, std::min(nr, rows - r0));
    }
  }
}

// Entries >= 0 of a row's expansion (reference_expand_blocks): four per kept block, then the
// tail of the block holding the position.
int32_t expanded_count(const int32_t* ids, int64_t col_stride, int64_t k, int64_t pos) {
  pos = std::min<int64_t>(pos, INT32_MAX);  // as the expansion reads it
  int64_t n = 0;
  for (int64_t j = 0; j < k; ++j) {
    const int64_t id = ids[j * col_stride];
    if (id >= 0 && kBlockTokens * id + kBlockTokens - 1 <= pos) n += kBlockTokens;
  }
  if (pos >= 0) n += pos - kBlockTokens * ((pos + 1) / kBlockTokens) + 1;
  return static_cast<int32_t>(n);  // at most 4k + 3, which the API keeps within int32
}

// The selection of the chunk [b0, b0 + nb) x [r0, r0 + nr) from its scores [nb, nr, num_blocks]
// (contiguous) and positions [nb, nr] (-1 for a padding row; read only for tokens and counts).
void select_chunk(const GridOutputs& o, int64_t b0, int64_t nb, int64_t r0, int64_t nr,
                  const float* scores, int64_t num_blocks, const int64_t* positions) {
  TopkBlocksParams t{};
  t.batch = nb;
  t.rows = nr;
  t.num_blocks = num_blocks;
  t.k = o.k;
  t.scores = scores;
  t.scores_batch_stride = nr * num_blocks;
  t.scores_row_stride = num_blocks;
  t.scores_col_stride = 1;
  t.out = o.block_ids.at(b0, r0);
  t.out_batch_stride = o.block_ids.batch_stride;
  t.out_row_stride = o.block_ids.row_stride;
  t.out_col_stride = o.block_ids.col_stride;
  reference_topk_blocks(t);
  if (o.token_indices.ptr) {
    ExpandBlocksParams e{};
    e.batch = nb;
    e.rows = nr;
    e.k = o.k;
    e.block_ids = MetaPtr(t.out, DType::kI32);
    e.block_ids_batch_stride = t.out_batch_stride;
    e.block_ids_row_stride = t.out_row_stride;
    e.block_ids_col_stride = t.out_col_stride;
    e.query_positions = MetaPtr(positions, DType::kI64);
    e.query_positions_batch_stride = nr;
    e.query_positions_row_stride = 1;
    e.token_indices = o.token_indices.at(b0, r0);
    e.token_indices_batch_stride = o.token_indices.batch_stride;
    e.token_indices_row_stride = o.token_indices.row_stride;
    e.token_indices_col_stride = o.token_indices.col_stride;
    reference_expand_blocks(e);
  }
  if (o.valid_counts.ptr) {
    for (int64_t bi = 0; bi < nb; ++bi) {
      for (int64_t ri = 0; ri < nr; ++ri) {
        *o.valid_counts.at(b0 + bi, r0 + ri) = expanded_count(
            o.block_ids.at(b0 + bi, r0 + ri), o.block_ids.col_stride, o.k, positions[bi * nr + ri]);
      }
    }
  }
}

const void* element(const void* base, DType dtype, int64_t offset) {
  return static_cast<const char*>(base) + offset * static_cast<int64_t>(dtype_size(dtype));
}

}  // namespace

void host_indexer_select(const IndexerSelectParams& p, ScoreFn score) {
  const MqaScoreParams& s = p.score;
  // read_score_rows builds no row for a score matrix without columns (its rows need not be
  // backed by memory); the selection's outputs always are (k >= 1), so the rows are those of
  // the same call with one column. This also checks the metadata contents, before any write.
  MqaScoreParams with_columns = s;
  with_columns.num_blocks = std::max<int64_t>(s.num_blocks, 1);
  const std::vector<ScoreRow> rows = read_score_rows(with_columns);
  // The grid: padded [batch, q_len]; varlen one run of q_len rows.
  const int64_t batch = s.varlen ? 1 : s.batch;
  const GridOutputs out = grid_outputs(p.select, s.q_len, s.varlen);
  const int64_t max_rows = chunk_rows(p.select.max_workspace_bytes, s.num_blocks, batch * s.q_len);
  std::vector<float> scores(static_cast<size_t>(max_rows * s.num_blocks));
  std::vector<int64_t> req(static_cast<size_t>(max_rows)), pos(static_cast<size_t>(max_rows));
  for_each_chunk(batch, s.q_len, max_rows, [&](int64_t b0, int64_t nb, int64_t r0, int64_t nr) {
    // The chunk as a score call of its own: its rows' requests and positions made explicit
    // (request -1 / position -1: a padding row), so that each row scores as in the whole call.
    for (int64_t bi = 0; bi < nb; ++bi) {
      for (int64_t ri = 0; ri < nr; ++ri) {
        const ScoreRow& row = rows[(b0 + bi) * s.q_len + r0 + ri];
        req[bi * nr + ri] = row.valid ? row.req : -1;
        pos[bi * nr + ri] = row.valid ? row.pos : -1;
      }
    }
    MqaScoreParams c = s;
    c.seq_lens_q = {};
    c.cu_seqlens_q = {};
    if (s.varlen) {
      c.q_len = nr;
      c.q = element(s.q, s.dtype, r0 * s.q_row_stride);
      c.token_to_req = MetaPtr(req.data(), DType::kI64);
      c.token_to_req_stride = 1;
    } else {
      c.batch = nb;
      c.q_len = nr;
      c.q = element(s.q, s.dtype, b0 * s.q_batch_stride + r0 * s.q_row_stride);
      if (s.block_table) {
        c.block_table = s.block_table + b0 * s.block_table_batch_stride;
      } else {
        c.k = element(s.k, s.k_dtype, b0 * s.k_batch_stride);
      }
    }
    c.query_positions = MetaPtr(pos.data(), DType::kI64);
    c.query_positions_batch_stride = s.varlen ? 0 : nr;
    c.query_positions_row_stride = 1;
    c.out = scores.data();
    c.out_batch_stride = s.varlen ? 0 : nr * s.num_blocks;
    c.out_row_stride = s.num_blocks;
    c.out_col_stride = 1;
    score(c);
    select_chunk(out, b0, nb, r0, nr, scores.data(), s.num_blocks, pos.data());
  });
}

void host_decode_select(const DecodeSelectParams& p, DecodeScoreFn score) {
  const MqaDecodeParams& s = p.score;
  const GridOutputs out = grid_outputs(p.select, s.rows, true);
  const int64_t max_rows =
      chunk_rows(p.select.max_workspace_bytes, s.max_model_len, s.batch * s.rows);
  std::vector<float> scores(static_cast<size_t>(max_rows * s.max_model_len));
  std::vector<int64_t> lens(static_cast<size_t>(max_rows)), pos(static_cast<size_t>(max_rows));
  for_each_chunk(s.batch, s.rows, max_rows, [&](int64_t b0, int64_t nb, int64_t r0, int64_t nr) {
    // A padding row (context_lens <= 0 or a negative position) scores as a count of 0: all
    // -inf, no block selected, and its position -1 expands to nothing.
    for (int64_t bi = 0; bi < nb; ++bi) {
      for (int64_t ri = 0; ri < nr; ++ri) {
        const int64_t b = b0 + bi, r = r0 + ri;
        const int64_t len =
            s.context_lens[b * s.context_lens_batch_stride + r * s.context_lens_row_stride];
        const int64_t qp = p.query_positions
                               ? p.query_positions[b * p.query_positions_batch_stride +
                                                   r * p.query_positions_row_stride]
                               : 0;
        const bool padding = len <= 0 || qp < 0;
        lens[bi * nr + ri] = padding ? 0 : len;
        pos[bi * nr + ri] = padding ? -1 : qp;
      }
    }
    MqaDecodeParams c = s;
    c.batch = nb;
    c.rows = nr;
    c.q = element(s.q, s.dtype, b0 * s.q_batch_stride + r0 * s.q_row_stride);
    c.page_table = s.page_table + b0 * s.page_table_batch_stride;
    c.context_lens = MetaPtr(lens.data(), DType::kI64);
    c.context_lens_batch_stride = nr;
    c.context_lens_row_stride = 1;
    c.out = scores.data();
    c.out_row_stride = s.max_model_len;
    c.out_col_stride = 1;
    score(c);
    select_chunk(out, b0, nb, r0, nr, scores.data(), s.max_model_len, pos.data());
  });
}

void reference_indexer_select(const IndexerSelectParams& p) {
  host_indexer_select(p, reference_mqa_score);
}

void reference_decode_select(const DecodeSelectParams& p) {
  host_decode_select(p, reference_mqa_decode);
}

}  // namespace sparse_attn::detail
