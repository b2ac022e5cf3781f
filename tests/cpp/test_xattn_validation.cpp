// XAttention argument validation: one test per rule, asserting the error kind and that the
// message names the argument. Validation reads no tensor contents, so device views here may
// point at host memory: the call must fail before anything is read.
#include <gtest/gtest.h>

#include <algorithm>
#include <optional>

#include "sparse_attn/errors.h"
#include "sparse_attn/xattn.h"
#include "test_util.h"
#include "test_xattn_util.h"

namespace sparse_attn {
namespace {

using xattn_testing::expect_error;

// Valid estimate arguments: query [1, 4, 200, 16], key [1, 2, 300, 16], outputs [1, 4, 2, 3].
struct EstimateArgs : ::testing::Test {
  Tensor q = Tensor::empty({1, 4, 200, 16}, DType::kBF16);
  Tensor k = Tensor::empty({1, 2, 300, 16}, DType::kBF16);
  Tensor sums = Tensor::empty({1, 4, 2, 3}, DType::kF32);
  Tensor mask = Tensor::empty({1, 4, 2, 3}, DType::kBool);
  XAttnEstimateOptions o = [] {
    XAttnEstimateOptions x;
    x.backend = Backend::kReference;
    return x;
  }();

  EstimateArgs() {
    for (Tensor* t : {&q, &k}) std::fill_n(t->data_as<uint16_t>(), t->numel(), uint16_t{0});
  }
  void run() { xattn_estimate(q, k, sums, mask, o); }
  void run_with(const TensorView& qv, const TensorView& kv, const TensorView& sv,
                const TensorView& mv) {
    xattn_estimate(qv, kv, sv, mv, o);
  }
};

TEST_F(EstimateArgs, ValidArgumentsPass) { EXPECT_NO_THROW(run()); }

TEST_F(EstimateArgs, QueryRankMustBeFour) {
  Tensor q3 = Tensor::empty({4, 200, 16}, DType::kBF16);
  expect_error<ValueError>([&] { run_with(q3, k, sums, mask); }, "query");
}

TEST_F(EstimateArgs, KeyRankMustBeFour) {
  Tensor k3 = Tensor::empty({2, 300, 16}, DType::kBF16);
  expect_error<ValueError>([&] { run_with(q, k3, sums, mask); }, "key");
}

TEST_F(EstimateArgs, QueryDtypeMustBeFloating) {
  Tensor qi = Tensor::empty({1, 4, 200, 16}, DType::kI32);
  expect_error<TypeError>([&] { run_with(qi, k, sums, mask); }, "query");
}

TEST_F(EstimateArgs, KeyDtypeMustMatchQuery) {
  Tensor kf = Tensor::empty({1, 2, 300, 16}, DType::kF16);
  expect_error<TypeError>([&] { run_with(q, kf, sums, mask); }, "key");
}

TEST_F(EstimateArgs, KeyDeviceMustMatchQuery) {
  TensorView kd(k.data(), DType::kBF16, Device::cuda(0), k.shape());
  expect_error<ValueError>([&] { run_with(q, kd, sums, mask); }, "key");
}

TEST_F(EstimateArgs, KeyBatchMustMatchQuery) {
  Tensor k2 = Tensor::empty({2, 2, 300, 16}, DType::kBF16);
  expect_error<ValueError>([&] { run_with(q, k2, sums, mask); }, "key");
}

TEST_F(EstimateArgs, KeyHeadDimMustMatchQuery) {
  Tensor k2 = Tensor::empty({1, 2, 300, 32}, DType::kBF16);
  expect_error<ValueError>([&] { run_with(q, k2, sums, mask); }, "key");
}

TEST_F(EstimateArgs, QueryHeadsMustBeAMultipleOfKeyHeads) {
  Tensor k3 = Tensor::empty({1, 3, 300, 16}, DType::kBF16);
  expect_error<ValueError>([&] { run_with(q, k3, sums, mask); }, "query");
}

TEST_F(EstimateArgs, QueryMayNotBeLongerThanKey) {
  Tensor k2 = Tensor::empty({1, 2, 199, 16}, DType::kBF16);
  expect_error<ValueError>([&] { run_with(q, k2, sums, mask); }, "query");
}

TEST_F(EstimateArgs, NonCausalAllowsMoreQueriesThanKeys) {
  Tensor k2 = Tensor::empty({1, 2, 100, 16}, DType::kBF16);
  std::fill_n(k2.data_as<uint16_t>(), k2.numel(), uint16_t{0});
  Tensor s2 = Tensor::empty({1, 4, 2, 1}, DType::kF32);
  Tensor m2 = Tensor::empty({1, 4, 2, 1}, DType::kBool);
  o.causal = false;
  EXPECT_NO_THROW(run_with(q, k2, s2, m2));
  o.keep_recent = true;  // the diagonal needs the queries inside the key sequence
  expect_error<ValueError>([&] { run_with(q, k2, s2, m2); }, "query");
}

TEST_F(EstimateArgs, QueryDataMustNotBeNull) {
  TensorView qn(nullptr, DType::kBF16, Device::cpu(), q.shape());
  expect_error<ValueError>([&] { run_with(qn, k, sums, mask); }, "query");
}

TEST_F(EstimateArgs, BlockSizeMustBePositive) {
  o.block_size = 0;
  expect_error<ValueError>([&] { run(); }, "block_size");
}

TEST_F(EstimateArgs, StrideMustDivideBlockSize) {
  o.stride = 12;
  expect_error<ValueError>([&] { run(); }, "stride");
}

TEST_F(EstimateArgs, NormMustBePositive) {
  o.norm = 0.0;
  expect_error<ValueError>([&] { run(); }, "norm");
}

TEST_F(EstimateArgs, NormAndTheScoreScaleMustBeFloat32) {
  o.norm = 1e39;
  expect_error<ValueError>([&] { run(); }, "norm");
  // A subnormal float32 norm makes 1 / (sqrt(D) * stride * norm) overflow float32.
  o.norm = 1e-44;
  expect_error<ValueError>([&] { run(); }, "norm");
}

TEST_F(EstimateArgs, ChunkSizeMustBeAMultipleOfBlockSize) {
  o.chunk_size = 1000;
  expect_error<ValueError>([&] { run(); }, "chunk_size");
}

TEST_F(EstimateArgs, UpstreamSelectModesOtherThanInverseAreNotSupported) {
  o.select_mode = "slash";
  expect_error<NotSupportedError>([&] { run(); }, "select_mode");
}

TEST_F(EstimateArgs, UnknownSelectModeIsAValueError) {
  o.select_mode = "diagonal";
  expect_error<ValueError>([&] { run(); }, "select_mode");
}

TEST_F(EstimateArgs, ThresholdMustBeAFraction) {
  o.threshold = 1.5;
  expect_error<ValueError>([&] { run(); }, "threshold");
}

TEST_F(EstimateArgs, HeadThresholdsNeedOnePerQueryHead) {
  o.head_thresholds = {0.9, 0.9};
  expect_error<ValueError>([&] { run(); }, "head_thresholds");
}

TEST_F(EstimateArgs, EachHeadThresholdMustBeAFraction) {
  o.head_thresholds = {0.9, -0.1, 0.9, 0.9};
  expect_error<ValueError>([&] { run(); }, "head_thresholds[1]");
}

TEST_F(EstimateArgs, AttnSumsMustBeFloat32) {
  Tensor s = Tensor::empty({1, 4, 2, 3}, DType::kBF16);
  expect_error<TypeError>([&] { run_with(q, k, s, mask); }, "attn_sums");
}

TEST_F(EstimateArgs, AttnSumsShapeMustMatch) {
  Tensor s = Tensor::empty({1, 4, 2, 2}, DType::kF32);
  expect_error<ValueError>([&] { run_with(q, k, s, mask); }, "attn_sums");
}

TEST_F(EstimateArgs, AttnSumsMustHavePositiveStrides) {
  TensorView s = sums.view().as_strided({1, 4, 2, 3}, {24, 6, 0, 1});
  expect_error<ValueError>([&] { run_with(q, k, s, mask); }, "attn_sums");
}

TEST_F(EstimateArgs, AttnSumsElementsMustNotShareMemory) {
  TensorView s = sums.view().as_strided({1, 4, 2, 3}, {24, 3, 2, 1});
  expect_error<ValueError>([&] { run_with(q, k, s, mask); }, "attn_sums");
}

TEST_F(EstimateArgs, AttnSumsMustNotOverlapQuery) {
  TensorView s(q.data(), DType::kF32, Device::cpu(), {1, 4, 2, 3});
  expect_error<ValueError>([&] { run_with(q, k, s, mask); }, "attn_sums");
}

TEST_F(EstimateArgs, BlockMaskMustBeBool) {
  Tensor m = Tensor::empty({1, 4, 2, 3}, DType::kI32);
  expect_error<TypeError>([&] { run_with(q, k, sums, m); }, "block_mask");
}

TEST_F(EstimateArgs, BlockMaskShapeMustMatch) {
  Tensor m = Tensor::empty({1, 4, 3, 3}, DType::kBool);
  expect_error<ValueError>([&] { run_with(q, k, sums, m); }, "block_mask");
}

TEST_F(EstimateArgs, BlockMaskMustNotOverlapAttnSums) {
  TensorView m(sums.data(), DType::kBool, Device::cpu(), {1, 4, 2, 3});
  expect_error<ValueError>([&] { run_with(q, k, sums, m); }, "block_mask");
}

TEST_F(EstimateArgs, OutputsMustLiveOnTheQueryDevice) {
  TensorView s(sums.data(), DType::kF32, Device::cuda(0), sums.shape());
  expect_error<ValueError>([&] { run_with(q, k, s, mask); }, "attn_sums");
}

// Backend native on host tensors is the CPU backend (test_xattn_estimate.cpp compares it).
TEST_F(EstimateArgs, NativeBackendOnHostTensorsRuns) {
  o.backend = Backend::kNative;
  EXPECT_NO_THROW(run());
}

TEST_F(EstimateArgs, ShapeFunctionValidatesToo) {
  Tensor k2 = Tensor::empty({1, 2, 100, 16}, DType::kBF16);
  expect_error<ValueError>([&] { xattn_estimate_shape(q, k2, o); }, "query");
  EXPECT_EQ(xattn_estimate_shape(q, k, o), (Shape{1, 4, 2, 3}));
}

// find_blocks_chunked: sums [1, 2, 2, 3].
struct FindBlocksArgs : ::testing::Test {
  Tensor sums = Tensor::empty({1, 2, 2, 3}, DType::kF32);
  Tensor mask = Tensor::empty({1, 2, 2, 3}, DType::kBool);
  FindBlocksOptions o = [] {
    FindBlocksOptions x;
    x.backend = Backend::kReference;
    return x;
  }();
  void run(const TensorView& s, const TensorView& m) { find_blocks_chunked(s, m, o); }
};

TEST_F(FindBlocksArgs, ValidArgumentsPass) {
  std::fill_n(sums.data_as<float>(), sums.numel(), 1.0f);
  EXPECT_NO_THROW(run(sums, mask));
}

TEST_F(FindBlocksArgs, AttnSumsRankMustBeFour) {
  Tensor s = Tensor::empty({2, 2, 3}, DType::kF32);
  expect_error<ValueError>([&] { run(s, mask); }, "attn_sums");
}

TEST_F(FindBlocksArgs, AttnSumsMustBeFloat32) {
  Tensor s = Tensor::empty({1, 2, 2, 3}, DType::kF16);
  expect_error<TypeError>([&] { run(s, mask); }, "attn_sums");
}

TEST_F(FindBlocksArgs, BlockMaskShapeMustMatchAttnSums) {
  Tensor m = Tensor::empty({1, 2, 2, 4}, DType::kBool);
  expect_error<ValueError>([&] { run(sums, m); }, "block_mask");
}

TEST_F(FindBlocksArgs, QLenMustCoverTheQueryBlocks) {
  o.q_len = 300;
  expect_error<ValueError>([&] { run(sums, mask); }, "q_len");
}

TEST_F(FindBlocksArgs, KLenMustCoverTheKeyBlocks) {
  o.k_len = 256;
  expect_error<ValueError>([&] { run(sums, mask); }, "k_len");
}

TEST_F(FindBlocksArgs, QueriesMayNotOutnumberKeys) {
  // Three query blocks against two key blocks, lengths taken from the shape.
  Tensor s = Tensor::empty({1, 2, 3, 2}, DType::kF32);
  Tensor m = Tensor::empty({1, 2, 3, 2}, DType::kBool);
  expect_error<ValueError>([&] { run(s, m); }, "attn_sums");
}

TEST_F(FindBlocksArgs, ThresholdMustBeAFraction) {
  o.threshold = -0.5;
  expect_error<ValueError>([&] { run(sums, mask); }, "threshold");
}

// A broadcast view may claim any number of heads; nothing sized by it is built before the
// (non-broadcasting) outputs are checked, so the error is a ValueError, not std::bad_alloc.
TEST_F(FindBlocksArgs, HugeBroadcastHeadsGiveTheOutputError) {
  const int64_t heads = int64_t{1} << 40;
  TensorView s = sums.view().as_strided({1, heads, 2, 3}, {0, 0, 3, 1});
  TensorView m = mask.view().as_strided({1, heads, 2, 3}, {0, 0, 3, 1});
  expect_error<ValueError>([&] { run(s, m); }, "block_mask");
}

TEST_F(FindBlocksArgs, BlockCountTimesBlockSizeMustFitInt64) {
  o.block_size = int64_t{1} << 62;
  expect_error<ValueError>([&] { run(sums, mask); }, "block_size");
}

TEST_F(FindBlocksArgs, BlockMaskMustNotOverlapAttnSums) {
  TensorView m(sums.data(), DType::kBool, Device::cpu(), {1, 2, 2, 3});
  expect_error<ValueError>([&] { run(sums, m); }, "block_mask");
}

// block_sparse_attention: 2 sequences (100 + 60 queries, 150 + 60 keys), Hq 4 (types
// 1, 0, -1, 1: two block-sparse heads), Hkv 2, D 16.
struct AttentionArgs : ::testing::Test {
  Tensor q = Tensor::empty({160, 4, 16}, DType::kBF16);
  Tensor k = Tensor::empty({210, 2, 16}, DType::kBF16);
  Tensor v = Tensor::empty({210, 2, 16}, DType::kBF16);
  Tensor cu_q = testing::int32_tensor({3}, {0, 100, 160});
  Tensor cu_k = testing::int32_tensor({3}, {0, 150, 210});
  Tensor mask = Tensor::empty({2, 2, 1, 2}, DType::kBool);
  Tensor out = Tensor::empty({160, 4, 16}, DType::kBF16);
  Tensor lse = Tensor::empty({160, 4}, DType::kF32);
  int64_t max_q = 100, max_k = 150;
  std::optional<TensorView> mask_arg = mask.view();
  std::optional<TensorView> lse_arg = lse.view();
  BlockSparseAttentionOptions o = [] {
    BlockSparseAttentionOptions x;
    x.backend = Backend::kReference;
    x.head_mask_type = {1, 0, -1, 1};
    x.streaming_info = {0, 0, 0, 0, 1, 1, 0, 0};
    return x;
  }();

