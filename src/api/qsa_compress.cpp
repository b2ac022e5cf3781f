// API boundary of qsa_compress_block_keys: validation (metadata only), backend choice, params
// filling. docs/qsa.md ("## Compressed keys") is the user-facing statement of these rules.
#include "sparse_attn/qsa_compress.h"

#include <cmath>
#include <initializer_list>
#include <utility>

#include "api/check.h"
#include "api/qsa_compress_params.h"
#include "api/staging.h"
#include "reference/qsa_compress_ref.h"

namespace sparse_attn {
namespace {

using detail::kCompressBlockTokens;
using detail::throw_value_error;

// The geometry of the native kernel: the QSA indexer's 128-dim keys, RoPE on the first 64.
constexpr int64_t kNativeDim = 128;
constexpr int64_t kNativeRopeDim = 64;

void check_keys(const TensorView& keys) {
  detail::check_dtype(keys, "keys", {DType::kBF16, DType::kF16});
  detail::check_rank(keys, "keys", {2, 3});
  detail::check_data(keys, "keys");
}

// int metadata of an exact shape on the keys' device.
void check_metadata(const TensorView& t, const char* name, const Shape& shape,
                    std::string_view what, Device dev) {
  detail::check_metadata_dtype(t, name);
  detail::check_shape(t, name, shape, what);
  detail::check_device(t, name, dev, "keys");
  detail::check_data(t, name);
}

void check_table(const TensorView& t, const char* name, int64_t rope_dim, Device dev) {
  detail::check_dtype(t, name, {DType::kF32});
  detail::check_rank(t, name, {2});
  if (t.size(1) != rope_dim / 2 && t.size(1) != rope_dim) {
    throw_value_error(
        "{}: expected [positions, {}] (one column per frequency) or [positions, {}] (one per "
        "rotated dim) for rope_dim = {}, got shape {}",
        name, rope_dim / 2, rope_dim, rope_dim, t.shape_str());
  }
  detail::check_device(t, name, dev, "keys");
  detail::check_data(t, name);
}

struct Layout {
  int64_t batch;
  bool single;  // keys [T, D] without cu_seqlens
  bool paged;
};

// Checks every input; returns the request layout.
Layout check_inputs(const TensorView& keys, const TensorView& weight,
                    const CompressBlockKeysOptions& o) {
  check_keys(keys);
  const Device dev = keys.device();
  const int64_t D = keys.size(-1);
  if (o.cu_seqlens && keys.dim() != 2) {
    throw_value_error(
        "cu_seqlens: only with flattened keys [total_tokens, D], got keys of shape {}",
        keys.shape_str());
  }
  Layout l{};
  l.single = keys.dim() == 2 && !o.cu_seqlens;
  l.paged = o.block_table.has_value();
  if (o.cu_seqlens) {
    detail::check_metadata_dtype(*o.cu_seqlens, "cu_seqlens");
    detail::check_rank(*o.cu_seqlens, "cu_seqlens", {1});
    if (o.cu_seqlens->size(0) < 1) {
      throw_value_error("cu_seqlens: expected [B + 1] offsets (at least one), got shape {}",
                        o.cu_seqlens->shape_str());
    }
    detail::check_device(*o.cu_seqlens, "cu_seqlens", dev, "keys");
    detail::check_data(*o.cu_seqlens, "cu_seqlens");
    l.batch = o.cu_seqlens->size(0) - 1;
  } else {
    l.batch = keys.dim() == 3 ? keys.size(0) : 1;
  }
  detail::check_dtype(weight, "weight", {DType::kBF16, DType::kF16, DType::kF32});
  detail::check_shape(weight, "weight", {D}, "[keys.shape[-1]]");
  detail::check_device(weight, "weight", dev, "keys");
  detail::check_data(weight, "weight");
  if (!std::isfinite(o.eps) || o.eps < 0 || !std::isfinite(static_cast<float>(o.eps))) {
    throw_value_error("eps: expected a finite number >= 0 (applied in float32), got {}", o.eps);
  }
  if (o.rope_dim < 0 || o.rope_dim > D || o.rope_dim % 2 != 0) {
    throw_value_error("rope_dim: expected an even number from 0 to keys.shape[-1] ({}), got {}", D,
                      o.rope_dim);
  }
  if (o.cos.has_value() != o.sin.has_value()) {
    throw_value_error("{}: cos and sin come together, got only {}", o.cos ? "sin" : "cos",
                      o.cos ? "cos" : "sin");
  }
  if (o.cos && o.rope_theta) {
    throw_value_error(
        "rope_theta: the RoPE comes from the cos/sin tables or from rope_theta, not both "
        "(got rope_theta = {})",
        *o.rope_theta);
  }
  if (!o.cos && !o.rope_theta) {
    throw_value_error("rope_theta: expected the cos/sin tables or rope_theta, got neither");
  }
  if (o.rope_theta && (!std::isfinite(*o.rope_theta) || *o.rope_theta <= 0)) {
    throw_value_error("rope_theta: expected a finite number > 0, got {}", *o.rope_theta);
  }
  if (o.cos) {
    check_table(*o.cos, "cos", o.rope_dim, dev);
    check_table(*o.sin, "sin", o.rope_dim, dev);
    detail::check_shape(*o.sin, "sin", o.cos->shape(), "cos.shape");
  }
  if (o.start_positions) {
    check_metadata(*o.start_positions, "start_positions", {l.batch}, "[B]", dev);
  }
  if (o.block_table) {
    detail::check_metadata_dtype(*o.block_table, "block_table");
    detail::check_rank(*o.block_table, "block_table", {2});
    detail::check_size(*o.block_table, "block_table", 0, l.batch, "B, the requests of keys");
    detail::check_device(*o.block_table, "block_table", dev, "keys");
    detail::check_data(*o.block_table, "block_table");
  } else if (o.page_size) {
    throw_value_error("page_size: only with block_table (a paged out), got {}", *o.page_size);
  }
  return l;
}

void check_out(const TensorView& out, const TensorView& keys, const Layout& l,
               const CompressBlockKeysOptions& o,
               std::initializer_list<std::pair<const std::optional<TensorView>, const char*>> ins) {
  if (detail::is_missing(out)) return;
  const int64_t D = keys.size(-1);
  if (out.dtype() != keys.dtype()) {
    detail::throw_type_error("out: expected dtype {} (the dtype of keys), got {}",
                             dtype_name(keys.dtype()), dtype_name(out.dtype()));
  }
  if (l.paged) {
    detail::check_rank(out, "out", {3, 4});
    if (out.dim() == 4) detail::check_size(out, "out", 2, 1, "1 (one key head)");
    detail::check_size(out, "out", -1, D, "keys.shape[-1]");
    if (o.page_size && *o.page_size != out.size(1)) {
      throw_value_error("page_size: expected out.shape[1] ({}), got {}", out.size(1), *o.page_size);
    }
  } else if (l.single) {
    detail::check_rank(out, "out", {2});
    detail::check_size(out, "out", 1, D, "keys.shape[-1]");
  } else {
    detail::check_rank(out, "out", {3});
    detail::check_size(out, "out", 0, l.batch, "B, the requests of keys");
    detail::check_size(out, "out", 2, D, "keys.shape[-1]");
  }
  detail::check_device(out, "out", keys.device(), "keys");
  detail::check_positive_strides(out, "out");
  detail::check_no_self_overlap(out, "out");
  detail::check_data(out, "out");
  for (const auto& [in, name] : ins) {
    if (in) detail::check_no_overlap(out, "out", *in, name);
  }
}

detail::CompressBlockKeysParams make_params(const TensorView& keys, const TensorView& weight,
                                            const TensorView& out, const Layout& l,
                                            const CompressBlockKeysOptions& o) {
  detail::CompressBlockKeysParams p{};
  p.batch = l.batch;
  p.dim = keys.size(-1);
  p.keys = keys.data();
  p.keys_dtype = keys.dtype();
  p.keys_batch_stride = keys.dim() == 3 ? keys.stride(0) : 0;
  p.keys_row_stride = keys.stride(-2);
  p.keys_col_stride = keys.stride(-1);
  p.tokens_per_request = keys.size(-2);
  if (o.cu_seqlens) {
    p.cu_seqlens = meta_ptr(*o.cu_seqlens);
    p.cu_seqlens_stride = o.cu_seqlens->stride(0);
  }
  if (o.start_positions) {
    p.start_positions = meta_ptr(*o.start_positions);
    p.start_positions_stride = o.start_positions->stride(0);
  }
  p.weight = weight.data();
  p.weight_dtype = weight.dtype();
  p.weight_stride = weight.stride(0);
  p.eps = static_cast<float>(o.eps);
  p.rope_dim = o.rope_dim;
  p.rope_style = o.rope_style;
  if (o.cos) {
    p.cos = o.cos->data_as<const float>();
    p.sin = o.sin->data_as<const float>();
    p.cos_row_stride = o.cos->stride(0);
    p.cos_col_stride = o.cos->stride(1);
    p.sin_row_stride = o.sin->stride(0);
    p.sin_col_stride = o.sin->stride(1);
    p.rope_rows = o.cos->size(0);
    p.rope_cols = o.cos->size(1);
  } else {
    p.rope_theta = *o.rope_theta;
  }
  p.out = out.data();
  p.out_dtype = out.dtype();
  p.out_col_stride = out.stride(-1);
  if (l.paged) {
    p.out_page_stride = out.stride(0);
    p.out_slot_stride = out.stride(1);
    p.num_pages = out.size(0);
    p.page_size = out.size(1);
    p.block_table = meta_ptr(*o.block_table);
    p.block_table_row_stride = o.block_table->stride(0);
    p.block_table_col_stride = o.block_table->stride(1);
    p.max_pages = o.block_table->size(1);
  } else {
    // The contiguous layout as one page of N_B slots per request.
    p.out_page_stride = l.single ? 0 : out.stride(0);
    p.out_slot_stride = out.stride(-2);
    p.num_pages = l.batch;
    p.page_size = out.size(-2);
    p.max_pages = 1;
  }
  p.device_index = keys.device().is_cuda() ? keys.device().index : 0;
  p.stream = o.stream;
  return p;
}

}  // namespace

void detail::reference_compress_padded_keys(const TensorView& keys, const TensorView& weight,
                                            const TensorView& out,
                                            const CompressBlockKeysOptions& o) {
  reference_compress_block_keys(make_params(keys, weight, out, {keys.size(0), false, false}, o));
}

RopeStyle parse_rope_style(std::string_view name) {
  if (name == "rotate_half") return RopeStyle::kRotateHalf;
  if (name == "interleaved") return RopeStyle::kInterleaved;
  throw_value_error("rope_style: expected 'rotate_half' or 'interleaved', got '{}'", name);
}

Shape qsa_compress_block_keys_shape(const TensorView& keys) {
  check_keys(keys);
  Shape s = keys.shape();
  s[s.size() - 2] /= kCompressBlockTokens;
  return s;
}

void qsa_compress_block_keys(const TensorView& keys, const TensorView& weight,
                             const TensorView& out, const CompressBlockKeysOptions& o) {
  const Layout l = check_inputs(keys, weight, o);
  check_out(out, keys, l, o,
            {{keys, "keys"},
             {weight, "weight"},
             {o.cos, "cos"},
             {o.sin, "sin"},
             {o.cu_seqlens, "cu_seqlens"},
             {o.start_positions, "start_positions"},
             {o.block_table, "block_table"}});
  detail::check_not_missing(out, "out");

  if (!keys.device().is_cuda()) {  // host tensors: the reference loops, whichever backend
    detail::reference_compress_block_keys(make_params(keys, weight, out, l, o));
    return;
  }
  if (o.backend == Backend::kNative) {
    if (keys.size(-1) != kNativeDim || o.rope_dim != kNativeRopeDim) {
      detail::throw_not_supported(
          "qsa_compress_block_keys: the native backend needs keys.shape[-1] == {} and rope_dim "
          "== {}, got {} and {}",
          kNativeDim, kNativeRopeDim, keys.size(-1), o.rope_dim);
    }
    detail::native_compress_block_keys(make_params(keys, weight, out, l, o));
    return;
  }
  detail::HostStaging host;
  CompressBlockKeysOptions ho = o;
  ho.cu_seqlens = host.input(o.cu_seqlens);
  ho.start_positions = host.input(o.start_positions);
  ho.block_table = host.input(o.block_table);
  ho.cos = host.input(o.cos);
  ho.sin = host.input(o.sin);
  const TensorView hk = host.input(keys);
  const TensorView hw = host.input(weight);
  const TensorView hout = host.output(out);
  detail::reference_compress_block_keys(make_params(hk, hw, hout, l, ho));
  host.commit();
}

}  // namespace sparse_attn
