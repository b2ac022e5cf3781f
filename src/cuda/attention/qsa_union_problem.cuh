// QSA prefill sparse attention as a Problem of the SM90 attention core (cuda/attention/sm90/
// kernel_fwd.cuh): a CTA attends 2 x (64 / group) consecutive query rows of one request for one
// KV head, their query heads packed into the M rows of the two consumer warpgroups (12 heads x
// 5 rows = 60 of each warpgroup's 64 at the canonical 24/2), against the union of the rows'
// selected 4-token blocks, 64 union tokens per K/V tile.
//
// The union is built once per CTA, by every thread before the roles split, from the block hint
// (docs/qsa.md's entry rules: a hinted block counts where it is complete at the row's position,
// the tail entry is the row's current incomplete block): a bitmap over the visible blocks gives
// the sorted, duplicate-free union, a count per (row, union block) the multiplicities, and from
// them a 64-bit mask per (row, tile) of the tokens the row attends. A score of row j at union
// token t is s + log2(count) / scale_log2 where row j counts t's block and t is not after its
// position nor past the sequence, else -inf, which is the reference's sum over the row's
// entries with each duplicate counted. The order of the sums is the union's,
// not the caller's (FP32 sums; docs/qsa.md allows it); reruns are bitwise equal.
//
// A CTA whose rows span requests, reach past the bitmap, or whose union exceeds kMaxUnion
// blocks (independent selections: the union would be ~R times a row's) writes nothing and marks
// itself not handled; the row-tile kernel takes those rows (sparse_attention_native.cpp).
#pragma once

#include <cutlass/arch/barrier.h>

#include <climits>
#include <cute/arch/copy_sm80.hpp>
#include <cute/tensor.hpp>
#include <type_traits>

#include "api/qsa_attention_params.h"
#include "cuda/attention/qsa_union_params.h"
#include "cuda/attention/sparse_attention_common.cuh"
#include "cuda/attention/sparse_attention_launch.h"

namespace sparse_attn::cuda {

template <class Traits>
struct QsaUnionProblem {
  using C = QsaUnionConfig;
  using Params = QsaUnionParams;
  using Element = typename Traits::Element;
  static constexpr bool kGatherProducer = true;
  static constexpr int kBlockN = Traits::kBlockN;
  static_assert(kBlockN == C::kBlockN && Traits::kHeadDim == C::kHeadDim);
  static_assert(Traits::kProducerArrivals == 128, "the producer warpgroup gathers");

  struct SharedStorage {
    union {
      uint32_t bitmap[C::kBitmapWords];  // while the union is built
      // Then per (row, union block) the multiplicity, two 16-bit counts a word.
      uint32_t counts[C::kMaxRows][C::kMaxUnion / 2];
    };
    // Bit k of live[j][n]: row j attends union token 64 n + k (its block counted, the token
    // not after the row's position nor past the sequence); dup[j]'s bit n: a count of row j
    // in tile n exceeds 1 (the scores there take the log2(count) bias).
    uint64_t live[C::kMaxRows][C::kMaxUnion / 16];
    uint32_t dup[C::kMaxRows][(C::kMaxUnion / 16 + 31) / 32];
    int32_t blocks[C::kMaxUnion];  // the union, ascending
    int32_t outer[C::kMaxUnion];   // each union block's K/V outer index: its page, or request
    int32_t pos[C::kMaxRows];      // causal positions; -1 for a padding row (no keys)
    int32_t warp_sum[C::kThreads / 32];
    int32_t request, seq_len_k, max_pos, n_union;
    int32_t ok;
  };
  static constexpr int kSharedBytes = (sizeof(SharedStorage) + 127) / 128 * 128;

  const Params& pr;
  SharedStorage& sh;
  int r0 = 0, kvh = 0, rows_per_wg = 0, n_tiles = 0;
  bool ok = false;