  AttentionArgs() {
    std::fill_n(q.data_as<uint16_t>(), q.numel(), uint16_t{0});
    std::fill_n(k.data_as<uint16_t>(), k.numel(), uint16_t{0});
    std::fill_n(v.data_as<uint16_t>(), v.numel(), uint16_t{0});
    std::fill_n(mask.data_as<uint8_t>(), mask.numel(), uint8_t{1});
  }
  void run() {
    block_sparse_attention(q, k, v, cu_q, cu_k, mask_arg, max_q, max_k, out, lse_arg, o);
  }
  void run_qkv(const TensorView& qv, const TensorView& kv, const TensorView& vv) {
    block_sparse_attention(qv, kv, vv, cu_q, cu_k, mask_arg, max_q, max_k, out, lse_arg, o);
  }
  void run_out(const TensorView& ov) {
    block_sparse_attention(q, k, v, cu_q, cu_k, mask_arg, max_q, max_k, ov, lse_arg, o);
  }
};

TEST_F(AttentionArgs, ValidArgumentsPass) { EXPECT_NO_THROW(run()); }

TEST_F(AttentionArgs, QRankMustBeThree) {
  Tensor q4 = Tensor::empty({1, 160, 4, 16}, DType::kBF16);
  expect_error<ValueError>([&] { run_qkv(q4, k, v); }, "q");
}

TEST_F(AttentionArgs, KDtypeMustMatchQ) {
  Tensor kf = Tensor::empty({210, 2, 16}, DType::kF32);
  expect_error<TypeError>([&] { run_qkv(q, kf, v); }, "k");
}

TEST_F(AttentionArgs, VShapeMustMatchK) {
  Tensor v2 = Tensor::empty({209, 2, 16}, DType::kBF16);
  expect_error<ValueError>([&] { run_qkv(q, k, v2); }, "v");
}

TEST_F(AttentionArgs, KHeadDimMustMatchQ) {
  Tensor k2 = Tensor::empty({210, 2, 8}, DType::kBF16);
  Tensor v2 = Tensor::empty({210, 2, 8}, DType::kBF16);
  expect_error<ValueError>([&] { run_qkv(q, k2, v2); }, "k");
}

TEST_F(AttentionArgs, QHeadsMustBeAMultipleOfKHeads) {
  Tensor k3 = Tensor::empty({210, 3, 16}, DType::kBF16);
  Tensor v3 = Tensor::empty({210, 3, 16}, DType::kBF16);
  expect_error<ValueError>([&] { run_qkv(q, k3, v3); }, "q");
}

TEST_F(AttentionArgs, CuSeqlensQMustBeInteger) {
  Tensor c = Tensor::empty({3}, DType::kF32);
  expect_error<TypeError>(
      [&] { block_sparse_attention(q, k, v, c, cu_k, mask_arg, max_q, max_k, out, lse_arg, o); },
      "cu_seqlens_q");
}

TEST_F(AttentionArgs, CuSeqlensKNeedsBatchPlusOneEntries) {
  Tensor c = testing::int32_tensor({2}, {0, 150});
  expect_error<ValueError>(
      [&] { block_sparse_attention(q, k, v, cu_q, c, mask_arg, max_q, max_k, out, lse_arg, o); },
      "cu_seqlens_k");
}

TEST_F(AttentionArgs, MaxSeqlenQMustBeNonNegative) {
  max_q = -1;
  expect_error<ValueError>([&] { run(); }, "max_seqlen_q");
}

TEST_F(AttentionArgs, DropoutMustBeZero) {
  o.p_dropout = 0.1;
  expect_error<ValueError>([&] { run(); }, "p_dropout");
}

TEST_F(AttentionArgs, SoftmaxScaleMustBePositive) {
  o.softmax_scale = -1.0;
  expect_error<ValueError>([&] { run(); }, "softmax_scale");
}

TEST_F(AttentionArgs, HugeBroadcastHeadsGiveAValueError) {
  // All heads block-sparse by default: the per-head table is built only after validation.
  o.head_mask_type.clear();
  o.streaming_info.clear();
  const int64_t heads = int64_t{1} << 40;
  TensorView qv = q.view().as_strided({160, heads, 16}, {64, 0, 1});
  TensorView ov = out.view().as_strided({160, heads, 16}, {64, 0, 1});
  expect_error<ValueError>(
      [&] {
        block_sparse_attention(qv, k, v, cu_q, cu_k, mask_arg, max_q, max_k, ov, std::nullopt, o);
      },
      "base_blockmask");
}

// A missing output (a default-constructed TensorView) is reported only after every other
// argument, the given outputs included, is checked (api/check.h): what the Python wrappers rely
// on when an output they allocate does not fit.
TEST_F(AttentionArgs, MissingOutIsReportedAfterTheGivenLse) {
  Tensor l2 = Tensor::empty({160, 3}, DType::kF32);
  lse_arg = l2.view();
  expect_error<ValueError>([&] { run_out(TensorView()); }, "lse");
  lse_arg = lse.view();
  expect_error<ValueError>([&] { run_out(TensorView()); }, "out");
  lse_arg = std::nullopt;
  expect_error<ValueError>([&] { run_out(TensorView()); }, "out");
}

TEST_F(AttentionArgs, MissingOutStillLetsTheInputsBeChecked) {
  max_q = -1;
  expect_error<ValueError>([&] { run_out(TensorView()); }, "max_seqlen_q");
}

TEST_F(AttentionArgs, SoftmaxScaleMustBeFloat32) {
  for (double bad : {1e39, 1e-46}) {
    o.softmax_scale = bad;
    expect_error<ValueError>([&] { run(); }, "softmax_scale");
  }
}

TEST_F(AttentionArgs, HeadMaskTypeNeedsOneEntryPerQueryHead) {
  o.head_mask_type = {1, 1};
  expect_error<ValueError>([&] { run(); }, "head_mask_type");
}

TEST_F(AttentionArgs, HeadMaskTypeValuesAreMinusOneZeroOrOne) {
  o.head_mask_type = {1, 2, -1, 1};
  expect_error<ValueError>([&] { run(); }, "head_mask_type[1]");
}

TEST_F(AttentionArgs, StreamingHeadsNeedStreamingInfo) {
  o.streaming_info.clear();
  expect_error<ValueError>([&] { run(); }, "streaming_info");
}

TEST_F(AttentionArgs, StreamingInfoNeedsTwoEntriesPerQueryHead) {
  o.streaming_info = {1, 1};
  expect_error<ValueError>([&] { run(); }, "streaming_info");
}

TEST_F(AttentionArgs, StreamingInfoCountsAreNonNegative) {
  o.streaming_info[5] = -1;
  expect_error<ValueError>([&] { run(); }, "streaming_info[5]");
}

TEST_F(AttentionArgs, BlockSparseHeadsNeedBaseBlockmask) {
  mask_arg.reset();
  expect_error<ValueError>([&] { run(); }, "base_blockmask");
}

TEST_F(AttentionArgs, BaseBlockmaskWithoutBlockSparseHeadsIsRejected) {
  o.head_mask_type = {0, 0, -1, 0};
  expect_error<ValueError>([&] { run(); }, "base_blockmask");
}

TEST_F(AttentionArgs, BaseBlockmaskShapeCountsOnlyBlockSparseHeads) {
  Tensor m4 = Tensor::empty({2, 4, 1, 2}, DType::kBool);
  mask_arg = m4.view();
  expect_error<ValueError>([&] { run(); }, "base_blockmask");
}

TEST_F(AttentionArgs, BaseBlockmaskMustBeBool) {
  Tensor mi = Tensor::empty({2, 2, 1, 2}, DType::kI32);
  mask_arg = mi.view();
  expect_error<TypeError>([&] { run(); }, "base_blockmask");
}

TEST_F(AttentionArgs, OutShapeMustMatchQ) {
  Tensor o2 = Tensor::empty({160, 4, 8}, DType::kBF16);
  expect_error<ValueError>([&] { run_out(o2); }, "out");
}

TEST_F(AttentionArgs, OutDtypeMustMatchQ) {
  Tensor o2 = Tensor::empty({160, 4, 16}, DType::kF32);
  expect_error<TypeError>([&] { run_out(o2); }, "out");
}

TEST_F(AttentionArgs, OutElementsMustNotShareMemory) {
  TensorView o2 = out.view().as_strided({160, 4, 16}, {64, 8, 1});
  expect_error<ValueError>([&] { run_out(o2); }, "out");
}

TEST_F(AttentionArgs, OutMustNotOverlapQ) {
  expect_error<ValueError>([&] { run_out(q); }, "out");
}

TEST_F(AttentionArgs, LseShapeIsTotalQByHeads) {
  Tensor l2 = Tensor::empty({4, 160}, DType::kF32);
  lse_arg = l2.view();
  expect_error<ValueError>([&] { run(); }, "lse");
}

TEST_F(AttentionArgs, LseMustBeFloat32) {
  Tensor l2 = Tensor::empty({160, 4}, DType::kBF16);
  lse_arg = l2.view();
  expect_error<TypeError>([&] { run(); }, "lse");
}

// Backend native on host tensors is the CPU backend (test_cpu_block_sparse.cpp compares it).
TEST_F(AttentionArgs, NativeBackendOnHostTensorsRuns) {
  o.backend = Backend::kNative;
  EXPECT_NO_THROW(run());
}

// Contents are the caller's promise; both host backends check them as they read them.
TEST_F(AttentionArgs, HostBackendsRejectDecreasingCuSeqlensQ) {
  cu_q = testing::int32_tensor({3}, {0, 100, 90});
  for (Backend b : {Backend::kReference, Backend::kNative}) {
    o.backend = b;
    expect_error<ValueError>([&] { run(); }, "cu_seqlens_q");
  }
}

TEST_F(AttentionArgs, ReferenceRejectsSequencesLongerThanMaxSeqlen) {
  cu_k = testing::int32_tensor({3}, {0, 10, 210});
  expect_error<ValueError>([&] { run(); }, "cu_seqlens_k");
}

// block_sparse_attention_paged: the same queries, K/V in 8 pages of 64.
struct PagedArgs : AttentionArgs {
  Tensor kc = Tensor::empty({8, 64, 2, 16}, DType::kBF16);
  Tensor vc = Tensor::empty({8, 64, 2, 16}, DType::kBF16);
  Tensor table = testing::int32_tensor({2, 3}, {0, 1, 2, 3, -1, -1});
  Tensor seqlens = testing::int32_tensor({2}, {150, 60});

