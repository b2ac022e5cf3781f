// XAttention ops: estimation, block selection, block-sparse attention (varlen and paged) and
// the fused prefill. Option structs are filled from positional arguments in the order the
// Python wrappers pass them.
#include <nanobind/nanobind.h>
#include <nanobind/stl/vector.h>

#include <initializer_list>
#include <string>
#include <string_view>
#include <utility>

#include "bind.h"
#include "convert.h"
#include "sparse_attn/errors.h"
#include "sparse_attn/xattn.h"

namespace sparse_attn::python {
namespace {

using nb::handle;

constexpr Rename kThreshold{"head_thresholds", "threshold"};

// threshold (a float) or head_thresholds (a list, one per query head; None for none).
void fill_select(BlockSelectOptions& o, handle threshold, handle head_thresholds, handle causal,
                 handle keep_sink, handle keep_recent, handle block_size, handle backend,
                 handle stream) {
  o.threshold = to_float(threshold, "threshold");
  o.head_thresholds = to_float_list(head_thresholds, "threshold");
  o.causal = to_bool(causal, "causal");
  o.keep_sink = to_bool(keep_sink, "keep_sink");
  o.keep_recent = to_bool(keep_recent, "keep_recent");
  o.block_size = to_int(block_size, "block_size");
  o.backend = to_backend(backend);
  o.stream = to_stream(stream);
}

void fill_estimate(XAttnEstimateOptions& o, handle stride, handle norm, handle chunk_size,
                   handle select_mode) {
  o.stride = to_int(stride, "stride");
  o.norm = to_float(norm, "norm");
  o.chunk_size = to_int(chunk_size, "chunk_size");
  o.select_mode = to_str(select_mode, "select_mode");
}

void find_blocks(handle attn_sums, handle block_mask, handle threshold, handle head_thresholds,
                 handle causal, handle keep_sink, handle keep_recent, handle block_size,
                 handle q_len, handle k_len, handle backend, handle stream) {
  Borrowed b;
  const TensorView sums = b.tensor(attn_sums, "input_tensor");
  const TensorView mask = b.tensor(block_mask, "out", true);
  FindBlocksOptions o;
  fill_select(o, threshold, head_thresholds, causal, keep_sink, keep_recent, block_size, backend,
              stream);
  o.q_len = optional_int(q_len, "q_len");
  o.k_len = optional_int(k_len, "k_len");
  call_with_python_names({{"attn_sums", "input_tensor"}, {"block_mask", "out"}, kThreshold},
                         [&] { find_blocks_chunked(sums, mask, o); });
}

XAttnEstimateOptions estimate_options(handle threshold, handle head_thresholds, handle causal,
                                      handle keep_sink, handle keep_recent, handle block_size,
                                      handle stride, handle norm, handle chunk_size,
                                      handle select_mode, handle backend, handle stream) {
  XAttnEstimateOptions o;
  fill_select(o, threshold, head_thresholds, causal, keep_sink, keep_recent, block_size, backend,
              stream);
  fill_estimate(o, stride, norm, chunk_size, select_mode);
  return o;
}

void estimate(handle query, handle key, handle attn_sums, handle block_mask, handle threshold,
              handle head_thresholds, handle causal, handle keep_sink, handle keep_recent,
              handle block_size, handle stride, handle norm, handle chunk_size, handle select_mode,
              handle backend, handle stream) {
  Borrowed b;
  const TensorView q = b.tensor(query, "query_states");
  const TensorView k = b.tensor(key, "key_states");
  // Python's out=(attn_sums, simple_masks).
  const TensorView sums = b.tensor(attn_sums, "out[0]", true);
  const TensorView mask = b.tensor(block_mask, "out[1]", true);
  const XAttnEstimateOptions o =
      estimate_options(threshold, head_thresholds, causal, keep_sink, keep_recent, block_size,
                       stride, norm, chunk_size, select_mode, backend, stream);
  call_with_python_names({{"query", "query_states"},
                          {"key", "key_states"},
                          {"attn_sums", "out[0]"},
                          {"block_mask", "out[1]"},
                          kThreshold},
                         [&] { xattn_estimate(q, k, sums, mask, o); });
}

Shape estimate_shape(handle query, handle key, handle block_size) {
  Borrowed b;
  XAttnEstimateOptions o;
  o.block_size = to_int(block_size, "block_size");
  const TensorView q = b.tensor(query, "query_states");
  const TensorView k = b.tensor(key, "key_states");
  Shape shape;
  call_with_python_names({{"query", "query_states"}, {"key", "key_states"}},
                         [&] { shape = xattn_estimate_shape(q, k, o); });
  return shape;
}

BlockSparseAttentionOptions attention_options(handle head_mask_type, handle streaming_info,
                                              handle softmax_scale, handle is_causal,
                                              handle p_dropout, handle backend, handle stream) {
  BlockSparseAttentionOptions o;
  o.head_mask_type = to_int32_list(head_mask_type, "head_mask_type");
  o.streaming_info = to_int32_list(streaming_info, "streaming_info");
  o.softmax_scale = optional_float(softmax_scale, "softmax_scale");
  o.is_causal = to_bool(is_causal, "is_causal");
  o.p_dropout = to_float(p_dropout, "p_dropout");
  o.backend = to_backend(backend);
  o.stream = to_stream(stream);
  return o;
}

void attention(handle q, handle k, handle v, handle cu_seqlens_q, handle cu_seqlens_k,
               handle base_blockmask, handle max_seqlen_q, handle max_seqlen_k, handle out,
               handle lse, handle head_mask_type, handle streaming_info, handle softmax_scale,
               handle is_causal, handle p_dropout, handle backend, handle stream) {
  Borrowed b;
  const TensorView qv = b.tensor(q, "q");
  const TensorView kv = b.tensor(k, "k");
  const TensorView vv = b.tensor(v, "v");
  const TensorView cu_q = b.tensor(cu_seqlens_q, "cu_seqlens_q");
  const TensorView cu_k = b.tensor(cu_seqlens_k, "cu_seqlens_k");
  const std::optional<TensorView> mask = b.optional_tensor(base_blockmask, "base_blockmask");
  const int64_t max_q = to_int(max_seqlen_q, "max_seqlen_q_");
  const int64_t max_k = to_int(max_seqlen_k, "max_seqlen_k_");
  const TensorView o = b.tensor(out, "out", true);
  const std::optional<TensorView> l = b.optional_tensor(lse, "lse", true);
  const BlockSparseAttentionOptions opts = attention_options(
      head_mask_type, streaming_info, softmax_scale, is_causal, p_dropout, backend, stream);
  // block_sparse_attn_func keeps Block-Sparse-Attention's max_seqlen_q_ / max_seqlen_k_.
  call_with_python_names({{"max_seqlen_q", "max_seqlen_q_"}, {"max_seqlen_k", "max_seqlen_k_"}},
                         [&] { block_sparse_attention(qv, kv, vv, cu_q, cu_k, mask, max_q, max_k,
                                                      o, l, opts); });
}

void attention_paged(handle q, handle k_cache, handle v_cache, handle block_table, handle seqlens_k,
                     handle cu_seqlens_q, handle base_blockmask, handle max_seqlen_q,
                     handle max_seqlen_k, handle out, handle lse, handle head_mask_type,
                     handle streaming_info, handle softmax_scale, handle is_causal,
                     handle p_dropout, handle backend, handle stream) {
  Borrowed b;
  const TensorView qv = b.tensor(q, "q");
  const TensorView kc = b.tensor(k_cache, "k_cache");
  const TensorView vc = b.tensor(v_cache, "v_cache");
  const TensorView table = b.tensor(block_table, "block_table");
  const TensorView lens = b.tensor(seqlens_k, "seqlens_k");
  const TensorView cu_q = b.tensor(cu_seqlens_q, "cu_seqlens_q");
  const std::optional<TensorView> mask = b.optional_tensor(base_blockmask, "base_blockmask");
  const int64_t max_q = to_int(max_seqlen_q, "max_seqlen_q");
  const int64_t max_k = to_int(max_seqlen_k, "max_seqlen_k");
  const TensorView o = b.tensor(out, "out", true);
  const std::optional<TensorView> l = b.optional_tensor(lse, "lse", true);
  const BlockSparseAttentionOptions opts = attention_options(
      head_mask_type, streaming_info, softmax_scale, is_causal, p_dropout, backend, stream);
  nb::gil_scoped_release release;
  block_sparse_attention_paged(qv, kc, vc, table, lens, cu_q, mask, max_q, max_k, o, l, opts);
}

XAttnPrefillOptions prefill_options(handle threshold, handle head_thresholds, handle causal,
                                    handle keep_sink, handle keep_recent, handle block_size,
                                    handle stride, handle norm, handle chunk_size,
                                    handle select_mode, handle softmax_scale, handle backend,
                                    handle stream) {
  XAttnPrefillOptions opts;
  static_cast<XAttnEstimateOptions&>(opts) =
      estimate_options(threshold, head_thresholds, causal, keep_sink, keep_recent, block_size,
                       stride, norm, chunk_size, select_mode, backend, stream);
  opts.softmax_scale = optional_float(softmax_scale, "softmax_scale");
  return opts;
}

void prefill(handle query, handle key, handle value, handle attn_sums, handle block_mask,
             handle out, handle lse, handle threshold, handle head_thresholds, handle causal,
             handle keep_sink, handle keep_recent, handle block_size, handle stride, handle norm,
             handle chunk_size, handle select_mode, handle softmax_scale, handle backend,
             handle stream) {
  Borrowed b;
  const TensorView q = b.tensor(query, "query_states");
  const TensorView k = b.tensor(key, "key_states");
  const TensorView v = b.tensor(value, "value_states");
  const TensorView sums = b.tensor(attn_sums, "attn_sums", true);
  const TensorView mask = b.tensor(block_mask, "block_mask", true);
  const TensorView o = b.tensor(out, "out", true);
  const std::optional<TensorView> l = b.optional_tensor(lse, "lse", true);
  const XAttnPrefillOptions opts =
      prefill_options(threshold, head_thresholds, causal, keep_sink, keep_recent, block_size,
                      stride, norm, chunk_size, select_mode, softmax_scale, backend, stream);
  call_with_python_names(
      {{"query", "query_states"}, {"key", "key_states"}, {"value", "value_states"}, kThreshold},
      [&] { xattention_prefill(q, k, v, sums, mask, o, l, opts); });
}

void prefill_paged(handle query, handle k_cache, handle v_cache, handle block_table, handle k_len,
                   handle attn_sums, handle block_mask, handle out, handle lse, handle threshold,
                   handle head_thresholds, handle causal, handle keep_sink, handle keep_recent,
                   handle block_size, handle stride, handle norm, handle chunk_size,
                   handle select_mode, handle softmax_scale, handle backend, handle stream) {
  Borrowed b;
  const TensorView q = b.tensor(query, "query_states");
  const TensorView kc = b.tensor(k_cache, "k_cache");
  const TensorView vc = b.tensor(v_cache, "v_cache");
  const TensorView table = b.tensor(block_table, "block_table");
  const int64_t keys = to_int(k_len, "k_len");
  const TensorView sums = b.tensor(attn_sums, "attn_sums", true);
  const TensorView mask = b.tensor(block_mask, "block_mask", true);
  const TensorView o = b.tensor(out, "out", true);
  const std::optional<TensorView> l = b.optional_tensor(lse, "lse", true);
  const XAttnPrefillOptions opts =
      prefill_options(threshold, head_thresholds, causal, keep_sink, keep_recent, block_size,
                      stride, norm, chunk_size, select_mode, softmax_scale, backend, stream);
  call_with_python_names({{"query", "query_states"}, kThreshold}, [&] {
    xattention_prefill_paged(q, kc, vc, table, keys, sums, mask, o, l, opts);
  });
}

}  // namespace

void bind_xattn(nb::module_& m) {
  def(m, "find_blocks_chunked", &find_blocks, "attn_sums", "block_mask", "threshold",
      "head_thresholds", "causal", "keep_sink", "keep_recent", "block_size", "q_len", "k_len",
      "backend", "stream");
  def(m, "xattn_estimate", &estimate, "query", "key", "attn_sums", "block_mask", "threshold",
      "head_thresholds", "causal", "keep_sink", "keep_recent", "block_size", "stride", "norm",
      "chunk_size", "select_mode", "backend", "stream");
  def(m, "xattn_estimate_shape", &estimate_shape, "query", "key", "block_size");
  def(m, "block_sparse_attention", &attention, "q", "k", "v", "cu_seqlens_q", "cu_seqlens_k",
      "base_blockmask", "max_seqlen_q", "max_seqlen_k", "out", "lse", "head_mask_type",
      "streaming_info", "softmax_scale", "is_causal", "p_dropout", "backend", "stream");
  def(m, "block_sparse_attention_paged", &attention_paged, "q", "k_cache", "v_cache", "block_table",
      "seqlens_k", "cu_seqlens_q", "base_blockmask", "max_seqlen_q", "max_seqlen_k", "out", "lse",
      "head_mask_type", "streaming_info", "softmax_scale", "is_causal", "p_dropout", "backend",
      "stream");
  def(m, "xattention_prefill", &prefill, "query", "key", "value", "attn_sums", "block_mask", "out",
      "lse", "threshold", "head_thresholds", "causal", "keep_sink", "keep_recent", "block_size",
      "stride", "norm", "chunk_size", "select_mode", "softmax_scale", "backend", "stream");
  def(m, "xattention_prefill_paged", &prefill_paged, "query", "k_cache", "v_cache", "block_table",
      "k_len", "attn_sums", "block_mask", "out", "lse", "threshold", "head_thresholds", "causal",
      "keep_sink", "keep_recent", "block_size", "stride", "norm", "chunk_size", "select_mode",
      "softmax_scale", "backend", "stream");
  m.attr("BLOCK_SPARSE_BLOCK_SIZE") = kBlockSparseBlockSize;
}

}  // namespace sparse_attn::python
