// The paged decode kernel: R query rows (4 heads x 128 each) per request against its paged keys.
//
// Decode reads every visible key once and does 1 KFLOP per key and query row, so it is bound by
// HBM bandwidth; the kernel's job is to keep enough bytes in flight. The CTA's work items (a
// request's next kStageKeys columns) go round a ring of three 32 KB shared-memory stages, and
// stage w has its own producer warp w: per item it looks up the rows' context lengths and the
// item's page-table entries in one round trip, then moves each run of keys that shares a page
// into the stage with one bulk copy (cp.async.bulk), and the request's query rows with it. Three
// producers let three lookup chains a CTA overlap (one was too few: docs/perf-notes.md, session
// 19); two CTAs an SM keep up to 192 KB an SM in flight while eight consumer warps score the
// stages that have landed (a warp scores its tiles in series, so more warps overlap more of
// them). A CTA's items are a fixed stride apart, so producers and consumers walk the same list
// without talking.
//
// The MMA puts the keys on M (16 keys per m16 tile, each thread reading 16 bytes of a key row
// from shared memory straight into its A fragment, see mma.cuh) and (query row, head) pairs on
// N: an n8 tile holds two rows' 4 heads, so the R rows of multi-token decode share every key
// (R = 1 leaves half the columns zero; R = 3, 4 take a second n8 tile). FP8 keys: 16 bytes hold
// 16 features, widened in registers into two fragments; the K-step order (which features a
// thread's fragments hold) changes with it, and Q's fragments are read in the same order (a dot
// product does not care about the order of its terms).
//
// Columns past a row's context length (or on missing pages) are -inf; an item wholly past every
// row's only fills (and writes nothing at all in a selection, which reads only the windows).
// Keys that are not 16-byte vectors (a feature stride, misaligned rows) and strided queries are
// copied by the producer's lanes element by element instead: correct, not fast.
#pragma once

#include <cuda_runtime.h>
#include <cutlass/fast_math.h>

#include <algorithm>
#include <climits>
#include <cute/arch/copy_sm90_tma.hpp>
#include <type_traits>

#include "cuda/attention/sm90/pipeline.h"
#include "cuda/common/check.h"
#include "cuda/common/device_props.h"
#include "cuda/common/fp8.cuh"
#include "cuda/common/kernel_attributes.h"
#include "cuda/common/mma.cuh"
#include "cuda/indexer/mqa_problem.h"

namespace sparse_attn::cuda::indexer::decode {

inline constexpr int kConsumerWarps = 8;
inline constexpr int kStages = 3;
inline constexpr int kProducerWarps = kStages;  // producer warp w fills stage w
inline constexpr int kThreads = (kConsumerWarps + kProducerWarps) * 32;  // producers last
inline constexpr int kCtasPerSm = 2;
inline constexpr int kStageBytes = 32 * 1024;  // keys of one stage

template <typename T, typename KV>
struct Config {
  static constexpr bool kFp8 = sizeof(KV) == 1;
  using Stored = std::conditional_t<kFp8, uint8_t, uint16_t>;
  static constexpr int kRowBytes = kDim * int(sizeof(KV));
  static constexpr int kStageKeys = kStageBytes / kRowBytes;  // 128 (16-bit) or 256 (FP8)
  static constexpr int kWarpKeys = kStageKeys / kConsumerWarps;
  static constexpr int kTiles = kWarpKeys / 16;  // m16 key tiles a warp, per stage
  static_assert(kWarpKeys % 16 == 0, "a warp scores whole m16 tiles");
  static constexpr int kFeaturesPerLoad = 16 / int(sizeof(KV));
  static constexpr int kLoads = kDim / 4 / kFeaturesPerLoad;  // 16-byte reads a thread, per key
  static constexpr int kPagesPerLane = kStageKeys / 32;       // a stage spans <= kStageKeys pages
  // First feature of fragment j (8 features, j < 4) of quad lane c: one 16-byte read covers
  // kFeaturesPerLoad consecutive features, the four lanes of a quad neighbouring reads.
  __device__ static int feature(int j, int c) {
    return kFp8 ? 64 * (j / 2) + 16 * c + 8 * (j % 2) : 32 * j + 8 * c;
  }

