// QSA MQA indexer ops (qsa_indexer_mqa_score, qsa_mqa_prefill / qsa_mqa, qsa_mqa_decode) on the
// reference backend against double-precision expectations computed here, plus one test per
// validation rule.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "sparse_attn/errors.h"
#include "sparse_attn/qsa.h"
#include "test_util.h"

namespace sparse_attn {
namespace {

using testing::all_close;
using testing::get;
using testing::int32_tensor;
using testing::int64_tensor;
using testing::make_rng;
using testing::poison;
using testing::random_int32;
using testing::random_tensor;
using testing::to_vector;
using testing::widened;

constexpr double kInf = std::numeric_limits<double>::infinity();
// Outputs are FP32 sums of FP32 products of exact bf16/fp16 inputs; the expectation is exact
// double arithmetic on the same inputs.
constexpr double kAtol = 2e-5;
constexpr double kRtol = 2e-5;

std::vector<int64_t> cat(std::vector<int64_t> a, std::initializer_list<int64_t> b) {
  a.insert(a.end(), b);
  return a;
}

// sum_h max(0, q[qi.., h, :] . k[ki.., :]) in double.
double relu_head_sum(const TensorView& q, const std::vector<int64_t>& qi, const TensorView& k,
                     const std::vector<int64_t>& ki) {
  const int64_t heads = q.size(-2);
  const int64_t dim = q.size(-1);
  double total = 0;
  for (int64_t h = 0; h < heads; ++h) {
    double dot = 0;
    for (int64_t d = 0; d < dim; ++d) dot += get(q, cat(qi, {h, d})) * get(k, cat(ki, {d}));
    total += std::max(dot, 0.0);
  }
  return total;
}

// One query row of the score op as the test sees it.
struct Row {
  std::vector<int64_t> q_index;  // index prefix of the row in q_idx
  int64_t req;
  int64_t pos;
  bool valid;
};

// Expected scores: rows in output order; keys logical [B, N_B, D] or paged through `table`.
std::vector<double> expected_scores(const TensorView& q, const TensorView& keys,
                                    const std::vector<Row>& rows,
                                    const std::optional<TensorView>& table, int64_t num_blocks,
                                    double scale) {
  std::vector<double> out;
  for (const Row& r : rows) {
    for (int64_t b = 0; b < num_blocks; ++b) {
      if (!r.valid || 4 * b + 3 > r.pos) {
        out.push_back(-kInf);
        continue;
      }
      std::vector<int64_t> ki{r.req, b};
      if (table) {
        const int64_t page_size = keys.size(1);
        const auto page = static_cast<int64_t>(get(*table, {r.req, b / page_size}));
        if (page < 0 || page >= keys.size(0)) {
          out.push_back(-kInf);
          continue;
        }
        ki = {page, b % page_size};
        if (keys.dim() == 4) ki.push_back(0);
      }
      out.push_back(scale * relu_head_sum(q, r.q_index, keys, ki));
    }
  }
  return out;
}

std::vector<Row> padded_rows(int64_t batch, int64_t q_len, const TensorView* positions,
                             const TensorView* seq_lens) {
  std::vector<Row> rows;
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t i = 0; i < q_len; ++i) {
      const int64_t pos = positions ? static_cast<int64_t>(get(*positions, {b, i})) : i;
      const bool valid = !seq_lens || i < get(*seq_lens, {b});
      rows.push_back({{b, i}, b, pos, valid});
    }
  }
  return rows;
}

// Rows of a varlen query whose row r belongs to request req_of[r]; positions default to the
// count of earlier rows of the same request.
std::vector<Row> varlen_rows(const std::vector<int64_t>& req_of, const TensorView* positions) {
  std::vector<Row> rows;
  std::vector<int64_t> seen(64, 0);
  for (size_t r = 0; r < req_of.size(); ++r) {
    const auto row = static_cast<int64_t>(r);
    const int64_t pos = positions ? static_cast<int64_t>(get(*positions, {row})) : seen[req_of[r]];
    ++seen[req_of[r]];
    rows.push_back({{row}, req_of[r], pos, true});
  }
  return rows;
}

IndexerScoreOptions reference_score() {
  IndexerScoreOptions o;
  o.backend = Backend::kReference;
  return o;
}

MqaScoreOptions reference_mqa() {
  MqaScoreOptions o;
  o.backend = Backend::kReference;
  return o;
}

class IndexerDtype : public ::testing::TestWithParam<DType> {};

// ---------------------------------------------------------------------------------------
// qsa_indexer_mqa_score
// ---------------------------------------------------------------------------------------

TEST_P(IndexerDtype, ScorePaddedLogicalKeys) {
  auto rng = make_rng();
  const int64_t B = 2, Q = 23, H = 4, D = 128, NB = 7;  // positions 0..22 cover p % 4 = 0..3
  Tensor q = random_tensor({B, Q, H, D}, GetParam(), rng);
  Tensor k = random_tensor({B, NB, D}, GetParam(), rng);
  Tensor out = Tensor::empty({B, Q, NB}, DType::kF32);
  poison(out);
  qsa_indexer_mqa_score(q, k, out, reference_score());
  const auto expected = expected_scores(q, k, padded_rows(B, Q, nullptr, nullptr), std::nullopt, NB,
                                        1.0 / std::sqrt(128.0));
  EXPECT_TRUE(all_close(out, expected, kAtol, kRtol));
  EXPECT_EQ(qsa_indexer_mqa_score_shape(q, k), (Shape{B, Q, NB}));
}

TEST_P(IndexerDtype, ScorePaddedPositionsAndSeqLensQ) {
  auto rng = make_rng();
  const int64_t B = 3, Q = 6, H = 4, D = 64, NB = 12;
  Tensor q = random_tensor({B, Q, H, D}, GetParam(), rng);
  Tensor k = random_tensor({B, NB, D}, GetParam(), rng);
  Tensor pos = random_int32({B, Q}, rng, -2, 4 * NB + 4);
  Tensor seq_lens = int32_tensor({B}, {6, 0, 4});
  IndexerScoreOptions o = reference_score();
  o.query_positions = pos.view();
  o.seq_lens_q = seq_lens.view();
  o.scale = 0.37;
  Tensor out = Tensor::empty({B, Q, NB}, DType::kF32);
  poison(out);
  qsa_indexer_mqa_score(q, k, out, o);
  const TensorView pv = pos.view(), sv = seq_lens.view();
  EXPECT_TRUE(all_close(out,
                        expected_scores(q, k, padded_rows(B, Q, &pv, &sv), std::nullopt, NB, 0.37),
                        kAtol, kRtol));
}

TEST_P(IndexerDtype, ScoreVarlenCuSeqlens) {
  auto rng = make_rng();
  const int64_t H = 4, D = 128, NB = 9;
  const std::vector<int32_t> cu{0, 5, 5, 17};  // request 1 has no rows
  const int64_t total = cu.back();
  Tensor q = random_tensor({total, H, D}, GetParam(), rng);
  Tensor k = random_tensor({3, NB, D}, GetParam(), rng);
  Tensor cu_t = int32_tensor({4}, cu);
  IndexerScoreOptions o = reference_score();
  o.cu_seqlens_q = cu_t.view();
  o.score_scale = 4.0;
  Tensor out = Tensor::empty({total, NB}, DType::kF32);
  poison(out);
  qsa_indexer_mqa_score(q, k, out, o);
  std::vector<int64_t> req_of;
  for (int r = 0; r < 3; ++r) req_of.insert(req_of.end(), cu[r + 1] - cu[r], r);
  EXPECT_TRUE(all_close(out,
                        expected_scores(q, k, varlen_rows(req_of, nullptr), std::nullopt, NB, 0.25),
                        kAtol, kRtol));
  EXPECT_EQ(qsa_indexer_mqa_score_shape(q, k, o), (Shape{total, NB}));
}

TEST_P(IndexerDtype, ScoreVarlenTokenToReqInterleavedRows) {
  auto rng = make_rng();
  const int64_t H = 4, D = 32, NB = 5, total = 19;
  Tensor q = random_tensor({total, H, D}, GetParam(), rng);
  // Four key rows but only three requests in use: num_requests bounds the ids.
  Tensor k = random_tensor({4, NB, D}, GetParam(), rng);
  Tensor t2r = random_int32({total}, rng, 0, 2);
  // A prefill from each request's first token: its i-th row sits at position i (given, since
  // token_to_req rows are never counted).
  std::vector<int64_t> req_of, rank;
  std::vector<int64_t> seen(3, 0);
  for (double v : to_vector(t2r)) {
    req_of.push_back(static_cast<int64_t>(v));
    rank.push_back(seen[req_of.back()]++);
  }
  Tensor pos = int64_tensor({total}, rank);
  IndexerScoreOptions o = reference_score();
  o.token_to_req = t2r.view();
  o.num_requests = 3;
  o.query_positions = pos.view();
  Tensor out = Tensor::empty({total, NB}, DType::kF32);
  poison(out);
  qsa_indexer_mqa_score(q, k, out, o);
  EXPECT_TRUE(all_close(
      out,
      expected_scores(q, k, varlen_rows(req_of, nullptr), std::nullopt, NB, 1.0 / std::sqrt(32.0)),
      kAtol, kRtol));
}

