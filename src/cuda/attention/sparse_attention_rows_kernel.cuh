// sm90 sparse attention, row-tile kernel for prefill: one CTA attends kRows consecutive query
// rows for one KV head, and gathers each K/V tile once for all of them. It runs where the
// gather kernel does not fit (more than 2112 token ids a row, groups outside 12..16, unaligned
// Q), which wins wherever it does (sparse_attention_native.cpp, use_row_tiles).
//
// Why: neighbouring prefill rows select almost the same tokens (the structured workload's
// consecutive-row Jaccard is 0.999), so the per-row kernel (sparse_attention_kernel.cuh) pulls
// the same K/V rows through L2 once per row and spends its issue slots on gather addresses and
// on 16-token MMA steps. Here the gather, the index compaction and the ldmatrix of each K/V
// tile serve four rows, and each warp runs full 64-token MMA steps.
//
// Warps: two per row, each taking 32 of a tile's 64 tokens with its own online softmax (8 warps,
// two per scheduler, so one warp's MMA or ldmatrix latency has another to hide behind); the
// pair merges once at the end.
//
// Per CTA = (row tile, KV head), for each pass over a window of index entries:
//   1. every row's valid entries of the window (the per-row kernel's validity rules) become
//      (row, slot) positions with a physical K/V key; a shared-memory hash table of the keys
//      records each key's first position (atomicMin, so it does not depend on timing);
//   2. the union of the keys, ordered by first position, is compacted into `loc` (row 0's
//      tokens in its index order, then what later rows add), and each row's multiplicity of
//      each union token is counted (integer atomics: exact and order-free). Duplicates in a
//      row count as often as they occur, as in the reference;
//   3. the multiplicities become a per-(row, token) score bias log2(count) (-inf for a token
//      the row did not select), and the union is gathered 64 tokens per stage with cp.async;
//      row j's warps run S = Q_j K^T + bias_j, the online softmax and O_j += P V over their
//      halves of the tile, and skip halves that hold none of the row's tokens (so unrelated
//      rows cost no MMAs).
//
// S is computed by wgmma m64n32k16 per warpgroup with Q and K read straight from shared memory
// (warpgroup h computes all 4 rows' 16-head score tiles over its 32 tokens: warp w's
// accumulator fragment is exactly row w's, the mma.sync C layout the softmax and P V use).
// Every reduction has a fixed order, so reruns are bitwise equal; the union order, not the
// caller's index order, fixes the summation order, which the docs allow (FP32 sums).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <climits>
#include <cstdint>
#include <cute/arch/copy_sm75.hpp>
#include <cute/arch/copy_sm80.hpp>
#include <cute/arch/mma_sm90_gmma.hpp>

#include "api/qsa_attention_params.h"
#include "cuda/attention/sparse_attention_common.cuh"
#include "cuda/attention/sparse_attention_launch.h"
#include "cuda/common/check.h"
#include "cuda/common/kernel_attributes.h"
#include "cuda/common/mma.cuh"

