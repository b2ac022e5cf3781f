// Configuration and kernel parameters of the union prefill kernel (qsa_union_problem.cuh),
// shared with the host code that decides whether it runs (sparse_attention_native.cpp).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "api/qsa_attention_params.h"
#include "cuda/attention/sparse_attention_launch.h"

namespace sparse_attn::cuda {

struct QsaUnionConfig {
  static constexpr int kHeadDim = 256;
  static constexpr int kBlockN = 64;         // union tokens per K/V tile: 16 blocks
  static constexpr int kStages = 2;          // per K and V: 64 KB of Q + 128 KB of K/V tiles
  static constexpr int kMaxRows = 10;        // 2 x (64 / group), group 12 .. 16
  static constexpr int kMaxUnion = 1024;     // union blocks of a CTA (4096 tokens, 64 tiles)
  static constexpr int kBitmapWords = 4096;  // visible blocks 131072: positions < 524288
  static constexpr int kThreads = 384;
  static constexpr int kMaxEntries = 512 + 1;  // block hint columns (the seed's limit) + tail
  static constexpr int kChunkTiles = 2048;     // row tiles per build + attention launch pair
  static constexpr int kEntriesPerThread =
      (kMaxRows * kMaxEntries + kThreads - 1) / kThreads;  // 14
};

// The union of one tile of rows (2 x rows_per_wg consecutive rows), as the build kernel
// (qsa_union_build.cu) leaves it for the attention kernel, which keeps it in shared memory.
struct alignas(16) QsaUnionData {
  // Bit k of live[j][n]: row j attends union token 64 n + k (its block counted, the token not
  // after the row's position nor past the sequence); dup[j]'s bit n: a count of row j in tile n
  // exceeds 1 (the scores there take the log2(count) bias).
  uint64_t live[QsaUnionConfig::kMaxRows][QsaUnionConfig::kMaxUnion / 16];
  uint32_t dup[QsaUnionConfig::kMaxRows][(QsaUnionConfig::kMaxUnion / 16 + 31) / 32];
  int32_t blocks[QsaUnionConfig::kMaxUnion];  // the union, ascending
  int32_t outer[QsaUnionConfig::kMaxUnion];   // each block's K/V outer index: page, or request
  int32_t pos[QsaUnionConfig::kMaxRows];      // causal positions; -1 for a padding row
  int32_t request, seq_len_k, max_pos, n_union;
  int32_t ok;      // 0: the gather kernel's tile (two requests, too far, union too big, a count
                   // over 255)
  int32_t pad[1];  // to 16 bytes: the kernels copy it in 16-byte pieces
};
struct QsaUnionTile {
  QsaUnionData data;
  // Per (row, union block) the multiplicity (read where dup is set). A byte each keeps the
  // record within the attention CTA's shared memory; a row that lists one block more than 255
  // times leaves its tile to the gather kernel.
  uint8_t counts[QsaUnionConfig::kMaxRows][QsaUnionConfig::kMaxUnion];
};

// Params of both kernels: the validated problem (ids narrowed to int32), the chunk of row tiles
// a launch takes, and where the build records whether the attention kernel takes a tile.
struct QsaUnionParams {
  SparseAttentionParams p;
  SparseAttentionLaunch x;        // block_hint set; one split
  QsaUnionTile* tiles = nullptr;  // [chunk_tiles]: tile tile_begin + i at i
  uint8_t* handled = nullptr;     // [ceil(rows / rows_per_cta)]: 1 where the union kernel
                                  // writes the tile's rows
  int tile_begin = 0, chunk_tiles = 0;
  int rows_per_wg = 0;  // 64 / group
};

// The union build of row tiles tile_begin .. tile_begin + chunk_tiles - 1 into params.tiles and
// params.handled.
void launch_qsa_union_build(const QsaUnionParams& params, cudaStream_t stream);

}  // namespace sparse_attn::cuda
