// sm90 sparse attention: gather-based forward kernel and SplitKV merge kernel. The math is
// docs/qsa.md's; the reference backend (src/reference) is its executable form and the GPU
// suite compares against it.
//
// Forward, per CTA = (query row r, KV head, split):
//   1. resolve the row: request b, causal position p, KV length (all read from device
//      metadata at run time, so a captured graph replays with current metadata);
//   2. read the split's index columns, keep the valid ones (0 <= t < seq_len_k, t <= p, page
//      id in range; physical: 0 <= id < total_kv) and compact their K/V coordinates into
//      shared memory, in index order; masked ids are never dereferenced;
//   3. gather 64 compacted tokens per stage (16-byte cp.async chunks) and run S = Q K^T,
//      online softmax and O += P V with m16n8k16 MMAs, 16 tokens per token group of 2 warps
//      (both compute the scores, each accumulates half of D); FP8 K/V tiles are converted to T
//      as their fragments are loaded (below);
//   4. merge the 4 groups' softmax states in a fixed order, then either store the output (gate
//      applied, LSE exported) or, with SplitKV, the split's normalised FP32 partial and LSE.
//
// FP8 K/V (KV = __nv_fp8_e4m3, T the query's 16-bit type) stay FP8 in shared memory, which
// halves the ring's bytes per tile. An ldmatrix of FP8 rows hands each thread 4 consecutive
// elements of one row where a 16-bit fragment holds 2 + 2 elements 8 apart, so both MMAs run
// on a permuted order whose pairs fp8x4_to_pairs makes in registers:
//   - S = Q K^T: the 16 dims of a K step are permuted; every thread of one k-step position
//     holds dims (4c, 4c + 2) where the natural order has (2c, 2c + 1), and (4c + 1, 4c + 3)
//     for (2c + 8, 2c + 9). The Q tile is permuted alike once in shared memory (permute_q),
//     so the dot products are unchanged.
//   - O += P V: a transposed ldmatrix of 16 dims hands each thread dims 2n and 2n + 1 of
//     column n, so its 16 dims make two n8 tiles, the even dims and the odd ones; the merge
//     stores them back in natural order.
// The dequantisation scales: k_scale comes folded into scale_log2 (sparse_attention_native.cpp),
// v_scale multiplies the output before it is rounded (the merge's, with SplitKV; 1 for 16-bit
// K/V).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>
#include <cute/arch/copy_sm75.hpp>
#include <cute/arch/copy_sm80.hpp>
#include <type_traits>

#include "api/qsa_attention_params.h"
#include "cuda/attention/merge.cuh"
#include "cuda/attention/sparse_attention_common.cuh"
#include "cuda/attention/sparse_attention_config.h"
#include "cuda/attention/sparse_attention_launch.h"
#include "cuda/common/mma.cuh"

namespace sparse_attn::cuda {

// Reorders each 16-dim group of the Q tile (two 16-byte chunks) into the FP8 K step's order:
// y[2c] = x[4c], y[2c + 1] = x[4c + 2], y[2c + 8] = x[4c + 1], y[2c + 9] = x[4c + 3]. One group
// per thread of the CTA (16 rows x 16 groups).
__device__ inline void permute_q(
    uint4 (&q)[SparseAttentionConfig::kHeadRows][SparseAttentionConfig::kQChunks], int tid) {
  const int hr = tid / 16, g = tid % 16;
  uint4& a = q[hr][swz(hr, 2 * g)];
  uint4& b = q[hr][swz(hr, 2 * g + 1)];
  const uint32_t x[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};  // element pairs (2i, 2i + 1)
  uint32_t y[8];
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    y[c] = __byte_perm(x[2 * c], x[2 * c + 1], 0x5410);      // elements 4c, 4c + 2
    y[4 + c] = __byte_perm(x[2 * c], x[2 * c + 1], 0x7632);  // elements 4c + 1, 4c + 3
  }
  a = make_uint4(y[0], y[1], y[2], y[3]);
  b = make_uint4(y[4], y[5], y[6], y[7]);
}

