// The register-blocked tile products of the CPU backend, per Highway target (included after
// hwy/highway.h by each kernel file that foreach_target.h re-includes). Outer products: kRows
// rows x vecs_per_row() vectors of accumulators, each broadcast and each vector load feeding
// several fused multiply-adds. A K^T tile is [dp][kTile] (keys contiguous), rows of Q and O
// are dp floats (the head dim padded by padded_dim, zeros past it); row counts are multiples of
// kRows (padding rows zero).

// Per-target include guard (Highway's idiom: toggled once per target).
#if defined(SPARSE_ATTN_CPU_TILE_PRODUCTS_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef SPARSE_ATTN_CPU_TILE_PRODUCTS_INL_H_
#undef SPARSE_ATTN_CPU_TILE_PRODUCTS_INL_H_
#else
#define SPARSE_ATTN_CPU_TILE_PRODUCTS_INL_H_
#endif

#include <hwy/highway.h>

#include <cstdint>

HWY_BEFORE_NAMESPACE();
namespace sparse_attn::cpu::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;
using DF = hn::ScalableTag<float>;

constexpr int64_t kTile = 128;  // keys (columns) of a K^T tile
constexpr int kRows = 4;        // rows of a register block

// Accumulator vectors per row of a register block: 4 on 512-bit vectors (16 accumulators of 32
// registers), 2 on narrower ones (AVX2 has 16 registers).
constexpr int vecs_per_row() { return HWY_MAX_BYTES >= 64 ? 4 : 2; }

// The padded head dim: a multiple of one register block's columns.
inline int64_t padded_dim(int64_t d) {
  const int64_t cols = vecs_per_row() * static_cast<int64_t>(hn::Lanes(DF()));
  return (d + cols - 1) / cols * cols;
}

// C[rows][cols] = A[rows][k] B[k][cols], or C += A B when `accumulate`: register blocks of
// kRows rows x vecs_per_row() vectors, the products over k added in order (so every element's
// sum runs in one fixed order). Row strides lda, ldb, ldc; cols a multiple of one block's width.
inline void block_product(const float* a, int64_t lda, const float* b, int64_t ldb, int64_t k,
                          float* c, int64_t ldc, int64_t rows, int64_t cols, bool accumulate) {
  const DF df;
  constexpr int kV = vecs_per_row();
  const int64_t n = hn::Lanes(df);
  for (int64_t i0 = 0; i0 < rows; i0 += kRows) {
    for (int64_t c0 = 0; c0 < cols; c0 += kV * n) {
      hn::Vec<DF> acc[kRows][kV];
      for (int r = 0; r < kRows; ++r) {
        for (int v = 0; v < kV; ++v) {
          acc[r][v] = accumulate ? hn::Load(df, c + (i0 + r) * ldc + c0 + v * n) : hn::Zero(df);
        }
      }
      for (int64_t t = 0; t < k; ++t) {
        hn::Vec<DF> bv[kV];
        for (int v = 0; v < kV; ++v) bv[v] = hn::Load(df, b + t * ldb + c0 + v * n);
        for (int r = 0; r < kRows; ++r) {
          const auto av = hn::Set(df, a[(i0 + r) * lda + t]);
          for (int v = 0; v < kV; ++v) acc[r][v] = hn::MulAdd(av, bv[v], acc[r][v]);
        }
      }
      for (int r = 0; r < kRows; ++r) {
        for (int v = 0; v < kV; ++v) hn::Store(acc[r][v], df, c + (i0 + r) * ldc + c0 + v * n);
      }
    }
  }
}

// S[kRows * row block][kTile] = Q[rows][Dp] K^T, K^T one key block [Dp][kTile].
inline void scores(const float* q, int64_t rows, int64_t dp, const float* kt, float* s) {
  block_product(q, dp, kt, kTile, dp, s, kTile, rows, kTile, false);
}

// O[rows][Dp] += P[rows][kTile] V, V one key block [kTile][Dp]; keys past `keys` have P = 0.
inline void add_pv(const float* p, int64_t rows, int64_t keys, const float* v, int64_t dp,
                   float* o) {
  block_product(p, kTile, v, dp, keys, o, dp, rows, dp, true);
}

}  // namespace sparse_attn::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // SPARSE_ATTN_CPU_TILE_PRODUCTS_INL_H_
