// CPU XAttention estimate (xattn_estimate's block sums; docs/xattention.md, "Estimation"), FP32.
//
// The strided antidiagonal score of query group g and key group j is one dot product of the
// reshaped rows: Q'_g = (q[gS + S-1], q[gS + S-2], ..., q[gS]) and K'_j = (k[jS], ..., k[jS +
// S-1]), each S * D long, so the scores of a query block are a [rows / S, Lk / S] product of
// Q' and K'^T. Per (batch, KV head) K' is widened once into K^T tiles [S * D][128 groups]
// (zero past the last key), shared by the group's query heads; work items are (query head,
// query block), each computing its groups' score rows with the register-blocked product of
// cpu/tile_products-inl.h, then per row the softmax over the visible key groups and the sums
// into 128-key blocks.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "cpu/cpu_kernels.h"
#include "sparse_attn/dtype.h"

// Highway's dynamic dispatch: foreach_target.h re-includes this file once per target, so the
// order of these includes matters.
// clang-format off
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "cpu/xattn_estimate.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>
#include <hwy/aligned_allocator.h>
#include <hwy/contrib/math/math-inl.h>
#include "cpu/tile_products-inl.h"
// clang-format on

HWY_BEFORE_NAMESPACE();
namespace sparse_attn::cpu::HWY_NAMESPACE {

void XAttnEstimateSums(const XAttnEstimateParams& p) {
  const DF df;
  const int64_t lanes = hn::Lanes(df);
  const int64_t S = p.stride, D = p.head_dim, Lq = p.q_len, Lk = p.k_len;
  const int64_t offset = Lk - Lq;  // position of query row 0
  const int64_t q_groups = (Lq + S - 1) / S, k_groups = (Lk + S - 1) / S;
  const int64_t per_block = p.block_size / S;  // groups in a 128-row (or -key) block
  const int64_t dp = padded_dim(S * D);
  const int64_t k_tiles = std::max<int64_t>((k_groups + kTile - 1) / kTile, 1);
  const int64_t rows_padded = (per_block + kRows - 1) / kRows * kRows;
  const float inf = std::numeric_limits<float>::infinity();
  auto sums_at = [&](int64_t b, int64_t h, int64_t qb, int64_t kb) -> float& {
    return p.attn_sums[b * p.sums_stride[0] + h * p.sums_stride[1] + qb * p.sums_stride[2] +
                       kb * p.sums_stride[3]];
  };

  auto kt = hwy::AllocateAligned<float>(static_cast<size_t>(k_tiles * dp * kTile));
  for (int64_t b = 0; b < p.batch; ++b) {
    for (int64_t kvh = 0; kvh < p.num_kv_heads; ++kvh) {
      // K'^T: element (t * D + d, j) of tile j / kTile is k[j * S + t][d].
#pragma omp parallel for schedule(static)
      for (int64_t j = 0; j < k_tiles * kTile; ++j) {
        float* col = kt.get() + (j / kTile) * dp * kTile + j % kTile;
        for (int64_t e = 0; e < dp; ++e) col[e * kTile] = 0.f;
        for (int64_t t = 0; t < S && j < k_groups && j * S + t < Lk; ++t) {
          const int64_t base =
              b * p.k_stride[0] + kvh * p.k_stride[1] + (j * S + t) * p.k_stride[2];
          for (int64_t d = 0; d < D; ++d) {
            col[(t * D + d) * kTile] = load_as_float(p.k, p.dtype, base + d * p.k_stride[3]);
          }
        }
      }

#pragma omp parallel
      {
        auto q = hwy::AllocateAligned<float>(static_cast<size_t>(rows_padded * dp));
        auto s = hwy::AllocateAligned<float>(static_cast<size_t>(rows_padded * kTile));
        std::vector<float> score_rows;  // [rows_padded][visible tiles * kTile]
        std::vector<double> block_sum(static_cast<size_t>(p.k_blocks));
        // Heaviest first: the last query blocks see the most key groups under a causal mask.
#pragma omp for collapse(2) schedule(dynamic, 1)
        for (int64_t hg = 0; hg < p.group; ++hg) {
          for (int64_t i = 0; i < p.q_blocks; ++i) {
            const int64_t h = kvh * p.group + hg, qb = p.q_blocks - 1 - i;
            const int64_t g0 = qb * per_block, g1 = std::min(g0 + per_block, q_groups);
            // Q'_g for the block's groups (rows past Lq and padding rows zero).
            std::fill(q.get(), q.get() + rows_padded * dp, 0.f);
            for (int64_t g = g0; g < g1; ++g) {
              for (int64_t t = 0; t < S; ++t) {
                const int64_t qr = g * S + S - 1 - t;
                if (qr >= Lq) continue;
                const int64_t base = b * p.q_stride[0] + h * p.q_stride[1] + qr * p.q_stride[2];
                for (int64_t d = 0; d < D; ++d) {
                  q[(g - g0) * dp + t * D + d] =
                      load_as_float(p.q, p.dtype, base + d * p.q_stride[3]);
                }
              }
            }
            // Key groups the block's rows may see (a row's own limit is applied below).
            auto visible_of = [&](int64_t g) {
              const int64_t last_pos = offset + std::min(g * S + S - 1, Lq - 1);
              return p.causal ? std::clamp<int64_t>(last_pos / S + 1, 0, k_groups) : k_groups;
            };
            const int64_t tiles = g1 > g0 ? (visible_of(g1 - 1) + kTile - 1) / kTile : 0;
            // Score rows: [rows_padded][tiles * kTile], one tile at a time (every element is
            // written by the copies below).
            score_rows.resize(static_cast<size_t>(tiles * kTile * rows_padded));
            for (int64_t tile = 0; tile < tiles; ++tile) {
              scores(q.get(), rows_padded, dp, kt.get() + tile * dp * kTile, s.get());
              for (int64_t r = 0; r < rows_padded; ++r) {
                std::copy(s.get() + r * kTile, s.get() + (r + 1) * kTile,
                          score_rows.data() + r * tiles * kTile + tile * kTile);
              }
            }
            std::fill(block_sum.begin(), block_sum.end(), 0.0);
            const auto vscale = hn::Set(df, static_cast<float>(p.score_scale));
            for (int64_t g = g0; g < g1; ++g) {
              float* sr = score_rows.data() + (g - g0) * tiles * kTile;
              const int64_t visible = visible_of(g);
              if (visible == 0) continue;
              const int64_t whole = visible / lanes * lanes;
              auto vmax = hn::Set(df, -inf);
              for (int64_t j = 0; j < whole; j += lanes) {
                const auto x = hn::Mul(hn::LoadU(df, sr + j), vscale);
                hn::StoreU(x, df, sr + j);
                vmax = hn::Max(vmax, x);
              }
              float m = hn::GetLane(hn::MaxOfLanes(df, vmax));
              for (int64_t j = whole; j < visible; ++j) {
                sr[j] *= static_cast<float>(p.score_scale);
                m = std::max(m, sr[j]);
              }
              const auto vm = hn::Set(df, m);
              auto vsum = hn::Zero(df);
              for (int64_t j = 0; j < whole; j += lanes) {
                const auto w = hn::Exp(df, hn::Sub(hn::LoadU(df, sr + j), vm));
                hn::StoreU(w, df, sr + j);
                vsum = hn::Add(vsum, w);
              }
              double denom = hn::GetLane(hn::SumOfLanes(df, vsum));
              for (int64_t j = whole; j < visible; ++j) {
                sr[j] = std::exp(sr[j] - m);
                denom += sr[j];
              }
              const double inv = 1.0 / denom;
              for (int64_t j = 0; j < visible; ++j) block_sum[j / per_block] += sr[j] * inv;
            }
            for (int64_t kb = 0; kb < p.k_blocks; ++kb) {
              sums_at(b, h, qb, kb) = static_cast<float>(block_sum[kb]);
            }
          }
        }
      }
    }
  }
}

}  // namespace sparse_attn::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace sparse_attn {
namespace cpu {
HWY_EXPORT(XAttnEstimateSums);
}  // namespace cpu

void cpu_xattn_estimate_sums(const XAttnEstimateParams& params) {
  HWY_DYNAMIC_DISPATCH(cpu::XAttnEstimateSums)(params);
}

}  // namespace sparse_attn
#endif