  struct Stage {
    alignas(128) uint8_t keys[kStageBytes];         // keys [kStageKeys, kDim], as stored
    alignas(16) T q[kMaxDecodeRows][kHeads][kDim];  // the item's query rows
    int64_t row_limit[kMaxDecodeRows];              // columns row r sees (0 past R)
    int64_t load_limit;                             // columns any row sees
    uint8_t page_ok[kStageKeys];                    // page i of the stage (from c0 / P) exists
  };
  struct SharedStorage {
    Stage stages[kStages];
    typename sm90::TmaPipeline<kStages, kConsumerWarps, 32, 32>::SharedStorage barriers;
  };
  static constexpr int kSmemBytes = int(sizeof(SharedStorage));
  // Two CTAs an SM: 228 KB of shared memory, 1 KB of it reserved per CTA.
  static_assert(kCtasPerSm * (kSmemBytes + 1024) <= 228 * 1024, "two CTAs must fit an SM");
};

struct Layout {
  cutlass::FastDivmod page_size;
  int64_t chunks;  // items per request
  int64_t items;   // batch * chunks
  bool vec_k;      // keys are 16-byte vectors (unit feature stride, aligned rows and pages)
  bool run_k;      // ... and a page's keys are contiguous: one copy per run of keys
  bool vec_q;      // query heads are contiguous 16-byte aligned rows of 128
};

// A producer warp: fills stage `st` with item (b, c0). Every lane arrives on the stage's
// "full" barrier once, after its copies are issued and its shared-memory stores are done.
template <typename C, typename Pipeline>
__device__ void produce(const DecodeProblem& p, const Layout& l, typename C::SharedStorage& s,
                        const Pipeline& pipe, const typename Pipeline::State& st, int64_t b,
                        int64_t c0) {
  const int lane = threadIdx.x % 32;
  const int64_t c1 = min(c0 + C::kStageKeys, p.max_model_len);
  const int64_t cap = min(p.max_model_len, p.max_pages * static_cast<int64_t>(p.page_size));
  const int64_t mapped = min(c1, cap);          // columns the table can hold
  int first_page = 0, last_page = 0, slot = 0;  // columns are below 2^31
  l.page_size.fast_divmod(first_page, slot, static_cast<int>(c0));
  if (mapped > c0) l.page_size.fast_divmod(last_page, slot, static_cast<int>(mapped - 1));
  const int64_t pages_spanned = mapped > c0 ? last_page - first_page + 1 : 0;
  // One round trip: the rows' context lengths (and positions), the item's page-table entries.
  int64_t len = 0, pos = 0;
  if (lane < p.rows) {
    len = p.context_lens[b * p.context_lens_batch_stride + lane * p.context_lens_row_stride];
    if (p.windows && c0 == 0 && p.query_positions)
      pos = p.query_positions[b * p.query_positions_batch_stride +
                              lane * p.query_positions_row_stride];
  }
  const MetaPtr table = p.page_table + b * p.page_table_batch_stride;
  int64_t page[C::kPagesPerLane];
#pragma unroll
  for (int i = 0; i < C::kPagesPerLane; ++i) {
    const int64_t j = lane + 32 * i;
    page[i] = j < pages_spanned ? table[(first_page + j) * p.page_table_page_stride] : -1;
  }

  // The loads above are in flight while the stage drains.
  pipe.producer_wait(st);
  typename C::Stage& sg = s.stages[st.index()];
  int64_t load_limit = 0;
#pragma unroll
  for (int r = 0; r < kMaxDecodeRows; ++r) {
    const int64_t row_limit = r < p.rows ? min(__shfl_sync(0xffffffffu, len, r), cap) : 0;
    if (lane == 0) sg.row_limit[r] = row_limit;
    load_limit = max(load_limit, row_limit);
  }
  if (p.windows && c0 == 0 && lane < p.rows) {
    // A padding row (no visible key, or a negative position) selects nothing.
    const bool valid = len > 0 && pos >= 0;
    p.windows[b * p.rows + lane] = {
        0, valid ? int32_t(min(len, cap)) : 0,
        valid && p.query_positions ? int32_t(std::min<int64_t>(pos, INT32_MAX)) : -1, 0};
  }
  uint64_t* const full = pipe.full_barrier(st);
  if (lane == 0) sg.load_limit = load_limit;
  const int64_t loaded = min(c1, load_limit);  // columns [c0, loaded) are read
  const auto* k = static_cast<const typename C::Stored*>(p.k_cache);
  uint32_t bytes = 0;  // this lane's bulk copies
#pragma unroll
  for (int i = 0; i < C::kPagesPerLane; ++i) {
    const int64_t j = lane + 32 * i;
    const bool ok = page[i] >= 0 && page[i] < p.num_pages;
    sg.page_ok[j] = ok;
    const int64_t lo = max(c0, (first_page + j) * p.page_size);
    const int64_t hi = min(loaded, (first_page + j + 1) * p.page_size);
    if (!ok || lo >= hi || !l.vec_k) continue;
    const auto* src =
        k + page[i] * p.k_page_stride + (lo - (first_page + j) * p.page_size) * p.k_slot_stride;
    uint8_t* dst = sg.keys + (lo - c0) * C::kRowBytes;
    if (l.run_k) {
      const auto n = static_cast<int32_t>((hi - lo) * C::kRowBytes);
      cute::SM90_BULK_COPY_G2S::copy(src, full, dst, n);
      bytes += n;
    } else {
      for (int64_t key = lo; key < hi; ++key) {
        cute::SM90_BULK_COPY_G2S::copy(src + (key - lo) * p.k_slot_stride, full,
                                       dst + (key - lo) * C::kRowBytes, C::kRowBytes);
        bytes += C::kRowBytes;
      }
    }
  }
  if (loaded > c0) {
    if (!l.vec_k) {
      // Element by element: lane l copies features 4 l .. 4 l + 3 of every loaded key, page
      // by page (page j's entry is lane j % 32's page[j / 32]).
      auto* dst = reinterpret_cast<typename C::Stored*>(sg.keys);
#pragma unroll
      for (int i = 0; i < C::kPagesPerLane; ++i) {
        for (int owner = 0; owner < 32; ++owner) {
          const int64_t j = 32 * i + owner;
          const int64_t pg = __shfl_sync(0xffffffffu, page[i], owner);
          if (j >= pages_spanned || pg < 0 || pg >= p.num_pages) continue;
          const int64_t start = (first_page + j) * p.page_size;
          for (int64_t key = max(c0, start); key < min(loaded, start + p.page_size); ++key) {
            const auto* row = k + pg * p.k_page_stride + (key - start) * p.k_slot_stride;
#pragma unroll
            for (int f = 4 * lane; f < 4 * lane + 4; ++f)
              dst[(key - c0) * kDim + f] = row[f * p.k_dim_stride];
          }
        }
      }
    }
    const auto* q = static_cast<const uint16_t*>(p.q) + b * p.q_batch_stride;
    if (l.vec_q) {
      if (lane < kHeads * p.rows) {
        const int r = lane / kHeads, h = lane % kHeads;
        cute::SM90_BULK_COPY_G2S::copy(q + r * p.q_row_stride + h * p.q_head_stride, full,
                                       sg.q[r][h], kDim * 2);
        bytes += kDim * 2;
      }
    } else {
      auto* dst = reinterpret_cast<uint16_t*>(&sg.q[0][0][0]);
      for (int e = lane; e < p.rows * kHeads * kDim; e += 32) {
        const int r = e / (kHeads * kDim), h = e / kDim % kHeads, f = e % kDim;
        dst[e] = q[r * p.q_row_stride + h * p.q_head_stride + f * p.q_dim_stride];
      }
    }
  }
  cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(full, bytes);
}

// A consumer warp: scores its kWarpKeys keys of the stage for request b's rows.
template <typename T, typename KV, int kRowTiles>
__device__ void consume(const DecodeProblem& p, const Layout& l,
                        const typename Config<T, KV>::Stage& sg, int64_t b, int64_t c0) {
  using C = Config<T, KV>;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  const int64_t c1 = min(c0 + C::kStageKeys, p.max_model_len);
  const int64_t load_limit = sg.load_limit;
  if (c0 >= load_limit) {
    if (p.windows) return;
    for (int r = 0; r < p.rows; ++r) {
      float* const out = p.out + (b * p.rows + r) * p.out_row_stride;
      for (int64_t n = c0 + warp * 32 + lane; n < c1; n += kConsumerWarps * 32)
        out[n * p.out_col_stride] = -INFINITY;
    }
    return;
  }
  // B operand of tile t: column g is query row 2 t + g / 4, head g % 4 (zero past R).
  uint4 qf[kRowTiles][4] = {};
#pragma unroll
  for (int t = 0; t < kRowTiles; ++t) {
    const int row = 2 * t + g / 4;
    if (row >= p.rows) continue;
#pragma unroll
    for (int j = 0; j < 4; ++j)
      qf[t][j] = *reinterpret_cast<const uint4*>(&sg.q[row][g % 4][C::feature(j, c)]);
  }
  // This thread writes query row 2 t + c / 2 of each tile t.
  int64_t row_limit[kRowTiles];
#pragma unroll
  for (int t = 0; t < kRowTiles; ++t) row_limit[t] = sg.row_limit[min(2 * t + c / 2, 3)];
  int first_page = 0, first_slot = 0;
  l.page_size.fast_divmod(first_page, first_slot, static_cast<int>(c0));

  // Every tile's key rows are read first (the reads of a stage past its loaded keys see stale
  // bytes, whose scores are masked), so that the reads of all tiles are in flight together.
  uint4 raw[C::kTiles][2][C::kLoads];
#pragma unroll
  for (int m = 0; m < C::kTiles; ++m)
#pragma unroll
    for (int half = 0; half < 2; ++half)
#pragma unroll
      for (int i = 0; i < C::kLoads; ++i)
        raw[m][half][i] = *reinterpret_cast<const uint4*>(
            sg.keys + (warp * C::kWarpKeys + 16 * m + 8 * half + g) * C::kRowBytes +
            C::feature(i * (4 / C::kLoads), c) * int(sizeof(KV)));

#pragma unroll
  for (int m = 0; m < C::kTiles; ++m) {
    const int local = warp * C::kWarpKeys + 16 * m;
    uint4 kf[2][4];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
#pragma unroll
      for (int i = 0; i < C::kLoads; ++i) {
        if constexpr (C::kFp8) {
          fp8x16_to_natural<T>(raw[m][half][i], kf[half][2 * i], kf[half][2 * i + 1]);
        } else {
          kf[half][i] = raw[m][half][i];
        }
      }
    }
#pragma unroll
    for (int t = 0; t < kRowTiles; ++t) {
      // S^T = K Q^T: rows are keys, columns (query row, head)
      float acc[4] = {};
#pragma unroll
      for (int j = 0; j < 4; ++j) mma_pair<T>(acc, kf[0][j], kf[1][j], qf[t][j]);
      // Thread (g, c) holds heads 2c % 4, +1 of row 2t + c / 2 for keys g and g + 8.
      float s_lo = relu(acc[0]) + relu(acc[1]);
      float s_hi = relu(acc[2]) + relu(acc[3]);
      s_lo += __shfl_xor_sync(0xffffffffu, s_lo, 1);
      s_hi += __shfl_xor_sync(0xffffffffu, s_hi, 1);
      // Even quad lanes write key g, odd ones key g + 8, of their row: -inf past the row's
      // limit or on a missing page.
      const int row = 2 * t + c / 2;
      const int64_t n = c0 + local + 8 * (c % 2) + g;
      if (row < p.rows && n < c1) {
        int page_index = 0, slot = 0;
        const bool seen = n < row_limit[t];
        if (seen) l.page_size.fast_divmod(page_index, slot, static_cast<int>(n));
        p.out[(b * p.rows + row) * p.out_row_stride + n * p.out_col_stride] =
            seen && sg.page_ok[page_index - first_page] ? p.scale * (c % 2 == 0 ? s_lo : s_hi)
                                                        : -INFINITY;
      }
    }
  }
}

