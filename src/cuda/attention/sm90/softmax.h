// The online softmax of the SM90 attention consumers (one instance per thread, for the rows its
// accumulator fragments hold). Scores are scaled into log2 units once (exp2 instead of exp);
// a row whose scores are all -inf so far keeps a -inf maximum and contributes zero weights,
// never NaN. Sums are kept per thread and reduced over the row's four threads only at the end.
//
// The maximum a row's weights are taken relative to is allowed to go stale: it moves only when
// a tile's scores exceed it by more than kStaleLog2 (log2 units), so weights stay below
// 2^kStaleLog2 = 256 (no overflow in FP32 sums or in the 16-bit P, whose relative precision does
// not depend on magnitude) and the output and the LSE, which use the same maximum for the sum
// and the numerator, are unchanged as math. A warp whose rows all kept their maximum skips the
// O rescale, which is most tiles of a long row (docs/perf-notes.md, session 7).
#pragma once

#include <cutlass/arch/barrier.h>

#include <cute/tensor.hpp>

#include "cuda/attention/sm90/mma.h"

namespace sparse_attn::cuda::sm90 {

// 2^x by the SFU alone: flush-to-zero drops exp2f's denormal-range fix-up (a compare and two
// multiplies a score); weights below 2^-126 are 0 at the output's precision anyway.
__device__ __forceinline__ float exp2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// The stale-maximum rule for one row (or column) of weights: `max` (scaled log2 units) moves to
// the tile's maximum `tile_max` only when that exceeds it by more than kStaleLog2. Returns the
// factor earlier weights and partial outputs take; `m_use` is what this tile's scores are
// taken relative to.
inline constexpr float kStaleLog2 = 8.f;
__device__ __forceinline__ float move_max(float& max, float tile_max, float& m_use) {
  const float m_new = fmaxf(max, tile_max);
  // -inf + 8 is -inf: a row's first finite maximum always moves it.
  const float m = m_new > max + kStaleLog2 ? m_new : max;
  // -inf - -inf would be NaN: a row with nothing visible yet subtracts 0 (its weights are 0).
  m_use = m == -INFINITY ? 0.f : m;
  const float rescale = exp2_ftz(max - m_use);
  max = m;
  return rescale;
}

// The end of a row: `inv_sum` normalises the output (0 for a row that saw no key) and `lse` is
// the natural-log LSE of the scaled scores (-inf for such a row), from the row's maximum and
// its whole weight sum.
__device__ __forceinline__ void finish(float max, float sum, float& inv_sum, float& lse) {
  const bool empty = sum == 0.f;
  inv_sum = empty ? 0.f : 1.f / sum;
  lse = empty ? -INFINITY : (max + log2f(sum)) * 0.69314718055994531f;
}

template <int kRows>
struct OnlineSoftmax {
  float row_max[kRows];  // in scaled log2 units
  float row_sum[kRows];  // this thread's columns only
  float scale_log2;      // softmax_scale * log2(e)

  __device__ explicit OnlineSoftmax(float scale_log2_) : scale_log2(scale_log2_) {
    CUTE_UNROLL
    for (int i = 0; i < kRows; ++i) {
      row_max[i] = -INFINITY;
      row_sum[i] = 0.f;
    }
  }

