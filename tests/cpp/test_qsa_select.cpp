// Selection helpers (qsa_topk_blocks, qsa_expand_blocks) against expectations computed here,
// plus one test per validation rule.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "sparse_attn/errors.h"
#include "sparse_attn/qsa_select.h"
#include "test_util.h"

namespace sparse_attn {
namespace {

using testing::get;
using testing::int32_tensor;
using testing::make_rng;
using testing::poison;
using testing::random_int32;
using testing::set;
using testing::to_vector;

constexpr float kInf = std::numeric_limits<float>::infinity();

// Row r of a [rows, n] or [B, Q, n] view as a vector.
std::vector<double> row_of(const TensorView& t, int64_t r) {
  std::vector<double> v;
  const int64_t rows_per_batch = t.size(-2);
  for (int64_t j = 0; j < t.size(-1); ++j) {
    v.push_back(t.dim() == 3 ? get(t, {r / rows_per_batch, r % rows_per_batch, j})
                             : get(t, {r, j}));
  }
  return v;
}

int64_t num_rows(const TensorView& t) { return t.numel() == 0 ? 0 : t.numel() / t.size(-1); }

// Expected top-k: a stable sort by descending score keeps equal scores in ascending id order.
std::vector<double> expected_topk(const TensorView& scores, int64_t k) {
  std::vector<double> out;
  for (int64_t r = 0; r < num_rows(scores); ++r) {
    const std::vector<double> s = row_of(scores, r);
    std::vector<int64_t> ids;
    for (size_t j = 0; j < s.size(); ++j) {
      if (std::isfinite(s[j])) ids.push_back(static_cast<int64_t>(j));
    }
    std::stable_sort(ids.begin(), ids.end(), [&](int64_t a, int64_t b) { return s[a] > s[b]; });
    for (int64_t j = 0; j < k; ++j) {
      out.push_back(j < static_cast<int64_t>(ids.size()) ? static_cast<double>(ids[j]) : -1.0);
    }
  }
  return out;
}

// Scores drawn from a few values so that ties are common; some invisible.
Tensor tied_scores(const Shape& shape, std::mt19937_64& rng) {
  Tensor t = Tensor::empty(shape, DType::kF32);
  const float values[] = {-kInf, -1.5f, 0.f, 0.25f, 0.25f, 3.f, kInf, NAN};
  std::uniform_int_distribution<int> pick(0, 7);
  for (int64_t i = 0; i < t.numel(); ++i) t.data_as<float>()[i] = values[pick(rng)];
  return t;
}

TEST(QsaTopk, TiesGoToLowerBlockIdAndOrderIsDescending) {
  Tensor scores = Tensor::empty({1, 7}, DType::kF32);
  const float s[] = {1.f, 2.f, 2.f, 1.f, -kInf, 2.f, 0.5f};
  std::copy(s, s + 7, scores.data_as<float>());
  Tensor out = Tensor::empty({1, 5}, DType::kI32);
  poison(out);
  qsa_topk_blocks(scores, 5, out);
  EXPECT_EQ(to_vector(out), (std::vector<double>{1, 2, 5, 0, 3}));
}

TEST(QsaTopk, FewerVisibleThanKPadsWithMinusOne) {
  Tensor scores = Tensor::empty({2, 4}, DType::kF32);
  const float s[] = {-kInf, 0.5f, -kInf, NAN, -kInf, -kInf, -kInf, -kInf};
  std::copy(s, s + 8, scores.data_as<float>());
  Tensor out = Tensor::empty({2, 6}, DType::kI32);  // k > N_B is allowed
  poison(out);
  qsa_topk_blocks(scores, 6, out);
  EXPECT_EQ(to_vector(out), (std::vector<double>{1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1}));
}

class QsaTopkRandom : public ::testing::TestWithParam<std::tuple<int64_t, bool>> {};

TEST_P(QsaTopkRandom, MatchesStableSort) {
  const auto [k, batched] = GetParam();
  auto rng = make_rng();
  const Shape shape = batched ? Shape{3, 5, 37} : Shape{11, 37};
  Tensor scores = tied_scores(shape, rng);
  // Also random distinct values in some rows.
  std::uniform_real_distribution<float> u(-4.f, 4.f);
  for (int64_t j = 0; j < 37; ++j) scores.data_as<float>()[j] = u(rng);
  const Shape out_shape = qsa_topk_blocks_shape(scores, k);
  Shape expected_shape = shape;
  expected_shape.back() = k;
  ASSERT_EQ(out_shape, expected_shape);
  Tensor out = Tensor::empty(out_shape, DType::kI32);
  poison(out);
  qsa_topk_blocks(scores, k, out);
  EXPECT_EQ(to_vector(out), expected_topk(scores, k));
}

INSTANTIATE_TEST_SUITE_P(Ks, QsaTopkRandom,
                         ::testing::Combine(::testing::Values<int64_t>(1, 4, 36, 37, 40),
                                            ::testing::Bool()),
                         [](const auto& info) {
                           return "k" + std::to_string(std::get<0>(info.param)) +
                                  (std::get<1>(info.param) ? "_padded" : "_rows");
                         });

TEST(QsaTopk, DefaultKAndStridedViews) {
  auto rng = make_rng();
  const int64_t rows = 3, nb = 1500;
  EXPECT_EQ(kQsaTopkBlocks, 512);
  // Scores are every other column of a wider buffer.
  Tensor wide = tied_scores({rows, 2 * nb}, rng);
  TensorView scores = wide.view().as_strided({rows, nb}, {2 * nb, 2});
  ASSERT_EQ(qsa_topk_blocks_shape(scores), (Shape{rows, kQsaTopkBlocks}));
  Tensor big = Tensor::empty({rows, kQsaTopkBlocks + 2}, DType::kI32);
  poison(big);
  TensorView out = big.view().narrow(1, 1, kQsaTopkBlocks);
  qsa_topk_blocks(scores, kQsaTopkBlocks, out);
  EXPECT_EQ(to_vector(out), expected_topk(scores, kQsaTopkBlocks));
  for (int64_t r = 0; r < rows; ++r) {
    EXPECT_EQ(get(big, {r, 0}), 0x7f7f7f7f);
    EXPECT_EQ(get(big, {r, kQsaTopkBlocks + 1}), 0x7f7f7f7f);
  }
}

// ---------------------------------------------------------------------------------------
// qsa_expand_blocks
// ---------------------------------------------------------------------------------------

struct Expanded {
  std::vector<double> tokens;
  std::vector<double> blocks;
};

Expanded expected_expand(const TensorView& ids, const TensorView& pos) {
  Expanded e;
  const int64_t k = ids.size(-1);
  const std::vector<double> positions = to_vector(pos);
  for (int64_t r = 0; r < num_rows(ids); ++r) {
    const auto p = static_cast<int64_t>(positions[r]);
    std::vector<double> tokens, blocks;
    for (double b : row_of(ids, r)) {
      if (b >= 0 && 4 * b + 3 <= p) {
        blocks.push_back(b);
        for (int t = 0; t < 4; ++t) tokens.push_back(4 * b + t);
      }
    }
    // The block holding p is incomplete unless p is its last token (p % 4 == 3).
    if (p >= 0 && p % 4 != 3) {
      for (int64_t t = p - p % 4; t <= p; ++t) tokens.push_back(static_cast<double>(t));
    }
    tokens.resize(4 * k + 3, -1.0);
    blocks.resize(k, -1.0);
    e.tokens.insert(e.tokens.end(), tokens.begin(), tokens.end());
    e.blocks.insert(e.blocks.end(), blocks.begin(), blocks.end());
  }
  return e;
}

TEST(QsaExpand, TailForEachPositionModFour) {
  // Block 0 (tokens 0..3) and block 1 (4..7) selected; positions 4..7 cover p % 4 = 0..3.
  Tensor ids = int32_tensor({4, 2}, {0, 1, 0, 1, 0, 1, 0, 1});
  Tensor pos = int32_tensor({4}, {4, 5, 6, 7});
  Tensor tokens = Tensor::empty({4, 11}, DType::kI32);
  Tensor blocks = Tensor::empty({4, 2}, DType::kI32);
  poison(tokens);
  poison(blocks);
  qsa_expand_blocks(ids, pos, tokens, blocks.view());
  EXPECT_EQ(to_vector(tokens),
            (std::vector<double>{0, 1, 2, 3, 4, -1, -1, -1, -1, -1, -1,     // p = 4: tail 4
                                 0, 1, 2, 3, 4, 5,  -1, -1, -1, -1, -1,     // p = 5: tail 4, 5
                                 0, 1, 2, 3, 4, 5,  6,  -1, -1, -1, -1,     // p = 6: tail 4..6
                                 0, 1, 2, 3, 4, 5,  6,  7,  -1, -1, -1}));  // p = 7: block 1 whole
  EXPECT_EQ(to_vector(blocks), (std::vector<double>{0, -1, 0, -1, 0, -1, 0, 1}));
}

TEST(QsaExpand, InvalidIdsAreCompactedAwayInInputOrder) {
  // -1 padding first, a future block (5: tokens 20..23 > p), then valid ids in score order.
  Tensor ids = int32_tensor({1, 5}, {-1, 5, 3, -7, 1});
  Tensor pos = int32_tensor({1}, {17});
  Tensor tokens = Tensor::empty({1, 23}, DType::kI32);
  poison(tokens);
  Tensor blocks = Tensor::empty({1, 5}, DType::kI32);
  poison(blocks);
  qsa_expand_blocks(ids, pos, tokens, blocks.view());
  std::vector<double> want{12, 13, 14, 15, 4, 5, 6, 7, 16, 17};
  want.resize(23, -1);
  EXPECT_EQ(to_vector(tokens), want);
  EXPECT_EQ(to_vector(blocks), (std::vector<double>{3, 1, -1, -1, -1}));
}

TEST(QsaExpand, NegativePositionSelectsNothing) {
  Tensor ids = int32_tensor({2, 1}, {0, 0});
  Tensor pos = int32_tensor({2}, {-1, -6});
  Tensor tokens = Tensor::empty({2, 7}, DType::kI32);
  poison(tokens);
  qsa_expand_blocks(ids, pos, tokens);
  EXPECT_EQ(to_vector(tokens), std::vector<double>(14, -1));
}

// int64 block ids and positions are read as stored: the int32 call's ids. A position past
// INT32_MAX reads as INT32_MAX (the outputs hold int32 token ids), and an id past it is a block
// no int32 position completes.
TEST(QsaExpand, Int64InputsMatchInt32) {
  auto rng = make_rng();
  Tensor ids = random_int32({2, 5, 6}, rng, -2, 30);
  Tensor pos = random_int32({2, 5}, rng, -3, 120);
  Tensor tokens = Tensor::empty({2, 5, 27}, DType::kI32);
  Tensor blocks = Tensor::empty({2, 5, 6}, DType::kI32);
  qsa_expand_blocks(ids, pos, tokens, blocks.view());
  const std::vector<double> narrow_tokens = to_vector(tokens), narrow_blocks = to_vector(blocks);
  poison(tokens);
  poison(blocks);
  qsa_expand_blocks(testing::widened(ids), testing::widened(pos), tokens, blocks.view());
  EXPECT_EQ(to_vector(tokens), narrow_tokens);
  EXPECT_EQ(to_vector(blocks), narrow_blocks);

  constexpr int64_t kMax = std::numeric_limits<int32_t>::max();
  Tensor big_ids = testing::int64_tensor({2, 2}, {int64_t{1} << 40, 3, -(int64_t{1} << 40), 1});
  Tensor big_pos = testing::int64_tensor({2}, {int64_t{1} << 40, kMax});
  Tensor big_tokens = Tensor::empty({2, 11}, DType::kI32);
  qsa_expand_blocks(big_ids, big_pos, big_tokens);
  // Both rows sit at INT32_MAX, whose incomplete block is empty (p % 4 == 3): no tail tokens.
  std::vector<double> row = {12, 13, 14, 15, -1, -1, -1, -1, -1, -1, -1};
  std::vector<double> want = row;
  row = {4, 5, 6, 7, -1, -1, -1, -1, -1, -1, -1};
  want.insert(want.end(), row.begin(), row.end());
  EXPECT_EQ(to_vector(big_tokens), want);
}

class QsaExpandRandom : public ::testing::TestWithParam<bool> {};

TEST_P(QsaExpandRandom, MatchesExpectationWithStridedOutputs) {
  const bool batched = GetParam();
  auto rng = make_rng();
  const int64_t k = 9;
  const Shape rows = batched ? Shape{2, 7} : Shape{13};
  Shape id_shape = rows;
  id_shape.push_back(k);
  Tensor ids = random_int32(id_shape, rng, -2, 20);
  Tensor pos = random_int32(rows, rng, -1, 90);
  Shape tok_shape = rows;
  tok_shape.push_back(4 * k + 3);
  ASSERT_EQ(qsa_expand_blocks_token_shape(ids), tok_shape);
  // token_indices lands in the middle of a wider buffer whose edges must stay poisoned.
  Shape wide_shape = rows;
  wide_shape.push_back(4 * k + 3 + 4);
  Tensor wide = Tensor::empty(wide_shape, DType::kI32);
  poison(wide);
  TensorView tokens = wide.view().narrow(-1, 2, 4 * k + 3);
  Tensor blocks = Tensor::empty(id_shape, DType::kI32);
  poison(blocks);
  qsa_expand_blocks(ids, pos, tokens, blocks.view());
  const Expanded e = expected_expand(ids, pos);
  EXPECT_EQ(to_vector(tokens), e.tokens);
  EXPECT_EQ(to_vector(blocks), e.blocks);
  const std::vector<double> all = to_vector(wide);
  const int64_t w = 4 * k + 3 + 4;
  for (size_t i = 0; i < all.size(); ++i) {
    const int64_t c = static_cast<int64_t>(i) % w;
    if (c < 2 || c >= w - 2) EXPECT_EQ(all[i], 0x7f7f7f7f) << i;
  }
}

INSTANTIATE_TEST_SUITE_P(Layouts, QsaExpandRandom, ::testing::Bool(),
                         [](const auto& info) { return info.param ? "padded" : "rows"; });

TEST(QsaExpand, TopkThenExpandGivesTheSparseAttentionLayout) {
  auto rng = make_rng();
  const int64_t rows = 6, nb = 30, k = 8;
  Tensor pos = random_int32({rows}, rng, 0, 4 * nb + 3);
  // Scores as the indexer masks them: -inf for blocks not complete before the position.
  Tensor scores = Tensor::empty({rows, nb}, DType::kF32);
  std::uniform_real_distribution<float> u(0.f, 1.f);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < nb; ++b) {
      set(scores, {r, b}, 4 * b + 3 <= get(pos, {r}) ? u(rng) : -kInf);
    }
  }
  Tensor ids = Tensor::empty({rows, k}, DType::kI32);
  qsa_topk_blocks(scores, k, ids);
  Tensor tokens = Tensor::empty({rows, 4 * k + 3}, DType::kI32);
  Tensor blocks = Tensor::empty({rows, k}, DType::kI32);
  qsa_expand_blocks(ids, pos, tokens, blocks.view());
  // Every selected block survives expansion (top-k only picks visible ones), so block_indices
  // equals the top-k output and the valid tokens form a prefix.
  EXPECT_EQ(to_vector(blocks), to_vector(ids));
  const Expanded e = expected_expand(ids, pos);
  EXPECT_EQ(to_vector(tokens), e.tokens);
}

