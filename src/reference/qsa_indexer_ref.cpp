#include "reference/qsa_indexer_ref.h"

#include <algorithm>
#include <limits>
#include <vector>

#include "api/check.h"
#include "sparse_attn/dtype.h"

namespace sparse_attn::detail {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// Tokens per compressed key: key b covers tokens 4b .. 4b + 3.
constexpr int64_t kBlockTokens = 4;

// sum_h ReLU(q[h, :] . k[:]) in FP32; q_row/k_row point at element [0, 0] / [0] of a q of
// `q_dtype` and a key of `k_dtype` (FP8 keys are used as stored: they carry no scale).
float relu_head_sum(const void* q_row, int64_t q_head_stride, int64_t q_dim_stride,
                    const void* k_row, int64_t k_dim_stride, int64_t heads, int64_t dim,
                    DType q_dtype, DType k_dtype) {
  float total = 0.f;
  for (int64_t h = 0; h < heads; ++h) {
    float dot = 0.f;
    for (int64_t d = 0; d < dim; ++d) {
      dot += load_as_float(q_row, q_dtype, h * q_head_stride + d * q_dim_stride) *
             load_as_float(k_row, k_dtype, d * k_dim_stride);
    }
    total += std::max(dot, 0.f);
  }
  return total;
}

const void* offset(const void* base, DType dtype, int64_t elements) {
  return static_cast<const char*>(base) + elements * static_cast<int64_t>(dtype_size(dtype));
}

// Checks the metadata contents the rows are resolved from (request lengths, offsets, request
// ids). Allocates nothing: q_len comes from q_idx, which may be a broadcast view of any size,
// so nothing sized by it is built before these checks pass.
void check_score_metadata(const MqaScoreParams& p) {
  if (!p.varlen) {
    if (!p.seq_lens_q) return;
    for (int64_t b = 0; b < p.batch; ++b) {
      const int64_t valid_rows = p.seq_lens_q[b * p.seq_lens_q_stride];
      if (valid_rows < 0 || valid_rows > p.q_len) {
        throw_value_error(
            "seq_lens_q: expected values in [0, {}] (q_idx.shape[1]), got "
            "seq_lens_q[{}] = {}",
            p.q_len, b, valid_rows);
      }
    }
    return;
  }
  if (p.cu_seqlens_q) {
    auto cu = [&](int64_t r) -> int64_t { return p.cu_seqlens_q[r * p.cu_seqlens_q_stride]; };
    if (cu(0) != 0 || cu(p.batch) != p.q_len) {
      throw_value_error("cu_seqlens_q: expected offsets from 0 to total_q = {}, got {} .. {}",
                        p.q_len, cu(0), cu(p.batch));
    }
    for (int64_t r = 0; r < p.batch; ++r) {
      if (cu(r + 1) < cu(r)) {
        throw_value_error(
            "cu_seqlens_q: expected non-decreasing offsets, got cu_seqlens_q[{}] = "
            "{} > cu_seqlens_q[{}] = {}",
            r, cu(r), r + 1, cu(r + 1));
      }
    }
    return;
  }
  for (int64_t row = 0; row < p.q_len; ++row) {
    const int64_t r = p.token_to_req[row * p.token_to_req_stride];
    if (r != -1 && (r < 0 || r >= p.batch)) {
      throw_value_error(
          "token_to_req: expected request ids in [0, {}) (num_requests) or -1 (a padding row), "
          "got token_to_req[{}] = {}",
          p.batch, row, r);
    }
  }
}

}  // namespace

std::vector<ScoreRow> read_score_rows(const MqaScoreParams& p) {
  check_score_metadata(p);
  std::vector<ScoreRow> rows;
  if (p.num_blocks == 0) return rows;
  if (!p.varlen) {
    for (int64_t b = 0; b < p.batch; ++b) {
      const int64_t valid_rows = p.seq_lens_q ? p.seq_lens_q[b * p.seq_lens_q_stride] : p.q_len;
      for (int64_t i = 0; i < p.q_len; ++i) {
        const int64_t pos = p.query_positions
                                ? p.query_positions[b * p.query_positions_batch_stride +
                                                    i * p.query_positions_row_stride]
                                : i;
        rows.push_back({b, pos, i < valid_rows && pos >= 0,
                        b * p.q_batch_stride + i * p.q_row_stride,
                        b * p.out_batch_stride + i * p.out_row_stride});
      }
    }
    return rows;
  }
  std::vector<int64_t> req(p.q_len);
  std::vector<int64_t> local(p.q_len);  // cu_seqlens_q: the row's index within its request
  if (p.cu_seqlens_q) {
    auto cu = [&](int64_t r) -> int64_t { return p.cu_seqlens_q[r * p.cu_seqlens_q_stride]; };
    // Monotonic from 0 to q_len (checked): every offset lies in [0, q_len].
    for (int64_t r = 0; r < p.batch; ++r) {
      for (int64_t row = cu(r); row < cu(r + 1); ++row) {
        req[row] = r;
        local[row] = row - cu(r);
      }
    }
  } else {
    // -1 or in [0, batch) (checked); validation made token_to_req come with query_positions.
    for (int64_t row = 0; row < p.q_len; ++row)
      req[row] = p.token_to_req[row * p.token_to_req_stride];
  }
  for (int64_t row = 0; row < p.q_len; ++row) {
    const int64_t pos =
        p.query_positions ? p.query_positions[row * p.query_positions_row_stride] : local[row];
    // Request id -1 and a negative position mark a padding row of a graph-padded batch.
    const bool padding = req[row] == -1 || pos < 0;
    rows.push_back(
        {padding ? 0 : req[row], pos, !padding, row * p.q_row_stride, row * p.out_row_stride});
  }
  return rows;
}

