// Reference of XAttention's estimation and block selection (docs/xattention.md, sections
// "Estimation" and "Selection").
#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "reference/xattn_ref.h"
#include "sparse_attn/dtype.h"

namespace sparse_attn {
namespace {

// A [rows, D] slab of one (batch, head) of a [B, H, L, D] view, widened to float (exact for
// BF16/FP16), so the inner loops are plain arrays.
std::vector<float> load_rows(const void* base, DType dtype, const int64_t stride[4], int64_t b,
                             int64_t h, int64_t rows, int64_t dim) {
  std::vector<float> out(static_cast<size_t>(rows * dim));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t d = 0; d < dim; ++d) {
      out[r * dim + d] =
          load_as_float(base, dtype, b * stride[0] + h * stride[1] + r * stride[2] + d * stride[3]);
    }
  }
  return out;
}

// FP64 dot product; the simd reduction only reorders FP64 additions.
double dot(const float* a, const float* b, int64_t n) {
  double s = 0.0;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += static_cast<double>(a[i]) * b[i];
  return s;
}

}  // namespace

void reference_xattn_estimate_sums(const XAttnEstimateParams& p) {
  const int64_t S = p.stride;
  const int64_t D = p.head_dim;
  const int64_t Lq = p.q_len;
  const int64_t Lk = p.k_len;
  const int64_t offset = Lk - Lq;             // position of query row 0
  const int64_t q_groups = (Lq + S - 1) / S;  // partial last group: missing rows are zero
  const int64_t k_groups = (Lk + S - 1) / S;  // partial last group: missing keys are zero
  const int64_t groups_per_block = p.block_size / S;

#pragma omp parallel for collapse(2) schedule(dynamic, 1)
  for (int64_t b = 0; b < p.batch; ++b) {
    for (int64_t h = 0; h < p.num_q_heads; ++h) {
      const std::vector<float> q = load_rows(p.q, p.dtype, p.q_stride, b, h, Lq, D);
      const std::vector<float> k = load_rows(p.k, p.dtype, p.k_stride, b, h / p.group, Lk, D);
      std::vector<double> score(static_cast<size_t>(k_groups));
      std::vector<double> block_sum(static_cast<size_t>(p.k_blocks));
      for (int64_t qb = 0; qb < p.q_blocks; ++qb) {
        std::fill(block_sum.begin(), block_sum.end(), 0.0);
        const int64_t g_end = std::min((qb + 1) * groups_per_block, q_groups);
        for (int64_t g = qb * groups_per_block; g < g_end; ++g) {
          // Causal at group level: key group j is visible when its first key is not after the
          // position of the group's last query row.
          const int64_t last_pos = offset + std::min(g * S + S - 1, Lq - 1);
          const int64_t visible = p.causal ? std::min(last_pos / S + 1, k_groups) : k_groups;
          // Antidiagonal: query rows g*S + S-1-t (inverse order) meet keys j*S + t.
          double max_score = -INFINITY;
          for (int64_t j = 0; j < visible; ++j) {
            double s = 0.0;
            for (int64_t t = 0; t < S; ++t) {
              const int64_t qr = g * S + S - 1 - t;
              const int64_t kr = j * S + t;
              if (qr < Lq && kr < Lk) s += dot(&q[qr * D], &k[kr * D], D);
            }
            score[j] = s * p.score_scale;
            max_score = std::max(max_score, score[j]);
          }
          double denom = 0.0;
          for (int64_t j = 0; j < visible; ++j) {
            score[j] = std::exp(score[j] - max_score);
            denom += score[j];
          }
          for (int64_t j = 0; j < visible; ++j) {
            block_sum[j / groups_per_block] += score[j] / denom;
          }
        }
        for (int64_t kb = 0; kb < p.k_blocks; ++kb) {
          p.attn_sums[b * p.sums_stride[0] + h * p.sums_stride[1] + qb * p.sums_stride[2] +
                      kb * p.sums_stride[3]] = static_cast<float>(block_sum[kb]);
        }
      }
    }
  }
}

void reference_find_blocks(const BlockSelectParams& p) {
  const int64_t offset = p.k_len - p.q_len;  // position of query row 0

#pragma omp parallel for collapse(3) schedule(static)
  for (int64_t b = 0; b < p.batch; ++b) {
    for (int64_t h = 0; h < p.num_heads; ++h) {
      for (int64_t qb = 0; qb < p.q_blocks; ++qb) {
        // The diagonal: the key block holding the last key that the block's last row sees.
        const int64_t last_row = std::min((qb + 1) * p.block_size, p.q_len) - 1;
        const int64_t diagonal = (offset + last_row) / p.block_size;
        const int64_t eligible = p.causal ? diagonal + 1 : p.k_blocks;
        const float* x =
            p.attn_sums + b * p.sums_stride[0] + h * p.sums_stride[1] + qb * p.sums_stride[2];
        auto value = [&](int64_t kb) { return static_cast<double>(x[kb * p.sums_stride[3]]); };

        std::vector<char> forced(static_cast<size_t>(p.k_blocks), 0);
        if (p.causal || p.keep_recent) forced[diagonal] = 1;
        if (p.keep_sink) forced[0] = 1;
        // Visit order: forced blocks (ascending index), then the rest by descending sum, ties
        // to the lower index.
        std::vector<int64_t> order(static_cast<size_t>(eligible));
        std::iota(order.begin(), order.end(), 0);
        std::sort(order.begin(), order.end(), [&](int64_t a, int64_t c) {
          if (forced[a] != forced[c]) return forced[a] > forced[c];
          if (forced[a]) return a < c;
          const double va = value(a);
          const double vc = value(c);
          return va != vc ? va > vc : a < c;
        });

        std::vector<char> keep(static_cast<size_t>(p.k_blocks), 0);
        const double threshold = p.thresholds[h];
        if (threshold >= 1.0) {
          // Everything eligible; the running-sum rule below could drop blocks whose mass is
          // below the rounding error of the running sum.
          std::fill(keep.begin(), keep.begin() + eligible, 1);
        } else {
          double total = 0.0;
          for (int64_t kb : order) total += value(kb);
          const double required = threshold * total;
          double before = 0.0;
          for (int64_t kb : order) {
            if (!forced[kb] && !(before < required)) break;
            keep[kb] = 1;
            before += value(kb);
          }
        }
        uint8_t* m =
            p.block_mask + b * p.mask_stride[0] + h * p.mask_stride[1] + qb * p.mask_stride[2];
        for (int64_t kb = 0; kb < p.k_blocks; ++kb) m[kb * p.mask_stride[3]] = keep[kb];
      }
    }
  }
}

}  // namespace sparse_attn