// ---------------------------------------------------------------------------------------
// Validation: one test per rule, error kind and the argument's name.
// ---------------------------------------------------------------------------------------

template <typename E>
void expect_error(const std::function<void()>& call, const std::string& name) {
  try {
    call();
    ADD_FAILURE() << "expected an error naming " << name;
  } catch (const E& e) {
    EXPECT_NE(std::string(e.what()).find(name), std::string::npos) << e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "wrong error kind: " << e.what();
  }
}

struct SelectInputs {
  Tensor scores = Tensor::empty({4, 10}, DType::kF32);
  Tensor out = Tensor::empty({4, 3}, DType::kI32);
  Tensor ids = int32_tensor({4, 3}, {0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 2});
  Tensor pos = int32_tensor({4}, {3, 7, 11, 40});
  Tensor tokens = Tensor::empty({4, 15}, DType::kI32);
  Tensor blocks = Tensor::empty({4, 3}, DType::kI32);
};

TEST(QsaSelectValidation, TopkScoresDtype) {
  SelectInputs in;
  Tensor s = Tensor::empty({4, 10}, DType::kBF16);
  expect_error<TypeError>([&] { qsa_topk_blocks(s, 3, in.out); }, "scores");
}

TEST(QsaSelectValidation, TopkScoresRank) {
  SelectInputs in;
  Tensor s = Tensor::empty({40}, DType::kF32);
  expect_error<ValueError>([&] { qsa_topk_blocks(s, 3, in.out); }, "scores");
}

