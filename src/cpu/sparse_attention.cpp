// CPU qsa_sparse_attention (docs/qsa.md, "Sparse attention"), FP32 throughout.
//
// A query row's work, per KV head: the G query heads of the group attend to the row's valid
// tokens (the reference's metadata reading and masking, shared), whose K and V rows are widened
// to FP32 (FP8 K/V: and scaled) a chunk of tokens at a time, once per (row, KV head). The vectors
// run across the group's heads for the scores and the softmax, and across the head dim for P V, so
// neither K nor V is ever transposed:
//   S[t][h] = sum_d K[t][d] * Qt[d][h]          broadcast K[t][d], vector of heads
//   softmax over t, per head                    vector max, exp and sum across heads
//   O[h][:] += P[t][h] * V[t][:]                broadcast P[t][h], vectors of the head dim
// Rows go to the threads dynamically; a row is one thread's work, so results do not depend on
// the thread count.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "cpu/cpu_kernels.h"
#include "reference/qsa_attention_ref.h"
#include "sparse_attn/dtype.h"

// Highway's dynamic dispatch: foreach_target.h re-includes this file once per target, so the
// order of these includes matters.
// clang-format off
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "cpu/sparse_attention.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>
#include <hwy/aligned_allocator.h>
#include <hwy/contrib/math/math-inl.h>
// clang-format on

HWY_BEFORE_NAMESPACE();
namespace sparse_attn::cpu::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;
using DF = hn::ScalableTag<float>;

constexpr int64_t kChunk = 64;  // tokens widened at a time (64 x 256 floats: 64 KB, in L2)
// Tokens of a score register block: 16 accumulators of AVX-512's 32 registers (measured: 56%
// of the FMA ceiling against 51% with 8), 8 of AVX2's 16.
constexpr int kTokens = HWY_MAX_BYTES >= 64 ? 16 : 8;
constexpr int kHeads = 4;  // heads of a P V register block
constexpr int kCols = 4;   // vectors of the head dim in a P V register block

// n floats of a row of K or V (element stride `stride`) into dst. FP8 takes the scalar loop:
// Highway has no e4m3 promotion, and the CPU backend's FP8 path is for correctness, not speed.
void widen(const void* src, DType dt, int64_t off, int64_t stride, int64_t n, float* dst) {
  const DF df;
  const int64_t lanes = hn::Lanes(df);
  int64_t d = 0;
  if (stride == 1 && dt == DType::kBF16) {
    const hn::Rebind<hwy::bfloat16_t, DF> db;
    const auto* p = static_cast<const hwy::bfloat16_t*>(src) + off;
    for (; d + lanes <= n; d += lanes)
      hn::StoreU(hn::PromoteTo(df, hn::LoadU(db, p + d)), df, dst + d);
  } else if (stride == 1 && dt == DType::kF16) {
    const hn::Rebind<hwy::float16_t, DF> dh;
    const auto* p = static_cast<const hwy::float16_t*>(src) + off;
    for (; d + lanes <= n; d += lanes)
      hn::StoreU(hn::PromoteTo(df, hn::LoadU(dh, p + d)), df, dst + d);
  }
  for (; d < n; ++d) dst[d] = load_as_float(src, dt, off + d * stride);
}

// One thread's buffers, sized for the largest row.
struct Scratch {
  hwy::AlignedFreeUniquePtr<float[]> qt, s, o, kv;
  std::vector<int64_t> k_offs, v_offs;
};