  // Max over the four threads that share a row of the accumulator.
  __device__ static float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffff, x, 2));
  }
  __device__ static float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffff, x, 1);
    return x + __shfl_xor_sync(0xffffffff, x, 2);
  }

  // One tile of scores (an accumulator fragment): moves the row maxima, turns the scores into
  // unnormalised weights exp2(s * scale_log2 - max) in place, adds them to the sums, and
  // returns in `rescale` the factor by which earlier partial outputs must be multiplied. The
  // maximum is taken over the raw scores (scale_log2 > 0 keeps the order) and scaled once, so
  // a score costs a max, one fused multiply-add, the exponential and an add. The max and the
  // sum of a row run as kChains independent chains: while a warpgroup is in its softmax the
  // other one is issuing GEMMs, so a scheduler has little else to hide a serial chain behind.
  // `after_first_row(sum)` runs once row 0's weights and their sum (this thread's) are done.
  template <class Fragment, class AfterFirstRow>
  __device__ void update(Fragment& s, float (&rescale)[kRows], AfterFirstRow&& after_first_row) {
    auto rc = cute::make_tensor(s.data(), accumulator_rows_cols(s.layout()));
    constexpr int kCols = decltype(cute::size<1>(rc))::value;
    constexpr int kChains = kCols % 4 == 0 ? 4 : 1;
    static_assert(decltype(cute::size<0>(rc))::value == kRows);
    CUTE_UNROLL
    for (int i = 0; i < kRows; ++i) {
      float part[kChains];
      CUTE_UNROLL
      for (int c = 0; c < kChains; ++c) part[c] = -INFINITY;
      CUTE_UNROLL
      for (int j = 0; j < kCols; ++j) part[j % kChains] = fmaxf(part[j % kChains], rc(i, j));
      float raw = part[0];
      CUTE_UNROLL
      for (int c = 1; c < kChains; ++c) raw = fmaxf(raw, part[c]);
      float m_use;
      rescale[i] = move_max(row_max[i], quad_max(raw) * scale_log2, m_use);
      CUTE_UNROLL
      for (int c = 0; c < kChains; ++c) part[c] = 0.f;
      CUTE_UNROLL
      for (int j = 0; j < kCols; ++j) {
        rc(i, j) = exp2_ftz(fmaf(rc(i, j), scale_log2, -m_use));
        part[j % kChains] += rc(i, j);
      }
      float sum = part[0];
      CUTE_UNROLL
      for (int c = 1; c < kChains; ++c) sum += part[c];
      row_sum[i] = row_sum[i] * rescale[i] + sum;
      if (i == 0) after_first_row(sum);
    }
  }

  // Whether any row of this warp's fragments must be rescaled (a factor other than 1).
  __device__ static bool any_moved(const float (&factor)[kRows]) {
    bool moved = false;
    CUTE_UNROLL
    for (int i = 0; i < kRows; ++i) moved = moved || factor[i] != 1.f;
    return __any_sync(0xffffffff, moved);
  }

  // Multiplies each row of an output accumulator fragment by its factor.
  template <class Fragment>
  __device__ static void scale_rows(Fragment& o, const float (&factor)[kRows]) {
    auto rc = cute::make_tensor(o.data(), accumulator_rows_cols(o.layout()));
    CUTE_UNROLL
    for (int i = 0; i < kRows; ++i) {
      CUTE_UNROLL
      for (int j = 0; j < cute::size<1>(rc); ++j) rc(i, j) *= factor[i];
    }
  }

  // The end of the rows: `inv_sum` normalises the output (0 for a row that saw no key) and
  // `lse` is the natural-log LSE of the scaled scores (-inf for such a row).
  __device__ void finalize(float (&inv_sum)[kRows], float (&lse)[kRows]) const {
    CUTE_UNROLL
    for (int i = 0; i < kRows; ++i) {
      finish(row_max[i], quad_sum(row_sum[i]), inv_sum[i], lse[i]);
    }
  }
};

// The online softmax of a transposed score tile S^T [keys, heads] (one warpgroup's GMMA
// accumulator: M = 64 keys over its four warps, N = kHeads query heads): a head is a column
// spread over the four warps, so its tile maximum takes shuffles within each warp and one
// exchange through shared memory (`red`: two [4][kHeads] buffers used in turn, so that a warp
// can write the next one while a slower warp still reads this one; the named barrier between
// them orders the rest). Every thread then holds the same column maxima and the stale rule
// (move_max) moves them for all threads alike; weight sums stay per thread until finalize.
template <int kHeads>
struct ColumnSoftmax {
  static constexpr int kCols = kHeads / 4;  // columns of a thread: pairs in groups of 8
  float col_max[kCols];                     // scaled log2 units, the same in every thread
  float col_sum[kCols];                     // this thread's keys only
  float scale_log2;
  float* red;        // [2][4][kHeads] in shared memory
  uint32_t barrier;  // named barrier of the warpgroup's 128 threads
  int parity = 0;

