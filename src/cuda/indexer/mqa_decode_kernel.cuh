// The paged decode kernel: R query rows (4 heads x 128 each) per request against its paged keys.
//
// Decode reads every visible key once and does 1 KFLOP per key and query row, so it is bound by
// HBM bandwidth; the kernel's job is to keep many 16-byte loads in flight. The MMA puts the
// keys on M (16 keys per m16 tile, read by each thread straight from global memory into the
// A fragment, see mma.cuh) and (query row, head) pairs on N: an n8 tile holds two rows' 4
// heads, so the R rows of multi-token decode share every key load (R = 1 leaves half the
// columns zero; R = 3, 4 take a second n8 tile). The tensor cores are far from busy either way;
// no shared memory or synchronisation is involved.
//
// FP8 keys: a 16-byte load holds 16 features, widened in registers into two fragments; the
// K-step order (which features a thread's fragments hold) changes with it, and Q's fragments
// are loaded in the same order (a dot product does not care about the order of its terms).
//
// A CTA covers 256 columns of one request (4 warps x 64 keys); columns past a row's context
// length (or on missing pages) are -inf, and a CTA wholly past every row's only fills. 4 warps
// x 2 iterations of 2 tiles is the fastest of three 16-bit versions measured on the H200
// (docs/perf-notes.md): 8 warps x 1 iteration, and a per-warp cp.async ring in shared memory,
// were both slower. FP8 loads 4 tiles in one iteration: the same bytes in flight.
#pragma once

#include <cuda_runtime.h>
#include <cutlass/fast_math.h>

#include <algorithm>
#include <climits>
#include <type_traits>

#include "cuda/common/check.h"
#include "cuda/common/fp8.cuh"
#include "cuda/common/mma.cuh"
#include "cuda/indexer/mqa_problem.h"

