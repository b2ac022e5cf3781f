// QSA (Qwen Sparse Attention): the MQA indexer and sparse core attention.
//
// The functions mirror the seed API (`mate.qsa_*`) with destination passing: the caller
// provides every output as a TensorView (the *_shape functions give the shapes) and the
// stream. Optional arguments live in an options struct whose fields carry the seed's
// keyword names. docs/qsa.md states each op's math and edge cases; the reference backend
// (src/reference/) is the executable form of that document.
//
// Validation happens once, here at the boundary, and reads only metadata. Contents the
// caller promises (monotonic cu_seqlens, request ids in range, lengths within capacity) are
// not read by validation; the reference backend, which reads them anyway, raises ValueError
// when they are broken, and native kernels clamp so that they never access out of bounds.
//
// "int" below is integer metadata: int32 or int64, read as stored (docs/qsa.md, "Metadata":
// dtypes, padding rows of graph-padded batches, and where positions come from).
//
// FP8 caches (docs/qsa.md, "FP8 caches"): K/V and the indexer's compressed keys may be FP8 e4m3
// (DType::kF8E4M3), or uint8 storage read as FP8 e4m3 when kv_cache_dtype names the format, as
// serving engines keep them. Values are decoded exactly and used in FP32.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string_view>

#include "sparse_attn/common.h"
#include "sparse_attn/tensor.h"

