// block_sparse_attention (varlen and paged) and xattention_prefill (reference backend) against
// a dense masked softmax in double precision (test_xattn_util.h), on fresh random inputs with
// NaN-poisoned outputs.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "sparse_attn/errors.h"
#include "sparse_attn/xattn.h"
#include "test_util.h"
#include "test_xattn_util.h"

namespace sparse_attn {
namespace {

using testing::all_close;
using testing::default_atol;
using testing::default_rtol;
using testing::get;
using testing::make_rng;
using testing::poison;
using testing::random_tensor;
using testing::to_vector;
using namespace xattn_testing;

constexpr double kInf = std::numeric_limits<double>::infinity();

// A varlen problem: q [total_q, Hq, D], k/v [total_k, Hkv, D], cu_seqlens, a random mask over
// the block-sparse heads, poisoned outputs.
struct Varlen {
  std::vector<int64_t> q_lens, k_lens;
  AttnHeads heads;
  int64_t max_q = 0, max_k = 0, sparse = 0;
  Tensor q, k, v, cu_q, cu_k, mask, out, lse;

  Varlen(std::vector<int64_t> ql, std::vector<int64_t> kl, std::vector<int> types, int64_t hkv,
         int64_t dim, DType dtype, std::mt19937_64& rng, double density = 0.5)
      : q_lens(std::move(ql)), k_lens(std::move(kl)) {
    const int64_t hq = static_cast<int64_t>(types.size());
    heads.types = std::move(types);
    heads.num_kv_heads = hkv;
    heads.dim = dim;
    heads.scale = 1.0 / std::sqrt(double(dim));
    const int64_t total_q = std::accumulate(q_lens.begin(), q_lens.end(), int64_t{0});
    const int64_t total_k = std::accumulate(k_lens.begin(), k_lens.end(), int64_t{0});
    max_q = *std::max_element(q_lens.begin(), q_lens.end());
    max_k = *std::max_element(k_lens.begin(), k_lens.end());
    q = random_tensor({total_q, hq, dim}, dtype, rng, -2.f, 2.f);
    k = random_tensor({total_k, hkv, dim}, dtype, rng, -2.f, 2.f);
    v = random_tensor({total_k, hkv, dim}, dtype, rng);
    std::vector<int32_t> cq{0}, ck{0};
    for (size_t b = 0; b < q_lens.size(); ++b) {
      cq.push_back(cq.back() + static_cast<int32_t>(q_lens[b]));
      ck.push_back(ck.back() + static_cast<int32_t>(k_lens[b]));
    }
    const int64_t batch = static_cast<int64_t>(q_lens.size());
    cu_q = testing::int32_tensor({batch + 1}, cq);
    cu_k = testing::int32_tensor({batch + 1}, ck);
    sparse = std::count(heads.types.begin(), heads.types.end(), 1);
    mask =
        Tensor::empty(block_sparse_attention_mask_shape(batch, sparse, max_q, max_k), DType::kBool);
    std::bernoulli_distribution coin(density);
    for (int64_t i = 0; i < mask.numel(); ++i) mask.data_as<uint8_t>()[i] = coin(rng);
    out = Tensor::empty(q.shape(), dtype);
    lse = Tensor::empty({total_q, hq}, DType::kF32);
    poison(out);
    poison(lse);
  }

  std::optional<TensorView> mask_arg() const {
    return sparse > 0 ? std::optional<TensorView>(mask.view()) : std::nullopt;
  }

  AttnSequence sequence(int64_t b) const {
    const int64_t q0 = get(cu_q, {b}), k0 = get(cu_k, {b});
    AttnSequence s;
    s.q_len = q_lens[b];
    s.k_len = k_lens[b];
    s.q = [this, q0](int64_t r, int64_t h, int64_t d) { return get(q, {q0 + r, h, d}); };
    s.k = [this, k0](int64_t t, int64_t h, int64_t d) { return get(k, {k0 + t, h, d}); };
    s.v = [this, k0](int64_t t, int64_t h, int64_t d) { return get(v, {k0 + t, h, d}); };
    s.mask = [this, b](int64_t sh, int64_t i, int64_t j) { return get(mask, {b, sh, i, j}) != 0; };
    return s;
  }