template <typename T, typename KV>
__global__ void __launch_bounds__(FwdShape::kThreads, 1)
    sparse_attention_fwd_kernel(const __grid_constant__ SparseAttentionParams p,
                                const __grid_constant__ SparseAttentionLaunch x) {
  using C = SparseAttentionConfig;
  using S = FwdShape;
  using R = KVRing<KV>;
  using E = ElementTraits<T>;
  using Mma = typename Sm80Mma<T>::Atom;
  constexpr bool kFp8 = std::is_same_v<KV, __nv_fp8_e4m3>;
  static_assert(kFp8 || std::is_same_v<KV, T>, "K/V are the query's type or FP8 e4m3");
  extern __shared__ __align__(128) unsigned char smem_raw[];
  auto& sm = *reinterpret_cast<SparseAttentionSmem<KV>*>(smem_raw);

  // The SplitKV merge kernel is launched as a programmatic dependent of this grid and waits
  // for its completion in cudaGridDependencySynchronize, so it may be scheduled as soon as
  // every CTA of this grid has started: its CTAs (1 KB of shared memory) then sit resident in that
  // wait, and the merge starts the moment the last split is written instead of a launch later.
  // Without a dependent launch this is a no-op.
  cudaTriggerProgrammaticLaunchCompletion();

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  // This warp's token group (16 tokens of every tile) and its share of D in P V and O.
  const int token_group = warp % C::kTokenGroups;
  const int dim0 = warp / C::kTokenGroups * S::kWarpDims;
  const int64_t r = blockIdx.x;
  const int kvh = blockIdx.y, split = blockIdx.z;
  const int group = static_cast<int>(p.group);

  prefetch_decode_table_row(p, r, tid, S::kThreads);

  // Index entries: token ids, or with the block hint one block per entry plus the tail entry.
  // The first pass's entries do not depend on the row's metadata: load them first, so their
  // latency overlaps the Q tile and the request lookup.
  constexpr int kPerThread = S::kPerThread;
  const int64_t n_entries = x.block_hint ? p.num_blocks + 1 : p.width;
  const int64_t pass_entries = x.block_hint ? C::kBlockPassEntries : S::kPassTokens;
  const int64_t col_begin = static_cast<int64_t>(split) * x.split_cols;
  const int64_t split_end = min(n_entries, col_begin + x.split_cols);
  int32_t ids[kPerThread];
  auto load_ids = [&](int64_t c0, int64_t c1) {
    const int32_t* row = x.block_hint ? p.block_indices.narrowed() + r * p.block_indices_row_stride
                                      : p.token_indices.narrowed() + r * p.token_indices_row_stride;
    const int64_t col_stride =
        x.block_hint ? p.block_indices_col_stride : p.token_indices_col_stride;
    const int64_t stored = x.block_hint ? min(c1, p.num_blocks) : c1;  // the tail is not stored
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) {
      const int64_t e = c0 + j * S::kThreads + tid;
      ids[j] = e < stored ? row[e * col_stride] : -1;
    }
  };
  load_ids(col_begin, min(split_end, col_begin + pass_entries));

  // ----- Q tile: the group's heads, zero rows past the group ------------------------------
  // Vector layouts use cp.async (one group, waited for at the end of the first compaction),
  // so this thread's chunks are in flight together and the request lookup below starts at
  // once, instead of one load-to-store round trip per chunk before it.
  {
    const T* q = static_cast<const T*>(p.q) + r * p.q_row_stride +
                 static_cast<int64_t>(kvh) * group * p.q_head_stride;
    const bool vec =
        p.q_dim_stride == 1 && p.q_head_stride % 8 == 0 && reinterpret_cast<uintptr_t>(q) % 16 == 0;
    for (int c = tid; c < C::kHeadRows * C::kQChunks; c += S::kThreads) {
      const int hr = c / C::kQChunks, chunk = c % C::kQChunks;
      if (vec) {
        // Rows past the group are zero-filled; their source address (row 0) is not read.
        const T* src = q + (hr < group ? hr : 0) * p.q_head_stride + chunk * 8;
        cute::SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<uint4>::copy(*reinterpret_cast<const uint4*>(src),
                                                           sm.q[hr][swz(hr, chunk)], hr < group);
        continue;
      }
      uint4 v = make_uint4(0, 0, 0, 0);
      if (hr < group) {
        const T* src = q + hr * p.q_head_stride + chunk * 8 * p.q_dim_stride;
        T e[8];
        for (int j = 0; j < 8; ++j) e[j] = src[j * p.q_dim_stride];
        v = *reinterpret_cast<uint4*>(e);
      }
      sm.q[hr][swz(hr, chunk)] = v;
    }
    cute::cp_async_fence();
  }
  const RowInfo ri = resolve_row(p, x, r);

  // Per-warp softmax state: rows g = lane / 4 and g + 8 of the head tile, O columns
  // dim0 .. dim0 + kWarpDims. The warps of one token group compute the same scores with the
  // same instructions, so their row_max and row_sum are bitwise equal.
  float o_acc[S::kWarpDims / 8][4];
