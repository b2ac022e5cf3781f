// xattention_prefill: xattn_estimate followed by block_sparse_attention with every head
// block-sparse, on the padded [B, H, L, D] layout. Validation, backend choice, params filling.
#include <cmath>
#include <vector>

#include "api/check.h"
#include "api/staging.h"
#include "api/xattn_checks.h"
#include "api/xattn_params.h"
#include "cpu/cpu_kernels.h"
#include "reference/xattn_ref.h"
#include "sparse_attn/xattn.h"

namespace sparse_attn {
namespace {

using detail::check_no_overlap;
using detail::copy_strides;

struct Views {
  TensorView query, key, value, attn_sums, block_mask, out;
  std::optional<TensorView> lse;
};

// The attention step's pointers: query/out [B, Hq, Lq, D], key/value [B, Hkv, Lk, D], all
// addressed in the (batch, row, head, dim) stride order; lse [B, Hq, Lq].
void fill_attention(BlockSparseAttnParams& a, const Views& v) {
  auto reorder = [](const TensorView& t, int64_t* s) {
    s[0] = t.stride(0);
    s[1] = t.stride(2);
    s[2] = t.stride(1);
    s[3] = t.stride(3);
  };
  a.q = v.query.data();
  reorder(v.query, a.q_stride);
  a.k = v.key.data();
  reorder(v.key, a.k_stride);
  a.v = v.value.data();
  reorder(v.value, a.v_stride);
  a.out = v.out.data();
  reorder(v.out, a.out_stride);
  a.block_mask = v.block_mask.data_as<const uint8_t>();
  copy_strides(v.block_mask, a.mask_stride, 4);
  if (v.lse) {
    a.lse = v.lse->data_as<float>();
    a.lse_stride[0] = v.lse->stride(0);
    a.lse_stride[1] = v.lse->stride(2);
    a.lse_stride[2] = v.lse->stride(1);
  }
}

}  // namespace

void xattention_prefill(const TensorView& query, const TensorView& key, const TensorView& value,
                        const TensorView& attn_sums, const TensorView& block_mask,
                        const TensorView& out, const std::optional<TensorView>& lse,
                        const XAttnPrefillOptions& options) {
  XAttnEstimateParams e = detail::check_estimate_inputs(query, key, options);
  if (options.block_size != kBlockSparseBlockSize) {
    detail::throw_value_error(
        "block_size: xattention_prefill attends over {}x{} blocks (Block-Sparse-Attention's "
        "size), got {}",
        kBlockSparseBlockSize, kBlockSparseBlockSize, options.block_size);
  }
  detail::check_select_options(options, e.num_q_heads);
  detail::check_rank(value, "value", {4});
  detail::check_float_input(value, "value", &query, "query");
  detail::check_shape(value, "value", key.shape(), "the shape of key");
  if (options.softmax_scale) {
    detail::check_float32_scale(*options.softmax_scale, "softmax_scale");
  }
  detail::check_estimate_outputs(e, query, key, attn_sums, block_mask);
  detail::check_xattn_output(out, "out", query.dtype(), query.shape(), "the shape of query",
                             query.device(), "query");
  if (lse) {
    detail::check_xattn_output(*lse, "lse", DType::kF32, {e.batch, e.num_q_heads, e.q_len},
                               "[B, Hq, Lq]", query.device(), "query");
    check_no_overlap(*lse, "lse", out, "out");
  }
  for (const auto& [t, name] : {std::pair{query, "query"},
                                {key, "key"},
                                {value, "value"},
                                {attn_sums, "attn_sums"},
                                {block_mask, "block_mask"}}) {
    check_no_overlap(out, "out", t, name);
    if (lse) check_no_overlap(*lse, "lse", t, name);
  }
  for (const auto& [t, name] : {std::pair{attn_sums, "attn_sums"}, {block_mask, "block_mask"}}) {
    check_no_overlap(t, name, value, "value");
  }
  // Missing outputs (api/check.h) once everything else is checked, given outputs included.
  detail::check_not_missing(attn_sums, "attn_sums");
  detail::check_not_missing(block_mask, "block_mask");
  detail::check_not_missing(out, "out");
  detail::check_not_missing(lse, "lse");
  const std::vector<double> thresholds = detail::head_thresholds(options, e.num_q_heads);
  e.select.thresholds = thresholds.data();

  // The attention step: every head block-sparse through the estimate's mask.
  const std::vector<int32_t> head_types(static_cast<size_t>(e.num_q_heads), 1);
  BlockSparseAttnParams a;
  a.batch = e.batch;
  a.num_q_heads = e.num_q_heads;
  a.num_kv_heads = e.num_kv_heads;
  a.group = e.group;
  a.head_dim = e.head_dim;
  a.block_size = kBlockSparseBlockSize;
  a.max_seqlen_q = e.q_len;
  a.max_seqlen_k = e.k_len;
  a.dtype = e.dtype;
  a.total_q = e.batch * e.q_len;
  a.kv_layout = XAttnKVLayout::kPadded;
  a.head_mask_type = head_types.data();
  a.mask_q_blocks = e.q_blocks;
  a.mask_k_blocks = e.k_blocks;
  a.softmax_scale =
      options.softmax_scale.value_or(1.0 / std::sqrt(static_cast<double>(e.head_dim)));
  a.causal = options.causal;
  a.device_index = e.device_index;
  a.stream = options.stream;

  const Views v{query, key, value, attn_sums, block_mask, out, lse};
  if (options.backend == Backend::kNative && !query.device().is_cuda()) {  // the CPU backend
    detail::fill_estimate_pointers(e, query, key, attn_sums, block_mask);
    fill_attention(a, v);
    cpu_xattn_estimate_sums(e);
    reference_find_blocks(e.select);
    cpu_block_sparse_attention(a);
    return;
  }
  if (options.backend == Backend::kNative) {
    detail::check_native_block_sparse(
        {{&query, "query"}, {&key, "key"}, {&value, "value"}, {&out, "out"}}, e.num_q_heads,
        "xattention_prefill");
    detail::check_native_estimate(query, key, e, "xattention_prefill");
    detail::fill_estimate_pointers(e, query, key, attn_sums, block_mask);
    fill_attention(a, v);
    native_xattn_estimate(e);
    native_block_sparse_attention(a);
    return;
  }
  detail::HostStaging staging;
  const Views h{staging.input(query),      staging.input(key),         staging.input(value),
                staging.output(attn_sums), staging.output(block_mask), staging.output(out),
                staging.output(lse)};
  detail::fill_estimate_pointers(e, h.query, h.key, h.attn_sums, h.block_mask);
  fill_attention(a, h);
  reference_xattn_estimate_sums(e);
  reference_find_blocks(e.select);
  reference_block_sparse_attention(a);
  staging.commit();
}

}  // namespace sparse_attn
