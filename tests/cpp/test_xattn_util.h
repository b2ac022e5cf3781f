// Double-precision expectations shared by the XAttention tests, written from
// docs/xattention.md independently of src/reference.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <exception>
#include <functional>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "sparse_attn/errors.h"
#include "sparse_attn/tensor.h"
#include "test_util.h"

namespace sparse_attn::xattn_testing {

// The selection rule's inputs besides the sums.
struct SelectRule {
  std::vector<double> thresholds;  // per head
  bool causal = true;
  bool keep_sink = false;
  bool keep_recent = false;
  int64_t q_len = 0;
  int64_t k_len = 0;
  int64_t block = 128;
};

// Expected block mask (row-major, 0/1) for sums [B, H, q_blocks, k_blocks]: forced blocks,
// then repeatedly the largest remaining eligible block (lowest index on ties) while the mass
// taken so far is below threshold * eligible mass; threshold 1 takes every eligible block.
inline std::vector<double> expected_mask(const TensorView& sums, const SelectRule& r) {
  const int64_t B = sums.size(0), H = sums.size(1), QB = sums.size(2), KB = sums.size(3);
  std::vector<double> out;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < QB; ++i) {
        const int64_t last_pos = (r.k_len - r.q_len) + std::min((i + 1) * r.block, r.q_len) - 1;
        const int64_t diag = last_pos / r.block;
        std::vector<double> keep(KB, 0.0);
        std::vector<bool> eligible(KB, false), forced(KB, false);
        for (int64_t j = 0; j < KB; ++j) eligible[j] = !r.causal || j <= diag;
        if (r.causal || r.keep_recent) forced[diag] = true;
        if (r.keep_sink) forced[0] = true;
        std::vector<int64_t> order;
        for (int64_t j = 0; j < KB; ++j)
          if (forced[j]) order.push_back(j);
        std::vector<bool> used = forced;
        for (;;) {
          int64_t best = -1;
          for (int64_t j = 0; j < KB; ++j) {
            if (!eligible[j] || used[j]) continue;
            if (best < 0 || testing::get(sums, {b, h, i, j}) > testing::get(sums, {b, h, i, best}))
              best = j;
          }
          if (best < 0) break;
          used[best] = true;
          order.push_back(best);
        }
        double total = 0;
        for (int64_t j : order) total += testing::get(sums, {b, h, i, j});
        const double t = r.thresholds[h];
        double taken = 0;
        for (int64_t j : order) {
          if (t >= 1.0 || forced[j] || taken < t * total) {
            keep[j] = 1.0;
            taken += testing::get(sums, {b, h, i, j});
          } else {
            break;
          }
        }
        out.insert(out.end(), keep.begin(), keep.end());
      }
  return out;
}

// One sequence of an attention problem: lengths and element access (b is implied).
struct AttnSequence {
  int64_t q_len = 0, k_len = 0;
  std::function<double(int64_t r, int64_t h, int64_t d)> q;
  std::function<double(int64_t t, int64_t kvh, int64_t d)> k, v;
  // base_blockmask[b, s, i, j] of this sequence, for block-sparse head number s.
  std::function<bool(int64_t s, int64_t i, int64_t j)> mask;
};

// Which keys each head may read (docs/xattention.md, "Block-sparse attention").
struct AttnHeads {
  std::vector<int> types;      // per query head: -1, 0, 1
  std::vector<int> streaming;  // 2 per query head (sink, local)
  int64_t num_kv_heads = 1;
  int64_t dim = 0;
  double scale = 0;
  bool causal = true;
};

// Attention of one (row, head): output [D] and natural-log LSE; zero and -inf for a row that
// sees no key.
struct AttnRow {
  std::vector<double> out;
  double lse = -std::numeric_limits<double>::infinity();
};

