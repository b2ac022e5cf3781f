// xattn_estimate and find_blocks_chunked: validation, backend choice and params filling.
#include <cmath>
#include <string>

#include "api/check.h"
#include "api/staging.h"
#include "api/xattn_checks.h"
#include "api/xattn_params.h"
#include "cpu/cpu_kernels.h"
#include "reference/xattn_ref.h"
#include "sparse_attn/xattn.h"

namespace sparse_attn {
namespace {

using detail::ceil_div;
using detail::check_data;
using detail::check_device;
using detail::check_dtype;
using detail::check_rank;
using detail::check_shape;
using detail::copy_strides;
using detail::throw_not_supported;
using detail::throw_value_error;

}  // namespace

namespace detail {

XAttnEstimateParams check_estimate_inputs(const TensorView& query, const TensorView& key,
                                          const XAttnEstimateOptions& o) {
  check_rank(query, "query", {4});
  check_rank(key, "key", {4});
  detail::check_float_input(query, "query", nullptr, "");
  detail::check_float_input(key, "key", &query, "query");
  detail::check_size(key, "key", 0, query.size(0), "the batch of query [B, Hq, Lq, D]");
  detail::check_size(key, "key", 3, query.size(3), "the head_dim of query [B, Hq, Lq, D]");
  detail::check_gqa(query.size(1), key.size(1), "query", "key");
  if (query.size(3) < 1) {
    throw_value_error("query: expected head_dim >= 1, got shape {}", query.shape_str());
  }
  if (query.size(2) > key.size(2) && (o.causal || o.keep_recent)) {
    throw_value_error(
        "query: expected at most as many query rows as keys with causal or keep_recent (the "
        "queries are the last Lq positions of the key sequence), got Lq = {} with key length "
        "Lk = {}",
        query.size(2), key.size(2));
  }
  if (o.block_size < 1) {
    throw_value_error("block_size: expected a positive number of tokens, got {}", o.block_size);
  }
  if (o.stride < 1 || o.block_size % o.stride != 0) {
    throw_value_error("stride: expected a positive divisor of block_size ({}), got {}",
                      o.block_size, o.stride);
  }
  detail::check_float32_scale(o.norm, "norm");
  if (o.chunk_size < 1 || o.chunk_size % o.block_size != 0) {
    throw_value_error("chunk_size: expected a positive multiple of block_size ({}), got {}",
                      o.block_size, o.chunk_size);
  }
  if (o.select_mode != "inverse") {
    if (o.select_mode == "slash" || o.select_mode == "random" || o.select_mode == "double" ||
        o.select_mode == "triple") {
      throw_not_supported("select_mode: only 'inverse' is implemented, got upstream's '{}'",
                          o.select_mode);
    }
    throw_value_error("select_mode: expected 'inverse', got '{}'", o.select_mode);
  }

  XAttnEstimateParams p;
  p.batch = query.size(0);
  p.num_q_heads = query.size(1);
  p.num_kv_heads = key.size(1);
  p.group = p.num_q_heads / p.num_kv_heads;
  p.head_dim = query.size(3);
  p.q_len = query.size(2);
  p.k_len = key.size(2);
  p.block_size = o.block_size;
  p.stride = o.stride;
  p.chunk_size = o.chunk_size;
  p.q_blocks = ceil_div(p.q_len, o.block_size);
  p.k_blocks = ceil_div(p.k_len, o.block_size);
  p.dtype = query.dtype();
  p.score_scale =
      1.0 / (std::sqrt(static_cast<double>(p.head_dim)) * static_cast<double>(o.stride) * o.norm);
  detail::check_float32_scale(p.score_scale, "norm", "1 / (sqrt(D) * stride * norm)", o.norm);
  p.causal = o.causal;
  p.device_index = query.device().is_cuda() ? query.device().index : 0;
  p.stream = o.stream;

  BlockSelectParams& s = p.select;
  s.batch = p.batch;
  s.num_heads = p.num_q_heads;
  s.q_blocks = p.q_blocks;
  s.k_blocks = p.k_blocks;
  s.q_len = p.q_len;
  s.k_len = p.k_len;
  s.block_size = p.block_size;
  s.causal = o.causal;
  s.keep_sink = o.keep_sink;
  s.keep_recent = o.keep_recent;
  s.device_index = p.device_index;
  s.stream = o.stream;
  return p;
}

}  // namespace detail

namespace {

// attn_sums and block_mask of a selection: FP32 and bool [B, H, q_blocks, k_blocks], on
// `device`, disjoint from each other.
void check_select_outputs(const TensorView& attn_sums, const TensorView& block_mask,
                          const Shape& shape, std::string_view what, Device device,
                          std::string_view device_of, bool sums_is_output) {
  if (sums_is_output) {
    detail::check_xattn_output(attn_sums, "attn_sums", DType::kF32, shape, what, device, device_of);
  }
  detail::check_xattn_output(block_mask, "block_mask", DType::kBool, shape, what, device,
                             device_of);
  detail::check_no_overlap(block_mask, "block_mask", attn_sums, "attn_sums");
}

void fill_select_pointers(BlockSelectParams& s, const TensorView& attn_sums,
                          const TensorView& block_mask) {
  s.attn_sums = attn_sums.data_as<float>();
  copy_strides(attn_sums, s.sums_stride, 4);
  s.block_mask = block_mask.data_as<uint8_t>();
  copy_strides(block_mask, s.mask_stride, 4);
}

}  // namespace

namespace detail {

void check_estimate_outputs(const XAttnEstimateParams& p, const TensorView& query,
                            const TensorView& key, const TensorView& attn_sums,
                            const TensorView& block_mask) {
  check_select_outputs(attn_sums, block_mask, {p.batch, p.num_q_heads, p.q_blocks, p.k_blocks},
                       "xattn_estimate_shape(query, key)", query.device(), "query", true);
  for (const auto& [out, out_name] :
       {std::pair{attn_sums, "attn_sums"}, std::pair{block_mask, "block_mask"}}) {
    check_no_overlap(out, out_name, query, "query");
    check_no_overlap(out, out_name, key, "key");
  }
}

void fill_estimate_pointers(XAttnEstimateParams& p, const TensorView& query, const TensorView& key,
                            const TensorView& attn_sums, const TensorView& block_mask) {
  p.q = query.data();
  copy_strides(query, p.q_stride, 4);
  p.k = key.data();
  copy_strides(key, p.k_stride, 4);
  p.attn_sums = attn_sums.data_as<float>();
  copy_strides(attn_sums, p.sums_stride, 4);
  fill_select_pointers(p.select, attn_sums, block_mask);
}

}  // namespace detail

Shape xattn_estimate_shape(const TensorView& query, const TensorView& key,
                           const XAttnEstimateOptions& options) {
  const XAttnEstimateParams p = detail::check_estimate_inputs(query, key, options);
  return {p.batch, p.num_q_heads, p.q_blocks, p.k_blocks};
}

void xattn_estimate(const TensorView& query, const TensorView& key, const TensorView& attn_sums,
                    const TensorView& block_mask, const XAttnEstimateOptions& options) {
  XAttnEstimateParams p = detail::check_estimate_inputs(query, key, options);
  detail::check_select_options(options, p.num_q_heads);
  detail::check_estimate_outputs(p, query, key, attn_sums, block_mask);
  detail::check_not_missing(attn_sums, "attn_sums");
  detail::check_not_missing(block_mask, "block_mask");
  const std::vector<double> thresholds = detail::head_thresholds(options, p.num_q_heads);
  p.select.thresholds = thresholds.data();
  if (options.backend == Backend::kNative && !query.device().is_cuda()) {  // the CPU backend
    detail::fill_estimate_pointers(p, query, key, attn_sums, block_mask);
    cpu_xattn_estimate_sums(p);
    reference_find_blocks(p.select);
    return;
  }
  if (options.backend == Backend::kNative) {
    detail::check_native_estimate(query, key, p, "xattn_estimate");
    detail::fill_estimate_pointers(p, query, key, attn_sums, block_mask);
    native_xattn_estimate(p);
    return;
  }
  detail::HostStaging staging;
  detail::fill_estimate_pointers(p, staging.input(query), staging.input(key),
                                 staging.output(attn_sums), staging.output(block_mask));
  reference_xattn_estimate_sums(p);
  reference_find_blocks(p.select);
  staging.commit();
}

void find_blocks_chunked(const TensorView& attn_sums, const TensorView& block_mask,
                         const FindBlocksOptions& options) {
  check_rank(attn_sums, "attn_sums", {4});
  check_dtype(attn_sums, "attn_sums", {DType::kF32});
  check_data(attn_sums, "attn_sums");
  BlockSelectParams s;
  s.batch = attn_sums.size(0);
  s.num_heads = attn_sums.size(1);
  s.q_blocks = attn_sums.size(2);
  s.k_blocks = attn_sums.size(3);
  detail::check_select_options(options, s.num_heads);
  s.block_size = options.block_size;
  s.q_len = options.q_len ? *options.q_len
                          : detail::checked_size_product(s.q_blocks, s.block_size, "block_size",
                                                         "attn_sums.shape[2] * block_size");
  s.k_len = options.k_len ? *options.k_len
                          : detail::checked_size_product(s.k_blocks, s.block_size, "block_size",
                                                         "attn_sums.shape[3] * block_size");
  if (options.q_len && (s.q_len < 0 || ceil_div(s.q_len, s.block_size) != s.q_blocks)) {
    throw_value_error(
        "q_len: expected a query length of {} blocks of {} (attn_sums.shape[2]), got {}",
        s.q_blocks, s.block_size, s.q_len);
  }
  if (options.k_len && (s.k_len < 0 || ceil_div(s.k_len, s.block_size) != s.k_blocks)) {
    throw_value_error(
        "k_len: expected a key length of {} blocks of {} (attn_sums.shape[3]), got {}", s.k_blocks,
        s.block_size, s.k_len);
  }
  if (s.q_len > s.k_len && (options.causal || options.keep_recent)) {
    throw_value_error(
        "attn_sums: expected at most as many query rows as keys with causal or keep_recent (the "
        "queries are the last rows of the key sequence), got q_len = {} and k_len = {} (shape {})",
        s.q_len, s.k_len, attn_sums.shape_str());
  }
  check_select_outputs(attn_sums, block_mask, attn_sums.shape(), "the shape of attn_sums",
                       attn_sums.device(), "attn_sums", false);
  detail::check_not_missing(block_mask, "block_mask");
  const std::vector<double> thresholds = detail::head_thresholds(options, s.num_heads);
  s.thresholds = thresholds.data();
  s.causal = options.causal;
  s.keep_sink = options.keep_sink;
  s.keep_recent = options.keep_recent;
  s.device_index = attn_sums.device().is_cuda() ? attn_sums.device().index : 0;
  s.stream = options.stream;

  // The CPU backend's selection is the reference's (cpu/cpu_kernels.h says why).
  if (options.backend == Backend::kNative && attn_sums.device().is_cuda()) {
    fill_select_pointers(s, attn_sums, block_mask);
    native_find_blocks(s);
    return;
  }
  if (options.backend == Backend::kNative) {
    fill_select_pointers(s, attn_sums, block_mask);
    reference_find_blocks(s);
    return;
  }
  detail::HostStaging staging;
  fill_select_pointers(s, staging.input(attn_sums), staging.output(block_mask));
  reference_find_blocks(s);
  staging.commit();
}

}  // namespace sparse_attn