// int64 metadata everywhere (cu_seqlens_q, positions, seq_lens_q, the block table), with
// padding rows marked by a negative position: the int32 call's scores, bit for bit.
TEST_P(IndexerDtype, ScoreInt64MetadataMatchesInt32) {
  auto rng = make_rng();
  const int64_t B = 2, Q = 7, H = 4, D = 64, page_size = 4, max_pages = 3, pages = 5;
  const int64_t NB = max_pages * page_size;
  Tensor cache = random_tensor({pages, page_size, D}, GetParam(), rng);
  Tensor table = int32_tensor({B, max_pages}, {4, -1, 2, 0, 7, 1});
  for (bool varlen : {false, true}) {
    Tensor q = varlen ? random_tensor({B * Q, H, D}, GetParam(), rng)
                      : random_tensor({B, Q, H, D}, GetParam(), rng);
    Tensor pos = varlen ? random_int32({B * Q}, rng, -3, 4 * NB + 3)
                        : random_int32({B, Q}, rng, -3, 4 * NB + 3);
    Tensor cu = int32_tensor({B + 1}, {0, 3, static_cast<int32_t>(B * Q)});
    Tensor seq = int32_tensor({B}, {7, 4});
    const auto call = [&](bool wide) {
      std::vector<Tensor> keep;
      const auto meta = [&](const Tensor& t) {
        keep.push_back(wide ? widened(t) : t);
        return keep.back().view();
      };
      IndexerScoreOptions o = reference_score();
      o.block_table = meta(table);
      o.query_positions = meta(pos);
      if (varlen) o.cu_seqlens_q = meta(cu);
      if (!varlen) o.seq_lens_q = meta(seq);
      Tensor out = Tensor::empty(qsa_indexer_mqa_score_shape(q, cache, o), DType::kF32);
      poison(out);
      qsa_indexer_mqa_score(q, cache, out, o);
      return to_vector(out);
    };
    const std::vector<double> narrow = call(false);
    EXPECT_EQ(call(true), narrow) << (varlen ? "varlen" : "padded");
    // Rows at a negative position are padding rows: every score -inf.
    const std::vector<double> p = to_vector(pos);
    for (size_t r = 0; r < p.size(); ++r) {
      if (p[r] >= 0) continue;
      for (int64_t b = 0; b < NB; ++b) EXPECT_EQ(narrow[r * NB + b], -kInf) << r;
    }
  }
}

// The position rule (docs/qsa.md, "Metadata"): token_to_req rows are never counted, so
// positions are required.
TEST(IndexerScore, TokenToReqNeedsQueryPositions) {
  auto rng = make_rng();
  Tensor q = random_tensor({4, 4, 16}, DType::kBF16, rng);
  Tensor k = random_tensor({2, 3, 16}, DType::kBF16, rng);
  Tensor t2r = int32_tensor({4}, {0, 1, 1, 0});
  Tensor out = Tensor::empty({4, 3}, DType::kF32);
  for (Backend backend : {Backend::kReference, Backend::kNative}) {
    IndexerScoreOptions o;
    o.backend = backend;
    o.token_to_req = t2r.view();
    try {
      qsa_indexer_mqa_score(q, k, out, o);
      ADD_FAILURE() << "no error";
    } catch (const ValueError& e) {
      EXPECT_EQ(std::string(e.what()).rfind("query_positions:", 0), 0u) << e.what();
    }
  }
}

TEST_P(IndexerDtype, ScoreVarlenWithQueryPositions) {
  auto rng = make_rng();
  const int64_t H = 4, D = 16, NB = 40, total = 10;
  Tensor q = random_tensor({total, H, D}, GetParam(), rng);
  Tensor k = random_tensor({2, NB, D}, GetParam(), rng);
  Tensor cu = int32_tensor({3}, {0, 3, 10});
  Tensor pos = random_int32({total}, rng, 0, 4 * NB + 3);  // chunked prefill: arbitrary positions
  IndexerScoreOptions o = reference_score();
  o.cu_seqlens_q = cu.view();
  o.query_positions = pos.view();
  Tensor out = Tensor::empty({total, NB}, DType::kF32);
  poison(out);
  qsa_indexer_mqa_score(q, k, out, o);
  const TensorView pv = pos.view();
  EXPECT_TRUE(all_close(out,
                        expected_scores(q, k, varlen_rows({0, 0, 0, 1, 1, 1, 1, 1, 1, 1}, &pv),
                                        std::nullopt, NB, 0.25),
                        kAtol, kRtol));
}

// Paged block keys: -1 and out-of-range pages mask their columns.
class ScorePaged : public ::testing::TestWithParam<std::tuple<int64_t, bool>> {};

TEST_P(ScorePaged, PaddedQueries) {
  const auto [page_size, with_head_axis] = GetParam();
  auto rng = make_rng();
  const int64_t B = 2, Q = 14, H = 4, D = 128, max_pages = 4, pages = 6;
  Tensor q = random_tensor({B, Q, H, D}, DType::kBF16, rng);
  Shape cache_shape{pages, page_size, D};
  if (with_head_axis) cache_shape = {pages, page_size, 1, D};
  Tensor cache = random_tensor(cache_shape, DType::kBF16, rng);
  Tensor table = int32_tensor({B, max_pages}, {3, -1, 0, 5, 6, 1, 100, 2});
  Tensor pos = random_int32({B, Q}, rng, 0, static_cast<int32_t>(4 * max_pages * page_size + 3));
  IndexerScoreOptions o = reference_score();
  o.block_table = table.view();
  o.page_size = page_size;
  o.query_positions = pos.view();
  const int64_t NB = max_pages * page_size;
  ASSERT_EQ(qsa_indexer_mqa_score_shape(q, cache, o), (Shape{B, Q, NB}));
  Tensor out = Tensor::empty({B, Q, NB}, DType::kF32);
  poison(out);
  qsa_indexer_mqa_score(q, cache, out, o);
  const TensorView pv = pos.view();
  EXPECT_TRUE(all_close(out,
                        expected_scores(q, cache, padded_rows(B, Q, &pv, nullptr), table.view(), NB,
                                        1.0 / std::sqrt(128.0)),
                        kAtol, kRtol));
}

TEST_P(ScorePaged, VarlenQueries) {
  const auto [page_size, with_head_axis] = GetParam();
  auto rng = make_rng();
  const int64_t H = 4, D = 64, max_pages = 3, pages = 5, total = 11;
  Tensor q = random_tensor({total, H, D}, DType::kF16, rng);
  Shape cache_shape{pages, page_size, D};
  if (with_head_axis) cache_shape = {pages, page_size, 1, D};
  Tensor cache = random_tensor(cache_shape, DType::kF16, rng);
  Tensor table = int32_tensor({2, max_pages}, {4, -1, 2, 0, -7, 5});
  Tensor t2r = int32_tensor({total}, {1, 0, 1, 1, 0, 0, 1, 0, 0, 1, 1});
  Tensor pos = random_int32({total}, rng, 0, static_cast<int32_t>(4 * max_pages * page_size + 3));
  IndexerScoreOptions o = reference_score();
  o.block_table = table.view();
  o.token_to_req = t2r.view();
  o.query_positions = pos.view();
  const int64_t NB = max_pages * page_size;
  Tensor out = Tensor::empty({total, NB}, DType::kF32);
  poison(out);
  qsa_indexer_mqa_score(q, cache, out, o);
  const TensorView pv = pos.view();
  EXPECT_TRUE(
      all_close(out,
                expected_scores(q, cache, varlen_rows({1, 0, 1, 1, 0, 0, 1, 0, 0, 1, 1}, &pv),
                                table.view(), NB, 1.0 / 8.0),
                kAtol, kRtol));
}

INSTANTIATE_TEST_SUITE_P(PageSizes, ScorePaged,
                         ::testing::Combine(::testing::Values<int64_t>(1, 3, 8, 64),
                                            ::testing::Bool()),
                         [](const auto& info) {
                           return "page" + std::to_string(std::get<0>(info.param)) +
                                  (std::get<1>(info.param) ? "_head_axis" : "_no_head_axis");
                         });

