// qsa_sparse_attention: validation, backend choice and params filling.
//
// validate() checks every argument against the seed's rules, reading only metadata, and decides
// the problem (layouts, sizes, scale); fill_params() turns a set of views into the plain params
// struct the backends take. The reference fills params from host-staged copies of the views,
// the native path from the caller's views directly.
#include <cmath>
#include <limits>
#include <numbers>
#include <string>

#include "api/check.h"
#include "api/qsa_attention_params.h"
#include "api/staging.h"
#include "cpu/cpu_kernels.h"
#include "reference/qsa_attention_ref.h"
#include "sparse_attn/qsa.h"

namespace sparse_attn {
namespace {

using detail::check_data;
using detail::check_device;
using detail::check_dtype;
using detail::check_rank;
using detail::check_shape;
using detail::check_size;
using detail::throw_not_supported;
using detail::throw_type_error;
using detail::throw_value_error;

// The canonical Qwen geometry; the structured native variants exist only for it.
constexpr int64_t kCanonicalQHeads = 24;
constexpr int64_t kCanonicalKVHeads = 2;
constexpr int64_t kNativeHeadDim = 256;
constexpr int64_t kNativeMaxGroup = 16;  // GQA group rows fit one native compute tile
constexpr int64_t kMaxHintBlocks = 512;  // block_indices width limit of the seed

// Every tensor of one call. `indices` is token_indices or, in physical mode,
// selected_kv_indices.
struct Views {
  TensorView query, key, value, out;
  TensorView indices;
  std::optional<TensorView> lse, block_indices, gate, cu_seqlens_q, token_to_req, cu_seqlens_k,
      block_table, seq_lens_q, seq_lens_k, query_positions;
};

// The stride that steps one row when the leading `n` axes (already checked to form a row
// view) are collapsed: the stride of the innermost of them longer than 1. With every one of
// them of size 1 there is at most one row and the stride is never used.
int64_t row_stride(const TensorView& t, int n) {
  for (int d = n - 1; d >= 0; --d) {
    if (t.size(d) > 1) return t.stride(d);
  }
  return 0;
}

// Shape of `query` without its last axis: the LSE shape and the per-head gate shape.
Shape drop_last(const TensorView& t) {
  Shape s = t.shape();
  s.pop_back();
  return s;
}

// A metadata tensor: int32 or int64 (read as stored), exact shape, device and data.
void check_metadata(const TensorView& t, std::string_view name, const Shape& shape,
                    std::string_view what, Device device) {
  detail::check_metadata_dtype(t, name);
  check_shape(t, name, shape, what);
  check_device(t, name, device, "query");
  check_data(t, name);
}

// The position rule of token_to_req layouts (docs/qsa.md, "Metadata"): a row's index within
// its request could only be counted from the ids of the rows before it, and a padding row that
// carries a live request id (as graph-padded batches have) would count as a real row of that
// request, shifting the inferred positions of its real rows and, with seq_lens_q, which of its
// rows are real: a silently wrong answer. So positions are required and nothing is counted.
void check_token_to_req_rule(const Views& v) {
  if (!v.query_positions) {
    throw_value_error(
        "query_positions: required with token_to_req (one position per query row, int32 or "
        "int64): positions inferred by counting each request's rows would shift when a padding "
        "row carries a live request id; mark padding rows with request id -1 or a negative "
        "position");
  }
  if (v.seq_lens_q) {
    throw_value_error(
        "seq_lens_q: cannot be combined with token_to_req: which rows of a request are real "
        "would be counted from the row order, which a padding row carrying a live request id "
        "shifts; mark padding rows with request id -1 or a negative query position instead");
  }
}

// k_scale / v_scale (`name`) for K/V `kv` (docs/qsa.md, "FP8 caches"): a positive finite float32
// for FP8 K/V, exactly 1 for 16-bit K/V, whose values are used as stored.
float check_kv_scale(double scale, const char* name, const TensorView& kv) {
  if (kv.dtype() != DType::kF8E4M3 && scale != 1.0) {
    throw_value_error(
        "{}: expected 1.0 for {} K/V (a dequantisation scale applies to FP8 e4m3 K/V only), got "
        "{}",
        name, dtype_name(kv.dtype()), scale);
  }
  return detail::check_float32_scale(scale, name);
}

// Checks everything and returns the params with sizes, layouts and scalars decided (pointers
// and strides are filled later, from whichever views the backend reads).
SparseAttentionParams validate(const Views& v, bool physical, const SparseAttentionOptions& o) {
  SparseAttentionParams p;
  const TensorView& q = v.query;
  const Device dev = q.device();

  // ----- query ----------------------------------------------------------------------------
  check_rank(q, "query", {3, 4});
  check_dtype(q, "query", {DType::kBF16, DType::kF16});
  check_data(q, "query");
  const bool padded_q = q.dim() == 4;
  const int nrow_axes = padded_q ? 2 : 1;
  p.dtype = q.dtype();
  p.num_q_heads = q.size(-2);
  p.head_dim = q.size(-1);
  p.q_len = padded_q ? q.size(1) : 0;
  p.rows = padded_q ? q.size(0) * q.size(1) : q.size(0);
  if (p.num_q_heads < 1 || p.head_dim < 1) {
    throw_value_error("query: expected at least one head and a nonzero head_dim, got shape {}",
                      q.shape_str());
  }
  detail::check_row_view(q, "query", nrow_axes);
  const Shape row_shape(q.sizes(), q.sizes() + nrow_axes);  // [B, Q] or [total_q]

  // ----- scalars --------------------------------------------------------------------------
  if (o.scale && o.softmax_scale) {
    throw_value_error(
        "scale, softmax_scale: softmax_scale is an alias of scale; pass one, got "
        "both ({} and {})",
        *o.scale, *o.softmax_scale);
  }
  const std::optional<double> scale = o.scale ? o.scale : o.softmax_scale;
  const char* scale_name = o.scale ? "scale" : "softmax_scale";
  p.scale = scale ? detail::check_float32_scale(*scale, scale_name)
                  : static_cast<float>(1.0 / std::sqrt(static_cast<double>(p.head_dim)));
  // The native kernels' softmax runs on exp2, with the scale in log2 units.
  p.scale_log2 = detail::check_float32_scale(static_cast<double>(p.scale) * std::numbers::log2e,
                                             scale_name, "scale * log2(e)", p.scale);
  if (o.compute_dtype != DType::kBF16 && o.compute_dtype != q.dtype()) {
    throw_value_error(
        "compute_dtype: expected bfloat16 or the query dtype ({}), got {}; FP8 compute is not "
        "enabled",
        dtype_name(q.dtype()), dtype_name(o.compute_dtype));
  }
  if (o.num_splits && (*o.num_splits < 1 || *o.num_splits > std::numeric_limits<int>::max())) {
    throw_value_error(
        "num_splits: expected a positive split count (1 disables SplitKV) or none "
        "for the heuristic, got {}",
        *o.num_splits);
  }
  p.num_splits = o.num_splits ? static_cast<int>(*o.num_splits) : 0;
  p.warp_specialized = o.warp_specialized;
  p.assume_compact_blocks = o.assume_compact_blocks;
  p.device_index = dev.is_cuda() ? dev.index : 0;
  p.stream = o.stream;

  // ----- key / value ----------------------------------------------------------------------
  const TensorView& k = v.key;
  check_rank(k, "key", {3, 4});
  if (k.dtype() != q.dtype() && k.dtype() != DType::kF8E4M3) {
    throw_type_error("key: expected dtype {} (the query's) or float8_e4m3fn (FP8 K/V), got {}",
                     dtype_name(q.dtype()), dtype_name(k.dtype()));
  }
  check_device(k, "key", dev, "query");
  check_data(k, "key");
  check_dtype(v.value, "value", {k.dtype()});
  check_device(v.value, "value", dev, "query");
  check_shape(v.value, "value", k.shape(), "the shape of key");
  check_data(v.value, "value");
  p.num_kv_heads = k.size(-2);
  if (k.size(-1) != p.head_dim) {
    throw_value_error("key: expected head_dim {} (query.shape[-1]) in shape[-1], got shape {}",
                      p.head_dim, k.shape_str());
  }
  if (p.num_kv_heads < 1 || p.num_q_heads % p.num_kv_heads != 0) {
    throw_value_error(
        "key: expected a KV head count (shape[-2]) that divides the {} query heads, got shape {}",
        p.num_q_heads, k.shape_str());
  }
  p.group = p.num_q_heads / p.num_kv_heads;
  p.kv_dtype = k.dtype();
  p.k_scale = check_kv_scale(o.k_scale, "k_scale", k);
  p.v_scale = check_kv_scale(o.v_scale, "v_scale", v.value);

  // ----- physical mode: flattened BF16 Q/K/V and row ids, nothing logical -----------------
  if (physical) {
    const std::pair<const std::optional<TensorView>*, const char*> logical[] = {
        {&v.block_indices, "block_indices"},
        {&v.cu_seqlens_q, "cu_seqlens_q"},
        {&v.token_to_req, "token_to_req"},
        {&v.cu_seqlens_k, "cu_seqlens_k"},
        {&v.seq_lens_q, "seq_lens_q"},
        {&v.seq_lens_k, "seq_lens_k"},
        {&v.query_positions, "query_positions"},
        {&v.block_table, "block_table"},
        {&v.gate, "gate"}};
    for (const auto& [arg, name] : logical) {
      if (arg->has_value()) {
        throw_value_error(
            "{}: cannot be combined with selected_kv_indices (physical indices take no logical "
            "request/page metadata and no gate)",
            name);
      }
    }
    if (o.num_requests) {
      throw_value_error(
          "num_requests: cannot be combined with selected_kv_indices (physical "
          "indices take no logical request metadata)");
    }
    if (o.page_size) {
      throw_value_error(
          "page_size: cannot be combined with selected_kv_indices (physical "
          "indices take no page metadata)");
    }
    if (padded_q) {
      throw_value_error(
          "query: selected_kv_indices needs flattened queries [rows, Hq, D], got "
          "shape {}",
          q.shape_str());
    }
    if (k.dim() != 3) {
      throw_value_error(
          "key: selected_kv_indices needs flattened K/V [total_kv, Hkv, D], got "
          "shape {}",
          k.shape_str());
    }
    check_dtype(q, "query", {DType::kBF16});
    check_dtype(k, "key", {DType::kBF16, DType::kF8E4M3});
    const TensorView& s = v.indices;
    detail::check_metadata_dtype(s, "selected_kv_indices");
    check_rank(s, "selected_kv_indices", {2});
    check_size(s, "selected_kv_indices", 0, p.rows, "query rows");
    check_device(s, "selected_kv_indices", dev, "query");
    check_data(s, "selected_kv_indices");
    p.width = s.size(1);
    p.kv_layout = KVLayout::kPhysical;
    p.total_kv = k.size(0);
    p.row_mapping = RowMapping::kNone;
  } else {
    // ----- K/V layout -----------------------------------------------------------------------
    if (v.block_table) {
      const TensorView& bt = *v.block_table;
      if (k.dim() != 4) {
        throw_value_error(
            "key: block_table makes key a paged cache [pages, page_size, Hkv, D], "
            "got shape {}",
            k.shape_str());
      }
      if (v.cu_seqlens_k) {
        throw_value_error(
            "cu_seqlens_k: describes flattened-varlen K/V and cannot be combined "
            "with block_table");
      }
      detail::check_metadata_dtype(bt, "block_table");
      check_rank(bt, "block_table", {2});
      check_device(bt, "block_table", dev, "query");
      check_data(bt, "block_table");
      p.kv_layout = KVLayout::kPaged;
      p.num_pages = k.size(0);
      p.page_size = k.size(1);
      p.max_pages = bt.size(1);
      p.batch = bt.size(0);
      p.kv_capacity = p.max_pages * p.page_size;
      if (o.page_size && *o.page_size != p.page_size) {
        throw_value_error(
            "page_size: expected key.shape[1] == {} (the page size of the cache), "
            "got {}",
            p.page_size, *o.page_size);
      }
      if (p.page_size < 1) {
        throw_value_error("key: expected a page size (shape[1]) of at least 1, got shape {}",
                          k.shape_str());
      }
    } else {
      if (o.page_size) {
        throw_value_error("page_size: given without block_table (only paged K/V has pages)");
      }
      if (k.dim() == 4) {
        if (v.cu_seqlens_k) {
          throw_value_error(
              "cu_seqlens_k: describes flattened-varlen K/V [total_k, Hkv, D], but "
              "key is padded with shape {}",
              k.shape_str());
        }
        p.kv_layout = KVLayout::kPadded;
        p.batch = k.size(0);
        p.kv_capacity = k.size(1);
      } else {
        if (!v.cu_seqlens_k) {
          throw_value_error(
              "cu_seqlens_k: required for flattened-varlen K/V (key shape {}); "
              "padded K/V is [B, S_k, Hkv, D], paged K/V needs block_table",
              k.shape_str());
        }
        const TensorView& cu = *v.cu_seqlens_k;
        detail::check_metadata_dtype(cu, "cu_seqlens_k");
        check_rank(cu, "cu_seqlens_k", {1});
        if (cu.size(0) < 1) {
          throw_value_error("cu_seqlens_k: expected [B + 1] offsets, got shape {}", cu.shape_str());
        }
        check_device(cu, "cu_seqlens_k", dev, "query");
        check_data(cu, "cu_seqlens_k");
        p.kv_layout = KVLayout::kVarlen;
        p.batch = cu.size(0) - 1;
        p.total_kv = k.size(0);
      }
    }

    // ----- query rows -> requests -------------------------------------------------------------
    if (padded_q) {
      if (q.size(0) != p.batch) {
        throw_value_error(
            "query: expected batch shape[0] == {} (the requests of the K/V "
            "layout), got shape {}",
            p.batch, q.shape_str());
      }
      if (v.cu_seqlens_q || v.token_to_req || o.num_requests) {
        throw_value_error(
            "{}: describes flattened queries [total_q, Hq, D], but query is "
            "padded with shape {}",
            v.cu_seqlens_q ? "cu_seqlens_q" : (v.token_to_req ? "token_to_req" : "num_requests"),
            q.shape_str());
      }
      p.row_mapping = RowMapping::kPadded;
    } else if (v.cu_seqlens_q) {
      if (v.token_to_req) {
        throw_value_error(
            "token_to_req: pass either cu_seqlens_q or token_to_req to map "
            "flattened query rows to requests, not both");
      }
      if (o.num_requests) {
        throw_value_error(
            "num_requests: goes with token_to_req; cu_seqlens_q already gives "
            "the request count");
      }
      check_metadata(*v.cu_seqlens_q, "cu_seqlens_q", {p.batch + 1}, "B + 1, B from the K/V layout",
                     dev);
      p.row_mapping = RowMapping::kCuSeqlens;
    } else if (v.token_to_req) {
      if (o.num_requests && *o.num_requests != p.batch) {
        throw_value_error("num_requests: expected {} (the requests of the K/V layout), got {}",
                          p.batch, *o.num_requests);
      }
      check_metadata(*v.token_to_req, "token_to_req", {p.rows}, "one request id per query row",
                     dev);
      p.row_mapping = RowMapping::kTokenToReq;
    } else {
      if (o.num_requests) {
        throw_value_error("num_requests: goes with token_to_req, which was not given");
      }
      if (p.batch != 1) {
        throw_value_error(
            "cu_seqlens_q: flattened queries need cu_seqlens_q or token_to_req "
            "when the K/V layout holds {} requests (only a single request needs "
            "neither)",
            p.batch);
      }
      p.row_mapping = RowMapping::kSingleRequest;
    }
    if (v.seq_lens_q) check_metadata(*v.seq_lens_q, "seq_lens_q", {p.batch}, "[B]", dev);
    if (v.seq_lens_k) check_metadata(*v.seq_lens_k, "seq_lens_k", {p.batch}, "[B]", dev);
    if (v.query_positions) {
      check_metadata(*v.query_positions, "query_positions", row_shape,
                     "query.shape[:-2], one position per query row", dev);
    }
    if (p.row_mapping == RowMapping::kTokenToReq) check_token_to_req_rule(v);

    // ----- token_indices and the block hint -------------------------------------------------
    const TensorView& t = v.indices;
    detail::check_metadata_dtype(t, "token_indices");
    check_rank(t, "token_indices", {nrow_axes + 1});
    Shape want = row_shape;
    want.push_back(t.size(-1));
    check_shape(t, "token_indices", want, "query.shape[:-2] + [W]");
    check_device(t, "token_indices", dev, "query");
    check_data(t, "token_indices");
    detail::check_row_view(t, "token_indices", nrow_axes);
    p.width = t.size(-1);
    if (v.block_indices) {
      const TensorView& b = *v.block_indices;
      detail::check_metadata_dtype(b, "block_indices");
      check_rank(b, "block_indices", {nrow_axes + 1});
      const int64_t nb = b.size(-1);
      if (nb < 1 || nb > kMaxHintBlocks) {
        throw_value_error(
            "block_indices: expected between 1 and {} blocks per row (shape[-1]), "
            "got shape {}; wider selections use the token-only path",
            kMaxHintBlocks, b.shape_str());
      }
      if (p.width != 4 * nb + 3) {
        throw_value_error(
            "block_indices: expected token_indices.shape[-1] == 4 * "
            "block_indices.shape[-1] + 3 == {}, got token width {} (shape {})",
            4 * nb + 3, p.width, b.shape_str());
      }
      Shape bwant = row_shape;
      bwant.push_back(nb);
      check_shape(b, "block_indices", bwant, "query.shape[:-2] + [nb]");
      check_device(b, "block_indices", dev, "query");
      check_data(b, "block_indices");
      detail::check_row_view(b, "block_indices", nrow_axes);
      p.num_blocks = nb;
    }
  }

  // ----- gate -----------------------------------------------------------------------------
  if (v.gate) {
    const TensorView& g = *v.gate;
    check_dtype(g, "gate", {q.dtype()});
    if (g.shape() == q.shape()) {
      p.gate_kind = GateKind::kElementwise;
    } else if (g.shape() == drop_last(q)) {
      p.gate_kind = GateKind::kPerHead;
    } else {
      throw_value_error(
          "gate: expected the query shape {} (element-wise) or {} (one value per "
          "head), got {}",
          q.shape_str(), shape_str(drop_last(q)), g.shape_str());
    }
    check_device(g, "gate", dev, "query");
    check_data(g, "gate");
    detail::check_row_view(g, "gate", nrow_axes);
  }

  return p;
}

// Calls fn(view, name) for every input tensor of the call.
template <typename Fn>
void for_each_input(const Views& v, bool physical, Fn&& fn) {
  fn(v.query, "query");
  fn(v.key, "key");
  fn(v.value, "value");
  fn(v.indices, physical ? "selected_kv_indices" : "token_indices");
  const std::pair<const std::optional<TensorView>*, const char*> optional_inputs[] = {
      {&v.block_indices, "block_indices"},    {&v.gate, "gate"},
      {&v.cu_seqlens_q, "cu_seqlens_q"},      {&v.token_to_req, "token_to_req"},
      {&v.cu_seqlens_k, "cu_seqlens_k"},      {&v.block_table, "block_table"},
      {&v.seq_lens_q, "seq_lens_q"},          {&v.seq_lens_k, "seq_lens_k"},
      {&v.query_positions, "query_positions"}};
  for (const auto& [in, in_name] : optional_inputs) {
    if (in->has_value()) fn(**in, in_name);
  }
}

// out and lse: dtype, shape, device, writable layouts, no overlap with any input or each other.
void check_outputs(const Views& v, bool physical) {
  const TensorView& q = v.query;
  const int nrow_axes = q.dim() == 4 ? 2 : 1;
  auto check_output = [&](const TensorView& out, const char* name, DType dtype, const Shape& shape,
                          std::string_view what) {
    if (detail::is_missing(out)) return;  // reported after the workspace checks
    check_dtype(out, name, {dtype});
    check_shape(out, name, shape, what);
    check_device(out, name, q.device(), "query");
    check_data(out, name);
    detail::check_positive_strides(out, name);
    detail::check_no_self_overlap(out, name);
    detail::check_row_view(out, name, nrow_axes);
    for_each_input(v, physical, [&](const TensorView& in, const char* in_name) {
      detail::check_no_overlap(out, name, in, in_name);
    });
  };
  check_output(v.out, "out", q.dtype(), q.shape(), "the query shape");
  if (v.lse) {
    check_output(*v.lse, "lse", DType::kF32, drop_last(q), "query.shape[:-1]");
    detail::check_no_overlap(*v.lse, "lse", v.out, "out");
  }
}

// options.workspace, except its size: it is written, so it overlaps nothing else.
void check_workspace(const TensorView& w, const Views& v, bool physical) {
  detail::check_workspace(w, "workspace", v.query.device(), "query");
  for_each_input(v, physical, [&](const TensorView& in, const char* in_name) {
    detail::check_no_overlap(w, "workspace", in, in_name);
  });
  detail::check_no_overlap(w, "workspace", v.out, "out");
  if (v.lse) detail::check_no_overlap(w, "workspace", *v.lse, "lse");
}

// Native-only rules: CUDA tensors, and the combinations the native kernels implement.
void check_native(const Views& v, const SparseAttentionParams& p) {
  if (!v.query.device().is_cuda()) {
    throw_not_supported(
        "query: backend 'native' runs on CUDA tensors, got device {}; pass "
        "backend='reference' for the CPU reference",
        v.query.device().str());
  }
  if (p.head_dim != kNativeHeadDim) {
    throw_not_supported(
        "query: backend 'native' supports head_dim {}, got {} (shape {}); use "
        "backend='reference'",
        kNativeHeadDim, p.head_dim, v.query.shape_str());
  }
  if (p.group > kNativeMaxGroup) {
    throw_not_supported(
        "key: backend 'native' supports GQA groups up to {} query heads per KV "
        "head, got {} / {} = {}; use backend='reference'",
        kNativeMaxGroup, p.num_q_heads, p.num_kv_heads, p.group);
  }
  if (p.warp_specialized && (p.num_q_heads != kCanonicalQHeads ||
                             p.num_kv_heads != kCanonicalKVHeads || p.head_dim != kNativeHeadDim)) {
    throw_not_supported(
        "warp_specialized: requires the canonical geometry {}/{}/{} "
        "(Hq/Hkv/D), got {}/{}/{}",
        kCanonicalQHeads, kCanonicalKVHeads, kNativeHeadDim, p.num_q_heads, p.num_kv_heads,
        p.head_dim);
  }
  switch (p.kv_layout) {
    case KVLayout::kVarlen:
      throw_not_supported(
          "cu_seqlens_k: flattened-varlen K/V is reference-only; use paged K/V "
          "(block_table) or backend='reference'");
    case KVLayout::kPadded:
      if (p.row_mapping != RowMapping::kPadded) {
        throw_not_supported(
            "query: backend 'native' with nonpaged K/V needs padded queries "
            "[B, Q, Hq, D]; flattened queries need paged K/V (block_table)");
      }
      if (p.num_splits > 1) {
        throw_not_supported(
            "num_splits: backend 'native' with nonpaged K/V needs num_splits=1; "
            "SplitKV needs paged K/V (block_table), got {}",
            p.num_splits);
      }
      break;
    case KVLayout::kPaged:
    case KVLayout::kPhysical:
      break;
  }
  // The kernels hold token ids in 32 bits and read int64 ones saturated (api/meta_ptr.h),
  // which is exact while every token they could address has an int32 id.
  const int64_t addressable = p.kv_layout == KVLayout::kPhysical ? p.total_kv : p.kv_capacity;
  const char* ids_name =
      p.kv_layout == KVLayout::kPhysical ? "selected_kv_indices" : "token_indices";
  const bool wide_ids = v.indices.dtype() == DType::kI64 ||
                        (v.block_indices && v.block_indices->dtype() == DType::kI64);
  if (wide_ids && addressable > std::numeric_limits<int32_t>::max()) {
    throw_not_supported(
        "{}: backend 'native' takes int64 token ids for K/V of at most 2^31 - 1 tokens per "
        "request, got {}; pass int32 ids or backend='reference'",
        ids_name, addressable);
  }
  detail::check_vector_load_layout(v.key, "key");
  detail::check_vector_load_layout(v.value, "value");
}

// Pointers and strides of `v` into `p` (sizes and layouts already decided by validate()).
void fill_params(SparseAttentionParams& p, const Views& v) {
  const int n = p.row_mapping == RowMapping::kPadded ? 2 : 1;
  const TensorView& q = v.query;
  p.q = q.data();
  p.q_row_stride = row_stride(q, n);
  p.q_head_stride = q.stride(-2);
  p.q_dim_stride = q.stride(-1);

  const bool rank4 = v.key.dim() == 4;
  const TensorView& k = v.key;
  p.k = k.data();
  p.k_batch_stride = rank4 ? k.stride(0) : 0;
  p.k_token_stride = k.stride(-3);
  p.k_head_stride = k.stride(-2);
  p.k_dim_stride = k.stride(-1);
  const TensorView& val = v.value;
  p.v = val.data();
  p.v_batch_stride = rank4 ? val.stride(0) : 0;
  p.v_token_stride = val.stride(-3);
  p.v_head_stride = val.stride(-2);
  p.v_dim_stride = val.stride(-1);

  p.out = v.out.data();
  p.out_row_stride = row_stride(v.out, n);
  p.out_head_stride = v.out.stride(-2);
  p.out_dim_stride = v.out.stride(-1);
  if (v.lse) {
    p.lse = v.lse->data_as<float>();
    p.lse_row_stride = row_stride(*v.lse, n);
    p.lse_head_stride = v.lse->stride(-1);
  }
  if (v.gate) {
    p.gate = v.gate->data();
    p.gate_row_stride = row_stride(*v.gate, n);
    p.gate_head_stride = v.gate->stride(n);
    p.gate_dim_stride = p.gate_kind == GateKind::kElementwise ? v.gate->stride(-1) : 0;
  }
  p.token_indices = meta_ptr(v.indices);
  p.token_indices_row_stride = row_stride(v.indices, n);
  p.token_indices_col_stride = v.indices.stride(-1);
  if (v.block_indices) {
    p.block_indices = meta_ptr(*v.block_indices);
    p.block_indices_row_stride = row_stride(*v.block_indices, n);
    p.block_indices_col_stride = v.block_indices->stride(-1);
  }
  if (v.cu_seqlens_q) {
    p.cu_seqlens_q = meta_ptr(*v.cu_seqlens_q);
    p.cu_seqlens_q_stride = v.cu_seqlens_q->stride(0);
  }
  if (v.token_to_req) {
    p.token_to_req = meta_ptr(*v.token_to_req);
    p.token_to_req_stride = v.token_to_req->stride(0);
  }
  if (v.cu_seqlens_k) {
    p.cu_seqlens_k = meta_ptr(*v.cu_seqlens_k);
    p.cu_seqlens_k_stride = v.cu_seqlens_k->stride(0);
  }
  if (v.block_table) {
    p.block_table = meta_ptr(*v.block_table);
    p.block_table_batch_stride = v.block_table->stride(0);
    p.block_table_page_stride = v.block_table->stride(1);
  }
  if (v.seq_lens_q) {
    p.seq_lens_q = meta_ptr(*v.seq_lens_q);
    p.seq_lens_q_stride = v.seq_lens_q->stride(0);
  }
  if (v.seq_lens_k) {
    p.seq_lens_k = meta_ptr(*v.seq_lens_k);
    p.seq_lens_k_stride = v.seq_lens_k->stride(0);
  }
  if (v.query_positions) {
    p.query_positions = meta_ptr(*v.query_positions);
    p.query_positions_batch_stride = n == 2 ? v.query_positions->stride(0) : 0;
    p.query_positions_row_stride = v.query_positions->stride(n - 1);
  }
}

// Host copies of every CUDA view (CPU views pass through), outputs written back by commit().
Views stage(detail::HostStaging& s, const Views& v) {
  Views h;
  h.query = s.input(v.query);
  h.key = s.input(v.key);
  h.value = s.input(v.value);
  h.indices = s.input(v.indices);
  h.block_indices = s.input(v.block_indices);
  h.gate = s.input(v.gate);
  h.cu_seqlens_q = s.input(v.cu_seqlens_q);
  h.token_to_req = s.input(v.token_to_req);
  h.cu_seqlens_k = s.input(v.cu_seqlens_k);
  h.block_table = s.input(v.block_table);
  h.seq_lens_q = s.input(v.seq_lens_q);
  h.seq_lens_k = s.input(v.seq_lens_k);
  h.query_positions = s.input(v.query_positions);
  h.out = s.output(v.out);
  h.lse = s.output(v.lse);
  return h;
}

// The call's tensors; out stays empty for the workspace size (outputs do not change it).
Views views_of(const TensorView& query, const TensorView& key, const TensorView& value,
               const std::optional<TensorView>& token_indices, const SparseAttentionOptions& o) {
  const bool physical = o.selected_kv_indices.has_value();
  if (physical && token_indices) {
    throw_value_error(
        "selected_kv_indices: mutually exclusive with token_indices; pass "
        "request-local token_indices or physical selected_kv_indices, not both");
  }
  if (!physical && !token_indices) {
    throw_value_error(
        "token_indices: required (int32 [.., W] request-local ids) unless "
        "selected_kv_indices is given");
  }
  Views v;
  v.query = query;
  v.key = detail::resolve_cache_dtype(key, "key", o.kv_cache_dtype);
  v.value = detail::resolve_cache_dtype(value, "value", o.kv_cache_dtype);
  v.indices = physical ? *o.selected_kv_indices : *token_indices;
  v.block_indices = o.block_indices;
  v.gate = o.gate;
  v.cu_seqlens_q = o.cu_seqlens_q;
  v.token_to_req = o.token_to_req;
  v.cu_seqlens_k = o.cu_seqlens_k;
  v.block_table = o.block_table;
  v.seq_lens_q = o.seq_lens_q;
  v.seq_lens_k = o.seq_lens_k;
  v.query_positions = o.query_positions;
  return v;
}

}  // namespace

Shape qsa_sparse_attention_out_shape(const TensorView& query) {
  check_rank(query, "query", {3, 4});
  return query.shape();
}

Shape qsa_sparse_attention_lse_shape(const TensorView& query) {
  check_rank(query, "query", {3, 4});
  return drop_last(query);
}

size_t qsa_sparse_attention_workspace_size(const TensorView& query, const TensorView& key,
                                           const TensorView& value,
                                           const std::optional<TensorView>& token_indices,
                                           const SparseAttentionOptions& options) {
  const Views v = views_of(query, key, value, token_indices, options);
  const bool physical = options.selected_kv_indices.has_value();
  SparseAttentionParams params = validate(v, physical, options);
  if (options.backend != Backend::kNative || !query.device().is_cuda()) return 0;
  check_native(v, params);
  fill_params(params, v);
  return native_sparse_attention_workspace_size(params);
}

void qsa_sparse_attention(const TensorView& query, const TensorView& key, const TensorView& value,
                          const std::optional<TensorView>& token_indices, const TensorView& out,
                          const std::optional<TensorView>& lse,
                          const SparseAttentionOptions& options) {
  Views v = views_of(query, key, value, token_indices, options);
  v.out = out;
  v.lse = lse;
  const bool physical = options.selected_kv_indices.has_value();
  SparseAttentionParams params = validate(v, physical, options);
  check_outputs(v, physical);
  if (options.workspace && options.workspace_allocator) {
    throw_value_error(
        "workspace_allocator: pass a workspace or a workspace_allocator (or neither), not both");
  }
  // The reference needs no scratch; a workspace given to it must still be a valid one.
  if (options.workspace) check_workspace(*options.workspace, v, physical);
  // Missing outputs (api/check.h) once every other argument is checked, the other output too.
  detail::check_not_missing(out, "out");
  detail::check_not_missing(lse, "lse");
  if (options.backend == Backend::kNative && !query.device().is_cuda()) {  // the CPU backend
    fill_params(params, v);
    cpu_sparse_attention(params);
    return;
  }
  if (options.backend == Backend::kNative) {
    check_native(v, params);
    fill_params(params, v);
    std::optional<TensorView> workspace = options.workspace;
    const size_t bytes = workspace || options.workspace_allocator
                             ? native_sparse_attention_workspace_size(params)
                             : 0;
    if (!workspace && bytes > 0 && options.workspace_allocator) {
      workspace = options.workspace_allocator(bytes);
      check_workspace(*workspace, v, physical);
    }
    if (workspace) {
      detail::check_workspace_size(*workspace, "workspace", bytes,
                                   "qsa_sparse_attention_workspace_size");
      params.workspace = workspace->data();
    }
    native_sparse_attention(params);
    return;
  }
  detail::HostStaging staging;
  fill_params(params, stage(staging, v));
  reference_sparse_attention(params);
  staging.commit();
}

}  // namespace sparse_attn
