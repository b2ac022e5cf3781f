// The CPU reference of the QSA MQA indexer ops: the executable form of docs/qsa.md
// ("## Indexer scores"). Host pointers only (the API stages CUDA tensors through the host).
//
// The reference reads metadata contents, so it checks them and raises ValueError for contents
// the caller promised but broke (non-monotonic cu_seqlens_q, request ids out of range,
// seq_lens_q outside [0, q_len]) instead of reading out of bounds. Contents the spec masks
// (page ids -1 or out of range, negative positions, intervals outside [0, keys), context
// lengths beyond the table) are masked, not errors. Nothing is written when it raises.
#pragma once

#include "api/qsa_indexer_params.h"

namespace sparse_attn::detail {

void reference_mqa_score(const MqaScoreParams& p);
void reference_mqa_prefill(const MqaPrefillParams& p);
void reference_mqa_decode(const MqaDecodeParams& p);

}  // namespace sparse_attn::detail
