// The LSE merge of partial attention results over disjoint key sets, for one (row, head): by a
// whole CTA (merge_lse_partials: the SplitKV merge kernel of sparse_attention_kernel.cuh and
// merge_attention_states in merge_native.cu) or by one thread over a few partials
// (merge_lse_thread: the gather kernel's cluster merge). The math is docs/merge.md's:
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

// The same merge by one thread over at most kMaxParts partials (n of them) of kPer features
// each: the partials of a SplitKV cluster read from its CTAs' shared memory
// (qsa_gather_kernel.cuh). Every partial's LSE load is issued before any is used, then the features
// of kUnroll partials at a time, so a thread keeps that many in flight. Same rules and order as
// merge_lse_partials.
template <int kMaxParts, int kPer, int kUnroll, class Lse2, class Part>
__device__ inline float merge_lse_thread(int n, const Lse2& lse2, const Part& part,
                                         float (&out)[kPer]) {
  static_assert(kMaxParts % kUnroll == 0);
  float w[kMaxParts];
#pragma unroll
  for (int s = 0; s < kMaxParts; ++s) w[s] = s < n ? lse2(s) : -INFINITY;
  float m = -INFINITY;
#pragma unroll
  for (int s = 0; s < kMaxParts; ++s) m = w[s] != w[s] || m != m ? NAN : fmaxf(m, w[s]);
#pragma unroll
  for (int j = 0; j < kPer; ++j) out[j] = 0.f;
  if (m != m || m == INFINITY) {
#pragma unroll
    for (int j = 0; j < kPer; ++j) out[j] = NAN;
    return NAN;
  }
  if (m == -INFINITY) return -INFINITY;
#pragma unroll
  for (int s = 0; s < kMaxParts; ++s) w[s] = exp2f(w[s] - m);  // 0 past n (LSE -inf)
  float l = 0.f;
#pragma unroll
  for (int s0 = 0; s0 < kMaxParts; s0 += kUnroll) {
    if (s0 >= n) break;
    float pv[kUnroll][kPer];
#pragma unroll
    for (int i = 0; i < kUnroll; ++i) {
      if (w[s0 + i] > 0.f) part(s0 + i, pv[i]);
    }
#pragma unroll
    for (int i = 0; i < kUnroll; ++i) {
      l += w[s0 + i];
      if (w[s0 + i] > 0.f) {
#pragma unroll
        for (int j = 0; j < kPer; ++j) out[j] += w[s0 + i] * pv[i][j];
      }
    }
  }
#pragma unroll
  for (int j = 0; j < kPer; ++j) out[j] /= l;
  return m + log2f(l);
}

}  // namespace sparse_attn::cuda
