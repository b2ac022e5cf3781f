#include "reference/qsa_attention_ref.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "api/check.h"
#include "sparse_attn/dtype.h"

namespace sparse_attn {
namespace {

using detail::throw_value_error;

int64_t at(const MetaPtr& p, int64_t stride, int64_t i) { return p[i * stride]; }

}  // namespace

QsaRequests read_qsa_requests(const SparseAttentionParams& p) {
  const int64_t B = p.batch;
  QsaRequests r;
  r.rows.assign(B, 0);
  switch (p.row_mapping) {
    case RowMapping::kPadded:
      r.rows.assign(B, p.q_len);
      break;
    case RowMapping::kSingleRequest:
      r.rows[0] = p.rows;
      break;
    case RowMapping::kCuSeqlens: {
      if (at(p.cu_seqlens_q, p.cu_seqlens_q_stride, 0) != 0) {
        throw_value_error("cu_seqlens_q: expected cu_seqlens_q[0] == 0, got {}",
                          at(p.cu_seqlens_q, p.cu_seqlens_q_stride, 0));
      }
      for (int64_t b = 0; b < B; ++b) {
        const int64_t lo = at(p.cu_seqlens_q, p.cu_seqlens_q_stride, b);
        const int64_t hi = at(p.cu_seqlens_q, p.cu_seqlens_q_stride, b + 1);
        if (hi < lo) {
          throw_value_error(
              "cu_seqlens_q: expected nondecreasing offsets, got {} then {} at "
              "request {}",
              lo, hi, b);
        }
        r.rows[b] = hi - lo;
      }
      const int64_t end = at(p.cu_seqlens_q, p.cu_seqlens_q_stride, B);
      if (end != p.rows) {
        throw_value_error(
            "cu_seqlens_q: expected the last offset to equal the {} query rows, "
            "got {}",
            p.rows, end);
      }
      break;
    }
    case RowMapping::kTokenToReq:
      for (int64_t i = 0; i < p.rows; ++i) {
        const int64_t b = at(p.token_to_req, p.token_to_req_stride, i);
        if (b == -1) continue;  // a padding row: no request's
        if (b < 0 || b >= B) {
          throw_value_error(
              "token_to_req: expected request ids in [0, {}) or -1 (a padding row), got {} at "
              "row {}",
              B, b, i);
        }
        ++r.rows[b];
      }
      break;
    case RowMapping::kNone:
      break;
  }

  r.seq_len_q = r.rows;
  if (p.seq_lens_q) {
    for (int64_t b = 0; b < B; ++b) {
      const int64_t n = at(p.seq_lens_q, p.seq_lens_q_stride, b);
      if (n < 0 || n > r.rows[b]) {
        throw_value_error(
            "seq_lens_q: expected 0 <= seq_lens_q[{}] <= {} (the request's query "
            "rows), got {}",
            b, r.rows[b], n);
      }
      r.seq_len_q[b] = n;
    }
  }

  std::vector<int64_t> capacity(B, p.kv_capacity);
  if (p.kv_layout == KVLayout::kVarlen) {
    r.kv_start.assign(B, 0);
    const int64_t first = at(p.cu_seqlens_k, p.cu_seqlens_k_stride, 0);
    if (first < 0) throw_value_error("cu_seqlens_k: expected cu_seqlens_k[0] >= 0, got {}", first);
    for (int64_t b = 0; b < B; ++b) {
      const int64_t lo = at(p.cu_seqlens_k, p.cu_seqlens_k_stride, b);
      const int64_t hi = at(p.cu_seqlens_k, p.cu_seqlens_k_stride, b + 1);
      if (hi < lo) {
        throw_value_error(
            "cu_seqlens_k: expected nondecreasing offsets, got {} then {} at "
            "request {}",
            lo, hi, b);
      }
      r.kv_start[b] = lo;
      capacity[b] = hi - lo;
    }
    const int64_t end = at(p.cu_seqlens_k, p.cu_seqlens_k_stride, B);
    if (end > p.total_kv) {
      throw_value_error("cu_seqlens_k: expected the last offset <= {} (key.shape[0]), got {}",
                        p.total_kv, end);
    }
  }
  r.seq_len_k = capacity;
  if (p.seq_lens_k) {
    for (int64_t b = 0; b < B; ++b) {
      const int64_t n = at(p.seq_lens_k, p.seq_lens_k_stride, b);
      if (n < 0 || n > capacity[b]) {
        throw_value_error(
            "seq_lens_k: expected 0 <= seq_lens_k[{}] <= {} (the request's KV "
            "capacity), got {}",
            b, capacity[b], n);
      }
      r.seq_len_k[b] = n;
    }
  }
  return r;
}

std::vector<QsaRow> read_qsa_rows(const SparseAttentionParams& p, const QsaRequests& req) {
  std::vector<QsaRow> rows(p.rows);
  if (p.kv_layout == KVLayout::kPhysical) {
    for (auto& r : rows) r.active = true;
    return rows;
  }
  for (int64_t r = 0; r < p.rows; ++r) {
    int64_t b = 0;
    int64_t i = r;
    switch (p.row_mapping) {
      case RowMapping::kPadded:
        b = r / p.q_len;
        i = r % p.q_len;
        break;
      case RowMapping::kCuSeqlens:
        // Requests are few; a linear walk keeps the reference obviously right.
        while (at(p.cu_seqlens_q, p.cu_seqlens_q_stride, b + 1) <= r) ++b;
        i = r - at(p.cu_seqlens_q, p.cu_seqlens_q_stride, b);
        break;
      case RowMapping::kTokenToReq:
        b = at(p.token_to_req, p.token_to_req_stride, r);
        if (b == -1) continue;  // a padding row stays inactive: zero output, LSE -inf
        // Validation made token_to_req come with positions and without seq_lens_q, so the
        // row's index within its request decides nothing: no row's is counted.
        i = 0;
        break;
      case RowMapping::kSingleRequest:
      case RowMapping::kNone:
        break;
    }
    QsaRow& info = rows[r];
    info.request = b;
    info.seq_len_k = req.seq_len_k[b];
    if (p.query_positions) {
      const int64_t off =
          p.row_mapping == RowMapping::kPadded
              ? b * p.query_positions_batch_stride + i * p.query_positions_row_stride
              : r * p.query_positions_row_stride;
      info.position = p.query_positions[off];
    } else {
      info.position = req.seq_len_k[b] - req.seq_len_q[b] + i;
    }
    // Rows past the request's seq_lens_q and rows at a negative position are padding rows.
    info.active = i < req.seq_len_q[b] && info.position >= 0;
  }
  return rows;
}

bool locate_qsa_token(const SparseAttentionParams& p, const QsaRequests& req, const QsaRow& row,
                      int64_t t, int64_t* k_off, int64_t* v_off) {
  if (p.kv_layout == KVLayout::kPhysical) {
    if (t < 0 || t >= p.total_kv) return false;
    *k_off = t * p.k_token_stride;
    *v_off = t * p.v_token_stride;
    return true;
  }
  if (t < 0 || t >= row.seq_len_k || t > row.position) return false;
  const int64_t b = row.request;
  switch (p.kv_layout) {
    case KVLayout::kPadded:
      *k_off = b * p.k_batch_stride + t * p.k_token_stride;
      *v_off = b * p.v_batch_stride + t * p.v_token_stride;
      return true;
    case KVLayout::kVarlen:
      *k_off = (req.kv_start[b] + t) * p.k_token_stride;
      *v_off = (req.kv_start[b] + t) * p.v_token_stride;
      return true;
    case KVLayout::kPaged: {
      const int64_t slot = t / p.page_size;
      if (slot >= p.max_pages) return false;
      const int64_t page =
          p.block_table[b * p.block_table_batch_stride + slot * p.block_table_page_stride];
      if (page < 0 || page >= p.num_pages) return false;
      const int64_t in_page = t % p.page_size;
      *k_off = page * p.k_batch_stride + in_page * p.k_token_stride;
      *v_off = page * p.v_batch_stride + in_page * p.v_token_stride;
      return true;
    }
    case KVLayout::kPhysical:
      break;
  }
  return false;
}

void reference_sparse_attention(const SparseAttentionParams& p) {
  const QsaRequests req = read_qsa_requests(p);
  const std::vector<QsaRow> rows = read_qsa_rows(p, req);
  const int64_t D = p.head_dim;
  const DType dt = p.dtype;
  const DType kv_dt = p.kv_dtype;
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();

#pragma omp parallel
  {
    // Per thread: the row's valid tokens, and their K/V rows of one KV head as float (the stored
    // value times k_scale / v_scale, which are 1 for 16-bit K/V), gathered once per KV head and
    // reused by the group's query heads. K is stored transposed
    // (kt[d * n + j]) so the score loop runs over tokens; each score is still the plain
    // sequential sum over d.
    std::vector<int64_t> k_offs, v_offs;
    std::vector<float> kt, vf, q, s, o;
    q.resize(D);
    o.resize(D);
#pragma omp for schedule(dynamic, 1)
    for (int64_t r = 0; r < p.rows; ++r) {
      const QsaRow& row = rows[r];
      k_offs.clear();
      v_offs.clear();
      if (row.active) {
        for (int64_t j = 0; j < p.width; ++j) {
          const int64_t t =
              p.token_indices[r * p.token_indices_row_stride + j * p.token_indices_col_stride];
          int64_t ko = 0, vo = 0;
          if (locate_qsa_token(p, req, row, t, &ko, &vo)) {
            k_offs.push_back(ko);
            v_offs.push_back(vo);
          }
        }
      }
      const int64_t n = static_cast<int64_t>(k_offs.size());
      kt.resize(n * D);
      vf.resize(n * D);
      s.resize(n);
      for (int64_t g = 0; g < p.num_kv_heads; ++g) {
        // K is transposed a tile of tokens at a time so each write fills a cache line.
        constexpr int64_t kTile = 16;
        for (int64_t j0 = 0; j0 < n; j0 += kTile) {
          const int64_t j1 = std::min(n, j0 + kTile);
          for (int64_t d = 0; d < D; ++d) {
            for (int64_t j = j0; j < j1; ++j) {
              kt[d * n + j] =
                  load_as_float(p.k, kv_dt, k_offs[j] + g * p.k_head_stride + d * p.k_dim_stride) *
                  p.k_scale;
            }
          }
        }
        for (int64_t j = 0; j < n; ++j) {
          for (int64_t d = 0; d < D; ++d) {
            vf[j * D + d] =
                load_as_float(p.v, kv_dt, v_offs[j] + g * p.v_head_stride + d * p.v_dim_stride) *
                p.v_scale;
          }
        }
        for (int64_t h = g * p.group; h < (g + 1) * p.group; ++h) {
          float lse = kNegInf;
          std::fill(o.begin(), o.end(), 0.f);
          if (n > 0) {
            for (int64_t d = 0; d < D; ++d) {
              q[d] = load_as_float(p.q, dt,
                                   r * p.q_row_stride + h * p.q_head_stride + d * p.q_dim_stride);
            }
            // S = scale * q K^T, then a max-subtracted softmax over the n tokens.
            std::fill(s.begin(), s.end(), 0.f);
            for (int64_t d = 0; d < D; ++d) {
              for (int64_t j = 0; j < n; ++j) s[j] += q[d] * kt[d * n + j];
            }
            float m = kNegInf;
            for (int64_t j = 0; j < n; ++j) {
              s[j] *= p.scale;
              m = std::max(m, s[j]);
            }
            float l = 0.f;
            for (int64_t j = 0; j < n; ++j) {
              s[j] = std::exp(s[j] - m);
              l += s[j];
            }
            // O = P V / l
            for (int64_t j = 0; j < n; ++j) {
              for (int64_t d = 0; d < D; ++d) o[d] += s[j] * vf[j * D + d];
            }
            for (int64_t d = 0; d < D; ++d) o[d] /= l;
            lse = m + std::log(l);
          }
          if (p.lse) p.lse[r * p.lse_row_stride + h * p.lse_head_stride] = lse;
          const int64_t out_base = r * p.out_row_stride + h * p.out_head_stride;
          const int64_t gate_base = r * p.gate_row_stride + h * p.gate_head_stride;
          for (int64_t d = 0; d < D; ++d) {
            float val = o[d];
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

}  // namespace sparse_attn
