// Kernel parameters of native block-sparse attention (XAttention's attention step and
// block_sparse_attention / _paged) on the SM90 attention core. Filled on the host from the
// validated BlockSparseAttnParams (block_sparse_fwd.cu); the kernel trusts them.
#pragma once

#include <cuda.h>  // CUtensorMap (a plain struct; no driver call is made through this header)

#include <cstdint>

namespace sparse_attn::cuda {

enum class BlockSparseKV : int32_t {
  kRows,   // one K/V tensor of rows (varlen: sequence b from row cu_seqlens_k[b]; padded: outer b)
  kPaged,  // pages of page_size rows: key t of sequence b in page block_table[b, t / page_size]
};

// Tile configuration per head dim (keys per tile, pipeline stages, launch, register split), for
// 128-row CTAs of two consumer warpgroups. A tile never straddles a 128-key mask block, so
// kBlockN divides 128. d64 / d128: 128-key tiles (S and P of a 64 x 128 tile and O fit the
// consumers' registers); d256: 64-key tiles, since O alone takes 128 registers a thread. Stages
// (K/V tiles in flight): three at d64 and d128 (d128: 32 KB Q + 3 x 64 KB K/V), two at d256
// (64 KB Q + 2 x 64 KB; three K stages and two V fit too and measured no better:
// docs/perf-notes.md). d64 / d128 launch persistent CTAs (sm90/scheduler.h), whose producer
// warp needs 40 registers for its item loop (it spills ~470 bytes at 24); d256 launches one CTA
// per work item: its consumers' main loop spills ~200 bytes in the persistent kernel at either
// 40 / 232 or 32 / 240.
template <int kHeadDim>
struct BlockSparseTile;
template <>
struct BlockSparseTile<64> {
  static constexpr int kBlockN = 128, kStages = 3;
  static constexpr bool kPersistent = true;
  static constexpr int kProducerRegisters = 40, kConsumerRegisters = 232;
};
template <>
struct BlockSparseTile<128> {
  static constexpr int kBlockN = 128, kStages = 3;
  static constexpr bool kPersistent = true;
  static constexpr int kProducerRegisters = 40, kConsumerRegisters = 232;
};
template <>
struct BlockSparseTile<256> {
  static constexpr int kBlockN = 64, kStages = 2;
  static constexpr bool kPersistent = false;
  static constexpr int kProducerRegisters = 24, kConsumerRegisters = 240;
};

constexpr int kMaxSplits = 64;  // SplitKV: the merge reads two LSEs a lane

struct BlockSparseFwdParams {
  static constexpr int kMaxHeads = 256;  // per-head tables below

  // TMA descriptors, 4-D (head dim, row, head, outer), 128-byte swizzle, boxes of 64 columns x
  // 128 rows for Q and x kBlockN rows for K / V (a whole tile). Q: rows of a sequence (varlen:
  // all sequences, outer 1; padded: max_seqlen_q rows, outer = batch). K / V: kRows like Q;
  // kPaged: rows are page slots, outer is the page. The piece descriptors (8-row boxes) load the
  // tiles that cross a page boundary; set when kPaged and page_size % kBlockN != 0.
  CUtensorMap tma_q, tma_k, tma_v, tma_k_pieces, tma_v_pieces;

  int32_t batch = 0;
  int32_t num_q_heads = 0;
  int32_t group = 0;     // query heads per KV head
  int32_t m_blocks = 0;  // ceil(max_seqlen_q / 128): work tiles per (sequence, head)
  // CTAs are dealt in sections of `section` consecutive (sequence, query head) units (unit =
  // sequence * num_q_heads + head), 1 <= section <= batch * num_q_heads: the K/V that the CTAs
  // of one section read fits in L2 together.
  int32_t section = 1;
  int32_t max_seqlen_q = 0, max_seqlen_k = 0;
  int64_t total_q = 0, total_k = 0;  // varlen row counts (the clamps of broken offsets)

  // Sequences. cu_seqlens_q: [batch + 1] or null (padded: every sequence max_seqlen_q rows).
  const int32_t* cu_seqlens_q = nullptr;
  int64_t cu_seqlens_q_stride = 1;
  BlockSparseKV kv = BlockSparseKV::kRows;
  const int32_t* cu_seqlens_k = nullptr;  // kRows varlen: [batch + 1]; null: padded
  int64_t cu_seqlens_k_stride = 1;
  const int32_t* seqlens_k = nullptr;  // kPaged: [batch]
  int64_t seqlens_k_stride = 1;
  const int32_t* block_table = nullptr;  // kPaged: [batch, max_pages]
  int64_t block_table_stride[2] = {};
  int32_t page_size = 0, max_pages = 0;

  // Which key blocks each query head reads. kind: 0 dense, 1 block-sparse (mask slice
  // `sparse_index`), -1 streaming (sink, local) blocks.
  const uint8_t* block_mask = nullptr;  // bool [batch, sparse_heads, m_blocks, k_blocks] or null
  int64_t mask_stride[4] = {};
  int8_t head_kind[kMaxHeads] = {};
  int16_t sparse_index[kMaxHeads] = {};
  int32_t sink[kMaxHeads] = {};   // clamped to the mask's key blocks
  int32_t local[kMaxHeads] = {};  // likewise

  // Outputs: out like q (strides outer, row, head; the head dim contiguous), lse FP32 or null.
  void* out = nullptr;
  int64_t out_stride[3] = {};
  float* lse = nullptr;
  int64_t lse_stride[3] = {};

  // SplitKV, for grids too small to fill the GPU: each work tile's visible key blocks are cut
  // into `splits` contiguous ranges, one CTA each (CTA = work tile * splits + split), which
  // write FP32 partials; the merge kernel then writes out and lse. Partial row index: the
  // sequence's row in q (varlen) or batch * max_seqlen_q + row (padded). o_partial: [splits,
  // partial_rows, Hq, D], each row normalised by its own sum; lse_partial: [splits,
  // partial_rows, Hq], natural log, -inf for a split that saw no key. Null when splits == 1.
  int32_t splits = 1;
  int64_t partial_rows = 0;
  float* o_partial = nullptr;
  float* lse_partial = nullptr;

  float scale_log2 = 0.f;  // softmax_scale * log2(e)
  bool causal = true;

  // Work items (CTAs of a launch of one CTA per item) = work tiles * splits. A persistent launch
  // (sm90/scheduler.h) claims them from work_counter, [1] int32, zero at launch; null otherwise.
  int32_t work_items = 0;
  int32_t* work_counter = nullptr;
};

}  // namespace sparse_attn::cuda
