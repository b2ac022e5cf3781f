// The "rows" kernel: many query rows against a key range, each row with a visible key interval.
// Serves qsa_mqa_prefill and every form of qsa_indexer_mqa_score (padded / varlen queries,
// logical / paged keys) and the fused selections' chunks.
//
// Work split: a CTA is one warpgroup and owns 64 query rows and a range of keys. Q sits in
// shared memory for the whole CTA as [256 M-rows, 128] (64 rows x 4 heads), and the keys stream
// through a two-stage cp.async ring of 64-key tiles, both in GMMA's 128-byte swizzle. Per key
// tile the warpgroup issues 4 m64 tiles x 8 K-steps of wgmma m64n64k16 and waits for them; two
// CTAs an SM, so one CTA's MMAs run while the other's epilogue does.
//
// The head sum of ReLU in wgmma's accumulator layout: thread (warp w, g = lane / 4) holds M-rows
// 16 w + g and 16 w + g + 8 of each m64 tile. The M-rows are ordered so that these two are heads
// 2 h' and 2 h' + 1 (h' = g / 4) of one query row, 16 mt + 4 w + g % 4, and lane ^ 16 holds the
// other two heads of the same row: a thread adds its two heads, and lanes l and l ^ 16 swap
// halves of their 16 partial sums with one shuffle per two columns, so each ends with 8 finished
// columns of its row (the mma.sync kernel this replaced held Q in 128 registers a thread, which
// capped an SM at 8 warps and left it latency-bound; docs/perf-notes.md).
//
// FP8 keys: the copies land FP8 tiles (half the bytes); the warpgroup widens each into one
// 16-bit tile before its MMAs read it, so the compute is the 16-bit kernel's.
//
// Masking: only tiles that intersect a row interval are loaded and computed; everything else
// is filled with -inf by plain vector stores, except in a fused selection's chunk (windows
// set), whose top-k reads only each row's visible columns: there nothing outside the active
// tiles is written. Rows of several requests in one CTA (varlen,
// or padded rows straddling a request boundary) are handled in one pass per request, since
// the keys differ per request.
#pragma once

#include <cuda_runtime.h>
#include <cutlass/arch/barrier.h>

#include <algorithm>
#include <climits>
#include <cute/arch/copy_sm80.hpp>
#include <cute/tensor.hpp>
#include <type_traits>

#include "cuda/attention/sm90/gather.h"
#include "cuda/attention/sm90/mma.h"
#include "cuda/attention/sm90/traits.h"
#include "cuda/common/check.h"
#include "cuda/common/device_props.h"
#include "cuda/common/fp8.cuh"
#include "cuda/common/kernel_attributes.h"
#include "cuda/common/mma.cuh"
#include "cuda/indexer/mqa_problem.h"

