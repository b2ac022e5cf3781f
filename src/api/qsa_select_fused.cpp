// API boundary of the fused selections (qsa_indexer_select, qsa_mqa_decode_select): the score
// ops' validation (api/qsa_indexer_checks.h) plus the selection's, params, and the backend:
// native CUDA (src/cuda/select), the CPU backend or the reference (src/reference/
// qsa_select_ref.cpp, the composition in chunks). docs/qsa.md ("### Fused selection") states
// the rules.
#include <climits>
#include <optional>
#include <span>
#include <string_view>

#include "api/check.h"
#include "api/qsa_indexer_checks.h"
#include "api/qsa_select_params.h"
#include "api/staging.h"
#include "cpu/cpu_kernels.h"
#include "reference/qsa_indexer_ref.h"
#include "reference/qsa_select_ref.h"
#include "sparse_attn/qsa_select.h"

namespace sparse_attn {
namespace {

using detail::NamedInput;
using detail::throw_not_supported;
using detail::throw_value_error;

constexpr int64_t kBlockTokens = 4;
// The largest k whose expansion fits int32: token ids 4b + 3 and the width 4k + 3 (and so the
// valid counts, which are at most the width).
constexpr int64_t kMaxExpandedK = (INT32_MAX - (kBlockTokens - 1)) / kBlockTokens;

Shape with_last(Shape s, int64_t last) {
  s.back() = last;
  return s;
}

Shape drop_last(Shape s) {
  s.pop_back();
  return s;
}

// k blocks per row: block ids are int32, so no row has more than INT32_MAX to select; an
// expansion (token_indices or valid_counts wanted) must fit int32 too.
void check_k(int64_t k, bool expanded) {
  if (k < 1 || k > INT32_MAX) {
    throw_value_error("k: expected 1 to {} blocks per row (block ids are int32), got {}", INT32_MAX,
                      k);
  }
  if (expanded && k > kMaxExpandedK) {
    throw_value_error(
        "k: expected at most {} blocks per row with token_indices or valid_counts (token ids "
        "and the width 4k + 3 are int32), got {}",
        kMaxExpandedK, k);
  }
}

// The budget must hold the FP32 scores of one row: `num_blocks` of them.
void check_budget(size_t max_workspace_bytes, int64_t num_blocks) {
  const size_t row = sizeof(float) * static_cast<size_t>(num_blocks);
  if (max_workspace_bytes < row) {
    throw_value_error(
        "max_workspace_bytes: expected at least {} bytes (one row's FP32 scores: 4 * {} "
        "blocks), got {}",
        row, num_blocks, max_workspace_bytes);
  }
}

bool wants_expansion(const SelectOptions& s) {
  return s.token_indices.has_value() || s.valid_counts.has_value();
}

// An int32 output of an exact shape on `device`, writable by strides (no two elements at one
// address), sharing no byte with an input. Nothing for a missing output (api/check.h).
void check_int32_out(const TensorView& t, const char* name, const Shape& shape,
                     std::string_view what, Device device, const char* device_ref,
                     std::span<const NamedInput> inputs) {
  if (detail::is_missing(t)) return;  // reported after the op's other checks
  detail::check_dtype(t, name, {DType::kI32});
  detail::check_shape(t, name, shape, what);
  detail::check_device(t, name, device, device_ref);
  detail::check_positive_strides(t, name);
  detail::check_no_self_overlap(t, name);
  detail::check_data(t, name);
  for (const auto& [in, in_name] : inputs) {
    if (in != nullptr) detail::check_no_overlap(t, name, *in, in_name);
  }
}

// The three outputs and the workspace of a call: shapes from the score rows `rows` and k; no
// overlap with the inputs or with each other.
void check_outputs(const TensorView& block_ids, const SelectOptions& s, const Shape& rows,
                   int64_t k, Device device, const char* device_ref,
                   std::span<const NamedInput> inputs) {
  Shape ids_shape = rows, token_shape = rows;
  ids_shape.push_back(k);
  token_shape.push_back(kBlockTokens * k + kBlockTokens - 1);
  check_int32_out(block_ids, "block_ids", ids_shape, "the score rows + [k]", device, device_ref,
                  inputs);
  if (s.token_indices) {
    check_int32_out(*s.token_indices, "token_indices", token_shape, "the score rows + [4k + 3]",
                    device, device_ref, inputs);
    detail::check_no_overlap(*s.token_indices, "token_indices", block_ids, "block_ids");
  }
  if (s.valid_counts) {
    check_int32_out(*s.valid_counts, "valid_counts", rows, "the score rows", device, device_ref,
                    inputs);
    detail::check_no_overlap(*s.valid_counts, "valid_counts", block_ids, "block_ids");
    if (s.token_indices) {
      detail::check_no_overlap(*s.valid_counts, "valid_counts", *s.token_indices, "token_indices");
    }
  }
  if (s.workspace) {
    // Written by the native call, so it overlaps nothing else; its size is checked there.
    const TensorView& w = *s.workspace;
    detail::check_workspace(w, "workspace", device, device_ref);
    for (const auto& [in, in_name] : inputs) {
      if (in != nullptr) detail::check_no_overlap(w, "workspace", *in, in_name);
    }
    detail::check_no_overlap(w, "workspace", block_ids, "block_ids");
    if (s.token_indices)
      detail::check_no_overlap(w, "workspace", *s.token_indices, "token_indices");
    if (s.valid_counts) detail::check_no_overlap(w, "workspace", *s.valid_counts, "valid_counts");
  }
}

// Missing outputs (api/check.h), once every other argument is checked.
void check_not_missing(const TensorView& block_ids, const SelectOptions& s) {
  detail::check_not_missing(block_ids, "block_ids");
  detail::check_not_missing(s.token_indices, "token_indices");
  detail::check_not_missing(s.valid_counts, "valid_counts");
}

void check_native_k(int64_t k) {
  if (k > detail::kNativeSelectMaxK) {
    throw_not_supported(
        "k: backend 'native' selects at most {} blocks per row (its sort runs in shared memory), "
        "got {}; pass backend='reference'",
        detail::kNativeSelectMaxK, k);
  }
}

// Strides of an output over the score rows: (batch, row, col) of a [B, Q, ..] (batched) or
// [rows, ..] output, batch 0 for the latter; col 0 for an output without a column axis.
struct OutStrides {
  int64_t batch = 0, row = 0, col = 0;
};
OutStrides out_strides(const TensorView& t, bool batched, bool has_col) {
  if (detail::is_missing(t)) return {};
  const int lead = batched ? 1 : 0;
  return {batched ? t.stride(0) : 0, t.stride(lead), has_col ? t.stride(lead + 1) : 0};
}

// The selection's part of the params; block_ids may be missing (the workspace size functions).
detail::SelectOutputs select_outputs(int64_t k, const TensorView& block_ids, const SelectOptions& s,
                                     bool batched, Device device) {
  detail::SelectOutputs o{};
  o.k = k;
  if (!detail::is_missing(block_ids)) {
    const OutStrides st = out_strides(block_ids, batched, true);
    o.block_ids = block_ids.data_as<int32_t>();
    o.block_ids_batch_stride = st.batch;
    o.block_ids_row_stride = st.row;
    o.block_ids_col_stride = st.col;
  }
  if (s.token_indices && !detail::is_missing(*s.token_indices)) {
    const OutStrides st = out_strides(*s.token_indices, batched, true);
    o.token_indices = s.token_indices->data_as<int32_t>();
    o.token_indices_batch_stride = st.batch;
    o.token_indices_row_stride = st.row;
    o.token_indices_col_stride = st.col;
  }
  if (s.valid_counts && !detail::is_missing(*s.valid_counts)) {
    const OutStrides st = out_strides(*s.valid_counts, batched, false);
    o.valid_counts = s.valid_counts->data_as<int32_t>();
    o.valid_counts_batch_stride = st.batch;
    o.valid_counts_row_stride = st.row;
  }
  if (s.workspace) {
    o.workspace = s.workspace->data();
    o.workspace_bytes = static_cast<size_t>(s.workspace->size(0));
  }
  o.max_workspace_bytes = s.max_workspace_bytes;
  o.device_index = device.is_cuda() ? device.index : 0;
  return o;
}

// What the workspace size functions read of `s`: the outputs' presence, not their views (which
// they do not check); no workspace.
SelectOptions presence_only(const SelectOptions& s) {
  SelectOptions p = s;
  if (p.token_indices) p.token_indices = TensorView{};
  if (p.valid_counts) p.valid_counts = TensorView{};
  p.workspace.reset();
  return p;
}

// SelectOptions with the outputs swapped for host views (the reference on CUDA tensors).
SelectOptions staged(detail::HostStaging& host, const SelectOptions& s) {
  SelectOptions h = s;
  h.token_indices = host.output(s.token_indices);
  h.valid_counts = host.output(s.valid_counts);
  h.query_positions = host.input(s.query_positions);
  h.workspace.reset();  // not read by the reference
  return h;
}

// ---------------------------------------------------------------------------------------
// qsa_indexer_select
// ---------------------------------------------------------------------------------------

// A validated indexer selection, everything but the outputs.
struct IndexerCall {
  TensorView block_keys;  // as its bytes are read
  detail::ScoreLayout layout;
  float scale;
  Shape rows;  // the score rows: [B, Q] or [total_q]
  bool native_cuda;
};

IndexerCall check_indexer_call(const TensorView& q_idx, const TensorView& block_keys_stored,
                               int64_t k, const IndexerScoreOptions& o, const SelectOptions& s) {
  IndexerCall c;
  c.block_keys = detail::resolve_cache_dtype(block_keys_stored, "block_keys", o.kv_cache_dtype);
  c.layout = detail::check_score(q_idx, c.block_keys, o);
  c.scale = detail::resolve_indexer_scale(o.scale, o.score_scale, q_idx.size(-1));
  if (c.layout.num_blocks > INT32_MAX) {
    throw_value_error("{}: block ids must fit int32, got {} blocks per row",
                      c.layout.paged ? "block_table" : "block_keys", c.layout.num_blocks);
  }
  check_k(k, wants_expansion(s));
  if (s.query_positions) {
    throw_value_error(
        "query_positions: qsa_indexer_select takes the rows' positions from the score options "
        "(IndexerScoreOptions::query_positions); SelectOptions::query_positions is for "
        "qsa_mqa_decode_select only");
  }
  check_budget(s.max_workspace_bytes, c.layout.num_blocks);
  c.rows = drop_last(c.layout.out_shape);
  c.native_cuda = o.backend == Backend::kNative && q_idx.device().is_cuda();
  return c;
}

void check_indexer_native(const IndexerCall& c, const TensorView& q_idx, int64_t k) {
  detail::check_score_native("qsa_indexer_select", q_idx, c.block_keys);
  check_native_k(k);
}

detail::IndexerSelectParams indexer_params(const IndexerCall& c, const TensorView& q_idx,
                                           const TensorView& block_keys, int64_t k,
                                           const TensorView& block_ids,
                                           const IndexerScoreOptions& o, const SelectOptions& s) {
  detail::IndexerSelectParams p{};
  p.score = detail::score_params(c.layout, q_idx, block_keys, o, c.scale);
  p.select = select_outputs(k, block_ids, s, !c.layout.varlen, q_idx.device());
  return p;
}

// ---------------------------------------------------------------------------------------
// qsa_mqa_decode_select
// ---------------------------------------------------------------------------------------

struct DecodeCall {
  TensorView k_cache;  // as its bytes are read
  detail::DecodeLayout layout;
  float scale;
  Shape rows;  // [B * R]
  bool native_cuda;
};

// query_positions: one position per query row, [B, R]; [B] only when R == 1 (as context_lens).
void check_query_positions(const TensorView& t, const detail::DecodeLayout& l, Device device) {
  detail::check_metadata_dtype(t, "query_positions");
  if (t.dim() == 1 && l.rows == 1) {
    detail::check_shape(t, "query_positions", {l.batch}, "q.shape[0]");
  } else {
    detail::check_shape(t, "query_positions", {l.batch, l.rows},
                        "[B, R]: a position per query row of q ([B] when R == 1)");
  }
  detail::check_device(t, "query_positions", device, "q");
  detail::check_data(t, "query_positions");
}

DecodeCall check_decode_call(const TensorView& q, const TensorView& k_stored,
                             const TensorView& page_table, const TensorView& context_lens,
                             int64_t max_model_len, int64_t k, const MqaScoreOptions& o,
                             const SelectOptions& s) {
  DecodeCall c;
  c.layout = detail::check_decode_layout(q, max_model_len);
  c.k_cache = detail::check_decode_inputs(q, k_stored, page_table, context_lens, c.layout,
                                          o.kv_cache_dtype);
  c.scale = detail::resolve_indexer_scale(o.scale, o.score_scale, q.size(-1));
  check_k(k, wants_expansion(s));
  if (s.query_positions) {
    check_query_positions(*s.query_positions, c.layout, q.device());
  } else if (wants_expansion(s)) {
    throw_value_error(
        "query_positions: required with token_indices or valid_counts (int [B, R], the token "
        "position each query row expands at), got none");
  }
  check_budget(s.max_workspace_bytes, max_model_len);
  c.rows = drop_last(c.layout.out_shape);
  c.native_cuda = o.backend == Backend::kNative && q.device().is_cuda();
  return c;
}

void check_decode_native(const DecodeCall& c, const TensorView& q, int64_t k) {
  detail::check_decode_native("qsa_mqa_decode_select", q, c.layout);
  check_native_k(k);
}

detail::DecodeSelectParams decode_params(const DecodeCall& c, const TensorView& q,
                                         const TensorView& k_cache, const TensorView& page_table,
                                         const TensorView& context_lens, int64_t max_model_len,
                                         int64_t k, const TensorView& block_ids,
                                         const MqaScoreOptions& o, const SelectOptions& s) {
  detail::DecodeSelectParams p{};
  p.score =
      detail::decode_params(q, k_cache, page_table, context_lens, max_model_len, c.scale, o.stream);
  if (s.query_positions) {
    const TensorView& qp = *s.query_positions;
    p.query_positions = meta_ptr(qp);
    p.query_positions_batch_stride = qp.stride(0);
    p.query_positions_row_stride = qp.dim() == 2 ? qp.stride(1) : 0;
  }
  p.select = select_outputs(k, block_ids, s, false, q.device());
  return p;
}

}  // namespace

Shape qsa_indexer_select_shape(const TensorView& q_idx, const TensorView& block_keys, int64_t k,
                               const IndexerScoreOptions& options) {
  const Shape scores = qsa_indexer_mqa_score_shape(q_idx, block_keys, options);
  check_k(k, false);
  return with_last(scores, k);
}

size_t qsa_indexer_select_workspace_size(const TensorView& q_idx, const TensorView& block_keys,
                                         int64_t k, const IndexerScoreOptions& options,
                                         const SelectOptions& select_options) {
  const SelectOptions select = presence_only(select_options);
  const IndexerCall c = check_indexer_call(q_idx, block_keys, k, options, select);
  if (!c.native_cuda) return 0;
  check_indexer_native(c, q_idx, k);
  return detail::native_indexer_select_workspace_size(
      indexer_params(c, q_idx, c.block_keys, k, TensorView{}, options, select));
}

void qsa_indexer_select(const TensorView& q_idx, const TensorView& block_keys_stored, int64_t k,
                        const TensorView& block_ids, const IndexerScoreOptions& o,
                        const SelectOptions& s) {
  const IndexerCall c = check_indexer_call(q_idx, block_keys_stored, k, o, s);
  check_outputs(block_ids, s, c.rows, k, q_idx.device(), "q_idx",
                detail::score_inputs(q_idx, c.block_keys, o));
  if (c.native_cuda) {
    check_indexer_native(c, q_idx, k);
    // The size comes from shapes only, so a missing output does not change it.
    const detail::IndexerSelectParams p =
        indexer_params(c, q_idx, c.block_keys, k, block_ids, o, s);
    if (s.workspace) {
      detail::check_workspace_size(*s.workspace, "workspace",
                                   detail::native_indexer_select_workspace_size(p),
                                   "qsa_indexer_select_workspace_size");
    }
    check_not_missing(block_ids, s);
    detail::native_indexer_select(p);
    return;
  }
  check_not_missing(block_ids, s);
  if (o.backend == Backend::kNative) {  // the CPU backend (host tensors)
    detail::host_indexer_select(indexer_params(c, q_idx, c.block_keys, k, block_ids, o, s),
                                cpu_mqa_score);
    return;
  }
  detail::HostStaging host;
  const IndexerScoreOptions ho = detail::stage_score_options(host, o);
  const TensorView hq = host.input(q_idx);
  const TensorView hk = host.input(c.block_keys);
  const TensorView hids = host.output(block_ids);
  const SelectOptions hs = staged(host, s);
  detail::reference_indexer_select(indexer_params(c, hq, hk, k, hids, ho, hs));
  host.commit();
}

Shape qsa_mqa_decode_select_shape(const TensorView& q, int64_t k) {
  // The rows do not depend on the score width.
  const Shape scores = qsa_mqa_decode_shape(q, 0);
  check_k(k, false);
  return with_last(scores, k);
}

size_t qsa_mqa_decode_select_workspace_size(const TensorView& q, const TensorView& k_cache,
                                            const TensorView& page_table,
                                            const TensorView& context_lens, int64_t max_model_len,
                                            int64_t k, const MqaScoreOptions& options,
                                            const SelectOptions& select_options) {
  const SelectOptions select = presence_only(select_options);
  const DecodeCall c =
      check_decode_call(q, k_cache, page_table, context_lens, max_model_len, k, options, select);
  if (!c.native_cuda) return 0;
  check_decode_native(c, q, k);
  return detail::native_decode_select_workspace_size(decode_params(
      c, q, c.k_cache, page_table, context_lens, max_model_len, k, TensorView{}, options, select));
}

void qsa_mqa_decode_select(const TensorView& q, const TensorView& k_stored,
                           const TensorView& page_table, const TensorView& context_lens,
                           int64_t max_model_len, int64_t k, const TensorView& block_ids,
                           const MqaScoreOptions& o, const SelectOptions& s) {
  const DecodeCall c =
      check_decode_call(q, k_stored, page_table, context_lens, max_model_len, k, o, s);
  const NamedInput inputs[] = {{&q, "q"},
                               {&c.k_cache, "k_cache"},
                               {&page_table, "page_table"},
                               {&context_lens, "context_lens"},
                               {detail::opt_ptr(s.query_positions), "query_positions"}};
  check_outputs(block_ids, s, c.rows, k, q.device(), "q", inputs);
  auto params = [&](const TensorView& hq, const TensorView& hk, const TensorView& hpt,
                    const TensorView& hcl, const TensorView& hids, const SelectOptions& hs) {
    return decode_params(c, hq, hk, hpt, hcl, max_model_len, k, hids, o, hs);
  };
  if (c.native_cuda) {
    check_decode_native(c, q, k);
    // The size comes from shapes only, so a missing output does not change it.
    const detail::DecodeSelectParams p =
        params(q, c.k_cache, page_table, context_lens, block_ids, s);
    if (s.workspace) {
      detail::check_workspace_size(*s.workspace, "workspace",
                                   detail::native_decode_select_workspace_size(p),
                                   "qsa_mqa_decode_select_workspace_size");
    }
    check_not_missing(block_ids, s);
    detail::native_decode_select(p);
    return;
  }
  check_not_missing(block_ids, s);
  if (o.backend == Backend::kNative) {  // the CPU backend (host tensors)
    detail::host_decode_select(params(q, c.k_cache, page_table, context_lens, block_ids, s),
                               cpu_mqa_decode);
    return;
  }
  detail::HostStaging host;
  const TensorView hq = host.input(q);
  const TensorView hk = host.input(c.k_cache);
  const TensorView hpt = host.input(page_table);
  const TensorView hcl = host.input(context_lens);
  const TensorView hids = host.output(block_ids);
  const SelectOptions hs = staged(host, s);
  detail::reference_decode_select(params(hq, hk, hpt, hcl, hids, hs));
  host.commit();
}

}  // namespace sparse_attn
