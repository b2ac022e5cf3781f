// The LSE merge of partial attention results over disjoint key sets, for one (row, head), by a
// whole CTA: the one implementation behind the SplitKV merge (sparse_attention_kernel.cuh) and
// merge_attention_states (merge_native.cu). The math is docs/merge.md's:
//   m = max_i lse_i, w_i = 2^(lse_i - m), out = sum_i w_i o_i / sum_i w_i, lse = m + log2 sum_i w_i
// in the log2 domain, summed in partial order (bitwise the same on every run).
#pragma once

#include <cuda_runtime.h>

#include <cmath>

namespace sparse_attn::cuda {

// Shared memory of one merge: the weights of a chunk of kThreads partials, the warps' maxima.
template <int kThreads>
struct LseMergeSmem {
  float weight[kThreads];
  float warp_max[kThreads / 32];
};

// n partials; lse2(i): partial i's log2-domain LSE (-inf: it saw no key, and its features are
// not read); part(i, d): its feature d. Thread t merges features d0 + t + j kThreads, j <
// kPerThread, below `dim` (the others of out[] are left 0). Returns the merged log2 LSE, -inf
// when no partial saw a key (out all 0), NaN when an LSE is NaN or +inf (out NaN). Loads of
// kUnroll partials are issued together, so a thread keeps that many in flight.
template <int kThreads, int kPerThread, class Lse2, class Part>
__device__ inline float merge_lse_partials(int n, int d0, int dim, const Lse2& lse2,
                                           const Part& part, float (&out)[kPerThread],
                                           LseMergeSmem<kThreads>& sm) {
  constexpr int kUnroll = 16;
  const int t = threadIdx.x;
  // The maximum over the partials (exact in any order); NaN wins, so a NaN LSE is not lost.
  const auto max_nan = [](float a, float b) { return a != a || b != b ? NAN : fmaxf(a, b); };
  float m = -INFINITY;
  for (int s = t; s < n; s += kThreads) m = max_nan(m, lse2(s));
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) m = max_nan(m, __shfl_xor_sync(0xffffffffu, m, off));
  if (t % 32 == 0) sm.warp_max[t / 32] = m;
  __syncthreads();
  m = sm.warp_max[0];
#pragma unroll
  for (int w = 1; w < kThreads / 32; ++w) m = max_nan(m, sm.warp_max[w]);
  __syncthreads();  // warp_max is read before a later merge by this CTA writes it

#pragma unroll
  for (int j = 0; j < kPerThread; ++j) out[j] = 0.f;
  if (m != m || m == INFINITY) {  // uniform over the CTA
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) out[j] = NAN;
    return NAN;
  }
  if (m == -INFINITY) return -INFINITY;
  float l = 0.f;
  for (int s0 = 0; s0 < n; s0 += kThreads) {
    const int count = min(kThreads, n - s0);
    // A partial with LSE -inf has weight 0, and its features (which may be unwritten) are
    // skipped rather than multiplied by 0.
    if (t < count) sm.weight[t] = exp2f(lse2(s0 + t) - m);
    __syncthreads();
    for (int i0 = 0; i0 < count; i0 += kUnroll) {
      float pv[kUnroll][kPerThread];
#pragma unroll
      for (int i = 0; i < kUnroll; ++i) {
        const bool live = i0 + i < count && sm.weight[i0 + i] > 0.f;
#pragma unroll
        for (int j = 0; j < kPerThread; ++j) {
          const int d = d0 + t + j * kThreads;
          pv[i][j] = live && d < dim ? part(s0 + i0 + i, d) : 0.f;
        }
      }
#pragma unroll
      for (int i = 0; i < kUnroll; ++i) {
        if (i0 + i < count) {
          const float w = sm.weight[i0 + i];
          l += w;
          if (w > 0.f) {
#pragma unroll
            for (int j = 0; j < kPerThread; ++j) out[j] += w * pv[i][j];
          }
        }
      }
    }
    __syncthreads();  // every thread has read this chunk's weights
  }
#pragma unroll
  for (int j = 0; j < kPerThread; ++j) out[j] /= l;
  return m + log2f(l);
}

}  // namespace sparse_attn::cuda
