// The CPU reference of the QSA MQA indexer ops: the executable form of docs/qsa.md
// ("## Indexer scores"). Host pointers only (the API stages CUDA tensors through the host).
//
// The reference reads metadata contents, so it checks them and raises ValueError for contents
// the caller promised but broke (non-monotonic cu_seqlens_q, request ids out of range,
// seq_lens_q outside [0, q_len]) instead of reading out of bounds. Contents the spec masks
// (page ids -1 or out of range, negative positions, intervals outside [0, keys), context
// lengths beyond the table) are masked, not errors. Nothing is written when it raises.
#pragma once

#include <cstdint>
#include <vector>

#include "api/qsa_indexer_params.h"

namespace sparse_attn::detail {

void reference_mqa_score(const MqaScoreParams& p);
void reference_mqa_prefill(const MqaPrefillParams& p);
void reference_mqa_decode(const MqaDecodeParams& p);

// Where a query row of the score op lives and what it sees (shared with the CPU backend).
struct ScoreRow {
  int64_t req;    // request index
  int64_t pos;    // request-local position
  bool valid;     // false: a padding row (past seq_lens_q, request id -1 or position < 0): -inf
  int64_t q_off;  // element offset of q[row, 0, 0]
  int64_t out_off;
};

// Resolves every row's request and position, checking the metadata contents first (ValueError
// naming the tensor). With no block to score there is nothing to write (out is empty) and no
// row is built: the rows of an empty output are not bounded by any memory the caller has.
std::vector<ScoreRow> read_score_rows(const MqaScoreParams& p);

}  // namespace sparse_attn::detail
