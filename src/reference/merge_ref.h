// The CPU reference of merge_attention_states: the executable form of docs/merge.md. Plain
// loops with double accumulation, on host memory.
#pragma once

#include "api/merge_params.h"

namespace sparse_attn::detail {

// Writes every element of out and, when params.lse_out is set, of lse_out.
void reference_merge_attention_states(const MergeParams& params);

}  // namespace sparse_attn::detail
