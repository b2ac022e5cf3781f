// Native fused selections (qsa_indexer_select, qsa_mqa_decode_select): the score kernel and the
// top-k kernel, chunk by chunk over the rows, through a scratch bounded by max_workspace_bytes.
//
// Per chunk, the score kernel writes each row's visible columns only, into a packed [rows,
// width] FP32 scratch, and records the row's window (visible columns, position); the top-k
// kernel reads those windows' columns, selects, sorts and expands in the same launch. Nothing
// else is read or written, so a chunk costs the visible scores twice (one write, one read) and
// the causal upper triangle of a prefill costs nothing. Chunks run back to back on the stream:
// the scratch of one is reused by the next.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>

#include "api/qsa_select_params.h"
#include "cuda/common/device_guard.h"
#include "cuda/common/workspace_pool.h"
#include "cuda/indexer/mqa_problem.h"
#include "cuda/select/topk_problem.h"
#include "sparse_attn/errors.h"

namespace sparse_attn {
namespace cuda::select {
namespace {

constexpr size_t kAlign = 256;
constexpr int64_t kRowTile = 64;  // the rows kernel's row tile: chunks are whole tiles

size_t align_up(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

// Score columns of a scratch row: a multiple of 4 floats, so that every row is 16-byte aligned
// for the top-k's vector loads.
int64_t scratch_width(int64_t columns) { return (columns + 3) / 4 * 4; }

// How the rows are cut into chunks, and where a chunk's windows and scores lie in the scratch.
struct ChunkPlan {
  int64_t chunk_rows;  // rows per chunk (the last may be shorter)
  int64_t width;       // scratch row stride, in floats
  size_t bytes;        // scratch for one chunk
};

size_t chunk_bytes(int64_t rows, int64_t width) {
  return align_up(static_cast<size_t>(rows) * sizeof(RowWindow)) +
         static_cast<size_t>(rows) * static_cast<size_t>(width) * sizeof(float);
}

// `unit` rows move together (a decode request's rows; a score chunk of whole row tiles when
// more than one tile fits). The budget bounds a chunk's FP32 scores (the API's promise), with
// at least one unit a chunk; the windows and the rows' 16-byte padding come on top.
ChunkPlan plan_chunks(int64_t rows, int64_t columns, int64_t unit, size_t budget) {
  ChunkPlan plan{};
  plan.width = scratch_width(columns);
  const size_t unit_scores = static_cast<size_t>(unit) * static_cast<size_t>(columns) * 4;
  const int64_t units =
      unit_scores == 0 ? rows : std::max<int64_t>(1, static_cast<int64_t>(budget / unit_scores));
  plan.chunk_rows = std::min<int64_t>(rows, units * unit);
  plan.bytes = chunk_bytes(plan.chunk_rows, plan.width);
  return plan;
}

struct ChunkScratch {
  RowWindow* windows;
  float* scores;
};

ChunkScratch carve(void* workspace, int64_t chunk_rows) {
  auto* base = static_cast<char*>(workspace);
  return {reinterpret_cast<RowWindow*>(base),
          reinterpret_cast<float*>(base +
                                   align_up(static_cast<size_t>(chunk_rows) * sizeof(RowWindow)))};
}

// The top-k of a chunk's rows [row_begin, row_end), whose outputs are at flattened rows of
// `rows` per batch entry.
TopkProblem chunk_topk(const detail::SelectOutputs& o, int64_t rows, const ChunkScratch& sc,
                       const ChunkPlan& plan, int64_t columns, int64_t row_begin,
                       int64_t row_end) {
  TopkProblem t{};
  t.row_begin = row_begin;
  t.row_end = row_end;
  t.rows = rows;
  t.score_rows = plan.chunk_rows;
  t.num_blocks = columns;
  t.k = o.k;
  t.scores = sc.scores;
  t.scores_row_stride = plan.width;
  t.scores_col_stride = 1;
  t.windows = sc.windows;
  t.out = o.block_ids;
  t.out_batch_stride = o.block_ids_batch_stride;
  t.out_row_stride = o.block_ids_row_stride;
  t.out_col_stride = o.block_ids_col_stride;
  t.tokens = o.token_indices;
  t.tokens_batch_stride = o.token_indices_batch_stride;
  t.tokens_row_stride = o.token_indices_row_stride;
  t.tokens_col_stride = o.token_indices_col_stride;
  t.counts = o.valid_counts;
  t.counts_batch_stride = o.valid_counts_batch_stride;
  t.counts_row_stride = o.valid_counts_row_stride;
  return t;
}

void require_k(const detail::SelectOutputs& o, const char* op) {
  if (o.k < 1 || o.k > detail::kNativeSelectMaxK) {
    throw Error(std::string(op) + ": internal: native path reached with k = " +
                std::to_string(o.k));
  }
}

int64_t score_rows(const detail::MqaScoreParams& p) {
  return p.varlen ? p.q_len : p.batch * p.q_len;
}

ChunkPlan indexer_plan(const detail::IndexerSelectParams& p) {
  const int64_t rows = score_rows(p.score);
  // Whole row tiles per chunk, unless even one tile's scores are over the budget.
  const size_t tile_scores = static_cast<size_t>(kRowTile * p.score.num_blocks) * 4;
  const int64_t unit = tile_scores <= p.select.max_workspace_bytes ? kRowTile : 1;
  return plan_chunks(rows, p.score.num_blocks, std::min(unit, rows), p.select.max_workspace_bytes);
}

ChunkPlan decode_plan(const detail::DecodeSelectParams& p) {
  return plan_chunks(p.score.batch * p.score.rows, p.score.max_model_len, p.score.rows,
                     p.select.max_workspace_bytes);
}

// The caller's workspace, or scratch from the library's pool for the call.
class Workspace {
 public:
  Workspace(const detail::SelectOutputs& o, size_t bytes, cudaStream_t stream) {
    if (o.workspace) {
      ptr_ = o.workspace;
    } else {
      owned_.emplace(bytes, o.device_index, stream);
      ptr_ = owned_->get();
    }
  }
  void* get() const { return ptr_; }

 private:
  std::optional<StreamScratch> owned_;
  void* ptr_ = nullptr;
};

}  // namespace
}  // namespace cuda::select

namespace detail {

namespace sel = cuda::select;
namespace ix = cuda::indexer;

size_t native_indexer_select_workspace_size(const IndexerSelectParams& p) {
  if (sel::score_rows(p.score) == 0) return 0;
  return sel::indexer_plan(p).bytes;
}

void native_indexer_select(const IndexerSelectParams& p) {
  const int64_t rows = sel::score_rows(p.score);
  if (rows == 0) return;
  sel::require_k(p.select, "qsa_indexer_select");
  cuda::DeviceGuard guard(p.select.device_index);
  const auto stream = static_cast<cudaStream_t>(p.score.stream);
  const int64_t columns = p.score.num_blocks;
  const sel::ChunkPlan plan = sel::indexer_plan(p);
  const sel::Workspace ws(p.select, plan.bytes, stream);
  const sel::ChunkScratch sc = sel::carve(ws.get(), plan.chunk_rows);
  ix::RowsProblem r = ix::score_problem(p.score);
  r.out = sc.scores;
  r.out_row_stride = plan.width;
  r.out_col_stride = 1;
  r.windows = sc.windows;
  for (int64_t begin = 0; begin < rows; begin += plan.chunk_rows) {
    const int64_t end = std::min(rows, begin + plan.chunk_rows);
    r.row_begin = begin;
    r.num_rows = end;
    ix::launch_rows(r, p.score.dtype, p.score.k_dtype, "qsa_indexer_select", stream);
    sel::launch_topk(sel::chunk_topk(p.select, p.score.q_len, sc, plan, columns, begin, end),
                     nullptr, p.select.device_index, stream);
  }
}

size_t native_decode_select_workspace_size(const DecodeSelectParams& p) {
  if (p.score.batch == 0) return 0;
  return sel::decode_plan(p).bytes;
}

void native_decode_select(const DecodeSelectParams& p) {
  if (p.score.batch == 0) return;
  sel::require_k(p.select, "qsa_mqa_decode_select");
  cuda::DeviceGuard guard(p.select.device_index);
  const auto stream = static_cast<cudaStream_t>(p.score.stream);
  const sel::ChunkPlan plan = sel::decode_plan(p);
  const sel::Workspace ws(p.select, plan.bytes, stream);
  const sel::ChunkScratch sc = sel::carve(ws.get(), plan.chunk_rows);
  const ix::DecodeProblem whole = ix::decode_problem(p.score);
  const int64_t rows_per_req = p.score.rows;
  const int64_t chunk_reqs = plan.chunk_rows / rows_per_req;
  const int64_t total_rows = p.score.batch * rows_per_req;
  for (int64_t b0 = 0; b0 < p.score.batch; b0 += chunk_reqs) {
    const int64_t b1 = std::min(p.score.batch, b0 + chunk_reqs);
    // The chunk's requests as a decode problem of their own (queries are 16-bit).
    ix::DecodeProblem d = whole;
    d.batch = b1 - b0;
    d.q = static_cast<const uint16_t*>(whole.q) + b0 * whole.q_batch_stride;
    d.page_table = whole.page_table + b0 * whole.page_table_batch_stride;
    d.context_lens = whole.context_lens + b0 * whole.context_lens_batch_stride;
    d.query_positions = p.query_positions
                            ? p.query_positions + b0 * p.query_positions_batch_stride
                            : MetaPtr();
    d.query_positions_batch_stride = p.query_positions_batch_stride;
    d.query_positions_row_stride = p.query_positions_row_stride;
    d.out = sc.scores;
    d.out_row_stride = plan.width;
    d.out_col_stride = 1;
    d.windows = sc.windows;
    ix::launch_decode(d, p.score.dtype, p.score.k_dtype, stream);
    sel::launch_topk(sel::chunk_topk(p.select, total_rows, sc, plan, p.score.max_model_len,
                                     b0 * rows_per_req, b1 * rows_per_req),
                     nullptr, p.select.device_index, stream, /*programmatic=*/true);
  }
}

}  // namespace detail
}  // namespace sparse_attn
