// The resolved qsa_sparse_attention problem: what validation (src/api/qsa_attention.cpp)
// hands to a backend. Every backend (the CPU reference, the native CUDA kernels) takes this
// plain struct and trusts it: shapes, dtypes, devices and layouts are already checked, so a
// kernel only reads pointers, sizes and strides. Contents (ids, lengths, offsets) are not
// checked; docs/qsa.md says how each backend treats out-of-range values.
//
// Conventions
// - "rows" are query rows: B * q_len for padded queries [B, Q, Hq, D] (row r = b * q_len + i),
//   total_q for flattened queries [total_q, Hq, D]. Query, indices, gate, out and lse are
//   addressed per row through one row stride (validation guarantees the batch/query axes
//   collapse into a zero-copy row view).
// - Strides are int64, in elements of the tensor's own dtype. A stride of an axis of size 1
//   may be anything (it is never multiplied by a nonzero index).
// - Q, out and an element-wise or per-head gate share one dtype (`dtype`, BF16 or FP16). K and V
//   share `kv_dtype`: `dtype`, or FP8 e4m3, whose values are used times k_scale / v_scale.
//   Indices and metadata are int32 or int64, read through MetaPtr (api/meta_ptr.h). lse is
//   FP32.
// - A pointer is null exactly when its argument was not given; the comment says which
//   combinations exist.
#pragma once

#include <cstddef>
#include <cstdint>

#include "api/meta_ptr.h"
#include "sparse_attn/tensor.h"

namespace sparse_attn {

// Where the keys/values of request b, request-local token t live.
enum class KVLayout : uint8_t {
  kPadded,    // key [B, S_k, Hkv, D]: k[b, t]; capacity S_k per request
  kVarlen,    // key [total_k, Hkv, D]: k[cu_seqlens_k[b] + t]; capacity cu_seqlens_k[b+1] -
              // cu_seqlens_k[b] (reference only)
  kPaged,     // key [num_pages, page_size, Hkv, D]: k[block_table[b, t / page_size],
              // t % page_size]; capacity max_pages * page_size; page ids < 0 or >= num_pages
              // and t / page_size >= max_pages are masked
  kPhysical,  // key [total_kv, Hkv, D]: selected_kv_indices hold row ids into it directly (no
              // requests, no causal mask); ids < 0 or >= total_kv are masked
};

// Which request a query row belongs to, and its request-local row index i.
enum class RowMapping : uint8_t {
  kPadded,         // padded query: request r / q_len, i = r % q_len
  kCuSeqlens,      // flattened: request b owns rows [cu_seqlens_q[b], cu_seqlens_q[b+1]),
                   // i = r - cu_seqlens_q[b]
  kTokenToReq,     // flattened: request token_to_req[r]; i = number of earlier rows of the same
                   // request
  kSingleRequest,  // flattened, batch == 1, no mapping given: every row is request 0, i = r
  kNone,           // physical mode: rows belong to no request
};

// How the optional gate multiplies the attention output: out = attn * sigmoid(gate), with attn
// rounded to `dtype` first and the product rounded again (the unfused result).
enum class GateKind : uint8_t {
  kNone,
  kElementwise,  // gate shaped like the query: [rows, Hq, D]
  kPerHead,      // gate shaped like the query without its last axis: [rows, Hq]
};

struct SparseAttentionParams {
  // ----- sizes --------------------------------------------------------------------------
  int64_t rows = 0;          // query rows (see Conventions); 0 is a no-op
  int64_t batch = 0;         // requests B; 0 in physical mode
  int64_t q_len = 0;         // padded queries: Q (rows per request slot); flattened: 0
  int64_t num_q_heads = 0;   // Hq
  int64_t num_kv_heads = 0;  // Hkv; Hq % Hkv == 0
  int64_t group = 0;         // Hq / Hkv: query head h reads KV head h / group
  int64_t head_dim = 0;      // D, shared by Q, K, V and out
  int64_t width = 0;         // W: columns of token_indices or selected_kv_indices (may be 0)
  int64_t num_blocks = 0;    // nb: columns of block_indices (W == 4 * nb + 3); 0 without hint

  // ----- K/V layout ---------------------------------------------------------------------
  KVLayout kv_layout = KVLayout::kPadded;
  int64_t kv_capacity = 0;  // kPadded: S_k; kPaged: max_pages * page_size; otherwise 0
  int64_t total_kv = 0;     // kVarlen / kPhysical: key.shape[0]; otherwise 0
  int64_t page_size = 0;    // kPaged only
  int64_t num_pages = 0;    // kPaged only: key.shape[0]
  int64_t max_pages = 0;    // kPaged only: block_table.shape[1]

  DType dtype = DType::kBF16;     // Q, out and gate (BF16 or FP16)
  DType kv_dtype = DType::kBF16;  // K and V: `dtype`, or kF8E4M3
  // The value of a K (V) element is its stored value x k_scale (v_scale), in FP32; both are 1
  // unless kv_dtype is kF8E4M3.
  float k_scale = 1.f, v_scale = 1.f;