void SparseAttention(const SparseAttentionParams& p) {
  const QsaRequests req = read_qsa_requests(p);
  const std::vector<QsaRow> rows = read_qsa_rows(p, req);
  const DF df;
  const int64_t lanes = hn::Lanes(df);
  const int64_t D = p.head_dim, G = p.group, W = p.width;
  const int64_t dp = (D + kCols * lanes - 1) / (kCols * lanes) * (kCols * lanes);
  const int64_t hv = (G + lanes - 1) / lanes;  // head vectors of a score row
  const int64_t gp = hv * lanes;               // heads padded to whole vectors
  const int64_t gh = (G + kHeads - 1) / kHeads * kHeads;
  const float inf = std::numeric_limits<float>::infinity();
  const DType dt = p.dtype;

#pragma omp parallel
  {
    Scratch sc;
    sc.qt = hwy::AllocateAligned<float>(static_cast<size_t>(dp * gp));
    sc.s = hwy::AllocateAligned<float>(static_cast<size_t>(std::max<int64_t>(W, 1) * gp));
    sc.o = hwy::AllocateAligned<float>(static_cast<size_t>(gh * dp));
    sc.kv = hwy::AllocateAligned<float>(static_cast<size_t>(kChunk * dp));
    std::vector<float> m(gp), l(gp);
#pragma omp for schedule(dynamic, 1)
    for (int64_t r = 0; r < p.rows; ++r) {
      const QsaRow& row = rows[r];
      sc.k_offs.clear();
      sc.v_offs.clear();
      if (row.active) {
        for (int64_t j = 0; j < W; ++j) {
          const int64_t t =
              p.token_indices[r * p.token_indices_row_stride + j * p.token_indices_col_stride];
          int64_t ko = 0, vo = 0;
          if (locate_qsa_token(p, req, row, t, &ko, &vo)) {
            sc.k_offs.push_back(ko);
            sc.v_offs.push_back(vo);
          }
        }
      }
      const int64_t n = static_cast<int64_t>(sc.k_offs.size());
      float* kv = sc.kv.get();
      float* s = sc.s.get();
      float* o = sc.o.get();
      for (int64_t g = 0; g < p.num_kv_heads; ++g) {
        const int64_t h0 = g * G;
        std::fill(o, o + gh * dp, 0.f);
        std::fill(m.begin(), m.end(), -inf);
        std::fill(l.begin(), l.end(), 0.f);
        if (n > 0) {
          // Qt[d][h] = scale * q[h][d], zero for padding heads and dims.
          float* qt = sc.qt.get();
          std::fill(qt, qt + dp * gp, 0.f);
          for (int64_t h = 0; h < G; ++h) {
            const int64_t qb = r * p.q_row_stride + (h0 + h) * p.q_head_stride;
            for (int64_t d = 0; d < D; ++d) {
              qt[d * gp + h] = load_as_float(p.q, dt, qb + d * p.q_dim_stride) * p.scale;
            }
          }
          // Tokens [c0, c0 + cn) of K or V (KV head g) widened into kv, rows of dp floats, times
          // the dequantisation scale of FP8 K/V (1 for 16-bit K/V, skipped).
          auto widen_chunk = [&](const void* src, const std::vector<int64_t>& offs,
                                 int64_t head_stride, int64_t dim_stride, float scale, int64_t c0,
                                 int64_t cn) {
            for (int64_t j = 0; j < cn; ++j) {
              float* dst = kv + j * dp;
              widen(src, p.kv_dtype, offs[c0 + j] + g * head_stride, dim_stride, D, dst);
              if (scale != 1.f) {
                for (int64_t d = 0; d < D; ++d) dst[d] *= scale;
              }
              std::fill(dst + D, dst + dp, 0.f);
            }
          };
          // S[t][:] for every token, a chunk of widened K rows at a time.
          for (int64_t c0 = 0; c0 < n; c0 += kChunk) {
            const int64_t cn = std::min(kChunk, n - c0);
            widen_chunk(p.k, sc.k_offs, p.k_head_stride, p.k_dim_stride, p.k_scale, c0, cn);
            for (int64_t hb = 0; hb < hv; ++hb) {
              for (int64_t j0 = 0; j0 < cn; j0 += kTokens) {
                const int64_t jn = std::min<int64_t>(kTokens, cn - j0);
                hn::Vec<DF> acc[kTokens];
                for (auto& a : acc) a = hn::Zero(df);
                if (jn == kTokens) {
                  for (int64_t d = 0; d < dp; ++d) {
                    const auto qv = hn::Load(df, qt + d * gp + hb * lanes);
                    for (int j = 0; j < kTokens; ++j) {
                      acc[j] = hn::MulAdd(hn::Set(df, kv[(j0 + j) * dp + d]), qv, acc[j]);
                    }
                  }
                } else {
                  for (int64_t d = 0; d < dp; ++d) {
                    const auto qv = hn::Load(df, qt + d * gp + hb * lanes);
                    for (int64_t j = 0; j < jn; ++j) {
                      acc[j] = hn::MulAdd(hn::Set(df, kv[(j0 + j) * dp + d]), qv, acc[j]);
                    }
                  }
                }
                for (int64_t j = 0; j < jn; ++j) {
                  hn::Store(acc[j], df, s + (c0 + j0 + j) * gp + hb * lanes);
                }
              }
            }
          }
          // Softmax over the tokens, a vector of heads at a time: S becomes P.
          for (int64_t hb = 0; hb < hv; ++hb) {
            auto vmax = hn::Set(df, -inf);
            for (int64_t t = 0; t < n; ++t)
              vmax = hn::Max(vmax, hn::Load(df, s + t * gp + hb * lanes));
            auto vsum = hn::Zero(df);
            for (int64_t t = 0; t < n; ++t) {
              float* st = s + t * gp + hb * lanes;
              const auto w = hn::Exp(df, hn::Sub(hn::Load(df, st), vmax));
              hn::Store(w, df, st);
              vsum = hn::Add(vsum, w);
            }
            hn::StoreU(vmax, df, m.data() + hb * lanes);
            hn::StoreU(vsum, df, l.data() + hb * lanes);
          }
          // O += P V, a chunk of widened V rows at a time.
          for (int64_t c0 = 0; c0 < n; c0 += kChunk) {
            const int64_t cn = std::min(kChunk, n - c0);
            widen_chunk(p.v, sc.v_offs, p.v_head_stride, p.v_dim_stride, p.v_scale, c0, cn);
            for (int64_t hq = 0; hq < G; hq += kHeads) {
              const int64_t heads = std::min<int64_t>(kHeads, G - hq);
              for (int64_t col = 0; col < dp; col += kCols * lanes) {
                hn::Vec<DF> acc[kHeads][kCols];
                for (int h = 0; h < kHeads; ++h) {
                  for (int c = 0; c < kCols; ++c) {
                    acc[h][c] = hn::Load(df, o + (hq + h) * dp + col + c * lanes);
                  }
                }
                for (int64_t j = 0; j < cn; ++j) {
                  hn::Vec<DF> vv[kCols];
                  for (int c = 0; c < kCols; ++c)
                    vv[c] = hn::Load(df, kv + j * dp + col + c * lanes);
                  const float* pt = s + (c0 + j) * gp + hq;
                  for (int h = 0; h < kHeads; ++h) {
                    const auto pw = hn::Set(df, h < heads ? pt[h] : 0.f);
                    for (int c = 0; c < kCols; ++c) acc[h][c] = hn::MulAdd(pw, vv[c], acc[h][c]);
                  }
                }
                for (int h = 0; h < kHeads; ++h) {
                  for (int c = 0; c < kCols; ++c) {
                    hn::Store(acc[h][c], df, o + (hq + h) * dp + col + c * lanes);
                  }
                }
              }
            }
          }
        }
        for (int64_t h = 0; h < G; ++h) {
          const bool any = n > 0;
          if (p.lse) {
            p.lse[r * p.lse_row_stride + (h0 + h) * p.lse_head_stride] =
                any ? m[h] + std::log(l[h]) : -inf;
          }
          const float inv = any ? 1.f / l[h] : 0.f;
          const int64_t out_base = r * p.out_row_stride + (h0 + h) * p.out_head_stride;
          const int64_t gate_base = r * p.gate_row_stride + (h0 + h) * p.gate_head_stride;
          for (int64_t d = 0; d < D; ++d) {
            float val = o[h * dp + d] * inv;
            if (p.gate_kind != GateKind::kNone) {
              // The unfused result: attention rounded to the output dtype, then gated in FP32.
              const float gate = load_as_float(p.gate, dt, gate_base + d * p.gate_dim_stride);
              val = round_to(dt, val) * (1.f / (1.f + std::exp(-gate)));
            }
            store_from_float(p.out, dt, out_base + d * p.out_dim_stride, val);
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
HWY_EXPORT(SparseAttention);
}  // namespace cpu

void cpu_sparse_attention(const SparseAttentionParams& params) {
  HWY_DYNAMIC_DISPATCH(cpu::SparseAttention)(params);
}

}  // namespace sparse_attn
#endif
