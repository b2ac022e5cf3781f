// The block-sparse attention cases shared by the native backends' suites (block_sparse_cases.h).
#include "block_sparse_cases.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <optional>

#include "test_util.h"

namespace sparse_attn::testing {

std::string case_name(const ::testing::TestParamInfo<BsCase>& info) { return info.param.name; }

Problem make_problem(const BsCase& c, std::mt19937_64& rng) {
  Problem pb;
  pb.c = c;
  pb.batch = static_cast<int64_t>(c.lq.size());
  std::vector<int32_t> cu_q{0}, cu_k{0};
  for (int64_t b = 0; b < pb.batch; ++b) {
    cu_q.push_back(static_cast<int32_t>(cu_q.back() + c.lq[b]));
    cu_k.push_back(static_cast<int32_t>(cu_k.back() + c.lk[b]));
  }
  pb.total_q = cu_q.back() + c.extra_q_rows;
  pb.total_k = cu_k.back();
  pb.max_q = *std::max_element(c.lq.begin(), c.lq.end());
  pb.max_k = *std::max_element(c.lk.begin(), c.lk.end());
  pb.q = random_tensor({pb.total_q, c.hq, c.d}, c.dtype, rng, -2.f, 2.f);
  pb.cu_q = int32_tensor({pb.batch + 1}, cu_q);
  if (c.page_size == 0) {
    pb.k = random_tensor({std::max<int64_t>(pb.total_k, 1), c.hkv, c.d}, c.dtype, rng, -2.f, 2.f);
    pb.v = random_tensor({std::max<int64_t>(pb.total_k, 1), c.hkv, c.d}, c.dtype, rng);
    pb.cu_k = int32_tensor({pb.batch + 1}, cu_k);
  } else {
    // Pages shuffled over the pool; every slot no sequence owns holds NaN, so a kernel that
    // lets one into a product fails.
    pb.max_pages = (pb.max_k + c.page_size - 1) / c.page_size + 1;
    int64_t need = 0;
    for (int64_t l : c.lk) need += (l + c.page_size - 1) / c.page_size;
    pb.num_pages = need + 2;
    pb.k = random_tensor({pb.num_pages, c.page_size, c.hkv, c.d}, c.dtype, rng, -2.f, 2.f);
    pb.v = random_tensor({pb.num_pages, c.page_size, c.hkv, c.d}, c.dtype, rng);
    std::vector<int32_t> phys(pb.num_pages);
    std::iota(phys.begin(), phys.end(), 0);
    std::shuffle(phys.begin(), phys.end(), rng);
    std::vector<int32_t> table(pb.batch * pb.max_pages, -1);
    std::vector<bool> owned(pb.num_pages * c.page_size, false);
    for (int64_t b = 0, next = 0; b < pb.batch; ++b) {
      for (int64_t j = 0; j * c.page_size < c.lk[b]; ++j) {
        const int32_t page = phys[next++];
        table[b * pb.max_pages + j] = page;
        for (int64_t s = 0; s < c.page_size && j * c.page_size + s < c.lk[b]; ++s)
          owned[page * c.page_size + s] = true;
      }
    }
    for (int64_t i = 0; i < pb.num_pages * c.page_size; ++i) {
      if (owned[i]) continue;
      for (int64_t h = 0; h < c.hkv; ++h) {
        for (int64_t e = 0; e < c.d; ++e) {
          set(pb.k.view(), {i / c.page_size, i % c.page_size, h, e}, NAN);
          set(pb.v.view(), {i / c.page_size, i % c.page_size, h, e}, NAN);
        }
      }
    }
    pb.table = int32_tensor({pb.batch, pb.max_pages}, table);
    std::vector<int32_t> lens(c.lk.begin(), c.lk.end());
    pb.seqlens = int32_tensor({pb.batch}, lens);
  }
  std::vector<int32_t> types = c.head_types;
  if (types.empty()) types.assign(c.hq, 1);
  pb.sparse_heads = std::count(types.begin(), types.end(), 1);
  if (pb.sparse_heads > 0) {
    const Shape ms =
        block_sparse_attention_mask_shape(pb.batch, pb.sparse_heads, pb.max_q, pb.max_k);
    pb.mask = Tensor::empty(ms, DType::kBool);
    std::uniform_real_distribution<double> u01(0, 1);
    for (int64_t i = 0; i < pb.mask.numel(); ++i)
      pb.mask.data_as<uint8_t>()[i] = u01(rng) < c.keep ? 1 : 0;
  }
  pb.opts.backend = Backend::kReference;
  pb.opts.is_causal = c.causal;
  pb.opts.head_mask_type = c.head_types;
  pb.opts.streaming_info = c.streaming;
  if (c.softmax_scale > 0) pb.opts.softmax_scale = c.softmax_scale;

  pb.out = Tensor::empty(pb.q.shape(), c.dtype);
  poison(pb.out.view());
  if (c.lse) {
    pb.lse = Tensor::empty({pb.total_q, c.hq}, DType::kF32);
    poison(pb.lse.view());
  }
  return pb;
}

namespace {

std::optional<TensorView> opt(const Tensor& t, bool present) {
  if (!present) return std::nullopt;
  return t.view();
}

}  // namespace

void run(Problem& pb, bool native, void* stream) {
  const BsCase& c = pb.c;
  BlockSparseAttentionOptions o = pb.opts;
  o.backend = native ? Backend::kNative : Backend::kReference;
  o.stream = stream;
  const bool has_mask = pb.sparse_heads > 0;
  if (c.page_size == 0) {
    block_sparse_attention(native ? pb.nq : pb.q, native ? pb.nk : pb.k, native ? pb.nv : pb.v,
                           native ? pb.ncu_q : pb.cu_q, native ? pb.ncu_k : pb.cu_k,
                           opt(native ? pb.nmask : pb.mask, has_mask), pb.max_q, pb.max_k,
                           native ? pb.nout : pb.out, opt(native ? pb.nlse : pb.lse, c.lse), o);
  } else {
    block_sparse_attention_paged(
        native ? pb.nq : pb.q, native ? pb.nk : pb.k, native ? pb.nv : pb.v,
        native ? pb.ntable : pb.table, native ? pb.nseqlens : pb.seqlens,
        native ? pb.ncu_q : pb.cu_q, opt(native ? pb.nmask : pb.mask, has_mask), pb.max_q, pb.max_k,
        native ? pb.nout : pb.out, opt(native ? pb.nlse : pb.lse, c.lse), o);
  }
}

void expect_matches_reference(const Problem& pb) {
  const std::vector<double> want = to_vector(pb.out.view());
  const std::vector<double> got = to_vector(Tensor::to_host(pb.nout.view()).view());
  const int64_t written = (pb.total_q - pb.c.extra_q_rows) * pb.c.hq * pb.c.d;
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = written; i < got.size(); ++i) {
    ASSERT_TRUE(std::isnan(got[i])) << "row outside every sequence written at " << i;
  }
  Tensor o = Tensor::empty({written}, DType::kF32);
  for (int64_t i = 0; i < written; ++i) o.data_as<float>()[i] = static_cast<float>(got[i]);
  const std::vector<double> want_out(want.begin(), want.begin() + written);
  EXPECT_TRUE(
      all_close(o.view(), want_out, 2 * default_atol(pb.c.dtype), 2 * default_rtol(pb.c.dtype)))
      << "out";
  if (pb.c.lse) {
    const int64_t lse_written = (pb.total_q - pb.c.extra_q_rows) * pb.c.hq;
    const std::vector<double> lw = to_vector(pb.lse.view());
    const Tensor lg = Tensor::to_host(pb.nlse.view());
    EXPECT_TRUE(all_close(lg.view().narrow(0, 0, lse_written / pb.c.hq),
                          std::vector<double>(lw.begin(), lw.begin() + lse_written), 1e-3, 1e-3))
        << "lse";
  }
}

