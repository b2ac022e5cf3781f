// The CPU reference of XAttention: the executable form of docs/xattention.md. Plain loops,
// FP64 accumulation, host memory only (the API stages device tensors). Each function takes
// validated params; contents the API cannot check without reading them (cu_seqlens,
// lengths, page ids) are checked here first, raising ValueError before anything is written.
#pragma once

#include <vector>

#include "api/xattn_params.h"

namespace sparse_attn {

// Writes p.attn_sums (every element) from query and key.
void reference_xattn_estimate_sums(const XAttnEstimateParams& p);

// Writes p.block_mask (every element) from p.attn_sums.
void reference_find_blocks(const BlockSelectParams& p);

// Writes out (every element of every real query row) and, when wanted, lse.
void reference_block_sparse_attention(const BlockSparseAttnParams& p);

// One sequence of block-sparse attention: its first query row and key (varlen offsets; 0 when
// padded or paged) and its lengths.
struct XAttnSequence {
  int64_t q_start = 0, q_len = 0;
  int64_t k_start = 0, k_len = 0;
};

// Every sequence's extent from the metadata, checking what the caller promised (offsets
// non-decreasing and in range, lengths within the maxima, page ids of used page slots in range):
// ValueError naming the tensor otherwise. Shared with the CPU backend.
std::vector<XAttnSequence> read_block_sparse_sequences(const BlockSparseAttnParams& p);

// Element offsets of key t's K and V rows (KV head kvh, feature 0) of sequence b, t < k_len.
void block_sparse_kv_offsets(const BlockSparseAttnParams& p, const XAttnSequence& s, int64_t b,
                             int64_t kvh, int64_t t, int64_t* k_off, int64_t* v_off);

}  // namespace sparse_attn