namespace sparse_attn::cuda::indexer::rows {

inline constexpr int kThreads = 128;  // one warpgroup
inline constexpr int kWarps = kThreads / 32;
inline constexpr int kCtasPerSm = 2;
inline constexpr int kMTiles = 4;                         // m64 tiles: 16 query rows x 4 heads each
inline constexpr int kBlockRows = 16 * kMTiles;           // 64 query rows per CTA
inline constexpr int kQRows = kHeads * kBlockRows;        // M-rows of Q (256)
inline constexpr int kBlockKeys = 64;                     // keys per tile (the MMAs' N)
inline constexpr int kStages = 2;                         // key tiles in the ring
inline constexpr int kRowsPerWarp = kBlockRows / kWarps;  // rows a warp fills with -inf
inline constexpr int kKeysPerWarp = kBlockKeys / kWarps;  // keys of a tile a warp gathers
static_assert(kHeads == 4 && kRowsPerWarp == 16, "the head-pair order of the M-rows");
static_assert(kKeysPerWarp == 16, "a warp gathers one 16-row piece of a tile");

struct NoBuffer {};

// KV: the keys' element type (16-bit, or FP8 e4m3).
template <typename T, typename KV>
struct Config {
  using Element = sm90::CutlassElement<T>;
  static constexpr bool kFp8 = sizeof(KV) == 1;
  using TileShape = cute::Shape<cute::Int<kQRows>, cute::Int<kBlockKeys>, cute::Int<kDim>>;
  using Mma = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<Element, Element, float, TileShape>()));
  using AtomQ = decltype(cutlass::gemm::collective::detail::ss_smem_selector<
                         cute::GMMA::Major::K, Element, cute::Int<kQRows>, cute::Int<kDim>>());
  using LayoutQ =
      decltype(cute::tile_to_shape(AtomQ{}, cute::Shape<cute::Int<kQRows>, cute::Int<kDim>>{}));
  // 16-bit keys: the ring itself; FP8: the one widened tile the MMAs read.
  static constexpr int kTiles = kFp8 ? 1 : kStages;
  using LayoutK = typename sm90::KVStageLayouts<Element, kDim, kBlockKeys, kTiles>::LayoutK;
  using Staging = cute::uint128_t[kStages][kBlockKeys][kDim / 16];  // FP8 tiles as they land

  struct SharedStorage {
    // 1024-byte aligned: GMMA addresses the 128-byte swizzle pattern from the smem address.
    alignas(1024) cute::array_aligned<Element, cute::cosize_v<LayoutQ>> q;
    alignas(1024) cute::array_aligned<Element, cute::cosize_v<LayoutK>> k;
    std::conditional_t<kFp8, Staging, NoBuffer> staging;
    // Bit i of [stage][w]: key kKeysPerWarp w + i of the tile has a source.
    uint16_t key_valid[kStages][kWarps];
    int64_t q_off[kBlockRows];    // element offset of the row's q[row, 0, 0]
    int64_t out_off[kBlockRows];  // element offset of the row's out[row, 0]
    int64_t lo[kBlockRows];       // visible keys [lo, hi), clipped to [0, num_keys]
    int64_t hi[kBlockRows];
    int32_t req[kBlockRows];  // request of the row; -1: not a valid row (all -inf)
    int32_t next_req;
    unsigned long long union_lo;  // the current request's rows' visible columns, CTA-wide
    unsigned long long union_hi;
  };
  static constexpr int kSmemBytes = int(sizeof(SharedStorage));
  static_assert(kCtasPerSm * (kSmemBytes + 1024) <= 228 * 1024, "two CTAs an SM");
};

// Fills out[row, a..b) (columns, element stride `stride`) with -inf, cooperatively by a warp.
__device__ inline void warp_fill_row(float* row, int64_t a, int64_t b, int64_t stride, int lane) {
  if (a >= b) return;
  const float ninf = -INFINITY;
  if (stride != 1) {
    for (int64_t i = a + lane; i < b; i += 32) row[i * stride] = ninf;
    return;
  }
  float* p = row + a;
  const int64_t n = b - a;
  const int64_t head =
      std::min<int64_t>(n, ((16 - (reinterpret_cast<uintptr_t>(p) & 15)) & 15) / sizeof(float));
  for (int64_t i = lane; i < head; i += 32) p[i] = ninf;
  float4* v = reinterpret_cast<float4*>(p + head);
  const int64_t nv = (n - head) / 4;
  for (int64_t i = lane; i < nv; i += 32) v[i] = make_float4(ninf, ninf, ninf, ninf);
  for (int64_t i = head + nv * 4 + lane; i < n; i += 32) p[i] = ninf;
}

