// CPU implementation of the selection helpers; the executable form of docs/qsa.md
// ("## Selection helpers"). Host pointers only.
#pragma once

#include "api/qsa_indexer_params.h"
#include "api/qsa_select_params.h"

namespace sparse_attn::detail {

void reference_topk_blocks(const TopkBlocksParams& p);
void reference_expand_blocks(const ExpandBlocksParams& p);

// The fused selections on host memory, as their composition (docs/qsa.md, "Fused selection"):
// the rows are taken in chunks whose FP32 scores fit select.max_workspace_bytes (whole requests
// while one fits, else rows of one request); `score` writes a chunk's scores into a buffer of
// that size, then its rows get reference_topk_blocks, reference_expand_blocks at their
// positions (padding rows at position -1: all -1) and their counts. `score` is the score op's
// reference loop or the CPU backend's (cpu_mqa_score, cpu_mqa_decode), which give the same
// bits, so neither changes the result. The metadata contents are read and checked as the score
// op checks them (ValueError) before anything is written.
using ScoreFn = void (*)(const MqaScoreParams&);
using DecodeScoreFn = void (*)(const MqaDecodeParams&);
void host_indexer_select(const IndexerSelectParams& p, ScoreFn score);
void host_decode_select(const DecodeSelectParams& p, DecodeScoreFn score);

// The reference: host_*_select with the reference's score loops.
void reference_indexer_select(const IndexerSelectParams& p);
void reference_decode_select(const DecodeSelectParams& p);

}  // namespace sparse_attn::detail
