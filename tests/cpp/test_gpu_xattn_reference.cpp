// The XAttention reference backend on CUDA tensors: inputs are staged to the host and outputs
// copied back into the caller's (strided) device views, giving bitwise the result of the host
// call.
#include <gtest/gtest.h>

#include <cmath>

#include "gpu_test_util.h"
#include "sparse_attn/xattn.h"
#include "test_util.h"

namespace sparse_attn {
namespace {

using testing::make_rng;
using testing::to_device;
using testing::to_vector;

std::vector<double> host_values(const TensorView& device_view) {
  return to_vector(Tensor::to_host(device_view).view());
}

// NaN-aware bitwise-style comparison (-inf LSE entries compare equal).
void expect_same(const std::vector<double>& got, const std::vector<double>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    if (std::isnan(want[i])) {
      EXPECT_TRUE(std::isnan(got[i])) << i;
    } else {
      EXPECT_EQ(got[i], want[i]) << i;
    }
  }
}

TEST(GpuXAttentionReference, PrefillOnDeviceTensorsMatchesHostCallBitwise) {
  SPARSE_ATTN_REQUIRE_GPU();
  auto rng = make_rng();
  Tensor q = testing::random_tensor({2, 4, 200, 32}, DType::kBF16, rng, -2.f, 2.f);
  Tensor k = testing::random_tensor({2, 2, 300, 32}, DType::kBF16, rng, -2.f, 2.f);
  Tensor v = testing::random_tensor({2, 2, 300, 32}, DType::kBF16, rng);
  XAttnPrefillOptions o;
  o.backend = Backend::kReference;
  o.threshold = 0.8;
  const Shape shape = xattn_estimate_shape(q, k, o);
  Tensor sums_h = Tensor::empty(shape, DType::kF32), mask_h = Tensor::empty(shape, DType::kBool);
  Tensor out_h = Tensor::empty(q.shape(), DType::kBF16);
  Tensor lse_h = Tensor::empty({2, 4, 200}, DType::kF32);
  xattention_prefill(q, k, v, sums_h, mask_h, out_h, lse_h.view(), o);

  Tensor qd = to_device(q), kd = to_device(k), vd = to_device(v);
  Tensor sums_d = testing::poisoned_device(shape, DType::kF32);
  Tensor mask_d = testing::poisoned_device(shape, DType::kBool);
  Tensor out_buf = testing::poisoned_device({2, 4, 200, 40}, DType::kBF16);
  TensorView out_d = out_buf.view().narrow(3, 4, 32);
  Tensor lse_d = testing::poisoned_device({2, 4, 200}, DType::kF32);
  xattention_prefill(qd, kd, vd, sums_d, mask_d, out_d, lse_d.view(), o);

  expect_same(host_values(sums_d.view()), to_vector(sums_h.view()));
  expect_same(host_values(mask_d.view()), to_vector(mask_h.view()));
  expect_same(host_values(out_d), to_vector(out_h.view()));
  expect_same(host_values(lse_d.view()), to_vector(lse_h.view()));
  int64_t nan = 0;
  for (double x : host_values(out_buf.view())) nan += std::isnan(x) ? 1 : 0;
  EXPECT_EQ(nan, 2 * 4 * 200 * 8);  // the columns around the view are untouched
}

TEST(GpuXAttentionReference, PagedAttentionOnDeviceTensorsMatchesHostCallBitwise) {
  SPARSE_ATTN_REQUIRE_GPU();
  auto rng = make_rng();
  Tensor q = testing::random_tensor({150, 4, 16}, DType::kF16, rng);
  Tensor kc = testing::random_tensor({6, 64, 2, 16}, DType::kF16, rng);
  Tensor vc = testing::random_tensor({6, 64, 2, 16}, DType::kF16, rng);
  Tensor table = testing::int32_tensor({2, 3}, {4, 0, 2, 5, 1, -1});
  Tensor seqlens = testing::int32_tensor({2}, {170, 100});
  Tensor cu_q = testing::int32_tensor({3}, {0, 100, 150});
  Tensor mask = Tensor::empty({2, 2, 1, 2}, DType::kBool);
  for (int64_t i = 0; i < mask.numel(); ++i) mask.data_as<uint8_t>()[i] = i % 3 != 1;
  BlockSparseAttentionOptions o;
  o.backend = Backend::kReference;
  o.head_mask_type = {1, -1, 0, 1};
  o.streaming_info = {0, 0, 1, 1, 0, 0, 0, 0};
  Tensor out_h = Tensor::empty(q.shape(), DType::kF16);
  Tensor lse_h = Tensor::empty({150, 4}, DType::kF32);
  block_sparse_attention_paged(q, kc, vc, table, seqlens, cu_q, mask.view(), 100, 170, out_h,
                               lse_h.view(), o);

  Tensor qd = to_device(q), kcd = to_device(kc), vcd = to_device(vc);
  Tensor tabled = to_device(table), seqd = to_device(seqlens), cud = to_device(cu_q);
  Tensor maskd = to_device(mask);
  Tensor out_d = testing::poisoned_device(q.shape(), DType::kF16);
  Tensor lse_d = testing::poisoned_device({150, 4}, DType::kF32);
  block_sparse_attention_paged(qd, kcd, vcd, tabled, seqd, cud, maskd.view(), 100, 170, out_d,
                               lse_d.view(), o);
  expect_same(host_values(out_d.view()), to_vector(out_h.view()));
  expect_same(host_values(lse_d.view()), to_vector(lse_h.view()));
}

TEST(GpuXAttentionReference, FindBlocksOnDeviceTensorsMatchesHostCall) {
  SPARSE_ATTN_REQUIRE_GPU();
  auto rng = make_rng();
  Tensor sums = testing::random_tensor({1, 3, 4, 6}, DType::kF32, rng, 0.f, 1.f);
  FindBlocksOptions o;
  o.backend = Backend::kReference;
  o.threshold = 0.6;
  Tensor mask_h = Tensor::empty(sums.shape(), DType::kBool);
  find_blocks_chunked(sums, mask_h, o);
  Tensor sums_d = to_device(sums);
  Tensor mask_d = testing::poisoned_device(sums.shape(), DType::kBool);
  find_blocks_chunked(sums_d, mask_d, o);
  expect_same(host_values(mask_d.view()), to_vector(mask_h.view()));
}

}  // namespace
}  // namespace sparse_attn