namespace sparse_attn::cuda {

struct RowTileConfig {
  static constexpr int kHeadDim = 256;
  static constexpr int kHeadRows = 16;  // MMA M of one warp: the group's query heads, padded
  static constexpr int kRows = 4;       // query rows per CTA
  static constexpr int kWarpsPerRow = 2;
  static constexpr int kWarps = kRows * kWarpsPerRow;  // warp w: row w % kRows, half w / kRows
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kTileTokens = 64;  // gathered tokens per stage
  static constexpr int kWarpTokens = kTileTokens / kWarpsPerRow;
  static constexpr int kStages = 2;  // 128 KB: one tile in flight while one is consumed
  static constexpr int kChunks = kHeadDim * 2 / 16;  // 16-byte chunks per 256-element row
  // (row, slot) positions of one pass: 9 per thread. A pass takes up to kRowSlots = 576 token
  // slots of every row (entries, or 4 slots per entry with the block hint), so the canonical
  // 2051-token selection takes 4 passes of about 513 slots.
  static constexpr int kPerThread = 9;
  static constexpr int kPositions = kPerThread * kThreads;
  static constexpr int kRowSlots = kPositions / kRows;
  static constexpr int kHashBits = 12;  // 4096 slots: load factor <= 0.57
  static constexpr int kHashSlots = 1 << kHashBits;
};

struct RowTileSmem {
  using C = RowTileConfig;
  struct Tiles {
    uint4 k[C::kStages][C::kTileTokens * C::kChunks];  // SmemLayout::k order
    uint4 v[C::kStages][C::kTileTokens][C::kChunks];
  };
  // Union construction scratch; lives in the tile ring, which is idle between passes.
  struct Union {
    int32_t key[C::kHashSlots];      // physical K/V key, -1 for an empty slot
    int32_t first[C::kHashSlots];    // smallest position holding the key
    int32_t dense[C::kHashSlots];    // the key's index in the union
    int16_t slot_of[C::kPositions];  // hash slot of each position, -1 for an invalid one
    int32_t id_of[C::kPositions];    // each position's index entry (-1 outside the pass)
    int32_t page_of[C::kPositions];  // and the page-table entry behind it (paged K/V)
  };
  // The second half-warps' softmax states at the end, [element][lane] so that the pair's
  // lanes (same fragment layout) meet without bank conflicts; also in the idle ring.
  struct Merge {
    float o[C::kRows][C::kHeadDim / 8 * 4][32];
    float m[C::kRows][2][32];
    float l[C::kRows][2][32];
  };
  union {
    Tiles tiles;
    Union u;
    Merge merge;
  };
  alignas(1024) uint4 q[C::kRows * C::kHeadRows * C::kChunks];  // SmemLayout::q order
  // Per (row, union token): first the multiplicity (int), then log2(multiplicity) or -inf.
  float bias[C::kRows][C::kPositions];
  int2 loc[C::kPositions];  // K/V coordinates of each union token (token_coords' form)
  int warp_count[C::kPerThread][C::kWarps];
  // Whether warp w's row has tokens in its half of the tile, by tile parity.
  int half_live[2][C::kWarps];
  RowInfo rows[C::kRows];
};

__device__ inline int hash_slot(int32_t key) {
  return static_cast<int>((static_cast<uint32_t>(key) * 0x9E3779B1u) >>
                          (32 - RowTileConfig::kHashBits));
}

// Where 16-byte chunk c (of 32) of Q row m = j * 16 + head, or of K token row t, lives. wgmma
// reads them through shared-memory descriptors in the 128-byte-swizzle K-major layout: 4 column
// blocks of 64 features, each 64 rows x 128 bytes, chunk (c % 8) ^ (row % 8) within a row (the
// hardware applies the same XOR on address bits [4, 7) from bits [7, 10), so every block must
// start on a 1024-byte boundary).
struct SmemLayout {
  using C = RowTileConfig;
  static_assert(C::kRows * C::kHeadRows == C::kTileTokens,
                "Q (4 rows x 16 heads) and a K tile (64 tokens) share one 64-row block shape");
  __device__ static int index(int row, int c) {
    return (c / 8) * (C::kTileTokens * 8) + row * 8 + ((c % 8) ^ (row & 7));
  }
};

// A K-major, 128-byte-swizzle wgmma descriptor for the 8-row groups starting at `smem`
// (1024 bytes apart, SBO); the leading offset is unused by swizzled layouts.
__device__ inline uint64_t gmma_desc(const void* smem) {
  const uint64_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  return ((addr >> 4) & 0x3FFF) | (uint64_t{1} << 16) | (uint64_t{1024 >> 4} << 32) |
         (uint64_t{1} << 62);
}

template <typename T>
struct Sm90ScoreMma;
template <>
struct Sm90ScoreMma<__nv_bfloat16> {
  using Atom = cute::SM90::GMMA::MMA_64x32x16_F32BF16BF16_SS<cute::SM90::GMMA::Major::K,
                                                             cute::SM90::GMMA::Major::K>;
};
template <>
struct Sm90ScoreMma<__half> {
  using Atom = cute::SM90::GMMA::MMA_64x32x16_F32F16F16_SS<cute::SM90::GMMA::Major::K,
                                                           cute::SM90::GMMA::Major::K>;
};

template <typename T>
__global__ void __launch_bounds__(RowTileConfig::kThreads, 1)
    sparse_attention_rows_kernel(const __grid_constant__ SparseAttentionParams p,
                                 const __grid_constant__ SparseAttentionLaunch x) {
  using C = RowTileConfig;
  using E = ElementTraits<T>;
  using Mma = typename Sm80Mma<T>::Atom;
  using L = SmemLayout;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  auto& sm = *reinterpret_cast<RowTileSmem*>(smem_raw);

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int row_j = warp % C::kRows, half = warp / C::kRows;
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * C::kRows;
  const int kvh = blockIdx.y;
  const int group = static_cast<int>(p.group);
  // ----- Q tiles of the kRows rows: the group's heads, zero rows past the group or the end --
  for (int c = tid; c < C::kRows * C::kHeadRows * C::kChunks; c += C::kThreads) {
    const int j = c / (C::kHeadRows * C::kChunks);
    const int hr = c / C::kChunks % C::kHeadRows, chunk = c % C::kChunks;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (hr < group && r0 + j < p.rows) {
      const T* src = static_cast<const T*>(p.q) + (r0 + j) * p.q_row_stride +
                     (static_cast<int64_t>(kvh) * group + hr) * p.q_head_stride +
                     chunk * 8 * p.q_dim_stride;
      if (p.q_dim_stride == 1 && reinterpret_cast<uintptr_t>(src) % 16 == 0) {
        v = *reinterpret_cast<const uint4*>(src);
      } else {
        T e[8];
        for (int i = 0; i < 8; ++i) e[i] = src[i * p.q_dim_stride];
        v = *reinterpret_cast<uint4*>(e);
      }
    }
    sm.q[L::index(j * C::kHeadRows + hr, chunk)] = v;
  }
  // resolve_row is collective (find_request counts over the CTA).
  for (int j = 0; j < C::kRows; ++j) {
    RowInfo ri;
    if (r0 + j < p.rows) {
      ri = resolve_row(p, x, r0 + j);
    } else {
      ri.active = false;
    }
    if (tid == 0) sm.rows[j] = ri;
  }
  __syncthreads();

  // Index entries (token ids, or blocks plus the tail entry) in passes of at most kRowSlots
  // token slots per row, balanced so the last pass is not a sliver.
  const int per_entry = x.block_hint ? 4 : 1;
  const int64_t n_entries = x.block_hint ? p.num_blocks + 1 : p.width;
  const int64_t max_pass_entries = C::kRowSlots / per_entry;
  const int64_t n_passes = (n_entries + max_pass_entries - 1) / max_pass_entries;
  const int64_t pass_entries = n_passes > 0 ? (n_entries + n_passes - 1) / n_passes : 0;

  float o_acc[C::kHeadDim / 8][4];
#pragma unroll
  for (int i = 0; i < C::kHeadDim / 8; ++i)
    o_acc[i][0] = o_acc[i][1] = o_acc[i][2] = o_acc[i][3] = 0.f;
  float row_max[2] = {-INFINITY, -INFINITY};
  float row_sum[2] = {0.f, 0.f};

  const T* k_head = static_cast<const T*>(p.k) + kvh * p.k_head_stride;
  const T* v_head = static_cast<const T*>(p.v) + kvh * p.v_head_stride;
  float* const bias_all = &sm.bias[0][0];               // [kRows][kPositions], flat
  int* const count = reinterpret_cast<int*>(bias_all);  // the same storage, counts first

  for (int64_t e0 = 0; e0 < n_entries; e0 += pass_entries) {
    const int64_t e1 = min(n_entries, e0 + pass_entries);
    // ----- 1. positions -> keys, first position of every key ------------------------------
    for (int i = tid; i < C::kHashSlots; i += C::kThreads) {
      sm.u.key[i] = -1;
      sm.u.first[i] = INT_MAX;
    }
    __syncthreads();
    // The loads of all 17 positions go out together: ids first, then the page-table entries
    // behind them (two dependent memory latencies per pass instead of two per position); each
    // batch lands in shared memory, since o_acc leaves no registers to hold them.
    // Position pos is (row j, slot s): entry e0 + s / per_entry, token k = s % per_entry of it.
    constexpr int kLoadBatch = 5;  // loads in flight per thread; more spill o_acc
    auto position = [&](int i, int& j, int64_t& e, int& k) {
      const int pos = i * C::kThreads + tid;
      j = pos / C::kRowSlots;
      const int s = pos % C::kRowSlots;
      e = e0 + s / per_entry;
      k = s % per_entry;
    };
#pragma unroll 1
    for (int i0 = 0; i0 < C::kPerThread; i0 += kLoadBatch) {
      int32_t batch[kLoadBatch];
#pragma unroll
      for (int b = 0; b < kLoadBatch; ++b) {
        int j, k;
        int64_t e;
        position(i0 + b, j, e, k);
        const int64_t r = r0 + j;
        batch[b] = -1;
        if (i0 + b < C::kPerThread && sm.rows[j].active && e < e1) {
          if (!x.block_hint) {
            batch[b] =
                p.token_indices
                    .narrowed()[r * p.token_indices_row_stride + e * p.token_indices_col_stride];
          } else if (e < p.num_blocks) {
            batch[b] =
                p.block_indices
                    .narrowed()[r * p.block_indices_row_stride + e * p.block_indices_col_stride];
          }
        }
      }
#pragma unroll
      for (int b = 0; b < kLoadBatch; ++b) {
        if (i0 + b < C::kPerThread) sm.u.id_of[(i0 + b) * C::kThreads + tid] = batch[b];
      }
    }
#pragma unroll 1
    for (int i0 = 0; i0 < C::kPerThread; i0 += kLoadBatch) {
      int32_t batch[kLoadBatch];
#pragma unroll
      for (int b = 0; b < kLoadBatch; ++b) {
        int j, k, n;
        int64_t e;
        position(min(i0 + b, C::kPerThread - 1), j, e, k);
        const int32_t id = sm.u.id_of[min(i0 + b, C::kPerThread - 1) * C::kThreads + tid];
        batch[b] = entry_page(p, sm.rows[j], entry_tokens(p, x, sm.rows[j], e, id, &n));
      }
#pragma unroll
      for (int b = 0; b < kLoadBatch; ++b) {
        if (i0 + b < C::kPerThread) sm.u.page_of[(i0 + b) * C::kThreads + tid] = batch[b];
      }
    }
#pragma unroll 1
    for (int i = 0; i < C::kPerThread; ++i) {
      int j, k, n;
      int64_t e;
      position(i, j, e, k);
      const int pos = i * C::kThreads + tid;
      const RowInfo& ri = sm.rows[j];
      const int64_t t = entry_tokens(p, x, ri, e, sm.u.id_of[pos], &n) + k;
      const int32_t page = sm.u.page_of[pos];
      int slot = -1;
      if (ri.active && e < e1 && k < n && token_valid(p, ri, t, page)) {
        const int32_t key = physical_key(p, ri, t, page);
        slot = hash_slot(key);
        for (;;) {
          const int32_t prev = atomicCAS(&sm.u.key[slot], -1, key);
          if (prev == -1 || prev == key) break;
          slot = (slot + 1) & (C::kHashSlots - 1);
        }
        atomicMin(&sm.u.first[slot], pos);
      }
      sm.u.slot_of[pos] = static_cast<int16_t>(slot);
    }
    __syncthreads();

    // ----- 2. the union in first-position order, then multiplicities ----------------------
#pragma unroll 1
    for (int i = 0; i < C::kPerThread; ++i) {
      const int pos = i * C::kThreads + tid;
      const int slot = sm.u.slot_of[pos];
      const bool rep = slot >= 0 && sm.u.first[slot] == pos;
      const unsigned ballot = __ballot_sync(0xffffffffu, rep);
      if (lane == 0) sm.warp_count[i][warp] = __popc(ballot);
    }
    __syncthreads();
    int n_union = 0;
#pragma unroll 1
    for (int i = 0; i < C::kPerThread; ++i) {
      int before = n_union;
      for (int w = 0; w < C::kWarps; ++w) {
        const int cnt = sm.warp_count[i][w];
        if (w < warp) before += cnt;
        n_union += cnt;
      }
      const int pos = i * C::kThreads + tid;
      const int slot = sm.u.slot_of[pos];
      const bool rep = slot >= 0 && sm.u.first[slot] == pos;
      const unsigned ballot = __ballot_sync(0xffffffffu, rep);
      if (rep) {
        const int d = before + __popc(ballot & ((1u << lane) - 1u));
        sm.u.dense[slot] = d;
        sm.loc[d] = key_coords(p, sm.u.key[slot]);
      }
    }
    const int n_tiles = (n_union + C::kTileTokens - 1) / C::kTileTokens;
    const int n_padded = n_tiles * C::kTileTokens;
    for (int i = tid; i < C::kRows * n_padded; i += C::kThreads) {
      count[i / n_padded * C::kPositions + i % n_padded] = 0;
    }
    __syncthreads();
#pragma unroll 1
    for (int i = 0; i < C::kPerThread; ++i) {
      const int pos = i * C::kThreads + tid;
      const int slot = sm.u.slot_of[pos];
      if (slot >= 0) atomicAdd(&count[pos / C::kRowSlots * C::kPositions + sm.u.dense[slot]], 1);
    }
    __syncthreads();
    for (int i = tid; i < C::kRows * n_padded; i += C::kThreads) {
      const int at = i / n_padded * C::kPositions + i % n_padded;
      const int c = count[at];
      bias_all[at] = c > 0 ? log2f(static_cast<float>(c)) : -INFINITY;
    }
    __syncthreads();  // the scratch in the ring is dead from here on

    // ----- 3. gather the union through the cp.async ring and attend -----------------------
    auto load_tile = [&](int tile, int stage) {
#pragma unroll
      for (int i = 0; i < C::kTileTokens / C::kWarps; ++i) {
        const int row = i * C::kWarps + warp;
        const int n = tile * C::kTileTokens + row;
        const bool valid = n < n_union;
        const int2 loc = valid ? sm.loc[n] : make_int2(0, 0);
        const T* ks = k_head + loc.x * p.k_batch_stride + loc.y * p.k_token_stride + lane * 8;
        const T* vs = v_head + loc.x * p.v_batch_stride + loc.y * p.v_token_stride + lane * 8;
        cute::SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<uint4>::copy(
            *reinterpret_cast<const uint4*>(ks), sm.tiles.k[stage][L::index(row, lane)], valid);
        cute::SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<uint4>::copy(
            *reinterpret_cast<const uint4*>(vs), sm.tiles.v[stage][row][swz(row, lane)], valid);
      }
    };
    if (n_tiles > 0) load_tile(0, 0);
    cute::cp_async_fence();
    const float* bias = sm.bias[row_j];
    const int tok0 = half * C::kWarpTokens;  // this warp's tokens inside a tile
    for (int tile = 0; tile < n_tiles; ++tile) {
      const int n0 = tile * C::kTileTokens + tok0;
      // This thread's bias columns are n-tile nt's columns 2 (lane % 4) and + 1; they are read
      // again in the softmax rather than held in registers across the S MMAs.
      auto bias_at = [&](int nt) {
        return *reinterpret_cast<const float2*>(&bias[n0 + nt * 8 + (lane % 4) * 2]);
      };
      bool mine = false;
#pragma unroll
      for (int nt = 0; nt < C::kWarpTokens / 8; ++nt) {
        const float2 b = bias_at(nt);
        mine |= b.x != -INFINITY || b.y != -INFINITY;
      }
      mine = __any_sync(0xffffffffu, mine);
      if (lane == 0) sm.half_live[tile & 1][warp] = mine;
      cute::cp_async_wait<0>();
      // cp.async and plain stores are generic-proxy writes; wgmma reads through the async proxy.
      asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
      __syncthreads();  // tile's data visible; every warp is done with the other stage
      if (tile + 1 < n_tiles) load_tile(tile + 1, (tile + 1) % C::kStages);
      cute::cp_async_fence();
      const int stage = tile % C::kStages;
      float s_acc[C::kWarpTokens / 8][4] = {};
      // A warpgroup's wgmma is collective: it skips a half only if none of its 4 rows has
      // tokens there.
      const int* live = &sm.half_live[tile & 1][half * C::kRows];
      if (!(live[0] | live[1] | live[2] | live[3])) continue;
      // S (64 = 4 rows x 16 heads, 32 tokens) over 16 K steps of 16 features: a step moves
      // 32 bytes inside a 128-byte row, every 4 steps to the next 64-feature block.
      using Gmma = typename Sm90ScoreMma<T>::Atom;
      const uint4* q_base = sm.q;
      const uint4* k_base = &sm.tiles.k[stage][tok0 * 8];
      cute::warpgroup_arrive();
#pragma unroll
      for (int ks = 0; ks < C::kHeadDim / 16; ++ks) {
        const int off = (ks / 4) * (C::kTileTokens * 8) + (ks % 4) * 2;  // in 16-byte chunks
        float(&d)[4][4] = s_acc;
        Gmma::fma(gmma_desc(q_base + off), gmma_desc(k_base + off), d[0][0], d[0][1], d[0][2],
                  d[0][3], d[1][0], d[1][1], d[1][2], d[1][3], d[2][0], d[2][1], d[2][2], d[2][3],
                  d[3][0], d[3][1], d[3][2], d[3][3],
                  ks == 0 ? cute::SM90::GMMA::ScaleOut::Zero : cute::SM90::GMMA::ScaleOut::One);
      }
      cute::warpgroup_commit_batch();
      cute::warpgroup_wait<0>();
#pragma unroll
      for (int nt = 0; nt < C::kWarpTokens / 8; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) cute::warpgroup_fence_operand(s_acc[nt][e]);
      }
      if (!mine) continue;  // warp-uniform: none of my row's tokens in this half

      // Online softmax (log2 domain) over the tile; the bias is log2(multiplicity) or -inf.
      // Once the running maxima settle, most tiles move none of the warp's 16, and the O
      // rescale (128 multiplies a thread, by exactly 1) is skipped.
      float s[2][C::kWarpTokens / 8][2];
      float m_new[2], m_use[2];
      bool moved = false;
#pragma unroll
      for (int hrow = 0; hrow < 2; ++hrow) {
        float mx = -INFINITY;
#pragma unroll
        for (int nt = 0; nt < C::kWarpTokens / 8; ++nt) {
          const float2 b = bias_at(nt);
          s[hrow][nt][0] = s_acc[nt][2 * hrow] * p.scale_log2 + b.x;
          s[hrow][nt][1] = s_acc[nt][2 * hrow + 1] * p.scale_log2 + b.y;
          mx = fmaxf(mx, fmaxf(s[hrow][nt][0], s[hrow][nt][1]));
        }
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        m_new[hrow] = fmaxf(row_max[hrow], mx);
        m_use[hrow] = m_new[hrow] == -INFINITY ? 0.f : m_new[hrow];  // all masked so far: no NaN
        moved |= m_new[hrow] != row_max[hrow];
      }
      if (__any_sync(0xffffffffu, moved)) {
#pragma unroll
        for (int hrow = 0; hrow < 2; ++hrow) {
          const float corr = exp2f(row_max[hrow] - m_use[hrow]);
          row_sum[hrow] *= corr;
#pragma unroll
          for (int i = 0; i < C::kHeadDim / 8; ++i) {
            o_acc[i][2 * hrow] *= corr;
            o_acc[i][2 * hrow + 1] *= corr;
          }
        }
      }
      uint32_t pa[C::kWarpTokens / 16][4];
#pragma unroll
      for (int hrow = 0; hrow < 2; ++hrow) {
        row_max[hrow] = m_new[hrow];
        float sum = 0.f;
#pragma unroll
        for (int nt = 0; nt < C::kWarpTokens / 8; ++nt) {
          const float p0 = exp2f(s[hrow][nt][0] - m_use[hrow]);
          const float p1 = exp2f(s[hrow][nt][1] - m_use[hrow]);
          sum += p0 + p1;
          // A operand of P V, k step nt / 2: regs {row g, k 0-7}, {g+8, 0-7}, {g, 8-15},
          // {g+8, 8-15}.
          pa[nt / 2][(nt % 2) * 2 + hrow] = E::pack(p0, p1);
        }
        row_sum[hrow] += sum;
      }

      // O_j += P V: 16 heads x 256 dims over the warp's 32 tokens. A step is 2 MMAs, shorter
      // than an ldmatrix's latency, so V fragments are loaded kAhead steps ahead.
      constexpr int kAhead = 3;
      uint32_t vb[kAhead + 1][4];
      auto load_v = [&](int step, uint32_t(&b)[4]) {
        const int kk = step / (C::kHeadDim / 16), dt = step % (C::kHeadDim / 16);
        const int row = tok0 + kk * 16 + (lane % 8) + ((lane >> 3) & 1) * 8;
        const int chunk = dt * 2 + (lane >> 4);
        cute::SM75_U16x8_LDSM_T::copy(
            reinterpret_cast<const cute::uint128_t&>(sm.tiles.v[stage][row][swz(row, chunk)]), b[0],
            b[1], b[2], b[3]);
      };
      constexpr int kPvSteps = C::kWarpTokens / 16 * (C::kHeadDim / 16);
#pragma unroll
      for (int step = 0; step < kAhead; ++step) load_v(step, vb[step]);
#pragma unroll
      for (int step = 0; step < kPvSteps; ++step) {
        if (step + kAhead < kPvSteps) load_v(step + kAhead, vb[(step + kAhead) % (kAhead + 1)]);
        const int kk = step / (C::kHeadDim / 16), dt = step % (C::kHeadDim / 16);
        const uint32_t(&b)[4] = vb[step % (kAhead + 1)];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          float* acc = o_acc[2 * dt + h];
          Mma::fma(acc[0], acc[1], acc[2], acc[3], pa[kk][0], pa[kk][1], pa[kk][2], pa[kk][3],
                   b[2 * h], b[2 * h + 1], acc[0], acc[1], acc[2], acc[3]);
        }
      }
    }
    cute::cp_async_wait<0>();
    __syncthreads();  // the ring, loc and bias are free for the next pass
  }

  // ----- merge each row's two halves, then its first warp writes the row --------------------