  // Expected out (row-major [total_q, Hq, D]) and lse ([total_q, Hq]).
  std::pair<std::vector<double>, std::vector<double>> expected() const {
    std::vector<double> eo, el;
    const int64_t hq = static_cast<int64_t>(heads.types.size());
    for (size_t b = 0; b < q_lens.size(); ++b) {
      const auto rows = expected_attention(sequence(static_cast<int64_t>(b)), heads);
      for (int64_t r = 0; r < q_lens[b]; ++r)
        for (int64_t h = 0; h < hq; ++h) {
          eo.insert(eo.end(), rows[h][r].out.begin(), rows[h][r].out.end());
          el.push_back(rows[h][r].lse);
        }
    }
    return {eo, el};
  }

  BlockSparseAttentionOptions options() const {
    BlockSparseAttentionOptions o;
    o.backend = Backend::kReference;
    o.head_mask_type = heads.types;
    o.streaming_info = heads.streaming;
    o.is_causal = heads.causal;
    return o;
  }

  void run() {
    block_sparse_attention(q, k, v, cu_q, cu_k, mask_arg(), max_q, max_k, out, lse, options());
  }

  void check(const char* what) const {
    const auto [eo, el] = expected();
    const DType dt = q.dtype();
    EXPECT_TRUE(all_close(out, eo, default_atol(dt), default_rtol(dt))) << what << " out";
    EXPECT_TRUE(all_close(lse, el, 1e-4, 1e-5)) << what << " lse";
  }
};

// ---------------------------------------------------------------------------------------
// Varlen block_sparse_attention
// ---------------------------------------------------------------------------------------

TEST(BlockSparseAttention, VarlenDenseSparseAndStreamingHeadsCausal) {
  auto rng = make_rng();
  // Sequence 2 has more queries than keys: its first 30 rows see nothing.
  Varlen p({200, 77, 130}, {200, 300, 100}, {1, 0, -1, 1}, 2, 32, DType::kBF16, rng);
  p.heads.streaming = {0, 0, 0, 0, 1, 1, 0, 0};
  p.run();
  p.check("causal");
  for (int64_t r = 277; r < 277 + 30; ++r) EXPECT_EQ(get(p.lse, {r, 1}), -kInf) << r;
}

TEST(BlockSparseAttention, VarlenNonCausal) {
  auto rng = make_rng();
  Varlen p({200, 77, 130}, {200, 300, 100}, {1, 0, -1, 1}, 2, 32, DType::kBF16, rng);
  p.heads.streaming = {0, 0, 0, 0, 1, 2, 0, 0};
  p.heads.causal = false;
  p.run();
  p.check("non-causal");
}

TEST(BlockSparseAttention, StreamingSinkAndLocalWindows) {
  auto rng = make_rng();
  // Long enough for a gap between the sink and the local window; offsets not whole blocks.
  Varlen p({300, 256}, {700, 600}, {-1, -1, -1, -1}, 1, 16, DType::kF32, rng);
  p.heads.streaming = {1, 1, 0, 2, 2, 0, 1, 3};
  p.run();
  p.check("streaming");
}

struct GqaCase {
  std::string name;
  int64_t hq, hkv;
};

void PrintTo(const GqaCase& c, std::ostream* os) { *os << c.name; }

class BlockSparseAttentionGqa : public ::testing::TestWithParam<GqaCase> {};

TEST_P(BlockSparseAttentionGqa, MatchesDoublePrecision) {
  auto rng = make_rng();
  const GqaCase& c = GetParam();
  Varlen p({150, 260}, {300, 260}, std::vector<int>(c.hq, 1), c.hkv, 16, DType::kF16, rng);
  p.run();
  p.check(c.name.c_str());
}

INSTANTIATE_TEST_SUITE_P(Groups, BlockSparseAttentionGqa,
                         ::testing::Values(GqaCase{"group1_hq8_hkv8", 8, 8},
                                           GqaCase{"group4_hq8_hkv2", 8, 2},
                                           GqaCase{"group8_hq8_hkv1", 8, 1}),
                         [](const auto& info) { return info.param.name; });

TEST(BlockSparseAttention, EmptyMaskRowsGiveZeroOutputAndMinusInfLse) {
  auto rng = make_rng();
  Varlen p({256}, {384}, {1, 1}, 1, 16, DType::kBF16, rng, 1.0);
  // Head 0, query block 1: nothing selected.
  for (int64_t j = 0; j < 3; ++j) testing::set(p.mask, {0, 0, 1, j}, 0);
  p.run();
  p.check("empty rows");
  for (int64_t r = 128; r < 256; ++r) {
    EXPECT_EQ(get(p.lse, {r, 0}), -kInf);
    for (int64_t d = 0; d < 16; ++d) ASSERT_EQ(get(p.out, {r, 0, d}), 0.0);
  }
}

TEST(BlockSparseAttention, EmptySequencesAndRowsOutsideEverySequence) {
  auto rng = make_rng();
  // Sequence 1 has no queries, sequence 2 no keys (its rows see nothing), and the last 5 rows
  // of q belong to no sequence: they are left untouched.
  Varlen p({60, 0, 20}, {90, 40, 0}, {1, 0}, 1, 16, DType::kF32, rng);
  Tensor q = random_tensor({85, 2, 16}, DType::kF32, rng);
  for (int64_t r = 0; r < 80; ++r)
    for (int64_t h = 0; h < 2; ++h)
      for (int64_t d = 0; d < 16; ++d) testing::set(q, {r, h, d}, get(p.q, {r, h, d}));
  Tensor out = Tensor::empty({85, 2, 16}, DType::kF32);
  Tensor lse = Tensor::empty({85, 2}, DType::kF32);
  poison(out);
  poison(lse);
  block_sparse_attention(q, p.k, p.v, p.cu_q, p.cu_k, p.mask_arg(), p.max_q, p.max_k, out,
                         lse.view(), p.options());
  const auto [eo, el] = p.expected();
  EXPECT_TRUE(all_close(out.view().narrow(0, 0, 80), eo, 1e-5, 1e-5));
  EXPECT_TRUE(all_close(lse.view().narrow(0, 0, 80), el, 1e-5, 1e-6));
  for (int64_t r = 60; r < 80; ++r) EXPECT_EQ(get(lse, {r, 1}), -kInf);
  for (double x : to_vector(out.view().narrow(0, 80, 5))) EXPECT_TRUE(std::isnan(x));
}

TEST(BlockSparseAttention, StridedOutputAndTransposedLse) {
  auto rng = make_rng();
  Varlen p({140, 60}, {140, 200}, {1, 0, 1, 1}, 2, 16, DType::kBF16, rng);
  // out inside a wider buffer, lse as the transpose of an [Hq, total_q] buffer.
  Tensor out_buf = Tensor::empty({200, 4, 32}, DType::kBF16);
  Tensor lse_buf = Tensor::empty({4, 200}, DType::kF32);
  poison(out_buf);
  poison(lse_buf);
  TensorView out = out_buf.view().narrow(2, 8, 16);
  TensorView lse = lse_buf.view().as_strided({200, 4}, {1, 200});
  block_sparse_attention(p.q, p.k, p.v, p.cu_q, p.cu_k, p.mask_arg(), p.max_q, p.max_k, out, lse,
                         p.options());
  const auto [eo, el] = p.expected();
  EXPECT_TRUE(all_close(out, eo, default_atol(DType::kBF16), default_rtol(DType::kBF16)));
  EXPECT_TRUE(all_close(lse, el, 1e-4, 1e-5));
  EXPECT_TRUE(std::isnan(get(out_buf, {0, 0, 0})));  // outside the view: untouched
}

// cu_seqlens as every other element of a wider buffer whose odd elements would be wrong offsets:
// read without the stride, the call would see the garbage.
Tensor every_other(const Tensor& cu) {
  const int64_t n = cu.numel();
  std::vector<int32_t> spread(static_cast<size_t>(2 * n), 999);
  for (int64_t i = 0; i < n; ++i) spread[2 * i] = cu.data_as<int32_t>()[i];
  return testing::int32_tensor({2 * n}, spread);
}

TEST(BlockSparseAttention, StridedCuSeqlens) {
  auto rng = make_rng();
  Varlen p({140, 60, 90}, {140, 200, 90}, {1, 0, 1, 1}, 2, 16, DType::kBF16, rng);
  const Tensor cu_q_buf = every_other(p.cu_q);
  const Tensor cu_k_buf = every_other(p.cu_k);
  const TensorView cu_q = cu_q_buf.view().as_strided({4}, {2});
  const TensorView cu_k = cu_k_buf.view().as_strided({4}, {2});
  block_sparse_attention(p.q, p.k, p.v, cu_q, cu_k, p.mask_arg(), p.max_q, p.max_k, p.out, p.lse,
                         p.options());
  p.check("strided cu_seqlens");
}

TEST(BlockSparseAttention, ExplicitSoftmaxScale) {
  auto rng = make_rng();
  Varlen p({100}, {180}, {1, 0}, 1, 16, DType::kF32, rng);
  p.heads.scale = 0.37;
  BlockSparseAttentionOptions o = p.options();
  o.softmax_scale = 0.37;
  block_sparse_attention(p.q, p.k, p.v, p.cu_q, p.cu_k, p.mask_arg(), p.max_q, p.max_k, p.out,
                         p.lse, o);
  p.check("scale");
}

// ---------------------------------------------------------------------------------------
// Paged KV
// ---------------------------------------------------------------------------------------

class BlockSparseAttentionPaged : public ::testing::TestWithParam<int64_t> {};

TEST_P(BlockSparseAttentionPaged, EqualsVarlenOnTheSameKeys) {
  auto rng = make_rng();
  const int64_t page = GetParam();
  Varlen p({130, 50, 200}, {300, 50, 260}, {1, -1, 0, 1}, 2, 16, DType::kBF16, rng);
  p.heads.streaming = {0, 0, 1, 1, 0, 0, 0, 0};
  // Scatter each sequence's keys over shuffled pages, with spare pages in between.
  const int64_t batch = 3, max_pages = (p.max_k + page - 1) / page;
  const int64_t num_pages = batch * max_pages + 3;
  std::vector<int32_t> ids(num_pages);
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  Tensor kc = random_tensor({num_pages, page, 2, 16}, DType::kBF16, rng);
  Tensor vc = random_tensor({num_pages, page, 2, 16}, DType::kBF16, rng);
  std::vector<int32_t> table(batch * max_pages, -1), lens;
  for (int64_t b = 0, next = 0, k0 = 0; b < batch; ++b) {
    for (int64_t t = 0; t < p.k_lens[b]; ++t) {
      if (t % page == 0) table[b * max_pages + t / page] = ids[next++];
      const int64_t pid = table[b * max_pages + t / page];
      for (int64_t h = 0; h < 2; ++h)
        for (int64_t d = 0; d < 16; ++d) {
          testing::set(kc, {pid, t % page, h, d}, get(p.k, {k0 + t, h, d}));
          testing::set(vc, {pid, t % page, h, d}, get(p.v, {k0 + t, h, d}));
        }
    }
    k0 += p.k_lens[b];
    lens.push_back(static_cast<int32_t>(p.k_lens[b]));
  }
  Tensor bt = testing::int32_tensor({batch, max_pages}, table);
  Tensor sk = testing::int32_tensor({batch}, lens);
  block_sparse_attention_paged(p.q, kc, vc, bt, sk, p.cu_q, p.mask_arg(), p.max_q, p.max_k, p.out,
                               p.lse, p.options());
  p.check("paged");
  // The same with cu_seqlens_q as a strided view.
  poison(p.out);
  poison(p.lse);
  const Tensor cu_q_buf = every_other(p.cu_q);
  block_sparse_attention_paged(p.q, kc, vc, bt, sk, cu_q_buf.view().as_strided({batch + 1}, {2}),
                               p.mask_arg(), p.max_q, p.max_k, p.out, p.lse, p.options());
  p.check("paged, strided cu_seqlens_q");
}

INSTANTIATE_TEST_SUITE_P(PageSizes, BlockSparseAttentionPaged, ::testing::Values(5, 16, 64, 100, 128, 256),
                         [](const auto& info) { return "page" + std::to_string(info.param); });

// ---------------------------------------------------------------------------------------
// xattention_prefill
// ---------------------------------------------------------------------------------------

struct Prefill {
  Tensor q, k, v, sums, mask, out, lse;
  Prefill(const TensorView& query, const TensorView& key, const TensorView& value,
          const XAttnPrefillOptions& o) {
    const Shape shape = xattn_estimate_shape(query, key, o);
    sums = Tensor::empty(shape, DType::kF32);
    mask = Tensor::empty(shape, DType::kBool);
    out = Tensor::empty(query.shape(), query.dtype());
    lse = Tensor::empty({query.size(0), query.size(1), query.size(2)}, DType::kF32);
    poison(sums);
    poison(out);
    poison(lse);
    xattention_prefill(query, key, value, sums, mask, out, lse, o);
  }
};

XAttnPrefillOptions prefill_opts(double threshold) {
  XAttnPrefillOptions o;
  o.backend = Backend::kReference;
  o.threshold = threshold;
  o.chunk_size = 256;
  return o;
}

// Expected prefill out [B, Hq, Lq, D] and lse [B, Hq, Lq] (row-major) for a given mask (all
// heads block-sparse), or dense causal when mask is null.
std::pair<std::vector<double>, std::vector<double>> expected_prefill(const TensorView& q,
                                                                     const TensorView& k,
                                                                     const TensorView& v,
                                                                     const TensorView* mask,
                                                                     bool causal) {
  const int64_t B = q.size(0), Hq = q.size(1), Lq = q.size(2), D = q.size(3);
  AttnHeads heads;
  heads.types.assign(Hq, mask ? 1 : 0);
  heads.num_kv_heads = k.size(1);
  heads.dim = D;
  heads.scale = 1.0 / std::sqrt(double(D));
  heads.causal = causal;
  std::vector<double> eo, el;
  for (int64_t b = 0; b < B; ++b) {
    AttnSequence s;
    s.q_len = Lq;
    s.k_len = k.size(2);
    s.q = [&, b](int64_t r, int64_t h, int64_t d) { return get(q, {b, h, r, d}); };
    s.k = [&, b](int64_t t, int64_t h, int64_t d) { return get(k, {b, h, t, d}); };
    s.v = [&, b](int64_t t, int64_t h, int64_t d) { return get(v, {b, h, t, d}); };
    s.mask = [&, b](int64_t h, int64_t i, int64_t j) { return get(*mask, {b, h, i, j}) != 0; };
    const auto rows = expected_attention(s, heads);
    for (int64_t h = 0; h < Hq; ++h)
      for (int64_t r = 0; r < Lq; ++r) {
        eo.insert(eo.end(), rows[h][r].out.begin(), rows[h][r].out.end());
        el.push_back(rows[h][r].lse);
      }
  }
  return {eo, el};
}

TEST(XAttentionPrefill, ThresholdOneEqualsDenseCausalAttention) {
  auto rng = make_rng();
  Tensor q = random_tensor({2, 4, 300, 16}, DType::kF32, rng, -2.f, 2.f);
  Tensor k = random_tensor({2, 2, 420, 16}, DType::kF32, rng, -2.f, 2.f);
  Tensor v = random_tensor({2, 2, 420, 16}, DType::kF32, rng);
  const Prefill r(q, k, v, prefill_opts(1.0));
  // Every causal block kept...
  for (int64_t i = 0; i < 3; ++i)
    for (int64_t j = 0; j < 4; ++j) {
      const int64_t last_key = 120 + std::min<int64_t>(128 * i + 127, 299);
      EXPECT_EQ(get(r.mask, {1, 3, i, j}), j <= last_key / 128 ? 1.0 : 0.0);
    }
  // ...so the output is dense causal attention.
  const auto [eo, el] = expected_prefill(q, k, v, nullptr, true);
  EXPECT_TRUE(all_close(r.out, eo, 1e-5, 1e-5));
  EXPECT_TRUE(all_close(r.lse, el, 1e-5, 1e-6));
}

TEST(XAttentionPipeline, EstimateAtThresholdOneThenBlockSparseAttentionIsDenseCausal) {
  auto rng = make_rng();
  // [B, L, H, D] storage: seen as [B, H, L, D] by the estimate, as varlen [B * L, H, D] by BSA.
  const int64_t B = 2, Lq = 200, Lk = 330, Hq = 4, Hkv = 1, D = 16;
  Tensor qs = random_tensor({B, Lq, Hq, D}, DType::kF32, rng, -2.f, 2.f);
  Tensor ks = random_tensor({B, Lk, Hkv, D}, DType::kF32, rng, -2.f, 2.f);
  Tensor vs = random_tensor({B, Lk, Hkv, D}, DType::kF32, rng);
  auto bhld = [](const Tensor& t) {
    const Shape s = t.shape();
    return t.view().as_strided({s[0], s[2], s[1], s[3]},
                               {s[1] * s[2] * s[3], s[3], s[2] * s[3], 1});
  };
  XAttnEstimateOptions eo;
  eo.backend = Backend::kReference;
  eo.threshold = 1.0;
  const Shape mshape = xattn_estimate_shape(bhld(qs), bhld(ks), eo);
  ASSERT_EQ(mshape, block_sparse_attention_mask_shape(B, Hq, Lq, Lk));
  Tensor sums = Tensor::empty(mshape, DType::kF32), mask = Tensor::empty(mshape, DType::kBool);
  xattn_estimate(bhld(qs), bhld(ks), sums, mask, eo);

  auto flat = [](const Tensor& t) {
    const Shape s = t.shape();
    return t.view().as_strided({s[0] * s[1], s[2], s[3]}, {s[2] * s[3], s[3], 1});
  };
  Tensor cu_q = testing::int32_tensor({3}, {0, Lq, 2 * Lq});
  Tensor cu_k = testing::int32_tensor({3}, {0, Lk, 2 * Lk});
  Tensor out = Tensor::empty({B * Lq, Hq, D}, DType::kF32);
  Tensor lse = Tensor::empty({B * Lq, Hq}, DType::kF32);
  poison(out);
  poison(lse);
  BlockSparseAttentionOptions ao;
  ao.backend = Backend::kReference;
  block_sparse_attention(flat(qs), flat(ks), flat(vs), cu_q, cu_k, mask.view(), Lq, Lk, out,
                         lse.view(), ao);

  // Dense causal attention, sequence by sequence, in the [B * L, H, D] row order.
  std::vector<double> want_out, want_lse;
  AttnHeads dense;
  dense.types.assign(Hq, 0);
  dense.num_kv_heads = Hkv;
  dense.dim = D;
  dense.scale = 1.0 / std::sqrt(double(D));
  for (int64_t b = 0; b < B; ++b) {
    AttnSequence s;
    s.q_len = Lq;
    s.k_len = Lk;
    s.q = [&, b](int64_t r, int64_t h, int64_t d) { return get(qs, {b, r, h, d}); };
    s.k = [&, b](int64_t t, int64_t h, int64_t d) { return get(ks, {b, t, h, d}); };
    s.v = [&, b](int64_t t, int64_t h, int64_t d) { return get(vs, {b, t, h, d}); };
    const auto rows = expected_attention(s, dense);
    for (int64_t r = 0; r < Lq; ++r)
      for (int64_t h = 0; h < Hq; ++h) {
        want_out.insert(want_out.end(), rows[h][r].out.begin(), rows[h][r].out.end());
        want_lse.push_back(rows[h][r].lse);
      }
  }
  EXPECT_TRUE(all_close(out, want_out, 1e-5, 1e-5));
  EXPECT_TRUE(all_close(lse, want_lse, 1e-5, 1e-6));
}

TEST(XAttentionPrefill, OutputFollowsTheEstimatedMask) {
  auto rng = make_rng();
  // Batch 2, GQA group 4, Lq < Lk at an offset that is not a whole block.
  Tensor q = random_tensor({2, 4, 260, 16}, DType::kBF16, rng, -3.f, 3.f);
  Tensor k = random_tensor({2, 1, 451, 16}, DType::kBF16, rng, -3.f, 3.f);
  Tensor v = random_tensor({2, 1, 451, 16}, DType::kBF16, rng);
  XAttnPrefillOptions o = prefill_opts(0.7);
  o.keep_sink = true;
  const Prefill r(q, k, v, o);
  // The mask is the estimate's.
  Tensor sums = Tensor::empty(r.sums.shape(), DType::kF32);
  Tensor mask = Tensor::empty(r.sums.shape(), DType::kBool);
  xattn_estimate(q, k, sums, mask, o);
  EXPECT_EQ(to_vector(r.mask), to_vector(mask));
  EXPECT_EQ(to_vector(r.sums), to_vector(sums));
  // And sparse: some causal block was dropped.
  double kept = 0;
  for (double m : to_vector(mask)) kept += m;
  EXPECT_LT(kept, 2 * 4 * 3 * 4);
  const TensorView mv = r.mask.view();
  const auto [eo, el] = expected_prefill(q, k, v, &mv, true);
  EXPECT_TRUE(all_close(r.out, eo, default_atol(DType::kBF16), default_rtol(DType::kBF16)));
  EXPECT_TRUE(all_close(r.lse, el, 1e-4, 1e-5));
}

TEST(XAttentionPrefill, NonCausal) {
  auto rng = make_rng();
  Tensor q = random_tensor({1, 2, 200, 16}, DType::kF32, rng, -3.f, 3.f);
  Tensor k = random_tensor({1, 2, 333, 16}, DType::kF32, rng, -3.f, 3.f);
  Tensor v = random_tensor({1, 2, 333, 16}, DType::kF32, rng);
  XAttnPrefillOptions o = prefill_opts(0.8);
  o.causal = false;
  o.keep_recent = true;
  const Prefill r(q, k, v, o);
  const TensorView mv = r.mask.view();
  const auto [eo, el] = expected_prefill(q, k, v, &mv, false);
  EXPECT_TRUE(all_close(r.out, eo, 1e-5, 1e-5));
  EXPECT_TRUE(all_close(r.lse, el, 1e-5, 1e-6));
}

TEST(XAttentionPrefill, ChunkedPrefillEqualsFullPrefillRows) {
  auto rng = make_rng();
  const int64_t L = 600, H = 4, Hkv = 1, D = 16;
  Tensor q = random_tensor({1, H, L, D}, DType::kBF16, rng, -3.f, 3.f);
  Tensor k = random_tensor({1, Hkv, L, D}, DType::kBF16, rng, -3.f, 3.f);
  Tensor v = random_tensor({1, Hkv, L, D}, DType::kBF16, rng);
  const XAttnPrefillOptions o = prefill_opts(0.8);
  const Prefill full(q, k, v, o);
  for (auto [start, end] :
       {std::pair<int64_t, int64_t>{0, 128}, {128, 384}, {384, 600}, {512, 600}}) {
    SCOPED_TRACE("chunk [" + std::to_string(start) + ", " + std::to_string(end) + ")");
    const Prefill part(q.view().narrow(2, start, end - start), k.view().narrow(2, 0, end),
                       v.view().narrow(2, 0, end), o);
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t i = 0; i < part.mask.shape()[2]; ++i)
        for (int64_t j = 0; j < part.mask.shape()[3]; ++j)
          ASSERT_EQ(get(part.mask, {0, h, i, j}), get(full.mask, {0, h, start / 128 + i, j}));
      for (int64_t r = 0; r < end - start; ++r) {
        ASSERT_EQ(get(part.lse, {0, h, r}), get(full.lse, {0, h, start + r}));
        for (int64_t d = 0; d < D; ++d)
          ASSERT_EQ(get(part.out, {0, h, r, d}), get(full.out, {0, h, start + r, d}));
      }
    }
  }
}

}  // namespace
}  // namespace sparse_attn