TEST(QsaSelectValidation, TopkKPositive) {
  SelectInputs in;
  Tensor out = Tensor::empty({4, 0}, DType::kI32);
  expect_error<ValueError>([&] { qsa_topk_blocks(in.scores, 0, out); }, "k");
}

TEST(QsaSelectValidation, TopkOutDtype) {
  SelectInputs in;
  Tensor out = Tensor::empty({4, 3}, DType::kI64);
  expect_error<TypeError>([&] { qsa_topk_blocks(in.scores, 3, out); }, "out");
}

TEST(QsaSelectValidation, TopkOutShape) {
  SelectInputs in;
  expect_error<ValueError>([&] { qsa_topk_blocks(in.scores, 4, in.out); }, "out");
}

TEST(QsaSelectValidation, TopkOutDevice) {
  SelectInputs in;
  TensorView out(in.out.data(), DType::kI32, Device::cuda(0), {4, 3});
  expect_error<ValueError>([&] { qsa_topk_blocks(in.scores, 3, out); }, "out");
}

TEST(QsaSelectValidation, TopkOutPositiveStrides) {
  SelectInputs in;
  TensorView out = in.out.view().as_strided({4, 3}, {0, 1});
  expect_error<ValueError>([&] { qsa_topk_blocks(in.scores, 3, out); }, "out");
}

