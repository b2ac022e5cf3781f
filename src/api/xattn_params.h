// The resolved XAttention problems: what validation (src/api/xattn_*.cpp) hands to a backend.
// Backends (the CPU reference, native kernels) trust these structs: shapes, dtypes, devices,
// layouts and options are checked. Tensor contents (cu_seqlens, lengths, page ids) are not;
// the reference checks them as it reads them.
//
// Conventions
// - Strides are int64, in elements of the tensor's own dtype; the stride of an axis of size 1
//   may be anything (it is only ever multiplied by 0).
// - Q, K, V and out share one dtype (`dtype`: BF16, FP16 or FP32). Sums and LSE are FP32,
//   masks are bool stored as one byte (0 or 1), metadata is int32.
// - Pointers marked "host" point to memory owned by the API call, alive for the whole call;
//   every other pointer lives on the tensors' device.
#pragma once

#include <cstdint>
#include <functional>

#include "api/meta_ptr.h"
#include "sparse_attn/tensor.h"

namespace sparse_attn {

// find_blocks_chunked, and the selection step of xattn_estimate / xattention_prefill.
struct BlockSelectParams {
  int64_t batch = 0;
  int64_t num_heads = 0;  // H of attn_sums (query heads)
  int64_t q_blocks = 0;
  int64_t k_blocks = 0;
  int64_t q_len = 0;  // query rows behind the sums; ceil(q_len / block_size) == q_blocks
  int64_t k_len = 0;  // keys; ceil(k_len / block_size) == k_blocks; q_len <= k_len when
                      // causal or keep_recent (the diagonal is placed)
  int64_t block_size = 0;

  // FP32 [batch, num_heads, q_blocks, k_blocks].
  const float* attn_sums = nullptr;
  int64_t sums_stride[4] = {};
  // bool [batch, num_heads, q_blocks, k_blocks], every element written.
  uint8_t* block_mask = nullptr;
  int64_t mask_stride[4] = {};

  const double* thresholds = nullptr;  // host, [num_heads], each in [0, 1]
  bool causal = true;
  bool keep_sink = false;
  bool keep_recent = false;

  int device_index = 0;
  void* stream = nullptr;  // cudaStream_t
};

// The estimation step of xattn_estimate: attn_sums from query and key. The selection that
// follows reads these sums through `select` (whose attn_sums is this op's attn_sums).
struct XAttnEstimateParams {
  int64_t batch = 0;
  int64_t num_q_heads = 0;   // Hq
  int64_t num_kv_heads = 0;  // Hkv; query head h reads KV head h / group
  int64_t group = 0;         // Hq / Hkv
  int64_t head_dim = 0;      // D
  int64_t q_len = 0;         // Lq (>= 0)
  int64_t k_len = 0;         // Lk (>= Lq when causal or keep_recent); query row r is at Lk - Lq + r
  int64_t block_size = 0;
  int64_t stride = 0;      // divides block_size
  int64_t chunk_size = 0;  // processing granularity only (a multiple of block_size)
  int64_t q_blocks = 0;    // ceil(Lq / block_size)
  int64_t k_blocks = 0;    // ceil(Lk / block_size)
  DType dtype = DType::kBF16;

  // Query [batch, Hq, Lq, D] and key [batch, Hkv, Lk, D]; strides (batch, head, token, dim).
  const void* q = nullptr;
  int64_t q_stride[4] = {};
  const void* k = nullptr;
  int64_t k_stride[4] = {};

  double score_scale = 0.0;  // 1 / (sqrt(D) * stride * norm), natural-log units
  bool causal = true;

  // FP32 [batch, Hq, q_blocks, k_blocks], every element written (0 where a query block sees
  // no key of the key block).
  float* attn_sums = nullptr;
  int64_t sums_stride[4] = {};

  // The selection step; its attn_sums are the ones above, its block_mask the op's output.
  BlockSelectParams select;

  int device_index = 0;
  void* stream = nullptr;  // cudaStream_t
};

// Where sequence b's keys and values live.
enum class XAttnKVLayout : uint8_t {
  kPadded,  // [batch, Hkv, max_seqlen_k, D] (xattention_prefill): k + b * stride[0] +
            // t * stride[1]
  kVarlen,  // [total_k, Hkv, D]: token t of sequence b at row cu_seqlens_k[b] + t
  kPaged,   // [num_pages, page_size, Hkv, D]: page block_table[b, t / page_size],
            // slot t % page_size; sequence b has seqlens_k[b] keys
};

// block_sparse_attention (varlen or paged) and the attention step of xattention_prefill.
struct BlockSparseAttnParams {
  int64_t batch = 0;
  int64_t num_q_heads = 0;   // Hq
  int64_t num_kv_heads = 0;  // Hkv
  int64_t group = 0;         // Hq / Hkv: query head h reads KV head h / group
  int64_t head_dim = 0;      // D of Q, K, V and out
  int64_t block_size = 0;    // 128
  int64_t max_seqlen_q = 0;  // bound on every sequence's query rows
  int64_t max_seqlen_k = 0;  // bound on every sequence's keys
  DType dtype = DType::kBF16;