// Expected rows [h][r] of one sequence: a visibility matrix from the block rules and the
// bottom-right causal rule, then a dense masked softmax.
inline std::vector<std::vector<AttnRow>> expected_attention(const AttnSequence& s,
                                                            const AttnHeads& a) {
  const int64_t hq = static_cast<int64_t>(a.types.size());
  const int64_t group = hq / a.num_kv_heads;
  const int64_t kblocks = (s.k_len + 127) / 128;
  std::vector<std::vector<AttnRow>> res(hq, std::vector<AttnRow>(s.q_len));
  for (int64_t h = 0, sparse = 0; h < hq; ++h) {
    const int64_t mask_head = a.types[h] == 1 ? sparse++ : -1;
    for (int64_t r = 0; r < s.q_len; ++r) {
      const int64_t i = r / 128;
      std::vector<bool> visible(s.k_len, false);
      for (int64_t t = 0; t < s.k_len; ++t) {
        const int64_t j = t / 128;
        bool ok = true;
        if (a.types[h] == 1) ok = s.mask(mask_head, i, j);
        if (a.types[h] == -1) {
          // The block of the query block's last visible key (causal), else the last block.
          const int64_t last_row = std::min(128 * i + 127, s.q_len - 1);
          const int64_t last_key = s.k_len - s.q_len + last_row;
          const int64_t d =
              a.causal ? static_cast<int64_t>(std::floor(last_key / 128.0)) : kblocks - 1;
          ok = j < a.streaming[2 * h] || (j <= d && j > d - a.streaming[2 * h + 1]);
        }
        if (a.causal && t > s.k_len - s.q_len + r) ok = false;
        visible[t] = ok;
      }
      std::vector<double> logit(s.k_len, -std::numeric_limits<double>::infinity());
      double m = -std::numeric_limits<double>::infinity();
      for (int64_t t = 0; t < s.k_len; ++t) {
        if (!visible[t]) continue;
        double dot = 0;
        for (int64_t d = 0; d < a.dim; ++d) dot += s.q(r, h, d) * s.k(t, h / group, d);
        logit[t] = dot * a.scale;
        m = std::max(m, logit[t]);
      }
      AttnRow& row = res[h][r];
      row.out.assign(a.dim, 0.0);
      if (m == -std::numeric_limits<double>::infinity()) continue;
      double z = 0;
      for (int64_t t = 0; t < s.k_len; ++t) {
        if (!visible[t]) continue;
        const double w = std::exp(logit[t] - m);
        z += w;
        for (int64_t d = 0; d < a.dim; ++d) row.out[d] += w * s.v(t, h / group, d);
      }
      for (double& o : row.out) o /= z;
      row.lse = m + std::log(z);
    }
  }
  return res;
}

using testing::expect_error;

// A paged KV cache of `batch` requests of k_len keys (bf16, uniform in [-1, 1]): one
// [pages, page_size, Hkv, 2 D] buffer holding K in the first D features and V in the last (as
// engines keep them), each request's pages at shuffled ids with a spare table slot of -1 past
// them; and the same keys and values as contiguous host tensors [batch, Hkv, k_len, D].
struct PagedCache {
  Tensor cache, table, key, value;
  TensorView k_cache, v_cache;

  PagedCache(int64_t batch, int64_t hkv, int64_t dim, int64_t page_size, int64_t k_len,
             std::mt19937_64& rng) {
    const int64_t per_req = (k_len + page_size - 1) / page_size, pages = batch * per_req + 3;
    cache = testing::random_tensor({pages, page_size, hkv, 2 * dim}, DType::kBF16, rng);
    k_cache = cache.view().narrow(3, 0, dim);
    v_cache = cache.view().narrow(3, dim, dim);
    std::vector<int32_t> ids(static_cast<size_t>(pages));
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), rng);
    std::vector<int32_t> slots;
    for (int64_t b = 0; b < batch; ++b)
      for (int64_t p = 0; p <= per_req; ++p)
        slots.push_back(p < per_req ? ids[b * per_req + p] : -1);
    table = testing::int32_tensor({batch, per_req + 1}, slots);
    key = Tensor::empty({batch, hkv, k_len, dim}, DType::kBF16);
    value = Tensor::empty({batch, hkv, k_len, dim}, DType::kBF16);
    for (int64_t b = 0; b < batch; ++b)
      for (int64_t t = 0; t < k_len; ++t) {
        const int64_t page = slots[b * (per_req + 1) + t / page_size];
        for (int64_t h = 0; h < hkv; ++h) {
          copy_into(key.view().select(0, b).select(0, h).select(0, t),
                    k_cache.select(0, page).select(0, t % page_size).select(0, h));
          copy_into(value.view().select(0, b).select(0, h).select(0, t),
                    v_cache.select(0, page).select(0, t % page_size).select(0, h));
        }
      }
  }
};

}  // namespace sparse_attn::xattn_testing
