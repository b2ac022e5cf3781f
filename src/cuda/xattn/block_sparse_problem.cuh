// Block-sparse attention as a Problem of the SM90 attention core (cuda/attention/sm90/
// kernel_fwd.cuh): which query rows and keys a CTA owns, the K/V tiles of the kept 128x128 blocks
// in descending order, their TMA loads (whole tiles, or 8-row pieces where pages cut a tile), the
// causal and sequence-end mask, and the output addressing. docs/xattention.md states the math.
#pragma once

#include <cute/arch/copy_sm90_tma.hpp>
#include <cute/tensor.hpp>

#include "cuda/xattn/block_sparse_fwd.h"

namespace sparse_attn::cuda {

__device__ __forceinline__ int floor_div(int a, int b) {  // b > 0
  return a >= 0 ? a / b : -((-a + b - 1) / b);
}

template <class Traits>
struct BlockSparseProblem {
  using Params = BlockSparseFwdParams;
  static constexpr int kSharedBytes = 0;
  static constexpr bool kGatherProducer = false;
  static constexpr bool kPersistent = BlockSparseTile<Traits::kHeadDim>::kPersistent;
  static constexpr int kBlock = 128;  // the mask's block size
  static constexpr int kBlockN = Traits::kBlockN;
  static constexpr int kCols = Traits::kSwizzleCols;
  static constexpr int kColBlocks = Traits::kHeadDim / kCols;
  static_assert(kBlock % kBlockN == 0, "tiles never straddle a mask block");

  const Params& p;
  int b = 0, h = 0, kvh = 0, m = 0;  // sequence, query head, KV head, query block
  int q_row0 = 0, q_outer = 0, lq = 0;
  int k_row0 = 0, k_outer = 0, lk = 0;
  int offset = 0;    // causal position of the sequence's query row 0: lk - lq
  int key_end = 0;   // keys [0, key_end) are visible to some row of the CTA (and its split)
  int block_lo = 0;  // the CTA's split reads key blocks >= block_lo only
  int split = 0;
  int kind = 1, sink = 0, local = 0, diagonal = 0;
  const uint8_t* mask_row = nullptr;

  // Work item = work tile * splits + split. Work tiles come in sections of p.section units, one
  // after the other; within a section the heaviest query blocks (the last ones, under a causal
  // mask) are handed out first, and within one block index every unit of the section.
  __device__ static int work_items(const Params& params) { return params.work_items; }
  __device__ static int32_t* work_counter(const Params& params) { return params.work_counter; }

  __device__ BlockSparseProblem(const Params& params, int cta, char* = nullptr) : p(params) {
    split = cta % p.splits;
    const int tile = cta / p.splits;
    const int units = p.batch * p.num_q_heads;
    const int per_section = p.section * p.m_blocks;
    const int u0 = tile / per_section * p.section, r = tile % per_section;
    const int width = min(p.section, units - u0);
    const int u = u0 + r % width;
    m = p.m_blocks - 1 - r / width;
    b = u / p.num_q_heads;
    h = u % p.num_q_heads;
    kvh = h / p.group;
    // Broken promises (offsets outside the tensors, lengths past the bounds) are clamped, so no
    // access leaves its tensor or the mask.
    if (p.cu_seqlens_q) {
      sequence_rows(p.cu_seqlens_q, p.cu_seqlens_q_stride, p.total_q, p.max_seqlen_q, q_row0, lq);
    } else {
      q_outer = b;
      lq = p.max_seqlen_q;
    }
    if (p.kv == BlockSparseKV::kPaged) {
      lk = clamp(p.seqlens_k[b * p.seqlens_k_stride], 0,
                 min(p.max_seqlen_k, p.max_pages * p.page_size));
    } else if (p.cu_seqlens_k) {
      sequence_rows(p.cu_seqlens_k, p.cu_seqlens_k_stride, p.total_k, p.max_seqlen_k, k_row0, lk);
    } else {
      k_outer = b;
      lk = p.max_seqlen_k;
    }
    offset = lk - lq;
    const int k_blocks = (lk + kBlock - 1) / kBlock;
    if (p.causal) {
      const int last_row = min(kBlock * m + kBlock - 1, lq - 1);
      key_end = clamp(offset + last_row + 1, 0, lk);
      diagonal = floor_div(offset + last_row, kBlock);
    } else {
      key_end = lk;
      diagonal = k_blocks - 1;
    }
    if (p.splits > 1) {  // the split's share of the visible blocks, a contiguous range
      const int blocks = (key_end + kBlock - 1) / kBlock;
      block_lo = split * blocks / p.splits;
      key_end = min(key_end, max(block_lo, (split + 1) * blocks / p.splits) * kBlock);
    }
    kind = p.head_kind[h];
    sink = p.sink[h];
    local = p.local[h];
    if (kind == 1) {
      mask_row = p.block_mask + b * p.mask_stride[0] + p.sparse_index[h] * p.mask_stride[1] +
                 m * p.mask_stride[2];
    }
  }

