// The "rows" kernel: many query rows against a key range, each row with a visible key interval.
// Serves qsa_mqa_prefill and every form of qsa_indexer_mqa_score (padded / varlen queries,
// logical / paged keys).
//
// Work split: a CTA owns 64 query rows (4 warps x 16) and a range of keys. Each warp keeps
// its 16 rows x 4 heads x 128 features of Q in registers for the whole CTA (128 registers a
// thread: the A operand of every MMA), and the CTA streams the keys through a 4-stage
// cp.async pipeline of 64-key tiles. Per 8-key column block a warp issues 4 heads x 8 K-steps
// of m16n8k16; the M tile of head h holds the warp's 16 rows for that head, so the sum over
// heads of ReLU is thread-local in the accumulator layout (no shuffles).
//
// Why mma.sync (CuTe's SM80 atom) and not wgmma: with mma.sync the head sum of ReLU is
// thread-local; wgmma's M = 64 rows per warpgroup spreads a row's 4 heads over 4 warps
// (head-major M) or 4 lanes (row-major M), so the sum needs shuffles or shared memory per
// output element, and the first goal was a kernel that is exact on every form. Measured on
// the H200 (docs/perf-notes.md) this version is latency-bound, not write-bound: the resident
// Q fragments (128 registers a thread) cap an SM at 8 warps and the tensor pipe is busy a
// third of the time (64K prefill at 40% of its floor). The next step is wgmma with Q and K
// in shared memory (no Q registers, MMAs overlapping the previous tile's epilogue).
//
// FP8 keys: the copies land FP8 tiles (half the bytes and shared memory); the CTA widens each
// into one 16-bit tile before the warps' MMAs read it, so the compute is the 16-bit kernel's.
//
// Masking: only tiles that intersect a row interval are loaded and computed; everything else
// is filled with -inf by plain vector stores, except in a fused selection's chunk (windows
// set), whose top-k reads only each row's visible columns: there nothing outside the active
// tiles is written. Rows of several requests in one CTA (varlen,
// or padded rows straddling a request boundary) are handled in one pass per request, since
// the keys differ per request.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cute/arch/copy_sm80.hpp>
#include <type_traits>

#include "cuda/common/check.h"
#include "cuda/common/device_props.h"
#include "cuda/common/fp8.cuh"
#include "cuda/common/mma.cuh"
#include "cuda/indexer/mqa_problem.h"

