#include "reference/merge_ref.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "sparse_attn/dtype.h"

namespace sparse_attn::detail {

void reference_merge_attention_states(const MergeParams& p) {
  constexpr double kInf = std::numeric_limits<double>::infinity();
  const int64_t pairs = p.rows * p.heads;
#pragma omp parallel
  {
    std::vector<double> acc(p.dim);
#pragma omp for schedule(static)
    for (int64_t rh = 0; rh < pairs; ++rh) {
      const int64_t r = rh / p.heads;
      const int64_t h = rh % p.heads;
      const float* lse = p.partial_lse + r * p.pl_row_stride + h * p.pl_head_stride;
      // A NaN or +inf LSE has no meaningful weight; it poisons the row instead of vanishing in a
      // max whose result would depend on where it sits.
      double m = -kInf;
      bool poisoned = false;
      for (int64_t i = 0; i < p.parts; ++i) {
        const double l = lse[i * p.pl_part_stride];
        if (std::isnan(l) || l == kInf) poisoned = true;
        if (!std::isnan(l)) m = std::max(m, l);
      }
      double merged_lse;
      if (poisoned) {
        std::fill(acc.begin(), acc.end(), std::numeric_limits<double>::quiet_NaN());
        merged_lse = std::numeric_limits<double>::quiet_NaN();
      } else if (m == -kInf) {  // no partial saw a key
        std::fill(acc.begin(), acc.end(), 0.0);
        merged_lse = -kInf;
      } else {
        std::fill(acc.begin(), acc.end(), 0.0);
        double sum = 0.0;
        for (int64_t i = 0; i < p.parts; ++i) {
          const double w = std::exp(lse[i * p.pl_part_stride] - m);
          sum += w;
          if (w == 0.0) continue;  // not read: the outputs of empty partials may be garbage
          const int64_t base = i * p.po_part_stride + r * p.po_row_stride + h * p.po_head_stride;
          for (int64_t d = 0; d < p.dim; ++d) {
            acc[d] += w * load_as_float(p.partial_out, p.partial_dtype, base + d * p.po_dim_stride);
          }
        }
        for (double& a : acc) a /= sum;
        merged_lse = m + std::log(sum);
      }
      const int64_t out_base = r * p.out_row_stride + h * p.out_head_stride;
      for (int64_t d = 0; d < p.dim; ++d) {
        store_from_float(p.out, p.out_dtype, out_base + d * p.out_dim_stride,
                         static_cast<float>(acc[d]));
      }
      if (p.lse_out) {
        p.lse_out[r * p.lo_row_stride + h * p.lo_head_stride] = static_cast<float>(merged_lse);
      }
    }
  }
}

}  // namespace sparse_attn::detail
