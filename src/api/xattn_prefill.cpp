// xattention_prefill: xattn_estimate followed by block_sparse_attention with every head
// block-sparse, on the padded [B, H, L, D] layout. Validation, backend choice, params filling.
#include <cmath>
#include <cstring>
#include <vector>

#include "api/check.h"
#include "api/meta_ptr.h"
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

// Every check of xattention_prefill's arguments; returns the estimate params (no pointers).
XAttnEstimateParams check_prefill(const TensorView& query, const TensorView& key,
                                  const TensorView& value, const TensorView& attn_sums,
                                  const TensorView& block_mask, const TensorView& out,
                                  const std::optional<TensorView>& lse,
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
  return e;
}

}  // namespace

void xattention_prefill(const TensorView& query, const TensorView& key, const TensorView& value,
                        const TensorView& attn_sums, const TensorView& block_mask,
                        const TensorView& out, const std::optional<TensorView>& lse,
                        const XAttnPrefillOptions& options) {
  XAttnEstimateParams e =
      check_prefill(query, key, value, attn_sums, block_mask, out, lse, options);
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

// ----- the paged form ---------------------------------------------------------------------

namespace {

// [B, L, H, D] storage seen as the [B, H, L, D] view the prefill takes.
TensorView heads_first(void* data, DType dtype, Device device, int64_t B, int64_t L, int64_t H,
                       int64_t D) {
  return TensorView(data, dtype, device, {B, H, L, D}, {L * H * D, D, H * D, 1});
}

}  // namespace

void xattention_prefill_paged(const TensorView& query, const TensorView& k_cache,
                              const TensorView& v_cache, const TensorView& block_table,
                              int64_t k_len, const TensorView& attn_sums,
                              const TensorView& block_mask, const TensorView& out,
                              const std::optional<TensorView>& lse,
                              const XAttnPrefillOptions& options) {
  detail::check_rank(query, "query", {4});
  detail::check_float_input(query, "query", nullptr, "");
  detail::check_rank(k_cache, "k_cache", {4});
  detail::check_rank(v_cache, "v_cache", {4});
  detail::check_float_input(k_cache, "k_cache", &query, "query");
  detail::check_float_input(v_cache, "v_cache", &query, "query");
  detail::check_shape(v_cache, "v_cache", k_cache.shape(), "the shape of k_cache");
  const int64_t B = query.size(0), Hq = query.size(1), Lq = query.size(2), D = query.size(3);
  const int64_t pages = k_cache.size(0), page_size = k_cache.size(1), Hkv = k_cache.size(2);
  if (k_cache.size(3) != D) {
    detail::throw_value_error("k_cache: expected head dim {} (query's), got shape {}", D,
                              k_cache.shape_str());
  }
  if (page_size < 1) {
    detail::throw_value_error("k_cache: expected a page size (shape[1]) of at least 1, got {}",
                              k_cache.shape_str());
  }
  detail::check_gqa(Hq, Hkv, "query", "k_cache");
  detail::check_rank(block_table, "block_table", {2});
  detail::check_metadata_dtype(block_table, "block_table");
  detail::check_shape(block_table, "block_table", {B, block_table.size(1)},
                      "[B, max_pages], B from query");
  detail::check_device(block_table, "block_table", query.device(), "query");
  detail::check_data(block_table, "block_table");
  const int64_t max_keys = detail::checked_size_product(block_table.size(1), page_size,
                                                        "block_table", "max_pages * page_size");
  if (k_len < 0 || k_len > max_keys) {
    detail::throw_value_error(
        "k_len: expected 0 <= k_len <= max_pages * page_size = {} * {} = {}, got {}",
        block_table.size(1), page_size, max_keys, k_len);
  }
  if (pages == 0 && k_len > 0) {
    detail::throw_value_error("k_cache: holds no pages, but the requests have k_len = {} keys",
                              k_len);
  }
  if ((options.causal || options.keep_recent) && Lq > k_len) {
    detail::throw_value_error(
        "k_len: the query rows are the last Lq = {} of the k_len keys (causal or keep_recent), "
        "so k_len must be at least {}, got {}",
        Lq, Lq, k_len);
  }
  // The rest of the checks are xattention_prefill's, on a stand-in for the gathered K/V: the
  // shape [B, Hkv, k_len, D] over the cache's first row (nothing is read), so that every
  // argument is checked before any work. The gathered K/V and the host stagings are fresh
  // buffers: overlaps of the outputs with the caller's inputs are checked here.
  const TensorView gathered(k_cache.data(), query.dtype(), query.device(), {B, Hkv, k_len, D},
                            {0, 0, 0, 1});
  const XAttnEstimateParams e =
      check_prefill(query, gathered, gathered, attn_sums, block_mask, out, lse, options);
  for (const auto& [t, name] : {std::pair{query, "query"},
                                {k_cache, "k_cache"},
                                {v_cache, "v_cache"},
                                {block_table, "block_table"}}) {
    detail::check_no_overlap(out, "out", t, name);
    detail::check_no_overlap(attn_sums, "attn_sums", t, name);
    detail::check_no_overlap(block_mask, "block_mask", t, name);
    if (lse) detail::check_no_overlap(*lse, "lse", t, name);
  }
  const DType dtype = query.dtype();
  const Device dev = query.device();

  if (options.backend == Backend::kNative && dev.is_cuda()) {
    detail::check_native_block_sparse(
        {{&query, "query"}, {&k_cache, "k_cache"}, {&v_cache, "v_cache"}, {&out, "out"}}, Hq,
        "xattention_prefill_paged");
    detail::check_native_estimate(query, gathered, e, "xattention_prefill_paged");
    PagedGatherParams g;
    g.k_cache = k_cache.data();
    g.v_cache = v_cache.data();
    copy_strides(k_cache, g.k_stride, 3);
    copy_strides(v_cache, g.v_stride, 3);
    g.block_table = meta_ptr(block_table);
    copy_strides(block_table, g.block_table_stride, 2);
    g.batch = B;
    g.k_len = k_len;
    g.page_size = page_size;
    g.num_pages = pages;
    g.num_kv_heads = Hkv;
    g.head_dim = D;
    g.device_index = dev.index;
    g.stream = options.stream;
    native_gather_pages(g, [&](const void* k, const void* v) {
      xattention_prefill(query, heads_first(const_cast<void*>(k), dtype, dev, B, k_len, Hkv, D),
                         heads_first(const_cast<void*>(v), dtype, dev, B, k_len, Hkv, D), attn_sums,
                         block_mask, out, lse, options);
    });
    return;
  }

  // Host backends: the page table and the caches on the host (staged from a device), every
  // page id the requests use checked, then the gather and the prefill there.
  detail::HostStaging staging;
  const TensorView table = staging.input(block_table), kc = staging.input(k_cache),
                   vc = staging.input(v_cache);
  const MetaPtr ids = meta_ptr(table);
  Tensor key = Tensor::empty({B, k_len, Hkv, D}, dtype),
         value = Tensor::empty({B, k_len, Hkv, D}, dtype);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t first = 0; first < k_len; first += page_size) {
      const int64_t slot = first / page_size, n = std::min(page_size, k_len - first);
      const int64_t id = ids[b * table.stride(0) + slot * table.stride(1)];
      if (id < 0 || id >= pages) {
        detail::throw_value_error(
            "block_table: request {} needs page slot {} (keys {}..{}), which holds {}; expected "
            "a page id in [0, {})",
            b, slot, first, first + n - 1, id, pages);
      }
      copy_into(key.view().select(0, b).narrow(0, first, n), kc.select(0, id).narrow(0, 0, n));
      copy_into(value.view().select(0, b).narrow(0, first, n), vc.select(0, id).narrow(0, 0, n));
    }
  }
  const auto as_bhld = [&](const Tensor& t) {
    return heads_first(t.data(), dtype, Device::cpu(), B, k_len, Hkv, D);
  };
  xattention_prefill(staging.input(query), as_bhld(key), as_bhld(value), staging.output(attn_sums),
                     staging.output(block_mask), staging.output(out), staging.output(lse), options);
  staging.commit();
}

}  // namespace sparse_attn
