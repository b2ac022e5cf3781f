// The CPU reference of qsa_sparse_attention: the executable form of docs/qsa.md,
// "Sparse attention". Plain loops with FP32 accumulation, on host memory.
#pragma once

#include <cstdint>
#include <vector>

#include "api/qsa_attention_params.h"

namespace sparse_attn {

// Computes out (and lse when params.lse is set) for validated params whose pointers are host
// memory. Reads the request metadata first and raises ValueError, before writing anything, when
// a content the caller promises is broken (cu_seqlens not monotonic or not ending at the row
// count, a request id out of range, a length outside its capacity); it never reads out of
// bounds.
void reference_sparse_attention(const SparseAttentionParams& params);

// The request metadata both host backends read (the reference and the CPU backend), with the
// reference's checks (ValueError naming the tensor, before anything is written).
struct QsaRequests {
  std::vector<int64_t> rows;       // query rows each request holds in the layout
  std::vector<int64_t> seq_len_q;  // seq_lens_q, or `rows`
  std::vector<int64_t> seq_len_k;  // seq_lens_k, or the capacity
  std::vector<int64_t> kv_start;   // kVarlen: first row of the request in K/V
};
QsaRequests read_qsa_requests(const SparseAttentionParams& params);

// What the metadata says about one query row.
struct QsaRow {
  bool active = false;  // false: padding row (request id -1, past seq_lens_q, position < 0)
  int64_t request = 0;
  int64_t position = 0;   // causal position p (logical mode)
  int64_t seq_len_k = 0;  // valid ids are < seq_len_k (logical mode)
};
std::vector<QsaRow> read_qsa_rows(const SparseAttentionParams& params, const QsaRequests& req);

// Element offsets of token `t`'s (K, V) row for `row` (head 0, feature 0), or false when the
// token is masked (out of range, past the row's position, on a missing page).
bool locate_qsa_token(const SparseAttentionParams& params, const QsaRequests& req,
                      const QsaRow& row, int64_t t, int64_t* k_off, int64_t* v_off);

}  // namespace sparse_attn
