// CPU QSA indexer ops (qsa_indexer_mqa_score, qsa_mqa_prefill, qsa_mqa_decode; docs/qsa.md,
// "Indexer scores"), FP32.
//
// All three compute out[row, key] = scale * sum_h ReLU(q[row, h] . k[key]) where the key is
// visible to the row, -inf elsewhere; they differ in which keys a row reads and which it sees.
// The keys a set of rows shares are widened once into K^T tiles [D][128 keys] (zero where a key
// does not exist); the rows' heads are the rows of the register-blocked tile product
// (cpu/tile_products-inl.h: row r's head h is product row r * H + h), then per row the ReLU
// and the sum over heads run with the vectors across keys. Each row's visibility rule comes
// from the reference's own metadata reading (shared) and the op's mask.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "cpu/cpu_kernels.h"
#include "reference/qsa_indexer_ref.h"
#include "sparse_attn/dtype.h"

// Highway's dynamic dispatch: foreach_target.h re-includes this file once per target, so the
// order of these includes matters.
// clang-format off
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "cpu/qsa_indexer.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>
#include <hwy/aligned_allocator.h>
#include "cpu/tile_products-inl.h"
// clang-format on

HWY_BEFORE_NAMESPACE();
namespace sparse_attn::cpu::HWY_NAMESPACE {

using detail::MqaDecodeParams;
using detail::MqaPrefillParams;
using detail::MqaScoreParams;

constexpr int64_t kRowChunk = 32;  // query rows per product (x 4 heads: 128 product rows)

// Keys widened into K^T tiles; `key_off(j)` gives key j's element offset, or -1 when it does
// not exist (then its column is zero; the op's mask hides it).
struct KeyTiles {
  hwy::AlignedFreeUniquePtr<float[]> data;
  int64_t tiles = 0, dp = 0;

  template <class KeyOffset>
  void fill(const void* k, DType dt, int64_t k_dim_stride, int64_t dim, int64_t keys,
            KeyOffset key_off) {
    tiles = (keys + kTile - 1) / kTile;
    const size_t need = static_cast<size_t>(std::max<int64_t>(tiles, 1) * dp * kTile);
    data = hwy::AllocateAligned<float>(need);
    float* kt = data.get();
    for (int64_t j = 0; j < tiles * kTile; ++j) {
      float* col = kt + (j / kTile) * dp * kTile + j % kTile;
      const int64_t off = j < keys ? key_off(j) : -1;
      for (int64_t d = 0; d < dp; ++d) {
        col[d * kTile] = off >= 0 && d < dim ? load_as_float(k, dt, off + d * k_dim_stride) : 0.f;
      }
    }
  }
  const float* tile(int64_t t) const { return data.get() + t * dp * kTile; }
};

// One thread's buffers for a chunk of rows.
struct RowScratch {
  hwy::AlignedFreeUniquePtr<float[]> q, s;
  int64_t product_rows = 0;

  RowScratch(int64_t heads, int64_t dp) {
    product_rows = (kRowChunk * heads + kRows - 1) / kRows * kRows;
    q = hwy::AllocateAligned<float>(static_cast<size_t>(product_rows * dp));
    s = hwy::AllocateAligned<float>(static_cast<size_t>(product_rows * kTile));
  }
};

// Scores `n` rows (q_off(i): element offset of row i's q[0, 0]) against the keys of `kt` in
// tiles [t0, t1); emit(i, key, value) receives scale * sum_h ReLU(.) of every key of those
// tiles (the caller masks).
template <class QOffset, class Emit>
void score_chunk(const void* q, DType dt, int64_t q_head_stride, int64_t q_dim_stride,
                 int64_t heads, int64_t dim, int64_t n, QOffset q_off, const KeyTiles& kt,
                 int64_t t0, int64_t t1, float scale, RowScratch& sc, Emit emit) {
  const DF df;
  const int64_t lanes = hn::Lanes(df);
  const int64_t dp = kt.dp;
  const int64_t rows = (n * heads + kRows - 1) / kRows * kRows;
  float* qp = sc.q.get();
  std::fill(qp, qp + rows * dp, 0.f);
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t h = 0; h < heads; ++h) {
      for (int64_t d = 0; d < dim; ++d) {
        qp[(i * heads + h) * dp + d] =
            load_as_float(q, dt, q_off(i) + h * q_head_stride + d * q_dim_stride);
      }
    }
  }
  const auto zero = hn::Zero(df), vscale = hn::Set(df, scale);
  alignas(64) float sum[kTile];
  for (int64_t t = t0; t < t1; ++t) {
    scores(qp, rows, dp, kt.tile(t), sc.s.get());
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t j = 0; j < kTile; j += lanes) {
        auto acc = zero;
        for (int64_t h = 0; h < heads; ++h) {
          acc = hn::Add(acc, hn::Max(hn::Load(df, sc.s.get() + (i * heads + h) * kTile + j), zero));
        }
        hn::Store(hn::Mul(acc, vscale), df, sum + j);
      }
      for (int64_t j = 0; j < kTile; ++j) emit(i, t * kTile + j, sum[j]);
    }
  }
}

