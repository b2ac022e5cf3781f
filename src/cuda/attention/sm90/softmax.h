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

#include <cute/tensor.hpp>

#include "cuda/attention/sm90/mma.h"

namespace sparse_attn::cuda::sm90 {

template <int kRows>
struct OnlineSoftmax {
  static constexpr float kStaleLog2 = 8.f;
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

  // 2^x by the SFU alone: flush-to-zero drops exp2f's denormal-range fix-up (a compare and two
  // multiplies a score); weights below 2^-126 are 0 at the output's precision anyway.
  __device__ static float exp2_ftz(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
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
      const float m_new = fmaxf(row_max[i], quad_max(raw) * scale_log2);
      // -inf + 8 is -inf: a row's first finite maximum always moves it.
      const float m = m_new > row_max[i] + kStaleLog2 ? m_new : row_max[i];
      // -inf - -inf would be NaN: a row with nothing visible yet subtracts 0 (its weights are 0).
      const float m_use = m == -INFINITY ? 0.f : m;
      rescale[i] = exp2_ftz(row_max[i] - m_use);
      row_max[i] = m;
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
      const float sum = quad_sum(row_sum[i]);
      const bool empty = sum == 0.f;
      inv_sum[i] = empty ? 0.f : 1.f / sum;
      lse[i] = empty ? -INFINITY : (row_max[i] + log2f(sum)) * 0.69314718055994531f;
    }
  }
};

}  // namespace sparse_attn::cuda::sm90