TEST(IndexerScore, GeneralHeadsDimAndStridedInputs) {
  auto rng = make_rng();
  const int64_t B = 2, Q = 9, H = 3, D = 20, NB = 4;
  // q_idx is every other query row of a bigger tensor; keys have a padded block axis.
  Tensor q_big = random_tensor({B, 2 * Q, H, D}, DType::kBF16, rng);
  TensorView q = q_big.view().as_strided({B, Q, H, D}, {2 * Q * H * D, 2 * H * D, D, 1});
  Tensor k_big = random_tensor({B, NB, D + 5}, DType::kBF16, rng);
  TensorView k = k_big.view().narrow(2, 5, D);
  Tensor out = Tensor::empty({B, Q, NB}, DType::kF32);
  poison(out);
  qsa_indexer_mqa_score(q, k, out, reference_score());
  EXPECT_TRUE(all_close(out,
                        expected_scores(q, k, padded_rows(B, Q, nullptr, nullptr), std::nullopt, NB,
                                        1.0 / std::sqrt(20.0)),
                        kAtol, kRtol));
}

TEST(IndexerScore, OutIntoStridedViewLeavesSurroundingsUntouched) {
  auto rng = make_rng();
  const int64_t B = 2, Q = 8, H = 4, D = 128, NB = 3;
  Tensor q = random_tensor({B, Q, H, D}, DType::kBF16, rng);
  Tensor k = random_tensor({B, NB, D}, DType::kBF16, rng);
  Tensor big = Tensor::empty({B, Q, NB + 4}, DType::kF32);
  poison(big);
  // Columns 2 .. NB + 1 of every row; columns 0, 1 and NB + 2.. must keep their NaN.
  TensorView out = big.view().narrow(2, 2, NB);
  qsa_indexer_mqa_score(q, k, out, reference_score());
  EXPECT_TRUE(all_close(out,
                        expected_scores(q, k, padded_rows(B, Q, nullptr, nullptr), std::nullopt, NB,
                                        1.0 / std::sqrt(128.0)),
                        kAtol, kRtol));
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t i = 0; i < Q; ++i) {
      for (int64_t c : {0, 1, 5, 6}) EXPECT_TRUE(std::isnan(get(big, {b, i, c})));
    }
  }
}

TEST(IndexerScore, EmptyDimensions) {
  auto rng = make_rng();
  Tensor q = random_tensor({2, 0, 4, 128}, DType::kBF16, rng);
  Tensor k = random_tensor({2, 0, 128}, DType::kBF16, rng);
  Tensor out = Tensor::empty({2, 0, 0}, DType::kF32);
  EXPECT_NO_THROW(qsa_indexer_mqa_score(q, k, out, reference_score()));
  Tensor qv = random_tensor({0, 4, 128}, DType::kBF16, rng);
  Tensor cu = int32_tensor({3}, {0, 0, 0});
  IndexerScoreOptions o = reference_score();
  o.cu_seqlens_q = cu.view();
  Tensor k2 = random_tensor({2, 5, 128}, DType::kBF16, rng);
  Tensor out2 = Tensor::empty({0, 5}, DType::kF32);
  EXPECT_NO_THROW(qsa_indexer_mqa_score(qv, k2, out2, o));
}