  PagedArgs() {
    std::fill_n(kc.data_as<uint16_t>(), kc.numel(), uint16_t{0});
    std::fill_n(vc.data_as<uint16_t>(), vc.numel(), uint16_t{0});
  }
  void run_paged(const TensorView& kcv, const TensorView& vcv, const TensorView& bt,
                 const TensorView& sk) {
    block_sparse_attention_paged(q, kcv, vcv, bt, sk, cu_q, mask_arg, max_q, max_k, out, lse_arg,
                                 o);
  }
  void run_paged() { run_paged(kc, vc, table, seqlens); }
};

TEST_F(PagedArgs, ValidArgumentsPass) { EXPECT_NO_THROW(run_paged()); }

TEST_F(PagedArgs, KCacheRankMustBeFour) {
  Tensor k3 = Tensor::empty({512, 2, 16}, DType::kBF16);
  expect_error<ValueError>([&] { run_paged(k3, vc, table, seqlens); }, "k_cache");
}

TEST_F(PagedArgs, PageSizeMustBePositive) {
  Tensor k0 = Tensor::empty({8, 0, 2, 16}, DType::kBF16);
  Tensor v0 = Tensor::empty({8, 0, 2, 16}, DType::kBF16);
  expect_error<ValueError>([&] { run_paged(k0, v0, table, seqlens); }, "k_cache");
}

TEST_F(PagedArgs, VCacheShapeMustMatchKCache) {
  Tensor v2 = Tensor::empty({7, 64, 2, 16}, DType::kBF16);
  expect_error<ValueError>([&] { run_paged(kc, v2, table, seqlens); }, "v_cache");
}

TEST_F(PagedArgs, BlockTableNeedsOneRowPerSequence) {
  Tensor bt = testing::int32_tensor({1, 3}, {0, 1, 2});
  expect_error<ValueError>([&] { run_paged(kc, vc, bt, seqlens); }, "block_table");
}

TEST_F(PagedArgs, SeqlensKNeedsOneEntryPerSequence) {
  Tensor sk = testing::int32_tensor({3}, {150, 60, 0});
  expect_error<ValueError>([&] { run_paged(kc, vc, table, sk); }, "seqlens_k");
}

TEST_F(PagedArgs, MaxSeqlenKMustFitTheBlockTable) {
  max_k = 193 + 64 * 2;  // 3 pages of 64 hold 192 keys
  mask_arg.reset();
  o.head_mask_type = {0, 0, -1, 0};
  expect_error<ValueError>([&] { run_paged(); }, "max_seqlen_k");
}

TEST_F(PagedArgs, ReferenceRejectsPagesOutOfRange) {
  table = testing::int32_tensor({2, 3}, {0, 1, 8, 3, -1, -1});
  expect_error<ValueError>([&] { run_paged(); }, "block_table");
}

TEST_F(PagedArgs, ReferenceRejectsSeqlensKAboveMax) {
  seqlens = testing::int32_tensor({2}, {151, 60});
  expect_error<ValueError>([&] { run_paged(); }, "seqlens_k");
}

// xattention_prefill: query [1, 4, 200, 16], key/value [1, 2, 300, 16].
struct PrefillArgs : EstimateArgs {
  Tensor val = Tensor::empty({1, 2, 300, 16}, DType::kBF16);
  Tensor out = Tensor::empty({1, 4, 200, 16}, DType::kBF16);
  Tensor lse = Tensor::empty({1, 4, 200}, DType::kF32);
  XAttnPrefillOptions po = [] {
    XAttnPrefillOptions x;
    x.backend = Backend::kReference;
    return x;
  }();

