// The fused selections (qsa_indexer_select, qsa_mqa_decode_select) on host tensors, on both host
// backends (the reference and the CPU backend), against their composition: the score op on the
// same backend, qsa_topk_blocks, qsa_expand_blocks at each row's position and a count made
// here, bit for bit; padding rows all -1. Every form of the score ops (select_fused_cases.h),
// k of 1 to above N_B, scratch budgets of one row to all of them, ties, and one test per
// validation rule (the outputs untouched when the call raises).
#include <gtest/gtest.h>

#include <algorithm>
#include <climits>
#include <cstring>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "select_fused_cases.h"
#include "sparse_attn/errors.h"
#include "sparse_attn/qsa_select.h"
#include "test_util.h"

namespace sparse_attn {
namespace {

using testing::DecodeForm;
using testing::DecodeInputs;
using testing::expect_error;
using testing::IndexerForm;
using testing::IndexerInputs;
using testing::make_rng;
using testing::poison;

const char* name_of(Backend b) { return b == Backend::kReference ? "reference" : "cpu"; }

Shape with_last(Shape s, int64_t last) {
  s.push_back(last);
  return s;
}

// The three outputs of a selection over `rows`, poisoned.
struct Selection {
  Tensor ids, tokens, counts;

  Selection(const Shape& rows, int64_t k)
      : ids(Tensor::empty(with_last(rows, k), DType::kI32)),
        tokens(Tensor::empty(with_last(rows, 4 * k + 3), DType::kI32)),
        counts(Tensor::empty(rows, DType::kI32)) {
    poison(ids);
    poison(tokens);
    poison(counts);
  }

