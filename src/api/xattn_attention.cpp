// block_sparse_attention and block_sparse_attention_paged: validation, backend choice and
// params filling.
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
using detail::check_no_overlap;
using detail::check_rank;
using detail::check_shape;
using detail::check_size;
using detail::copy_strides;
using detail::throw_value_error;

// Every tensor of one call; k/v are [total_k, Hkv, D] (varlen) or [pages, page_size, Hkv, D].
struct Views {
  TensorView q, k, v, cu_seqlens_q, out;
  std::optional<TensorView> cu_seqlens_k, block_table, seqlens_k, mask, lse;
  const char* k_name = "k";  // "k_cache" / "v_cache" in the paged form
  const char* v_name = "v";
};

// A metadata tensor of the given shape on the query's device: int32 or int64, read as stored.
void check_metadata(const TensorView& t, std::string_view name, const Shape& shape,
                    std::string_view what, Device device) {
  detail::check_metadata_dtype(t, name);
  check_shape(t, name, shape, what);
  check_device(t, name, device, "q");
  check_data(t, name);
}

// Checks head types and streaming info; counts the block-sparse heads and says whether any
// head streams. An empty head_mask_type means every head is block-sparse.
void check_heads(const BlockSparseAttentionOptions& o, int64_t hq, int64_t* sparse_heads,
                 bool* any_streaming) {
  const std::vector<int32_t>& types = o.head_mask_type;
  *sparse_heads = types.empty() ? hq : 0;
  *any_streaming = false;
  if (!types.empty() && static_cast<int64_t>(types.size()) != hq) {
    throw_value_error("head_mask_type: expected one entry per query head ({}), got {}", hq,
                      types.size());
  }
  for (size_t h = 0; h < types.size(); ++h) {
    if (types[h] < -1 || types[h] > 1) {
      throw_value_error(
          "head_mask_type[{}]: expected -1 (streaming), 0 (dense) or 1 (block-sparse), got {}", h,
          types[h]);
    }
    *sparse_heads += types[h] == 1;
    *any_streaming |= types[h] == -1;
  }
  if (!o.streaming_info.empty()) {
    if (static_cast<int64_t>(o.streaming_info.size()) != 2 * hq) {
      throw_value_error(
          "streaming_info: expected 2 * {} entries (sink and local block counts per query "
          "head), got {}",
          hq, o.streaming_info.size());
    }
    for (size_t i = 0; i < o.streaming_info.size(); ++i) {
      if (o.streaming_info[i] < 0) {
        throw_value_error("streaming_info[{}]: expected a non-negative block count, got {}", i,
                          o.streaming_info[i]);
      }
    }
  } else if (*any_streaming) {
    throw_value_error(
        "streaming_info: required when a head is streaming (head_mask_type -1): 2 * {} entries, "
        "(sink, local) key-block counts per query head",
        hq);
  }
}

// The head types the backends read, one per query head. Built once every argument is checked:
// the head count comes from q, which may be a broadcast view of any size, while out (no
// broadcasting) bounds it by memory the caller has.
std::vector<int32_t> head_types(const BlockSparseAttentionOptions& o, int64_t hq) {
  if (!o.head_mask_type.empty()) return o.head_mask_type;
  return std::vector<int32_t>(static_cast<size_t>(hq), 1);
}