  template <class T>
  __device__ static T clamp(T x, T lo, T hi) {
    return x < lo ? lo : (x > hi ? hi : x);
  }

  // Sequence b's rows of a varlen tensor: [cu[b], cu[b + 1]) clamped into [0, total) and to at
  // most max_len rows.
  __device__ void sequence_rows(const int32_t* cu, int64_t stride, int64_t total, int max_len,
                                int& row0, int& len) const {
    const int64_t r0 = clamp<int64_t>(cu[b * stride], 0, total);
    const int64_t r1 = clamp<int64_t>(cu[(b + 1) * stride], r0, total);
    row0 = static_cast<int>(r0);
    len = static_cast<int>(min(r1 - r0, int64_t{max_len}));
  }

  __device__ bool has_rows() const { return kBlock * m < lq; }

  __device__ bool kept(int j) const {
    if (kind == 0) return true;
    if (kind == -1) return j < sink || (j > diagonal - local && j <= diagonal);
    return mask_row[j * p.mask_stride[3]] != 0;
  }

  // ----- the tiles a CTA visits: the tiles of its kept blocks, highest first -----------------
  // Warp-collective: each lane tests one block of a 32-block chunk and a ballot collects them,
  // so a chunk costs one load per lane; every warp that asks walks the same order. The next
  // chunk's loads are issued when a chunk is entered and read when it is used up, so their
  // latency hides behind the chunk's tiles.
  struct TileIterator {
    const BlockSparseProblem* pr;
    int chunk;          // first block of the current chunk
    uint32_t bits;      // kept blocks of the chunk not visited yet
    bool lower_kept;    // this lane's block of the chunk below is kept
    int tile, tile_lo;  // the current block's remaining tiles: tile .. tile_lo

    __device__ bool lane_kept(int c) const {
      const int j = c + static_cast<int>(threadIdx.x % 32);
      const int last_block = (pr->key_end - 1) / kBlock;
      return j >= pr->block_lo && j <= last_block && pr->kept(j);
    }

    __device__ bool next(int& n) {
      if (tile >= tile_lo) {
        n = tile--;
        return true;
      }
      while (bits == 0) {
        chunk -= 32;
        if (chunk + 32 <= pr->block_lo) return false;
        bits = __ballot_sync(0xffffffff, lower_kept);
        lower_kept = lane_kept(chunk - 32);
      }
      const int top = 31 - __clz(bits);
      bits &= ~(1u << top);
      const int j = chunk + top;
      tile_lo = j * (kBlock / kBlockN);
      n = (min((j + 1) * kBlock, pr->key_end) - 1) / kBlockN;
      tile = n - 1;
      return true;
    }
  };

  __device__ TileIterator tiles() const {
    TileIterator it{this, 0, 0u, false, -1, 0};
    if (key_end > 0) {
      it.chunk = (key_end - 1) / kBlock / 32 * 32;
      it.bits = __ballot_sync(0xffffffff, it.lane_kept(it.chunk));
      it.lower_kept = it.lane_kept(it.chunk - 32);
    }
    return it;
  }

  // ----- producer: TMA loads into 128-byte-swizzled column blocks of kCols -------------------
  __device__ void load_q(typename Traits::Element* smem, uint64_t* bar) const {
    CUTE_UNROLL
    for (int c = 0; c < kColBlocks; ++c) {
      cute::SM90_TMA_LOAD_4D::copy(
          &p.tma_q, bar, static_cast<uint64_t>(cute::TMA::CacheHintSm90::EVICT_FIRST),
          smem + c * Traits::kBlockM * kCols, c * kCols, q_row0 + kBlock * m, h, q_outer);
    }
  }