void reference_mqa_score(const MqaScoreParams& p) {
  const std::vector<ScoreRow> rows = read_score_rows(p);
  const int64_t n = static_cast<int64_t>(rows.size());
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t i = 0; i < n; ++i) {
    const ScoreRow& row = rows[i];
    const void* q_row = offset(p.q, p.dtype, row.q_off);
    for (int64_t b = 0; b < p.num_blocks; ++b) {
      float& dst = p.out[row.out_off + b * p.out_col_stride];
      dst = kNegInf;
      if (!row.valid || kBlockTokens * b + kBlockTokens - 1 > row.pos) continue;
      int64_t k_off;
      if (p.block_table) {
        const int64_t page = p.block_table[row.req * p.block_table_batch_stride +
                                           (b / p.page_size) * p.block_table_page_stride];
        if (page < 0 || page >= p.num_pages) continue;
        k_off = page * p.k_batch_stride + (b % p.page_size) * p.k_row_stride;
      } else {
        k_off = row.req * p.k_batch_stride + b * p.k_row_stride;
      }
      dst = p.scale * relu_head_sum(q_row, p.q_head_stride, p.q_dim_stride,
                                    offset(p.k, p.k_dtype, k_off), p.k_dim_stride, p.heads, p.dim,
                                    p.dtype, p.k_dtype);
    }
  }
}

void reference_mqa_prefill(const MqaPrefillParams& p) {
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t r = 0; r < p.rows; ++r) {
    const int64_t start = std::max<int64_t>(p.row_starts[r * p.row_starts_stride], 0);
    const int64_t end = std::min<int64_t>(p.row_ends[r * p.row_ends_stride], p.keys);
    const void* q_row = offset(p.q, p.dtype, r * p.q_row_stride);
    for (int64_t j = 0; j < p.keys; ++j) {
      float& dst = p.out[r * p.out_row_stride + j * p.out_col_stride];
      dst = kNegInf;
      if (j < start || j >= end) continue;
      dst = p.scale * relu_head_sum(q_row, p.q_head_stride, p.q_dim_stride,
                                    offset(p.k, p.k_dtype, j * p.k_row_stride), p.k_dim_stride,
                                    p.heads, p.dim, p.dtype, p.k_dtype);
    }
  }
}

void reference_mqa_decode(const MqaDecodeParams& p) {
  // An empty out has nothing to write, and its rows are bounded by no memory (q may broadcast).
  if (p.max_model_len == 0) return;
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t i = 0; i < p.batch * p.rows; ++i) {
    const int64_t b = i / p.rows, r = i % p.rows;  // query row i: row r of request b
    const int64_t context_len =
        p.context_lens[b * p.context_lens_batch_stride + r * p.context_lens_row_stride];
    const void* q_row = offset(p.q, p.dtype, b * p.q_batch_stride + r * p.q_row_stride);
    for (int64_t c = 0; c < p.max_model_len; ++c) {
      float& dst = p.out[i * p.out_row_stride + c * p.out_col_stride];
      dst = kNegInf;
      if (c >= context_len || c / p.page_size >= p.max_pages) continue;
      const int64_t page = p.page_table[b * p.page_table_batch_stride +
                                        (c / p.page_size) * p.page_table_page_stride];
      if (page < 0 || page >= p.num_pages) continue;
      const int64_t k_off = page * p.k_page_stride + (c % p.page_size) * p.k_slot_stride;
      dst = p.scale * relu_head_sum(q_row, p.q_head_stride, p.q_dim_stride,
                                    offset(p.k_cache, p.k_dtype, k_off), p.k_dim_stride, p.heads,
                                    p.dim, p.dtype, p.k_dtype);
    }
  }
}

}  // namespace sparse_attn::detail