// Request, row offsets and the visible interval of one flattened query row.
template <typename Storage>
__device__ inline void resolve_row(const RowsProblem& p, int64_t r, Storage& s, int t) {
  int32_t req = -1;
  int64_t lo = 0, hi = 0, q_off = 0, out_off = 0, pos = -1;
  if (r < p.num_rows) {
    switch (p.mode) {
      case RowMode::kPrefill: {
        req = 0;
        q_off = r * p.q_row_stride;
        out_off = r * p.out_row_stride;
        lo = std::max<int64_t>(p.row_starts[r * p.row_starts_stride], 0);
        hi = std::min<int64_t>(p.row_ends[r * p.row_ends_stride], p.num_keys);
        break;
      }
      case RowMode::kPadded: {
        const int64_t b = r / p.q_len, i = r % p.q_len;
        q_off = b * p.q_batch_stride + i * p.q_row_stride;
        out_off = b * p.out_batch_stride + i * p.out_row_stride;
        const bool valid = !p.seq_lens_q || i < p.seq_lens_q[b * p.seq_lens_q_stride];
        req = valid ? static_cast<int32_t>(b) : -1;
        pos = p.query_positions ? p.query_positions[b * p.query_positions_batch_stride +
                                                    i * p.query_positions_row_stride]
                                : i;
        break;
      }
      case RowMode::kVarlenCu: {
        q_off = r * p.q_row_stride;
        out_off = r * p.out_row_stride;
        // Last request whose start is <= r; the row belongs to it if r is also before its end.
        // Broken (non-monotonic) offsets may make the search miss: the row is then invalid.
        if (p.batch == 0) break;
        int64_t a = 0, b = p.batch;  // invariant: answer in [a, b)
        while (b - a > 1) {
          const int64_t m = (a + b) / 2;
          if (p.cu_seqlens_q[m * p.cu_seqlens_q_stride] <= r)
            a = m;
          else
            b = m;
        }
        const int64_t start = p.cu_seqlens_q[a * p.cu_seqlens_q_stride];
        const int64_t end = p.cu_seqlens_q[(a + 1) * p.cu_seqlens_q_stride];
        if (start <= r && r < end) {
          req = static_cast<int32_t>(a);
          pos = p.query_positions ? p.query_positions[r * p.query_positions_row_stride] : r - start;
        }
        break;
      }
      case RowMode::kVarlenTok: {
        q_off = r * p.q_row_stride;
        out_off = r * p.out_row_stride;
        const int64_t id = p.token_to_req[r * p.token_to_req_stride];
        if (id >= 0 && id < p.batch) {
          req = static_cast<int32_t>(id);
          pos = p.query_positions[r * p.query_positions_row_stride];  // given (validated)
        }
        break;
      }
    }
    // A negative position marks a padding row of a graph-padded batch: -inf, no key read.
    if (p.mode != RowMode::kPrefill && pos < 0) req = -1;
    if (p.mode != RowMode::kPrefill) {
      // Block b (tokens 4b..4b+3) is visible iff 4b + 3 <= pos.
      lo = 0;
      hi = pos >= 3 ? std::min<int64_t>(p.num_keys, (pos + 1) / 4) : 0;
    }
  }
  hi = max(hi, lo);
  if (p.windows) {
    // A fused selection's chunk: rows packed in the scratch, and the top-k told what to read.
    out_off = (r - p.row_begin) * p.out_row_stride;
    if (r < p.num_rows && blockIdx.y == 0) {
      const bool valid = req >= 0 && p.mode != RowMode::kPrefill;
      p.windows[r - p.row_begin] = {valid ? int32_t(lo) : 0, valid ? int32_t(hi) : 0,
                                    valid ? int32_t(std::min<int64_t>(pos, INT32_MAX)) : -1, 0};
    }
  }
  s.req[t] = req;
  s.lo[t] = lo;
  s.hi[t] = hi;
  s.q_off[t] = q_off;
  s.out_off[t] = out_off;
}

// Element offset of key n of request `req` in the keys, or -1 where it has no source (past the
// CTA's range, or on a missing page).
__device__ __forceinline__ int64_t key_offset(const RowsProblem& p, int64_t n, int64_t col1,
                                              int32_t req) {
  if (n >= col1) return -1;
  if (!p.block_table) return req * p.k_batch_stride + n * p.k_row_stride;
  // 32-bit division where it fits (always, for real caches): the 64-bit one is a long sequence.
  const bool narrow = n <= INT32_MAX && p.page_size <= INT32_MAX;
  const int64_t slot_page = narrow ? uint32_t(n) / uint32_t(p.page_size) : n / p.page_size;
  const int64_t page =
      p.block_table[req * p.block_table_batch_stride + slot_page * p.block_table_page_stride];
  if (page < 0 || page >= p.num_pages) return -1;
  return page * p.k_batch_stride + (n - slot_page * p.page_size) * p.k_row_stride;
}

