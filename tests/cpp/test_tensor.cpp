#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "api/check.h"
#include "sparse_attn/dtype.h"
#include "sparse_attn/errors.h"
#include "sparse_attn/qsa.h"
#include "sparse_attn/tensor.h"
#include "test_util.h"

namespace sparse_attn {
namespace {

using testing::make_rng;

TEST(Tensor, ContiguousViewHasRowMajorStrides) {
  Tensor t = Tensor::empty({2, 3, 4}, DType::kBF16);
  EXPECT_EQ(t.view().stride(0), 12);
  EXPECT_EQ(t.view().stride(1), 4);
  EXPECT_EQ(t.view().stride(-1), 1);
  EXPECT_TRUE(t.view().is_contiguous());
  EXPECT_EQ(t.numel(), 24);
  EXPECT_EQ(t.view().shape_str(), "[2, 3, 4]");
}

TEST(Tensor, NarrowAndSelectKeepStrides) {
  Tensor t = Tensor::empty({4, 6}, DType::kF32);
  TensorView col = t.view().narrow(1, 2, 3);
  EXPECT_FALSE(col.is_contiguous());
  EXPECT_EQ(col.data(), t.data_as<float>() + 2);
  TensorView row = t.view().select(0, 3);
  EXPECT_EQ(row.dim(), 1);
  EXPECT_EQ(row.data(), t.data_as<float>() + 18);
}

TEST(Tensor, ByteRangeAndOverlap) {
  Tensor t = Tensor::empty({8, 8}, DType::kF32);
  TensorView top = t.view().narrow(0, 0, 4);
  TensorView bottom = t.view().narrow(0, 4, 4);
  EXPECT_FALSE(views_overlap(top, bottom));
  EXPECT_TRUE(views_overlap(top, t.view().narrow(0, 3, 2)));
  auto [lo, hi] = top.byte_range();
  EXPECT_EQ(hi - lo, 4u * 8u * 4u);
}

TEST(Tensor, RejectsTooManyDimsAndNegativeSizes) {
  EXPECT_THROW(TensorView(nullptr, DType::kF32, Device::cpu(), Shape{1, 1, 1, 1, 1, 1, 1}),
               ValueError);
  EXPECT_THROW(TensorView(nullptr, DType::kF32, Device::cpu(), Shape{-1}), ValueError);
}

TEST(Tensor, CopyIntoStridedView) {
  auto rng = make_rng();
  Tensor src = testing::random_tensor({3, 5}, DType::kF16, rng);
  Tensor big = Tensor::empty({3, 8}, DType::kF16);
  testing::poison(big.view());
  TensorView dst = big.view().narrow(1, 1, 5);
  copy_into(dst, src.view());
  EXPECT_EQ(testing::to_vector(dst), testing::to_vector(src.view()));
  EXPECT_TRUE(std::isnan(testing::get(big.view(), {0, 0})));
}

TEST(Tensor, CudaWithoutCudaBuildIsNotSupported) {
#ifndef SPARSE_ATTN_TEST_HAS_CUDA
  EXPECT_THROW(Tensor::empty({4}, DType::kF32, Device::cuda(0)), NotSupportedError);
#else
  GTEST_SKIP() << "CUDA build";
#endif
}

TEST(DType, Bf16RoundTripAndRounding) {
  EXPECT_EQ(bf16_to_float(float_to_bf16(1.0f)), 1.0f);
  // 1 + 2^-8 is halfway between two bf16 values; ties go to even (1.0).
  EXPECT_EQ(bf16_to_float(float_to_bf16(1.0f + 1.0f / 256)), 1.0f);
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(std::nanf("")))));
  EXPECT_EQ(bf16_to_float(float_to_bf16(-INFINITY)), -INFINITY);
}

