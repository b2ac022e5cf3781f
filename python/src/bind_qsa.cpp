// QSA ops: the indexer scores (padded/varlen/paged), packed-prefill and paged-decode MQA
// logits, the fused selections on top of them, and sparse core attention. Each binding converts its
// arguments (naming them in errors), releases the GIL and calls the C++ entry point, which
// validates.
#include <nanobind/nanobind.h>
#include <nanobind/stl/vector.h>

#include "bind.h"
#include "convert.h"
#include "sparse_attn/qsa.h"
#include "sparse_attn/qsa_select.h"

namespace sparse_attn::python {
namespace {

using nb::handle;

IndexerScoreOptions indexer_options(Borrowed& b, handle block_table, handle page_size,
                                    handle cu_seqlens_q, handle token_to_req, handle num_requests,
                                    handle query_positions, handle seq_lens_q, handle block_size,
                                    handle scale, handle score_scale, handle kv_cache_dtype,
                                    handle backend, handle stream) {
  IndexerScoreOptions o;
  o.block_table = b.optional_tensor(block_table, "block_table");
  o.page_size = optional_int(page_size, "page_size");
  o.cu_seqlens_q = b.optional_tensor(cu_seqlens_q, "cu_seqlens_q");
  o.token_to_req = b.optional_tensor(token_to_req, "token_to_req");
  o.num_requests = optional_int(num_requests, "num_requests");
  o.query_positions = b.optional_tensor(query_positions, "query_positions");
  o.seq_lens_q = b.optional_tensor(seq_lens_q, "seq_lens_q");
  o.block_size = to_int(block_size, "block_size");
  o.scale = optional_float(scale, "scale");
  o.score_scale = optional_float(score_scale, "score_scale");
  o.kv_cache_dtype = to_kv_cache_dtype(kv_cache_dtype, "kv_cache_dtype");
  o.backend = to_backend(backend);
  o.stream = to_stream(stream);
  return o;
}

MqaScoreOptions mqa_options(handle score_scale, handle scale, handle kv_cache_dtype, handle backend,
                            handle stream) {
  MqaScoreOptions o;
  o.score_scale = optional_float(score_scale, "score_scale");
  o.scale = optional_float(scale, "scale");
  o.kv_cache_dtype = to_kv_cache_dtype(kv_cache_dtype, "kv_cache_dtype");
  o.backend = to_backend(backend);
  o.stream = to_stream(stream);
  return o;
}

void indexer_score(handle q_idx, handle block_keys, handle out, handle block_table,
                   handle page_size, handle cu_seqlens_q, handle token_to_req, handle num_requests,
                   handle query_positions, handle seq_lens_q, handle block_size, handle scale,
                   handle score_scale, handle kv_cache_dtype, handle backend, handle stream) {
  Borrowed b;
  const TensorView q = b.tensor(q_idx, "q_idx");
  const TensorView k = b.tensor(block_keys, "block_keys");
  const TensorView o = b.tensor(out, "out", true);
  const IndexerScoreOptions opts = indexer_options(
      b, block_table, page_size, cu_seqlens_q, token_to_req, num_requests, query_positions,
      seq_lens_q, block_size, scale, score_scale, kv_cache_dtype, backend, stream);
  nb::gil_scoped_release release;
  qsa_indexer_mqa_score(q, k, o, opts);
}

Shape indexer_score_shape(handle q_idx, handle block_keys, handle block_table, handle page_size,
                          handle cu_seqlens_q, handle token_to_req, handle num_requests,
                          handle query_positions, handle seq_lens_q, handle block_size,
                          handle scale, handle score_scale, handle kv_cache_dtype, handle backend) {
  Borrowed b;
  const TensorView q = b.tensor(q_idx, "q_idx");
  const TensorView k = b.tensor(block_keys, "block_keys");
  const IndexerScoreOptions opts = indexer_options(
      b, block_table, page_size, cu_seqlens_q, token_to_req, num_requests, query_positions,
      seq_lens_q, block_size, scale, score_scale, kv_cache_dtype, backend, nb::none());
  return qsa_indexer_mqa_score_shape(q, k, opts);
}

void mqa_prefill(handle q, handle k, handle row_starts, handle row_ends, handle out,
                 handle score_scale, handle scale, handle kv_cache_dtype, handle backend,
                 handle stream) {
  Borrowed b;
  const TensorView qv = b.tensor(q, "q");
  const TensorView kv = b.tensor(k, "k");
  const TensorView starts = b.tensor(row_starts, "row_starts");
  const TensorView ends = b.tensor(row_ends, "row_ends");
  const TensorView o = b.tensor(out, "out", true);
  const MqaScoreOptions opts = mqa_options(score_scale, scale, kv_cache_dtype, backend, stream);
  nb::gil_scoped_release release;
  qsa_mqa_prefill(qv, kv, starts, ends, o, opts);
}

Shape mqa_prefill_shape(handle q, handle k, handle kv_cache_dtype) {
  Borrowed b;
  MqaScoreOptions opts;
  opts.kv_cache_dtype = to_kv_cache_dtype(kv_cache_dtype, "kv_cache_dtype");
  return qsa_mqa_prefill_shape(b.tensor(q, "q"), b.tensor(k, "k"), opts);
}

void mqa_decode(handle q, handle k_cache, handle page_table, handle context_lens,
                handle max_model_len, handle out, handle score_scale, handle scale,
                handle kv_cache_dtype, handle backend, handle stream) {
  Borrowed b;
  const TensorView qv = b.tensor(q, "q");
  const TensorView kv = b.tensor(k_cache, "k_cache");
  const TensorView pages = b.tensor(page_table, "page_table");
  const TensorView lens = b.tensor(context_lens, "context_lens");
  const int64_t width = to_int(max_model_len, "max_model_len");
  const TensorView o = b.tensor(out, "out", true);
  const MqaScoreOptions opts = mqa_options(score_scale, scale, kv_cache_dtype, backend, stream);
  nb::gil_scoped_release release;
  qsa_mqa_decode(qv, kv, pages, lens, width, o, opts);
}

Shape mqa_decode_shape(handle q, handle max_model_len) {
  Borrowed b;
  return qsa_mqa_decode_shape(b.tensor(q, "q"), to_int(max_model_len, "max_model_len"));
}

// ---------------------------------------------------------------------------------------
// Fused selections (qsa_indexer_select, qsa_mqa_decode_select): the score ops' arguments, then
// the selection's. Python calls the C++ k `topk` and block_ids `out`.
// ---------------------------------------------------------------------------------------

constexpr Rename kTopk{"k", "topk"};
constexpr Rename kOut{"block_ids", "out"};

SelectOptions select_options(Borrowed& b, handle token_indices, handle valid_counts,
                             handle query_positions, handle max_workspace_bytes, handle workspace) {
  SelectOptions s;
  s.token_indices = b.optional_tensor(token_indices, "token_indices", true);
  s.valid_counts = b.optional_tensor(valid_counts, "valid_counts", true);
  s.query_positions = b.optional_tensor(query_positions, "query_positions");
  if (const std::optional<int64_t> bytes =
          optional_int(max_workspace_bytes, "max_workspace_bytes")) {
    if (*bytes < 0) {
      throw ValueError("max_workspace_bytes: expected a nonnegative byte count, got " +
                       std::to_string(*bytes));
    }
    s.max_workspace_bytes = static_cast<size_t>(*bytes);
  }
  s.workspace = b.optional_tensor(workspace, "workspace", true);
  return s;
}

void indexer_select(handle q_idx, handle block_keys, handle k, handle out, handle token_indices,
                    handle valid_counts, handle block_table, handle page_size, handle cu_seqlens_q,
                    handle token_to_req, handle num_requests, handle query_positions,
                    handle seq_lens_q, handle block_size, handle scale, handle score_scale,
                    handle kv_cache_dtype, handle backend, handle max_workspace_bytes,
                    handle workspace, handle stream) {
  Borrowed b;
  const TensorView q = b.tensor(q_idx, "q_idx");
  const TensorView keys = b.tensor(block_keys, "block_keys");
  const int64_t kk = to_int(k, "topk");
  const TensorView ids = b.tensor(out, "out", true);
  const IndexerScoreOptions opts = indexer_options(
      b, block_table, page_size, cu_seqlens_q, token_to_req, num_requests, query_positions,
      seq_lens_q, block_size, scale, score_scale, kv_cache_dtype, backend, stream);
  const SelectOptions sel =
      select_options(b, token_indices, valid_counts, nb::none(), max_workspace_bytes, workspace);
  call_with_python_names({kTopk, kOut}, [&] { qsa_indexer_select(q, keys, kk, ids, opts, sel); });
}

Shape indexer_select_shape(handle q_idx, handle block_keys, handle k, handle block_table,
                           handle page_size, handle cu_seqlens_q, handle token_to_req,
                           handle num_requests, handle query_positions, handle seq_lens_q,
                           handle block_size, handle scale, handle score_scale,
                           handle kv_cache_dtype, handle backend) {
  Borrowed b;
  const TensorView q = b.tensor(q_idx, "q_idx");
  const TensorView keys = b.tensor(block_keys, "block_keys");
  const int64_t kk = to_int(k, "topk");
  const IndexerScoreOptions opts = indexer_options(
      b, block_table, page_size, cu_seqlens_q, token_to_req, num_requests, query_positions,
      seq_lens_q, block_size, scale, score_scale, kv_cache_dtype, backend, nb::none());
  Shape shape;
  call_with_python_names({kTopk, kOut},
                         [&] { shape = qsa_indexer_select_shape(q, keys, kk, opts); });
  return shape;
}

size_t indexer_select_workspace_size(handle q_idx, handle block_keys, handle k,
                                     handle token_indices, handle valid_counts, handle block_table,
                                     handle page_size, handle cu_seqlens_q, handle token_to_req,
                                     handle num_requests, handle query_positions, handle seq_lens_q,
                                     handle block_size, handle scale, handle score_scale,
                                     handle kv_cache_dtype, handle backend,
                                     handle max_workspace_bytes) {
  Borrowed b;
  const TensorView q = b.tensor(q_idx, "q_idx");
  const TensorView keys = b.tensor(block_keys, "block_keys");
  const int64_t kk = to_int(k, "topk");
  const IndexerScoreOptions opts = indexer_options(
      b, block_table, page_size, cu_seqlens_q, token_to_req, num_requests, query_positions,
      seq_lens_q, block_size, scale, score_scale, kv_cache_dtype, backend, nb::none());
  const SelectOptions sel =
      select_options(b, token_indices, valid_counts, nb::none(), max_workspace_bytes, nb::none());
  size_t bytes = 0;
  call_with_python_names(
      {kTopk, kOut}, [&] { bytes = qsa_indexer_select_workspace_size(q, keys, kk, opts, sel); });
  return bytes;
}

void decode_select(handle q, handle k_cache, handle page_table, handle context_lens,
                   handle max_model_len, handle k, handle out, handle token_indices,
                   handle valid_counts, handle query_positions, handle score_scale, handle scale,
                   handle kv_cache_dtype, handle backend, handle max_workspace_bytes,
                   handle workspace, handle stream) {
  Borrowed b;
  const TensorView qv = b.tensor(q, "q");
  const TensorView kv = b.tensor(k_cache, "k_cache");
  const TensorView pages = b.tensor(page_table, "page_table");
  const TensorView lens = b.tensor(context_lens, "context_lens");
  const int64_t width = to_int(max_model_len, "max_model_len");
  const int64_t kk = to_int(k, "topk");
  const TensorView ids = b.tensor(out, "out", true);
  const MqaScoreOptions opts = mqa_options(score_scale, scale, kv_cache_dtype, backend, stream);
  const SelectOptions sel = select_options(b, token_indices, valid_counts, query_positions,
                                           max_workspace_bytes, workspace);
  call_with_python_names({kTopk, kOut}, [&] {
    qsa_mqa_decode_select(qv, kv, pages, lens, width, kk, ids, opts, sel);
  });
}

Shape decode_select_shape(handle q, handle k) {
  Borrowed b;
  const TensorView qv = b.tensor(q, "q");
  const int64_t kk = to_int(k, "topk");
  Shape shape;
  call_with_python_names({kTopk, kOut}, [&] { shape = qsa_mqa_decode_select_shape(qv, kk); });
  return shape;
}

size_t decode_select_workspace_size(handle q, handle k_cache, handle page_table,
                                    handle context_lens, handle max_model_len, handle k,
                                    handle token_indices, handle valid_counts,
                                    handle query_positions, handle score_scale, handle scale,
                                    handle kv_cache_dtype, handle backend,
                                    handle max_workspace_bytes) {
  Borrowed b;
  const TensorView qv = b.tensor(q, "q");
  const TensorView kv = b.tensor(k_cache, "k_cache");
  const TensorView pages = b.tensor(page_table, "page_table");
  const TensorView lens = b.tensor(context_lens, "context_lens");
  const int64_t width = to_int(max_model_len, "max_model_len");
  const int64_t kk = to_int(k, "topk");
  const MqaScoreOptions opts = mqa_options(score_scale, scale, kv_cache_dtype, backend, nb::none());
  const SelectOptions sel = select_options(b, token_indices, valid_counts, query_positions,
                                           max_workspace_bytes, nb::none());
  size_t bytes = 0;
  call_with_python_names({kTopk, kOut}, [&] {
    bytes = qsa_mqa_decode_select_workspace_size(qv, kv, pages, lens, width, kk, opts, sel);
  });
  return bytes;
}

// The options of qsa_sparse_attention from its Python arguments (tensors imported into `b`).
SparseAttentionOptions attention_options(
    Borrowed& b, handle block_indices, handle cu_seqlens_q, handle token_to_req,
    handle num_requests, handle cu_seqlens_k, handle seq_lens_q, handle seq_lens_k,
    handle query_positions, handle block_table, handle page_size, handle scale, handle gate,
    handle num_splits, handle backend, handle warp_specialized, handle assume_compact_blocks,
    handle selected_kv_indices, handle softmax_scale, handle k_scale, handle v_scale,
    handle compute_dtype, handle kv_cache_dtype, handle stream) {
  SparseAttentionOptions opts;
  opts.block_indices = b.optional_tensor(block_indices, "block_indices");
  opts.cu_seqlens_q = b.optional_tensor(cu_seqlens_q, "cu_seqlens_q");
  opts.token_to_req = b.optional_tensor(token_to_req, "token_to_req");
  opts.num_requests = optional_int(num_requests, "num_requests");
  opts.cu_seqlens_k = b.optional_tensor(cu_seqlens_k, "cu_seqlens_k");
  opts.seq_lens_q = b.optional_tensor(seq_lens_q, "seq_lens_q");
  opts.seq_lens_k = b.optional_tensor(seq_lens_k, "seq_lens_k");
  opts.query_positions = b.optional_tensor(query_positions, "query_positions");
  opts.block_table = b.optional_tensor(block_table, "block_table");
  opts.page_size = optional_int(page_size, "page_size");
  opts.scale = optional_float(scale, "scale");
  opts.gate = b.optional_tensor(gate, "gate");
  opts.num_splits = optional_int(num_splits, "num_splits");
  opts.backend = to_backend(backend);
  opts.warp_specialized = to_bool(warp_specialized, "warp_specialized");
  opts.assume_compact_blocks = to_bool(assume_compact_blocks, "assume_compact_blocks");
  opts.selected_kv_indices = b.optional_tensor(selected_kv_indices, "selected_kv_indices");
  opts.softmax_scale = optional_float(softmax_scale, "softmax_scale");
  opts.k_scale = to_float(k_scale, "k_scale");
  opts.v_scale = to_float(v_scale, "v_scale");
  opts.compute_dtype = to_dtype(compute_dtype, "compute_dtype");
  opts.kv_cache_dtype = to_kv_cache_dtype(kv_cache_dtype, "kv_cache_dtype");
  opts.stream = to_stream(stream);
  return opts;
}

// Raised out of a workspace allocator whose Python callable failed, once the Python error is
// stored again; the binding turns it back into that error with the GIL held.
struct PythonErrorPending {};

// workspace: None (the library's pool), a uint8 tensor, or a callable that allocates one
// (options.workspace_allocator): called with the byte count, only when the call needs scratch
// (native backend, CUDA tensors, SplitKV or the row-rank pass), so that the caller's framework
// owns the memory (torch's caching allocator, which CUDA graph capture understands) at no cost
// to calls that need none.
void sparse_attention(handle query, handle key, handle value, handle token_indices, handle out,
                      handle lse, handle block_indices, handle cu_seqlens_q, handle token_to_req,
                      handle num_requests, handle cu_seqlens_k, handle seq_lens_q,
                      handle seq_lens_k, handle query_positions, handle block_table,
                      handle page_size, handle scale, handle gate, handle num_splits,
                      handle backend, handle warp_specialized, handle assume_compact_blocks,
                      handle selected_kv_indices, handle softmax_scale, handle k_scale,
                      handle v_scale, handle compute_dtype, handle kv_cache_dtype, handle workspace,
                      handle stream) {
  Borrowed b;
  const TensorView q = b.tensor(query, "query");
  const TensorView k = b.tensor(key, "key");
  const TensorView v = b.tensor(value, "value");
  const std::optional<TensorView> ids = b.optional_tensor(token_indices, "token_indices");
  const TensorView o = b.tensor(out, "out", true);
  const std::optional<TensorView> l = b.optional_tensor(lse, "lse", true);
  SparseAttentionOptions opts = attention_options(
      b, block_indices, cu_seqlens_q, token_to_req, num_requests, cu_seqlens_k, seq_lens_q,
      seq_lens_k, query_positions, block_table, page_size, scale, gate, num_splits, backend,
      warp_specialized, assume_compact_blocks, selected_kv_indices, softmax_scale, k_scale, v_scale,
      compute_dtype, kv_cache_dtype, stream);
  nb::object allocated;  // keeps a workspace from the callable alive through the call
  if (PyCallable_Check(workspace.ptr())) {
    // Runs inside the call, which has released the GIL.
    opts.workspace_allocator = [&](size_t bytes) {
      nb::gil_scoped_acquire gil;
      try {
        allocated = workspace(bytes);
      } catch (nb::python_error& e) {
        e.restore();
        throw PythonErrorPending{};
      }
      return b.tensor(allocated, "workspace", true);
    };
  } else {
    opts.workspace = b.optional_tensor(workspace, "workspace", true);
  }
  try {
    nb::gil_scoped_release release;
    qsa_sparse_attention(q, k, v, ids, o, l, opts);
  } catch (const PythonErrorPending&) {
    throw nb::python_error();
  }
}

size_t sparse_attention_workspace_size(handle query, handle key, handle value, handle token_indices,
                                       handle block_indices, handle cu_seqlens_q,
                                       handle token_to_req, handle num_requests,
                                       handle cu_seqlens_k, handle seq_lens_q, handle seq_lens_k,
                                       handle query_positions, handle block_table, handle page_size,
                                       handle scale, handle gate, handle num_splits, handle backend,
                                       handle warp_specialized, handle assume_compact_blocks,
                                       handle selected_kv_indices, handle softmax_scale,
                                       handle k_scale, handle v_scale, handle compute_dtype,
                                       handle kv_cache_dtype) {
  Borrowed b;
  const TensorView q = b.tensor(query, "query");
  const TensorView k = b.tensor(key, "key");
  const TensorView v = b.tensor(value, "value");
  const std::optional<TensorView> ids = b.optional_tensor(token_indices, "token_indices");
  const SparseAttentionOptions opts = attention_options(
      b, block_indices, cu_seqlens_q, token_to_req, num_requests, cu_seqlens_k, seq_lens_q,
      seq_lens_k, query_positions, block_table, page_size, scale, gate, num_splits, backend,
      warp_specialized, assume_compact_blocks, selected_kv_indices, softmax_scale, k_scale, v_scale,
      compute_dtype, kv_cache_dtype, nb::none());
  return qsa_sparse_attention_workspace_size(q, k, v, ids, opts);
}

Shape sparse_attention_out_shape(handle query) {
  Borrowed b;
  return qsa_sparse_attention_out_shape(b.tensor(query, "query"));
}

Shape sparse_attention_lse_shape(handle query) {
  Borrowed b;
  return qsa_sparse_attention_lse_shape(b.tensor(query, "query"));
}

}  // namespace

void bind_qsa(nb::module_& m) {
  def(m, "qsa_indexer_mqa_score", &indexer_score, "q_idx", "block_keys", "out", "block_table",
      "page_size", "cu_seqlens_q", "token_to_req", "num_requests", "query_positions", "seq_lens_q",
      "block_size", "scale", "score_scale", "kv_cache_dtype", "backend", "stream");
  def(m, "qsa_indexer_mqa_score_shape", &indexer_score_shape, "q_idx", "block_keys", "block_table",
      "page_size", "cu_seqlens_q", "token_to_req", "num_requests", "query_positions", "seq_lens_q",
      "block_size", "scale", "score_scale", "kv_cache_dtype", "backend");
  def(m, "qsa_mqa_prefill", &mqa_prefill, "q", "k", "row_starts", "row_ends", "out", "score_scale",
      "scale", "kv_cache_dtype", "backend", "stream");
  def(m, "qsa_mqa_prefill_shape", &mqa_prefill_shape, "q", "k", "kv_cache_dtype");
  def(m, "qsa_mqa_decode", &mqa_decode, "q", "k_cache", "page_table", "context_lens",
      "max_model_len", "out", "score_scale", "scale", "kv_cache_dtype", "backend", "stream");
  def(m, "qsa_mqa_decode_shape", &mqa_decode_shape, "q", "max_model_len");
  def(m, "qsa_indexer_select", &indexer_select, "q_idx", "block_keys", "topk", "out",
      "token_indices", "valid_counts", "block_table", "page_size", "cu_seqlens_q", "token_to_req",
      "num_requests", "query_positions", "seq_lens_q", "block_size", "scale", "score_scale",
      "kv_cache_dtype", "backend", "max_workspace_bytes", "workspace", "stream");
  def(m, "qsa_indexer_select_shape", &indexer_select_shape, "q_idx", "block_keys", "topk",
      "block_table", "page_size", "cu_seqlens_q", "token_to_req", "num_requests", "query_positions",
      "seq_lens_q", "block_size", "scale", "score_scale", "kv_cache_dtype", "backend");
  def(m, "qsa_indexer_select_workspace_size", &indexer_select_workspace_size, "q_idx", "block_keys",
      "topk", "token_indices", "valid_counts", "block_table", "page_size", "cu_seqlens_q",
      "token_to_req", "num_requests", "query_positions", "seq_lens_q", "block_size", "scale",
      "score_scale", "kv_cache_dtype", "backend", "max_workspace_bytes");
  def(m, "qsa_mqa_decode_select", &decode_select, "q", "k_cache", "page_table", "context_lens",
      "max_model_len", "topk", "out", "token_indices", "valid_counts", "query_positions",
      "score_scale", "scale", "kv_cache_dtype", "backend", "max_workspace_bytes", "workspace",
      "stream");
  def(m, "qsa_mqa_decode_select_shape", &decode_select_shape, "q", "topk");
  def(m, "qsa_mqa_decode_select_workspace_size", &decode_select_workspace_size, "q", "k_cache",
      "page_table", "context_lens", "max_model_len", "topk", "token_indices", "valid_counts",
      "query_positions", "score_scale", "scale", "kv_cache_dtype", "backend",
      "max_workspace_bytes");
  def(m, "qsa_sparse_attention", &sparse_attention, "query", "key", "value", "token_indices", "out",
      "lse", "block_indices", "cu_seqlens_q", "token_to_req", "num_requests", "cu_seqlens_k",
      "seq_lens_q", "seq_lens_k", "query_positions", "block_table", "page_size", "scale", "gate",
      "num_splits", "backend", "warp_specialized", "assume_compact_blocks", "selected_kv_indices",
      "softmax_scale", "k_scale", "v_scale", "compute_dtype", "kv_cache_dtype", "workspace",
      "stream");
  def(m, "qsa_sparse_attention_workspace_size", &sparse_attention_workspace_size, "query", "key",
      "value", "token_indices", "block_indices", "cu_seqlens_q", "token_to_req", "num_requests",
      "cu_seqlens_k", "seq_lens_q", "seq_lens_k", "query_positions", "block_table", "page_size",
      "scale", "gate", "num_splits", "backend", "warp_specialized", "assume_compact_blocks",
      "selected_kv_indices", "softmax_scale", "k_scale", "v_scale", "compute_dtype",
      "kv_cache_dtype");
  def(m, "qsa_sparse_attention_out_shape", &sparse_attention_out_shape, "query");
  def(m, "qsa_sparse_attention_lse_shape", &sparse_attention_lse_shape, "query");
}

}  // namespace sparse_attn::python