TEST(QsaSelectValidation, TopkOutElementsOverlap) {
  SelectInputs in;
  TensorView out = in.out.view().as_strided({4, 3}, {1, 1});  // positive strides, shared elements
  expect_error<ValueError>([&] { qsa_topk_blocks(in.scores, 3, out); }, "out: elements overlap");
}

TEST(QsaSelectValidation, TopkOutOverlapsScores) {
  SelectInputs in;
  TensorView out(in.scores.data(), DType::kI32, Device::cpu(), {4, 3});
  expect_error<ValueError>([&] { qsa_topk_blocks(in.scores, 3, out); }, "out");
}

TEST(QsaSelectValidation, ExpandBlockIdsDtype) {
  SelectInputs in;
  Tensor ids = Tensor::empty({4, 3}, DType::kF32);
  expect_error<TypeError>([&] { qsa_expand_blocks(ids, in.pos, in.tokens); }, "block_ids");
}

TEST(QsaSelectValidation, ExpandBlockIdsRank) {
  SelectInputs in;
  Tensor ids = Tensor::empty({12}, DType::kI32);
  expect_error<ValueError>([&] { qsa_expand_blocks(ids, in.pos, in.tokens); }, "block_ids");
}

TEST(QsaSelectValidation, ExpandQueryPositionsDtype) {
  SelectInputs in;
  Tensor pos = Tensor::empty({4}, DType::kF32);
  expect_error<TypeError>([&] { qsa_expand_blocks(in.ids, pos, in.tokens); }, "query_positions");
}