// kRowTiles n8 tiles of (row, head) columns: 1 for R <= 2, 2 for R <= 4. CTA x takes items
// x, x + gridDim.x, ...; item i is request i / chunks, columns from (i % chunks) * kStageKeys.
template <typename T, typename KV, int kRowTiles>
__global__ void __launch_bounds__(kThreads, kCtasPerSm)
    mqa_decode_kernel(const DecodeProblem p, const Layout l) {
  using C = Config<T, KV>;
  using Pipeline = sm90::TmaPipeline<kStages, kConsumerWarps, 32, 32>;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  auto& s = *reinterpret_cast<typename C::SharedStorage*>(smem_raw);
  // The fused selection launches its top-k as a programmatic dependent of this grid: once
  // every CTA here has started (the grid is one wave) the top-k's CTAs may be scheduled, and
  // they wait for this grid's scores in cudaGridDependencySynchronize. Otherwise a no-op.
  cudaTriggerProgrammaticLaunchCompletion();
  if (threadIdx.x == 0) Pipeline::init(s.barriers);
  cutlass::arch::fence_barrier_init();
  __syncthreads();
  const Pipeline pipe{s.barriers, 0};
  const int warp = threadIdx.x / 32;
  if (warp >= kConsumerWarps) {
    // Producer w fills stage w with the CTA's items w, w + kProducerWarps, ...: each warp's
    // lookups wait one round trip, and the warps' round trips overlap.
    static_assert(kProducerWarps == kStages, "producer w owns stage w");
    const int w = warp - kConsumerWarps;
    typename Pipeline::State st(w, 1, w);  // starts a phase ahead: every stage is free
    for (int64_t i = blockIdx.x + int64_t(w) * gridDim.x; i < l.items;
         i += int64_t(kProducerWarps) * gridDim.x, st += kProducerWarps)
      produce<C>(p, l, s, pipe, st, i / l.chunks, i % l.chunks * C::kStageKeys);
  } else {
    typename Pipeline::State st{};
    for (int64_t i = blockIdx.x; i < l.items; i += gridDim.x, ++st) {
      pipe.consumer_wait(st);
      consume<T, KV, kRowTiles>(p, l, s.stages[st.index()], i / l.chunks,
                                i % l.chunks * C::kStageKeys);
      __syncwarp();
      pipe.consumer_release(st);
    }
  }
}

}  // namespace sparse_attn::cuda::indexer::decode

