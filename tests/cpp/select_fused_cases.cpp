#include "select_fused_cases.h"

#include <cmath>

#include "sparse_attn/dtype.h"
#include "test_util.h"

namespace sparse_attn::testing {
namespace {

// Values in [-2, 2] rounded to integers (or, for FP8, codes of such values): products and sums
// are small integers, so equal scores (ties) are common.
Tensor quantised(const Shape& shape, DType dtype, std::mt19937_64& rng) {
  Tensor t = random_tensor(shape, dtype == DType::kF8E4M3 ? DType::kF32 : dtype, rng, -2.f, 2.f);
  if (dtype == DType::kF8E4M3) {
    Tensor f = Tensor::empty(shape, dtype);
    for (int64_t i = 0; i < t.numel(); ++i) {
      f.data_as<uint8_t>()[i] = float_to_fp8_e4m3(std::round(t.data_as<float>()[i]));
    }
    return f;
  }
  for (int64_t i = 0; i < t.numel(); ++i) {
    store_from_float(t.data(), dtype, i, std::round(load_as_float(t.data(), dtype, i)));
  }
  return t;
}

}  // namespace

IndexerInputs make_indexer_inputs(const IndexerForm& f, std::mt19937_64& rng) {
  IndexerInputs in;
  const int64_t B = f.batch, rows = f.rows, nb = f.num_blocks;
  const bool padded = f.q_form == "padded";
  const DType kdt = f.fp8 ? DType::kF8E4M3 : f.dtype;
  in.q = quantised(padded ? Shape{B, rows, f.heads, f.dim} : Shape{B * rows, f.heads, f.dim},
                   f.dtype, rng);
  IndexerScoreOptions& o = in.options;
  if (f.page_size == 0) {
    in.keys = quantised({B, nb, f.dim}, kdt, rng);
  } else {
    const int64_t pages = (nb + f.page_size - 1) / f.page_size, pool = B * pages + 2;
    in.keys = quantised({pool, f.page_size, 1, f.dim}, kdt, rng);
    // -1 and ids past the pool: masked pages.
    in.table = random_int32({B, pages}, rng, -1, static_cast<int32_t>(pool + 1));
    o.block_table = in.table.view();
  }
  const int64_t total = B * rows;
  std::vector<int64_t> req(total), local(total);
  for (int64_t r = 0; r < total; ++r) req[r] = r / rows, local[r] = r % rows;
  if (f.q_form == "cu_seqlens") {
    // Request 1 has no rows; the others share them unevenly.
    const int32_t first = static_cast<int32_t>(rows / 3);
    in.cu = int32_tensor({B + 1}, {0, first, first, static_cast<int32_t>(total)});
    o.cu_seqlens_q = in.cu.view();
    for (int64_t r = 0; r < total; ++r) {
      req[r] = r < first ? 0 : 2;
      local[r] = r < first ? r : r - first;
    }
  } else if (f.q_form == "token_to_req") {
    in.t2r = random_int32({total}, rng, -1, static_cast<int32_t>(B - 1));  // -1: padding rows
    o.token_to_req = in.t2r.view();
    o.num_requests = B;
    for (int64_t r = 0; r < total; ++r) req[r] = in.t2r.data_as<int32_t>()[r];
  }
  if (f.positions || f.q_form == "token_to_req") {
    in.pos = random_int32(padded ? Shape{B, rows} : Shape{total}, rng, -5,
                          static_cast<int32_t>(4 * nb + 8));
    o.query_positions = in.pos.view();
  }
  if (f.seq_lens_q && padded) {
    in.lens = int32_tensor({B}, {static_cast<int32_t>(rows), 0, static_cast<int32_t>(rows / 2)});
    o.seq_lens_q = in.lens.view();
  }
  in.rows = padded ? Shape{B, rows} : Shape{total};
  for (int64_t r = 0; r < total; ++r) {
    const int64_t p = in.pos.data() ? in.pos.data_as<int32_t>()[r] : local[r];
    bool valid = p >= 0 && req[r] >= 0;
    if (in.lens.data()) valid = valid && local[r] < in.lens.data_as<int32_t>()[req[r]];
    in.row_pos.push_back(valid ? p : -1);
  }
  return in;
}

std::vector<IndexerForm> indexer_forms() {
  std::vector<IndexerForm> v;
  auto add = [&](IndexerForm f) { v.push_back(f); };
  add({.name = "padded_default_positions"});
  add({.name = "padded_positions_seq_lens_q", .positions = true, .seq_lens_q = true});
  add({.name = "padded_seq_lens_q", .seq_lens_q = true});
  add({.name = "padded_paged7_positions", .page_size = 7, .positions = true});
  add({.name = "cu_seqlens_logical", .q_form = "cu_seqlens"});
  add({.name = "cu_seqlens_paged16_positions",
       .q_form = "cu_seqlens",
       .page_size = 16,
       .positions = true});
  add({.name = "token_to_req_paged1", .q_form = "token_to_req", .page_size = 1});
  add({.name = "token_to_req_logical_fp16", .q_form = "token_to_req", .dtype = DType::kF16});
  add({.name = "fp8_padded_paged16", .page_size = 16, .positions = true, .fp8 = true});
  add({.name = "fp8_cu_seqlens_logical", .q_form = "cu_seqlens", .positions = true, .fp8 = true});
  add({.name = "heads3_dim40_padded", .positions = true, .heads = 3, .dim = 40});
  return v;
}

DecodeInputs make_decode_inputs(const DecodeForm& f, std::mt19937_64& rng) {
  DecodeInputs in;
  const int64_t B = f.batch, R = f.rows;
  in.max_model_len = f.max_model_len;
  in.q = quantised(f.rank3_q ? Shape{B, 4, 128} : Shape{B, R, 4, 128}, DType::kBF16, rng);
  in.cache = quantised({f.pool, f.page_size, 128}, f.fp8 ? DType::kF8E4M3 : DType::kBF16, rng);
  in.table = random_int32({B, f.max_pages}, rng, -2, static_cast<int32_t>(f.pool + 2));
  const Shape rows = f.rank3_q ? Shape{B} : Shape{B, R};
  // Counts of 0 and below (padding rows), past the table and past max_model_len among them.
  in.lens = random_int32(rows, rng, -2, static_cast<int32_t>(f.max_model_len + 40));
  in.lens.data_as<int32_t>()[0] = 0;
  if (f.positions) {
    in.pos = random_int32(rows, rng, -3, static_cast<int32_t>(4 * f.max_model_len + 8));
    in.pos.data_as<int32_t>()[B * R - 1] = -1;  // a padding row by position
  }
  for (int64_t i = 0; i < B * R; ++i) {
    const int64_t p = f.positions ? in.pos.data_as<int32_t>()[i] : 0;
    const bool padding = in.lens.data_as<int32_t>()[i] <= 0 || p < 0;
    in.padding.push_back(padding);
    in.row_pos.push_back(padding ? -1 : p);
  }
  return in;
}

std::vector<DecodeForm> decode_forms() {
  return {
      {.name = "r1_rank3_page16", .rank3_q = true},
      {.name = "r1_rank4_page1", .page_size = 1, .max_pages = 200},
      {.name = "r3_page16", .rows = 3},
      {.name = "r3_page64_fp8", .rows = 3, .page_size = 64, .fp8 = true},
      {.name = "r4_page8_no_positions", .rows = 4, .page_size = 8, .positions = false},
      {.name = "r2_page12_width_past_table", .rows = 2, .page_size = 12, .max_pages = 3},
  };
}

}  // namespace sparse_attn::testing