// Writes the scores (or -inf) of one thread's two adjacent columns kc, kc + 1 of a tile.
// `dst` points at column kc; `lim` is the number of the tile's columns inside the CTA's range;
// `pairs`: unit column stride and an 8-byte aligned row (kc is even), so one float2 store.
__device__ __forceinline__ void store_pair(float* dst, int64_t stride, bool pairs, int kc, int lim,
                                           float v0, float v1) {
  if (pairs && kc + 1 < lim) {
    *reinterpret_cast<float2*>(dst) = make_float2(v0, v1);
    return;
  }
  if (kc < lim) dst[0] = v0;
  if (kc + 1 < lim) dst[stride] = v1;
}

// Bits [lo, hi) of a 64-bit tile mask (0 <= lo <= hi <= 64).
__device__ __forceinline__ uint64_t span_mask(int lo, int hi) {
  const uint64_t below_hi = hi >= 64 ? ~0ull : (1ull << hi) - 1;
  const uint64_t below_lo = lo >= 64 ? ~0ull : (1ull << lo) - 1;
  return below_hi & ~below_lo;
}

template <typename T, typename KV>
__global__ void __launch_bounds__(kThreads, kCtasPerSm)
    mqa_rows_kernel(const __grid_constant__ RowsProblem p, int64_t keys_per_cta) {
  using namespace cute;
  using cute::Shape;  // not sparse_attn's (sparse_attn/tensor.h)
  using cute::Tensor;
  using C = Config<T, KV>;
  using Element = typename C::Element;
  extern __shared__ __align__(1024) char smem[];
  auto& s = *reinterpret_cast<typename C::SharedStorage*>(smem);
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  // Row tiles in zig-zag order (last, first, second last, second, ...): in a causal prefill
  // neighbouring CTAs then pair a heavy tile with a light, mostly -inf one, so SMs mix MMA
  // and store work and the grid has no long tail of heavy tiles.
  const int64_t zig = blockIdx.x;
  const int64_t row0 =
      p.row_begin + (zig % 2 == 0 ? int64_t(gridDim.x) - 1 - zig / 2 : zig / 2) * kBlockRows;
  const int64_t col0 = int64_t(blockIdx.y) * keys_per_cta;
  const int64_t col1 = min(p.num_keys, col0 + keys_per_cta);
  float* const out = p.out;

  // --- rows of the tile: request, offsets, visible interval
  if (tid < kBlockRows) resolve_row(p, row0 + tid, s, tid);
  __syncthreads();

  // --- Q into shared memory, once: M-row 16 G + i (G = 4 mt + w, i < 16) is head
  // 2 ((i % 8) / 4) + i / 8 of CTA row 16 mt + 4 w + i % 4 (the head-pair order above); rows
  // that are not valid are zero-filled. Waited with the first key tile.
  {
    const auto* q = static_cast<const Element*>(p.q);
    const int i = lane % 16;
    for (int G = warp; G < kQRows / 16; G += kWarps) {
      const int r = 16 * (G / 4) + 4 * (G % 4) + i % 4, h = 2 * ((i % 8) / 4) + i / 8;
      const int64_t off = s.req[r] >= 0 ? s.q_off[r] + h * p.q_head_stride : -1;
      sm90::gather_rows16<Element, kQRows, kDim>(s.q.data(), q, off, G, lane);
    }
    cute::cp_async_fence();
  }

  // --- invalid rows: -inf over the CTA's columns (a selection's chunk reads none of them)
  const bool fill = !p.windows;
  for (int i = 0; fill && i < kRowsPerWarp; ++i) {
    const int r = warp * kRowsPerWarp + i;
    if (row0 + r < p.num_rows && s.req[r] < 0)
      warp_fill_row(out + s.out_off[r], col0, col1, p.out_col_stride, lane);
  }

  typename C::Mma mma;
  Tensor sQ = make_tensor(make_smem_ptr(s.q.data()), typename C::LayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(s.k.data()), typename C::LayoutK{});
  auto thr = mma.get_thread_slice(tid);
  Tensor tSrQ = thr.partition_fragment_A(sQ);  // descriptors (MMA, kMTiles, K-steps)
  Tensor tSrK = thr.partition_fragment_B(sK);  // descriptors (MMA, 1, K-steps, tiles)
  Tensor tSrS = partition_fragment_C(mma, Shape<Int<kQRows>, Int<kBlockKeys>>{});
  // The thread's query row in m64 tile mt is 16 mt + my_row. Its accumulators hold columns
  // 8 j + 2 (lane % 4) + {0, 1}; after the swap with lane ^ 16 it keeps the even groups j
  // (lanes < 16) or the odd ones: columns first_col + 16 jj + {0, 1}.
  const int my_row = 4 * warp + (lane / 4) % 4;
  const bool upper = lane >= 16;
  const int first_col = 8 * int(upper) + 2 * (lane % 4);
  const auto* keys = static_cast<const std::conditional_t<C::kFp8, uint8_t, Element>*>(p.k);
  const bool paged = static_cast<bool>(p.block_table);  // only then can a key be missing

  // --- one pass per request present in the tile (usually one)
  int32_t prev = -1;
  for (;;) {
    if (tid == 0) {
      s.next_req = INT_MAX;
      s.union_lo = ULLONG_MAX;
      s.union_hi = 0;
    }
    __syncthreads();
    if (tid < kBlockRows && s.req[tid] > prev) atomicMin(&s.next_req, s.req[tid]);
    __syncthreads();
    const int32_t cur = s.next_req;
    if (cur == INT_MAX) break;
    prev = cur;
    if (tid < kBlockRows && s.req[tid] == cur && s.lo[tid] < s.hi[tid]) {
      atomicMin(&s.union_lo, static_cast<unsigned long long>(s.lo[tid]));
      atomicMax(&s.union_hi, static_cast<unsigned long long>(s.hi[tid]));
    }
    __syncthreads();
    const int64_t ulo =
        std::max<int64_t>(col0, s.union_lo == ULLONG_MAX ? col1 : int64_t(s.union_lo));
    const int64_t uhi = std::min<int64_t>(col1, int64_t(s.union_hi));
    // Active tiles (aligned at col0) intersect [ulo, uhi); the rest of the range is -inf.
    const int64_t t0 = ulo < uhi ? (ulo - col0) / kBlockKeys : 0;
    const int64_t t1 = ulo < uhi ? (uhi - col0 + kBlockKeys - 1) / kBlockKeys : 0;
    const int64_t a_begin = min(col1, col0 + t0 * kBlockKeys);
    const int64_t a_end = min(col1, col0 + t1 * kBlockKeys);
    for (int i = 0; fill && i < kRowsPerWarp; ++i) {
      const int r = warp * kRowsPerWarp + i;
      if (s.req[r] != cur) continue;
      warp_fill_row(out + s.out_off[r], col0, a_begin, p.out_col_stride, lane);
      warp_fill_row(out + s.out_off[r], a_end, col1, p.out_col_stride, lane);
    }

    // The thread's rows of this request: intervals, output rows.
    bool own[kMTiles], pairs[kMTiles];
    int64_t lo[kMTiles], hi[kMTiles];
    float* dst[kMTiles];
    CUTE_UNROLL
    for (int mt = 0; mt < kMTiles; ++mt) {
      const int r = 16 * mt + my_row;
      own[mt] = s.req[r] == cur;
      lo[mt] = s.lo[r];
      hi[mt] = s.hi[r];
      dst[mt] = out + s.out_off[r];
      pairs[mt] = p.out_col_stride == 1 && (reinterpret_cast<uintptr_t>(dst[mt]) & 7) == 0;
    }

    // Tile t's copies into ring slot `stage`: warp w gathers keys 16 w .. 16 w + 15, lane i
    // looks key 16 w + i up once.
    auto load = [&](int64_t t, int stage) {
      const int64_t off =
          key_offset(p, col0 + t * kBlockKeys + kKeysPerWarp * warp + lane % 16, col1, cur);
      const unsigned valid = __ballot_sync(0xffffffffu, off >= 0) & 0xffffu;
      if (lane == 0) s.key_valid[stage][warp] = static_cast<uint16_t>(valid);
      if constexpr (C::kFp8) {
        sm90::gather_rows16_fp8<kBlockKeys, kDim>(s.staging[stage], keys, off, warp, lane);
      } else {
        sm90::gather_rows16<Element, kBlockKeys, kDim>(s.k.data() + stage * (kBlockKeys * kDim),
                                                       keys, off, warp, lane);
      }
      cute::cp_async_fence();
    };

    if (t0 < t1) load(t0, 0);
    for (int64_t t = t0; t < t1; ++t) {
      const int stage = int((t - t0) % kStages);
      // Tile t (and, the first time, Q) landed; every thread's MMAs of tile t - 1 are done
      // (waited below), so its slot, and the FP8 tile buffer, are free.
      cute::cp_async_wait<0>();
      if constexpr (C::kFp8) {
        __syncthreads();
        sm90::convert_rows_fp8<Element, kBlockKeys, kKeysPerWarp, kDim>(
            s.k.data(), s.staging[stage], kKeysPerWarp * warp, lane,
            [](uint32_t w, uint32_t& l, uint32_t& h) { fp8x4_to_natural<T>(w, l, h); });
      }
      cutlass::arch::fence_view_async_shared();  // generic-proxy writes, then GMMA reads
      __syncthreads();
      sm90::warpgroup_gemm<true, -1>(mma, tSrQ, tSrK(_, _, _, C::kFp8 ? 0 : stage), tSrS);
      if (t + 1 < t1) load(t + 1, (stage + 1) % kStages);  // while the MMAs run
      cute::warpgroup_wait<0>();
      cute::warpgroup_fence_operand(tSrS);

      // score = scale * sum_h ReLU(S_h), -inf outside the row's interval or on a missing page
      const int64_t n0 = col0 + t * kBlockKeys;
      const auto rel = [&](int64_t x) { return int(std::clamp<int64_t>(x - n0, 0, kBlockKeys)); };
      const int lim = rel(col1);
      // The whole tile inside the CTA's range with unit column stride: plain float2 stores.
      const bool whole = lim == kBlockKeys && p.out_col_stride == 1;
      uint64_t key_valid = ~0ull;
      if (paged) {
        key_valid = 0;
        CUTE_UNROLL
        for (int w = 0; w < kWarps; ++w)
          key_valid |= uint64_t(s.key_valid[stage][w]) << (kKeysPerWarp * w);
      }
      CUTE_UNROLL
      for (int mt = 0; mt < kMTiles; ++mt) {
        // The two heads this thread holds (accumulator rows g and g + 8), per column; then
        // column groups 2 jj (the lower lanes keep it) and 2 jj + 1 (the upper lanes): each lane
        // sends the partial sums of the group its partner keeps. Every lane shuffles; only the
        // request's rows store. v[jj] are columns first_col + 16 jj + {0, 1}.
        float v[kBlockKeys / 16][2];
        CUTE_UNROLL
        for (int jj = 0; jj < kBlockKeys / 16; ++jj) {
          CUTE_UNROLL
          for (int e = 0; e < 2; ++e) {
            const float even = relu(tSrS(make_coord(e, 0, 2 * jj), mt, 0)) +
                               relu(tSrS(make_coord(e, 1, 2 * jj), mt, 0));
            const float odd = relu(tSrS(make_coord(e, 0, 2 * jj + 1), mt, 0)) +
                              relu(tSrS(make_coord(e, 1, 2 * jj + 1), mt, 0));
            const float keep = upper ? odd : even;
            v[jj][e] = p.scale * (keep + __shfl_xor_sync(0xffffffffu, upper ? even : odd, 16));
          }
        }
        if (!own[mt]) continue;
        const uint64_t visible = (key_valid & span_mask(rel(lo[mt]), rel(hi[mt]))) >> first_col;
        const auto score = [&](int jj, int e) {
          return (visible >> (16 * jj + e)) & 1 ? v[jj][e] : -INFINITY;
        };
        float* const row = dst[mt] + (n0 + first_col) * p.out_col_stride;
        if (whole && pairs[mt]) {
          CUTE_UNROLL
          for (int jj = 0; jj < kBlockKeys / 16; ++jj)
            *reinterpret_cast<float2*>(row + 16 * jj) = make_float2(score(jj, 0), score(jj, 1));
        } else {
          CUTE_UNROLL
          for (int jj = 0; jj < kBlockKeys / 16; ++jj)
            store_pair(row + 16 * jj * p.out_col_stride, p.out_col_stride, pairs[mt],
                       16 * jj + first_col, lim, score(jj, 0), score(jj, 1));
        }
      }
    }
    cute::cp_async_wait<0>();
    __syncthreads();
  }
  cute::cp_async_wait<0>();  // Q, where no pass had a tile to compute
}