  // Queries, strides in the order (batch, row, head, dim). Padded (cu_seqlens_q null):
  // [batch, Hq, q_len, D] with every sequence max_seqlen_q rows; row r of sequence b at
  // q + b * q_stride[0] + r * q_stride[1]. Varlen: [total_q, Hq, D], q_stride[0] == 0, row r of
  // sequence b at q + (cu_seqlens_q[b] + r) * q_stride[1].
  const void* q = nullptr;
  int64_t q_stride[4] = {};
  MetaPtr cu_seqlens_q;             // [batch + 1], or null (padded)
  int64_t cu_seqlens_q_stride = 0;  // entry b at cu_seqlens_q[b * stride]
  int64_t total_q = 0;              // varlen: q.shape[0]; padded: batch * max_seqlen_q

  // Keys and values, same layout (see XAttnKVLayout); strides in the order
  // (batch or page, token or slot, head, dim). Varlen: stride[0] == 0. Padded: every sequence
  // has max_seqlen_k keys.
  XAttnKVLayout kv_layout = XAttnKVLayout::kVarlen;
  const void* k = nullptr;
  int64_t k_stride[4] = {};
  const void* v = nullptr;
  int64_t v_stride[4] = {};
  MetaPtr cu_seqlens_k;             // kVarlen: [batch + 1]; otherwise null
  int64_t cu_seqlens_k_stride = 0;  // entry b at cu_seqlens_k[b * stride]
  int64_t total_k = 0;              // kVarlen: k.shape[0]
  MetaPtr block_table;              // kPaged: [batch, max_pages]; otherwise null
  int64_t block_table_stride[2] = {};
  MetaPtr seqlens_k;  // kPaged: [batch]; otherwise null
  int64_t seqlens_k_stride = 0;
  int64_t page_size = 0;  // kPaged: any size >= 1
  int64_t num_pages = 0;  // kPaged: k.shape[0]
  int64_t max_pages = 0;  // kPaged: block_table.shape[1]

  // Per query head: -1 streaming, 0 dense, 1 block-sparse (host, [Hq]).
  const int32_t* head_mask_type = nullptr;
  // (sink, local) key-block counts per query head, host, [2 * Hq]; null when no head is -1.
  const int32_t* streaming_info = nullptr;
  // bool [batch, sparse_heads, mask_q_blocks, mask_k_blocks]; sparse head s is the s-th query
  // head of type 1. Null when no head is 1.
  const uint8_t* block_mask = nullptr;
  int64_t mask_stride[4] = {};
  int64_t mask_q_blocks = 0;  // ceil(max_seqlen_q / 128)
  int64_t mask_k_blocks = 0;  // ceil(max_seqlen_k / 128)

  // Output, addressed like q (same stride order); every element of every row that belongs to a
  // sequence is written, rows outside all sequences (varlen) are left alone.
  void* out = nullptr;
  int64_t out_stride[4] = {};
  // FP32 LSE (natural log), -inf for rows that see no key; null when not wanted. Addressed like
  // q without the dim: strides (batch, row, head). Padded: [batch, Hq, q_len]; varlen:
  // [total_q, Hq] with lse_stride[0] == 0.
  float* lse = nullptr;
  int64_t lse_stride[3] = {};

  double softmax_scale = 0.0;  // resolved; positive
  bool causal = true;          // bottom-right: row r sees keys t <= seq_k - seq_q + r

  // Native: (sequence, query head) units per section of the CTA order (0: from the L2 size).
  // Never set by the API; tests set it so that small problems take several sections.
  int64_t section = 0;
  // Native: splits of each work tile's keys (0: picked from the grid, docs/xattention.md).
  // Never set by the API; tests set it to take the split path on any shape.
  int64_t num_splits = 0;

  int device_index = 0;
  void* stream = nullptr;  // cudaStream_t
};

// Native (CUDA) implementations. A CPU-only build defines them to raise NotSupportedError
// (xattn_native_cpu_only.cpp); a CUDA build defines them in src/cuda. Called only with
// validated params, every tensor on one CUDA device.
void native_xattn_estimate(const XAttnEstimateParams& params);  // sums, then the selection
void native_find_blocks(const BlockSelectParams& params);

// xattention_prefill_paged's gather: keys [0, k_len) of every request from their pages into
// contiguous K and V buffers [batch, k_len, Hkv, D].
struct PagedGatherParams {
  // [num_pages, page_size, Hkv, D], head dim contiguous; bf16 or fp16, copied as 16-bit words
  const void* k_cache = nullptr;
  const void* v_cache = nullptr;  // the same shape
  int64_t k_stride[3] = {};       // (page, slot, head), elements
  int64_t v_stride[3] = {};
  MetaPtr block_table;  // [batch, max_pages]; ids outside [0, num_pages) read as zero rows
  int64_t block_table_stride[2] = {};
  int64_t batch = 0, k_len = 0, page_size = 0, num_pages = 0, num_kv_heads = 0, head_dim = 0;
  int device_index = 0;
  void* stream = nullptr;
};

// Gathers into stream-ordered scratch, calls `use(k, v)` with the two contiguous buffers (it
// enqueues the work that reads them on the same stream), then frees the scratch on the stream.
void native_gather_pages(const PagedGatherParams& params,
                         const std::function<void(const void* k, const void* v)>& use);
void native_block_sparse_attention(const BlockSparseAttnParams& params);

}  // namespace sparse_attn