  // ----- the CTA's rows and their union (every thread) ----------------------------------------
  __device__ QsaUnionProblem(const Params& params, int cta, char* shared)
      : pr(params), sh(*reinterpret_cast<SharedStorage*>(shared)) {
    const SparseAttentionParams& p = pr.p;
    const int tid = static_cast<int>(threadIdx.x);
    rows_per_wg = pr.rows_per_wg;
    const int rows = 2 * rows_per_wg;
    kvh = cta / pr.row_tiles;
    r0 = (cta % pr.row_tiles) * rows;

    // resolve_row is collective (find_request counts over the CTA).
    if (tid == 0) {
      sh.ok = 1;
      sh.request = -1;
      sh.max_pos = -1;
      sh.seq_len_k = 0;
    }
    __syncthreads();
    for (int j = 0; j < rows; ++j) {
      RowInfo ri;
      ri.active = false;
      if (r0 + j < p.rows) ri = resolve_row(p, pr.x, r0 + j);
      if (tid == 0) {
        // Positions past the bitmap, or rows of two requests, are the row-tile kernel's.
        const bool fits = ri.pos < 4 * int64_t{C::kBitmapWords} * 32 - 4;
        if (ri.active && (!fits || (sh.request >= 0 && sh.request != ri.b))) sh.ok = 0;
        const bool live = ri.active && fits;
        sh.pos[j] = live ? static_cast<int32_t>(ri.pos) : -1;
        if (live) {
          sh.request = ri.b;
          sh.seq_len_k = static_cast<int32_t>(min(ri.seq_len_k, int64_t{INT_MAX}));
          sh.max_pos = max(sh.max_pos, static_cast<int32_t>(ri.pos));
        }
      }
    }
    __syncthreads();
    ok = sh.ok != 0;
    if (ok) build_union(tid, rows);
    ok = sh.ok != 0;
    if (tid == 0) pr.handled[cta] = ok ? 1 : 0;
    n_tiles = (4 * sh.n_union + kBlockN - 1) / kBlockN;
  }