  // ----- tensors ------------------------------------------------------------------------
  // Query [rows, Hq, D].
  const void* q = nullptr;
  int64_t q_row_stride = 0, q_head_stride = 0, q_dim_stride = 0;

  // Key / value: rank-4 layouts [B or num_pages, S_k or page_size, Hkv, D] use all four
  // strides; rank-3 layouts [total, Hkv, D] have kv_batch_stride == 0. Same shape as each other,
  // strides independent.
  const void* k = nullptr;
  int64_t k_batch_stride = 0, k_token_stride = 0, k_head_stride = 0, k_dim_stride = 0;
  const void* v = nullptr;
  int64_t v_batch_stride = 0, v_token_stride = 0, v_head_stride = 0, v_dim_stride = 0;

  // Output [rows, Hq, D]; every element of it is written (zero for rows without a valid token).
  void* out = nullptr;
  int64_t out_row_stride = 0, out_head_stride = 0, out_dim_stride = 0;

  // FP32 [rows, Hq], natural-log LSE of scale * q.k over the row's valid tokens (-inf for a
  // row without any); null when the caller wants no LSE.
  float* lse = nullptr;
  int64_t lse_row_stride = 0, lse_head_stride = 0;

  // Gate [rows, Hq, D] (kElementwise) or [rows, Hq] (kPerHead); null for kNone.
  GateKind gate_kind = GateKind::kNone;
  const void* gate = nullptr;
  int64_t gate_row_stride = 0, gate_head_stride = 0, gate_dim_stride = 0;  // dim: kElementwise

  // int32 [rows, width]: request-local token ids (logical mode) or physical row ids into K/V
  // (kPhysical); -1 pads. Never null (W may be 0).
  MetaPtr token_indices;
  int64_t token_indices_row_stride = 0, token_indices_col_stride = 0;

  // int32 [rows, num_blocks]: the 4-token blocks behind token_indices, an optimisation hint
  // (the result must equal the token-only one); null when not given; never in kPhysical.
  MetaPtr block_indices;
  int64_t block_indices_row_stride = 0, block_indices_col_stride = 0;

  // ----- request metadata (all null in physical mode) -----------------------------------
  RowMapping row_mapping = RowMapping::kPadded;
  MetaPtr cu_seqlens_q;  // [batch + 1]; non-null iff kCuSeqlens
  int64_t cu_seqlens_q_stride = 0;
  MetaPtr token_to_req;  // [rows]; non-null iff kTokenToReq
  int64_t token_to_req_stride = 0;
  MetaPtr cu_seqlens_k;  // [batch + 1]; non-null iff kVarlen
  int64_t cu_seqlens_k_stride = 0;
  MetaPtr block_table;  // [batch, max_pages]; non-null iff kPaged
  int64_t block_table_batch_stride = 0, block_table_page_stride = 0;

  // [batch]: query rows per request; rows with i >= seq_lens_q[b] are padding (zero output,
  // LSE -inf). Null: every row of the layout is a real row.
  MetaPtr seq_lens_q;
  int64_t seq_lens_q_stride = 0;
  // [batch]: KV length per request (<= its capacity). Null: the capacity.
  MetaPtr seq_lens_k;
  int64_t seq_lens_k_stride = 0;
  // Request-local causal position of each row: [batch, q_len] for padded queries (element
  // (r / q_len, r % q_len)), [rows] for flattened ones (element r, batch stride 0). Null: the
  // right-aligned default p = seq_len_k - seq_len_q + i.
  MetaPtr query_positions;
  int64_t query_positions_batch_stride = 0, query_positions_row_stride = 0;

  // ----- scalars and flags --------------------------------------------------------------
  float scale = 0.f;                   // softmax scale, resolved (default 1/sqrt(D)); > 0
  float scale_log2 = 0.f;              // scale * log2(e), for exp2-based softmax
  int num_splits = 0;                  // 0: the backend's heuristic; >= 1: that many KV splits
  bool warp_specialized = false;       // native prefill variant (canonical 24/2/256 only)
  bool assume_compact_blocks = false;  // producer promise about block_indices, see docs/qsa.md

  int device_index = 0;    // CUDA ordinal of every tensor (native); 0 on the CPU
  void* stream = nullptr;  // cudaStream_t; nullptr is the legacy default stream
  // Native only: device scratch of at least native_sparse_attention_workspace_size(*this) bytes,
  // 16-byte aligned (the caller's options.workspace); null: the backend allocates it from the
  // library's stream-ordered pool.
  void* workspace = nullptr;
};

// The native (CUDA) implementation. A CPU-only build defines it to raise NotSupportedError
// (qsa_attention_native_cpu_only.cpp); the CUDA build defines it in src/cuda. It is called only
// with params that passed validation and the native-only checks, all tensors on one CUDA device.
void native_sparse_attention(const SparseAttentionParams& params);
// Bytes of scratch native_sparse_attention needs for these params (the same builds define it):
// computed from sizes, layouts and options alone (and the device's SM count), 0 when none.
size_t native_sparse_attention_workspace_size(const SparseAttentionParams& params);

}  // namespace sparse_attn