// Checks the inputs common to both K/V layouts (head types are checked before) and fills sizes
// and scalars. `kv_heads_dim` is the axis of k holding the KV heads. Outputs are checked by
// check_outputs, after each layout's own inputs.
BlockSparseAttnParams validate(const Views& v, int kv_heads_dim, int64_t max_seqlen_q,
                               int64_t max_seqlen_k, const BlockSparseAttentionOptions& o,
                               int64_t sparse_heads) {
  const TensorView& q = v.q;
  const Device dev = q.device();
  check_rank(q, "q", {3});
  detail::check_float_input(q, "q", nullptr, "");
  detail::check_float_input(v.k, v.k_name, &q, "q");
  detail::check_float_input(v.v, v.v_name, &q, "q");
  check_shape(v.v, v.v_name, v.k.shape(), fmt::format("the shape of {}", v.k_name));
  check_size(v.k, v.k_name, -1, q.size(2), "the head_dim of q");
  if (q.size(2) < 1) throw_value_error("q: expected head_dim >= 1, got shape {}", q.shape_str());
  detail::check_gqa(q.size(1), v.k.size(kv_heads_dim), "q", v.k_name);

  check_rank(v.cu_seqlens_q, "cu_seqlens_q", {1});
  if (v.cu_seqlens_q.size(0) < 1) {
    throw_value_error("cu_seqlens_q: expected [batch + 1] offsets, got shape {}",
                      v.cu_seqlens_q.shape_str());
  }
  const int64_t batch = v.cu_seqlens_q.size(0) - 1;
  check_metadata(v.cu_seqlens_q, "cu_seqlens_q", {batch + 1}, "[batch + 1]", dev);
  if (max_seqlen_q < 0) throw_value_error("max_seqlen_q: expected >= 0, got {}", max_seqlen_q);
  if (max_seqlen_k < 0) throw_value_error("max_seqlen_k: expected >= 0, got {}", max_seqlen_k);
  if (o.p_dropout != 0.0) {
    throw_value_error("p_dropout: expected 0 (inference only: dropout is not implemented), got {}",
                      o.p_dropout);
  }
  if (o.softmax_scale) detail::check_float32_scale(*o.softmax_scale, "softmax_scale");

  BlockSparseAttnParams p;
  p.batch = batch;
  p.num_q_heads = q.size(1);
  p.num_kv_heads = v.k.size(kv_heads_dim);
  p.group = p.num_q_heads / p.num_kv_heads;
  p.head_dim = q.size(2);
  p.block_size = kBlockSparseBlockSize;
  p.max_seqlen_q = max_seqlen_q;
  p.max_seqlen_k = max_seqlen_k;
  p.dtype = q.dtype();
  p.total_q = q.size(0);
  p.mask_q_blocks = ceil_div(max_seqlen_q, kBlockSparseBlockSize);
  p.mask_k_blocks = ceil_div(max_seqlen_k, kBlockSparseBlockSize);
  p.softmax_scale = o.softmax_scale.value_or(1.0 / std::sqrt(static_cast<double>(p.head_dim)));
  p.causal = o.is_causal;
  p.device_index = dev.is_cuda() ? dev.index : 0;
  p.stream = o.stream;

  const Shape mask_shape =
      block_sparse_attention_mask_shape(batch, sparse_heads, max_seqlen_q, max_seqlen_k);
  if (sparse_heads > 0 && !v.mask) {
    throw_value_error(
        "base_blockmask: required when a head is block-sparse (head_mask_type 1): bool {}",
        shape_str(mask_shape));
  }
  if (sparse_heads == 0 && v.mask) {
    throw_value_error(
        "base_blockmask: given, but no head is block-sparse (head_mask_type has no 1); pass "
        "nullopt");
  }
  if (v.mask) {
    check_dtype(*v.mask, "base_blockmask", {DType::kBool});
    check_shape(*v.mask, "base_blockmask", mask_shape,
                "[batch, block-sparse heads, ceil(max_seqlen_q / 128), ceil(max_seqlen_k / 128)]");
    check_device(*v.mask, "base_blockmask", dev, "q");
    check_data(*v.mask, "base_blockmask");
  }
  return p;
}

// out like q, lse FP32 [total_q, Hq]; neither overlapping the other nor any input. The last
// checks of both ops.
void check_outputs(const Views& v) {
  const TensorView& q = v.q;
  const Device dev = q.device();
  detail::check_xattn_output(v.out, "out", q.dtype(), q.shape(), "the shape of q", dev, "q");
  if (v.lse) {
    detail::check_xattn_output(*v.lse, "lse", DType::kF32, {q.size(0), q.size(1)}, "[total_q, Hq]",
                               dev, "q");
    check_no_overlap(*v.lse, "lse", v.out, "out");
  }
  for (const auto& [t, name] :
       {std::pair{v.q, "q"}, {v.k, v.k_name}, {v.v, v.v_name}, {v.cu_seqlens_q, "cu_seqlens_q"}}) {
    check_no_overlap(v.out, "out", t, name);
    if (v.lse) check_no_overlap(*v.lse, "lse", t, name);
  }
  for (const auto& [t, name] : {std::pair{v.mask, "base_blockmask"},
                                {v.cu_seqlens_k, "cu_seqlens_k"},
                                {v.block_table, "block_table"},
                                {v.seqlens_k, "seqlens_k"}}) {
    if (!t) continue;
    check_no_overlap(v.out, "out", *t, name);
    if (v.lse) check_no_overlap(*v.lse, "lse", *t, name);
  }
  // Missing outputs (api/check.h) last: a given lse is checked even when out is missing.
  detail::check_not_missing(v.out, "out");
  detail::check_not_missing(v.lse, "lse");
}