  __device__ void build_union(int tid, int rows) {
    const SparseAttentionParams& p = pr.p;
    const int b = max(sh.request, 0);
    const int max_pos = sh.max_pos, seq_len_k = sh.seq_len_k;
    const int words = max_pos < 0 ? 0 : (max_pos + 1) / 4 / 32 + 1;
    for (int w = tid; w < words; w += C::kThreads) sh.bitmap[w] = 0u;

    // Entry f of the CTA is row f / (nb + 1), column f % (nb + 1); column nb is the tail. A
    // thread's entries' loads go out together (ids, then the pages behind them).
    const int nb = static_cast<int>(p.num_blocks), per_row = nb + 1;
    int32_t blk[C::kEntriesPerThread];
    CUTE_UNROLL
    for (int i = 0; i < C::kEntriesPerThread; ++i) {
      const int f = i * C::kThreads + tid, j = f / per_row, e = f % per_row;
      blk[i] = -1;
      if (f < rows * per_row && sh.pos[j] >= 0) {
        const int pos = sh.pos[j];
        if (e < nb) {
          const int32_t id =
              p.block_indices.narrowed()[(r0 + j) * p.block_indices_row_stride +
                                         static_cast<int64_t>(e) * p.block_indices_col_stride];
          blk[i] = id >= 0 && 4 * static_cast<int64_t>(id) + 3 <= pos ? id : -1;
        } else if ((pos + 1) % 4 != 0) {
          blk[i] = (pos + 1) / 4;
        }
        if (4 * static_cast<int64_t>(blk[i]) >= seq_len_k) blk[i] = -1;
      }
    }
    if (p.kv_layout == KVLayout::kPaged) {  // pages hold whole blocks (page_size % 4 == 0)
      int32_t page[C::kEntriesPerThread];
      CUTE_UNROLL
      for (int i = 0; i < C::kEntriesPerThread; ++i) {
        const int idx = blk[i] >= 0 ? 4 * blk[i] / static_cast<int>(p.page_size) : 0;
        page[i] = p.block_table
                      .narrowed()[b * p.block_table_batch_stride + idx * p.block_table_page_stride];
      }
      CUTE_UNROLL
      for (int i = 0; i < C::kEntriesPerThread; ++i) {
        if (page[i] < 0 || page[i] >= p.num_pages) blk[i] = -1;
      }
    }
    __syncthreads();  // the bitmap is clear
    CUTE_UNROLL
    for (int i = 0; i < C::kEntriesPerThread; ++i) {
      if (blk[i] >= 0) atomicOr(&sh.bitmap[blk[i] / 32], 1u << (blk[i] % 32));
    }
    __syncthreads();

    // The union in ascending order: each thread's run of words, an exclusive scan of their
    // counts over the CTA, then each thread writes its blocks.
    const int per_thread = (words + C::kThreads - 1) / C::kThreads;
    const int w0 = tid * per_thread, w1 = min(words, w0 + per_thread);
    int mine = 0;
    for (int w = w0; w < w1; ++w) mine += __popc(sh.bitmap[w]);
    const int lane = tid % 32, warp = tid / 32;
    int incl = mine;
    CUTE_UNROLL
    for (int d = 1; d < 32; d *= 2) {
      const int v = __shfl_up_sync(0xffffffffu, incl, d);
      if (lane >= d) incl += v;
    }
    if (lane == 31) sh.warp_sum[warp] = incl;
    __syncthreads();
    int before = incl - mine, total = 0;
    for (int w = 0; w < C::kThreads / 32; ++w) {
      if (w < warp) before += sh.warp_sum[w];
      total += sh.warp_sum[w];
    }
    if (total > C::kMaxUnion) {  // CTA-uniform
      if (tid == 0) sh.ok = 0;
      __syncthreads();
      return;
    }
    for (int w = w0; w < w1; ++w) {
      uint32_t bits = sh.bitmap[w];
      while (bits != 0u) {
        const int bit = __ffs(bits) - 1;
        bits &= bits - 1u;
        sh.blocks[before++] = 32 * w + bit;
      }
    }
    __syncthreads();  // the bitmap is dead: its storage becomes the counts
    for (int i = tid; i < total; i += C::kThreads) {
      sh.outer[i] =
          p.kv_layout == KVLayout::kPaged
              ? p.block_table
                    .narrowed()[b * p.block_table_batch_stride +
                                (4 * sh.blocks[i] / p.page_size) * p.block_table_page_stride]
              : b;
    }

    // Counts of every row over the tiles' blocks (a partial last tile reads zeros).
    const int padded = (total + kBlockN / 4 - 1) / (kBlockN / 4) * (kBlockN / 4);
    const int tiles = padded / (kBlockN / 4);
    for (int i = tid; i < rows * (padded / 2); i += C::kThreads) {
      sh.counts[i / (padded / 2)][i % (padded / 2)] = 0u;
    }
    for (int i = tid; i < rows * tiles; i += C::kThreads) sh.live[i / tiles][i % tiles] = 0u;
    for (int i = tid; i < C::kMaxRows * ((C::kMaxUnion / 16 + 31) / 32); i += C::kThreads) {
      (&sh.dup[0][0])[i] = 0u;
    }
    __syncthreads();
    CUTE_UNROLL
    for (int i = 0; i < C::kEntriesPerThread; ++i) {
      if (blk[i] < 0) continue;
      int lo = 0, hi = total - 1;  // blk[i] is in the union
      while (lo < hi) {
        const int mid = (lo + hi) / 2;
        if (sh.blocks[mid] < blk[i]) {
          lo = mid + 1;
        } else {
          hi = mid;
        }
      }
      const int j = (i * C::kThreads + tid) / (static_cast<int>(pr.p.num_blocks) + 1);
      atomicAdd(&sh.counts[j][lo / 2], 1u << (16 * (lo % 2)));
    }
    __syncthreads();
    // Each (row, union block)'s four tokens into the row's live bits of the block's tile.
    for (int i = tid; i < rows * total; i += C::kThreads) {
      const int j = i / total, rank = i % total;
      const int count = static_cast<int>((sh.counts[j][rank / 2] >> (16 * (rank % 2))) & 0xffffu);
      if (count == 0) continue;
      uint32_t nibble = 0u;
      CUTE_UNROLL
      for (int e = 0; e < 4; ++e) {
        const int t = 4 * sh.blocks[rank] + e;
        if (t <= sh.pos[j] && t < seq_len_k) nibble |= 1u << e;
      }
      const int n = rank / (kBlockN / 4), within = rank % (kBlockN / 4);
      auto* words = reinterpret_cast<uint32_t*>(&sh.live[j][n]);
      atomicOr(&words[within / 8], nibble << (4 * (within % 8)));
      if (count > 1) atomicOr(&sh.dup[j][n / 32], 1u << (n % 32));
    }
    if (tid == 0) sh.n_union = total;
    __syncthreads();
  }

  __device__ bool has_rows() const { return ok; }

  // ----- tiles: the union's, ascending ----------------------------------------------------
  struct TileIterator {
    int n, end;
    __device__ bool next(int& tile) {
      if (n >= end) return false;
      tile = n++;
      return true;
    }
  };
  __device__ TileIterator tiles() const { return TileIterator{0, n_tiles}; }

