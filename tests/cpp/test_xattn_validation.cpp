// XAttention argument validation: one test per rule, asserting the error kind and that the
// message names the argument. Validation reads no tensor contents, so device views here may
// point at host memory: the call must fail before anything is read.
#include <gtest/gtest.h>

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

TEST_F(EstimateArgs, NativeBackendNeedsCudaTensors) {
  o.backend = Backend::kNative;
  expect_error<NotSupportedError>([&] { run(); }, "query");
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

TEST_F(FindBlocksArgs, BlockMaskMustNotOverlapAttnSums) {
  TensorView m(sums.data(), DType::kBool, Device::cpu(), {1, 2, 2, 3});
  expect_error<ValueError>([&] { run(sums, m); }, "block_mask");
}

}  // namespace
}  // namespace sparse_attn