#pragma unroll
  for (int j = 0; j < S::kWarpDims / 8; ++j)
    o_acc[j][0] = o_acc[j][1] = o_acc[j][2] = o_acc[j][3] = 0.f;
  float row_max[2] = {-INFINITY, -INFINITY};
  float row_sum[2] = {0.f, 0.f};

  const KV* k_head = static_cast<const KV*>(p.k) + kvh * p.k_head_stride;
  const KV* v_head = static_cast<const KV*>(p.v) + kvh * p.v_head_stride;
  const int64_t col_end = ri.active ? split_end : col_begin;
  int tile_seq = 0;

  for (int64_t c0 = col_begin; c0 < col_end; c0 += pass_entries) {
    const int64_t c1 = min(col_end, c0 + pass_entries);
    // ----- compact this pass's valid tokens (index order) ---------------------------------
    if (c0 != col_begin) load_ids(c0, c1);
    // Every entry's page-table read first (unconditional, so they are all in flight together),
    // then the validity of every token. Token k of entry j is bit 4j + k with the block hint
    // (j <= 4), bit j on the token path.
    uint64_t bits = 0;
    const int per_entry = x.block_hint ? 4 : 1;
    auto entry_mask = [&](int j) {
      return static_cast<unsigned>((bits >> (per_entry * j)) & ((1ull << per_entry) - 1));
    };
    // The pages wait for phase 2 in the idle tile ring (each thread its own slots), which
    // keeps registers for o_acc.
    int32_t* const page_buf = reinterpret_cast<int32_t*>(&sm.tiles);
    int32_t pages[kPerThread];
    // Entry steps past the pass's end hold nothing: a split of a few tiles (small decode
    // batches) stops after its first steps instead of running all kPerThread. The bound is
    // uniform over the CTA and the same in the four loops below.
    const int steps = static_cast<int>((c1 - c0 + S::kThreads - 1) / S::kThreads);
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) {
      if (j >= steps) break;
      int count;
      pages[j] =
          entry_page(p, ri, entry_tokens(p, x, ri, c0 + j * S::kThreads + tid, ids[j], &count));
    }
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) {
      if (j >= steps) break;
      const int64_t e = c0 + j * S::kThreads + tid;
      int count;
      const int64_t first = entry_tokens(p, x, ri, e, ids[j], &count);
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        if (e < c1 && k < count && token_valid(p, ri, first + k, pages[j])) {
          bits |= 1ull << (per_entry * j + k);
        }
      }
      page_buf[j * S::kThreads + tid] = pages[j];
    }
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) {
      if (j >= steps) break;
      const int total = __reduce_add_sync(0xffffffffu, __popc(entry_mask(j)));
      if (lane == 0) sm.warp_count[j * S::kWarps + warp] = total;
    }
    __syncthreads();
    // Token k of entry (j, warp, lane) goes after every valid token of earlier j, of earlier
    // warps at this j, of earlier lanes of this warp, and of earlier k.
    int n_valid = 0;
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) {
      if (j >= steps) break;
      int before_warp = 0, in_j = 0;
      for (int w = 0; w < S::kWarps; ++w) {
        const int cnt = sm.warp_count[j * S::kWarps + w];
        if (w < warp) before_warp += cnt;
        in_j += cnt;
      }
      const unsigned mine = entry_mask(j);
      int before_lane = __popc(mine);  // inclusive scan over the warp's lanes, made exclusive
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const int y = __shfl_up_sync(0xffffffffu, before_lane, o);
        if (lane >= o) before_lane += y;
      }
      before_lane -= __popc(mine);
      if (mine) {
        int count;
        const int64_t first = entry_tokens(p, x, ri, c0 + j * S::kThreads + tid, ids[j], &count);
        int at = n_valid + before_warp + before_lane;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          if ((mine >> k) & 1u) {
            sm.token_loc[at++] = token_coords(p, ri, first + k, page_buf[j * S::kThreads + tid]);
          }
        }
      }
      n_valid += in_j;
    }
    cute::cp_async_wait<0>();  // the Q tile's group (first pass; nothing pending after it)
    __syncthreads();
    if constexpr (kFp8) {
      if (c0 == col_begin) {
        permute_q(sm.q, tid);
        __syncthreads();
      }
    }

    // ----- gather tiles through the ring and attend ----------------------------------------
    // Tiles of every pass go through the ring in one sequence (tile_seq counts the earlier
    // passes' tiles).
    const int n_tiles = (n_valid + C::kBlockTokens - 1) / C::kBlockTokens;
    auto stage_of = [&](int tile) { return (tile_seq + tile) % R::kStages; };
    auto load_tile = [&](int tile) {
      const int stage = stage_of(tile);
      // A warp copies 32 / kChunks rows per step (one 16-bit row, two FP8 rows). Rows past
      // n_valid are zero-filled, so P V never meets stale bytes.
      constexpr int kRowsPerStep = 32 / R::kChunks;
      const int chunk = lane % R::kChunks;
#pragma unroll
      for (int i = 0; i < C::kBlockTokens / (S::kWarps * kRowsPerStep); ++i) {
        const int row = (i * S::kWarps + warp) * kRowsPerStep + lane / R::kChunks;
        const int n = tile * C::kBlockTokens + row;
        const bool valid = n < n_valid;
        const int2 loc = valid ? sm.token_loc[n] : make_int2(0, 0);
        const KV* ks =
            k_head + loc.x * p.k_batch_stride + loc.y * p.k_token_stride + chunk * R::kChunkDims;
        const KV* vs =
            v_head + loc.x * p.v_batch_stride + loc.y * p.v_token_stride + chunk * R::kChunkDims;
        cute::SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<uint4>::copy(
            *reinterpret_cast<const uint4*>(ks), sm.tiles.k[stage][row][swz(row, chunk)], valid);
        cute::SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<uint4>::copy(
            *reinterpret_cast<const uint4*>(vs), sm.tiles.v[stage][row][swz(row, chunk)], valid);
      }
      cute::cp_async_fence();
    };
