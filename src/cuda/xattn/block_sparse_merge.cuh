// The SplitKV merge of native block-sparse attention: for each row and head, the splits'
// FP32 partials (each normalised by its own sum, with its natural-log LSE) combined as
//   lse = log(sum_s exp(lse_s)),  out = sum_s exp(lse_s - lse) * o_s
// in split order (deterministic); a row no split saw a key of gets 0 and -inf. The rows and
// their addresses come from the forward kernel's Problem, so the merge writes exactly the rows
// the unsplit kernel would.
#pragma once

#include <cute/numeric/numeric_types.hpp>

#include "cuda/xattn/block_sparse_fwd.h"
#include "cuda/xattn/block_sparse_problem.cuh"

namespace sparse_attn::cuda {

constexpr int kMergeRowsPerWarp = 4;  // a CTA: 4 warps, 16 rows of one work tile
constexpr int kMergeRowsPerCta = 4 * kMergeRowsPerWarp;

// Grid: (work tiles, 128 / kMergeRowsPerCta); 128 threads.
template <class Traits>
__global__ void __launch_bounds__(128)
    block_sparse_merge_kernel(const __grid_constant__ BlockSparseFwdParams p) {
  using Element = typename Traits::Element;
  constexpr int D = Traits::kHeadDim;
  const BlockSparseProblem<Traits> prob(p, static_cast<int>(blockIdx.x) * p.splits);
  if (!prob.has_rows()) return;
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int row0 = static_cast<int>(blockIdx.y) * kMergeRowsPerCta +
                   static_cast<int>(threadIdx.x / 32) * kMergeRowsPerWarp;
  for (int row = row0; row < row0 + kMergeRowsPerWarp; ++row) {
    if (!prob.row_in_range(row)) break;  // rows past the sequence's end are all at the end
    const float lse_a = lane < p.splits ? p.lse_partial[prob.partial_slot(lane, row)] : -INFINITY;
    const float lse_b =
        lane + 32 < p.splits ? p.lse_partial[prob.partial_slot(lane + 32, row)] : -INFINITY;
    float m = fmaxf(lse_a, lse_b);
    for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
    // m == -inf: no split saw a key; every weight is then exp(-inf - 0) = 0.
    const float m_use = m == -INFINITY ? 0.f : m;
    const float w_a = expf(lse_a - m_use), w_b = expf(lse_b - m_use);
    float total = w_a + w_b;
    for (int off = 16; off > 0; off >>= 1) total += __shfl_xor_sync(0xffffffffu, total, off);
    const float inv = total > 0.f ? 1.f / total : 0.f;
    // Lane g writes features [8 g, 8 g + 8) of the row (D / 8 <= 32 groups).
    const int g = lane;
    float acc[8] = {};
    for (int s = 0; s < p.splits; ++s) {
      const float w = __shfl_sync(0xffffffffu, s < 32 ? w_a : w_b, s % 32);
      if (8 * g < D && w > 0.f) {
        const float4* src =
            reinterpret_cast<const float4*>(p.o_partial + prob.partial_slot(s, row) * D + 8 * g);
        const float4 x = src[0], y = src[1];
        acc[0] += w * x.x, acc[1] += w * x.y, acc[2] += w * x.z, acc[3] += w * x.w;
        acc[4] += w * y.x, acc[5] += w * y.y, acc[6] += w * y.z, acc[7] += w * y.w;
      }
    }
    if (8 * g < D) {
      uint4 packed;
      Element* e = reinterpret_cast<Element*>(&packed);
      for (int i = 0; i < 8; ++i) e[i] = Element(acc[i] * inv);
      prob.store_o(row, 8 * g, packed);
    }
    if (lane == 0) prob.store_lse(row, total > 0.f ? m + logf(total) : -INFINITY);
  }
}

}  // namespace sparse_attn::cuda