namespace sparse_attn::cuda::indexer::decode {

inline constexpr int kWarps = 4;
inline constexpr int kThreads = kWarps * 32;
inline constexpr int kKeysPerCta = 256;

template <typename KV>
struct KeyLoads {
  static constexpr bool kFp8 = sizeof(KV) == 1;
  static constexpr int kFeaturesPerLoad = 16 / sizeof(KV);
  static constexpr int kLoads = kDim / 4 / kFeaturesPerLoad;  // 16-byte loads a thread, per key
  static constexpr int kTilesPerIter = kFp8 ? 4 : 2;          // m16 key tiles loaded together
  static constexpr int kIters = kKeysPerCta / (kWarps * 16 * kTilesPerIter);
  // First feature of fragment j (8 features, j < 4) of quad lane c: one load covers
  // kFeaturesPerLoad consecutive features, the four lanes of a quad neighbouring loads.
  __device__ static int feature(int j, int c) {
    return kFp8 ? 64 * (j / 2) + 16 * c + 8 * (j % 2) : 32 * j + 8 * c;
  }
};

// 16 bytes of a row starting at feature f as one fragment's worth of raw storage. `vec`: the
// row is 16-byte aligned with unit stride (one load); otherwise element by element (broadcast
// or odd strides).
template <typename E>
__device__ __forceinline__ uint4 load16(const E* row, int64_t f, int64_t stride, bool vec) {
  if (vec) return __ldg(reinterpret_cast<const uint4*>(row + f));
  constexpr int kPerWord = 4 / sizeof(E);
  uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    w[i] = 0;
#pragma unroll
    for (int e = 0; e < kPerWord; ++e) {
      const uint32_t bits = __ldg(row + (f + kPerWord * i + e) * stride);
      w[i] |= bits << (8 * sizeof(E) * e);
    }
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// kRowTiles n8 tiles of (row, head) columns: 1 for R <= 2, 2 for R <= 4.
template <typename T, typename KV, int kRowTiles>
__global__ void __launch_bounds__(kThreads)
    mqa_decode_kernel(const DecodeProblem p, cutlass::FastDivmod page_size, int64_t chunks,
                      bool vec_k) {
  using L = KeyLoads<KV>;
  using Stored = std::conditional_t<L::kFp8, uint8_t, uint16_t>;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, c = lane % 4;
  const int64_t b = blockIdx.x / chunks;
  const int64_t c0 = (blockIdx.x % chunks) * kKeysPerCta;
  const int64_t c1 = min(c0 + kKeysPerCta, p.max_model_len);
  // Row r's columns >= its limit are -inf: past its context, the output, or the page table.
  const int64_t cap = min(p.max_model_len, p.max_pages * static_cast<int64_t>(p.page_size));
  int64_t load_limit = 0;  // keys any row sees
  for (int r = 0; r < p.rows; ++r) {
    const int64_t len =
        p.context_lens[b * p.context_lens_batch_stride + r * p.context_lens_row_stride];
    load_limit = max(load_limit, min(len, cap));
  }
  if (p.windows && c0 == 0 && tid < p.rows) {
    const int64_t len = p.context_lens[b * p.context_lens_batch_stride +
                                       tid * p.context_lens_row_stride];
    const int64_t pos = p.query_positions ? p.query_positions[b * p.query_positions_batch_stride +
                                                              tid * p.query_positions_row_stride]
                                          : 0;
    // A padding row (no visible key, or a negative position) selects nothing.
    const bool valid = len > 0 && pos >= 0;
    p.windows[b * p.rows + tid] = {0, valid ? int32_t(min(len, cap)) : 0,
                                   valid && p.query_positions
                                       ? int32_t(std::min<int64_t>(pos, INT32_MAX))
                                       : -1,
                                   0};
  }
  if (c0 >= load_limit) {
    if (p.windows) return;  // a selection reads no column past the rows' windows
    for (int r = 0; r < p.rows; ++r) {
      float* const out = p.out + (b * p.rows + r) * p.out_row_stride;
      for (int64_t i = c0 + tid; i < c1; i += kThreads) out[i * p.out_col_stride] = -INFINITY;
    }
    return;
  }

  // B operand of tile t: column g is query row 2 t + g / 4, head g % 4 (zero past R).
  uint4 qf[kRowTiles][4] = {};
#pragma unroll
  for (int t = 0; t < kRowTiles; ++t) {
    const int row = 2 * t + g / 4;
    if (row >= p.rows) continue;
    const auto* q = static_cast<const uint16_t*>(p.q) + b * p.q_batch_stride +
                    row * p.q_row_stride + (g % 4) * p.q_head_stride;
#pragma unroll
    for (int j = 0; j < 4; ++j) qf[t][j] = load16(q, L::feature(j, c), p.q_dim_stride, false);
  }
  // This thread writes query row 2 t + c / 2 of each tile t: its limit.
  int64_t row_limit[kRowTiles];
#pragma unroll
  for (int t = 0; t < kRowTiles; ++t) {
    const int row = 2 * t + c / 2;
    row_limit[t] =
        row < p.rows
            ? min(p.context_lens[b * p.context_lens_batch_stride + row * p.context_lens_row_stride],
                  cap)
            : 0;
  }

  const auto* k = static_cast<const Stored*>(p.k_cache);
  const MetaPtr pages = p.page_table + b * p.page_table_batch_stride;
#pragma unroll
  for (int it = 0; it < L::kIters; ++it) {
    const int64_t base = c0 + (int64_t(it) * kWarps + warp) * 16 * L::kTilesPerIter;
    // A operand: keys base + 16 m + g (lo) and + 8 (hi) of each tile m, as stored.
    uint4 raw[L::kTilesPerIter][2][L::kLoads];
    bool valid[L::kTilesPerIter][2];
#pragma unroll
    for (int m = 0; m < L::kTilesPerIter; ++m) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int64_t n = base + 16 * m + 8 * half + g;
        bool ok = n < load_limit;
        const Stored* row = k;
        if (ok) {
          int page_index, slot;
          page_size.fast_divmod(page_index, slot, static_cast<int>(n));
          const int64_t page = pages[page_index * p.page_table_page_stride];
          ok = page >= 0 && page < p.num_pages;
          row = k + page * p.k_page_stride + slot * p.k_slot_stride;
        }
        valid[m][half] = ok;
#pragma unroll
        for (int l = 0; l < L::kLoads; ++l) {
          raw[m][half][l] =
              ok ? load16(row, L::feature(l * (4 / L::kLoads), c), p.k_dim_stride, vec_k) : uint4{};
        }
      }
    }
#pragma unroll
    for (int m = 0; m < L::kTilesPerIter; ++m) {
      uint4 kf[2][4];
#pragma unroll
      for (int half = 0; half < 2; ++half) {
#pragma unroll
        for (int l = 0; l < L::kLoads; ++l) {
          if constexpr (L::kFp8) {
            fp8x16_to_natural<T>(raw[m][half][l], kf[half][2 * l], kf[half][2 * l + 1]);
          } else {
            kf[half][l] = raw[m][half][l];
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
        // Even quad lanes write key g, odd ones key g + 8, of their row.
        const int row = 2 * t + c / 2, half = c % 2;
        const int64_t n = base + 16 * m + 8 * half + g;
        if (row < p.rows && n < c1) {
          const bool ok = valid[m][half] && n < row_limit[t];
          p.out[(b * p.rows + row) * p.out_row_stride + n * p.out_col_stride] =
              ok ? p.scale * (half == 0 ? s_lo : s_hi) : -INFINITY;
        }
      }
    }
  }
}

}  // namespace sparse_attn::cuda::indexer::decode

namespace sparse_attn::cuda::indexer {

template <typename T, typename KV>
void launch_mqa_decode(const DecodeProblem& p, cudaStream_t stream) {
  using namespace decode;
  if (p.batch == 0 || (p.max_model_len == 0 && !p.windows)) return;
  // A selection's chunk runs with no column too: its windows are still needed.
  const int64_t chunks = std::max<int64_t>(1, (p.max_model_len + kKeysPerCta - 1) / kKeysPerCta);
  if (chunks * p.batch > INT_MAX) throw Error("qsa_mqa_decode: batch x max_model_len too large");
  // Vector key loads need unit feature stride and 16-byte aligned rows.
  constexpr int64_t kPerVector = 16 / sizeof(KV);
  const bool vec_k = p.k_dim_stride == 1 && reinterpret_cast<uintptr_t>(p.k_cache) % 16 == 0 &&
                     (p.k_page_stride % kPerVector == 0 || p.num_pages <= 1) &&
                     p.k_slot_stride % kPerVector == 0;
  const auto kernel =
      p.rows <= 2 ? mqa_decode_kernel<T, KV, 1> : mqa_decode_kernel<T, KV, kMaxDecodeRows / 2>;
  kernel<<<unsigned(chunks * p.batch), kThreads, 0, stream>>>(p, cutlass::FastDivmod(p.page_size),
                                                              chunks, vec_k);
  SPARSE_ATTN_CUDA_CHECK_LAUNCH();
}

}  // namespace sparse_attn::cuda::indexer
