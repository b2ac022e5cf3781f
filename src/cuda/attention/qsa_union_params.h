// Configuration and kernel parameters of the union prefill kernel (qsa_union_problem.cuh),
// shared with the host code that decides whether it runs (sparse_attention_native.cpp).
#pragma once

#include <cstdint>

#include "api/qsa_attention_params.h"
#include "cuda/attention/sparse_attention_launch.h"

namespace sparse_attn::cuda {

struct QsaUnionConfig {
  static constexpr int kHeadDim = 256;
  static constexpr int kBlockN = 64;         // union tokens per K/V tile: 16 blocks
  static constexpr int kStages = 2;          // per K and V: 64 KB of Q + 128 KB of K/V tiles
  static constexpr int kMaxRows = 10;        // 2 x (64 / group), group 12 .. 16
  static constexpr int kMaxUnion = 768;      // union blocks of a CTA (3072 tokens, 48 tiles)
  static constexpr int kBitmapWords = 4096;  // visible blocks 131072: positions < 524288
  static constexpr int kThreads = 384;
  static constexpr int kMaxEntries = 512 + 1;  // block hint columns (the seed's limit) + tail
  static constexpr int kEntriesPerThread =
      (kMaxRows * kMaxEntries + kThreads - 1) / kThreads;  // 14
};

// Params of the kernel: the validated problem (ids narrowed to int32), and where a CTA records
// whether it wrote its rows.
struct QsaUnionParams {
  SparseAttentionParams p;
  SparseAttentionLaunch x;     // block_hint set; one split
  uint8_t* handled = nullptr;  // [num_kv_heads, row_tiles]: 1 where the CTA wrote its rows
  int row_tiles = 0;           // ceil(rows / rows_per_cta)
  int rows_per_wg = 0;         // 64 / group
};

}  // namespace sparse_attn::cuda