#pragma unroll
    for (int s = 0; s < R::kStages - 1; ++s) {
      if (s < n_tiles) {
        load_tile(s);
      } else {
        cute::cp_async_fence();  // an empty group keeps the wait counts below uniform
      }
    }
    for (int tile = 0; tile < n_tiles; ++tile) {
      const int stage = stage_of(tile);
      // The tile's data visible, and every warp done with the stage reused next.
      cute::cp_async_wait<R::kStages - 2>();
      __syncthreads();
      const int next = tile + R::kStages - 1;
      if (next < n_tiles) {
        load_tile(next);
      } else {
        cute::cp_async_fence();
      }

      const int tok0 = token_group * C::kWarpTokens;  // this warp's 16 tokens in the tile
      const int n_first = tile * C::kBlockTokens + tok0;
      if (n_first >= n_valid) continue;  // warp-uniform: only the last tile is partial

      // S = Q K^T: 16 heads x 16 tokens, two accumulators per n8 tile for MMA-chain ILP, and
      // the next K step's fragments loaded before this step's MMAs (one warp per scheduler
      // has no other warp to hide the ldmatrix latency behind).
      float s_acc[2][2][4] = {};
      auto load_q = [&](int ks, uint32_t(&a)[4]) {
        const int qrow = (lane % 8) + ((lane >> 3) & 1) * 8;
        const int qchunk = ks * 2 + (lane >> 4);
        cute::SM75_U32x4_LDSM_N::copy(
            reinterpret_cast<const cute::uint128_t&>(sm.q[qrow][swz(qrow, qchunk)]), a[0], a[1],
            a[2], a[3]);
      };
      if constexpr (kFp8) {
        // One ldmatrix of FP8 K covers two K steps (32 dims): matrix m is n8 tile m % 2 at
        // chunk 2 * ks2 + m / 2, each register 4 dims of one token (the permuted order).
        uint32_t kr[2][4];
        auto load_k2 = [&](int ks2, uint32_t(&b)[4]) {
          const int krow = tok0 + (lane % 8) + ((lane >> 3) & 1) * 8;
          const int kchunk = ks2 * 2 + (lane >> 4);
          cute::SM75_U32x4_LDSM_N::copy(
              reinterpret_cast<const cute::uint128_t&>(sm.tiles.k[stage][krow][swz(krow, kchunk)]),
              b[0], b[1], b[2], b[3]);
        };
        load_k2(0, kr[0]);
#pragma unroll
        for (int ks2 = 0; ks2 < C::kHeadDim / 32; ++ks2) {
          if (ks2 + 1 < C::kHeadDim / 32) load_k2(ks2 + 1, kr[(ks2 + 1) & 1]);
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            uint32_t a[4];
            load_q(2 * ks2 + h, a);
#pragma unroll
            for (int nt = 0; nt < 2; ++nt) {
              uint32_t b0, b1;
              fp8x4_to_pairs<T>(kr[ks2 & 1][2 * h + nt], b0, b1);
              float* acc = s_acc[nt][h];
              Mma::fma(acc[0], acc[1], acc[2], acc[3], a[0], a[1], a[2], a[3], b0, b1, acc[0],
                       acc[1], acc[2], acc[3]);
            }
          }
        }
      } else {
        uint32_t qa[2][4], kb[2][4];
        auto load_qk = [&](int ks, uint32_t(&a)[4], uint32_t(&b)[4]) {
          load_q(ks, a);
          const int krow = tok0 + (lane % 8) + (lane >> 4) * 8;
          const int kchunk = ks * 2 + ((lane >> 3) & 1);
          cute::SM75_U32x4_LDSM_N::copy(
              reinterpret_cast<const cute::uint128_t&>(sm.tiles.k[stage][krow][swz(krow, kchunk)]),
              b[0], b[1], b[2], b[3]);
        };
        load_qk(0, qa[0], kb[0]);
#pragma unroll
        for (int ks = 0; ks < C::kHeadDim / 16; ++ks) {
          if (ks + 1 < C::kHeadDim / 16) load_qk(ks + 1, qa[(ks + 1) & 1], kb[(ks + 1) & 1]);
          const uint32_t(&a)[4] = qa[ks & 1];
          const uint32_t(&b)[4] = kb[ks & 1];
#pragma unroll
          for (int nt = 0; nt < 2; ++nt) {
            float* acc = s_acc[nt][ks & 1];
            Mma::fma(acc[0], acc[1], acc[2], acc[3], a[0], a[1], a[2], a[3], b[2 * nt],
                     b[2 * nt + 1], acc[0], acc[1], acc[2], acc[3]);
          }
        }
      }

      // V fragments for O += P V: the first one is loaded before the softmax, which hides its
      // latency, and each next one before the current one's MMAs. dt counts this warp's steps
      // of two chunks from dim0 (16 dims of 16-bit V, 32 of FP8).
      constexpr int kVSteps = S::kWarpDims / (2 * R::kChunkDims);
      uint32_t vb[2][4];
      auto load_v = [&](int dt, uint32_t(&b)[4]) {
        const int row = tok0 + (lane % 8) + ((lane >> 3) & 1) * 8;
        const int chunk = dim0 / R::kChunkDims + 2 * dt + (lane >> 4);
        cute::SM75_U16x8_LDSM_T::copy(
            reinterpret_cast<const cute::uint128_t&>(sm.tiles.v[stage][row][swz(row, chunk)]), b[0],
            b[1], b[2], b[3]);
      };
      load_v(0, vb[0]);

      // online softmax (log2 domain); tokens past n_valid are -inf
      float s[2][4];
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int n = n_first + nt * 8 + (lane % 4) * 2 + (e & 1);
          s[nt][e] = n < n_valid ? (s_acc[nt][0][e] + s_acc[nt][1][e]) * p.scale_log2 : -INFINITY;
        }
      }
      uint32_t pa[4];
      float corr[2];
