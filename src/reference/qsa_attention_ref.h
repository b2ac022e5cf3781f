// The CPU reference of qsa_sparse_attention: the executable form of docs/qsa.md,
// "Sparse attention". Plain loops with FP32 accumulation, on host memory.
#pragma once

#include "api/qsa_attention_params.h"

namespace sparse_attn {

// Computes out (and lse when params.lse is set) for validated params whose pointers are host
// memory. Reads the request metadata first and raises ValueError, before writing anything, when
// a content the caller promises is broken (cu_seqlens not monotonic or not ending at the row
// count, a request id out of range, a length outside its capacity); it never reads out of
// bounds.
void reference_sparse_attention(const SparseAttentionParams& params);

}  // namespace sparse_attn