// Broken metadata contents: the reference reads them and raises instead of reading out of
// bounds; the output is left as it was.
void expect_contents_error(const std::function<void(const TensorView&)>& call, const Shape& shape,
                           const std::string& needle) {
  Tensor out = Tensor::empty(shape, DType::kF32);
  poison(out);
  try {
    call(out);
    ADD_FAILURE() << "expected ValueError mentioning " << needle;
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
  for (double v : to_vector(out)) EXPECT_TRUE(std::isnan(v));
}

TEST(IndexerScore, ReferenceRejectsBrokenCuSeqlens) {
  auto rng = make_rng();
  Tensor q = random_tensor({5, 4, 16}, DType::kBF16, rng);
  Tensor k = random_tensor({2, 3, 16}, DType::kBF16, rng);
  for (const std::vector<int32_t>& cu : {std::vector<int32_t>{0, 9, 5}, {0, 2, 4}, {1, 3, 5}}) {
    Tensor cu_t = int32_tensor({3}, cu);
    IndexerScoreOptions o = reference_score();
    o.cu_seqlens_q = cu_t.view();
    expect_contents_error([&](const TensorView& out) { qsa_indexer_mqa_score(q, k, out, o); },
                          {5, 3}, "cu_seqlens_q");
  }
}

TEST(IndexerScore, VarlenRowsPastInt32AreRefusedFromTheShape) {
  // cu_seqlens_q's int32 offsets cannot end at 2**40: refused by name before the output is
  // looked at (here it is missing, as when the Python wrapper could not allocate it).
  Tensor q = Tensor::empty({1, 4, 16}, DType::kBF16);
  Tensor k = Tensor::empty({2, 3, 16}, DType::kBF16);
  Tensor cu = int32_tensor({3}, {0, 0, 0});
  const TensorView qv = q.view().as_strided({int64_t{1} << 40, 4, 16}, {0, 16, 1});
  IndexerScoreOptions o = reference_score();
  o.cu_seqlens_q = cu.view();
  try {
    qsa_indexer_mqa_score(qv, k, TensorView(), o);
    ADD_FAILURE() << "expected a ValueError naming q_idx";
  } catch (const ValueError& e) {
    EXPECT_EQ(std::string(e.what()).rfind("q_idx:", 0), 0u) << e.what();
  }
}

TEST(IndexerScore, ReferenceChecksCuSeqlensBeforeBuildingRows) {
  // INT32_MAX broadcast rows and broken offsets: the reference refuses the offsets before it
  // builds anything per row (it used to allocate two vectors of q_len first).
  Tensor q = Tensor::empty({1, 4, 16}, DType::kBF16);
  Tensor k = Tensor::empty({2, 0, 16}, DType::kBF16);
  Tensor cu = int32_tensor({3}, {0, 0, 0});
  const int64_t rows = 2147483647;
  const TensorView qv = q.view().as_strided({rows, 4, 16}, {0, 16, 1});
  Tensor out = Tensor::empty({rows, 0}, DType::kF32);
  IndexerScoreOptions o = reference_score();
  o.cu_seqlens_q = cu.view();
  try {
    qsa_indexer_mqa_score(qv, k, out, o);
    ADD_FAILURE() << "expected a ValueError naming cu_seqlens_q";
  } catch (const ValueError& e) {
    EXPECT_EQ(std::string(e.what()).rfind("cu_seqlens_q:", 0), 0u) << e.what();
  }
}

TEST(IndexerScore, EmptyOutputOfHugeBroadcastRowsBuildsNoRows) {
  // No block to score: out [1, 2**40, 0] is empty and nothing per row is built.
  Tensor q = Tensor::empty({1, 1, 4, 16}, DType::kBF16);
  Tensor k = Tensor::empty({1, 0, 16}, DType::kBF16);
  const int64_t rows = int64_t{1} << 40;
  const TensorView qv = q.view().as_strided({1, rows, 4, 16}, {0, 0, 16, 1});
  Tensor out = Tensor::empty({1, rows, 0}, DType::kF32);
  EXPECT_NO_THROW(qsa_indexer_mqa_score(qv, k, out, reference_score()));
}

TEST(IndexerScore, ReferenceRejectsRequestIdOutOfRange) {
  auto rng = make_rng();
  Tensor q = random_tensor({4, 4, 16}, DType::kBF16, rng);
  Tensor k = random_tensor({3, 3, 16}, DType::kBF16, rng);
  for (int32_t bad : {-2, 2}) {  // -1 is a padding row, not an error
    Tensor t2r = int32_tensor({4}, {0, 1, bad, 0});
    Tensor pos = int32_tensor({4}, {0, 0, 1, 1});
    IndexerScoreOptions o = reference_score();
    o.token_to_req = t2r.view();
    o.query_positions = pos.view();
    o.num_requests = 2;
    expect_contents_error([&](const TensorView& out) { qsa_indexer_mqa_score(q, k, out, o); },
                          {4, 3}, "token_to_req");
  }
}

TEST(IndexerScore, ReferenceRejectsSeqLensQOutOfRange) {
  auto rng = make_rng();
  Tensor q = random_tensor({2, 3, 4, 16}, DType::kBF16, rng);
  Tensor k = random_tensor({2, 3, 16}, DType::kBF16, rng);
  for (int32_t bad : {-1, 4}) {
    Tensor sl = int32_tensor({2}, {1, bad});
    IndexerScoreOptions o = reference_score();
    o.seq_lens_q = sl.view();
    expect_contents_error([&](const TensorView& out) { qsa_indexer_mqa_score(q, k, out, o); },
                          {2, 3, 3}, "seq_lens_q");
  }
}

// ---------------------------------------------------------------------------------------
// qsa_mqa_prefill / qsa_mqa
// ---------------------------------------------------------------------------------------

std::vector<double> expected_prefill(const TensorView& q, const TensorView& k,
                                     const TensorView& starts, const TensorView& ends,
                                     double scale) {
  std::vector<double> out;
  for (int64_t r = 0; r < q.size(0); ++r) {
    const double s = get(starts, {r});
    const double e = get(ends, {r});
    for (int64_t j = 0; j < k.size(0); ++j) {
      const bool visible = j >= s && j < e;
      out.push_back(visible ? scale * relu_head_sum(q, {r}, k,
                                                    k.dim() == 3 ? std::vector<int64_t>{j, 0}
                                                                 : std::vector<int64_t>{j})
                            : -kInf);
    }
  }
  return out;
}

TEST_P(IndexerDtype, PrefillIntervalsClampedToKeys) {
  auto rng = make_rng();
  const int64_t rows = 9, H = 4, D = 128, keys = 13;
  Tensor q = random_tensor({rows, H, D}, GetParam(), rng);
  for (bool head_axis : {false, true}) {
    Tensor k = random_tensor(head_axis ? Shape{keys, 1, D} : Shape{keys, D}, GetParam(), rng);
    // Empty (start == end, start > end), negative start, end past keys, whole range.
    Tensor starts = int32_tensor({rows}, {0, 3, 5, -4, 10, 0, 12, 13, -100});
    Tensor ends = int32_tensor({rows}, {13, 3, 2, 4, 40, 1, 13, 20, 100});
    Tensor out = Tensor::empty({rows, keys}, DType::kF32);
    poison(out);
    MqaScoreOptions o = reference_mqa();
    o.score_scale = 2.0;
    qsa_mqa_prefill(q, k, starts, ends, out, o);
    EXPECT_TRUE(all_close(out, expected_prefill(q, k, starts, ends, 0.5), kAtol, kRtol));
    poison(out);
    qsa_mqa(q, k, starts, ends, out, o);
    EXPECT_TRUE(all_close(out, expected_prefill(q, k, starts, ends, 0.5), kAtol, kRtol));
  }
}

TEST(IndexerPrefill, StridedInputsAndOutputView) {
  auto rng = make_rng();
  const int64_t rows = 6, H = 2, D = 24, keys = 7;
  Tensor q_big = random_tensor({rows, H + 1, D}, DType::kF16, rng);
  TensorView q = q_big.view().narrow(1, 1, H);
  Tensor k = random_tensor({keys, D}, DType::kF16, rng);
  Tensor starts = random_int32({rows}, rng, -2, keys);
  Tensor ends = random_int32({rows}, rng, 0, keys + 2);
  Tensor big = Tensor::empty({rows + 2, keys * 2}, DType::kF32);
  poison(big);
  // Every other column of rows 1 .. rows.
  TensorView out = big.view().as_strided({rows, keys}, {2 * keys, 2}, 2 * keys);
  MqaScoreOptions o = reference_mqa();
  o.scale = 1.5;
  qsa_mqa_prefill(q, k, starts, ends, out, o);
  EXPECT_TRUE(all_close(out, expected_prefill(q, k, starts, ends, 1.5), kAtol, kRtol));
  for (int64_t r = 0; r < rows + 2; ++r) {
    for (int64_t c = 0; c < 2 * keys; ++c) {
      const bool inside = r >= 1 && r <= rows && c % 2 == 0;
      if (!inside) EXPECT_TRUE(std::isnan(get(big, {r, c}))) << r << "," << c;
    }
  }
  EXPECT_EQ(qsa_mqa_prefill_shape(q, k), (Shape{rows, keys}));
}

// ---------------------------------------------------------------------------------------
// qsa_mqa_decode
// ---------------------------------------------------------------------------------------

// Expected decode scores in output order (request b's query row r is row b * R + r): q
// [B, H, D] (R = 1) or [B, R, H, D], context_lens [B] (R = 1) or [B, R].
std::vector<double> expected_decode(const TensorView& q, const TensorView& cache,
                                    const TensorView& table, const TensorView& context_lens,
                                    int64_t max_model_len, double scale) {
  const int64_t page_size = cache.size(1);
  const int64_t rows = q.dim() == 4 ? q.size(1) : 1;
  std::vector<double> out;
  for (int64_t b = 0; b < q.size(0); ++b) {
    for (int64_t r = 0; r < rows; ++r) {
      const double context_len =
          context_lens.dim() == 2 ? get(context_lens, {b, r}) : get(context_lens, {b});
      for (int64_t c = 0; c < max_model_len; ++c) {
        const int64_t logical_page = c / page_size;
        if (c >= context_len || logical_page >= table.size(1)) {
          out.push_back(-kInf);
          continue;
        }
        const auto page = static_cast<int64_t>(get(table, {b, logical_page}));
        if (page < 0 || page >= cache.size(0)) {
          out.push_back(-kInf);
          continue;
        }
        std::vector<int64_t> ki{page, c % page_size};
        if (cache.dim() == 4) ki.push_back(0);
        std::vector<int64_t> qi{b};
        if (q.dim() == 4) qi.push_back(r);
        out.push_back(scale * relu_head_sum(q, qi, cache, ki));
      }
    }
  }
  return out;
}

class DecodePaged : public ::testing::TestWithParam<std::tuple<int64_t, DType>> {};

TEST_P(DecodePaged, MasksContextAndBadPages) {
  const auto [page_size, dtype] = GetParam();
  auto rng = make_rng();
  const int64_t B = 4, H = 4, D = 128, pages = 7, max_pages = 3;
  const int64_t capacity = max_pages * page_size;
  const int64_t max_model_len = capacity + 5;  // columns past the table are -inf too
  Tensor q = random_tensor({B, H, D}, dtype, rng);
  Tensor cache = random_tensor({pages, page_size, 1, D}, dtype, rng);
  Tensor table = int32_tensor({B, max_pages}, {6, 0, 3, -1, 2, 7, 5, 1, -1, 4, 200, 0});
  const auto cap = static_cast<int32_t>(capacity);
  Tensor context = int32_tensor({B}, {cap, cap / 2 + 1, 0, cap + 4});
  Tensor out = Tensor::empty({B, max_model_len}, DType::kF32);
  poison(out);
  qsa_mqa_decode(q, cache, table, context, max_model_len, out, reference_mqa());
  EXPECT_TRUE(all_close(
      out, expected_decode(q, cache, table, context, max_model_len, 1.0 / std::sqrt(128.0)), kAtol,
      kRtol));
  EXPECT_EQ(qsa_mqa_decode_shape(q, max_model_len), (Shape{B, max_model_len}));
}

INSTANTIATE_TEST_SUITE_P(PageSizes, DecodePaged,
                         ::testing::Combine(::testing::Values<int64_t>(1, 3, 8, 64),
                                            ::testing::Values(DType::kBF16, DType::kF16)),
                         [](const auto& info) {
                           return "page" + std::to_string(std::get<0>(info.param)) + "_" +
                                  dtype_name(std::get<1>(info.param));
                         });

TEST(IndexerDecode, BroadcastQueryRankFourAndNarrowWidth) {
  auto rng = make_rng();
  const int64_t B = 3, H = 4, D = 32, pages = 4, page_size = 5, max_pages = 2;
  // One query vector per request shared by all heads (head stride 0), as [B, 1, H, D].
  Tensor base = random_tensor({B, D}, DType::kBF16, rng);
  TensorView q = base.view().as_strided({B, 1, H, D}, {D, D, 0, 1});
  Tensor cache = random_tensor({pages, page_size, D}, DType::kBF16, rng);
  Tensor table = int32_tensor({B, max_pages}, {0, 1, 3, 2, 2, -1});
  Tensor context = int32_tensor({B}, {7, 10, 3});
  const int64_t max_model_len = 6;  // narrower than the table: context past it is not written
  Tensor big = Tensor::empty({B, max_model_len + 1}, DType::kF32);
  poison(big);
  TensorView out = big.view().narrow(1, 1, max_model_len);
  MqaScoreOptions o = reference_mqa();
  o.score_scale = 3.0;
  qsa_mqa_decode(q, cache, table, context, max_model_len, out, o);
  EXPECT_TRUE(all_close(out, expected_decode(q, cache, table, context, max_model_len, 1.0 / 3.0),
                        kAtol, kRtol));
  for (int64_t b = 0; b < B; ++b) EXPECT_TRUE(std::isnan(get(big, {b, 0})));
}

// Multi-token decode: R query rows per request, each with its own context length (consecutive
// counts as a speculative step has them, 0 and negative padding rows, counts past the table and
// past the output), pages of any size, int32 and int64 counts, q's rows strided (q is a view of
// a [R, B, H, D] buffer). Both host backends match the double expectation, and the CPU backend
// (which tiles a request's keys once for all of its rows) the reference bit for bit.
class DecodeMultiRow : public ::testing::TestWithParam<std::tuple<int64_t, int64_t, DType>> {};

TEST_P(DecodeMultiRow, EachRowSeesItsOwnContext) {
  const auto [R, page_size, meta] = GetParam();
  auto rng = make_rng();
  const int64_t B = 3, H = 4, D = 128, pages = 7, max_pages = 3;
  const int64_t cap = max_pages * page_size;
  const int64_t max_model_len = cap + 5;
  Tensor q_rows_first = random_tensor({R, B, H, D}, DType::kBF16, rng);
  const TensorView q = q_rows_first.view().as_strided({B, R, H, D}, {H * D, B * H * D, D, 1});
  Tensor cache = random_tensor({pages, page_size, 1, D}, DType::kBF16, rng);
  Tensor table = int32_tensor({B, max_pages}, {6, 0, 3, -1, 2, 7, 5, 1, -1});
  const std::vector<std::vector<int64_t>> per_row = {
      {cap - 5, cap - 4, cap - 3, cap - 2, cap - 1, cap},
      {0, cap + 4, 1, -2, cap / 2 + 1, 7},
      {max_model_len + 9, 2, 0, cap / 3, page_size + 1, 0}};
  std::vector<int64_t> lens;
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t r = 0; r < R; ++r) lens.push_back(per_row[b][r % 6]);
  }
  const Tensor context = meta == DType::kI64
                             ? int64_tensor({B, R}, lens)
                             : int32_tensor({B, R}, std::vector<int32_t>(lens.begin(), lens.end()));
  const std::vector<double> want =
      expected_decode(q, cache, table, context, max_model_len, 1.0 / std::sqrt(128.0));
  EXPECT_EQ(qsa_mqa_decode_shape(q, max_model_len), (Shape{B * R, max_model_len}));
  Tensor ref = Tensor::empty({B * R, max_model_len}, DType::kF32);
  Tensor cpu = Tensor::empty({B * R, max_model_len}, DType::kF32);
  poison(ref);
  poison(cpu);
  qsa_mqa_decode(q, cache, table, context, max_model_len, ref, reference_mqa());
  qsa_mqa_decode(q, cache, table, context, max_model_len, cpu, MqaScoreOptions{});
  EXPECT_TRUE(all_close(ref, want, kAtol, kRtol)) << "reference";
  EXPECT_TRUE(all_close(cpu, want, kAtol, kRtol)) << "cpu";
  EXPECT_EQ(std::memcmp(cpu.data(), ref.data(), cpu.numel() * sizeof(float)), 0);
}