void MqaScore(const MqaScoreParams& p) {
  const std::vector<detail::ScoreRow> rows = detail::read_score_rows(p);
  const float inf = std::numeric_limits<float>::infinity();
  const int64_t dp = padded_dim(p.dim);
  // Rows by request: a request's rows share its keys. Padding rows are all -inf.
  std::vector<std::vector<int64_t>> by_req(static_cast<size_t>(p.batch));
  for (int64_t i = 0; i < static_cast<int64_t>(rows.size()); ++i) {
    if (rows[i].valid) {
      by_req[rows[i].req].push_back(i);
    } else {
      for (int64_t b = 0; b < p.num_blocks; ++b)
        p.out[rows[i].out_off + b * p.out_col_stride] = -inf;
    }
  }
  for (int64_t r = 0; r < p.batch; ++r) {
    const std::vector<int64_t>& mine = by_req[r];
    if (mine.empty()) continue;
    // Keys past the last block any of the request's rows can see are never scored.
    int64_t keys = 0;
    for (int64_t i : mine) keys = std::max(keys, std::min(p.num_blocks, (rows[i].pos + 1) / 4));
    // Key block b of the request: its page (paged keys; missing pages give -inf columns).
    auto page_of = [&](int64_t b) -> int64_t {
      return p.block_table[r * p.block_table_batch_stride +
                           (b / p.page_size) * p.block_table_page_stride];
    };
    auto exists = [&](int64_t b) {
      return !p.block_table || (page_of(b) >= 0 && page_of(b) < p.num_pages);
    };
    KeyTiles kt;
    kt.dp = dp;
    kt.fill(p.k, p.k_dtype, p.k_dim_stride, p.dim, keys, [&](int64_t b) -> int64_t {
      if (!exists(b)) return -1;
      if (!p.block_table) return r * p.k_batch_stride + b * p.k_row_stride;
      return page_of(b) * p.k_batch_stride + (b % p.page_size) * p.k_row_stride;
    });
    const int64_t chunks = (static_cast<int64_t>(mine.size()) + kRowChunk - 1) / kRowChunk;
#pragma omp parallel
    {
      RowScratch sc(p.heads, dp);
#pragma omp for schedule(dynamic, 1)
      for (int64_t c = 0; c < chunks; ++c) {
        const int64_t first = c * kRowChunk;
        const int64_t n = std::min<int64_t>(kRowChunk, static_cast<int64_t>(mine.size()) - first);
        auto row_of = [&](int64_t i) -> const detail::ScoreRow& { return rows[mine[first + i]]; };
        for (int64_t i = 0; i < n; ++i) {
          for (int64_t b = 0; b < p.num_blocks; ++b)
            p.out[row_of(i).out_off + b * p.out_col_stride] = -inf;
        }
        score_chunk(
            p.q, p.dtype, p.q_head_stride, p.q_dim_stride, p.heads, p.dim, n,
            [&](int64_t i) { return row_of(i).q_off; }, kt, 0, kt.tiles, p.scale, sc,
            [&](int64_t i, int64_t b, float v) {
              const detail::ScoreRow& row = row_of(i);
              if (b < keys && 4 * b + 3 <= row.pos && exists(b)) {
                p.out[row.out_off + b * p.out_col_stride] = v;
              }
            });
      }
    }
  }
}

void MqaPrefill(const MqaPrefillParams& p) {
  const float inf = std::numeric_limits<float>::infinity();
  KeyTiles kt;
  kt.dp = padded_dim(p.dim);
  kt.fill(p.k, p.k_dtype, p.k_dim_stride, p.dim, p.keys,
          [&](int64_t j) -> int64_t { return j * p.k_row_stride; });
  const int64_t chunks = (p.rows + kRowChunk - 1) / kRowChunk;
#pragma omp parallel
  {
    RowScratch sc(p.heads, kt.dp);
#pragma omp for schedule(dynamic, 1)
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t r0 = c * kRowChunk, n = std::min(kRowChunk, p.rows - r0);
      auto start = [&](int64_t i) {
        return std::max<int64_t>(p.row_starts[(r0 + i) * p.row_starts_stride], 0);
      };
      auto end = [&](int64_t i) {
        return std::min<int64_t>(p.row_ends[(r0 + i) * p.row_ends_stride], p.keys);
      };
      int64_t lo = p.keys, hi = 0;  // the chunk's keys: the union of its rows' windows
      for (int64_t i = 0; i < n; ++i) {
        for (int64_t j = 0; j < p.keys; ++j)
          p.out[(r0 + i) * p.out_row_stride + j * p.out_col_stride] = -inf;
        if (start(i) < end(i)) lo = std::min(lo, start(i)), hi = std::max(hi, end(i));
      }
      if (lo >= hi) continue;
      score_chunk(
          p.q, p.dtype, p.q_head_stride, p.q_dim_stride, p.heads, p.dim, n,
          [&](int64_t i) { return (r0 + i) * p.q_row_stride; }, kt, lo / kTile,
          (hi + kTile - 1) / kTile, p.scale, sc,
          [&](int64_t i, int64_t j, float v) {
            if (j >= start(i) && j < end(i))
              p.out[(r0 + i) * p.out_row_stride + j * p.out_col_stride] = v;
          });
    }
  }
}