  // CTA row m (0 .. 127) is row (m / 64) * rows_per_wg + (m % 64) / group of the CTA, head
  // (m % 64) % group of KV head kvh's group; -1 for a warpgroup's padding rows.
  __device__ int cta_row(int m) const {
    const int g = static_cast<int>(pr.p.group);
    const int jj = (m % 64) / g;
    return jj < rows_per_wg ? (m / 64) * rows_per_wg + jj : -1;
  }
  __device__ int head_of(int m) const {
    const int g = static_cast<int>(pr.p.group);
    return kvh * g + (m % 64) % g;
  }

  // ----- producer: the whole producer warpgroup, cp.async ----------------------------------
  // Q: every (CTA row, 16-byte chunk), zeros for padding rows. A K or V tile: warp w copies
  // tile rows 16 w .. 16 w + 15, lane l chunk l of each (one 512-byte row per warp
  // instruction); lanes 0-15 look up the row's source, lanes 16-31 repeat them.
  template <class T, class Pipe>
  __device__ void produce(typename T::SharedStorage& ss, Pipe& pipe_k, Pipe& pipe_v) const {
    using Copy = cute::SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<cute::uint128_t>;
    const SparseAttentionParams& p = pr.p;
    const int t = static_cast<int>(threadIdx.x);  // 0 .. 127
    const int lane = t % 32, warp = t / 32;
    auto it = tiles();
    int n;
    if (!it.next(n)) return;  // nothing visible: the consumers write zeros without waiting

    const auto* q = static_cast<const Element*>(p.q);
    // Destinations through the swizzled smem tensors: a layout alone gives unswizzled offsets.
    cute::Tensor sQ = cute::make_tensor(cute::make_smem_ptr(ss.q.data()), typename T::LayoutQ{});
    for (int c = t; c < T::kBlockM * (C::kHeadDim / 8); c += 128) {
      const int m = c / (C::kHeadDim / 8), col = (c % (C::kHeadDim / 8)) * 8;
      const int j = cta_row(m);
      const bool live = j >= 0 && r0 + j < p.rows;
      const Element* src =
          q + (live ? (r0 + j) * p.q_row_stride + head_of(m) * p.q_head_stride + col : 0);
      Copy::copy(*reinterpret_cast<const cute::uint128_t*>(src),
                 *reinterpret_cast<cute::uint128_t*>(&sQ(m, col)), live);
    }
    cutlass::arch::cpasync_barrier_arrive_noinc(reinterpret_cast<uint64_t*>(&ss.barrier_q));

    // Lanes 0-15: tile row 16 warp + lane % 16, its K and V element offsets (or -1).
    const int b = max(sh.request, 0), max_pos = sh.max_pos, seq_len_k = sh.seq_len_k;
    const int n_union = sh.n_union;
    auto source = [&](int tile, int64_t& k_off, int64_t& v_off) {
      const int u = tile * kBlockN + 16 * warp + lane % 16;
      const int rank = u / 4;
      const int tok = rank < n_union ? 4 * sh.blocks[rank] + u % 4 : INT_MAX;
      k_off = v_off = -1;
      if (tok <= max_pos && tok < seq_len_k) {
        int64_t outer = b, slot = tok;
        if (p.kv_layout == KVLayout::kPaged) {
          outer = sh.outer[rank];
          slot = tok % p.page_size;
        }
        k_off = outer * p.k_batch_stride + slot * p.k_token_stride + kvh * p.k_head_stride;
        v_off = outer * p.v_batch_stride + slot * p.v_token_stride + kvh * p.v_head_stride;
      }
    };
    // A K (and V) stage is LayoutK: the K-major 128-byte swizzle puts 16-byte chunk c of tile
    // row `row` at column block c / 8, row `row`, slot (c % 8) ^ (row % 8) of that row (V
    // stages hold the same bytes; LayoutVt views them transposed). Lane `lane` copies chunk
    // `lane` of rows 16 warp .. 16 warp + 15, whose row % 8 is r % 8.
    const int lane_offset = (lane / 8) * (kBlockN * 64) + 16 * warp * 64;
    auto copy_tile = [&](Pipe& pipe, auto& state, const Element* base, int64_t off,
                         Element* stages) {
      pipe.producer_wait(state);
      Element* dst = stages + state.index() * (kBlockN * C::kHeadDim) + lane_offset;
      CUTE_UNROLL
      for (int r = 0; r < 16; ++r) {
        const int64_t o = __shfl_sync(0xffffffffu, off, r);
        Copy::copy(*reinterpret_cast<const cute::uint128_t*>(base + (o >= 0 ? o + lane * 8 : 0)),
                   *reinterpret_cast<cute::uint128_t*>(dst + r * 64 + ((lane % 8) ^ (r % 8)) * 8),
                   o >= 0);
      }
      pipe.arrive_on_copies(state);
      ++state;
    };
    const auto* kp = static_cast<const Element*>(p.k);
    const auto* vp = static_cast<const Element*>(p.v);
    auto state_k = Pipe::producer_start();
    auto state_v = Pipe::producer_start();
    int64_t k_off, v_off, v_prev;
    source(n, k_off, v_off);
    copy_tile(pipe_k, state_k, kp, k_off, ss.k.data());
    v_prev = v_off;
    while (it.next(n)) {
      source(n, k_off, v_off);
      copy_tile(pipe_k, state_k, kp, k_off, ss.k.data());
      copy_tile(pipe_v, state_v, vp, v_prev, ss.v.data());
      v_prev = v_off;
    }
    copy_tile(pipe_v, state_v, vp, v_prev, ss.v.data());
  }

