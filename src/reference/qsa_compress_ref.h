// CPU implementation of qsa_compress_block_keys; the executable form of docs/qsa.md
// ("Compressed keys"). Host pointers only. The workload generator builds its compressed
// indexer keys with it too, which is why it reads fp32 keys as well as bf16/fp16.
#pragma once

#include "api/qsa_compress_params.h"

namespace sparse_attn::detail {

// Reads the promised metadata contents first (cu_seqlens from 0, non-decreasing, ending at the
// key rows; table rows covering position 4b of every complete block) and raises ValueError
// naming the argument before writing anything when one is broken.
void reference_compress_block_keys(const CompressBlockKeysParams& p);

}  // namespace sparse_attn::detail