TEST(QsaSelectValidation, ExpandQueryPositionsShape) {
  SelectInputs in;
  Tensor pos = int32_tensor({3}, {1, 2, 3});
  expect_error<ValueError>([&] { qsa_expand_blocks(in.ids, pos, in.tokens); }, "query_positions");
}

TEST(QsaSelectValidation, ExpandQueryPositionsDevice) {
  SelectInputs in;
  TensorView pos(in.pos.data(), DType::kI32, Device::cuda(0), {4});
  expect_error<ValueError>([&] { qsa_expand_blocks(in.ids, pos, in.tokens); }, "query_positions");
}

TEST(QsaSelectValidation, ExpandTokenIndicesShape) {
  SelectInputs in;
  Tensor tokens = Tensor::empty({4, 12}, DType::kI32);
  expect_error<ValueError>([&] { qsa_expand_blocks(in.ids, in.pos, tokens); }, "token_indices");
}

TEST(QsaSelectValidation, ExpandTokenIndicesDtype) {
  SelectInputs in;
  Tensor tokens = Tensor::empty({4, 15}, DType::kF32);
  expect_error<TypeError>([&] { qsa_expand_blocks(in.ids, in.pos, tokens); }, "token_indices");
}

TEST(QsaSelectValidation, ExpandTokenIndicesOverlapsBlockIds) {
  SelectInputs in;
  Tensor shared = Tensor::empty({4, 15}, DType::kI32);
  TensorView ids = shared.view().narrow(1, 0, 3);
  expect_error<ValueError>([&] { qsa_expand_blocks(ids, in.pos, shared); }, "token_indices");
}

