// CPU implementation of the selection helpers; the executable form of docs/qsa.md
// ("## Selection helpers"). Host pointers only.
#pragma once

#include "api/qsa_select_params.h"

namespace sparse_attn::detail {

void reference_topk_blocks(const TopkBlocksParams& p);
void reference_expand_blocks(const ExpandBlocksParams& p);

}  // namespace sparse_attn::detail
