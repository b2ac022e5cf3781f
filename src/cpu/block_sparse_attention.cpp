// CPU block-sparse attention (block_sparse_attention, _paged; docs/xattention.md): a flash
// attention over the kept 128 x 128 blocks, FP32 throughout.
//
// Per (sequence, KV head) the keys are widened once into K^T tiles [D][128] and the values into
// rows [keys][D] (zero past the last key), shared by the group's query heads. The work items,
// (query head, 128-row query block), go to the threads heaviest first (the last blocks see the
// most keys under a causal mask). An item keeps its rows' Q (pre-scaled by softmax_scale), O,
// row maxima and sums, and for each kept key block computes S = Q K^T, masks it (causal, the
// sequence end), folds it into the online softmax and adds P V (the register-blocked products
// of cpu/tile_products-inl.h).
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "cpu/cpu_kernels.h"
#include "reference/xattn_ref.h"
#include "sparse_attn/dtype.h"

// Highway's dynamic dispatch: foreach_target.h re-includes this file once per target, so the
// order of these includes matters.
// clang-format off
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "cpu/block_sparse_attention.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>
#include <hwy/aligned_allocator.h>
#include <hwy/contrib/math/math-inl.h>
#include "cpu/tile_products-inl.h"
// clang-format on

#ifndef SPARSE_ATTN_CPU_BLOCK_SPARSE_SHARED
#define SPARSE_ATTN_CPU_BLOCK_SPARSE_SHARED
namespace sparse_attn::cpu {

constexpr int64_t kBlock = 128;  // the mask's block size: keys per tile, rows per work item

// One item's rows and where its keys end.
struct Item {
  int64_t b, h, qblk;
  int64_t weight;  // keys the last row sees (the work order)
};

// Float buffers of one thread, 64-byte aligned (whole vectors at any target).
using Buffer = hwy::AlignedFreeUniquePtr<float[]>;
inline Buffer buffer(int64_t n) { return hwy::AllocateAligned<float>(static_cast<size_t>(n)); }

// floor(a / kBlock) for any sign (a row before the sequence's first key has a negative
// diagonal block).
inline int64_t floor_div_blocks(int64_t a) {
  return a >= 0 ? a / kBlock : -((-a + kBlock - 1) / kBlock);
}

}  // namespace sparse_attn::cpu
#endif

