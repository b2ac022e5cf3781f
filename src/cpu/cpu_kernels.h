// The CPU backend: multithreaded (OpenMP) and vectorised (Highway, dispatched at run time to
// the best of AVX-512 / AVX2 / SSE4 the CPU has) forms of the ops, selected by backend 'native'
// on CPU tensors. Same params and results as the reference (docs/qsa.md, docs/xattention.md),
// FP32 accumulation; the reference stays the spec.
#pragma once

#include "api/merge_params.h"
#include "api/qsa_attention_params.h"
#include "api/qsa_indexer_params.h"
#include "api/xattn_params.h"

namespace sparse_attn {

// Writes out (every element of every real query row) and, when wanted, lse. Host memory;
// metadata contents are checked as the reference checks them, before anything is written.
void cpu_block_sparse_attention(const BlockSparseAttnParams& params);

// Writes out (every element) and, when wanted, lse, as reference_sparse_attention does, with
// the same checks of the metadata. Host memory. The block hint is not read (the result equals
// the token-only one by definition).
void cpu_sparse_attention(const SparseAttentionParams& params);

// The QSA indexer ops: every element of out, as reference_mqa_score / _prefill / _decode
// write it, with the same checks of the metadata. Host memory.
void cpu_mqa_score(const detail::MqaScoreParams& params);
void cpu_mqa_prefill(const detail::MqaPrefillParams& params);
void cpu_mqa_decode(const detail::MqaDecodeParams& params);

// Writes p.attn_sums (every element) from query and key, as reference_xattn_estimate_sums does
// (FP32 instead of FP64). The selection (block_mask) is the reference's reference_find_blocks
// on these sums: sorting a row of block sums is not where the time goes, and its masks must
// match the reference's bit for bit anyway.
void cpu_xattn_estimate_sums(const XAttnEstimateParams& params);

// Writes out (every element) and, when params.lse_out is set, lse_out, as
// reference_merge_attention_states does (FP32 instead of FP64). Host memory.
void cpu_merge_attention_states(const detail::MergeParams& params);

}  // namespace sparse_attn
