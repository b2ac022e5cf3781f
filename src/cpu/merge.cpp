// CPU merge_attention_states (docs/merge.md), FP32: per (row, head), the maximum LSE, then the
// weighted sum of the partial outputs in partial order 0 .. N-1 and one division by the summed
// weights. (row, head) pairs go to the OpenMP threads, each pair one thread's sequential work,
// so the bits do not depend on the thread count or the schedule.
//
// The op reads each partial element once for one multiply-add: memory-bound, so the plain loops
// below (the unit-stride one vectorised by the compiler) are all it needs, without Highway.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "cpu/cpu_kernels.h"
#include "sparse_attn/dtype.h"

namespace sparse_attn {
namespace {

// acc[d] += w * src[off + d * stride] for d < n, src of dtype kDt.
template <DType kDt>
void accumulate(float w, const void* src, int64_t off, int64_t stride, int64_t n, float* acc) {
  if (stride == 1) {
    for (int64_t d = 0; d < n; ++d) acc[d] += w * load_as_float(src, kDt, off + d);
  } else {
    for (int64_t d = 0; d < n; ++d) acc[d] += w * load_as_float(src, kDt, off + d * stride);
  }
}

template <DType kPartial>
void merge(const detail::MergeParams& p) {
  constexpr float kInf = std::numeric_limits<float>::infinity();
  constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
  const int64_t pairs = p.rows * p.heads;
#pragma omp parallel
  {
    std::vector<float> acc(p.dim);
#pragma omp for schedule(static)
    for (int64_t rh = 0; rh < pairs; ++rh) {
      const int64_t r = rh / p.heads;
      const int64_t h = rh % p.heads;
      const float* lse = p.partial_lse + r * p.pl_row_stride + h * p.pl_head_stride;
      float m = -kInf;
      bool poisoned = false;  // a NaN or +inf LSE: the row is NaN (as the reference decides)
      for (int64_t i = 0; i < p.parts; ++i) {
        const float l = lse[i * p.pl_part_stride];
        poisoned |= std::isnan(l) || l == kInf;
        m = std::max(m, l);  // keeps m for a NaN l; poisoned covers it
      }
      float merged_lse;
      if (poisoned) {
        std::fill(acc.begin(), acc.end(), kNaN);
        merged_lse = kNaN;
      } else if (m == -kInf) {  // no partial saw a key
        std::fill(acc.begin(), acc.end(), 0.f);
        merged_lse = -kInf;
      } else {
        std::fill(acc.begin(), acc.end(), 0.f);
        float sum = 0.f;
        for (int64_t i = 0; i < p.parts; ++i) {
          const float w = std::exp(lse[i * p.pl_part_stride] - m);
          sum += w;
          if (w == 0.f) continue;  // not read: the outputs of empty partials may be garbage
          accumulate<kPartial>(w, p.partial_out,
                               i * p.po_part_stride + r * p.po_row_stride + h * p.po_head_stride,
                               p.po_dim_stride, p.dim, acc.data());
        }
        for (float& a : acc) a /= sum;
        merged_lse = m + std::log(sum);
      }
      const int64_t out_base = r * p.out_row_stride + h * p.out_head_stride;
      for (int64_t d = 0; d < p.dim; ++d) {
        store_from_float(p.out, p.out_dtype, out_base + d * p.out_dim_stride, acc[d]);
      }
      if (p.lse_out) p.lse_out[r * p.lo_row_stride + h * p.lo_head_stride] = merged_lse;
    }
  }
}

}  // namespace

void cpu_merge_attention_states(const detail::MergeParams& params) {
  switch (params.partial_dtype) {
    case DType::kBF16:
      return merge<DType::kBF16>(params);
    case DType::kF16:
      return merge<DType::kF16>(params);
    default:
      return merge<DType::kF32>(params);
  }
}

}  // namespace sparse_attn