#pragma unroll
      for (int hrow = 0; hrow < 2; ++hrow) {
        float mx = fmaxf(fmaxf(s[0][2 * hrow], s[0][2 * hrow + 1]),
                         fmaxf(s[1][2 * hrow], s[1][2 * hrow + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float m_new = fmaxf(row_max[hrow], mx);
        const float m_use = m_new == -INFINITY ? 0.f : m_new;  // all masked so far: no NaN
        corr[hrow] = exp2f(row_max[hrow] - m_use);
        row_max[hrow] = m_new;
        float p00 = exp2f(s[0][2 * hrow] - m_use), p01 = exp2f(s[0][2 * hrow + 1] - m_use);
        float p10 = exp2f(s[1][2 * hrow] - m_use), p11 = exp2f(s[1][2 * hrow + 1] - m_use);
        row_sum[hrow] = row_sum[hrow] * corr[hrow] + (p00 + p01 + p10 + p11);
        // P as the A operand of P V: k = tokens 0..7 from n8 tile 0, 8..15 from tile 1.
        pa[hrow] = E::pack(p00, p01);
        pa[2 + hrow] = E::pack(p10, p11);
      }
      // Once the row maxima settle (most tiles after the first few) every factor is exactly
      // 1 and the rescale would change no bit: skip it unless some row of the warp moved.
      if (__any_sync(0xffffffffu, corr[0] != 1.f || corr[1] != 1.f)) {
#pragma unroll
        for (int j = 0; j < S::kWarpDims / 8; ++j) {
          o_acc[j][0] *= corr[0];
          o_acc[j][1] *= corr[0];
          o_acc[j][2] *= corr[1];
          o_acc[j][3] *= corr[1];
        }
      }

      // O += P V: 16 heads x kWarpDims dims over this warp's 16 tokens. Registers 2h and
      // 2h + 1 of a step hold tokens 0-7 and 8-15 of its chunk h: an n8 tile of 16-bit V, the
      // n8 tiles of the chunk's even and odd dims for FP8.
#pragma unroll
      for (int dt = 0; dt < kVSteps; ++dt) {
        if (dt + 1 < kVSteps) load_v(dt + 1, vb[(dt + 1) & 1]);
        const uint32_t(&b)[4] = vb[dt & 1];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          if constexpr (kFp8) {
            uint32_t even0, odd0, even1, odd1;
            fp8x4_to_pairs<T>(b[2 * h], even0, odd0);
            fp8x4_to_pairs<T>(b[2 * h + 1], even1, odd1);
            float* acc = o_acc[4 * dt + 2 * h];
            Mma::fma(acc[0], acc[1], acc[2], acc[3], pa[0], pa[1], pa[2], pa[3], even0, even1,
                     acc[0], acc[1], acc[2], acc[3]);
            acc = o_acc[4 * dt + 2 * h + 1];
            Mma::fma(acc[0], acc[1], acc[2], acc[3], pa[0], pa[1], pa[2], pa[3], odd0, odd1, acc[0],
                     acc[1], acc[2], acc[3]);
          } else {
            float* acc = o_acc[2 * dt + h];
            Mma::fma(acc[0], acc[1], acc[2], acc[3], pa[0], pa[1], pa[2], pa[3], b[2 * h],
                     b[2 * h + 1], acc[0], acc[1], acc[2], acc[3]);
          }
        }
      }
    }
    cute::cp_async_wait<0>();
    __syncthreads();  // the ring and token_loc are free for the next pass or the merge
    tile_seq += n_tiles;
  }
  cute::cp_async_wait<0>();  // a row without passes (padding) still has the Q group in flight

  // ----- merge the token groups' states in group order (deterministic) ---------------------
  if (x.num_splits == 1 && p.gate_kind != GateKind::kNone) {
    // store_output below reads one gate element per iteration, and as far as the compiler
    // knows its store to out may alias the next iteration's gate, so those reads would run one
    // memory latency each, in series (24 per thread with 4 warps). Fetch this thread's gate
    // lines into L1 first, all in flight together, while the states are merged.
    const T* gate = static_cast<const T*>(p.gate) + r * p.gate_row_stride;
    for (int e = tid; e < group * C::kHeadDim; e += S::kThreads) {
      const int64_t h = static_cast<int64_t>(kvh) * group + e / C::kHeadDim;
      const int64_t d = p.gate_kind == GateKind::kElementwise ? e % C::kHeadDim : 0;
      asm volatile(
          "prefetch.global.L1 [%0];" ::"l"(gate + h * p.gate_head_stride + d * p.gate_dim_stride));
    }
  }
  const int g = lane / 4;