INSTANTIATE_TEST_SUITE_P(RowsPagesMeta, DecodeMultiRow,
                         ::testing::Combine(::testing::Values<int64_t>(1, 2, 3, 4, 6),
                                            ::testing::Values<int64_t>(5, 16, 200, 212),
                                            ::testing::Values(DType::kI32, DType::kI64)),
                         [](const auto& info) {
                           return "rows" + std::to_string(std::get<0>(info.param)) + "_page" +
                                  std::to_string(std::get<1>(info.param)) + "_" +
                                  dtype_name(std::get<2>(info.param));
                         });

INSTANTIATE_TEST_SUITE_P(Dtypes, IndexerDtype, ::testing::Values(DType::kBF16, DType::kF16),
                         [](const auto& info) { return std::string(dtype_name(info.param)); });

}  // namespace
}  // namespace sparse_attn

// ---------------------------------------------------------------------------------------
// Validation: one case per rule, asserting the error kind and that the message names the
// argument. Inputs are valid except for the one thing each case breaks.
// ---------------------------------------------------------------------------------------

namespace sparse_attn {
namespace {

enum class Kind { kValue, kType, kNotSupported };

struct ValidationCase {
  std::string name;
  std::function<void()> call;
  Kind kind;
  std::string needle;  // must appear in the message (the argument's name)
};

void PrintTo(const ValidationCase& c, std::ostream* os) { *os << c.name; }

// A view claiming to live on cuda:0 over host memory: validation reads no contents, so every
// case that uses it must fail before a kernel would touch the memory.
TensorView on_cuda(const TensorView& t) {
  return TensorView(t.data(), t.dtype(), Device::cuda(0), t.shape(),
                    Shape(t.strides(), t.strides() + t.dim()));
}

struct Fixture {
  static constexpr int64_t B = 2, Q = 5, H = 4, D = 128, NB = 6, pages = 3, page_size = 8;
  Tensor q = Tensor::empty({B, Q, H, D}, DType::kBF16);
  Tensor qv = Tensor::empty({7, H, D}, DType::kBF16);
  Tensor k = Tensor::empty({B, NB, D}, DType::kBF16);
  Tensor cache = Tensor::empty({pages, page_size, 1, D}, DType::kBF16);
  Tensor table = int32_tensor({B, 2}, {0, 1, 2, -1});
  Tensor cu = int32_tensor({B + 1}, {0, 3, 7});
  Tensor t2r = int32_tensor({7}, {0, 0, 1, 1, 1, 0, 1});
  Tensor pos = int32_tensor({B, Q}, {0, 1, 2, 3, 4, 0, 1, 2, 3, 4});
  Tensor seq = int32_tensor({B}, {5, 2});
  Tensor out = Tensor::empty({B, Q, NB}, DType::kF32);
  Tensor out_paged = Tensor::empty({B, Q, 2 * page_size}, DType::kF32);
  Tensor outv = Tensor::empty({7, NB}, DType::kF32);
  // prefill
  Tensor pq = Tensor::empty({9, H, D}, DType::kF16);
  Tensor pk = Tensor::empty({11, D}, DType::kF16);
  Tensor starts = int32_tensor({9}, {0, 0, 0, 0, 0, 0, 0, 0, 0});
  Tensor ends = int32_tensor({9}, {1, 2, 3, 4, 5, 6, 7, 8, 9});
  Tensor pout = Tensor::empty({9, 11}, DType::kF32);
  // decode
  Tensor dq = Tensor::empty({B, H, D}, DType::kBF16);
  Tensor ctx = int32_tensor({B}, {9, 16});
  Tensor dout = Tensor::empty({B, 20}, DType::kF32);
};

Fixture& fx() {
  static Fixture f;
  return f;
}

IndexerScoreOptions paged_options() {
  IndexerScoreOptions o = reference_score();
  o.block_table = fx().table.view();
  return o;
}

IndexerScoreOptions varlen_options() {
  IndexerScoreOptions o = reference_score();
  o.cu_seqlens_q = fx().cu.view();
  return o;
}

void score(const TensorView& q, const TensorView& k, const TensorView& out,
           const IndexerScoreOptions& o) {
  qsa_indexer_mqa_score(q, k, out, o);
}

void prefill(const TensorView& q, const TensorView& k, const TensorView& s, const TensorView& e,
             const TensorView& out, const MqaScoreOptions& o = reference_mqa()) {
  qsa_mqa_prefill(q, k, s, e, out, o);
}

void decode(const TensorView& q, const TensorView& cache, const TensorView& table,
            const TensorView& ctx, int64_t max_model_len, const TensorView& out,
            const MqaScoreOptions& o = reference_mqa()) {
  qsa_mqa_decode(q, cache, table, ctx, max_model_len, out, o);
}

std::vector<ValidationCase> validation_cases() {
  Fixture& f = fx();
  const TensorView q = f.q, qv = f.qv, k = f.k, cache = f.cache, out = f.out, outv = f.outv;
  const TensorView out_paged = f.out_paged;
  std::vector<ValidationCase> c;
  auto add = [&](std::string name, std::function<void()> call, Kind kind, std::string needle) {
    c.push_back({std::move(name), std::move(call), kind, std::move(needle)});
  };
  auto with = [](IndexerScoreOptions o, auto edit) {
    edit(o);
    return o;
  };
  const IndexerScoreOptions ref = reference_score();

  // --- qsa_indexer_mqa_score: tensors ---
  add(
      "score_q_idx_rank", [=] { score(q.select(0, 0).select(0, 0), k, out, ref); }, Kind::kValue,
      "q_idx");
  add(
      "score_q_idx_dtype",
      [=] {
        Tensor q32 = Tensor::empty({2, 5, 4, 128}, DType::kF32);
        score(q32, k, out, ref);
      },
      Kind::kType, "q_idx");
  add(
      "score_block_keys_dtype",
      [=] {
        Tensor k16 = Tensor::empty({2, 6, 128}, DType::kF16);
        score(q, k16, out, ref);
      },
      Kind::kType, "block_keys");
  add(
      "score_block_keys_device", [=] { score(q, on_cuda(k), out, ref); }, Kind::kValue,
      "block_keys: expected device");
  add(
      "score_block_keys_dim", [=] { score(q, k.narrow(2, 0, 64), out, ref); }, Kind::kValue,
      "block_keys");
  add(
      "score_block_keys_rank", [=] { score(q, cache, out, ref); }, Kind::kValue, "block_keys");
  add(
      "score_q_idx_zero_heads", [=] { score(q.narrow(2, 0, 0), k, out, ref); }, Kind::kValue,
      "q_idx");
  add(
      "score_q_idx_null_data",
      [=] { score(TensorView(nullptr, DType::kBF16, Device::cpu(), q.shape()), k, out, ref); },
      Kind::kValue, "q_idx");
  add(
      "score_batch_mismatch", [=] { score(q.narrow(0, 0, 1), k, out.narrow(0, 0, 1), ref); },
      Kind::kValue, "q_idx");
  add(
      "score_block_size", [=] { score(q, k, out, with(ref, [](auto& o) { o.block_size = 8; })); },
      Kind::kValue, "block_size");
  // --- scaling ---
  add(
      "score_scale_and_score_scale",
      [=] {
        score(q, k, out, with(ref, [](auto& o) {
                o.scale = 0.1;
                o.score_scale = 10.0;
              }));
      },
      Kind::kValue, "score_scale");
  add(
      "score_scale_not_positive",
      [=] { score(q, k, out, with(ref, [](auto& o) { o.scale = 0.0; })); }, Kind::kValue, "scale");
  add(
      "score_scale_nan", [=] { score(q, k, out, with(ref, [](auto& o) { o.scale = NAN; })); },
      Kind::kValue, "scale");
  add(
      "score_score_scale_negative",
      [=] { score(q, k, out, with(ref, [](auto& o) { o.score_scale = -2.0; })); }, Kind::kValue,
      "score_scale");
  // Scales are applied in FP32: out of its range they would give inf, NaN or zeros.
  for (const auto& [bad, tag] : {std::pair{1e39, "1e39"}, {1e-46, "1e_46"}}) {
    add(
        std::string("score_scale_") + tag,
        [=] { score(q, k, out, with(ref, [=](auto& o) { o.scale = bad; })); }, Kind::kValue,
        "scale: expected a value representable as a positive finite float32");
    add(
        std::string("score_score_scale_") + tag,
        [=] { score(q, k, out, with(ref, [=](auto& o) { o.score_scale = bad; })); }, Kind::kValue,
        "score_scale: expected a value representable as a positive finite float32");
  }
  add(
      "score_score_scale_reciprocal_overflows",
      [=] { score(q, k, out, with(ref, [](auto& o) { o.score_scale = 1e-40; })); }, Kind::kValue,
      "score_scale: expected 1 / score_scale to be representable");
  // --- paged keys ---
  add(
      "score_page_size_mismatch",
      [=] { score(q, cache, out_paged, with(paged_options(), [](auto& o) { o.page_size = 4; })); },
      Kind::kValue, "page_size");
  add(
      "score_page_size_without_block_table",
      [=] { score(q, k, out, with(ref, [](auto& o) { o.page_size = 8; })); }, Kind::kValue,
      "page_size");
  add(
      "score_block_table_dtype",
      [=] {
        Tensor t = Tensor::empty({2, 2}, DType::kF32);
        score(q, cache, out_paged,
              with(paged_options(), [&](auto& o) { o.block_table = t.view(); }));
      },
      Kind::kType, "block_table");
  add(
      "score_block_table_rank",
      [=] {
        score(q, cache, out_paged,
              with(paged_options(), [](auto& o) { o.block_table = o.block_table->select(0, 0); }));
      },
      Kind::kValue, "block_table");
  add(
      "score_block_table_device",
      [=] {
        score(q, cache, out_paged,
              with(paged_options(), [](auto& o) { o.block_table = on_cuda(*o.block_table); }));
      },
      Kind::kValue, "block_table: expected device");
  add(
      "score_block_table_batch",
      [=] {
        score(q, cache, out_paged.narrow(1, 0, 5), with(paged_options(), [](auto& o) {
                o.block_table = o.block_table->narrow(0, 0, 1);
              }));
      },
      Kind::kValue, "block_table");
  add(
      "score_paged_cache_head_axis",
      [=] {
        Tensor c2 = Tensor::empty({3, 8, 2, 128}, DType::kBF16);
        score(q, c2, out_paged, paged_options());
      },
      Kind::kValue, "block_keys");
  add(
      "score_paged_cache_zero_page_size",
      [=] {
        Tensor c0 = Tensor::empty({3, 0, 128}, DType::kBF16);
        score(q, c0, out_paged.narrow(2, 0, 0), paged_options());
      },
      Kind::kValue, "block_keys");
  // --- request layout ---
  add(
      "score_cu_seqlens_with_padded_q",
      [=] { score(q, k, out, with(ref, [](auto& o) { o.cu_seqlens_q = fx().cu.view(); })); },
      Kind::kValue, "cu_seqlens_q");
  add(
      "score_token_to_req_with_padded_q",
      [=] { score(q, k, out, with(ref, [](auto& o) { o.token_to_req = fx().t2r.view(); })); },
      Kind::kValue, "token_to_req");
  add(
      "score_num_requests_with_padded_q",
      [=] { score(q, k, out, with(ref, [](auto& o) { o.num_requests = 2; })); }, Kind::kValue,
      "num_requests");
  add(
      "score_varlen_needs_a_mapping", [=] { score(qv, k, outv, ref); }, Kind::kValue,
      "cu_seqlens_q");
  add(
      "score_varlen_both_mappings",
      [=] {
        score(qv, k, outv,
              with(varlen_options(), [](auto& o) { o.token_to_req = fx().t2r.view(); }));
      },
      Kind::kValue, "token_to_req");
  add(
      "score_seq_lens_q_with_varlen",
      [=] {
        score(qv, k, outv, with(varlen_options(), [](auto& o) { o.seq_lens_q = fx().seq.view(); }));
      },
      Kind::kValue, "seq_lens_q");
  add(
      "score_num_requests_with_cu_seqlens",
      [=] { score(qv, k, outv, with(varlen_options(), [](auto& o) { o.num_requests = 2; })); },
      Kind::kValue, "num_requests");
  add(
      "score_cu_seqlens_shape",
      [=] {
        score(qv, k, outv, with(varlen_options(), [](auto& o) {
                o.cu_seqlens_q = o.cu_seqlens_q->narrow(0, 0, 2);
              }));
      },
      Kind::kValue, "cu_seqlens_q");
  add(
      "score_cu_seqlens_dtype",
      [=] {
        Tensor t = Tensor::empty({3}, DType::kF32);
        score(qv, k, outv, with(varlen_options(), [&](auto& o) { o.cu_seqlens_q = t.view(); }));
      },
      Kind::kType, "cu_seqlens_q");
  add(
      "score_token_to_req_shape",
      [=] {
        score(qv, k, outv,
              with(ref, [](auto& o) { o.token_to_req = fx().t2r.view().narrow(0, 0, 6); }));
      },
      Kind::kValue, "token_to_req");
  add(
      "score_token_to_req_device",
      [=] { score(qv, k, outv, with(ref, [](auto& o) { o.token_to_req = on_cuda(fx().t2r); })); },
      Kind::kValue, "token_to_req: expected device");
  add(
      "score_num_requests_above_key_batch",
      [=] {
        score(qv, k, outv, with(ref, [](auto& o) {
                o.token_to_req = fx().t2r.view();
                o.num_requests = 3;
              }));
      },
      Kind::kValue, "num_requests");
  add(
      "score_num_requests_negative",
      [=] {
        score(qv, k, outv, with(ref, [](auto& o) {
                o.token_to_req = fx().t2r.view();
                o.num_requests = -1;
              }));
      },
      Kind::kValue, "num_requests");
  add(
      "score_query_positions_shape_padded",
      [=] {
        score(q, k, out,
              with(ref, [](auto& o) { o.query_positions = fx().pos.view().narrow(1, 0, 4); }));
      },
      Kind::kValue, "query_positions");
  add(
      "score_query_positions_shape_varlen",
      [=] {
        score(qv, k, outv,
              with(varlen_options(), [](auto& o) { o.query_positions = fx().pos.view(); }));
      },
      Kind::kValue, "query_positions");
  add(
      "score_query_positions_dtype",
      [=] {
        Tensor t = Tensor::empty({2, 5}, DType::kF32);
        score(q, k, out, with(ref, [&](auto& o) { o.query_positions = t.view(); }));
      },
      Kind::kType, "query_positions");
  add(
      "score_seq_lens_q_shape",
      [=] { score(q, k, out, with(ref, [](auto& o) { o.seq_lens_q = fx().cu.view(); })); },
      Kind::kValue, "seq_lens_q");
  add(
      "score_seq_lens_q_dtype",
      [=] {
        Tensor t = Tensor::empty({2}, DType::kF32);
        score(q, k, out, with(ref, [&](auto& o) { o.seq_lens_q = t.view(); }));
      },
      Kind::kType, "seq_lens_q");
  // --- out ---
  add(
      "score_out_dtype",
      [=] {
        Tensor o16 = Tensor::empty({2, 5, 6}, DType::kBF16);
        score(q, k, o16, ref);
      },
      Kind::kType, "out");
  add(
      "score_out_shape", [=] { score(q, k, out.narrow(2, 0, 5), ref); }, Kind::kValue, "out");
  add(
      "score_out_device", [=] { score(q, k, on_cuda(out), ref); }, Kind::kValue,
      "out: expected device");
  add(
      "score_out_broadcast_stride",
      [=] {
        score(q, k, out.as_strided({2, 5, 6}, {30, 0, 1}), ref);
      },
      Kind::kValue, "out");
  add(
      "score_out_elements_overlap",
      [=] {
        score(q, k, out.as_strided({2, 5, 6}, {30, 1, 1}), ref);
      },
      Kind::kValue, "out: elements overlap");
  add(
      "score_out_overlaps_q_idx",
      [=] {
        score(q, k, TensorView(q.data(), DType::kF32, Device::cpu(), {2, 5, 6}), ref);
      },
      Kind::kValue, "overlaps q_idx");
  add(
      "score_out_overlaps_block_table",
      [=] {
        score(q, cache, TensorView(fx().table.data(), DType::kF32, Device::cpu(), {2, 5, 16}),
              paged_options());
      },
      Kind::kValue, "overlaps block_table");
  // --- native ---
  add(
      "score_native_heads_dim",
      [=] {
        Tensor q2 = Tensor::empty({2, 5, 2, 128}, DType::kBF16);
        score(on_cuda(q2), on_cuda(k), on_cuda(out), IndexerScoreOptions{});
      },
      Kind::kNotSupported, "q_idx");
  add(
      "score_native_q_idx_alignment",
      [=] {
        Tensor big = Tensor::empty({2 * 5 * 4 * 128 + 8}, DType::kBF16);
        TensorView qm = big.view().as_strided({2, 5, 4, 128}, {2560, 512, 128, 1}, 1);
        score(on_cuda(qm), on_cuda(k), on_cuda(out), IndexerScoreOptions{});
      },
      Kind::kValue, "q_idx: vector loads require unit feature stride and 16-byte alignment");
  add(
      "score_native_block_keys_outer_stride",
      [=] {
        Tensor big = Tensor::empty({2, 6, 133}, DType::kBF16);
        score(on_cuda(q), on_cuda(big.view().narrow(2, 0, 128)), on_cuda(out),
              IndexerScoreOptions{});
      },
      Kind::kValue, "block_keys: vector loads");
  add(
      "score_native_feature_stride",
      [=] {
        Tensor big = Tensor::empty({2, 6, 128, 2}, DType::kBF16);
        score(on_cuda(q), on_cuda(big.view().select(3, 0)), on_cuda(out), IndexerScoreOptions{});
      },
      Kind::kValue, "block_keys: vector loads");
#ifndef SPARSE_ATTN_TEST_HAS_CUDA
  add(
      "score_native_needs_cuda_build",
      [=] { score(on_cuda(q), on_cuda(k), on_cuda(out), IndexerScoreOptions{}); },
      Kind::kNotSupported, "CUDA build");
  // The reference stages CUDA tensors through the host, which needs CUDA support.
  add(
      "score_reference_cuda_tensors_need_cuda_build",
      [=] { score(on_cuda(q), on_cuda(k), on_cuda(out), ref); }, Kind::kNotSupported,
      "no CUDA support");
#endif

  // --- qsa_mqa_prefill ---
  const TensorView pq = f.pq, pk = f.pk, ps = f.starts, pe = f.ends, pout = f.pout;
  add(
      "prefill_q_rank", [=] { prefill(pq.select(1, 0), pk, ps, pe, pout); }, Kind::kValue, "q");
  add(
      "prefill_q_dtype",
      [=] {
        Tensor t = Tensor::empty({9, 4, 128}, DType::kF32);
        prefill(t, pk, ps, pe, pout);
      },
      Kind::kType, "q");
  add(
      "prefill_k_rank",
      [=] {
        prefill(pq, pk.as_strided({11, 1, 1, 128}, {128, 128, 128, 1}), ps, pe, pout);
      },
      Kind::kValue, "k");
  add(
      "prefill_k_head_axis",
      [=] {
        Tensor t = Tensor::empty({11, 2, 128}, DType::kF16);
        prefill(pq, t, ps, pe, pout);
      },
      Kind::kValue, "k");
  add(
      "prefill_k_dtype",
      [=] {
        Tensor t = Tensor::empty({11, 128}, DType::kBF16);
        prefill(pq, t, ps, pe, pout);
      },
      Kind::kType, "k");
  add(
      "prefill_k_dim", [=] { prefill(pq, pk.narrow(1, 0, 64), ps, pe, pout); }, Kind::kValue, "k");
  add(
      "prefill_row_starts_dtype",
      [=] {
        Tensor t = Tensor::empty({9}, DType::kF32);
        prefill(pq, pk, t, pe, pout);
      },
      Kind::kType, "row_starts");
  add(
      "prefill_row_starts_shape", [=] { prefill(pq, pk, ps.narrow(0, 0, 8), pe, pout); },
      Kind::kValue, "row_starts");
  add(
      "prefill_row_ends_shape", [=] { prefill(pq, pk, ps, pe.narrow(0, 0, 8), pout); },
      Kind::kValue, "row_ends");
  add(
      "prefill_row_ends_device", [=] { prefill(pq, pk, ps, on_cuda(pe), pout); }, Kind::kValue,
      "row_ends: expected device");
  add(
      "prefill_scale_and_score_scale",
      [=] {
        MqaScoreOptions o = reference_mqa();
        o.scale = 1.0;
        o.score_scale = 1.0;
        prefill(pq, pk, ps, pe, pout, o);
      },
      Kind::kValue, "score_scale");
  add(
      "prefill_scale_outside_float32",
      [=] {
        MqaScoreOptions o = reference_mqa();
        o.scale = 1e39;
        prefill(pq, pk, ps, pe, pout, o);
      },
      Kind::kValue, "scale: expected a value representable as a positive finite float32");
  add(
      "prefill_score_scale_outside_float32",
      [=] {
        MqaScoreOptions o = reference_mqa();
        o.score_scale = 1e-46;
        prefill(pq, pk, ps, pe, pout, o);
      },
      Kind::kValue, "score_scale: expected a value representable as a positive finite float32");
  add(
      "prefill_out_shape", [=] { prefill(pq, pk, ps, pe, pout.narrow(1, 0, 10)); }, Kind::kValue,
      "out");
  add(
      "prefill_out_elements_overlap",
      [=] {
        prefill(pq, pk, ps, pe, pout.as_strided({9, 11}, {1, 1}));
      },
      Kind::kValue, "out: elements overlap");
  add(
      "prefill_out_overlaps_k",
      [=] {
        prefill(pq, pk, ps, pe, TensorView(pk.data(), DType::kF32, Device::cpu(), {9, 11}));
      },
      Kind::kValue, "overlaps k");
  add(
      "prefill_out_overlaps_row_ends",
      [=] {
        prefill(pq, pk, ps, pe, TensorView(pe.data(), DType::kF32, Device::cpu(), {9, 11}));
      },
      Kind::kValue, "overlaps row_ends");
  add(
      "prefill_native_q_alignment",
      [=] {
        Tensor big = Tensor::empty({9 * 4 * 128 + 8}, DType::kF16);
        TensorView qm = big.view().as_strided({9, 4, 128}, {512, 128, 1}, 4);
        prefill(on_cuda(qm), on_cuda(pk), on_cuda(ps), on_cuda(pe), on_cuda(pout),
                MqaScoreOptions{});
      },
      Kind::kValue, "q: vector loads");
  add(
      "prefill_native_k_outer_stride",
      [=] {
        Tensor big = Tensor::empty({11, 130}, DType::kF16);
        prefill(on_cuda(pq), on_cuda(big.view().narrow(1, 0, 128)), on_cuda(ps), on_cuda(pe),
                on_cuda(pout), MqaScoreOptions{});
      },
      Kind::kValue, "k: vector loads");

  // --- qsa_mqa_decode ---
  const TensorView dq = f.dq, table = f.table, ctx = f.ctx, dout = f.dout;
  add(
      "decode_q_rank", [=] { decode(dq.select(0, 0), cache, table, ctx, 20, dout); }, Kind::kValue,
      "q");
  add(
      "decode_q_zero_rows",
      [=] {
        Tensor t = Tensor::empty({2, 0, 4, 128}, DType::kBF16);
        decode(t, cache, table, ctx, 20, dout);
      },
      Kind::kValue, "q: expected at least one query row per request");
  add(
      "decode_q_dtype",
      [=] {
        Tensor t = Tensor::empty({2, 4, 128}, DType::kF32);
        decode(t, cache, table, ctx, 20, dout);
      },
      Kind::kType, "q");
  add(
      "decode_k_cache_rank",
      [=] { decode(dq, cache.select(0, 0).select(0, 0), table, ctx, 20, dout); }, Kind::kValue,
      "k_cache");
  add(
      "decode_k_cache_head_axis",
      [=] {
        Tensor t = Tensor::empty({3, 8, 2, 128}, DType::kBF16);
        decode(dq, t, table, ctx, 20, dout);
      },
      Kind::kValue, "k_cache");
  add(
      "decode_k_cache_dtype",
      [=] {
        Tensor t = Tensor::empty({3, 8, 128}, DType::kF16);
        decode(dq, t, table, ctx, 20, dout);
      },
      Kind::kType, "k_cache");
  add(
      "decode_k_cache_zero_page_size",
      [=] {
        Tensor t = Tensor::empty({3, 0, 128}, DType::kBF16);
        decode(dq, t, table, ctx, 20, dout);
      },
      Kind::kValue, "k_cache");
  add(
      "decode_page_table_dtype",
      [=] {
        Tensor t = Tensor::empty({2, 2}, DType::kF32);
        decode(dq, cache, t, ctx, 20, dout);
      },
      Kind::kType, "page_table");
  add(
      "decode_page_table_rank", [=] { decode(dq, cache, table.select(1, 0), ctx, 20, dout); },
      Kind::kValue, "page_table");
  add(
      "decode_page_table_batch", [=] { decode(dq, cache, table.narrow(0, 0, 1), ctx, 20, dout); },
      Kind::kValue, "page_table");
  add(
      "decode_context_lens_shape", [=] { decode(dq, cache, table, ctx.narrow(0, 0, 1), 20, dout); },
      Kind::kValue, "context_lens");
  add(
      "decode_context_lens_per_request_with_three_rows",
      [=] {
        Tensor t = Tensor::empty({2, 3, 4, 128}, DType::kBF16);
        Tensor o = Tensor::empty({6, 20}, DType::kF32);
        decode(t, cache, table, ctx, 20, o);
      },
      Kind::kValue,
      "context_lens: expected shape [B, R] = [2, 3]: each query row of multi-token decode sees "
      "its own number of compressed keys");
  add(
      "decode_context_lens_rows",
      [=] {
        Tensor t = Tensor::empty({2, 3, 4, 128}, DType::kBF16);
        Tensor o = Tensor::empty({6, 20}, DType::kF32);
        decode(t, cache, table, int32_tensor({2, 2}, {9, 9, 16, 16}), 20, o);
      },
      Kind::kValue, "context_lens: expected shape [2, 3]");
  add(
      "decode_context_lens_rank",
      [=] {
        decode(dq, cache, table, int32_tensor({2, 1, 1}, {9, 16}), 20, dout);
      },
      Kind::kValue, "context_lens: expected shape [2, 1]");
  add(
      "decode_context_lens_dtype",
      [=] {
        Tensor t = Tensor::empty({2}, DType::kF32);
        decode(dq, cache, table, t, 20, dout);
      },
      Kind::kType, "context_lens");
  add(
      "decode_max_model_len_negative", [=] { decode(dq, cache, table, ctx, -1, dout); },
      Kind::kValue, "max_model_len");
  add(
      "decode_score_scale_not_positive",
      [=] {
        MqaScoreOptions o = reference_mqa();
        o.score_scale = 0.0;
        decode(dq, cache, table, ctx, 20, dout, o);
      },
      Kind::kValue, "score_scale");
  add(
      "decode_out_shape", [=] { decode(dq, cache, table, ctx, 21, dout); }, Kind::kValue, "out");
  add(
      "decode_out_one_row_per_request_with_two_rows",
      [=] {
        Tensor t = Tensor::empty({2, 2, 4, 128}, DType::kBF16);
        decode(t, cache, table, int32_tensor({2, 2}, {9, 9, 16, 16}), 20, dout);
      },
      Kind::kValue, "out: expected shape [4, 20]");
  add(
      "decode_out_elements_overlap",
      [=] {
        decode(dq, cache, table, ctx, 20, dout.as_strided(dout.shape(), {1, 1}));
      },
      Kind::kValue, "out: elements overlap");
  add(
      "decode_out_overlaps_context_lens",
      [=] {
        decode(dq, cache, table, ctx, 20,
               TensorView(ctx.data(), DType::kF32, Device::cpu(), {2, 20}));
      },
      Kind::kValue, "overlaps context_lens");
  add(
      "decode_native_rows",
      [=] {
        Tensor t = Tensor::empty({2, 5, 4, 128}, DType::kBF16);
        Tensor c = int32_tensor({2, 5}, {9, 9, 9, 9, 9, 16, 16, 16, 16, 16});
        Tensor o = Tensor::empty({10, 20}, DType::kF32);
        decode(on_cuda(t), on_cuda(cache), on_cuda(table), on_cuda(c), 20, on_cuda(o),
               MqaScoreOptions{});
      },
      Kind::kNotSupported, "q: backend 'native' takes at most 4 query rows per request, got R = 5");
  add(
      "decode_native_heads_dim",
      [=] {
        Tensor t = Tensor::empty({2, 4, 64}, DType::kBF16);
        Tensor c = Tensor::empty({3, 8, 64}, DType::kBF16);
        decode(on_cuda(t), on_cuda(c), on_cuda(table), on_cuda(ctx), 20, on_cuda(dout),
               MqaScoreOptions{});
      },
      Kind::kNotSupported, "q");
#ifndef SPARSE_ATTN_TEST_HAS_CUDA
  // Broadcast queries pass the native checks (decode has no vector-load rule).
  add(
      "decode_native_broadcast_q_needs_cuda_build",
      [=] {
        TensorView bq = dq.as_strided({2, 4, 128}, {0, 0, 1});
        decode(on_cuda(bq), on_cuda(cache), on_cuda(table), on_cuda(ctx), 20, on_cuda(dout),
               MqaScoreOptions{});
      },
      Kind::kNotSupported, "CUDA build");
  // So do four query rows per request and page sizes other than powers of two.
  add(
      "decode_native_four_rows_needs_cuda_build",
      [=] {
        Tensor t = Tensor::empty({2, 4, 4, 128}, DType::kBF16);
        Tensor kc = Tensor::empty({3, 200, 128}, DType::kBF16);
        Tensor c = int32_tensor({2, 4}, {9, 9, 9, 9, 16, 16, 16, 16});
        Tensor o = Tensor::empty({8, 20}, DType::kF32);
        decode(on_cuda(t), on_cuda(kc), on_cuda(table), on_cuda(c), 20, on_cuda(o),
               MqaScoreOptions{});
      },
      Kind::kNotSupported, "CUDA build");
#endif
  return c;
}

class IndexerValidation : public ::testing::TestWithParam<ValidationCase> {};

TEST_P(IndexerValidation, RaisesNamingTheArgument) {
  const ValidationCase& c = GetParam();
  try {
    c.call();
    FAIL() << "no error; expected one mentioning '" << c.needle << "'";
  } catch (const NotSupportedError& e) {
    EXPECT_EQ(c.kind, Kind::kNotSupported) << e.what();
    EXPECT_NE(std::string(e.what()).find(c.needle), std::string::npos) << e.what();
  } catch (const ValueError& e) {
    EXPECT_EQ(c.kind, Kind::kValue) << e.what();
    EXPECT_NE(std::string(e.what()).find(c.needle), std::string::npos) << e.what();
  } catch (const TypeError& e) {
    EXPECT_EQ(c.kind, Kind::kType) << e.what();
    EXPECT_NE(std::string(e.what()).find(c.needle), std::string::npos) << e.what();
  }
}

INSTANTIATE_TEST_SUITE_P(Rules, IndexerValidation, ::testing::ValuesIn(validation_cases()),
                         [](const auto& info) { return info.param.name; });

}  // namespace
}  // namespace sparse_attn