TEST(QsaSelectValidation, ExpandBlockIndicesShape) {
  SelectInputs in;
  Tensor blocks = Tensor::empty({4, 4}, DType::kI32);
  expect_error<ValueError>([&] { qsa_expand_blocks(in.ids, in.pos, in.tokens, blocks.view()); },
                           "block_indices");
}

TEST(QsaSelectValidation, ExpandOutputsElementsOverlap) {
  SelectInputs in;
  TensorView tokens = in.tokens.view().as_strided({4, 15}, {2, 1});
  expect_error<ValueError>([&] { qsa_expand_blocks(in.ids, in.pos, tokens); },
                           "token_indices: elements overlap");
  TensorView blocks = in.blocks.view().as_strided({4, 3}, {1, 1});
  expect_error<ValueError>([&] { qsa_expand_blocks(in.ids, in.pos, in.tokens, blocks); },
                           "block_indices: elements overlap");
}

TEST(QsaSelectValidation, ExpandBlockIndicesOverlapsTokenIndices) {
  SelectInputs in;
  TensorView blocks = in.tokens.view().narrow(1, 0, 3);
  expect_error<ValueError>([&] { qsa_expand_blocks(in.ids, in.pos, in.tokens, blocks); },
                           "block_indices");
}

}  // namespace
}  // namespace sparse_attn

namespace sparse_attn {
namespace {

// The worked example of docs/qsa.md ("### qsa_expand_blocks").
TEST(QsaExpand, DocumentedExample) {
  Tensor ids = int32_tensor({1, 3}, {2, -1, 0});
  Tensor pos = int32_tensor({1}, {14});
  Tensor tokens = Tensor::empty({1, 15}, DType::kI32);
  Tensor blocks = Tensor::empty({1, 3}, DType::kI32);
  poison(tokens);
  poison(blocks);
  qsa_expand_blocks(ids, pos, tokens, blocks.view());
  EXPECT_EQ(to_vector(tokens),
            (std::vector<double>{8, 9, 10, 11, 0, 1, 2, 3, 12, 13, 14, -1, -1, -1, -1}));
  EXPECT_EQ(to_vector(blocks), (std::vector<double>{2, 0, -1}));
}

}  // namespace
}  // namespace sparse_attn
