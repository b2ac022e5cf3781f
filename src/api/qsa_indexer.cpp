// API boundary of the QSA MQA indexer ops: validation (metadata only), backend choice, params
// filling. docs/qsa.md ("## Indexer scores") is the user-facing statement of these rules. The
// checks and params the fused selections share (api/qsa_indexer_checks.h) are defined here too.
#include <climits>
#include <cmath>
#include <span>
#include <utility>

#include "api/check.h"
#include "api/qsa_indexer_checks.h"
#include "api/qsa_indexer_params.h"
#include "api/staging.h"
#include "cpu/cpu_kernels.h"
#include "reference/qsa_indexer_ref.h"
#include "sparse_attn/qsa.h"

namespace sparse_attn {
namespace {

using detail::DecodeLayout;
using detail::throw_not_supported;
using detail::throw_value_error;

// The geometry the native kernels are built for (the seed's H4/D128 indexer).
constexpr int64_t kNativeHeads = 4;
constexpr int64_t kNativeDim = 128;
// QSA compresses exactly four tokens per key; the masks (4b + 3 <= p) assume it.
constexpr int64_t kQsaBlockSize = 4;

// q: bfloat16/float16 with at least one head and one feature; k: q's device and dim, q's dtype
// or FP8 e4m3 (already resolved from uint8 storage by resolve_cache_dtype).
void check_query_and_keys(const TensorView& q, const char* q_name, const TensorView& k,
                          const char* k_name) {
  detail::check_dtype(q, q_name, {DType::kBF16, DType::kF16});
  if (k.dtype() != q.dtype() && k.dtype() != DType::kF8E4M3) {
    detail::throw_type_error("{}: expected dtype {} (the dtype of {}) or float8_e4m3fn, got {}",
                             k_name, dtype_name(q.dtype()), q_name, dtype_name(k.dtype()));
  }
  detail::check_device(k, k_name, q.device(), q_name);
  if (q.size(-2) < 1 || q.size(-1) < 1) {
    throw_value_error("{}: expected at least one head and one feature, got shape {}", q_name,
                      q.shape_str());
  }
  detail::check_size(k, k_name, -1, q.size(-1), std::string(q_name) + ".shape[-1]");
  detail::check_data(q, q_name);
  detail::check_data(k, k_name);
}

// FP32 output of the given shape on `device`, writable by strides (no two elements at one
// address: the kernels write every element once, from different threads), overlapping no input.
// The last check of each scoring op (their only output), so a missing out (api/check.h) is
// reported here: every other argument has passed.
void check_out(const TensorView& out, const Shape& shape, std::string_view what, Device device,
               const char* device_ref, std::span<const detail::NamedInput> inputs) {
  detail::check_not_missing(out, "out");
  detail::check_dtype(out, "out", {DType::kF32});
  detail::check_shape(out, "out", shape, what);
  detail::check_device(out, "out", device, device_ref);
  detail::check_positive_strides(out, "out");
  detail::check_no_self_overlap(out, "out");
  detail::check_data(out, "out");
  for (const auto& [in, name] : inputs) {
    if (in != nullptr) detail::check_no_overlap(out, "out", *in, name);
  }
}

// Drops axis `d` (of size 1) from a view: the kernels address [.., 1, D] caches as [.., D].
TensorView drop_axis(const TensorView& t, int d) { return t.select(d, 0); }

// The output width: a compressed key per column. Checked before context_lens are seen (the
// shape function has no context_lens), so the bound is the library's, not the dtype's: 2^31 - 1
// compressed keys are 8.6e9 tokens, more context than any model serves.
void check_max_model_len(int64_t max_model_len) {
  if (max_model_len < 0 || max_model_len > INT32_MAX) {
    throw_value_error(
        "max_model_len: expected an output width in [0, {}] (compressed keys per request), got {}",
        INT32_MAX, max_model_len);
  }
}

// context_lens: one count per query row, [B, R]; a [B] tensor only when R == 1. Several rows of
// a request see different keys (row r of a multi-token step sees the blocks its own token
// completes), so a single count per request cannot describe them.
void check_context_lens(const TensorView& context_lens, const DecodeLayout& l, Device device) {
  detail::check_metadata_dtype(context_lens, "context_lens");
  if (context_lens.dim() == 1 && l.rows > 1) {
    throw_value_error(
        "context_lens: expected shape [B, R] = {}: each query row of multi-token decode sees its "
        "own number of compressed keys (a [B] count cannot say which keys the later rows see), "
        "got {}",
        shape_str(Shape{l.batch, l.rows}), context_lens.shape_str());
  }
  if (context_lens.dim() == 1) {
    detail::check_shape(context_lens, "context_lens", {l.batch}, "q.shape[0]");
  } else {
    detail::check_shape(context_lens, "context_lens", {l.batch, l.rows},
                        "[B, R]: a count per query row of q");
  }
  detail::check_device(context_lens, "context_lens", device, "q");
  detail::check_data(context_lens, "context_lens");
}

// ---------------------------------------------------------------------------------------
// qsa_mqa_prefill
// ---------------------------------------------------------------------------------------

// Returns k as its bytes are read (resolve_cache_dtype).
TensorView check_prefill(const TensorView& q, const TensorView& k_stored,
                         const std::optional<DType>& kv_cache_dtype) {
  detail::check_rank(q, "q", {3});
  detail::check_rank(k_stored, "k", {2, 3});
  const TensorView k = detail::resolve_cache_dtype(k_stored, "k", kv_cache_dtype);
  if (k.dim() == 3) detail::check_size(k, "k", 1, 1, "the shared key head");
  check_query_and_keys(q, "q", k, "k");
  return k;
}

detail::MqaPrefillParams prefill_params(const TensorView& q, const TensorView& k,
                                        const TensorView& row_starts, const TensorView& row_ends,
                                        const TensorView& out, float scale, StreamHandle stream) {
  const TensorView keys = k.dim() == 3 ? drop_axis(k, 1) : k;
  detail::MqaPrefillParams p{};
  p.dtype = q.dtype();
  p.k_dtype = keys.dtype();
  p.rows = q.size(0);
  p.heads = q.size(1);
  p.dim = q.size(2);
  p.q = q.data();
  p.q_row_stride = q.stride(0);
  p.q_head_stride = q.stride(1);
  p.q_dim_stride = q.stride(2);
  p.keys = keys.size(0);
  p.k = keys.data();
  p.k_row_stride = keys.stride(0);
  p.k_dim_stride = keys.stride(1);
  p.row_starts = meta_ptr(row_starts);
  p.row_starts_stride = row_starts.stride(0);
  p.row_ends = meta_ptr(row_ends);
  p.row_ends_stride = row_ends.stride(0);
  p.scale = scale;
  p.out = out.data_as<float>();
  p.out_row_stride = out.stride(0);
  p.out_col_stride = out.stride(1);
  p.stream = stream;
  return p;
}

}  // namespace

namespace detail {

float resolve_indexer_scale(const std::optional<double>& scale,
                            const std::optional<double>& score_scale, int64_t dim) {
  if (scale && score_scale) {
    throw_value_error(
        "scale: scale (a multiplier) and score_scale (a denominator) are mutually "
        "exclusive, got scale = {} and score_scale = {}",
        *scale, *score_scale);
  }
  if (scale) return detail::check_float32_scale(*scale, "scale");
  if (score_scale) {
    detail::check_float32_scale(*score_scale, "score_scale");
    return detail::check_float32_scale(1.0 / *score_scale, "score_scale", "1 / score_scale",
                                       *score_scale);
  }
  return static_cast<float>(1.0 / std::sqrt(static_cast<double>(dim)));
}

void check_indexer_metadata(const TensorView& t, const char* name, const Shape& shape,
                            std::string_view what, Device device, const char* device_ref) {
  detail::check_metadata_dtype(t, name);
  detail::check_shape(t, name, shape, what);
  detail::check_device(t, name, device, device_ref);
  detail::check_data(t, name);
}

void check_indexer_native(const char* op, const TensorView& q, const char* q_name) {
  if (q.size(-2) != kNativeHeads || q.size(-1) != kNativeDim) {
    throw_not_supported(
        "{}: backend 'native' supports heads == {} and dim == {}, got {} of shape "
        "{}; pass backend='reference'",
        op, kNativeHeads, kNativeDim, q_name, q.shape_str());
  }
}

// ---------------------------------------------------------------------------------------
// qsa_indexer_mqa_score
// ---------------------------------------------------------------------------------------

ScoreLayout check_score(const TensorView& q, const TensorView& k, const IndexerScoreOptions& o) {
  detail::check_rank(q, "q_idx", {3, 4});
  ScoreLayout l{};
  l.varlen = q.dim() == 3;
  l.paged = o.block_table.has_value();
  if (o.block_size != kQsaBlockSize) {
    throw_value_error("block_size: expected {} (QSA compresses four tokens per key), got {}",
                      kQsaBlockSize, o.block_size);
  }
  const Device dev = q.device();

  // Keys: logical [key_batch, N_B, D] or paged [pages, page_size, (1), D] behind block_table.
  int64_t key_batch;
  if (l.paged) {
    detail::check_rank(k, "block_keys", {3, 4});
    if (k.dim() == 4) detail::check_size(k, "block_keys", 2, 1, "the shared key head");
    l.page_size = k.size(1);
    if (o.page_size && *o.page_size != l.page_size) {
      throw_value_error("page_size: expected {} (block_keys.shape[1]), got {}", l.page_size,
                        *o.page_size);
    }
    if (l.page_size < 1) {
      throw_value_error("block_keys: expected a positive page size (shape[1]), got shape {}",
                        k.shape_str());
    }
    const TensorView& bt = *o.block_table;
    detail::check_metadata_dtype(bt, "block_table");
    detail::check_rank(bt, "block_table", {2});
    detail::check_device(bt, "block_table", dev, "q_idx");
    detail::check_data(bt, "block_table");
    key_batch = bt.size(0);
    l.num_blocks = detail::checked_size_product(bt.size(1), l.page_size, "block_table",
                                                "max_pages * page_size");
  } else {
    if (o.page_size) {
      throw_value_error(
          "page_size: only valid with block_table (a paged block_keys cache), got "
          "page_size = {} without block_table",
          *o.page_size);
    }
    detail::check_rank(k, "block_keys", {3});
    key_batch = k.size(0);
    l.num_blocks = k.size(1);
  }
  check_query_and_keys(q, "q_idx", k, "block_keys");

  // Requests and rows.
  if (!l.varlen) {
    for (const auto& [given, name] : {std::pair{o.cu_seqlens_q.has_value(), "cu_seqlens_q"},
                                      std::pair{o.token_to_req.has_value(), "token_to_req"},
                                      std::pair{o.num_requests.has_value(), "num_requests"}}) {
      if (given) {
        throw_value_error(
            "{}: only valid with varlen q_idx [total_q, heads, dim], got padded "
            "q_idx of shape {}",
            name, q.shape_str());
      }
    }
    l.batch = q.size(0);
    l.q_len = q.size(1);
    if (l.batch != key_batch) {
      throw_value_error("q_idx: expected shape[0] == {} ({}), got shape {}", key_batch,
                        l.paged ? "block_table.shape[0]" : "block_keys.shape[0]", q.shape_str());
    }
    if (o.query_positions) {
      check_indexer_metadata(*o.query_positions, "query_positions", {l.batch, l.q_len},
                             "q_idx.shape[:2]", dev, "q_idx");
    }
    if (o.seq_lens_q)
      check_indexer_metadata(*o.seq_lens_q, "seq_lens_q", {l.batch}, "q_idx.shape[0]", dev,
                             "q_idx");
    l.out_shape = {l.batch, l.q_len, l.num_blocks};
  } else {
    l.q_len = q.size(0);
    if (o.cu_seqlens_q.has_value() == o.token_to_req.has_value()) {
      throw_value_error(
          "cu_seqlens_q: varlen q_idx [total_q, heads, dim] needs exactly one of "
          "cu_seqlens_q and token_to_req, got {}",
          o.cu_seqlens_q ? "both" : "neither");
    }
    if (o.seq_lens_q) {
      throw_value_error(
          "seq_lens_q: only valid with padded q_idx [B, Q, heads, dim]; varlen "
          "rows come from cu_seqlens_q or token_to_req");
    }
    if (o.cu_seqlens_q) {
      if (o.num_requests) {
        throw_value_error(
            "num_requests: only valid with token_to_req, got it with "
            "cu_seqlens_q");
      }
      l.batch = key_batch;
      check_indexer_metadata(*o.cu_seqlens_q, "cu_seqlens_q", {key_batch + 1},
                             l.paged ? "block_table.shape[0] + 1" : "block_keys.shape[0] + 1", dev,
                             "q_idx");
      // int32 offsets end at total_q (the reference checks the values): more rows than
      // INT32_MAX cannot be described. Checked here from the shape and dtype, so that a
      // broadcast q_idx of 2**40 rows is refused by name before its output is allocated.
      if (o.cu_seqlens_q->dtype() == DType::kI32 && l.q_len > INT32_MAX) {
        throw_value_error(
            "q_idx: expected at most {} rows (cu_seqlens_q's int32 offsets end at total_q), got "
            "shape {}",
            INT32_MAX, q.shape_str());
      }
    } else {
      check_indexer_metadata(*o.token_to_req, "token_to_req", {l.q_len}, "q_idx.shape[0]", dev,
                             "q_idx");
      l.batch = o.num_requests.value_or(key_batch);
      if (l.batch < 0 || l.batch > key_batch) {
        throw_value_error("num_requests: expected a value in [0, {}] ({}), got {}", key_batch,
                          l.paged ? "block_table.shape[0]" : "block_keys.shape[0]", l.batch);
      }
      // docs/qsa.md, "Metadata": counting a request's rows would count a padding row that
      // carries a live request id, shifting the positions of the real rows behind it.
      if (!o.query_positions) {
        throw_value_error(
            "query_positions: required with token_to_req (one position per row, int32 or int64): "
            "positions inferred by counting each request's rows would shift when a padding row "
            "carries a live request id; mark padding rows with request id -1 or a negative "
            "position");
      }
    }
    if (o.query_positions) {
      check_indexer_metadata(*o.query_positions, "query_positions", {l.q_len}, "q_idx.shape[0]",
                             dev, "q_idx");
    }
    l.out_shape = {l.q_len, l.num_blocks};
  }
  return l;
}

void check_score_native(const char* op, const TensorView& q_idx, const TensorView& block_keys) {
  check_indexer_native(op, q_idx, "q_idx");
  check_vector_load_layout(q_idx, "q_idx");
  check_vector_load_layout(block_keys, "block_keys");
}

std::array<NamedInput, 7> score_inputs(const TensorView& q_idx, const TensorView& block_keys,
                                       const IndexerScoreOptions& o) {
  return {{{&q_idx, "q_idx"},
           {&block_keys, "block_keys"},
           {opt_ptr(o.block_table), "block_table"},
           {opt_ptr(o.cu_seqlens_q), "cu_seqlens_q"},
           {opt_ptr(o.token_to_req), "token_to_req"},
           {opt_ptr(o.query_positions), "query_positions"},
           {opt_ptr(o.seq_lens_q), "seq_lens_q"}}};
}

MqaScoreParams score_params(const ScoreLayout& l, const TensorView& q, const TensorView& k,
                            const IndexerScoreOptions& o, float scale) {
  MqaScoreParams p{};
  p.dtype = q.dtype();
  p.k_dtype = k.dtype();
  p.varlen = l.varlen;
  p.batch = l.batch;
  p.q_len = l.q_len;
  p.heads = q.size(-2);
  p.dim = q.size(-1);
  p.q = q.data();
  p.q_batch_stride = l.varlen ? 0 : q.stride(0);
  p.q_row_stride = q.stride(-3);
  p.q_head_stride = q.stride(-2);
  p.q_dim_stride = q.stride(-1);
  if (o.cu_seqlens_q) {
    p.cu_seqlens_q = meta_ptr(*o.cu_seqlens_q);
    p.cu_seqlens_q_stride = o.cu_seqlens_q->stride(0);
  }
  if (o.token_to_req) {
    p.token_to_req = meta_ptr(*o.token_to_req);
    p.token_to_req_stride = o.token_to_req->stride(0);
  }
  if (o.query_positions) {
    p.query_positions = meta_ptr(*o.query_positions);
    p.query_positions_batch_stride = l.varlen ? 0 : o.query_positions->stride(0);
    p.query_positions_row_stride = o.query_positions->stride(-1);
  }
  if (o.seq_lens_q) {
    p.seq_lens_q = meta_ptr(*o.seq_lens_q);
    p.seq_lens_q_stride = o.seq_lens_q->stride(0);
  }
  p.num_blocks = l.num_blocks;
  const TensorView keys = (l.paged && k.dim() == 4) ? drop_axis(k, 2) : k;
  p.k = keys.data();
  p.k_batch_stride = keys.stride(0);
  p.k_row_stride = keys.stride(1);
  p.k_dim_stride = keys.stride(2);
  if (l.paged) {
    p.block_table = meta_ptr(*o.block_table);
    p.block_table_batch_stride = o.block_table->stride(0);
    p.block_table_page_stride = o.block_table->stride(1);
    p.max_pages = o.block_table->size(1);
    p.page_size = l.page_size;
    p.num_pages = keys.size(0);
  }
  p.scale = scale;
  p.stream = o.stream;
  return p;
}

void set_score_out(MqaScoreParams& p, const ScoreLayout& l, const TensorView& out) {
  p.out = out.data_as<float>();
  p.out_batch_stride = l.varlen ? 0 : out.stride(0);
  p.out_row_stride = out.stride(-2);
  p.out_col_stride = out.stride(-1);
}

// ---------------------------------------------------------------------------------------
// qsa_mqa_decode
// ---------------------------------------------------------------------------------------

DecodeLayout check_decode_layout(const TensorView& q, int64_t max_model_len) {
  check_rank(q, "q", {3, 4});
  DecodeLayout l{q.size(0), q.dim() == 4 ? q.size(1) : 1, {}};
  if (l.rows < 1) {
    throw_value_error(
        "q: expected at least one query row per request (shape[1] >= 1), got shape {}",
        q.shape_str());
  }
  check_max_model_len(max_model_len);
  // B * R overflows only for a q without elements (H or D of 0): an error, not a wrapped size.
  l.out_shape = {checked_size_product(l.batch, l.rows, "q", "q.shape[0] * q.shape[1]"),
                 max_model_len};
  return l;
}

TensorView check_decode_inputs(const TensorView& q, const TensorView& k_stored,
                               const TensorView& page_table, const TensorView& context_lens,
                               const DecodeLayout& l, const std::optional<DType>& kv_cache_dtype) {
  check_rank(k_stored, "k_cache", {3, 4});
  const TensorView k_cache = resolve_cache_dtype(k_stored, "k_cache", kv_cache_dtype);
  if (k_cache.dim() == 4) check_size(k_cache, "k_cache", 2, 1, "the shared key head");
  check_query_and_keys(q, "q", k_cache, "k_cache");
  if (k_cache.size(1) < 1) {
    throw_value_error("k_cache: expected a positive page size (shape[1]), got shape {}",
                      k_cache.shape_str());
  }
  check_metadata_dtype(page_table, "page_table");
  check_rank(page_table, "page_table", {2});
  check_size(page_table, "page_table", 0, l.batch, "q.shape[0]");
  check_device(page_table, "page_table", q.device(), "q");
  check_data(page_table, "page_table");
  check_context_lens(context_lens, l, q.device());
  return k_cache;
}

MqaDecodeParams decode_params(const TensorView& q, const TensorView& k4,
                              const TensorView& page_table, const TensorView& context_lens,
                              int64_t max_model_len, float scale, StreamHandle stream) {
  const bool multi_row = q.dim() == 4;
  const TensorView k = k4.dim() == 4 ? drop_axis(k4, 2) : k4;
  MqaDecodeParams p{};
  p.dtype = q.dtype();
  p.k_dtype = k.dtype();
  p.batch = q.size(0);
  p.rows = multi_row ? q.size(1) : 1;
  p.heads = q.size(-2);
  p.dim = q.size(-1);
  p.q = q.data();
  p.q_batch_stride = q.stride(0);
  p.q_row_stride = multi_row ? q.stride(1) : 0;
  p.q_head_stride = q.stride(-2);
  p.q_dim_stride = q.stride(-1);
  p.k_cache = k.data();
  p.k_page_stride = k.stride(0);
  p.k_slot_stride = k.stride(1);
  p.k_dim_stride = k.stride(2);
  p.num_pages = k.size(0);
  p.page_size = k.size(1);
  p.page_table = meta_ptr(page_table);
  p.page_table_batch_stride = page_table.stride(0);
  p.page_table_page_stride = page_table.stride(1);
  p.max_pages = page_table.size(1);
  p.context_lens = meta_ptr(context_lens);
  p.context_lens_batch_stride = context_lens.stride(0);
  p.context_lens_row_stride = context_lens.dim() == 2 ? context_lens.stride(1) : 0;
  p.max_model_len = max_model_len;
  p.scale = scale;
  p.stream = stream;
  return p;
}

void set_decode_out(MqaDecodeParams& p, const TensorView& out) {
  p.out = out.data_as<float>();
  p.out_row_stride = out.stride(0);
  p.out_col_stride = out.stride(1);
}

void check_decode_native(const char* op, const TensorView& q, const DecodeLayout& l) {
  check_indexer_native(op, q, "q");
  if (l.rows > kNativeDecodeRows) {
    throw_not_supported(
        "q: backend 'native' takes at most {} query rows per request, got R = {} (q of shape "
        "{}); pass backend='reference'",
        kNativeDecodeRows, l.rows, q.shape_str());
  }
}

IndexerScoreOptions stage_score_options(HostStaging& host, const IndexerScoreOptions& o) {
  IndexerScoreOptions ho = o;
  ho.block_table = host.input(o.block_table);
  ho.cu_seqlens_q = host.input(o.cu_seqlens_q);
  ho.token_to_req = host.input(o.token_to_req);
  ho.query_positions = host.input(o.query_positions);
  ho.seq_lens_q = host.input(o.seq_lens_q);
  return ho;
}

}  // namespace detail

Shape qsa_indexer_mqa_score_shape(const TensorView& q_idx, const TensorView& block_keys,
                                  const IndexerScoreOptions& options) {
  return detail::check_score(
             q_idx, detail::resolve_cache_dtype(block_keys, "block_keys", options.kv_cache_dtype),
             options)
      .out_shape;
}

void qsa_indexer_mqa_score(const TensorView& q_idx, const TensorView& block_keys_stored,
                           const TensorView& out, const IndexerScoreOptions& o) {
  const TensorView block_keys =
      detail::resolve_cache_dtype(block_keys_stored, "block_keys", o.kv_cache_dtype);
  const detail::ScoreLayout l = detail::check_score(q_idx, block_keys, o);
  const float scale = detail::resolve_indexer_scale(o.scale, o.score_scale, q_idx.size(-1));
  check_out(out, l.out_shape, "qsa_indexer_mqa_score_shape", q_idx.device(), "q_idx",
            detail::score_inputs(q_idx, block_keys, o));
  auto params = [&](const TensorView& q, const TensorView& k, const TensorView& dst,
                    const IndexerScoreOptions& opts) {
    detail::MqaScoreParams p = detail::score_params(l, q, k, opts, scale);
    detail::set_score_out(p, l, dst);
    return p;
  };
  if (o.backend == Backend::kNative && !q_idx.device().is_cuda()) {  // the CPU backend
    cpu_mqa_score(params(q_idx, block_keys, out, o));
    return;
  }
  if (o.backend == Backend::kNative) {
    detail::check_score_native("qsa_indexer_mqa_score", q_idx, block_keys);
    detail::native_mqa_score(params(q_idx, block_keys, out, o));
    return;
  }
  detail::HostStaging host;
  const IndexerScoreOptions ho = detail::stage_score_options(host, o);
  const TensorView hq = host.input(q_idx);
  const TensorView hk = host.input(block_keys);
  const TensorView hout = host.output(out);
  detail::reference_mqa_score(params(hq, hk, hout, ho));
  host.commit();
}

Shape qsa_mqa_prefill_shape(const TensorView& q, const TensorView& k,
                            const MqaScoreOptions& options) {
  check_prefill(q, k, options.kv_cache_dtype);
  return {q.size(0), k.size(0)};
}

void qsa_mqa_prefill(const TensorView& q, const TensorView& k_stored, const TensorView& row_starts,
                     const TensorView& row_ends, const TensorView& out, const MqaScoreOptions& o) {
  const TensorView k = check_prefill(q, k_stored, o.kv_cache_dtype);
  const Device dev = q.device();
  detail::check_indexer_metadata(row_starts, "row_starts", {q.size(0)}, "q.shape[0]", dev, "q");
  detail::check_indexer_metadata(row_ends, "row_ends", {q.size(0)}, "q.shape[0]", dev, "q");
  const float scale = detail::resolve_indexer_scale(o.scale, o.score_scale, q.size(-1));
  const detail::NamedInput inputs[] = {
      {&q, "q"}, {&k, "k"}, {&row_starts, "row_starts"}, {&row_ends, "row_ends"}};
  check_out(out, {q.size(0), k.size(0)}, "[q.shape[0], k.shape[0]]", dev, "q", inputs);
  if (o.backend == Backend::kNative && !q.device().is_cuda()) {  // the CPU backend
    cpu_mqa_prefill(prefill_params(q, k, row_starts, row_ends, out, scale, o.stream));
    return;
  }
  if (o.backend == Backend::kNative) {
    detail::check_indexer_native("qsa_mqa_prefill", q, "q");
    detail::check_vector_load_layout(q, "q");
    detail::check_vector_load_layout(k, "k");
    detail::native_mqa_prefill(prefill_params(q, k, row_starts, row_ends, out, scale, o.stream));
    return;
  }
  detail::HostStaging host;
  const TensorView hq = host.input(q);
  const TensorView hk = host.input(k);
  const TensorView hs = host.input(row_starts);
  const TensorView he = host.input(row_ends);
  const TensorView hout = host.output(out);
  detail::reference_mqa_prefill(prefill_params(hq, hk, hs, he, hout, scale, o.stream));
  host.commit();
}

Shape qsa_mqa_decode_shape(const TensorView& q, int64_t max_model_len) {
  return detail::check_decode_layout(q, max_model_len).out_shape;
}

void qsa_mqa_decode(const TensorView& q, const TensorView& k_stored, const TensorView& page_table,
                    const TensorView& context_lens, int64_t max_model_len, const TensorView& out,
                    const MqaScoreOptions& o) {
  const detail::DecodeLayout l = detail::check_decode_layout(q, max_model_len);
  const TensorView k_cache =
      detail::check_decode_inputs(q, k_stored, page_table, context_lens, l, o.kv_cache_dtype);
  const float scale = detail::resolve_indexer_scale(o.scale, o.score_scale, q.size(-1));
  const detail::NamedInput inputs[] = {{&q, "q"},
                                       {&k_cache, "k_cache"},
                                       {&page_table, "page_table"},
                                       {&context_lens, "context_lens"}};
  check_out(out, l.out_shape, "qsa_mqa_decode_shape: [B * R, max_model_len]", q.device(), "q",
            inputs);
  auto params = [&](const TensorView& hq, const TensorView& hk, const TensorView& hpt,
                    const TensorView& hcl, const TensorView& dst) {
    detail::MqaDecodeParams p =
        detail::decode_params(hq, hk, hpt, hcl, max_model_len, scale, o.stream);
    detail::set_decode_out(p, dst);
    return p;
  };
  if (o.backend == Backend::kNative && !q.device().is_cuda()) {  // the CPU backend
    cpu_mqa_decode(params(q, k_cache, page_table, context_lens, out));
    return;
  }
  if (o.backend == Backend::kNative) {
    detail::check_decode_native("qsa_mqa_decode", q, l);
    detail::native_mqa_decode(params(q, k_cache, page_table, context_lens, out));
    return;
  }
  detail::HostStaging host;
  const TensorView hq = host.input(q);
  const TensorView hk = host.input(k_cache);
  const TensorView hpt = host.input(page_table);
  const TensorView hcl = host.input(context_lens);
  const TensorView hout = host.output(out);
  detail::reference_mqa_decode(params(hq, hk, hpt, hcl, hout));
  host.commit();
}

}  // namespace sparse_attn