  __device__ ColumnSoftmax(float scale_log2_, float* red_, uint32_t barrier_)
      : scale_log2(scale_log2_), red(red_), barrier(barrier_) {
    CUTE_UNROLL
    for (int j = 0; j < kCols; ++j) {
      col_max[j] = -INFINITY;
      col_sum[j] = 0.f;
    }
  }

  // Per column j of the thread, op over the warpgroup of the thread's values v[j] (which the
  // thread's coords give as column `get<1>(coords(0, j))`); every thread gets the result.
  template <class Coords, class Op>
  __device__ void all_reduce(float (&v)[kCols], const Coords& coords, Op op) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32 % 4;
    float* buf = red + parity * 4 * kHeads;
    parity ^= 1;
    CUTE_UNROLL
    for (int j = 0; j < kCols; ++j) {
      CUTE_UNROLL
      for (int d = 4; d < 32; d *= 2) v[j] = op(v[j], __shfl_xor_sync(0xffffffffu, v[j], d));
    }
    if (lane < 4) {
      CUTE_UNROLL
      for (int j = 0; j < kCols; ++j) buf[warp * kHeads + cute::get<1>(coords(0, j))] = v[j];
    }
    cutlass::arch::NamedBarrier::sync(128, barrier);
    CUTE_UNROLL
    for (int j = 0; j < kCols; ++j) {
      const int h = cute::get<1>(coords(0, j));
      v[j] = op(op(buf[h], buf[kHeads + h]), op(buf[2 * kHeads + h], buf[3 * kHeads + h]));
    }
  }

  // One tile of scores s (rows: keys, columns: heads), in place to unnormalised weights; the
  // factor each column's earlier weights and outputs take goes to `rescale`.
  template <class Scores, class Coords>
  __device__ void update(Scores& s, const Coords& coords, float (&rescale)[kCols]) {
    static_assert(decltype(cute::size<1>(s))::value == kCols);
    float m[kCols];
    CUTE_UNROLL
    for (int j = 0; j < kCols; ++j) {
      m[j] = s(0, j);
      CUTE_UNROLL
      for (int i = 1; i < cute::size<0>(s); ++i) m[j] = fmaxf(m[j], s(i, j));
    }
    // Every tile, including one whose maxima cannot move: the gather consumer's single P^T
    // buffer relies on this barrier (qsa_gather_consumer.cuh, LayoutP).
    all_reduce(m, coords, [](float a, float b) { return fmaxf(a, b); });
    CUTE_UNROLL
    for (int j = 0; j < kCols; ++j) {
      float m_use;
      rescale[j] = move_max(col_max[j], m[j] * scale_log2, m_use);
      float sum = 0.f;
      CUTE_UNROLL
      for (int i = 0; i < cute::size<0>(s); ++i) {
        s(i, j) = exp2_ftz(fmaf(s(i, j), scale_log2, -m_use));
        sum += s(i, j);
      }
      col_sum[j] = col_sum[j] * rescale[j] + sum;
    }
  }

  template <class Coords>
  __device__ void finalize(const Coords& coords, float (&inv_sum)[kCols], float (&lse)[kCols]) {
    float sum[kCols];
    CUTE_UNROLL
    for (int j = 0; j < kCols; ++j) sum[j] = col_sum[j];
    all_reduce(sum, coords, [](float a, float b) { return a + b; });
    CUTE_UNROLL
    for (int j = 0; j < kCols; ++j) finish(col_max[j], sum[j], inv_sum[j], lse[j]);
  }
};

}  // namespace sparse_attn::cuda::sm90
