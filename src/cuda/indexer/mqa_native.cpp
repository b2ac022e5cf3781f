// Native (CUDA) entry points of the QSA indexer ops: the API's validated params become the
// kernels' problems, and the element type becomes a template argument (the one dispatch).
#include <bit>
#include <cstdint>

#include "api/qsa_indexer_params.h"
#include "cuda/common/dispatch.h"
#include "cuda/indexer/mqa_problem.h"
#include "sparse_attn/errors.h"

namespace sparse_attn::detail {
namespace {

namespace ix = cuda::indexer;

cudaStream_t to_stream(StreamHandle s) { return static_cast<cudaStream_t>(s); }

// The API checks the native geometry and layout before it fills params; these guard the
// kernels' own assumptions should a caller reach them another way.
void require_geometry(const char* op, int heads, int dim) {
  if (heads != ix::kHeads || dim != ix::kDim) {
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

void native_mqa_score(const MqaScoreParams& p) {
  require_geometry("qsa_indexer_mqa_score", p.heads, p.dim);
  const int64_t rows = p.varlen ? p.q_len : p.batch * p.q_len;
  if (rows == 0 || p.num_blocks == 0) return;
  require_vector_layout("qsa_indexer_mqa_score", p.q, p.q_dim_stride);
  require_vector_layout("qsa_indexer_mqa_score", p.k, p.k_dim_stride);
  ix::RowsProblem r{};
  r.mode = !p.varlen ? ix::RowMode::kPadded
                     : (p.cu_seqlens_q ? ix::RowMode::kVarlenCu : ix::RowMode::kVarlenTok);
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
  cuda::dispatch_dtype(p.dtype, "qsa_indexer_mqa_score", [&](auto t) {
    ix::launch_mqa_rows<typename decltype(t)::type>(r, to_stream(p.stream));
  });
}

void native_mqa_prefill(const MqaPrefillParams& p) {
  require_geometry("qsa_mqa_prefill", p.heads, p.dim);
  if (p.rows == 0 || p.keys == 0) return;
  require_vector_layout("qsa_mqa_prefill", p.q, p.q_dim_stride);
  require_vector_layout("qsa_mqa_prefill", p.k, p.k_dim_stride);
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
  cuda::dispatch_dtype(p.dtype, "qsa_mqa_prefill", [&](auto t) {
    ix::launch_mqa_rows<typename decltype(t)::type>(r, to_stream(p.stream));
  });
}

void native_mqa_decode(const MqaDecodeParams& p) {
  require_geometry("qsa_mqa_decode", p.heads, p.dim);
  if (p.page_size < 8 || p.page_size > 64 || !std::has_single_bit(uint64_t(p.page_size))) {
    throw NotSupportedError("qsa_mqa_decode: page_size " + std::to_string(p.page_size) +
                            " is not supported by the native kernels (8, 16, 32 or 64); pass "
                            "backend='reference'");
  }
  ix::DecodeProblem d{};
  d.batch = p.batch;
  d.q = p.q;
  d.q_batch_stride = p.q_batch_stride;
  d.q_head_stride = p.q_head_stride;
  d.q_dim_stride = p.q_dim_stride;
  d.k_cache = p.k_cache;
  d.k_page_stride = p.k_page_stride;
  d.k_slot_stride = p.k_slot_stride;
  d.k_dim_stride = p.k_dim_stride;
  d.num_pages = p.num_pages;
  d.page_size_log2 = std::countr_zero(uint64_t(p.page_size));
  d.page_table = p.page_table;
  d.page_table_batch_stride = p.page_table_batch_stride;
  d.page_table_page_stride = p.page_table_page_stride;
  d.max_pages = p.max_pages;
  d.context_lens = p.context_lens;
  d.context_lens_stride = p.context_lens_stride;
  d.max_model_len = p.max_model_len;
  d.scale = p.scale;
  d.out = p.out;
  d.out_batch_stride = p.out_batch_stride;
  d.out_col_stride = p.out_col_stride;
  cuda::dispatch_dtype(p.dtype, "qsa_mqa_decode", [&](auto t) {
    ix::launch_mqa_decode<typename decltype(t)::type>(d, to_stream(p.stream));
  });
}

}  // namespace sparse_attn::detail