  SelectOptions options(size_t budget = kQsaSelectWorkspaceBytes) const {
    SelectOptions s;
    s.token_indices = tokens.view();
    s.valid_counts = counts.view();
    s.max_workspace_bytes = budget;
    return s;
  }
};

bool same_bytes(const Tensor& a, const Tensor& b) {
  return a.numel() == b.numel() &&
         std::memcmp(a.data(), b.data(), a.numel() * dtype_size(a.dtype())) == 0;
}

void expect_same(const Selection& got, const Selection& want, const std::string& what) {
  EXPECT_TRUE(same_bytes(got.ids, want.ids)) << what << ": block_ids";
  EXPECT_TRUE(same_bytes(got.tokens, want.tokens)) << what << ": token_indices";
  EXPECT_TRUE(same_bytes(got.counts, want.counts)) << what << ": valid_counts";
}

// The composition on `scores` [rows.., N_B]: top-k, padding rows (row_pos -1) cleared, the
// expansion at row_pos and the entries >= 0 of each row.
Selection compose(const TensorView& scores, const Shape& rows, int64_t k,
                  const std::vector<int64_t>& row_pos) {
  Selection want(rows, k);
  qsa_topk_blocks(scores, k, want.ids);
  auto* ids = want.ids.data_as<int32_t>();
  for (size_t r = 0; r < row_pos.size(); ++r) {
    if (row_pos[r] < 0) std::fill_n(ids + r * k, k, -1);
  }
  const Tensor positions = testing::int64_tensor(rows, row_pos);
  qsa_expand_blocks(want.ids, positions, want.tokens);
  const auto* tokens = want.tokens.data_as<int32_t>();
  for (size_t r = 0; r < row_pos.size(); ++r) {
    int32_t n = 0;
    for (int64_t j = 0; j < 4 * k + 3; ++j) n += tokens[r * (4 * k + 3) + j] >= 0;
    want.counts.data_as<int32_t>()[r] = n;
  }
  return want;
}

Selection indexer_composition(const IndexerInputs& in, int64_t k, Backend b) {
  IndexerScoreOptions o = in.options;
  o.backend = b;
  Tensor scores = Tensor::empty(qsa_indexer_mqa_score_shape(in.q, in.keys, o), DType::kF32);
  qsa_indexer_mqa_score(in.q, in.keys, scores, o);
  return compose(scores, in.rows, k, in.row_pos);
}

Selection decode_composition(const DecodeInputs& in, int64_t k, Backend b) {
  MqaScoreOptions o;
  o.backend = b;
  Tensor scores = Tensor::empty(qsa_mqa_decode_shape(in.q, in.max_model_len), DType::kF32);
  qsa_mqa_decode(in.q, in.cache, in.table, in.lens, in.max_model_len, scores, o);
  // Without positions the rows expand nowhere: the composition's block ids are all there is.
  std::vector<int64_t> pos = in.row_pos;
  return compose(scores, {scores.shape()[0]}, k, pos);
}

// Budgets: the default (one chunk), one row's scores, seven rows' scores.
std::vector<size_t> budgets(int64_t num_blocks) {
  const size_t row = 4 * static_cast<size_t>(num_blocks);
  return {kQsaSelectWorkspaceBytes, row, 7 * row + 3};
}

// ---------------------------------------------------------------------------------------
// qsa_indexer_select
// ---------------------------------------------------------------------------------------

class IndexerSelect : public ::testing::TestWithParam<IndexerForm> {};

TEST_P(IndexerSelect, EqualsTheComposition) {
  auto rng = make_rng();
  const IndexerInputs in = testing::make_indexer_inputs(GetParam(), rng);
  const int64_t nb = qsa_indexer_mqa_score_shape(in.q, in.keys, in.options).back();
  for (Backend b : {Backend::kReference, Backend::kNative}) {
    for (int64_t k : {int64_t{1}, int64_t{16}, nb + 5}) {
      const Selection want = indexer_composition(in, k, b);
      for (size_t budget : budgets(nb)) {
        IndexerScoreOptions o = in.options;
        o.backend = b;
        Selection got(in.rows, k);
        ASSERT_EQ(qsa_indexer_select_shape(in.q, in.keys, k, o), got.ids.shape());
        EXPECT_EQ(qsa_indexer_select_workspace_size(in.q, in.keys, k, o, got.options(budget)), 0u);
        qsa_indexer_select(in.q, in.keys, k, got.ids, o, got.options(budget));
        expect_same(got, want,
                    std::string(name_of(b)) + " k " + std::to_string(k) + " budget " +
                        std::to_string(budget));
        // Only the block ids, only the counts: the same values.
        Selection only(in.rows, k);
        SelectOptions s;
        s.max_workspace_bytes = budget;
        qsa_indexer_select(in.q, in.keys, k, only.ids, o, s);
        EXPECT_TRUE(same_bytes(only.ids, want.ids)) << name_of(b) << " ids only";
        s.valid_counts = only.counts.view();
        qsa_indexer_select(in.q, in.keys, k, only.ids, o, s);
        EXPECT_TRUE(same_bytes(only.counts, want.counts)) << name_of(b) << " counts only";
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Forms, IndexerSelect, ::testing::ValuesIn(testing::indexer_forms()),
                         [](const auto& info) { return info.param.name; });

TEST(IndexerSelectTies, EqualScoresKeepTheLowestIds) {
  // q = 0: every visible block scores 0, so the selection is the first min(k, visible) blocks.
  const int64_t Q = 9, nb = 40, k = 6;
  Tensor q = Tensor::empty({1, Q, 4, 128}, DType::kBF16);
  std::memset(q.data(), 0, q.numel() * 2);
  auto rng = make_rng();
  Tensor keys = testing::random_tensor({1, nb, 128}, DType::kBF16, rng);
  std::vector<int32_t> pos_values(Q);
  for (int64_t i = 0; i < Q; ++i) pos_values[i] = static_cast<int32_t>(i * 4 + 2);  // i blocks
  Tensor pos = testing::int32_tensor({1, Q}, pos_values);
  for (Backend b : {Backend::kReference, Backend::kNative}) {
    IndexerScoreOptions o;
    o.backend = b;
    o.query_positions = pos.view();
    Selection got({1, Q}, k);
    qsa_indexer_select(q, keys, k, got.ids, o, got.options(4 * nb));
    for (int64_t i = 0; i < Q; ++i) {
      for (int64_t j = 0; j < k; ++j) {
        EXPECT_EQ(got.ids.data_as<int32_t>()[i * k + j], j < i ? j : -1) << i << ", " << j;
      }
      EXPECT_EQ(got.counts.data_as<int32_t>()[i], 4 * std::min(i, k) + 3) << i;
    }
  }
}

TEST(IndexerSelectPadding, PaddingRowsAreAllMinusOne) {
  // Row 1 is past seq_lens_q at position 10: the composition's expansion would give its tail
  // (8, 9, 10); a padding row gets nothing.
  auto rng = make_rng();
  Tensor q = testing::random_tensor({1, 3, 4, 128}, DType::kBF16, rng);
  Tensor keys = testing::random_tensor({1, 5, 128}, DType::kBF16, rng);
  Tensor pos = testing::int32_tensor({1, 3}, {10, 10, -1});
  Tensor lens = testing::int32_tensor({1}, {1});
  IndexerScoreOptions o;
  o.query_positions = pos.view();
  o.seq_lens_q = lens.view();
  Selection got({1, 3}, 2);
  qsa_indexer_select(q, keys, 2, got.ids, o, got.options());
  const auto* tokens = got.tokens.data_as<int32_t>();
  std::vector<int32_t> row0(tokens, tokens + 11);  // blocks 0 and 1 in score order, the tail
  std::sort(row0.begin(), row0.end());
  EXPECT_EQ(row0, (std::vector<int32_t>{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10}));
  for (int64_t r = 1; r < 3; ++r) {
    for (int64_t j = 0; j < 11; ++j) EXPECT_EQ(tokens[r * 11 + j], -1) << r;
    for (int64_t j = 0; j < 2; ++j) EXPECT_EQ(got.ids.data_as<int32_t>()[r * 2 + j], -1) << r;
    EXPECT_EQ(got.counts.data_as<int32_t>()[r], 0) << r;
  }
  EXPECT_EQ(got.counts.data_as<int32_t>()[0], 11);
}

TEST(IndexerSelectLayouts, StridedOutputsAndNoBlocks) {
  auto rng = make_rng();
  const IndexerInputs in = testing::make_indexer_inputs({.name = "x", .positions = true}, rng);
  const int64_t k = 8;
  const Selection want = indexer_composition(in, k, Backend::kReference);
  // Every output as every other element of a poisoned buffer.
  Tensor ids_buf = Tensor::empty({3 * 37 * k * 2}, DType::kI32);
  Tensor tok_buf = Tensor::empty({3 * 37 * (4 * k + 3) * 2}, DType::kI32);
  Tensor cnt_buf = Tensor::empty({3 * 37 * 2}, DType::kI32);
  for (const Tensor* t : {&ids_buf, &tok_buf, &cnt_buf}) poison(*t);
  const TensorView ids = ids_buf.view().as_strided({3, 37, k}, {37 * k * 2, k * 2, 2});
  SelectOptions s;
  s.token_indices =
      tok_buf.view().as_strided({3, 37, 4 * k + 3}, {37 * (4 * k + 3) * 2, (4 * k + 3) * 2, 2});
  s.valid_counts = cnt_buf.view().as_strided({3, 37}, {37 * 2, 2});
  s.max_workspace_bytes = 4 * 90 * 5;
  qsa_indexer_select(in.q, in.keys, k, ids, in.options, s);
  EXPECT_EQ(testing::to_vector(ids), testing::to_vector(want.ids));
  EXPECT_EQ(testing::to_vector(*s.token_indices), testing::to_vector(want.tokens));
  EXPECT_EQ(testing::to_vector(*s.valid_counts), testing::to_vector(want.counts));
  for (int64_t i = 1; i < ids_buf.numel(); i += 2) {
    ASSERT_EQ(static_cast<uint32_t>(ids_buf.data_as<int32_t>()[i]), 0x7f7f7f7fu) << i;
  }

  // N_B = 0 (no compressed key yet): every id -1, each row's tail only, for any budget.
  Tensor q = testing::random_tensor({5, 4, 128}, DType::kBF16, rng);
  Tensor empty_keys = Tensor::empty({1, 0, 128}, DType::kBF16);
  Tensor cu = testing::int32_tensor({2}, {0, 5});
  IndexerScoreOptions o;
  o.cu_seqlens_q = cu.view();
  Selection got({5}, 3);
  qsa_indexer_select(q, empty_keys, 3, got.ids, o, got.options(0));
  for (int64_t r = 0; r < 5; ++r) {
    // The tail 4 * ((r + 1) / 4) .. r: none at r = 3, whose block is complete (and absent).
    EXPECT_EQ(got.counts.data_as<int32_t>()[r], r % 4 == 3 ? 0 : r % 4 + 1) << r;
    for (int64_t j = 0; j < 3; ++j) EXPECT_EQ(got.ids.data_as<int32_t>()[r * 3 + j], -1);
  }
}

// ---------------------------------------------------------------------------------------
// qsa_mqa_decode_select
// ---------------------------------------------------------------------------------------

class DecodeSelect : public ::testing::TestWithParam<DecodeForm> {};

TEST_P(DecodeSelect, EqualsTheComposition) {
  auto rng = make_rng();
  const DecodeForm& f = GetParam();
  const DecodeInputs in = testing::make_decode_inputs(f, rng);
  const Shape rows{f.batch * f.rows};
  for (Backend b : {Backend::kReference, Backend::kNative}) {
    for (int64_t k : {int64_t{1}, int64_t{64}, f.max_model_len + 1}) {
      const Selection want = decode_composition(in, k, b);
      for (size_t budget : budgets(f.max_model_len)) {
        MqaScoreOptions o;
        o.backend = b;
        Selection got(rows, k);
        ASSERT_EQ(qsa_mqa_decode_select_shape(in.q, k), got.ids.shape());
        SelectOptions s;
        s.max_workspace_bytes = budget;
        if (f.positions) {
          s = got.options(budget);
          s.query_positions = in.pos.view();
        }
        EXPECT_EQ(qsa_mqa_decode_select_workspace_size(in.q, in.cache, in.table, in.lens,
                                                       in.max_model_len, k, o, s),
                  0u);
        qsa_mqa_decode_select(in.q, in.cache, in.table, in.lens, in.max_model_len, k, got.ids, o,
                              s);
        const std::string what = std::string(name_of(b)) + " k " + std::to_string(k) + " budget " +
                                 std::to_string(budget);
        if (f.positions) {
          expect_same(got, want, what);
        } else {
          EXPECT_TRUE(same_bytes(got.ids, want.ids)) << what;
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Forms, DecodeSelect, ::testing::ValuesIn(testing::decode_forms()),
                         [](const auto& info) { return info.param.name; });

TEST(DecodeSelectPadding, NegativePositionClearsAVisibleRow) {
  // Both rows see 3 blocks; row 1's position is -1: a padding row, though its scores are finite.
  auto rng = make_rng();
  Tensor q = testing::random_tensor({1, 2, 4, 128}, DType::kBF16, rng);
  Tensor cache = testing::random_tensor({1, 8, 128}, DType::kBF16, rng);
  Tensor table = testing::int32_tensor({1, 1}, {0});
  Tensor lens = testing::int32_tensor({1, 2}, {3, 3});
  Tensor pos = testing::int64_tensor({1, 2}, {13, -1});
  Selection got({2}, 4);
  SelectOptions s = got.options();
  s.query_positions = pos.view();
  qsa_mqa_decode_select(q, cache, table, lens, 8, 4, got.ids, {}, s);
  const auto* ids = got.ids.data_as<int32_t>();
  EXPECT_EQ(std::count(ids, ids + 4, -1), 1);       // row 0: blocks 0..2 in score order, then -1
  EXPECT_EQ(got.counts.data_as<int32_t>()[0], 14);  // 3 blocks and the tail 12, 13
  EXPECT_EQ(std::vector<int32_t>(ids + 4, ids + 8), std::vector<int32_t>(4, -1));
  EXPECT_EQ(got.counts.data_as<int32_t>()[1], 0);
}

// ---------------------------------------------------------------------------------------
// Validation
// ---------------------------------------------------------------------------------------

// A small valid indexer call whose pieces each test breaks, with every output poisoned; the
// outputs must be untouched after the expected error.
struct IndexerCall {
  std::mt19937_64 rng = make_rng();
  Tensor q = testing::random_tensor({2, 5, 4, 128}, DType::kBF16, rng);
  Tensor keys = testing::random_tensor({2, 6, 128}, DType::kBF16, rng);
  Selection out{{2, 5}, 3};
  IndexerScoreOptions o;
  SelectOptions s = out.options();

  template <typename E>
  void expect(const std::string& name, const TensorView& ids, const IndexerScoreOptions& opts,
              const SelectOptions& sel, int64_t k = 3) {
    const Selection before = copy();
    expect_error<E>([&] { qsa_indexer_select(q, keys, k, ids, opts, sel); }, name);
    expect_same(out, before, "untouched after the " + name + " error");
  }
  template <typename E>
  void expect(const std::string& name) {
    expect<E>(name, out.ids, o, s);
  }

  Selection copy() const {
    Selection c{{2, 5}, 3};
    std::memcpy(c.ids.data(), out.ids.data(), out.ids.numel() * 4);
    std::memcpy(c.tokens.data(), out.tokens.data(), out.tokens.numel() * 4);
    std::memcpy(c.counts.data(), out.counts.data(), out.counts.numel() * 4);
    return c;
  }
};

TEST(IndexerSelectValidation, OutputsDtypeShapeDeviceLayout) {
  IndexerCall c;
  Tensor f32 = Tensor::empty({2, 5, 3}, DType::kF32);
  c.expect<TypeError>("block_ids", f32, c.o, c.s);
  Tensor wrong = Tensor::empty({2, 5, 4}, DType::kI32);
  c.expect<ValueError>("block_ids", wrong, c.o, c.s);
  const TensorView on_cuda(c.out.ids.data(), DType::kI32, Device::cuda(0), {2, 5, 3});
  c.expect<ValueError>("block_ids", on_cuda, c.o, c.s);
  const TensorView broadcast = c.out.ids.view().as_strided({2, 5, 3}, {15, 0, 1});
  c.expect<ValueError>("block_ids", broadcast, c.o, c.s);
  c.expect<ValueError>("block_ids", TensorView{}, c.o, c.s);  // missing

  SelectOptions s = c.s;
  Tensor tokens = Tensor::empty({2, 5, 14}, DType::kI32);
  s.token_indices = tokens.view();
  c.expect<ValueError>("token_indices", c.out.ids, c.o, s);
  Tensor tokens64 = Tensor::empty({2, 5, 15}, DType::kI64);
  s.token_indices = tokens64.view();
  c.expect<TypeError>("token_indices", c.out.ids, c.o, s);
  s = c.s;
  Tensor counts = Tensor::empty({10}, DType::kI32);
  s.valid_counts = counts.view();
  c.expect<ValueError>("valid_counts", c.out.ids, c.o, s);
  s.valid_counts = c.out.counts.view().as_strided({2, 5}, {0, 1});
  c.expect<ValueError>("valid_counts", c.out.ids, c.o, s);
}

TEST(IndexerSelectValidation, OverlappingOutputs) {
  IndexerCall c;
  SelectOptions s = c.s;
  Tensor big = Tensor::empty({2 * 5 * 15}, DType::kI32);
  s.token_indices = big.view().as_strided({2, 5, 15}, {75, 15, 1});
  c.expect<ValueError>("token_indices", big.view().as_strided({2, 5, 3}, {15, 3, 1}), c.o, s);
  s = c.s;
  s.valid_counts = c.out.tokens.view().as_strided({2, 5}, {5, 1});
  c.expect<ValueError>("valid_counts", c.out.ids, c.o, s);
  // An output over an input.
  const TensorView over_q(c.q.data(), DType::kI32, Device::cpu(), {2, 5, 3});
  c.expect<ValueError>("block_ids", over_q, c.o, c.s);
  IndexerScoreOptions o = c.o;
  Tensor pos = testing::int32_tensor({2, 5}, std::vector<int32_t>(10, 7));
  o.query_positions = pos.view();
  s = c.s;
  s.valid_counts = pos.view();
  c.expect<ValueError>("valid_counts", c.out.ids, o, s);
}

TEST(IndexerSelectValidation, KBudgetPositionsWorkspaceAndMetadata) {
  IndexerCall c;
  c.expect<ValueError>("k", c.out.ids, c.o, c.s, 0);
  c.expect<ValueError>("k", c.out.ids, c.o, c.s, int64_t{INT32_MAX} + 1);
  // With an expansion, k is bounded by the int32 token ids (the k check comes first).
  c.expect<ValueError>("k", c.out.ids, c.o, c.s, (int64_t{INT32_MAX} - 3) / 4 + 1);
  EXPECT_THROW(qsa_indexer_select_shape(c.q, c.keys, 0), ValueError);

  SelectOptions s = c.s;
  s.query_positions = c.out.counts.view();
  c.expect<ValueError>("query_positions", c.out.ids, c.o, s);

  s = c.s;
  s.max_workspace_bytes = 4 * 6 - 1;  // one row holds 6 scores
  c.expect<ValueError>("max_workspace_bytes", c.out.ids, c.o, s);
  s.max_workspace_bytes = 4 * 6;
  qsa_indexer_select(c.q, c.keys, 3, c.out.ids, c.o, s);  // exactly one row: valid
  poison(c.out.ids);

  s = c.s;
  Tensor w = Tensor::empty({64}, DType::kI32);
  s.workspace = w.view();
  c.expect<TypeError>("workspace", c.out.ids, c.o, s);
  Tensor wb = Tensor::empty({80}, DType::kU8);
  s.workspace = wb.view().narrow(0, 1, 64);
  c.expect<ValueError>("workspace", c.out.ids, c.o, s);

  // Broken metadata contents: the score op's ValueError, nothing written.
  Tensor q = testing::random_tensor({6, 4, 128}, DType::kBF16, c.rng);
  Tensor cu = testing::int32_tensor({3}, {0, 5, 4});
  Selection out({6}, 3);
  std::vector<int32_t> ids_before(out.ids.data_as<int32_t>(), out.ids.data_as<int32_t>() + 18);
  for (Backend b : {Backend::kReference, Backend::kNative}) {
    IndexerScoreOptions o;
    o.backend = b;
    o.cu_seqlens_q = cu.view();
    expect_error<ValueError>([&] { qsa_indexer_select(q, c.keys, 3, out.ids, o, out.options()); },
                             "cu_seqlens_q");
    EXPECT_EQ(std::vector<int32_t>(out.ids.data_as<int32_t>(), out.ids.data_as<int32_t>() + 18),
              ids_before);
  }
  // And the score op's own argument checks, by name.
  IndexerScoreOptions o;
  o.block_size = 3;
  c.expect<ValueError>("block_size", c.out.ids, o, c.s);
  o = {};
  o.scale = 0.5;
  o.score_scale = 2.0;
  c.expect<ValueError>("scale", c.out.ids, o, c.s);
}

struct DecodeCall {
  std::mt19937_64 rng = make_rng();
  Tensor q = testing::random_tensor({2, 3, 4, 128}, DType::kBF16, rng);
  Tensor cache = testing::random_tensor({4, 16, 128}, DType::kBF16, rng);
  Tensor table = testing::int32_tensor({2, 2}, {0, 1, 2, 3});
  Tensor lens = testing::int32_tensor({2, 3}, {5, 6, 7, 0, 1, 2});
  Tensor pos = testing::int32_tensor({2, 3}, {20, 24, 28, 3, 4, 8});
  Selection out{{6}, 3};

  SelectOptions select() const {
    SelectOptions s = out.options();
    s.query_positions = pos.view();
    return s;
  }
  void expect(const std::string& name, const SelectOptions& s, bool type_error = false) {
    std::vector<int32_t> before(out.tokens.data_as<int32_t>(),
                                out.tokens.data_as<int32_t>() + out.tokens.numel());
    auto call = [&] { qsa_mqa_decode_select(q, cache, table, lens, 32, 3, out.ids, {}, s); };
    if (type_error) {
      expect_error<TypeError>(call, name);
    } else {
      expect_error<ValueError>(call, name);
    }
    EXPECT_EQ(std::vector<int32_t>(out.tokens.data_as<int32_t>(),
                                   out.tokens.data_as<int32_t>() + out.tokens.numel()),
              before);
  }
};

TEST(DecodeSelectValidation, QueryPositionsOutputsAndBudget) {
  DecodeCall c;
  SelectOptions s = c.select();
  qsa_mqa_decode_select(c.q, c.cache, c.table, c.lens, 32, 3, c.out.ids, {}, s);  // valid
  poison(c.out.tokens);

  s.query_positions.reset();
  c.expect("query_positions", s);  // token_indices and valid_counts need them
  s.token_indices.reset();
  c.expect("query_positions", s);  // valid_counts alone too
  Tensor flat = testing::int32_tensor({6}, std::vector<int32_t>(6, 4));
  s = c.select();
  s.query_positions = flat.view();  // [B * R] is not [B, R]
  c.expect("query_positions", s);
  Tensor f32 = Tensor::empty({2, 3}, DType::kF32);
  s.query_positions = f32.view();
  c.expect("query_positions", s, true);

  s = c.select();
  Tensor wrong = Tensor::empty({6, 14}, DType::kI32);
  s.token_indices = wrong.view();
  c.expect("token_indices", s);
  s = c.select();
  s.valid_counts = c.pos.view().as_strided({6}, {1});  // over query_positions
  c.expect("valid_counts", s);
  s = c.select();
  s.max_workspace_bytes = 4 * 32 - 1;
  c.expect("max_workspace_bytes", s);
  EXPECT_THROW(qsa_mqa_decode_select_shape(c.q, -1), ValueError);
  EXPECT_EQ(qsa_mqa_decode_select_shape(c.q, 7), (Shape{6, 7}));

  // The decode op's own checks, by name.
  Tensor lens_b = testing::int32_tensor({2}, {1, 2});
  expect_error<ValueError>(
      [&] { qsa_mqa_decode_select(c.q, c.cache, c.table, lens_b, 32, 3, c.out.ids, {}, s); },
      "context_lens");
  expect_error<ValueError>(
      [&] { qsa_mqa_decode_select(c.q, c.cache, c.table, c.lens, -1, 3, c.out.ids, {}, s); },
      "max_model_len");
  expect_error<ValueError>(
      [&] { qsa_mqa_decode_select(c.q, c.cache, c.table, c.lens, 32, 0, c.out.ids, {}, s); }, "k");
}

}  // namespace
}  // namespace sparse_attn
