// XAttention: block-sparse prefill with antidiagonal block-importance estimation.
//
// Four ops, the phases of the XAttention pipeline (docs/xattention.md states the exact math):
//   xattn_estimate         strided antidiagonal scores -> softmax -> per-block sums + selection
//   find_blocks_chunked    the selection alone (re-select from saved sums with another threshold)
//   block_sparse_attention attention over selected 128x128 blocks, Block-Sparse-Attention's
//                          calling convention (varlen, head_mask_type, streaming_info), plus
//                          block_sparse_attention_paged for a paged KV cache
//   xattention_prefill     estimate + select + attend in one call
//
// Destination passing: the caller provides every output (the *_shape functions give the
// shapes) and the stream; no op allocates. Outputs may be any view with positive strides that
// overlaps no input. Inputs may be any strided view, so a [B, L, H, D] tensor transposed to
// [B, H, L, D] is accepted without a copy. GQA is native everywhere: query head h reads KV head
// h / (Hq / Hkv).
//
// Positions are bottom-right aligned: with Lq query rows and Lk keys, query row r sits at
// position Lk - Lq + r, so the last query row sees the last key (a prefill chunk against all
// earlier keys). Query blocks are the rows [128 i, 128 i + 128) of the call, key blocks the keys
// [128 j, 128 j + 128), as in Block-Sparse-Attention's base_blockmask.
//
// Validation happens once, at this boundary, and reads no tensor contents. Contents the caller
// promises (monotonic cu_seqlens, lengths within max_seqlen, page ids in range) are checked by
// the reference backend, which reads them anyway (ValueError when broken).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "sparse_attn/common.h"
#include "sparse_attn/tensor.h"