namespace sparse_attn {

// ---------------------------------------------------------------------------------------
// MQA indexer scores
// score[row, b] = scale * sum_h ReLU(q[row, h, :] . k[b, :]), FP32, -inf where invisible.
// ---------------------------------------------------------------------------------------

struct IndexerScoreOptions {
  // int [B, max_pages]. When given, block_keys is a paged cache [pages, page_size, 1, D]
  // (or [pages, page_size, D]) and N_B = max_pages * page_size.
  std::optional<TensorView> block_table;
  std::optional<int64_t> page_size;  // must equal block_keys.shape[1] when given
  // Varlen q_idx [total_q, H, D] only, exactly one of: int [B + 1] row offsets (B = the key
  // batch: block_keys.shape[0] or block_table.shape[0]), or int [total_q] request id per row
  // with num_requests in [0, B] (default B) bounding the ids.
  std::optional<TensorView> cu_seqlens_q;
  std::optional<TensorView> token_to_req;
  std::optional<int64_t> num_requests;
  // int [B, Q] (padded) or [total_q] (varlen): request-local position of each query row; a
  // negative one marks a padding row (all -inf). Omitted: the i-th row of a request is at
  // position i. Required with token_to_req (its rows are never counted).
  std::optional<TensorView> query_positions;
  // int [B]: valid query rows per request (padded only); rows past it are all -inf.
  std::optional<TensorView> seq_lens_q;
  int64_t block_size = 4;             // tokens per compressed key; QSA fixes it at 4
  std::optional<double> scale;        // multiplier, default 1/sqrt(D)
  std::optional<double> score_scale;  // denominator; exclusive with scale
  // How block_keys' bytes are read: nullopt as their dtype (q_idx's, or kF8E4M3); kF8E4M3 also
  // reads uint8 storage as FP8 e4m3; kBF16 / kF16 only confirm the dtype. No scale: engines
  // store these keys unscaled.
  std::optional<DType> kv_cache_dtype;
  Backend backend = Backend::kNative;
  StreamHandle stream = nullptr;
};

// [B, Q, N_B] for padded q_idx [B, Q, H, D]; [total_q, N_B] for varlen q_idx [total_q, H, D].
Shape qsa_indexer_mqa_score_shape(const TensorView& q_idx, const TensorView& block_keys,
                                  const IndexerScoreOptions& options = {});
// out: FP32 with the shape above, positive strides, not overlapping any input. Block b is
// visible to a row at position p iff 4b + 3 <= p (and, paged, its page id is in
// [0, block_keys.shape[0])); invisible blocks and rows past seq_lens_q are -inf.
// Native: CUDA tensors, H == 4, D == 128, q_idx/block_keys in the vector-load layout; keys of
// q_idx's dtype or FP8 e4m3.
void qsa_indexer_mqa_score(const TensorView& q_idx, const TensorView& block_keys,
                           const TensorView& out, const IndexerScoreOptions& options = {});

struct MqaScoreOptions {
  std::optional<double> score_scale;  // denominator; exclusive with scale
  std::optional<double> scale;        // multiplier, default 1/sqrt(D)
  // How k / k_cache bytes are read, as IndexerScoreOptions::kv_cache_dtype.
  std::optional<DType> kv_cache_dtype;
  Backend backend = Backend::kNative;
  StreamHandle stream = nullptr;
};

// k / k_cache below are q's dtype or FP8 e4m3 (see kv_cache_dtype), on every backend.
//
// Packed prefill: q [rows, H, D], k [keys, D] or [keys, 1, D], row_starts/row_ends int32
// [rows] (visible keys [start, end), clamped to [0, keys); start >= end is an empty row).
// out: FP32 [rows, keys], -inf outside the interval.
// Native: CUDA tensors, H == 4, D == 128, q/k in the vector-load layout.
Shape qsa_mqa_prefill_shape(const TensorView& q, const TensorView& k,
                            const MqaScoreOptions& options = {});
void qsa_mqa_prefill(const TensorView& q, const TensorView& k, const TensorView& row_starts,
                     const TensorView& row_ends, const TensorView& out,
                     const MqaScoreOptions& options = {});
// The seed exports the same op under this name too.
inline void qsa_mqa(const TensorView& q, const TensorView& k, const TensorView& row_starts,
                    const TensorView& row_ends, const TensorView& out,
                    const MqaScoreOptions& options = {}) {
  qsa_mqa_prefill(q, k, row_starts, row_ends, out, options);
}

// Paged decode, R >= 1 query rows per request (multi-token decode): q [B, H, D] (R = 1) or
// [B, R, H, D] (broadcast strides allowed), k_cache [pages, page_size, 1, D] or
// [pages, page_size, D] (any page size), page_table int [B, max_pages], context_lens int
// [B, R]: the compressed keys each query row sees ([B] only when R = 1; with R > 1 it is a
// ValueError, since the rows of a request see different keys). out: FP32
// [B * R, max_model_len] (qsa_mqa_decode_shape), request b's row r at row b * R + r, every
// column written: -inf where c >= context_lens[b, r], c / page_size >= max_pages, or the page
// id is -1 / out of range; a count <= 0 is a padding row, all -inf.
// Native: CUDA tensors, H == 4, D == 128, R <= 4 (NotSupportedError naming q otherwise).
Shape qsa_mqa_decode_shape(const TensorView& q, int64_t max_model_len);
void qsa_mqa_decode(const TensorView& q, const TensorView& k_cache, const TensorView& page_table,
                    const TensorView& context_lens, int64_t max_model_len, const TensorView& out,
                    const MqaScoreOptions& options = {});

// ---------------------------------------------------------------------------------------
// Sparse core attention
// out[row, h] = softmax_j(scale * q[row, h] . K[j, h / G]) V[j, h / G] over the row's valid
// selected tokens j (G = Hq / Hkv), optionally times sigmoid(gate).
// ---------------------------------------------------------------------------------------

struct SparseAttentionOptions {
  // int [rows, nb]: the 4-token blocks behind token_indices (an optimisation hint).
  // Requires token_indices.shape[-1] == 4 * nb + 3 and 1 <= nb <= 512.
  std::optional<TensorView> block_indices;
  // Request layout of flattened queries [total_q, Hq, D]: int [B + 1] row offsets, or int
  // [total_q] request id per row, -1 for a padding row (with num_requests, default: B of the
  // K/V layout; needs query_positions and takes no seq_lens_q).
  std::optional<TensorView> cu_seqlens_q;
  std::optional<TensorView> token_to_req;
  std::optional<int64_t> num_requests;
  // int [B + 1]: flattened-varlen K/V [total_k, Hkv, D] row offsets (reference only).
  std::optional<TensorView> cu_seqlens_k;
  // int [B]: query rows per request (padded queries: rows past it give zero output, LSE
  // -inf) and KV length per request (default: the capacity of the K/V layout).
  std::optional<TensorView> seq_lens_q;
  std::optional<TensorView> seq_lens_k;
  // int [B, Q] or [total_q]: request-local causal position of each query row; negative: a
  // padding row (zero output, LSE -inf). Omitted (not with token_to_req): right-aligned,
  // p_i = seq_len_k - seq_len_q + i.
  std::optional<TensorView> query_positions;
  // int [B, max_pages]: makes key/value paged caches [pages, page_size, Hkv, D].
  std::optional<TensorView> block_table;
  std::optional<int64_t> page_size;     // must equal key.shape[1] when given
  std::optional<double> scale;          // default 1/sqrt(D)
  std::optional<double> softmax_scale;  // alias of scale; both given is an error
  // Same dtype as query; shaped like the query ([.., Hq, D]) or per head ([.., Hq]).
  std::optional<TensorView> gate;
  std::optional<int64_t> num_splits;  // nullopt: heuristic; 1 disables SplitKV; must be >= 1
  Backend backend = Backend::kNative;
  bool warp_specialized = false;       // opt-in prefill variant; canonical 24/2/256 only
  bool assume_compact_blocks = false;  // producer contract, see docs/qsa.md
  // int [rows, W]: physical token ids into flattened K/V [total_kv, Hkv, D] (BF16 or FP8), used
  // instead of token_indices; no causal filtering, duplicates kept, ids < 0 or >= total_kv
  // masked. Excludes every logical metadata argument and the gate.
  std::optional<TensorView> selected_kv_indices;
  // How key/value bytes are read: nullopt as their dtype (the query's, or kF8E4M3); kF8E4M3
  // also reads uint8 storage as FP8 e4m3 (vLLM's kv_cache_dtype "fp8" / "fp8_e4m3"); kBF16 /
  // kF16 only confirm the dtype.
  std::optional<DType> kv_cache_dtype;
  // Per-tensor dequantisation scales of FP8 K/V: the value used is stored value x scale, in
  // FP32; positive finite float32 values. 16-bit K/V need 1.
  double k_scale = 1.0;
  double v_scale = 1.0;
  DType compute_dtype = DType::kBF16;  // BF16 (or the query's dtype); FP8 is not enabled
  StreamHandle stream = nullptr;
  // uint8 [n] scratch for the call, n >= qsa_sparse_attention_workspace_size(...): contiguous,
  // 16-byte aligned, on the query's device, overlapping no input or output. The call may
  // overwrite all of it (stream-ordered on `stream`); its contents need no initialisation and
  // mean nothing afterwards. Omitted (with no workspace_allocator): the native backend takes
  // its scratch from a library-owned stream-ordered pool (the convenience path); pass it to own
  // every allocation, e.g. from a framework's caching allocator or a CUDA graph's memory.
  std::optional<TensorView> workspace;
  // The other way to own the scratch, for callers with an allocator (a framework's caching
  // allocator): called once, with the byte count, only when the call needs scratch, after
  // validation; returns a buffer under workspace's rules (checked the same way, errors name
  // `workspace`) that stays valid until the work queued on `stream` has run. It saves the
  // separate qsa_sparse_attention_workspace_size call and its second validation pass. Not
  // together with `workspace`.
  std::function<TensorView(size_t bytes)> workspace_allocator;
};

// The output has the query's shape and dtype; the LSE has query.shape[:-1], FP32.
Shape qsa_sparse_attention_out_shape(const TensorView& query);
Shape qsa_sparse_attention_lse_shape(const TensorView& query);

// Bytes of scratch (options.workspace) that qsa_sparse_attention needs for these arguments;
// 0 when it needs none: the reference backend, tensors that are not on a CUDA device, zero query
// rows, a single KV split, and builds without CUDA. It takes the
// call's inputs and options (the workspace options are ignored; outputs do not matter) and raises
// what the call raises for them. Decided on the host from shapes, options and the device's
// multiprocessor count, reading no tensor contents: calls with the same shapes and options on
// the same device need the same size, so one buffer serves every step of a decode loop or a
// captured CUDA graph.
size_t qsa_sparse_attention_workspace_size(const TensorView& query, const TensorView& key,
                                           const TensorView& value,
                                           const std::optional<TensorView>& token_indices,
                                           const SparseAttentionOptions& options = {});

// key/value: the query's dtype, or both FP8 e4m3 with k_scale / v_scale (every backend).
// token_indices: int [B, Q, W] (padded query) or [total_q, W],
// request-local ids, -1 pads;
// nullopt only with options.selected_kv_indices. out: the query's shape and dtype, any
// non-overlapping positive-stride view. lse: optional FP32 query.shape[:-1]; written when
// given (natural log; -inf for rows with no valid token).
void qsa_sparse_attention(const TensorView& query, const TensorView& key, const TensorView& value,
                          const std::optional<TensorView>& token_indices, const TensorView& out,
                          const std::optional<TensorView>& lse,
                          const SparseAttentionOptions& options = {});

}  // namespace sparse_attn