void share_host_inputs(Problem& pb) {
  pb.nq = pb.q, pb.nk = pb.k, pb.nv = pb.v, pb.ncu_q = pb.cu_q, pb.ncu_k = pb.cu_k;
  pb.nmask = pb.mask, pb.ntable = pb.table, pb.nseqlens = pb.seqlens;
  pb.nout = Tensor::empty(pb.q.shape(), pb.c.dtype);
  poison(pb.nout.view());
  if (pb.c.lse) {
    pb.nlse = Tensor::empty({pb.total_q, pb.c.hq}, DType::kF32);
    poison(pb.nlse.view());
  }
}

std::vector<BsCase> block_sparse_cases() {
  std::vector<BsCase> v;
  for (DType dt : {DType::kBF16, DType::kF16}) {
    for (int64_t d : {64, 128, 256}) {
      BsCase c;
      c.name = std::string(dt == DType::kBF16 ? "bf16" : "fp16") + "_d" + std::to_string(d) +
               "_varlen_causal";
      c.dtype = dt;
      c.d = d;
      c.lq = {300, 1, 129};
      c.lk = {700, 5, 129};
      v.push_back(c);
    }
  }
  {
    BsCase c;
    c.name = "d128_not_causal_lq_above_lk";
    c.causal = false;
    c.lq = {400, 77};
    c.lk = {250, 900};
    v.push_back(c);
  }
  {
    BsCase c;
    c.name = "d128_causal_lq_above_lk_rows_see_nothing";
    c.lq = {500};
    c.lk = {200};
    c.keep = 0.8;
    v.push_back(c);
  }
  {
    BsCase c;
    c.name = "d64_heads_dense_sparse_streaming_gqa4";
    c.d = 64;
    c.hq = 8;
    c.hkv = 2;
    c.lq = {640, 200};
    c.lk = {1000, 700};
    c.head_types = {1, 0, -1, 1, -1, 0, 1, 1};
    c.streaming = {1, 2, 0, 0, 2, 1, 0, 0, 0, 3, 0, 0, 0, 0, 0, 0};
    v.push_back(c);
  }
  {
    BsCase c;
    c.name = "d256_all_dense_equals_causal_flash";
    c.d = 256;
    c.hq = 2;
    c.hkv = 1;
    c.lq = {333};
    c.lk = {333};
    c.head_types = {0, 0};
    v.push_back(c);
  }
  {
    // Scores spread over ~60 log2 units: rows' maxima rise across tiles by more and by less
    // than the consumers' stale-maximum margin (2^8), dense and sparse heads, both dtypes.
    for (DType dt : {DType::kBF16, DType::kF16}) {
      BsCase c;
      c.name = std::string(dt == DType::kBF16 ? "bf16" : "fp16") + "_d128_wide_score_range";
      c.dtype = dt;
      c.lq = {700, 129};
      c.lk = {900, 300};
      c.head_types = {0, 1, 1, 0};
      c.softmax_scale = 1.0;
      v.push_back(c);
    }
  }
  {
    BsCase c;
    c.name = "d128_nothing_kept_zero_and_minus_inf";
    c.lq = {200, 50};
    c.lk = {400, 60};
    c.keep = 0.0;
    v.push_back(c);
  }
  {
    BsCase c;
    c.name = "d128_empty_sequences_and_unwritten_tail_rows";
    c.lq = {0, 130, 0, 7};
    c.lk = {50, 260, 0, 7};
    c.extra_q_rows = 9;
    v.push_back(c);
  }
  {
    BsCase c;
    c.name = "d128_group8_no_lse";
    c.hq = 8;
    c.hkv = 1;
    c.lq = {256};
    c.lk = {1024};
    c.lse = false;
    v.push_back(c);
  }
  // Dense heads alone at d256 (the bench's dense case): varlen and paged (pages holding whole
  // tiles, and pages that cut them), causal and not.
  for (int64_t page : {0, 24, 128, 800}) {
    BsCase c;
    c.name = "d256_all_dense_" + (page ? "paged_page" + std::to_string(page) : "varlen") +
             (page == 128 ? "_not_causal" : "");
    c.dtype = page == 24 ? DType::kF16 : DType::kBF16;
    c.d = 256;
    c.hq = 4;
    c.hkv = 2;
    c.page_size = page;
    c.causal = page != 128;
    c.lq = {300, 1, 129};
    c.lk = {700, 5, 250};
    c.head_types = {0, 0, 0, 0};
    v.push_back(c);
  }
  // Grids too small for the GPU (short query chunks, long keys): the native kernel splits the
  // keys (SplitKV) and merges; sparse, dense and streaming heads, paged, not causal.
  {
    BsCase c;
    c.name = "d128_small_grid_long_keys_split";
    c.lq = {64, 100};
    c.lk = {3000, 2500};
    v.push_back(c);
  }
  {
    BsCase c;
    c.name = "d256_small_grid_paged_page800_streaming_split";
    c.d = 256;
    c.hq = 2;
    c.hkv = 2;
    c.page_size = 800;
    c.lq = {50};
    c.lk = {1650};
    c.head_types = {-1, 1};
    c.streaming = {1, 3, 0, 0};
    v.push_back(c);
  }
  {
    BsCase c;
    c.name = "fp16_d64_small_grid_not_causal_split";
    c.dtype = DType::kF16;
    c.d = 64;
    c.causal = false;
    c.head_types = {0, 1, 1, 0};
    c.lq = {128};
    c.lk = {4000};
    v.push_back(c);
  }
  // Paged: pages that hold whole 128-key tiles, and pages that cut them (8-row pieces).
  for (int64_t page : {8, 24, 128, 256, 800, 1600}) {
    BsCase c;
    c.name = "d128_paged_page" + std::to_string(page);
    c.page_size = page;
    c.lq = {260, 3};
    c.lk = {1700, 1100};
    c.keep = 0.5;
    v.push_back(c);
  }
  {
    BsCase c;
    c.name = "d256_paged_page800_streaming";
    c.d = 256;
    c.hq = 2;
    c.hkv = 2;
    c.page_size = 800;
    c.lq = {200};
    c.lk = {1650};
    c.head_types = {-1, 1};
    c.streaming = {1, 3, 0, 0};
    v.push_back(c);
  }
  return v;
}

}  // namespace sparse_attn::testing
