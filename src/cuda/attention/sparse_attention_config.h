// Tile configuration and shared-memory layout of the sm90 sparse-attention kernels.
//
// One CTA owns one (query row, KV head, split): the group's query heads (Hq / Hkv <= 16) form
// the 16 rows of an MMA tile, padded with zero rows that are computed but never stored. The
// CTA gathers the row's selected tokens (one index list shared by every head of the group)
// 64 at a time into a multi-stage shared-memory ring with cp.async, and each of its 4 warps
// runs its own online softmax over 16 of the 64 tokens; the warps merge once at the end.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace sparse_attn::cuda {

struct SparseAttentionConfig {
  static constexpr int kHeadDim = 256;  // D; the only head size the kernels build
  static constexpr int kHeadRows = 16;  // MMA M: query heads of one group, padded
  static constexpr int kWarps = 4;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kWarpTokens = 16;  // tokens per warp per tile: one MMA K step of P V
  static constexpr int kBlockTokens = kWarps * kWarpTokens;  // 64 gathered tokens per stage
  static constexpr int kStages = 3;                  // cp.async ring depth (2 tiles in flight)
  static constexpr int kChunks = kHeadDim * 2 / 16;  // 16-byte chunks per 256-element row
  // Tokens one index pass can hold (17 per thread). A token-path pass reads this many ids, so
  // the canonical 2051-token selection takes one pass; wider token-only selections take
  // several, each ending with at most one partial tile. A block-hint pass reads up to 512
  // blocks (the seed's limit) plus the tail entry: at most 2051 tokens.
  static constexpr int kPassTokens = 17 * kThreads;
  static constexpr int kBlockPassEntries = 512 + 1;
  static constexpr int kMergePad = 8;    // floats of padding per merge row (banks)
  static constexpr int kMaxSplits = 64;  // heuristic's ceiling; explicit counts may exceed
};

// Shared memory as named buffers. Tiles hold 16-byte chunks, swizzled: chunk c of row r lives
// at slot c ^ (r % 8), so the 8 rows an ldmatrix reads at one column hit 8 different bank groups.
struct SparseAttentionSmem {
  using C = SparseAttentionConfig;
  struct Tiles {
    uint4 k[C::kStages][C::kBlockTokens][C::kChunks];
    uint4 v[C::kStages][C::kBlockTokens][C::kChunks];
  };
  // The per-warp softmax states at the end; reuses the tile ring, which is idle by then.
  struct Merge {
    float o[C::kWarps][C::kHeadRows][C::kHeadDim + C::kMergePad];
    float m[C::kWarps][C::kHeadRows];  // running max, log2 units
    float l[C::kWarps][C::kHeadRows];  // sum of exp2(s - m)
  };
  union {
    Tiles tiles;
    Merge merge;
  };
  uint4 q[C::kHeadRows][C::kChunks];
  // Compacted valid tokens of the current index pass: (outer, token) coordinates into K/V,
  // i.e. (page, slot) for paged caches, (request, token) for padded ones, (0, row) physical.
  int2 token_loc[C::kPassTokens];
  // Valid tokens of one pass per (entry step j, warp), for the compaction's prefix sums.
  int warp_count[C::kPassTokens / C::kThreads * C::kWarps];
};

}  // namespace sparse_attn::cuda