#pragma unroll
  for (int hrow = 0; hrow < 2; ++hrow) {
    row_sum[hrow] += __shfl_xor_sync(0xffffffffu, row_sum[hrow], 1);
    row_sum[hrow] += __shfl_xor_sync(0xffffffffu, row_sum[hrow], 2);
  }
  if (lane % 4 == 0 && dim0 == 0) {  // one warp per group: the pair's statistics are equal
    sm.merge.m[token_group][g] = row_max[0];
    sm.merge.m[token_group][g + 8] = row_max[1];
    sm.merge.l[token_group][g] = row_sum[0];
    sm.merge.l[token_group][g + 8] = row_sum[1];
  }
  if constexpr (kFp8) {
    // n8 tiles j and j + 1 are the even and odd dims of the 16 from dim0 + 8j: this thread's
    // columns 2c, 2c + 1 of each are dims 4c .. 4c + 3, interleaved.
#pragma unroll
    for (int j = 0; j < S::kWarpDims / 8; j += 2) {
      const int col = dim0 + j * 8 + (lane % 4) * 4;
      *reinterpret_cast<float4*>(&sm.merge.o[token_group][g][col]) =
          make_float4(o_acc[j][0], o_acc[j + 1][0], o_acc[j][1], o_acc[j + 1][1]);
      *reinterpret_cast<float4*>(&sm.merge.o[token_group][g + 8][col]) =
          make_float4(o_acc[j][2], o_acc[j + 1][2], o_acc[j][3], o_acc[j + 1][3]);
    }
  } else {
#pragma unroll
    for (int j = 0; j < S::kWarpDims / 8; ++j) {
      const int col = dim0 + j * 8 + (lane % 4) * 2;
      *reinterpret_cast<float2*>(&sm.merge.o[token_group][g][col]) =
          make_float2(o_acc[j][0], o_acc[j][1]);
      *reinterpret_cast<float2*>(&sm.merge.o[token_group][g + 8][col]) =
          make_float2(o_acc[j][2], o_acc[j][3]);
    }
  }
  __syncthreads();
  // Per head row, once instead of per feature: the maximum, each group's weight
  // exp2(m_w - m) and the weighted sum l (the same operations in the same order as per feature,
  // so the result does not change).
  if (tid < C::kHeadRows) {
    const int hr = tid;
    float m = -INFINITY;
#pragma unroll
    for (int w = 0; w < C::kTokenGroups; ++w) m = fmaxf(m, sm.merge.m[w][hr]);
    float l = 0.f;
    if (m != -INFINITY) {
#pragma unroll
      for (int w = 0; w < C::kTokenGroups; ++w) {
        const float c = exp2f(sm.merge.m[w][hr] - m);
        sm.merge.weight[w][hr] = c;
        l += c * sm.merge.l[w][hr];
      }
    }
    sm.merge.row_m[hr] = m;
    sm.merge.row_l[hr] = l;
  }
  __syncthreads();

  for (int e = tid; e < group * C::kHeadDim; e += S::kThreads) {
    const int hr = e / C::kHeadDim, d = e % C::kHeadDim;
    const float m = sm.merge.row_m[hr], l = sm.merge.row_l[hr];
    float o = 0.f;
    if (m != -INFINITY) {
#pragma unroll
      for (int w = 0; w < C::kTokenGroups; ++w) o += sm.merge.weight[w][hr] * sm.merge.o[w][hr][d];
    }
    const float attn = l > 0.f ? o / l : 0.f;
    const float lse2 = l > 0.f ? m + log2f(l) : -INFINITY;
    const int64_t h = static_cast<int64_t>(kvh) * group + hr;
    if (x.num_splits == 1) {
      store_output<T>(p, r, h, d, attn * p.v_scale);
      if (d == 0 && p.lse) {
        p.lse[r * p.lse_row_stride + h * p.lse_head_stride] = lse2 * 0.69314718055994531f;
      }
    } else {
      const int64_t slot = (static_cast<int64_t>(split) * p.rows + r) * p.num_q_heads + h;
      x.o_partial[slot * C::kHeadDim + d] = attn;
      if (d == 0) x.lse_partial[slot] = lse2;
    }
  }
}

