// Native qsa_compress_block_keys against the reference on the same, freshly drawn inputs: the
// destination starts poisoned (NaN) on both sides, slots no complete block reaches must stay
// poisoned, and written ones agree within one rounding of the output dtype (the native sum of
// squares runs in another order). Reruns are bitwise equal. Every case skips without a GPU.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "gpu_test_util.h"
#include "sparse_attn/errors.h"
#include "sparse_attn/qsa_compress.h"
#include "test_util.h"

namespace sparse_attn {
namespace {

using testing::get;
using testing::int32_tensor;
using testing::make_rng;
using testing::random_tensor;
using testing::to_device;

constexpr int64_t kD = 128;

struct GpuCase {
  std::string name;
  DType dtype;
  RopeStyle style;
  int64_t table_cols;           // 0: rope_theta
  std::vector<int32_t> cu;      // empty: one request of `tokens` rows
  std::vector<int32_t> starts;  // empty: no start_positions
  int64_t tokens;
  int64_t page_size;  // 0: contiguous out
};

void PrintTo(const GpuCase& c, std::ostream* os) { *os << c.name; }

class GpuCompress : public ::testing::TestWithParam<GpuCase> {};

TEST_P(GpuCompress, NativeMatchesReference) {
  SPARSE_ATTN_REQUIRE_GPU();
  const GpuCase& c = GetParam();
  auto rng = make_rng();
  const bool varlen = !c.cu.empty();
  const int64_t B = varlen ? int64_t(c.cu.size()) - 1 : 1;
  const int64_t rows = varlen ? c.cu.back() : c.tokens;
  const Tensor keys = random_tensor({rows, kD}, c.dtype, rng, -3.f, 3.f);
  const Tensor w = random_tensor({kD}, DType::kBF16, rng, -0.5f, 0.5f);
  int64_t max_start = 0;
  for (int32_t s : c.starts) max_start = std::max<int64_t>(max_start, s);
  const int64_t positions = max_start + rows + 4;
  const int64_t max_blocks = positions / 4 + 1;

  CompressBlockKeysOptions o;
  o.rope_style = c.style;
  std::optional<Tensor> cos, sin, cu, starts, table;
  if (c.table_cols) {
    cos = random_tensor({positions, c.table_cols}, DType::kF32, rng);
    sin = random_tensor({positions, c.table_cols}, DType::kF32, rng);
  } else {
    o.rope_theta = 1e6;
  }
  if (varlen) cu = int32_tensor({B + 1}, c.cu);
  if (!c.starts.empty()) starts = int32_tensor({B}, c.starts);
  Shape out_shape;
  if (c.page_size) {
    const int64_t max_pages = (max_blocks + c.page_size - 1) / c.page_size;
    const int64_t pages = B * max_pages + 1;
    std::vector<int32_t> t(B * max_pages);
    // Scattered pages, one missing (-1) and page 0 never used.
    for (int64_t i = 0; i < B * max_pages; ++i) t[i] = int32_t(pages - 1 - i);
    if (t.size() > 2) t[1] = -1;
    table = int32_tensor({B, max_pages}, t);
    out_shape = {pages, c.page_size, kD};
  } else {
    out_shape = varlen ? Shape{B, max_blocks, kD} : Shape{max_blocks, kD};
  }

  // Reference on host tensors.
  Tensor ref = Tensor::empty(out_shape, c.dtype);
  testing::poison(ref.view());
  CompressBlockKeysOptions ho = o;
  if (cos) ho.cos = cos->view(), ho.sin = sin->view();
  if (cu) ho.cu_seqlens = cu->view();
  if (starts) ho.start_positions = starts->view();
  if (table) ho.block_table = table->view();
  qsa_compress_block_keys(keys, w, ref, ho);

  // Native on device copies.
  std::vector<Tensor> keep;
  auto dev = [&](const std::optional<Tensor>& t) -> std::optional<TensorView> {
    if (!t) return std::nullopt;
    keep.push_back(to_device(*t));
    return keep.back().view();
  };
  CompressBlockKeysOptions dopt = o;
  dopt.cos = dev(cos);
  dopt.sin = dev(sin);
  dopt.cu_seqlens = dev(cu);
  dopt.start_positions = dev(starts);
  dopt.block_table = dev(table);
  const Tensor dkeys = to_device(keys), dw = to_device(w);
  const Tensor dout = testing::poisoned_device(out_shape, c.dtype);
  qsa_compress_block_keys(dkeys, dw, dout, dopt);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const Tensor got = Tensor::to_host(dout);

  const std::vector<double> r = testing::to_vector(ref), g = testing::to_vector(got);
  // Both sides are FP32 results rounded to the output dtype: FP32 values a few ulps apart (the
  // warp's sum of squares is reduced in another order) can round to neighbours, one output ulp.
  const double ulp = c.dtype == DType::kBF16 ? 0x1p-7 : 0x1p-10;
  int64_t written = 0;
  for (size_t i = 0; i < r.size(); ++i) {
    ASSERT_EQ(std::isnan(r[i]), std::isnan(g[i])) << "element " << i << " written by one side";
    if (std::isnan(r[i])) continue;
    ++written;
    ASSERT_NEAR(g[i], r[i], 1e-5 + 1.01 * ulp * std::abs(r[i])) << "element " << i;
  }
  EXPECT_GT(written, 0);

  // The same inputs give the same bits.
  const Tensor again = testing::poisoned_device(out_shape, c.dtype);
  qsa_compress_block_keys(dkeys, dw, again, dopt);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const Tensor again_host = Tensor::to_host(again);
  ASSERT_EQ(std::memcmp(again_host.data(), got.data(), got.numel() * dtype_size(c.dtype)), 0);

  // The reference backend on CUDA tensors stages through the host and gives the reference.
  const Tensor staged = testing::poisoned_device(out_shape, c.dtype);
  dopt.backend = Backend::kReference;
  qsa_compress_block_keys(dkeys, dw, staged, dopt);
  const Tensor staged_host = Tensor::to_host(staged);
  ASSERT_EQ(std::memcmp(staged_host.data(), ref.data(), ref.numel() * dtype_size(c.dtype)), 0);
}

INSTANTIATE_TEST_SUITE_P(
    Cases, GpuCompress,
    ::testing::Values(
        GpuCase{
            "single_bf16_tail3_theta", DType::kBF16, RopeStyle::kRotateHalf, 0, {}, {}, 8195, 0},
        GpuCase{"single_fp16_cols32", DType::kF16, RopeStyle::kRotateHalf, 32, {}, {}, 1001, 0},
        GpuCase{"single_bf16_cols64_interleaved",
                DType::kBF16,
                RopeStyle::kInterleaved,
                64,
                {},
                {},
                517,
                0},
        GpuCase{"varlen_bf16_page3_starts",
                DType::kBF16,
                RopeStyle::kRotateHalf,
                64,
                {0, 37, 37, 300, 301},
                {0, 5, 2, 11},
                0,
                3},
        GpuCase{"varlen_fp16_page196_theta",
                DType::kF16,
                RopeStyle::kRotateHalf,
                0,
                {0, 4000, 4003, 9000},
                {},
                0,
                196},
        GpuCase{"decode_bf16_page16",
                DType::kBF16,
                RopeStyle::kRotateHalf,
                0,
                {0, 4, 8, 12, 16, 19},
                {100, 4, 0, 64, 8},
                0,
                16},
        GpuCase{"varlen_bf16_contiguous_interleaved_theta",
                DType::kBF16,
                RopeStyle::kInterleaved,
                0,
                {0, 9, 77},
                {3, 0},
                0,
                0}),
    [](const auto& info) { return info.param.name; });

TEST(GpuCompressValidation, NativeNeedsDim128AndRopeDim64) {
  SPARSE_ATTN_REQUIRE_GPU();
  auto rng = make_rng();
  const Tensor keys = to_device(random_tensor({8, 64}, DType::kBF16, rng));
  const Tensor w = to_device(random_tensor({64}, DType::kF32, rng));
  const Tensor out = testing::poisoned_device({2, 64}, DType::kBF16);
  CompressBlockKeysOptions o;
  o.rope_theta = 1e4;
  o.rope_dim = 32;
  EXPECT_THROW(qsa_compress_block_keys(keys, w, out, o), NotSupportedError);
  o.backend = Backend::kReference;
  qsa_compress_block_keys(keys, w, out, o);
}

}  // namespace
}  // namespace sparse_attn
