// Tile configuration and shared-memory layout of the sm90 sparse-attention kernels.
//
// One CTA owns one (query row, KV head, split): the group's query heads (Hq / Hkv <= 16) form
// the 16 rows of an MMA tile, padded with zero rows that are computed but never stored. The
// CTA gathers the row's selected tokens (one index list shared by every head of the group)
// 64 at a time into a multi-stage shared-memory ring, and each of its 4 token groups of warps
// runs its own online softmax over 16 of the 64 tokens; the groups merge once at the end.
// Two of the CTA's 8 warps share a token group: both compute its scores, each accumulates O
// over its half of D, which halves the P V work and the O registers per warp and puts two
// warps on every scheduler.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace sparse_attn::cuda {

struct SparseAttentionConfig {
  static constexpr int kHeadDim = 256;    // D; the only head size the kernels build
  static constexpr int kHeadRows = 16;    // MMA M: query heads of one group, padded
  static constexpr int kTokenGroups = 4;  // warps (or warp pairs) along a tile's tokens
  static constexpr int kWarpTokens = 16;  // tokens per group per tile: one MMA K step of P V
  static constexpr int kBlockTokens = kTokenGroups * kWarpTokens;  // 64 tokens per stage
  static constexpr int kQChunks = kHeadDim * 2 / 16;  // 16-byte chunks per 16-bit Q row
  static constexpr int kBlockPassEntries = 512 + 1;
  static constexpr int kMergePad = 8;    // floats of padding per merge row (banks)
  static constexpr int kMaxSplits = 64;  // heuristic's ceiling; explicit counts may exceed
};

// The forward kernel's CTA shape: 8 warps, a pair per token group splitting D.
struct FwdShape {
  using C = SparseAttentionConfig;
  static constexpr int kWarps = 8;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kDimSplit = kWarps / C::kTokenGroups;  // warps sharing a token group
  static constexpr int kWarpDims = C::kHeadDim / kDimSplit;   // O columns one warp accumulates
  // Index entries per thread per pass and the tokens one pass can hold (2304). A
  // token-path pass reads this many ids, so the canonical 2051-token selection takes one
  // pass; wider token-only selections take several, each ending with at most one partial
  // tile. A block-hint pass reads up to 512 blocks (the seed's limit) plus the tail entry: at
  // most 2051 tokens.
  static constexpr int kPerThread = 9;
  static constexpr int kPassTokens = kPerThread * kThreads;
  static_assert(C::kBlockPassEntries <= kPassTokens && 4 * C::kBlockPassEntries <= kPassTokens + 4,
                "a block-hint pass must fit the entry registers and the token list");
};

// The K/V ring for K/V elements of type KV: 16-bit rows are 32 chunks of 16 bytes, kept in 3
// stages (two tiles in flight); FP8 rows are 16 chunks, kept in 6 stages, the same 192 KB with
// five tiles in flight, since a decode CTA's gather is bounded by the bytes it keeps in flight.
template <typename KV>
struct KVRing {
  static constexpr int kChunks = SparseAttentionConfig::kHeadDim * int(sizeof(KV)) / 16;
  static constexpr int kStages = sizeof(KV) == 1 ? 6 : 3;
  static constexpr int kChunkDims = 16 / int(sizeof(KV));  // elements per 16-byte chunk
};

// Shared memory as named buffers. A gathered row's 16-byte chunk c sits at slot c ^ (r % 8)
// (swz), so the 8 rows an ldmatrix reads at one column hit 8 bank groups; the Q tile likewise.
template <typename KV>
struct SparseAttentionSmem {
  using C = SparseAttentionConfig;
  using S = FwdShape;
  using R = KVRing<KV>;
  struct Tiles {
    uint4 k[R::kStages][C::kBlockTokens][R::kChunks];
    uint4 v[R::kStages][C::kBlockTokens][R::kChunks];
  };
  // The token groups' softmax states at the end; reuses the tile ring, idle by then.
  struct Merge {
    float o[C::kTokenGroups][C::kHeadRows][C::kHeadDim + C::kMergePad];
    float m[C::kTokenGroups][C::kHeadRows];  // running max, log2 units
    float l[C::kTokenGroups][C::kHeadRows];  // sum of exp2(s - m)
    // Per head row: the groups' weights exp2(m_w - max), the max and the weighted sum of l.
    float weight[C::kTokenGroups][C::kHeadRows];
    float row_m[C::kHeadRows];
    float row_l[C::kHeadRows];
  };
  union {
    Tiles tiles;
    Merge merge;
  };
  uint4 q[C::kHeadRows][C::kQChunks];
  // Compacted valid tokens of the current index pass: (outer, token) coordinates into K/V,
  // i.e. (page, slot) for paged caches, (request, token) for padded ones, (0, row) physical.
  int2 token_loc[S::kPassTokens];
  // Valid tokens of one pass per (entry step j, warp), for the compaction's prefix sums.
  int warp_count[S::kPerThread * S::kWarps];
};

}  // namespace sparse_attn::cuda
