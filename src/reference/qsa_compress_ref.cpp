#include "reference/qsa_compress_ref.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "api/check.h"
#include "sparse_attn/dtype.h"

namespace sparse_attn::detail {
namespace {

constexpr int64_t kB = kCompressBlockTokens;

int64_t floor_div(int64_t a, int64_t b) { return a >= 0 ? a / b : -((-a + b - 1) / b); }

// The complete blocks of one request: [first, end), and where its rows start.
struct RequestBlocks {
  int64_t row_base;  // element offset of the request's row 0
  int64_t start;     // position of row 0
  int64_t first, end;
};

std::vector<RequestBlocks> request_blocks(const CompressBlockKeysParams& p, int64_t total_rows) {
  std::vector<RequestBlocks> req(static_cast<size_t>(p.batch));
  for (int64_t r = 0; r < p.batch; ++r) {
    int64_t begin = 0, rows = p.tokens_per_request;
    if (p.cu_seqlens) {
      begin = p.cu_seqlens[r * p.cu_seqlens_stride];
      const int64_t end = p.cu_seqlens[(r + 1) * p.cu_seqlens_stride];
      if ((r == 0 && begin != 0) || end < begin || (r + 1 == p.batch && end != total_rows)) {
        throw_value_error(
            "cu_seqlens: expected non-decreasing offsets from 0 to the key rows ({}), got {} "
            "then {} at request {}",
            total_rows, begin, end, r);
      }
      rows = end - begin;
    }
    const int64_t s = p.start_positions ? p.start_positions[r * p.start_positions_stride] : 0;
    RequestBlocks& q = req[static_cast<size_t>(r)];
    q.row_base = p.cu_seqlens ? begin * p.keys_row_stride : r * p.keys_batch_stride;
    q.start = s;
    // Block b needs positions 4b .. 4b + 3 inside [max(s, 0), s + rows).
    q.first = std::max<int64_t>(0, floor_div(s + kB - 1, kB));
    q.end = std::max(q.first, floor_div(s + rows, kB));
    if (p.cos && q.end > q.first && kB * (q.end - 1) >= p.rope_rows) {
      throw_value_error(
          "cos, sin: request {} completes block {} at position {}, past the tables' {} rows", r,
          q.end - 1, kB * (q.end - 1), p.rope_rows);
    }
  }
  return req;
}

// cos and sin of the angle of frequency column j at position pos.
void rope_factors(const CompressBlockKeysParams& p, int64_t pos, int64_t d, int64_t j, float& c,
                  float& s) {
  if (p.cos) {
    const int64_t col = p.rope_cols == p.rope_dim ? d : j;
    c = p.cos[pos * p.cos_row_stride + col * p.cos_col_stride];
    s = p.sin[pos * p.sin_row_stride + col * p.sin_col_stride];
    return;
  }
  // As transformers: FP32 frequency and FP32 angle; the cos/sin of that angle exactly.
  const float inv_freq =
      static_cast<float>(std::pow(p.rope_theta, -2.0 * double(j) / double(p.rope_dim)));
  const float angle = static_cast<float>(pos) * inv_freq;
  c = static_cast<float>(std::cos(double(angle)));
  s = static_cast<float>(std::sin(double(angle)));
}

}  // namespace

void reference_compress_block_keys(const CompressBlockKeysParams& p) {
  const int64_t total_rows = p.tokens_per_request;
  const std::vector<RequestBlocks> req = request_blocks(p, total_rows);
  // Blocks of every request in one index space, so a long single request spreads over threads.
  std::vector<int64_t> offsets(req.size() + 1, 0);
  for (size_t r = 0; r < req.size(); ++r) offsets[r + 1] = offsets[r] + req[r].end - req[r].first;
  const int64_t D = p.dim, half = p.rope_dim / 2;

#pragma omp parallel
  {
    std::vector<float> y(static_cast<size_t>(D));
#pragma omp for schedule(static)
    for (int64_t i = 0; i < offsets.back(); ++i) {
      const int64_t r = std::upper_bound(offsets.begin(), offsets.end(), i) - offsets.begin() - 1;
      const RequestBlocks& q = req[static_cast<size_t>(r)];
      const int64_t b = q.first + (i - offsets[r]);
      const int64_t slot = b % p.page_size, page_index = b / p.page_size;
      if (page_index >= p.max_pages) continue;
      const int64_t page =
          p.block_table
              ? p.block_table[r * p.block_table_row_stride + page_index * p.block_table_col_stride]
              : r;
      if (page < 0 || page >= p.num_pages) continue;

      // Mean of the 4 raw keys, then the RMS over the dims, in FP32.
      const int64_t row0 = q.row_base + (kB * b - q.start) * p.keys_row_stride;
      float sum_sq = 0.f;
      for (int64_t d = 0; d < D; ++d) {
        float sum = 0.f;
        for (int64_t t = 0; t < kB; ++t) {
          sum += load_as_float(p.keys, p.keys_dtype,
                               row0 + t * p.keys_row_stride + d * p.keys_col_stride);
        }
        y[d] = sum / float(kB);
        sum_sq += y[d] * y[d];
      }
      const float inv_rms = 1.f / std::sqrt(sum_sq / float(D) + p.eps);
      for (int64_t d = 0; d < D; ++d) {
        y[d] =
            y[d] * inv_rms * (1.f + load_as_float(p.weight, p.weight_dtype, d * p.weight_stride));
      }

      const int64_t pos = kB * b;
      const int64_t out0 = page * p.out_page_stride + slot * p.out_slot_stride;
      for (int64_t d = 0; d < D; ++d) {
        float v = y[d];
        if (d < p.rope_dim) {
          // Pair (d, partner): the first of a pair takes -sin, the second +sin.
          const bool interleaved = p.rope_style == RopeStyle::kInterleaved;
          const bool first = interleaved ? d % 2 == 0 : d < half;
          const int64_t partner =
              interleaved ? (first ? d + 1 : d - 1) : (first ? d + half : d - half);
          const int64_t j = interleaved ? d / 2 : d % half;
          float c, s;
          rope_factors(p, pos, d, j, c, s);
          v = first ? y[d] * c - y[partner] * s : y[d] * c + y[partner] * s;
        }
        store_from_float(p.out, p.out_dtype, out0 + d * p.out_col_stride, v);
      }
    }
  }
}

}  // namespace sparse_attn::detail