void MqaDecode(const MqaDecodeParams& p) {
  // An empty out has nothing to write, and its rows are bounded by no memory (q may broadcast).
  if (p.max_model_len == 0) return;
  const float inf = std::numeric_limits<float>::infinity();
  const int64_t dp = padded_dim(p.dim);
  // A row sees the columns below its context length, within the output and the page table.
  const int64_t visible = std::min(p.max_model_len, p.max_pages * p.page_size);
#pragma omp parallel
  {
    RowScratch sc(p.heads, dp);
    std::vector<int64_t> keys_of(static_cast<size_t>(p.rows));  // per row of the request
    std::vector<int64_t> live;                                  // rows that see a key
#pragma omp for schedule(dynamic, 1)
    for (int64_t b = 0; b < p.batch; ++b) {
      auto out_row = [&](int64_t r) { return p.out + (b * p.rows + r) * p.out_row_stride; };
      // The request's rows share its keys: the tiles up to its longest context are filled once.
      int64_t keys = 0;
      live.clear();
      for (int64_t r = 0; r < p.rows; ++r) {
        float* out = out_row(r);
        for (int64_t c = 0; c < p.max_model_len; ++c) out[c * p.out_col_stride] = -inf;
        keys_of[r] = std::clamp<int64_t>(
            p.context_lens[b * p.context_lens_batch_stride + r * p.context_lens_row_stride], 0,
            visible);
        if (keys_of[r] > 0) live.push_back(r);
        keys = std::max(keys, keys_of[r]);
      }
      if (live.empty()) continue;
      auto page_of = [&](int64_t c) {
        return p.page_table[b * p.page_table_batch_stride +
                            (c / p.page_size) * p.page_table_page_stride];
      };
      KeyTiles kt;
      kt.dp = dp;
      kt.fill(p.k_cache, p.k_dtype, p.k_dim_stride, p.dim, keys, [&](int64_t c) -> int64_t {
        const int64_t page = page_of(c);
        if (page < 0 || page >= p.num_pages) return -1;
        return page * p.k_page_stride + (c % p.page_size) * p.k_slot_stride;
      });
      const auto n_live = static_cast<int64_t>(live.size());
      for (int64_t first = 0; first < n_live; first += kRowChunk) {
        const int64_t n = std::min(kRowChunk, n_live - first);
        int64_t chunk_keys = 0;
        for (int64_t i = 0; i < n; ++i) chunk_keys = std::max(chunk_keys, keys_of[live[first + i]]);
        score_chunk(
            p.q, p.dtype, p.q_head_stride, p.q_dim_stride, p.heads, p.dim, n,
            [&](int64_t i) { return b * p.q_batch_stride + live[first + i] * p.q_row_stride; }, kt,
            0, (chunk_keys + kTile - 1) / kTile, p.scale, sc,
            [&](int64_t i, int64_t c, float v) {
              const int64_t r = live[first + i];
              if (c >= keys_of[r]) return;
              const int64_t page = page_of(c);
              if (page >= 0 && page < p.num_pages) out_row(r)[c * p.out_col_stride] = v;
            });
      }
    }
  }
}

}  // namespace sparse_attn::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace sparse_attn {
namespace cpu {
HWY_EXPORT(MqaScore);
HWY_EXPORT(MqaPrefill);
HWY_EXPORT(MqaDecode);
}  // namespace cpu

void cpu_mqa_score(const detail::MqaScoreParams& params) {
  HWY_DYNAMIC_DISPATCH(cpu::MqaScore)(params);
}
void cpu_mqa_prefill(const detail::MqaPrefillParams& params) {
  HWY_DYNAMIC_DISPATCH(cpu::MqaPrefill)(params);
}
void cpu_mqa_decode(const detail::MqaDecodeParams& params) {
  HWY_DYNAMIC_DISPATCH(cpu::MqaDecode)(params);
}

}  // namespace sparse_attn
#endif
