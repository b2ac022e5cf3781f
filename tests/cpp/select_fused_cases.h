// Inputs of the fused selections (qsa_indexer_select, qsa_mqa_decode_select) shared by the host
// suite (test_qsa_select_fused.cpp: against the composition of the score op, qsa_topk_blocks
// and qsa_expand_blocks) and the GPU suite (test_gpu_qsa_select_fused.cpp: native against the
// reference): every query form (padded with and without positions and seq_lens_q, cu_seqlens_q,
// token_to_req with -1 padding rows), logical and paged keys (missing and out-of-range pages),
// FP8 keys, decode with R = 1 and 3, per-row context lengths, padding rows.
#pragma once

#include <random>
#include <string>
#include <vector>

#include "sparse_attn/qsa.h"
#include "sparse_attn/tensor.h"

namespace sparse_attn::testing {

struct IndexerForm {
  std::string name;
  std::string q_form = "padded";  // padded, cu_seqlens, token_to_req
  int64_t page_size = 0;          // 0: logical keys
  bool positions = false;         // query_positions given (always with token_to_req)
  bool seq_lens_q = false;        // padded only
  bool fp8 = false;               // FP8 e4m3 keys
  DType dtype = DType::kBF16;
  int64_t heads = 4, dim = 128;                   // native CUDA: 4 x 128 only
  int64_t batch = 3, rows = 37, num_blocks = 90;  // rows: per request (varlen: batch * rows)
};

// Host tensors of one call; `options` holds views of them (backend left at its default).
struct IndexerInputs {
  Tensor q, keys, table, cu, t2r, pos, lens;
  IndexerScoreOptions options;
  Shape rows;                    // the score rows: [B, Q] or [total_q]
  std::vector<int64_t> row_pos;  // per flattened row: its position, -1 for a padding row
};

IndexerInputs make_indexer_inputs(const IndexerForm& f, std::mt19937_64& rng);
std::vector<IndexerForm> indexer_forms();

struct DecodeForm {
  std::string name;
  int64_t rows = 1;  // R; 1 with rank3_q: q [B, H, D], context_lens and positions [B]
  bool rank3_q = false;
  int64_t page_size = 16;
  bool fp8 = false;
  bool positions = true;  // query_positions given
  int64_t batch = 6, max_pages = 7, pool = 30, max_model_len = 300;
};

struct DecodeInputs {
  Tensor q, cache, table, lens, pos;  // pos: empty unless the form has positions
  int64_t max_model_len;
  // per flattened row b * R + r: the position the row expands at, -1 for a padding row
  // (context_lens <= 0 or a negative position); padding[i]: the row is one.
  std::vector<int64_t> row_pos;
  std::vector<bool> padding;
};

DecodeInputs make_decode_inputs(const DecodeForm& f, std::mt19937_64& rng);
std::vector<DecodeForm> decode_forms();

}  // namespace sparse_attn::testing