#pragma unroll
  for (int hrow = 0; hrow < 2; ++hrow) {
    row_sum[hrow] += __shfl_xor_sync(0xffffffffu, row_sum[hrow], 1);
    row_sum[hrow] += __shfl_xor_sync(0xffffffffu, row_sum[hrow], 2);
  }
  if (half == 1) {
#pragma unroll
    for (int i = 0; i < C::kHeadDim / 8; ++i) {
#pragma unroll
      for (int c = 0; c < 4; ++c) sm.merge.o[row_j][i * 4 + c][lane] = o_acc[i][c];
    }
#pragma unroll
    for (int hrow = 0; hrow < 2; ++hrow) {
      sm.merge.m[row_j][hrow][lane] = row_max[hrow];
      sm.merge.l[row_j][hrow][lane] = row_sum[hrow];
    }
  }
  __syncthreads();
  const int64_t r = r0 + row_j;
  if (half == 1 || r >= p.rows) return;
  const int g = lane / 4;
#pragma unroll
  for (int hrow = 0; hrow < 2; ++hrow) {
    const float m1 = sm.merge.m[row_j][hrow][lane];
    const float m = fmaxf(row_max[hrow], m1);
    const float m_use = m == -INFINITY ? 0.f : m;
    const float c0 = exp2f(row_max[hrow] - m_use), c1 = exp2f(m1 - m_use);
    const float l = c0 * row_sum[hrow] + c1 * sm.merge.l[row_j][hrow][lane];
    const int hr = g + 8 * hrow;
    if (hr >= group) continue;
    const int64_t h = static_cast<int64_t>(kvh) * group + hr;
    const float inv = l > 0.f ? 1.f / l : 0.f;
#pragma unroll
    for (int i = 0; i < C::kHeadDim / 8; ++i) {
      const int d = i * 8 + (lane % 4) * 2;
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const float o =
            c0 * o_acc[i][2 * hrow + c] + c1 * sm.merge.o[row_j][i * 4 + 2 * hrow + c][lane];
        store_output<T>(p, r, h, d + c, o * inv);
      }
    }
    if (lane % 4 == 0 && p.lse) {
      p.lse[r * p.lse_row_stride + h * p.lse_head_stride] =
          l > 0.f ? (m + log2f(l)) * 0.69314718055994531f : -INFINITY;
    }
  }
}

template <typename T>
void launch_sparse_attention_rows(const SparseAttentionParams& p, const SparseAttentionLaunch& x,
                                  cudaStream_t stream) {
  using C = RowTileConfig;
  constexpr size_t kSmem = sizeof(RowTileSmem);
  static_assert(kSmem <= 227 * 1024, "one CTA must fit the 227 KB an sm90 block may use");
  static_assert(C::kPositions <= 32767 && C::kHashSlots <= 32767, "slot_of is int16");
  const auto kernel = sparse_attention_rows_kernel<T>;
  opt_in_shared_memory<sparse_attention_rows_kernel<T>>(static_cast<int>(kSmem));
  const dim3 grid(static_cast<unsigned>((p.rows + C::kRows - 1) / C::kRows),
                  static_cast<unsigned>(p.num_kv_heads));
  kernel<<<grid, C::kThreads, kSmem, stream>>>(p, x);
  SPARSE_ATTN_CUDA_CHECK_LAUNCH();
}

}  // namespace sparse_attn::cuda
