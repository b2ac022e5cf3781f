// Reference of block_sparse_attention (docs/xattention.md, "Block-sparse attention").
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "reference/xattn_ref.h"
#include "sparse_attn/dtype.h"
#include "sparse_attn/errors.h"

namespace sparse_attn {
namespace {

// floor(a / b) for b > 0 and any a (C++ division truncates toward zero).
int64_t floor_div(int64_t a, int64_t b) { return a >= 0 ? a / b : -((-a + b - 1) / b); }

template <typename... Args>
[[noreturn]] void broken(fmt::format_string<Args...> f, Args&&... args) {
  throw ValueError(fmt::format(f, std::forward<Args>(args)...));
}

// Reads cu_seqlens [batch + 1] (entry b at cu[b * stride]) and checks the promise:
// non-decreasing offsets in [0, total], lengths <= max_len.
std::vector<int64_t> read_offsets(const MetaPtr& cu, int64_t stride, int64_t batch, int64_t total,
                                  int64_t max_len, const char* name, const char* total_name,
                                  const char* max_name) {
  std::vector<int64_t> off(static_cast<size_t>(batch + 1));
  for (int64_t b = 0; b <= batch; ++b) off[b] = cu[b * stride];
  if (off[0] < 0 || off[0] > total) {
    broken("{}: expected offsets within [0, {} = {}], got {}[0] = {}", name, total_name, total,
           name, off[0]);
  }
  for (int64_t b = 0; b < batch; ++b) {
    if (off[b + 1] < off[b] || off[b + 1] > total) {
      broken("{}: expected non-decreasing offsets within [0, {} = {}], got {}[{}] = {} after {}",
             name, total_name, total, name, b + 1, off[b + 1], off[b]);
    }
    if (off[b + 1] - off[b] > max_len) {
      broken("{}: sequence {} has length {}, more than {} = {}", name, b, off[b + 1] - off[b],
             max_name, max_len);
    }
  }
  return off;
}

}  // namespace

std::vector<XAttnSequence> read_block_sparse_sequences(const BlockSparseAttnParams& p) {
  std::vector<XAttnSequence> seqs(static_cast<size_t>(p.batch));
  if (p.cu_seqlens_q) {
    const auto off = read_offsets(p.cu_seqlens_q, p.cu_seqlens_q_stride, p.batch, p.total_q,
                                  p.max_seqlen_q, "cu_seqlens_q", "total_q", "max_seqlen_q");
    for (int64_t b = 0; b < p.batch; ++b) {
      seqs[b].q_start = off[b];
      seqs[b].q_len = off[b + 1] - off[b];
    }
  } else {
    for (auto& s : seqs) s.q_len = p.max_seqlen_q;
  }
  switch (p.kv_layout) {
    case XAttnKVLayout::kPadded:
      for (auto& s : seqs) s.k_len = p.max_seqlen_k;
      break;
    case XAttnKVLayout::kVarlen: {
      const auto off = read_offsets(p.cu_seqlens_k, p.cu_seqlens_k_stride, p.batch, p.total_k,
                                    p.max_seqlen_k, "cu_seqlens_k", "total_k", "max_seqlen_k");
      for (int64_t b = 0; b < p.batch; ++b) {
        seqs[b].k_start = off[b];
        seqs[b].k_len = off[b + 1] - off[b];
      }
      break;
    }
    case XAttnKVLayout::kPaged:
      for (int64_t b = 0; b < p.batch; ++b) {
        const int64_t len = p.seqlens_k[b * p.seqlens_k_stride];
        if (len < 0 || len > p.max_seqlen_k) {
          broken("seqlens_k: expected lengths in [0, max_seqlen_k = {}], got seqlens_k[{}] = {}",
                 p.max_seqlen_k, b, len);
        }
        for (int64_t page = 0; page * p.page_size < len; ++page) {
          const int64_t id =
              p.block_table[b * p.block_table_stride[0] + page * p.block_table_stride[1]];
          if (id < 0 || id >= p.num_pages) {
            broken(
                "block_table: sequence {} needs page slot {} (keys {}..{}), which holds {}; "
                "expected a page id in [0, {})",
                b, page, page * p.page_size, std::min(len, (page + 1) * p.page_size) - 1, id,
                p.num_pages);
          }
        }
        seqs[b].k_len = len;
      }
      break;
  }
  return seqs;
}

void block_sparse_kv_offsets(const BlockSparseAttnParams& p, const XAttnSequence& s, int64_t b,
                             int64_t kvh, int64_t t, int64_t* k_off, int64_t* v_off) {
  if (p.kv_layout == XAttnKVLayout::kPaged) {
    const int64_t page =
        p.block_table[b * p.block_table_stride[0] + (t / p.page_size) * p.block_table_stride[1]];
    *k_off = page * p.k_stride[0] + (t % p.page_size) * p.k_stride[1];
    *v_off = page * p.v_stride[0] + (t % p.page_size) * p.v_stride[1];
  } else {
    *k_off = b * p.k_stride[0] + (s.k_start + t) * p.k_stride[1];
    *v_off = b * p.v_stride[0] + (s.k_start + t) * p.v_stride[1];
  }
  *k_off += kvh * p.k_stride[2];
  *v_off += kvh * p.v_stride[2];
}

namespace {

// The keys and values of one (sequence, KV head), widened to float: [k_len, D] each.
void load_kv(const BlockSparseAttnParams& p, const XAttnSequence& s, int64_t b, int64_t kvh,
             std::vector<float>& k, std::vector<float>& v) {
  const int64_t D = p.head_dim;
  k.resize(static_cast<size_t>(s.k_len * D));
  v.resize(static_cast<size_t>(s.k_len * D));
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < s.k_len; ++t) {
    int64_t kbase = 0, vbase = 0;
    block_sparse_kv_offsets(p, s, b, kvh, t, &kbase, &vbase);
    for (int64_t d = 0; d < D; ++d) {
      k[t * D + d] = load_as_float(p.k, p.dtype, kbase + d * p.k_stride[3]);
      v[t * D + d] = load_as_float(p.v, p.dtype, vbase + d * p.v_stride[3]);
    }
  }
}

}  // namespace

