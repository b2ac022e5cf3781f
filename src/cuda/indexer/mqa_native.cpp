// Native (CUDA) entry points of the QSA indexer ops: the API's validated params become the
// kernels' problems, and the element type becomes a template argument (the one dispatch).
#include <algorithm>
#include <climits>
#include <cstdint>

#include "api/qsa_indexer_params.h"
#include "cuda/common/dispatch.h"
#include "cuda/indexer/mqa_problem.h"
#include "sparse_attn/errors.h"

namespace sparse_attn::cuda::indexer {
namespace {

// The API checks the native geometry and layout before it fills params; these guard the
// kernels' own assumptions should a caller reach them another way.
void require_geometry(const char* op, int heads, int dim) {
  if (heads != kHeads || dim != kDim) {
    throw NotSupportedError(std::string(op) +
                            ": the native kernels take heads x dim = 4 x 128, got " +
                            std::to_string(heads) + " x " + std::to_string(dim));
  }
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Outer strides were checked at the API (only axes longer than one matter, which params do
// not all record); the base pointer and feature stride are what every row relies on.
void require_vector_layout(const char* op, const void* ptr, int64_t dim_stride) {
  if (!aligned16(ptr) || dim_stride != 1) {
    throw Error(std::string(op) +
                ": internal: native path reached with a layout the vector loads cannot read "
                "(vector loads require unit feature stride and 16-byte alignment)");
  }
}

}  // namespace

void launch_rows(const RowsProblem& r, DType dtype, DType k_dtype, const char* op,
                 cudaStream_t stream) {
  dispatch_dtype(dtype, op, [&](auto t) {
    using T = typename decltype(t)::type;
    dispatch_kv_dtype<T>(dtype, k_dtype, op, [&](auto kv) {
      launch_mqa_rows<T, typename decltype(kv)::type>(r, stream);
    });
  });
}

void launch_decode(const DecodeProblem& d, DType dtype, DType k_dtype, cudaStream_t stream) {
  dispatch_dtype(dtype, "qsa_mqa_decode", [&](auto t) {
    using T = typename decltype(t)::type;
    dispatch_kv_dtype<T>(dtype, k_dtype, "qsa_mqa_decode", [&](auto kv) {
      launch_mqa_decode<T, typename decltype(kv)::type>(d, stream);
    });
  });
}

RowsProblem score_problem(const detail::MqaScoreParams& p) {
  require_geometry("qsa_indexer_mqa_score", p.heads, p.dim);
  const int64_t rows = p.varlen ? p.q_len : p.batch * p.q_len;
  require_vector_layout("qsa_indexer_mqa_score", p.q, p.q_dim_stride);
  require_vector_layout("qsa_indexer_mqa_score", p.k, p.k_dim_stride);
  RowsProblem r{};
  r.mode = !p.varlen ? RowMode::kPadded
                     : (p.cu_seqlens_q ? RowMode::kVarlenCu : RowMode::kVarlenTok);
  r.num_rows = rows;
  r.q_len = p.q_len;
  r.batch = p.batch;
  r.q = p.q;
  r.q_batch_stride = p.q_batch_stride;
  r.q_row_stride = p.q_row_stride;
  r.q_head_stride = p.q_head_stride;
  r.cu_seqlens_q = p.cu_seqlens_q;
  r.cu_seqlens_q_stride = p.cu_seqlens_q_stride;
  r.token_to_req = p.token_to_req;
  r.token_to_req_stride = p.token_to_req_stride;
  r.query_positions = p.query_positions;
  r.query_positions_batch_stride = p.query_positions_batch_stride;
  r.query_positions_row_stride = p.query_positions_row_stride;
  r.seq_lens_q = p.seq_lens_q;
  r.seq_lens_q_stride = p.seq_lens_q_stride;
  r.num_keys = p.num_blocks;
  r.k = p.k;
  r.k_batch_stride = p.k_batch_stride;
  r.k_row_stride = p.k_row_stride;
  r.block_table = p.block_table;
  r.block_table_batch_stride = p.block_table_batch_stride;
  r.block_table_page_stride = p.block_table_page_stride;
  r.page_size = p.page_size;
  r.num_pages = p.num_pages;
  r.scale = p.scale;
  r.out = p.out;
  r.out_batch_stride = p.out_batch_stride;
  r.out_row_stride = p.out_row_stride;
  r.out_col_stride = p.out_col_stride;
  return r;
}


DecodeProblem decode_problem(const detail::MqaDecodeParams& p) {
  require_geometry("qsa_mqa_decode", p.heads, p.dim);
  if (p.rows < 1 || p.rows > kMaxDecodeRows) {
    throw Error("qsa_mqa_decode: internal: native path reached with " + std::to_string(p.rows) +
                " query rows per request (the kernel takes 1 to 4)");
  }
  DecodeProblem d{};
  d.batch = p.batch;
  d.rows = static_cast<int>(p.rows);
  d.q = p.q;
  d.q_batch_stride = p.q_batch_stride;
  d.q_row_stride = p.q_row_stride;
  d.q_head_stride = p.q_head_stride;
  d.q_dim_stride = p.q_dim_stride;
  d.k_cache = p.k_cache;
  d.k_page_stride = p.k_page_stride;
  d.k_slot_stride = p.k_slot_stride;
  d.k_dim_stride = p.k_dim_stride;
  d.num_pages = p.num_pages;
  // Columns are below 2^31 (max_model_len is checked), so a larger page is one page.
  d.page_size = static_cast<int>(std::min<int64_t>(p.page_size, INT32_MAX));
  d.page_table = p.page_table;
  d.page_table_batch_stride = p.page_table_batch_stride;
  d.page_table_page_stride = p.page_table_page_stride;
  d.max_pages = p.max_pages;
  d.context_lens = p.context_lens;
  d.context_lens_batch_stride = p.context_lens_batch_stride;
  d.context_lens_row_stride = p.context_lens_row_stride;
  d.max_model_len = p.max_model_len;
  d.scale = p.scale;
  d.out = p.out;
  d.out_row_stride = p.out_row_stride;
  d.out_col_stride = p.out_col_stride;
  return d;
}

}  // namespace sparse_attn::cuda::indexer

namespace sparse_attn::detail {

namespace ix = cuda::indexer;

void native_mqa_score(const MqaScoreParams& p) {
  if ((p.varlen ? p.q_len : p.batch * p.q_len) == 0 || p.num_blocks == 0) return;
  ix::launch_rows(ix::score_problem(p), p.dtype, p.k_dtype, "qsa_indexer_mqa_score",
                  static_cast<cudaStream_t>(p.stream));
}

void native_mqa_prefill(const MqaPrefillParams& p) {
  ix::require_geometry("qsa_mqa_prefill", p.heads, p.dim);
  if (p.rows == 0 || p.keys == 0) return;
  ix::require_vector_layout("qsa_mqa_prefill", p.q, p.q_dim_stride);
  ix::require_vector_layout("qsa_mqa_prefill", p.k, p.k_dim_stride);
  ix::RowsProblem r{};
  r.mode = ix::RowMode::kPrefill;
  r.num_rows = p.rows;
  r.q_len = p.rows;
  r.batch = 1;
  r.q = p.q;
  r.q_row_stride = p.q_row_stride;
  r.q_head_stride = p.q_head_stride;
  r.row_starts = p.row_starts;
  r.row_starts_stride = p.row_starts_stride;
  r.row_ends = p.row_ends;
  r.row_ends_stride = p.row_ends_stride;
  r.num_keys = p.keys;
  r.k = p.k;
  r.k_row_stride = p.k_row_stride;
  r.scale = p.scale;
  r.out = p.out;
  r.out_row_stride = p.out_row_stride;
  r.out_col_stride = p.out_col_stride;
  ix::launch_rows(r, p.dtype, p.k_dtype, "qsa_mqa_prefill", static_cast<cudaStream_t>(p.stream));
}

void native_mqa_decode(const MqaDecodeParams& p) {
  ix::launch_decode(ix::decode_problem(p), p.dtype, p.k_dtype, static_cast<cudaStream_t>(p.stream));
}

}  // namespace sparse_attn::detail