HWY_BEFORE_NAMESPACE();
namespace sparse_attn::cpu::HWY_NAMESPACE {
static_assert(kTile == kBlock, "a K^T tile is one mask block of keys");

// One row of the online softmax over a tile's scores s[0, kBlock), of which [0, valid) are
// visible: moves the row's max m and sum l, turns s into the weights exp(s - m), and scales the
// row's output o[0, dp) to the new maximum. Natural-log units (Q carries softmax_scale).
void softmax_row(float* s, int64_t valid, float& m, float& l, float* o, int64_t dp) {
  const DF df;
  const int64_t n = hn::Lanes(df);
  const auto neg_inf = hn::Set(df, -std::numeric_limits<float>::infinity());
  for (int64_t t = valid; t < kBlock; ++t) s[t] = -std::numeric_limits<float>::infinity();
  auto vmax = neg_inf;
  for (int64_t t = 0; t < kBlock; t += n) vmax = hn::Max(vmax, hn::Load(df, s + t));
  const float tile_max = hn::GetLane(hn::MaxOfLanes(df, vmax));
  const float m_new = std::max(m, tile_max);
  if (m_new == -std::numeric_limits<float>::infinity()) {  // nothing visible yet: weights 0
    for (int64_t t = 0; t < kBlock; t += n) hn::Store(hn::Zero(df), df, s + t);
    return;
  }
  const auto vm = hn::Set(df, m_new);
  auto vsum = hn::Zero(df);
  for (int64_t t = 0; t < kBlock; t += n) {
    const auto w = hn::Exp(df, hn::Sub(hn::Load(df, s + t), vm));
    hn::Store(w, df, s + t);
    vsum = hn::Add(vsum, w);
  }
  const float alpha = std::exp(m - m_new);  // 0 when m was -inf
  l = l * alpha + hn::GetLane(hn::SumOfLanes(df, vsum));
  m = m_new;
  if (alpha != 1.f) {
    const auto va = hn::Set(df, alpha);
    for (int64_t c = 0; c < dp; c += n) hn::Store(hn::Mul(hn::Load(df, o + c), va), df, o + c);
  }
}

void BlockSparseAttention(const BlockSparseAttnParams& p) {
  const std::vector<XAttnSequence> seqs = read_block_sparse_sequences(p);
  const int64_t D = p.head_dim, dp = padded_dim(D);
  const float inf = std::numeric_limits<float>::infinity();

  std::vector<int64_t> sparse_index(static_cast<size_t>(p.num_q_heads), -1);
  for (int64_t h = 0, s = 0; h < p.num_q_heads; ++h) {
    if (p.head_mask_type[h] == 1) sparse_index[h] = s++;
  }

  for (int64_t b = 0; b < p.batch; ++b) {
    const XAttnSequence& sq = seqs[b];
    const int64_t offset = sq.k_len - sq.q_len;  // position of query row 0
    const int64_t k_blocks = (sq.k_len + kBlock - 1) / kBlock;
    const int64_t q_blocks = (sq.q_len + kBlock - 1) / kBlock;
    if (sq.q_len == 0) continue;
    // Keys row r sees: [0, key_end(r)).
    auto key_end = [&](int64_t r) {
      return p.causal ? std::clamp<int64_t>(offset + r + 1, 0, sq.k_len) : sq.k_len;
    };
    std::vector<Item> items;
    for (int64_t hg = 0; hg < p.group; ++hg) {
      for (int64_t qblk = 0; qblk < q_blocks; ++qblk) {
        const int64_t last = std::min((qblk + 1) * kBlock, sq.q_len) - 1;
        items.push_back({b, hg, qblk, key_end(last)});
      }
    }
    std::stable_sort(items.begin(), items.end(),
                     [](const Item& x, const Item& y) { return x.weight > y.weight; });
    Buffer kt = buffer(std::max<int64_t>(k_blocks, 1) * dp * kBlock);
    Buffer vr = buffer(std::max<int64_t>(k_blocks, 1) * kBlock * dp);

    for (int64_t kvh = 0; kvh < p.num_kv_heads; ++kvh) {
      // The keys and values of (b, kvh), widened: K^T per key block, V by rows, zero padded.
#pragma omp parallel for schedule(static)
      for (int64_t t = 0; t < k_blocks * kBlock; ++t) {
        float* ktb = kt.get() + (t / kBlock) * dp * kBlock + t % kBlock;
        float* vrow = vr.get() + t * dp;
        std::fill(vrow, vrow + dp, 0.f);
        for (int64_t d = 0; d < dp; ++d) ktb[d * kBlock] = 0.f;
        if (t >= sq.k_len) continue;
        int64_t kbase = 0, vbase = 0;
        block_sparse_kv_offsets(p, sq, b, kvh, t, &kbase, &vbase);
        for (int64_t d = 0; d < D; ++d) {
          ktb[d * kBlock] = load_as_float(p.k, p.dtype, kbase + d * p.k_stride[3]);
          vrow[d] = load_as_float(p.v, p.dtype, vbase + d * p.v_stride[3]);
        }
      }

#pragma omp parallel
      {
        Buffer q = buffer(kBlock * dp), o = buffer(kBlock * dp), s = buffer(kBlock * kBlock);
        std::vector<float> m(kBlock), l(kBlock);
#pragma omp for schedule(dynamic, 1)
        for (size_t it = 0; it < items.size(); ++it) {
          const Item& item = items[it];
          const int64_t h = kvh * p.group + item.h;
          const int64_t r0 = item.qblk * kBlock;
          const int64_t rows = std::min(kBlock, sq.q_len - r0);
          const int64_t rows_padded = (rows + kRows - 1) / kRows * kRows;
          std::fill(q.get(), q.get() + rows_padded * dp, 0.f);
          std::fill(o.get(), o.get() + rows_padded * dp, 0.f);
          for (int64_t r = 0; r < rows; ++r) {
            const int64_t qbase =
                b * p.q_stride[0] + (sq.q_start + r0 + r) * p.q_stride[1] + h * p.q_stride[2];
            for (int64_t d = 0; d < D; ++d) {
              q[r * dp + d] = static_cast<float>(
                  load_as_float(p.q, p.dtype, qbase + d * p.q_stride[3]) * p.softmax_scale);
            }
            m[r] = -inf;
            l[r] = 0.f;
          }

          // The key blocks this item's head reads (docs/xattention.md, "Block-sparse attention").
          const int type = p.head_mask_type[h];
          const int64_t block_last_row = r0 + rows - 1;
          int64_t sink = 0, local = 0;
          const int64_t diagonal =
              p.causal ? floor_div_blocks(offset + block_last_row) : k_blocks - 1;
          if (type == -1) {
            sink = p.streaming_info[2 * h];
            local = p.streaming_info[2 * h + 1];
          }
          const int64_t end = key_end(block_last_row);
          for (int64_t j = 0; j * kBlock < end; ++j) {
            if (type == -1 && !(j < sink || (j > diagonal - local && j <= diagonal))) continue;
            if (type == 1 &&
                p.block_mask[b * p.mask_stride[0] + sparse_index[h] * p.mask_stride[1] +
                             item.qblk * p.mask_stride[2] + j * p.mask_stride[3]] == 0) {
              continue;
            }
            scores(q.get(), rows_padded, dp, kt.get() + j * dp * kBlock, s.get());
            int64_t keys = 0;  // keys of the tile that some row sees
            for (int64_t r = 0; r < rows; ++r) {
              const int64_t valid = std::clamp<int64_t>(key_end(r0 + r) - j * kBlock, 0, kBlock);
              keys = std::max(keys, valid);
              softmax_row(s.get() + r * kBlock, valid, m[r], l[r], o.get() + r * dp, dp);
            }
            for (int64_t r = rows; r < rows_padded; ++r) {
              std::fill(s.get() + r * kBlock, s.get() + (r + 1) * kBlock, 0.f);
            }
            add_pv(s.get(), rows_padded, keys, vr.get() + j * kBlock * dp, dp, o.get());
          }

          for (int64_t r = 0; r < rows; ++r) {
            const int64_t row = sq.q_start + r0 + r;
            const int64_t obase = b * p.out_stride[0] + row * p.out_stride[1] + h * p.out_stride[2];
            const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
            for (int64_t d = 0; d < D; ++d) {
              store_from_float(p.out, p.dtype, obase + d * p.out_stride[3], o[r * dp + d] * inv);
            }
            if (p.lse != nullptr) {
              p.lse[b * p.lse_stride[0] + row * p.lse_stride[1] + h * p.lse_stride[2]] =
                  l[r] > 0.f ? m[r] + std::log(l[r]) : -inf;
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
HWY_EXPORT(BlockSparseAttention);
}  // namespace cpu

void cpu_block_sparse_attention(const BlockSparseAttnParams& params) {
  HWY_DYNAMIC_DISPATCH(cpu::BlockSparseAttention)(params);
}

}  // namespace sparse_attn
#endif