void reference_block_sparse_attention(const BlockSparseAttnParams& p) {
  const std::vector<XAttnSequence> seqs = read_block_sparse_sequences(p);
  const int64_t D = p.head_dim;
  const int64_t BS = p.block_size;

  // Mask index of each block-sparse head: the count of type-1 heads before it.
  std::vector<int64_t> sparse_index(static_cast<size_t>(p.num_q_heads), -1);
  for (int64_t h = 0, s = 0; h < p.num_q_heads; ++h) {
    if (p.head_mask_type[h] == 1) sparse_index[h] = s++;
  }

  std::vector<float> k, v;
  for (int64_t b = 0; b < p.batch; ++b) {
    const XAttnSequence& s = seqs[b];
    const int64_t offset = s.k_len - s.q_len;  // position of query row 0
    const int64_t k_blocks = (s.k_len + BS - 1) / BS;
    for (int64_t kvh = 0; kvh < p.num_kv_heads; ++kvh) {
      load_kv(p, s, b, kvh, k, v);
#pragma omp parallel for collapse(2) schedule(dynamic, 16)
      for (int64_t hg = 0; hg < p.group; ++hg) {
        for (int64_t r = 0; r < s.q_len; ++r) {
          const int64_t h = kvh * p.group + hg;
          const int64_t row = s.q_start + r;
          const int64_t qbase = b * p.q_stride[0] + row * p.q_stride[1] + h * p.q_stride[2];
          std::vector<double> q(static_cast<size_t>(D));
          for (int64_t d = 0; d < D; ++d)
            q[d] = load_as_float(p.q, p.dtype, qbase + d * p.q_stride[3]);

          // Key blocks this row's head may read, then the causal limit inside them.
          const int64_t qblk = r / BS;
          const int type = p.head_mask_type[h];
          int64_t sink = 0, local = 0, diagonal = 0;
          if (type == -1) {
            sink = p.streaming_info[2 * h];
            local = p.streaming_info[2 * h + 1];
            const int64_t block_last_row = std::min((qblk + 1) * BS, s.q_len) - 1;
            diagonal = p.causal ? floor_div(offset + block_last_row, BS) : k_blocks - 1;
          }
          auto block_allowed = [&](int64_t j) {
            if (type == 0) return true;
            if (type == -1) return j < sink || (j > diagonal - local && j <= diagonal);
            return p.block_mask[b * p.mask_stride[0] + sparse_index[h] * p.mask_stride[1] +
                                qblk * p.mask_stride[2] + j * p.mask_stride[3]] != 0;
          };
          const int64_t key_end =
              p.causal ? std::clamp<int64_t>(offset + r + 1, 0, s.k_len) : s.k_len;

          std::vector<double> score;
          std::vector<int64_t> keys;
          score.reserve(static_cast<size_t>(key_end));
          keys.reserve(static_cast<size_t>(key_end));
          double max_score = -std::numeric_limits<double>::infinity();
          for (int64_t j = 0; j * BS < key_end; ++j) {
            if (!block_allowed(j)) continue;
            for (int64_t t = j * BS; t < std::min((j + 1) * BS, key_end); ++t) {
              double dot = 0.0;
              const float* kt = &k[t * D];
#pragma omp simd reduction(+ : dot)
              for (int64_t d = 0; d < D; ++d) dot += q[d] * kt[d];
              score.push_back(dot * p.softmax_scale);
              keys.push_back(t);
              max_score = std::max(max_score, score.back());
            }
          }
          std::vector<double> acc(static_cast<size_t>(D), 0.0);
          double denom = 0.0;
          for (size_t i = 0; i < keys.size(); ++i) {
            const double w = std::exp(score[i] - max_score);
            denom += w;
            const float* vt = &v[keys[i] * D];
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) acc[d] += w * vt[d];
          }
          const int64_t obase = b * p.out_stride[0] + row * p.out_stride[1] + h * p.out_stride[2];
          for (int64_t d = 0; d < D; ++d) {
            const double o = keys.empty() ? 0.0 : acc[d] / denom;
            store_from_float(p.out, p.dtype, obase + d * p.out_stride[3], static_cast<float>(o));
          }
          if (p.lse != nullptr) {
            p.lse[b * p.lse_stride[0] + row * p.lse_stride[1] + h * p.lse_stride[2]] =
                keys.empty() ? -std::numeric_limits<float>::infinity()
                             : static_cast<float>(max_score + std::log(denom));
          }
        }
      }
    }
  }
}

}  // namespace sparse_attn