namespace sparse_attn::cuda::indexer::rows {

// 4-warp CTAs, two per SM: the same 8 warps an SM holds at ~250 registers as one 8-warp CTA,
// in twice as many CTAs, which small prefills need (4K tokens: 52 -> 33 us measured); the
// 64K prefill stayed at 2.4 - 2.5 ms (docs/perf-notes.md).
inline constexpr int kWarps = 4;
inline constexpr int kCtasPerSm = 2;
inline constexpr int kThreads = kWarps * 32;
inline constexpr int kRowsPerWarp = 16;                   // one m16 tile per head
inline constexpr int kBlockRows = kWarps * kRowsPerWarp;  // 64 query rows per CTA
inline constexpr int kBlockKeys = 64;                     // keys per pipeline stage
inline constexpr int kStages = 4;                         // cp.async stages in flight
inline constexpr int kChunks = kDim * 2 / 16;             // 16-byte chunks per key (16)

static_assert(kBlockRows <= kThreads, "one thread resolves one row of the tile");
static_assert(kBlockKeys * kChunks % kThreads == 0, "a tile is copied in whole rounds");

struct NoBuffer {};

// KV: the keys' element type (16-bit, or FP8 e4m3).
template <typename KV>
struct SharedStorage {
  static constexpr bool kFp8 = sizeof(KV) == 1;
  static constexpr int kStoredChunks = kDim * int(sizeof(KV)) / 16;  // 16-byte chunks per key
  using Tile = uint4[kBlockKeys][kChunks];
  // Key tiles as the copies land them. 16-bit: the MMAs read them; the 16-byte chunk index is
  // XOR-swizzled with bit 2 of the key parity so that the two keys one 8-lane phase reads (keys
  // 2i, 2i+1, same chunks) land in different banks. FP8: unswizzled, widened into `wide` (same
  // swizzle) by the whole CTA before the MMAs: once per tile, not once per warp.
  uint4 stages[kStages][kBlockKeys][kStoredChunks];
  std::conditional_t<kFp8, Tile, NoBuffer> wide;
  uint8_t key_valid[kStages][kBlockKeys];  // 0: key past the range or on a missing page
  int64_t q_off[kBlockRows];               // element offset of the row's q[row, 0, 0]
  int64_t out_off[kBlockRows];             // element offset of the row's out[row, 0]
  int64_t lo[kBlockRows];                  // visible keys [lo, hi), clipped to [0, num_keys]
  int64_t hi[kBlockRows];
  int32_t req[kBlockRows];  // request of the row; -1: not a valid row (all -inf)
  int32_t next_req;
  unsigned long long union_lo;  // the current request's rows' visible columns, CTA-wide
  unsigned long long union_hi;
};

__device__ __forceinline__ int swizzle(int key, int chunk) { return chunk ^ ((key & 1) << 2); }

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

// Issues the cp.async copies of key tile [n0, n0 + kBlockKeys) of request `req` into `stage`.
template <typename KV>
__device__ inline void load_tile(const RowsProblem& p, SharedStorage<KV>& s, int stage, int64_t n0,
                                 int64_t col1, int32_t req, int tid) {
  using S = SharedStorage<KV>;
  constexpr int kPerChunk = 16 / sizeof(KV);  // elements
  const auto* k = static_cast<const std::conditional_t<S::kFp8, uint8_t, uint16_t>*>(p.k);
#pragma unroll
  for (int i = 0; i < kBlockKeys * S::kStoredChunks / kThreads; ++i) {
    const int idx = tid + i * kThreads;
    const int key = idx / S::kStoredChunks, chunk = idx % S::kStoredChunks;
    const int64_t n = n0 + key;
    bool valid = n < col1;
    const auto* src = k;
    if (valid) {
      if (!p.block_table) {
        src = k + req * p.k_batch_stride + n * p.k_row_stride + chunk * kPerChunk;
      } else {
        const int64_t page = p.block_table[req * p.block_table_batch_stride +
                                           (n / p.page_size) * p.block_table_page_stride];
        valid = page >= 0 && page < p.num_pages;
        if (valid)
          src =
              k + page * p.k_batch_stride + (n % p.page_size) * p.k_row_stride + chunk * kPerChunk;
      }
    }
    // Invalid keys are zero-filled (no global read) and marked, so they become -inf.
    uint4& dst = s.stages[stage][key][S::kFp8 ? chunk : swizzle(key, chunk)];
    cute::SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<uint4>::copy(*reinterpret_cast<const uint4*>(src), dst,
                                                       valid);
    if (chunk == 0) s.key_valid[stage][key] = valid;
  }
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

// FP8: the landed stage widened into the 16-bit tile, by the whole CTA (between barriers).
template <typename T>
__device__ inline void widen_tile(SharedStorage<__nv_fp8_e4m3>& s, int stage, int tid) {
  using S = SharedStorage<__nv_fp8_e4m3>;
#pragma unroll
  for (int i = 0; i < kBlockKeys * S::kStoredChunks / kThreads; ++i) {
    const int idx = tid + i * kThreads;
    const int key = idx / S::kStoredChunks, chunk = idx % S::kStoredChunks;
    uint4 lo, hi;
    fp8x16_to_natural<T>(s.stages[stage][key][chunk], lo, hi);
    s.wide[key][swizzle(key, 2 * chunk)] = lo;
    s.wide[key][swizzle(key, 2 * chunk + 1)] = hi;
  }
}

template <typename T, typename KV>
__global__ void __launch_bounds__(kThreads, kCtasPerSm)
    mqa_rows_kernel(const RowsProblem p, int64_t keys_per_cta) {
  using S = SharedStorage<KV>;
  extern __shared__ uint4 smem_raw[];
  S& s = *reinterpret_cast<S*>(smem_raw);
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, c = lane % 4;
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

  // --- Q fragments of the warp's rows ra = 16 warp + g and rb = ra + 8, all heads
  const int ra = warp * kRowsPerWarp + g, rb = ra + 8;
  uint4 qa[kHeads][4], qb[kHeads][4];
  {
    const auto* q = static_cast<const uint16_t*>(p.q);
    const bool va = s.req[ra] >= 0, vb = s.req[rb] >= 0;
    const uint4 zero = make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int h = 0; h < kHeads; ++h) {
#pragma unroll
      for (int pp = 0; pp < 4; ++pp) {
        const int64_t f = h * p.q_head_stride + 32 * pp + 8 * c;
        qa[h][pp] = va ? __ldg(reinterpret_cast<const uint4*>(q + s.q_off[ra] + f)) : zero;
        qb[h][pp] = vb ? __ldg(reinterpret_cast<const uint4*>(q + s.q_off[rb] + f)) : zero;
      }
    }
  }

  // --- invalid rows: -inf over the CTA's columns (a selection's chunk reads none of them)
  const bool fill = !p.windows;
  for (int i = 0; fill && i < kRowsPerWarp; ++i) {
    const int r = warp * kRowsPerWarp + i;
    if (row0 + r < p.num_rows && s.req[r] < 0)
      warp_fill_row(out + s.out_off[r], col0, col1, p.out_col_stride, lane);
  }

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

    // Visible columns of this request's rows: per thread row, per warp, per CTA.
    const bool own_a = s.req[ra] == cur, own_b = s.req[rb] == cur;
    const int64_t lo_a = s.lo[ra], hi_a = s.hi[ra], lo_b = s.lo[rb], hi_b = s.hi[rb];
    int64_t wlo = LLONG_MAX, whi = 0;
    if (own_a && lo_a < hi_a) wlo = lo_a, whi = hi_a;
    if (own_b && lo_b < hi_b) wlo = min(wlo, lo_b), whi = max(whi, hi_b);
#pragma unroll
    for (int m = 1; m < 32; m <<= 1) {
      wlo = min(wlo, __shfl_xor_sync(0xffffffffu, wlo, m));
      whi = max(whi, __shfl_xor_sync(0xffffffffu, whi, m));
    }
    const bool warp_owns = __any_sync(0xffffffffu, own_a || own_b);
    float* const row_a = out + s.out_off[ra];
    float* const row_b = out + s.out_off[rb];
    const int64_t cs = p.out_col_stride;
    const bool pairs_a = cs == 1 && (reinterpret_cast<uintptr_t>(row_a) & 7) == 0;
    const bool pairs_b = cs == 1 && (reinterpret_cast<uintptr_t>(row_b) & 7) == 0;
    const bool paged =
        static_cast<bool>(p.block_table);  // only then can a key inside the range be missing
    if (lane == 0 && wlo < whi) {
      atomicMin(&s.union_lo, static_cast<unsigned long long>(wlo));
      atomicMax(&s.union_hi, static_cast<unsigned long long>(whi));
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

    // --- key pipeline over the active tiles
#pragma unroll
    for (int st = 0; st < kStages - 1; ++st) {
      if (t0 + st < t1) load_tile(p, s, st, col0 + (t0 + st) * kBlockKeys, col1, cur, tid);
      cute::cp_async_fence();
    }
    for (int64_t t = t0; t < t1; ++t) {
      cute::cp_async_wait<kStages - 2>();
      __syncthreads();
      const int64_t pre = t + kStages - 1;
      if (pre < t1)
        load_tile(p, s, int((pre - t0) % kStages), col0 + pre * kBlockKeys, col1, cur, tid);
      cute::cp_async_fence();

      const int stage = int((t - t0) % kStages);
      const int64_t n0 = col0 + t * kBlockKeys;
      if constexpr (S::kFp8) {
        widen_tile<T>(s, stage, tid);
        __syncthreads();
      }
      const uint4(*tile)[kChunks] = [&] {
        if constexpr (S::kFp8) {
          return s.wide;
        } else {
          return s.stages[stage];
        }
      }();
      if (!warp_owns) continue;
      // A warp whose rows see nothing of this tile writes -inf without computing.
      const bool compute = n0 < whi && wlo < n0 + kBlockKeys;
      // Tile-relative 32-bit bounds keep the per-element masks cheap.
      const auto rel = [&](int64_t x) { return int(std::clamp<int64_t>(x - n0, 0, kBlockKeys)); };
      const int lim = rel(col1), la = rel(lo_a), ha = rel(hi_a), lb = rel(lo_b), hb = rel(hi_b);
      float* const tile_a = row_a + n0 * cs;
      float* const tile_b = row_b + n0 * cs;
#pragma unroll
      for (int j = 0; j < kBlockKeys / 8; j += 2) {
        float acc[2][kHeads][4] = {};
        if (compute) {
#pragma unroll
          for (int pp = 0; pp < 4; ++pp) {
            uint4 kf[2];
#pragma unroll
            for (int jj = 0; jj < 2; ++jj) {
              const int key = 8 * (j + jj) + g;
              kf[jj] = tile[key][swizzle(key, 4 * pp + c)];
            }
            // S = Q K^T, one m16 tile per head
#pragma unroll
            for (int jj = 0; jj < 2; ++jj)
#pragma unroll
              for (int h = 0; h < kHeads; ++h)
                mma_pair<T>(acc[jj][h], qa[h][pp], qb[h][pp], kf[jj]);
          }
        }
        // score = scale * sum_h ReLU(S_h), -inf outside the row's interval or on a missing page
#pragma unroll
        for (int jj = 0; jj < 2; ++jj) {
          const int kc = 8 * (j + jj) + 2 * c;  // column within the tile
          float v[4];
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const float sum = (relu(acc[jj][0][e]) + relu(acc[jj][1][e])) +
                              (relu(acc[jj][2][e]) + relu(acc[jj][3][e]));
            v[e] = p.scale * sum;
          }
          const bool k0 = !paged || s.key_valid[stage][kc];
          const bool k1 = !paged || s.key_valid[stage][kc + 1];
          const float ninf = -INFINITY;
          if (own_a) {
            const bool in0 = k0 && kc >= la && kc < ha, in1 = k1 && kc + 1 >= la && kc + 1 < ha;
            store_pair(tile_a + kc * cs, cs, pairs_a, kc, lim, in0 ? v[0] : ninf,
                       in1 ? v[1] : ninf);
          }
          if (own_b) {
            const bool in0 = k0 && kc >= lb && kc < hb, in1 = k1 && kc + 1 >= lb && kc + 1 < hb;
            store_pair(tile_b + kc * cs, cs, pairs_b, kc, lim, in0 ? v[2] : ninf,
                       in1 ? v[3] : ninf);
          }
        }
      }
    }
    cute::cp_async_wait<0>();
    __syncthreads();
  }
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
  constexpr int kSmem = sizeof(SharedStorage<KV>);
  SPARSE_ATTN_CUDA_CHECK(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
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
