// The paged decode kernel: one query (4 heads x 128) per request against its paged keys.
//
// Decode reads every visible key once and does 1 KFLOP per 256-byte key, so it is bound by
// HBM bandwidth; the kernel's job is to keep many 16-byte loads in flight. The MMA puts the
// keys on M (16 keys per m16 tile, read by each thread straight from global memory into the
// A fragment, see mma.cuh) and the 4 heads on N (n8, the other 4 columns zero), so the
// tensor cores do the dot products at 50% column occupancy, far above what the bandwidth needs,
// and no shared memory or synchronisation is involved.
//
// A CTA covers 256 columns of one request (4 warps x 2 iterations x 32 keys); columns past
// the context length (or on missing pages) are -inf, and a CTA wholly past it only fills.
// This is the fastest of three versions measured on the H200 (docs/perf-notes.md): 8 warps x
// 1 iteration, and a per-warp cp.async ring in shared memory, were both slower.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <climits>

#include "cuda/common/check.h"
#include "cuda/common/mma.cuh"
#include "cuda/indexer/mqa_problem.h"

namespace sparse_attn::cuda::indexer::decode {

inline constexpr int kWarps = 4;
inline constexpr int kThreads = kWarps * 32;
inline constexpr int kTilesPerIter = 2;  // m16 key tiles loaded together (more bytes in flight)
inline constexpr int kIters = 2;
inline constexpr int kKeysPerWarp = 16 * kTilesPerIter * kIters;
inline constexpr int kKeysPerCta = kWarps * kKeysPerWarp;  // 256

// 8 features [f, f + 8) of a 16-bit row as one 16-byte fragment. `vec`: the row is 16-byte
// aligned with unit stride (one load); otherwise element by element (broadcast or odd strides).
__device__ __forceinline__ uint4 load8(const uint16_t* row, int64_t f, int64_t stride, bool vec) {
  if (vec) return __ldg(reinterpret_cast<const uint4*>(row + f));
  uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint32_t lo = __ldg(row + (f + 2 * i) * stride);
    const uint32_t hi = __ldg(row + (f + 2 * i + 1) * stride);
    w[i] = lo | (hi << 16);
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    mqa_decode_kernel(const DecodeProblem p, int64_t chunks, bool vec_k) {
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, c = lane % 4;
  const int64_t b = blockIdx.x / chunks;
  const int64_t c0 = (blockIdx.x % chunks) * kKeysPerCta;
  const int64_t c1 = min(c0 + kKeysPerCta, p.max_model_len);
  float* const out = p.out + b * p.out_batch_stride;
  // Columns >= limit are -inf: past the context, the output, or the page table.
  const int64_t limit =
      min(std::min<int64_t>(p.context_lens[b * p.context_lens_stride], p.max_model_len),
          p.max_pages << p.page_size_log2);
  if (c0 >= limit) {
    for (int64_t i = c0 + tid; i < c1; i += kThreads) out[i * p.out_col_stride] = -INFINITY;
    return;
  }

  // B operand: Q of head g (lanes of groups 4..7 hold the zero padding of n8).
  uint4 qf[4] = {};
  if (g < kHeads) {
    const auto* q = static_cast<const uint16_t*>(p.q) + b * p.q_batch_stride + g * p.q_head_stride;
#pragma unroll
    for (int pp = 0; pp < 4; ++pp) qf[pp] = load8(q, 32 * pp + 8 * c, p.q_dim_stride, false);
  }

  const auto* k = static_cast<const uint16_t*>(p.k_cache);
  const MetaPtr pages = p.page_table + b * p.page_table_batch_stride;
  const int64_t slot_mask = (int64_t(1) << p.page_size_log2) - 1;
#pragma unroll
  for (int it = 0; it < kIters; ++it) {
    const int64_t base = c0 + (int64_t(it) * kWarps + warp) * 16 * kTilesPerIter;
    // A operand: keys base + 16 m + g (lo) and + 8 (hi) of each tile m.
    uint4 kf[kTilesPerIter][2][4];
    bool valid[kTilesPerIter][2];
#pragma unroll
    for (int m = 0; m < kTilesPerIter; ++m) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int64_t n = base + 16 * m + 8 * half + g;
        bool ok = n < limit;
        const uint16_t* row = k;
        if (ok) {
          const int64_t page = pages[(n >> p.page_size_log2) * p.page_table_page_stride];
          ok = page >= 0 && page < p.num_pages;
          row = k + page * p.k_page_stride + (n & slot_mask) * p.k_slot_stride;
        }
        valid[m][half] = ok;
#pragma unroll
        for (int pp = 0; pp < 4; ++pp)
          kf[m][half][pp] = ok ? load8(row, 32 * pp + 8 * c, p.k_dim_stride, vec_k) : uint4{};
      }
    }
#pragma unroll
    for (int m = 0; m < kTilesPerIter; ++m) {
      // S^T = K Q^T: rows are keys, columns heads
      float acc[4] = {};
#pragma unroll
      for (int pp = 0; pp < 4; ++pp) mma_pair<T>(acc, kf[m][0][pp], kf[m][1][pp], qf[pp]);
      // Thread (g, c) holds heads 2c, 2c+1 of keys g and g+8; heads 4..7 are the zero padding.
      float s_lo = relu(acc[0]) + relu(acc[1]);
      float s_hi = relu(acc[2]) + relu(acc[3]);
      s_lo += __shfl_xor_sync(0xffffffffu, s_lo, 1);
      s_hi += __shfl_xor_sync(0xffffffffu, s_hi, 1);
      // Quad lane 0 writes key g, quad lane 1 key g + 8.
      if (c < 2) {
        const int64_t n = base + 16 * m + 8 * c + g;
        const bool ok = valid[m][c];
        if (n < c1) out[n * p.out_col_stride] = ok ? p.scale * (c == 0 ? s_lo : s_hi) : -INFINITY;
      }
    }
  }
}

}  // namespace sparse_attn::cuda::indexer::decode

namespace sparse_attn::cuda::indexer {

template <typename T>
void launch_mqa_decode(const DecodeProblem& p, cudaStream_t stream) {
  using namespace decode;
  if (p.batch == 0 || p.max_model_len == 0) return;
  const int64_t chunks = (p.max_model_len + kKeysPerCta - 1) / kKeysPerCta;
  if (chunks * p.batch > INT_MAX) throw Error("qsa_mqa_decode: batch x max_model_len too large");
  // Vector key loads need unit feature stride and 16-byte aligned rows.
  const bool vec_k = p.k_dim_stride == 1 && reinterpret_cast<uintptr_t>(p.k_cache) % 16 == 0 &&
                     (p.k_page_stride % 8 == 0 || p.num_pages <= 1) && p.k_slot_stride % 8 == 0;
  mqa_decode_kernel<T><<<unsigned(chunks * p.batch), kThreads, 0, stream>>>(p, chunks, vec_k);
  SPARSE_ATTN_CUDA_CHECK_LAUNCH();
}

}  // namespace sparse_attn::cuda::indexer