namespace sparse_attn::cuda::indexer {

namespace decode {

template <typename T, typename KV, int kRowTiles>
void launch(const DecodeProblem& p, const Layout& l, cudaStream_t stream) {
  constexpr int kSmem = Config<T, KV>::kSmemBytes;
  opt_in_shared_memory<mqa_decode_kernel<T, KV, kRowTiles>>(kSmem, /*prefer_max_shared=*/true);
  int device = 0;
  SPARSE_ATTN_CUDA_CHECK(cudaGetDevice(&device));
  const int64_t ctas = std::min<int64_t>(l.items, int64_t{sm_count(device)} * kCtasPerSm);
  mqa_decode_kernel<T, KV, kRowTiles><<<unsigned(ctas), kThreads, kSmem, stream>>>(p, l);
  SPARSE_ATTN_CUDA_CHECK_LAUNCH();
}

}  // namespace decode

template <typename T, typename KV>
void launch_mqa_decode(const DecodeProblem& p, cudaStream_t stream) {
  using namespace decode;
  using C = Config<T, KV>;
  if (p.batch == 0 || (p.max_model_len == 0 && !p.windows)) return;
  Layout l{};
  l.page_size = cutlass::FastDivmod(p.page_size);
  // A selection's chunk runs with no column too: its windows are still needed.
  l.chunks = std::max<int64_t>(1, (p.max_model_len + C::kStageKeys - 1) / C::kStageKeys);
  l.items = l.chunks * p.batch;
  // Bulk copies need 16-byte aligned sources and sizes.
  constexpr int64_t kPerVector = 16 / sizeof(KV);
  l.vec_k = p.k_dim_stride == 1 && reinterpret_cast<uintptr_t>(p.k_cache) % 16 == 0 &&
            (p.k_page_stride % kPerVector == 0 || p.num_pages <= 1) &&
            p.k_slot_stride % kPerVector == 0;
  l.run_k = l.vec_k && p.k_slot_stride == kDim;
  l.vec_q = p.q_dim_stride == 1 && reinterpret_cast<uintptr_t>(p.q) % 16 == 0 &&
            p.q_batch_stride % 8 == 0 && p.q_row_stride % 8 == 0 && p.q_head_stride % 8 == 0;
  if (p.rows <= 2) {
    launch<T, KV, 1>(p, l, stream);
  } else {
    launch<T, KV, kMaxDecodeRows / 2>(p, l, stream);
  }
}

}  // namespace sparse_attn::cuda::indexer