void fill_pointers(BlockSparseAttnParams& p, const Views& v, bool paged) {
  p.q = v.q.data();
  p.q_stride[0] = 0;
  p.q_stride[1] = v.q.stride(0);
  p.q_stride[2] = v.q.stride(1);
  p.q_stride[3] = v.q.stride(2);
  p.out = v.out.data();
  p.out_stride[0] = 0;
  p.out_stride[1] = v.out.stride(0);
  p.out_stride[2] = v.out.stride(1);
  p.out_stride[3] = v.out.stride(2);
  p.cu_seqlens_q = meta_ptr(v.cu_seqlens_q);
  p.cu_seqlens_q_stride = v.cu_seqlens_q.stride(0);
  p.k = v.k.data();
  p.v = v.v.data();
  if (paged) {
    copy_strides(v.k, p.k_stride, 4);
    copy_strides(v.v, p.v_stride, 4);
    p.block_table = meta_ptr(*v.block_table);
    copy_strides(*v.block_table, p.block_table_stride, 2);
    p.seqlens_k = meta_ptr(*v.seqlens_k);
    p.seqlens_k_stride = v.seqlens_k->stride(0);
  } else {
    p.k_stride[0] = p.v_stride[0] = 0;
    for (int d = 0; d < 3; ++d) {
      p.k_stride[d + 1] = v.k.stride(d);
      p.v_stride[d + 1] = v.v.stride(d);
    }
    p.cu_seqlens_k = meta_ptr(*v.cu_seqlens_k);
    p.cu_seqlens_k_stride = v.cu_seqlens_k->stride(0);
  }
  if (v.mask) {
    p.block_mask = v.mask->data_as<const uint8_t>();
    copy_strides(*v.mask, p.mask_stride, 4);
  }
  if (v.lse) {
    p.lse = v.lse->data_as<float>();
    p.lse_stride[0] = 0;
    p.lse_stride[1] = v.lse->stride(0);
    p.lse_stride[2] = v.lse->stride(1);
  }
}

Views stage(detail::HostStaging& s, const Views& v) {
  Views h;
  h.q = s.input(v.q);
  h.k = s.input(v.k);
  h.v = s.input(v.v);
  h.cu_seqlens_q = s.input(v.cu_seqlens_q);
  h.cu_seqlens_k = s.input(v.cu_seqlens_k);
  h.block_table = s.input(v.block_table);
  h.seqlens_k = s.input(v.seqlens_k);
  h.mask = s.input(v.mask);
  h.out = s.output(v.out);
  h.lse = s.output(v.lse);
  return h;
}

void run(BlockSparseAttnParams& p, const Views& v, bool paged, const BlockSparseAttentionOptions& o,
         const char* op) {
  if (o.backend == Backend::kNative && !v.q.device().is_cuda()) {  // the CPU backend
    fill_pointers(p, v, paged);
    cpu_block_sparse_attention(p);
    return;
  }
  if (o.backend == Backend::kNative) {
    detail::check_native_block_sparse(
        {{&v.q, "q"}, {&v.k, v.k_name}, {&v.v, v.v_name}, {&v.out, "out"}}, p.num_q_heads, op);
    if (paged && p.page_size % 8 != 0) {
      detail::throw_not_supported(
          "k_cache: backend 'native' of {} supports page sizes that are multiples of 8, got {}", op,
          p.page_size);
    }
    fill_pointers(p, v, paged);
    native_block_sparse_attention(p);
    return;
  }
  detail::HostStaging staging;
  fill_pointers(p, stage(staging, v), paged);
  reference_block_sparse_attention(p);
  staging.commit();
}

}  // namespace