TEST(DType, Fp16MatchesIeeeOnEdgeValues) {
  for (float v : {0.0f, -0.0f, 1.0f, -2.5f, 65504.0f, 6.103515625e-05f, 5.960464477539063e-08f,
                  0.333251953125f}) {
    EXPECT_EQ(fp16_to_float(float_to_fp16(v)), v) << v;
  }
  EXPECT_EQ(fp16_to_float(float_to_fp16(70000.f)), INFINITY);
  EXPECT_EQ(fp16_to_float(float_to_fp16(1e-9f)), 0.0f);
  // Halfway between 1 and the next fp16 (2^-10 apart) rounds to even.
  EXPECT_EQ(fp16_to_float(float_to_fp16(1.0f + 1.0f / 2048)), 1.0f);
  EXPECT_EQ(fp16_to_float(float_to_fp16(1.0f + 3.0f / 2048)), 1.0f + 2.0f / 1024);
}

TEST(Backend, ParsesSeedNames) {
  EXPECT_EQ(parse_backend("native"), Backend::kNative);
  EXPECT_EQ(parse_backend("tilelang"), Backend::kNative);
  EXPECT_EQ(parse_backend("reference"), Backend::kReference);
  try {
    parse_backend("auto");
    FAIL();
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("backend"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("auto"), std::string::npos);
  }
}

TEST(Check, VectorLoadLayoutMessage) {
  Tensor t = Tensor::empty({4, 4, 128}, DType::kBF16);
  EXPECT_NO_THROW(detail::check_vector_load_layout(t.view(), "q"));
  // Offsetting by one element breaks the 16-byte alignment.
  TensorView off = t.view().as_strided({4, 4, 127}, {512, 128, 1}, 1);
  try {
    detail::check_vector_load_layout(off, "q");
    FAIL();
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("vector loads require unit feature stride and 16-byte "
                                         "alignment"),
              std::string::npos);
  }
  // Outer stride not a multiple of 16 bytes.
  TensorView odd = t.view().as_strided({4, 3, 128}, {4 * 129, 129, 1});
  EXPECT_THROW(detail::check_vector_load_layout(odd, "q"), ValueError);
}

TEST(Check, Float32ScaleRule) {
  EXPECT_EQ(detail::check_float32_scale(0.5, "scale"), 0.5f);
  EXPECT_GT(detail::check_float32_scale(1e-40, "scale"), 0.f);  // a float32 subnormal
  for (double bad : {0.0, -1.0, 1e39, 1e-46, std::nan(""), HUGE_VAL}) {
    try {
      detail::check_float32_scale(bad, "scale");
      ADD_FAILURE() << bad;
    } catch (const ValueError& e) {
      EXPECT_EQ(std::string(e.what()).rfind("scale: expected a value representable as a positive "
                                            "finite float32",
                                            0),
                0u)
          << e.what();
    }
  }
  try {
    detail::check_float32_scale(1.0 / 1e-40, "score_scale", "1 / score_scale", 1e-40);
    FAIL();
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("score_scale: expected 1 / score_scale to be"),
              std::string::npos)
        << e.what();
  }
}

TEST(Check, SizeProductsThatOverflowAreValueErrors) {
  EXPECT_EQ(detail::checked_size_product(int64_t{1} << 40, int64_t{1} << 20, "x", "a * b"),
            int64_t{1} << 60);
  try {
    detail::checked_size_product(int64_t{1} << 40, int64_t{1} << 30, "block_table",
                                 "max_pages * page_size");
    FAIL();
  } catch (const ValueError& e) {
    EXPECT_EQ(std::string(e.what()).rfind("block_table: max_pages * page_size", 0), 0u) << e.what();
  }
}

TEST(Check, RowViewCollapse) {
  Tensor t = Tensor::empty({2, 3, 4}, DType::kF32);
  EXPECT_NO_THROW(detail::check_row_view(t.view(), "query", 2));
  TensorView strided = t.view().as_strided({2, 2, 4}, {12, 4, 1});  // skips a row per batch
  EXPECT_THROW(detail::check_row_view(strided, "query", 2), ValueError);
  TensorView one = t.view().as_strided({1, 2, 4}, {100, 4, 1});  // batch of 1 is exempt
  EXPECT_NO_THROW(detail::check_row_view(one, "query", 2));
}

}  // namespace
}  // namespace sparse_attn