// SplitKV merge (merge.cuh, in split order), then the gate. One CTA per (query row, head), one
// thread per feature, so a decode batch of one request still spreads over Hq CTAs. Few
// registers (six CTAs an SM: at most 42), so that merge CTAs launched early (programmatic
// dependent launch) take little from the forward grid they wait for.
template <typename T>
__global__ void __launch_bounds__(SparseAttentionConfig::kHeadDim, 6)
    sparse_attention_merge_kernel(const __grid_constant__ SparseAttentionParams p,
                                  const __grid_constant__ SparseAttentionLaunch x) {
  constexpr int D = SparseAttentionConfig::kHeadDim;  // threads: one per feature
  __shared__ LseMergeSmem<D> sm;
  const int64_t r = blockIdx.x, h = blockIdx.y;
  const int d = threadIdx.x;
  if (p.gate_kind != GateKind::kNone) {
    // The gate is an input, not the forward grid's output: fetch it while the grid finishes.
    const int64_t gd = p.gate_kind == GateKind::kElementwise ? d : 0;
    asm volatile("prefetch.global.L1 [%0];" ::"l"(static_cast<const T*>(p.gate) +
                                                  r * p.gate_row_stride + h * p.gate_head_stride +
                                                  gd * p.gate_dim_stride));
  }
  cudaGridDependencySynchronize();  // the forward grid's partials are complete and visible
  const int64_t stride = p.rows * p.num_q_heads;  // between splits, in (row, head) slots
  const float* lse = x.lse_partial + r * p.num_q_heads + h;
  const float* part = x.o_partial + (r * p.num_q_heads + h) * D;
  float o[1];
  const float lse2 = merge_lse_partials<D, 1>(
      x.num_splits, 0, D, [&](int s) { return lse[s * stride]; },
      [&](int s, int f) { return part[s * stride * D + f]; }, o, sm);
  store_output<T>(p, r, h, d, o[0] * p.v_scale);
  if (d == 0 && p.lse) {
    p.lse[r * p.lse_row_stride + h * p.lse_head_stride] = lse2 * 0.69314718055994531f;
  }
}

}  // namespace sparse_attn::cuda