Shape block_sparse_attention_mask_shape(int64_t batch, int64_t sparse_heads, int64_t max_seqlen_q,
                                        int64_t max_seqlen_k) {
  return {batch, sparse_heads, ceil_div(max_seqlen_q, kBlockSparseBlockSize),
          ceil_div(max_seqlen_k, kBlockSparseBlockSize)};
}

void block_sparse_attention(const TensorView& q, const TensorView& k, const TensorView& v,
                            const TensorView& cu_seqlens_q, const TensorView& cu_seqlens_k,
                            const std::optional<TensorView>& base_blockmask, int64_t max_seqlen_q,
                            int64_t max_seqlen_k, const TensorView& out,
                            const std::optional<TensorView>& lse,
                            const BlockSparseAttentionOptions& options) {
  int64_t sparse_heads = 0;
  bool any_streaming = false;
  check_rank(q, "q", {3});
  check_heads(options, q.size(1), &sparse_heads, &any_streaming);
  check_rank(k, "k", {3});
  check_rank(v, "v", {3});
  const Views views{
      q, k, v, cu_seqlens_q, out, cu_seqlens_k, std::nullopt, std::nullopt, base_blockmask, lse};
  BlockSparseAttnParams p = validate(views, 1, max_seqlen_q, max_seqlen_k, options, sparse_heads);
  check_metadata(cu_seqlens_k, "cu_seqlens_k", {p.batch + 1},
                 "[batch + 1], batch from cu_seqlens_q", q.device());
  check_outputs(views);
  const std::vector<int32_t> types = head_types(options, q.size(1));
  p.kv_layout = XAttnKVLayout::kVarlen;
  p.total_k = k.size(0);
  p.head_mask_type = types.data();
  p.streaming_info = any_streaming ? options.streaming_info.data() : nullptr;
  run(p, views, false, options, "block_sparse_attention");
}

void block_sparse_attention_paged(const TensorView& q, const TensorView& k_cache,
                                  const TensorView& v_cache, const TensorView& block_table,
                                  const TensorView& seqlens_k, const TensorView& cu_seqlens_q,
                                  const std::optional<TensorView>& base_blockmask,
                                  int64_t max_seqlen_q, int64_t max_seqlen_k, const TensorView& out,
                                  const std::optional<TensorView>& lse,
                                  const BlockSparseAttentionOptions& options) {
  int64_t sparse_heads = 0;
  bool any_streaming = false;
  check_rank(q, "q", {3});
  check_heads(options, q.size(1), &sparse_heads, &any_streaming);
  check_rank(k_cache, "k_cache", {4});
  check_rank(v_cache, "v_cache", {4});
  const Views views{q,           k_cache,   v_cache,        cu_seqlens_q, out,       std::nullopt,
                    block_table, seqlens_k, base_blockmask, lse,          "k_cache", "v_cache"};
  BlockSparseAttnParams p = validate(views, 2, max_seqlen_q, max_seqlen_k, options, sparse_heads);
  const int64_t page_size = k_cache.size(1);
  if (page_size < 1) {
    throw_value_error("k_cache: expected a page size (shape[1]) of at least 1, got shape {}",
                      k_cache.shape_str());
  }
  check_rank(block_table, "block_table", {2});
  check_metadata(block_table, "block_table", {p.batch, block_table.size(1)},
                 "[batch, max_pages], batch from cu_seqlens_q", q.device());
  check_metadata(seqlens_k, "seqlens_k", {p.batch}, "[batch], batch from cu_seqlens_q", q.device());
  const int64_t max_keys = detail::checked_size_product(block_table.size(1), page_size,
                                                        "block_table", "max_pages * page_size");
  if (max_seqlen_k > max_keys) {
    throw_value_error(
        "max_seqlen_k: expected at most max_pages * page_size = {} * {} = {} keys, got {}",
        block_table.size(1), page_size, max_keys, max_seqlen_k);
  }
  check_outputs(views);
  const std::vector<int32_t> types = head_types(options, q.size(1));
  p.kv_layout = XAttnKVLayout::kPaged;
  p.page_size = page_size;
  p.num_pages = k_cache.size(0);
  p.max_pages = block_table.size(1);
  p.head_mask_type = types.data();
  p.streaming_info = any_streaming ? options.streaming_info.data() : nullptr;
  run(p, views, true, options, "block_sparse_attention_paged");
}

}  // namespace sparse_attn
