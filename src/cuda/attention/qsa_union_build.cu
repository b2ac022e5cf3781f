// The union build of the union prefill kernel (qsa_union_problem.cuh): one CTA per tile of
// 2 x (64 / group) consecutive rows, shared by the KV heads. It resolves the rows, decides
// whether the attention kernel can take them (one request, positions the bitmap covers, a
// union of at most kMaxUnion blocks) and builds their union into the tile's QsaUnionTile:
// a bitmap over the visible blocks gives the sorted, duplicate-free union (docs/qsa.md's entry
// rules: a hinted block counts where it is complete at the row's position, the tail entry is
// the row's current incomplete block), a count per (row, union block) the multiplicities, and
// from them a 64-bit mask per (row, 64-token tile) of the tokens the row attends.
#include <climits>

#include "cuda/attention/qsa_union_params.h"
#include "cuda/attention/sparse_attention_common.cuh"
#include "cuda/common/check.h"

namespace sparse_attn::cuda {
namespace {

using C = QsaUnionConfig;

struct BuildStorage {
  union {
    uint32_t bitmap[C::kBitmapWords];  // while the union is built
    uint32_t counts[C::kMaxRows][C::kMaxUnion / 2];  // two 16-bit counts a word
  };
  QsaUnionData d;
  int32_t warp_sum[C::kThreads / 32];
};

// Builds the union of the rows r0 .. r0 + rows - 1 (resolved into d.pos, d.request, ...) and
// returns its size in blocks; 0 with d.ok cleared when it is over kMaxUnion.
__device__ int build_union(const QsaUnionParams& pr, BuildStorage& s, int tid, int rows,
                           int64_t r0) {
  const SparseAttentionParams& p = pr.p;
  QsaUnionData& d = s.d;

  const int b = max(d.request, 0);
  const int max_pos = d.max_pos, seq_len_k = d.seq_len_k;
  const int words = max_pos < 0 ? 0 : (max_pos + 1) / 4 / 32 + 1;
  for (int w = tid; w < words; w += C::kThreads) s.bitmap[w] = 0u;

  // Entry f of the CTA is row f / (nb + 1), column f % (nb + 1); column nb is the tail. A
  // thread's entries' loads go out together (ids, then the pages behind them).
  const int nb = static_cast<int>(p.num_blocks), per_row = nb + 1;
  int32_t blk[C::kEntriesPerThread];
#pragma unroll
  for (int i = 0; i < C::kEntriesPerThread; ++i) {
    const int f = i * C::kThreads + tid, j = f / per_row, e = f % per_row;
    blk[i] = -1;
    if (f < rows * per_row && d.pos[j] >= 0) {
      const int pos = d.pos[j];
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
#pragma unroll
    for (int i = 0; i < C::kEntriesPerThread; ++i) {
      const int idx = blk[i] >= 0 ? 4 * blk[i] / static_cast<int>(p.page_size) : 0;
      page[i] = p.block_table
                    .narrowed()[b * p.block_table_batch_stride + idx * p.block_table_page_stride];
    }
#pragma unroll
    for (int i = 0; i < C::kEntriesPerThread; ++i) {
      if (page[i] < 0 || page[i] >= p.num_pages) blk[i] = -1;
    }
  }
  __syncthreads();  // the bitmap is clear
#pragma unroll
  for (int i = 0; i < C::kEntriesPerThread; ++i) {
    if (blk[i] >= 0) atomicOr(&s.bitmap[blk[i] / 32], 1u << (blk[i] % 32));
  }
  __syncthreads();

  // The union in ascending order: each thread's run of words, an exclusive scan of their
  // counts over the CTA, then each thread writes its blocks.
  const int per_thread = (words + C::kThreads - 1) / C::kThreads;
  const int w0 = tid * per_thread, w1 = min(words, w0 + per_thread);
  int mine = 0;
  for (int w = w0; w < w1; ++w) mine += __popc(s.bitmap[w]);
  const int lane = tid % 32, warp = tid / 32;
  int incl = mine;
#pragma unroll
  for (int d = 1; d < 32; d *= 2) {
    const int v = __shfl_up_sync(0xffffffffu, incl, d);
    if (lane >= d) incl += v;
  }
  if (lane == 31) s.warp_sum[warp] = incl;
  __syncthreads();
  int before = incl - mine, total = 0;
  for (int w = 0; w < C::kThreads / 32; ++w) {
    if (w < warp) before += s.warp_sum[w];
    total += s.warp_sum[w];
  }
  if (total > C::kMaxUnion) {  // CTA-uniform
    if (tid == 0) d.ok = 0;
    __syncthreads();
    return 0;
  }
  for (int w = w0; w < w1; ++w) {
    uint32_t bits = s.bitmap[w];
    while (bits != 0u) {
      const int bit = __ffs(bits) - 1;
      bits &= bits - 1u;
      d.blocks[before++] = 32 * w + bit;
    }
  }
  __syncthreads();  // the bitmap is dead: its storage becomes the counts
  for (int i = tid; i < total; i += C::kThreads) {
    d.outer[i] =
        p.kv_layout == KVLayout::kPaged
            ? p.block_table.narrowed()[b * p.block_table_batch_stride +
                                       (4 * d.blocks[i] / p.page_size) * p.block_table_page_stride]
            : b;
  }

  // Counts of every row over the tiles' blocks (a partial last tile reads zeros).
  const int padded = (total + C::kBlockN / 4 - 1) / (C::kBlockN / 4) * (C::kBlockN / 4);
  const int tiles = padded / (C::kBlockN / 4);
  for (int i = tid; i < rows * (padded / 2); i += C::kThreads) {
    s.counts[i / (padded / 2)][i % (padded / 2)] = 0u;
  }
  for (int i = tid; i < rows * tiles; i += C::kThreads) d.live[i / tiles][i % tiles] = 0u;
  for (int i = tid; i < C::kMaxRows * ((C::kMaxUnion / 16 + 31) / 32); i += C::kThreads) {
    (&d.dup[0][0])[i] = 0u;
  }
  __syncthreads();
#pragma unroll
  for (int i = 0; i < C::kEntriesPerThread; ++i) {
    if (blk[i] < 0) continue;
    int lo = 0, hi = total - 1;  // blk[i] is in the union
    while (lo < hi) {
      const int mid = (lo + hi) / 2;
      if (d.blocks[mid] < blk[i]) {
        lo = mid + 1;
      } else {
        hi = mid;
      }
    }
    const int j = (i * C::kThreads + tid) / (static_cast<int>(p.num_blocks) + 1);
    atomicAdd(&s.counts[j][lo / 2], 1u << (16 * (lo % 2)));
  }
  __syncthreads();
  // Each (row, union block)'s four tokens into the row's live bits of the block's tile.
  for (int i = tid; i < rows * total; i += C::kThreads) {
    const int j = i / total, rank = i % total;
    const int count = static_cast<int>((s.counts[j][rank / 2] >> (16 * (rank % 2))) & 0xffffu);
    if (count == 0) continue;
    if (count > 255) d.ok = 0;  // the record's counts are bytes
    uint32_t nibble = 0u;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int t = 4 * d.blocks[rank] + e;
      if (t <= d.pos[j] && t < seq_len_k) nibble |= 1u << e;
    }
    const int n = rank / (C::kBlockN / 4), within = rank % (C::kBlockN / 4);
    auto* words = reinterpret_cast<uint32_t*>(&d.live[j][n]);
    atomicOr(&words[within / 8], nibble << (4 * (within % 8)));
    if (count > 1) atomicOr(&d.dup[j][n / 32], 1u << (n % 32));
  }
  if (tid == 0) d.n_union = total;
  __syncthreads();
  return total;
}

__global__ void __launch_bounds__(C::kThreads)
    qsa_union_build_kernel(const __grid_constant__ QsaUnionParams pr) {
  extern __shared__ __align__(16) char smem[];
  auto& s = *reinterpret_cast<BuildStorage*>(smem);
  QsaUnionData& d = s.d;
  const SparseAttentionParams& p = pr.p;
  const int tid = static_cast<int>(threadIdx.x);
  const int rows = 2 * pr.rows_per_wg;
  const int tile = pr.tile_begin + static_cast<int>(blockIdx.x);
  const int64_t r0 = static_cast<int64_t>(tile) * rows;

  // resolve_row is collective (find_request counts over the CTA).
  if (tid == 0) {
    d.ok = 1;
    d.request = -1;
    d.max_pos = -1;
    d.seq_len_k = 0;
    d.n_union = 0;
  }
  __syncthreads();
  for (int j = 0; j < rows; ++j) {
    RowInfo ri;
    ri.active = false;
    if (r0 + j < p.rows) ri = resolve_row(p, pr.x, r0 + j);
    if (tid == 0) {
      // Positions past the bitmap, or rows of two requests, are the gather kernel's.
      const bool fits = ri.pos < 4 * int64_t{C::kBitmapWords} * 32 - 4;
      if (ri.active && (!fits || (d.request >= 0 && d.request != ri.b))) d.ok = 0;
      const bool live = ri.active && fits;
      d.pos[j] = live ? static_cast<int32_t>(ri.pos) : -1;
      if (live) {
        d.request = ri.b;
        d.seq_len_k = static_cast<int32_t>(min(ri.seq_len_k, int64_t{INT_MAX}));
        d.max_pos = max(d.max_pos, static_cast<int32_t>(ri.pos));
      }
    }
  }
  __syncthreads();
  const int total = d.ok != 0 ? build_union(pr, s, tid, rows, r0) : 0;
  QsaUnionTile& out = pr.tiles[blockIdx.x];
  static_assert(sizeof(QsaUnionData) % 16 == 0);
  const auto* src = reinterpret_cast<const uint4*>(&d);
  auto* dst = reinterpret_cast<uint4*>(&out.data);
  for (int i = tid; i < static_cast<int>(sizeof(QsaUnionData) / 16); i += C::kThreads) {
    dst[i] = src[i];
  }
  if (d.ok != 0) {  // the counts as bytes, four a word, over the tiles the union fills
    const int words = (total + C::kBlockN / 4 - 1) / (C::kBlockN / 4) * (C::kBlockN / 16);
    for (int i = tid; i < rows * words; i += C::kThreads) {
      const int j = i / words, w = i % words;
      const uint32_t lo = s.counts[j][2 * w], hi = s.counts[j][2 * w + 1];
      reinterpret_cast<uint32_t*>(out.counts[j])[w] =
          __byte_perm(lo, hi, 0x6420);  // the low byte of each 16-bit count
    }
  }
  if (tid == 0) pr.handled[tile] = d.ok != 0 ? 1 : 0;
}

}  // namespace

void launch_qsa_union_build(const QsaUnionParams& params, cudaStream_t stream) {
  constexpr int kSmem = static_cast<int>(sizeof(BuildStorage));
  static_assert(kSmem <= 48 * 1024, "no opt-in: several build CTAs per SM");
  qsa_union_build_kernel<<<static_cast<unsigned>(params.chunk_tiles), C::kThreads, kSmem, stream>>>(
      params);
  SPARSE_ATTN_CUDA_CHECK_LAUNCH();
}

}  // namespace sparse_attn::cuda