  // One K or V tile: whole when it lies in one row range or page, else in 8-row pieces, each
  // with its own page (lanes look the pages up, the leader issues the copies).
  __device__ void load_tile(const CUtensorMap* desc, const CUtensorMap* pieces, int n,
                            typename Traits::Element* smem, uint64_t* bar, bool leader) const {
    const uint64_t hint = static_cast<uint64_t>(cute::TMA::CacheHintSm90::EVICT_LAST);
    const int t0 = n * kBlockN;
    if (p.kv == BlockSparseKV::kRows || t0 % p.page_size + kBlockN <= p.page_size) {
      int row = k_row0 + t0, outer = k_outer;
      if (p.kv == BlockSparseKV::kPaged) {
        outer = p.block_table[b * p.block_table_stride[0] +
                              (t0 / p.page_size) * p.block_table_stride[1]];
        row = t0 % p.page_size;
      }
      if (leader) {
        CUTE_UNROLL
        for (int c = 0; c < kColBlocks; ++c) {
          cute::SM90_TMA_LOAD_4D::copy(desc, bar, hint, smem + c * kBlockN * kCols, c * kCols, row,
                                       kvh, outer);
        }
      }
      return;
    }
    // Pieces past the keys load piece 0's rows again (their page may not exist); the tile's
    // byte count stays whole and the rows are masked.
    constexpr int kPieces = kBlockN / 8;
    static_assert(kPieces <= 32, "one lane per piece");
    const int lane = static_cast<int>(threadIdx.x % 32);
    int t = t0 + 8 * lane;
    if (lane >= kPieces || t >= lk) t = t0;
    const int page =
        p.block_table[b * p.block_table_stride[0] + (t / p.page_size) * p.block_table_stride[1]];
    const int slot = t % p.page_size;
    CUTE_UNROLL
    for (int g = 0; g < kPieces; ++g) {
      const int pg = __shfl_sync(0xffffffff, page, g), sl = __shfl_sync(0xffffffff, slot, g);
      if (leader) {
        CUTE_UNROLL
        for (int c = 0; c < kColBlocks; ++c) {
          cute::SM90_TMA_LOAD_4D::copy(pieces, bar, hint,
                                       smem + c * kBlockN * kCols + g * 8 * kCols, c * kCols, sl,
                                       kvh, pg);
        }
      }
    }
  }
  __device__ void load_k(int n, typename Traits::Element* smem, uint64_t* bar, bool leader) const {
    load_tile(&p.tma_k, &p.tma_k_pieces, n, smem, bar, leader);
  }
  __device__ void load_v(int n, typename Traits::Element* smem, uint64_t* bar, bool leader) const {
    load_tile(&p.tma_v, &p.tma_v_pieces, n, smem, bar, leader);
  }

  // ----- scores ---------------------------------------------------------------------------
  __device__ int keys() const { return lk; }
  __device__ float scale_log2() const { return p.scale_log2; }
  // Keys past the sequence's, and under the causal mask those past the row's position.
  __device__ int key_limit(int row) const {
    return p.causal ? min(lk, offset + kBlock * m + row + 1) : lk;
  }
  // A tile is masked for a warpgroup's rows only where it reaches past the limit of its first
  // row (the limits do not decrease with the row): one compare for most tiles, and a compare
  // and select a score for the others.
  template <class Scores, class Coords>
  __device__ void mask_scores(int n, Scores& s, const Coords& coords, int first_row) const {
    if ((n + 1) * kBlockN <= key_limit(first_row)) return;
    CUTE_UNROLL
    for (int i = 0; i < cute::size<0>(s); ++i) {
      const int limit = key_limit(cute::get<0>(coords(i, 0))) - n * kBlockN;
      CUTE_UNROLL
      for (int j = 0; j < cute::size<1>(s); ++j) {
        if (cute::get<1>(coords(i, j)) >= limit) s(i, j) = -INFINITY;
      }
    }
  }

  // ----- outputs --------------------------------------------------------------------------
  __device__ bool row_in_range(int row) const { return kBlock * m + row < lq; }
  // Elements [col, col + sizeof(V) / 2) of a row: uint32_t from the kernel's registers, uint4
  // from the SplitKV merge.
  template <class V>
  __device__ void store_o(int row, int col, V v) const {
    const int64_t r = q_row0 + kBlock * m + row;
    auto* out = static_cast<typename Traits::Element*>(p.out) + q_outer * p.out_stride[0] +
                r * p.out_stride[1] + h * p.out_stride[2] + col;
    *reinterpret_cast<V*>(out) = v;
  }
  __device__ void store_lse(int row, float v) const {
    if (p.lse == nullptr) return;
    const int64_t r = q_row0 + kBlock * m + row;
    p.lse[q_outer * p.lse_stride[0] + r * p.lse_stride[1] + h * p.lse_stride[2]] = v;
  }

  // SplitKV partials (p.splits > 1): the (split, row, head) slot of row `row` of the tile.
  __device__ bool split_output() const { return p.splits > 1; }
  __device__ int64_t partial_slot(int s, int row) const {
    const int64_t r = static_cast<int64_t>(q_outer) * p.max_seqlen_q + q_row0 + kBlock * m + row;
    return (s * p.partial_rows + r) * p.num_q_heads + h;
  }
  __device__ void store_o_partial(int row, int col, float v) const {
    p.o_partial[partial_slot(split, row) * Traits::kHeadDim + col] = v;
  }
  __device__ void store_lse_partial(int row, float v) const {
    p.lse_partial[partial_slot(split, row)] = v;
  }
};

}  // namespace sparse_attn::cuda