// Splits the keys only as far as needed for two waves of resident CTAs: every split reloads
// the CTA's Q (64 KB) and pays the prologue again, which dominated small prefills when the
// keys were split finely (4K tokens: 52 us against a 5 us floor, docs/perf-notes.md).
// Examples on 132 SMs (264 resident CTAs): the 64K-token prefill has 1024 row tiles, so one
// split; 16K tokens: 256 row tiles want ceil(528 / 256) = 3 splits of 22 key tiles; 4K
// tokens: 64 row tiles want 9 splits of 2 key tiles (16 in all).
inline int64_t rows_keys_per_cta(int64_t row_tiles, int64_t num_keys, int sms) {
  const int64_t key_tiles = (num_keys + kBlockKeys - 1) / kBlockKeys;
  const int64_t want = (2 * kCtasPerSm * int64_t(sms) + row_tiles - 1) / row_tiles;
  int64_t splits = std::min<int64_t>(std::max<int64_t>(want, 1), key_tiles);
  int64_t tiles = (key_tiles + splits - 1) / splits;
  if ((key_tiles + tiles - 1) / tiles > 65535) tiles = (key_tiles + 65534) / 65535;  // grid.y
  return tiles * kBlockKeys;
}

}  // namespace sparse_attn::cuda::indexer::rows

