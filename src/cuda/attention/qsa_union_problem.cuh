// QSA prefill sparse attention as a Problem of the SM90 attention core (cuda/attention/sm90/
// kernel_fwd.cuh): a CTA attends 2 x (64 / group) consecutive query rows of one request for one
// KV head, their query heads packed into the M rows of the two consumer warpgroups (12 heads x
// 5 rows = 60 of each warpgroup's 64 at the canonical 24/2), against the union of the rows'
// selected 4-token blocks, 64 union tokens per K/V tile.
//
// The union of each tile of rows is built ahead of this kernel by qsa_union_build.cu (at its
// own occupancy, once for all KV heads) and copied into shared memory when a CTA starts: the
// sorted, duplicate-free union blocks, a 64-bit mask per (row, 64-token tile) of the tokens
// the row attends, and the rows' multiplicities. A score of row j at union token t is
// s + log2(count) / scale_log2 where row j counts t's block and t is not after its position
// nor past the sequence, else -inf: the reference's sum over the row's entries, each
// duplicate counted. The order of the sums is the union's, not the caller's (FP32 sums;
// docs/qsa.md allows it); reruns are bitwise equal.
//
// A tile whose rows span requests, reach past the build's bitmap, or whose union exceeds
// kMaxUnion blocks (independent selections: the union would be ~R times a row's) is marked by
// the build; its CTAs write nothing and the gather kernel takes its rows
// (sparse_attention_native.cpp).
#pragma once

#include <cutlass/arch/barrier.h>

#include <climits>
#include <cute/arch/copy_sm80.hpp>
#include <cute/tensor.hpp>
#include <type_traits>

#include "api/qsa_attention_params.h"
#include "cuda/attention/qsa_union_params.h"
#include "cuda/attention/sm90/gather.h"
#include "cuda/attention/sparse_attention_common.cuh"
#include "cuda/attention/sparse_attention_launch.h"

namespace sparse_attn::cuda {

template <class Traits>
struct QsaUnionProblem {
  using C = QsaUnionConfig;
  using Params = QsaUnionParams;
  using Element = typename Traits::Element;
  static constexpr bool kGatherProducer = true;
  static constexpr bool kPersistent = false;
  static constexpr int kBlockN = Traits::kBlockN;
  static_assert(kBlockN == C::kBlockN && Traits::kHeadDim == C::kHeadDim);
  static_assert(Traits::kProducerArrivals == 128, "the producer warpgroup gathers");

  using SharedStorage = QsaUnionTile;  // copied whole from the build's output
  static constexpr int kSharedBytes = (sizeof(SharedStorage) + 127) / 128 * 128;

  const Params& pr;
  SharedStorage& sh;
  int r0 = 0, kvh = 0, rows_per_wg = 0, n_tiles = 0;
  bool ok = false;

  // ----- the CTA's rows and their union, built by qsa_union_build.cu (every thread) ---------
  __device__ QsaUnionProblem(const Params& params, int cta, char* shared)
      : pr(params), sh(*reinterpret_cast<SharedStorage*>(shared)) {
    const int tid = static_cast<int>(threadIdx.x);
    rows_per_wg = pr.rows_per_wg;
    kvh = cta / pr.chunk_tiles;
    const int local = cta % pr.chunk_tiles;
    r0 = (pr.tile_begin + local) * 2 * rows_per_wg;
    // A tile left to the gather kernel (most of them under independent selections) is known
    // from one word of its record: the rest is not copied.
    if (pr.tiles[local].data.ok == 0) return;
    static_assert(sizeof(SharedStorage) % 16 == 0);
    const auto* src = reinterpret_cast<const uint4*>(&pr.tiles[local]);
    auto* dst = reinterpret_cast<uint4*>(&sh);
    for (int i = tid; i < static_cast<int>(sizeof(SharedStorage) / 16); i += C::kThreads) {
      dst[i] = src[i];
    }
    __syncthreads();
    ok = true;
    n_tiles = (4 * sh.data.n_union + kBlockN - 1) / kBlockN;
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
    const int b = max(sh.data.request, 0), max_pos = sh.data.max_pos, seq_len_k = sh.data.seq_len_k;
    const int n_union = sh.data.n_union;
    auto source = [&](int tile, int64_t& k_off, int64_t& v_off) {
      const int u = tile * kBlockN + 16 * warp + lane % 16;
      const int rank = u / 4;
      const int tok = rank < n_union ? 4 * sh.data.blocks[rank] + u % 4 : INT_MAX;
      k_off = v_off = -1;
      if (tok <= max_pos && tok < seq_len_k) {
        int64_t outer = b, slot = tok;
        if (p.kv_layout == KVLayout::kPaged) {
          outer = sh.data.outer[rank];
          slot = tok % p.page_size;
        }
        k_off = outer * p.k_batch_stride + slot * p.k_token_stride + kvh * p.k_head_stride;
        v_off = outer * p.v_batch_stride + slot * p.v_token_stride + kvh * p.v_head_stride;
      }
    };
    auto copy_tile = [&](Pipe& pipe, auto& state, const Element* base, int64_t off,
                         Element* stages) {
      pipe.producer_wait(state);
      sm90::gather_rows16<Element, kBlockN>(stages + state.index() * (kBlockN * C::kHeadDim), base,
                                            off, warp, lane);
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
      const uint64_t live = j >= 0 ? sh.data.live[j][n] >> col0 : 0u;
      CUTE_UNROLL
      for (int c = 0; c < cute::size<1>(s); ++c) {
        const int offset = cute::get<1>(coords(i, c)) - col0;
        if (((live >> offset) & 1u) == 0u) s(i, c) = -INFINITY;
      }
      if (j >= 0 && (sh.data.dup[j][n / 32] >> (n % 32) & 1u) != 0u) {
        const float inv_scale = 1.f / pr.p.scale_log2;
        CUTE_UNROLL
        for (int c = 0; c < cute::size<1>(s); ++c) {
          const int rank = (n * kBlockN + cute::get<1>(coords(i, c))) / 4;
          const uint32_t count = sh.counts[j][rank];
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
    // The CUDA type of the same bits, for the gate rule the other kernels apply.
    using T = std::conditional_t<std::is_same_v<Element, cutlass::half_t>, __half, __nv_bfloat16>;
    store_gated8<T>(p, r, h, col, v);
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
