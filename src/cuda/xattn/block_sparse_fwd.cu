// Native block-sparse attention (block_sparse_attention, _paged, and the attention step of
// xattention_prefill): kernel parameters and TMA descriptors from the validated params, int64
// metadata narrowed into int32 scratch on the stream, then the one dispatch from (dtype, head
// dim) to an instantiation (instantiations/*.cu).
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <cutlass/numeric_types.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "api/xattn_params.h"
#include "cuda/common/check.h"
#include "cuda/common/device_guard.h"
#include "cuda/common/device_props.h"
#include "cuda/common/narrow_metadata.h"
#include "cuda/common/tensor_map.h"
#include "cuda/common/workspace_pool.h"
#include "cuda/xattn/block_sparse_fwd.h"
#include "sparse_attn/errors.h"

namespace sparse_attn::cuda {

template <class Element, int kHeadDim>
void launch_block_sparse_fwd(const BlockSparseFwdParams& p, int64_t tiles, int sms,
                             cudaStream_t stream);

namespace {

// A 4-D descriptor (head dim, row, head, outer); `stride` in elements for the row, head and
// outer axes.
CUtensorMap tensor_map(const void* base, DType dtype, const int64_t (&size)[4],
                       const int64_t (&stride)[3], uint32_t box_cols, uint32_t box_rows) {
  const uint32_t box[4] = {box_cols, box_rows, 1, 1};
  return tiled_tensor_map(base, dtype, 4, size, stride, box, "block_sparse_attention");
}

// The instantiation's tile configuration for a head dim (validated: 64, 128 or 256): keys per
// K/V tile, and whether it launches persistent CTAs.
struct TileChoice {
  int block_n;
  bool persistent;
};
template <int kHeadDim>
constexpr TileChoice tile_choice() {
  return {BlockSparseTile<kHeadDim>::kBlockN, BlockSparseTile<kHeadDim>::kPersistent};
}
TileChoice tile_choice(int64_t head_dim) {
  switch (head_dim) {
    case 64:
      return tile_choice<64>();
    case 128:
      return tile_choice<128>();
    default:
      return tile_choice<256>();
  }
}

// (Sequence, query head) units per section of the CTA order: whole KV groups whose K and V
// (max_seqlen_k keys each) take at most half of L2 together; at least one group, at most every
// unit. The CTAs running at once then re-read their K/V from L2 rather than DRAM.
int32_t section_units(const BlockSparseAttnParams& a) {
  if (a.section > 0) return static_cast<int32_t>(std::min(a.section, a.batch * a.num_q_heads));
  const int64_t l2 = l2_cache_bytes(a.device_index);
  const int64_t kv_head_bytes = std::max<int64_t>(4 * a.max_seqlen_k * a.head_dim, 1);
  const int64_t groups = std::max<int64_t>(1, l2 / 2 / kv_head_bytes);
  return static_cast<int32_t>(std::min(groups * a.group, a.batch * a.num_q_heads));
}

// Key splits of each work tile. One unless the work tiles fill less than half of the GPU's SMs
// (a short query chunk against a long context, few heads): then as many splits as fit one wave
// of CTAs, each at least 4 key blocks (512 keys) of the longest sequence, at most kMaxSplits.
// E.g. on 132 SMs: 8 heads x 1 query block at 32K keys, 8 tiles: 132 / 8 = 16 splits of 16
// blocks (128 CTAs); 32 heads x 1 block: 4 splits; 32 heads x 3 blocks, 96 tiles: no split.
int64_t num_splits(const BlockSparseAttnParams& a, int64_t tiles) {
  if (a.num_splits > 0) return std::min<int64_t>(a.num_splits, kMaxSplits);
  const int64_t sms = sm_count(a.device_index);
  if (2 * tiles > sms) return 1;
  const int64_t k_blocks = (a.max_seqlen_k + 127) / 128;
  return std::max<int64_t>(1,
                           std::min({sms / tiles, k_blocks / 4, static_cast<int64_t>(kMaxSplits)}));
}

}  // namespace
}  // namespace sparse_attn::cuda