  // ----- scores -------------------------------------------------------------------------
  __device__ int keys() const { return INT_MAX; }  // union tiles past the end are zero-filled
  __device__ float scale_log2() const { return pr.p.scale_log2; }

  // Scores where the row does not attend the token are -inf; where the row counts the token's
  // block more than once (duplicate hint entries: rare) they take the bias log2(count), in raw
  // score units (the softmax scales by scale_log2).
  template <class Scores, class Coords>
  __device__ void mask_scores(int n, Scores& s, const Coords& coords, int) const {
    constexpr int kRowsHeld = decltype(cute::size<0>(s))::value;
    CUTE_UNROLL
    for (int i = 0; i < kRowsHeld; ++i) {
      const int j = cta_row(cute::get<0>(coords(i, 0)));
      // Shifted once to this thread's first column: the others are compile-time offsets
      // from it in the accumulator layout.
      const int col0 = cute::get<1>(coords(i, 0));
      const uint64_t live = j >= 0 ? sh.live[j][n] >> col0 : 0u;
      CUTE_UNROLL
      for (int c = 0; c < cute::size<1>(s); ++c) {
        const int offset = cute::get<1>(coords(i, c)) - col0;
        if (((live >> offset) & 1u) == 0u) s(i, c) = -INFINITY;
      }
      if (j >= 0 && (sh.dup[j][n / 32] >> (n % 32) & 1u) != 0u) {
        const float inv_scale = 1.f / pr.p.scale_log2;
        CUTE_UNROLL
        for (int c = 0; c < cute::size<1>(s); ++c) {
          const int rank = (n * kBlockN + cute::get<1>(coords(i, c))) / 4;
          const uint32_t count = (sh.counts[j][rank / 2] >> (16 * (rank % 2))) & 0xffffu;
          if (count > 1u) s(i, c) += __log2f(static_cast<float>(count)) * inv_scale;
        }
      }
    }
  }

  // ----- outputs: row m of the CTA is (query row, head); the gate applied to rounded attn --
  __device__ bool row_in_range(int m) const {
    const int j = cta_row(m);
    return j >= 0 && r0 + j < pr.p.rows;
  }
  __device__ void store_o(int m, int col, uint4 v) const {
    const SparseAttentionParams& p = pr.p;
    const int64_t r = r0 + cta_row(m), h = head_of(m);
    if (p.gate_kind != GateKind::kNone) {
      // The CUDA type of the same bits, for the gate rule the other kernels apply.
      using T = std::conditional_t<std::is_same_v<Element, cutlass::half_t>, __half, __nv_bfloat16>;
      auto* e = reinterpret_cast<T*>(&v);
      CUTE_UNROLL
      for (int i = 0; i < 8; ++i) {
        e[i] = gated_output<T>(p, r, h, col + i, ElementTraits<T>::to_float(e[i]));
      }
    }
    auto* out = static_cast<Element*>(p.out) + r * p.out_row_stride + h * p.out_head_stride + col;
    *reinterpret_cast<uint4*>(out) = v;
  }
  __device__ void store_lse(int m, float v) const {
    const SparseAttentionParams& p = pr.p;
    if (p.lse == nullptr) return;
    p.lse[(r0 + cta_row(m)) * p.lse_row_stride + head_of(m) * p.lse_head_stride] = v;
  }
  __device__ bool split_output() const { return false; }
  __device__ void store_o_partial(int, int, float) const {}
  __device__ void store_lse_partial(int, float) const {}
};

}  // namespace sparse_attn::cuda