  PrefillArgs() { std::fill_n(val.data_as<uint16_t>(), val.numel(), uint16_t{0}); }
  void run_prefill(const TensorView& vv, const TensorView& ov, const TensorView& lv) {
    xattention_prefill(q, k, vv, sums, mask, ov, lv, po);
  }
};

TEST_F(PrefillArgs, ValidArgumentsPass) { EXPECT_NO_THROW(run_prefill(val, out, lse)); }

TEST_F(PrefillArgs, BlockSizeMustBe128) {
  po.block_size = 64;
  po.chunk_size = 256;
  expect_error<ValueError>([&] { run_prefill(val, out, lse); }, "block_size");
}

TEST_F(PrefillArgs, ValueShapeMustMatchKey) {
  Tensor v2 = Tensor::empty({1, 2, 299, 16}, DType::kBF16);
  expect_error<ValueError>([&] { run_prefill(v2, out, lse); }, "value");
}

TEST_F(PrefillArgs, ValueDtypeMustMatchQuery) {
  Tensor v2 = Tensor::empty({1, 2, 300, 16}, DType::kF16);
  expect_error<TypeError>([&] { run_prefill(v2, out, lse); }, "value");
}

TEST_F(PrefillArgs, OutShapeMustMatchQuery) {
  Tensor o2 = Tensor::empty({1, 4, 300, 16}, DType::kBF16);
  expect_error<ValueError>([&] { run_prefill(val, o2, lse); }, "out");
}

TEST_F(PrefillArgs, LseShapeIsBatchHeadsRows) {
  Tensor l2 = Tensor::empty({1, 200, 4}, DType::kF32);
  expect_error<ValueError>([&] { run_prefill(val, out, l2); }, "lse");
}

TEST_F(PrefillArgs, OutMustNotOverlapValue) {
  // value and out inside one buffer, overlapping each other only.
  Tensor buf = Tensor::empty({1, 4, 400, 16}, DType::kBF16);
  std::fill_n(buf.data_as<uint16_t>(), buf.numel(), uint16_t{0});
  TensorView vv = buf.view().as_strided({1, 2, 300, 16}, {9600, 4800, 16, 1});
  TensorView ov = buf.view().as_strided({1, 4, 200, 16}, {12800, 3200, 16, 1}, 1000);
  expect_error<ValueError>([&] { run_prefill(vv, ov, lse); }, "out");
}

TEST_F(PrefillArgs, MissingScratchOutputsAreReportedAfterTheGivenOutAndLse) {
  Tensor o2 = Tensor::empty({1, 4, 300, 16}, DType::kBF16);
  Tensor l2 = Tensor::empty({1, 200, 4}, DType::kF32);
  auto missing_scratch = [&](const TensorView& ov, const TensorView& lv) {
    xattention_prefill(q, k, val, TensorView(), TensorView(), ov, lv, po);
  };
  expect_error<ValueError>([&] { missing_scratch(o2, lse); }, "out");
  expect_error<ValueError>([&] { missing_scratch(out, l2); }, "lse");
  expect_error<ValueError>([&] { missing_scratch(TensorView(), l2); }, "lse");
  expect_error<ValueError>([&] { missing_scratch(out, lse); }, "attn_sums");
  expect_error<ValueError>([&] { xattention_prefill(q, k, val, sums, TensorView(), out, lse, po); },
                           "block_mask");
}

TEST_F(PrefillArgs, SoftmaxScaleMustBePositive) {
  po.softmax_scale = 0.0;
  expect_error<ValueError>([&] { run_prefill(val, out, lse); }, "softmax_scale");
  po.softmax_scale = 1e39;
  expect_error<ValueError>([&] { run_prefill(val, out, lse); }, "softmax_scale");
}

TEST_F(PrefillArgs, EstimateRulesApplyToo) {
  po.stride = 3;
  expect_error<ValueError>([&] { run_prefill(val, out, lse); }, "stride");
}

}  // namespace
}  // namespace sparse_attn