namespace sparse_attn::cuda::indexer {

template <typename T, typename KV>
void launch_mqa_rows(const RowsProblem& p, cudaStream_t stream) {
  using namespace rows;
  // A selection's chunk runs without keys too: its windows (and positions) are still needed.
  if (p.num_rows <= p.row_begin || (p.num_keys == 0 && !p.windows)) return;
  const auto kernel = mqa_rows_kernel<T, KV>;
  constexpr int kSmem = Config<T, KV>::kSmemBytes;
  opt_in_shared_memory<mqa_rows_kernel<T, KV>>(kSmem, /*prefer_max_shared=*/true);
  int device = 0;
  SPARSE_ATTN_CUDA_CHECK(cudaGetDevice(&device));
  const int sms = sm_count(device);
  const int64_t row_tiles = (p.num_rows - p.row_begin + kBlockRows - 1) / kBlockRows;
  if (row_tiles > INT_MAX) throw Error("qsa indexer: too many query rows for one launch");
  const int64_t keys_per_cta =
      p.num_keys == 0 ? kBlockKeys : rows_keys_per_cta(row_tiles, p.num_keys, sms);
  const dim3 grid(unsigned(row_tiles),
                  unsigned(std::max<int64_t>(1, (p.num_keys + keys_per_cta - 1) / keys_per_cta)));
  kernel<<<grid, kThreads, kSmem, stream>>>(p, keys_per_cta);
  SPARSE_ATTN_CUDA_CHECK_LAUNCH();
}

}  // namespace sparse_attn::cuda::indexer