namespace sparse_attn {

void native_block_sparse_attention(const BlockSparseAttnParams& a) {
  using cuda::BlockSparseFwdParams;
  using cuda::BlockSparseKV;
  cuda::DeviceGuard guard(a.device_index);
  const int64_t m_blocks = (a.max_seqlen_q + 127) / 128;
  const int64_t tiles = a.batch * a.num_q_heads * m_blocks;
  if (tiles == 0) return;
  const int64_t splits = cuda::num_splits(a, tiles);
  // Work items are int32, and a persistent CTA's last claim reaches items + SMs - 1.
  const int sms = cuda::sm_count(a.device_index);
  const int64_t max_items = std::numeric_limits<int32_t>::max() - sms;
  if (tiles * splits > max_items) {
    throw NotSupportedError(
        "block_sparse_attention: backend 'native' takes at most " + std::to_string(max_items) +
        " work items (128 query rows of one head and sequence, times the key splits); got " +
        std::to_string(tiles * splits));
  }

  // int64 metadata is narrowed to int32 (NarrowedMetadata), exact while every bound fits.
  const bool wide =
      a.cu_seqlens_q.wide() || a.cu_seqlens_k.wide() || a.seqlens_k.wide() || a.block_table.wide();
  constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();
  if (wide && std::max({a.total_q, a.total_k, a.num_pages, a.max_seqlen_k}) > kInt32Max) {
    throw NotSupportedError(
        "block_sparse_attention: backend 'native' takes int64 metadata for at most 2^31 - 1 "
        "query rows, keys and pages; pass int32 metadata or backend='reference'");
  }

  BlockSparseFwdParams p;
  p.batch = static_cast<int32_t>(a.batch);
  p.num_q_heads = static_cast<int32_t>(a.num_q_heads);
  p.group = static_cast<int32_t>(a.group);
  p.m_blocks = static_cast<int32_t>(m_blocks);
  p.section = cuda::section_units(a);
  p.max_seqlen_q = static_cast<int32_t>(a.max_seqlen_q);
  p.max_seqlen_k = static_cast<int32_t>(a.max_seqlen_k);
  p.total_q = a.total_q;
  p.total_k = a.total_k;
  p.cu_seqlens_q_stride = a.cu_seqlens_q_stride;
  p.cu_seqlens_k_stride = a.cu_seqlens_k_stride;
  p.seqlens_k_stride = a.seqlens_k_stride;
  p.block_table_stride[0] = a.block_table_stride[0];
  p.block_table_stride[1] = a.block_table_stride[1];
  // int32 metadata is read in place, int64 metadata through int32 copies (NarrowedMetadata).
  auto stream = static_cast<cudaStream_t>(a.stream);
  cuda::NarrowedMetadata narrowed(a.device_index, stream);
  MetaPtr cu_q = a.cu_seqlens_q, cu_k = a.cu_seqlens_k, lens_k = a.seqlens_k, table = a.block_table;
  narrowed.narrow(cu_q, a.batch + 1, 1, p.cu_seqlens_q_stride);
  narrowed.narrow(cu_k, a.batch + 1, 1, p.cu_seqlens_k_stride);
  narrowed.narrow(lens_k, a.batch, 1, p.seqlens_k_stride);
  narrowed.narrow(table, a.batch, a.max_pages, p.block_table_stride[0], &p.block_table_stride[1]);
  narrowed.finish();
  p.cu_seqlens_q = static_cast<const int32_t*>(cu_q.data());
  p.cu_seqlens_k = static_cast<const int32_t*>(cu_k.data());
  p.seqlens_k = static_cast<const int32_t*>(lens_k.data());
  p.block_table = static_cast<const int32_t*>(table.data());
  p.page_size = static_cast<int32_t>(a.page_size);
  p.max_pages = static_cast<int32_t>(a.max_pages);
  p.block_mask = a.block_mask;
  for (int i = 0; i < 4; ++i) p.mask_stride[i] = a.mask_stride[i];
  for (int64_t h = 0, s = 0; h < a.num_q_heads; ++h) {
    p.head_kind[h] = static_cast<int8_t>(a.head_mask_type[h]);
    p.sparse_index[h] = static_cast<int16_t>(a.head_mask_type[h] == 1 ? s++ : 0);
    if (a.head_mask_type[h] == -1) {
      p.sink[h] = a.streaming_info[2 * h];
      p.local[h] = a.streaming_info[2 * h + 1];
    }
  }
  p.out = a.out;
  for (int i = 0; i < 3; ++i) p.out_stride[i] = a.out_stride[i];
  p.lse = a.lse;
  for (int i = 0; i < 3; ++i) p.lse_stride[i] = a.lse_stride[i];
  p.scale_log2 = static_cast<float>(a.softmax_scale * M_LOG2E);
  p.causal = a.causal;

  // Q: (D, rows, heads, outer); varlen has one outer of total_q rows, padded one per sequence.
  const int cols = 64;  // 128 bytes of 16-bit elements: the swizzle span
  const bool varlen_q = static_cast<bool>(a.cu_seqlens_q);
  p.tma_q = cuda::tensor_map(
      a.q, a.dtype,
      {a.head_dim, varlen_q ? a.total_q : a.max_seqlen_q, a.num_q_heads, varlen_q ? 1 : a.batch},
      {a.q_stride[1], a.q_stride[2], a.q_stride[0]}, cols, 128);
  const cuda::TileChoice tile = cuda::tile_choice(a.head_dim);
  int64_t kv_rows = 0, kv_outer = 1;
  switch (a.kv_layout) {
    case XAttnKVLayout::kPaged:
      p.kv = BlockSparseKV::kPaged;
      kv_rows = a.page_size;
      kv_outer = a.num_pages;
      break;
    case XAttnKVLayout::kVarlen:
      kv_rows = a.total_k;
      break;
    case XAttnKVLayout::kPadded:
      kv_rows = a.max_seqlen_k;
      kv_outer = a.batch;
      break;
  }
  auto kv_map = [&](const void* base, const int64_t(&s)[4], uint32_t rows) {
    return cuda::tensor_map(base, a.dtype, {a.head_dim, kv_rows, a.num_kv_heads, kv_outer},
                            {s[1], s[2], s[0]}, cols, rows);
  };
  p.tma_k = kv_map(a.k, a.k_stride, tile.block_n);
  p.tma_v = kv_map(a.v, a.v_stride, tile.block_n);
  if (p.kv == BlockSparseKV::kPaged && a.page_size % tile.block_n != 0) {
    p.tma_k_pieces = kv_map(a.k, a.k_stride, 8);
    p.tma_v_pieces = kv_map(a.v, a.v_stride, 8);
  }

  // SplitKV partials, stream-ordered scratch freed after the merge is enqueued.
  p.splits = static_cast<int32_t>(splits);
  p.partial_rows = varlen_q ? a.total_q : a.batch * a.max_seqlen_q;
  const int64_t slots = splits > 1 ? splits * p.partial_rows * a.num_q_heads : 0;
  const cuda::StreamScratch partials(slots * (a.head_dim + 1) * sizeof(float), a.device_index,
                                     stream);
  if (slots > 0) {
    p.o_partial = static_cast<float*>(partials.get());
    p.lse_partial = p.o_partial + slots * a.head_dim;
  }
  // The persistent launches' item counter (block_sparse_launch.cuh zeroes it on the stream).
  p.work_items = static_cast<int32_t>(tiles * splits);
  const cuda::StreamScratch counter(tile.persistent ? sizeof(int32_t) : 0, a.device_index, stream);
  p.work_counter = static_cast<int32_t*>(counter.get());
  const bool bf16 = a.dtype == DType::kBF16;
  switch (a.head_dim) {
    case 64:
      return bf16 ? cuda::launch_block_sparse_fwd<cutlass::bfloat16_t, 64>(p, tiles, sms, stream)
                  : cuda::launch_block_sparse_fwd<cutlass::half_t, 64>(p, tiles, sms, stream);
    case 128:
      return bf16 ? cuda::launch_block_sparse_fwd<cutlass::bfloat16_t, 128>(p, tiles, sms, stream)
                  : cuda::launch_block_sparse_fwd<cutlass::half_t, 128>(p, tiles, sms, stream);
    case 256:
      return bf16 ? cuda::launch_block_sparse_fwd<cutlass::bfloat16_t, 256>(p, tiles, sms, stream)
                  : cuda::launch_block_sparse_fwd<cutlass::half_t, 256>(p, tiles, sms, stream);
    default:
      throw NotSupportedError(
          "block_sparse_attention: backend 'native' supports head dims 64, "
          "128 and 256, got " +
          std::to_string(a.head_dim));
  }
}

}  // namespace sparse_attn