namespace sparse_attn {

// ---------------------------------------------------------------------------------------
// Block selection (find_blocks_chunked; also the selection step of the ops below)
// Per query block: forced blocks first, then the other eligible key blocks by descending sum
// (ties: lower block index first); a block is kept while the sum of the blocks before it is
// below threshold * (sum of the eligible blocks). threshold 1 keeps every eligible block.
// ---------------------------------------------------------------------------------------

struct BlockSelectOptions {
  double threshold = 0.9;               // in [0, 1]
  std::vector<double> head_thresholds;  // non-empty: one per query head, replaces threshold
  bool causal = true;        // key blocks past the block of a query block's last key: never kept;
                             // that last block (the diagonal) is always kept
  bool keep_sink = false;    // always keep key block 0
  bool keep_recent = false;  // always keep the diagonal block (implied by causal)
  int64_t block_size = 128;  // tokens per query/key block
  Backend backend = Backend::kNative;
  StreamHandle stream = nullptr;
};

struct FindBlocksOptions : BlockSelectOptions {
  // Query rows and keys behind the block sums (they place the diagonal). Omitted:
  // q_blocks * block_size and k_blocks * block_size (Lk - Lq a whole number of blocks, which is
  // upstream's current_index = k_blocks - q_blocks). Given: ceil(q_len / block_size) must be
  // q_blocks, ceil(k_len / block_size) must be k_blocks, and q_len <= k_len when causal or
  // keep_recent.
  std::optional<int64_t> q_len;
  std::optional<int64_t> k_len;
};

// attn_sums: FP32 [B, H, q_blocks, k_blocks] (any strides). block_mask: bool, same shape.
void find_blocks_chunked(const TensorView& attn_sums, const TensorView& block_mask,
                         const FindBlocksOptions& options = {});

// ---------------------------------------------------------------------------------------
// Estimation
// score(g, j) = (1 / (sqrt(D) * stride * norm)) * sum_t q[g*stride + stride-1-t] . k[j*stride + t]
// (inverse-interleaved queries, forward-interleaved keys), softmax over the key groups visible
// to query group g, summed over the groups of each (query block, key block) pair.
// ---------------------------------------------------------------------------------------

struct XAttnEstimateOptions : BlockSelectOptions {
  int64_t stride = 8;          // antidiagonal stride; divides block_size
  double norm = 1.0;           // score divisor; positive
  int64_t chunk_size = 16384;  // query rows per processing chunk (a multiple of block_size);
                               // bounds native workspace, never changes a result
  std::string select_mode = "inverse";  // the only mode implemented
};

// [B, Hq, ceil(Lq / block_size), ceil(Lk / block_size)]: the shape of attn_sums and of
// block_mask, for query [B, Hq, Lq, D] and key [B, Hkv, Lk, D].
Shape xattn_estimate_shape(const TensorView& query, const TensorView& key,
                           const XAttnEstimateOptions& options = {});

// query [B, Hq, Lq, D], key [B, Hkv, Lk, D] (BF16, FP16 or FP32, one dtype); Lq <= Lk when
// causal or keep_recent.
// attn_sums: FP32 with the shape above, block_mask: bool with the shape above; both written
// in full (attn_sums is 0 for key blocks a query block cannot see).
void xattn_estimate(const TensorView& query, const TensorView& key, const TensorView& attn_sums,
                    const TensorView& block_mask, const XAttnEstimateOptions& options = {});

// ---------------------------------------------------------------------------------------
// Block-sparse attention (Block-Sparse-Attention's block_sparse_attn_func, forward only)
// out[r, h] = sum_k softmax_k(softmax_scale * q[r, h] . k[k, h / G]) v[k, h / G] over the keys
// the row may see: causal (bottom-right) if is_causal, and by head_mask_type[h]:
//   0  dense: every key block
//   1  block-sparse: key blocks j with base_blockmask[b, s, i, j], s = the number of heads
//      before h whose type is 1 (the mask holds only the block-sparse heads)
//  -1  streaming: key blocks j < sink or d - local < j <= d, (sink, local) =
//      (streaming_info[2h], streaming_info[2h + 1]), d = the key block of the query block's
//      last visible key (causal) or the last key block
// A row that sees no key gets zero output and LSE -inf.
// ---------------------------------------------------------------------------------------

struct BlockSparseAttentionOptions {
  std::vector<int32_t> head_mask_type;  // [Hq] of -1, 0, 1; empty: every head 1
  std::vector<int32_t> streaming_info;  // [2 * Hq] (sink, local) block counts per head;
                                        // required (non-negative) when a head is -1
  std::optional<double> softmax_scale;  // default 1 / sqrt(D)
  bool is_causal = true;   // XAttention's setting (block_sparse_attn_func defaults to false)
  double p_dropout = 0.0;  // inference only: must be 0
  Backend backend = Backend::kNative;
  StreamHandle stream = nullptr;
};

// Block size of base_blockmask (Block-Sparse-Attention hard-codes it).
inline constexpr int64_t kBlockSparseBlockSize = 128;

// [B, sparse_heads, ceil(max_seqlen_q / 128), ceil(max_seqlen_k / 128)]: base_blockmask.
Shape block_sparse_attention_mask_shape(int64_t batch, int64_t sparse_heads, int64_t max_seqlen_q,
                                        int64_t max_seqlen_k);

// "int" is int32 or int64, read as stored (native: int64 is narrowed into int32 scratch on the
// stream, docs/xattention.md).
// q [total_q, Hq, D], k and v [total_k, Hkv, D] (BF16, FP16 or FP32, one dtype); cu_seqlens_q
// and cu_seqlens_k int [B + 1] (sequence b owns rows [cu[b], cu[b+1])); base_blockmask bool
// with the shape above (required when a head is 1, else nullopt); max_seqlen_q / max_seqlen_k
// bound every sequence's length. out: q's shape and dtype. lse: optional FP32 [total_q, Hq]
// (natural log; a transposed [Hq, total_q] buffer works through its strides).
void block_sparse_attention(const TensorView& q, const TensorView& k, const TensorView& v,
                            const TensorView& cu_seqlens_q, const TensorView& cu_seqlens_k,
                            const std::optional<TensorView>& base_blockmask, int64_t max_seqlen_q,
                            int64_t max_seqlen_k, const TensorView& out,
                            const std::optional<TensorView>& lse,
                            const BlockSparseAttentionOptions& options = {});

// The same with a paged KV cache: k_cache and v_cache [num_pages, page_size, Hkv, D], any
// page_size >= 1 (native: a multiple of 8; engines use 784 .. 1616); block_table int
// [B, max_pages] (key t of sequence b lives in page block_table[b, t / page_size], slot
// t % page_size); seqlens_k int [B] keys per sequence (<= max_pages * page_size).
void block_sparse_attention_paged(const TensorView& q, const TensorView& k_cache,
                                  const TensorView& v_cache, const TensorView& block_table,
                                  const TensorView& seqlens_k, const TensorView& cu_seqlens_q,
                                  const std::optional<TensorView>& base_blockmask,
                                  int64_t max_seqlen_q, int64_t max_seqlen_k, const TensorView& out,
                                  const std::optional<TensorView>& lse,
                                  const BlockSparseAttentionOptions& options = {});

// ---------------------------------------------------------------------------------------
// XAttention prefill: xattn_estimate, then block_sparse_attention with every head block-sparse
// ---------------------------------------------------------------------------------------

struct XAttnPrefillOptions : XAttnEstimateOptions {
  std::optional<double> softmax_scale;  // attention scale, default 1 / sqrt(D)
};

// query [B, Hq, Lq, D], key and value [B, Hkv, Lk, D], block_size 128; Lq <= Lk when causal or
// keep_recent.
// attn_sums / block_mask: outputs as in xattn_estimate (they are also the op's workspace).
// out: the query's shape and dtype. lse: optional FP32 [B, Hq, Lq].
// Chunked prefill: for causal calls, a query chunk [c, c + m) of a prompt against keys
// [0, c + m) gives exactly the mask rows and output rows of the whole-prompt call when c is a
// multiple of 128 and c + m is a multiple of 128 or the prompt's end (docs/xattention.md).
void xattention_prefill(const TensorView& query, const TensorView& key, const TensorView& value,
                        const TensorView& attn_sums, const TensorView& block_mask,
                        const TensorView& out, const std::optional<TensorView>& lse,
                        const XAttnPrefillOptions& options = {});

// The same over a paged KV cache (a prefill chunk against the cache an engine keeps):
// k_cache and v_cache [num_pages, page_size, Hkv, D] (any page_size >= 1, any strides with the
// head dim contiguous: views of one [pages, page, Hkv, 2 D] tensor work), block_table int
// [B, max_pages]: key t of request b is k_cache[block_table[b, t / page_size], t % page_size].
// Every request has k_len keys (<= max_pages * page_size), its query rows the last Lq of them
// (bottom-right, as in xattention_prefill). The result is xattention_prefill's on the keys and
// values gathered from the pages; the gather goes to stream-ordered scratch of 2 B k_len Hkv D
// elements on the GPU (no host synchronisation: a fixed-shape call can be captured). Page ids
// must lie in [0, num_pages): the host backends raise ValueError otherwise, the native one reads
// zeros for them.
void xattention_prefill_paged(const TensorView& query, const TensorView& k_cache,
                              const TensorView& v_cache, const TensorView& block_table,
                              int64_t k_len, const TensorView& attn_sums,
                              const TensorView& block_mask, const TensorView& out,
                              const std::optional<TensorView>& lse,
                              const XAttnPrefillOptions& options = {});

}  // namespace sparse_attn
