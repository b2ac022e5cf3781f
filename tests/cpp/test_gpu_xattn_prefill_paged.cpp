// Native xattention_prefill_paged: bitwise the native contiguous prefill on the keys and values
// its pages hold (engine page sizes, ones the stride does not divide, K/V as views of one
// [pages, page, Hkv, 2 D] cache, batch 2, GQA; the contiguous prefill is checked against the
// reference in test_gpu_xattn_estimate.cpp), a captured graph's replay the direct call's, and
// broken page ids read as zeros without a fault (memcheck). Every case skips cleanly without a
// GPU.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <vector>

#include "gpu_test_util.h"
#include "sparse_attn/errors.h"
#include "sparse_attn/xattn.h"
#include "test_util.h"
#include "test_xattn_util.h"

namespace sparse_attn {
namespace {

using testing::to_device;
using testing::to_vector;
using xattn_testing::PagedCache;

constexpr int64_t kB = 2, kHq = 8, kHkv = 2, kLq = 700, kD = 128;

struct DeviceOutputs {
  Tensor sums, mask, out, lse;
  DeviceOutputs(const Shape& shape, const Shape& q_shape)
      : sums(testing::poisoned_device(shape, DType::kF32)),
        mask(testing::poisoned_device(shape, DType::kBool)),
        out(testing::poisoned_device(q_shape, DType::kBF16)),
        lse(testing::poisoned_device({kB, kHq, kLq}, DType::kF32)) {}
  std::vector<std::vector<double>> values() const {
    return {to_vector(Tensor::to_host(sums.view()).view()),
            to_vector(Tensor::to_host(mask.view()).view()),
            to_vector(Tensor::to_host(out.view()).view()),
            to_vector(Tensor::to_host(lse.view()).view())};
  }
};

class GpuXAttnPrefillPaged : public ::testing::TestWithParam<int64_t> {};

TEST_P(GpuXAttnPrefillPaged, EqualsTheContiguousPrefill) {
  SPARSE_ATTN_REQUIRE_GPU();
  const int64_t page_size = GetParam(), k_len = 2500;
  auto rng = testing::make_rng();
  const PagedCache c(kB, kHkv, kD, page_size, k_len, rng);
  const Tensor q = testing::random_tensor({kB, kHq, kLq, kD}, DType::kBF16, rng, -2.f, 2.f);
  const Tensor dq = to_device(q), dcache = to_device(c.cache), dtable = to_device(c.table);
  const Tensor dkey = to_device(c.key), dvalue = to_device(c.value);
  const TensorView dk_cache = dcache.view().narrow(3, 0, kD),
                   dv_cache = dcache.view().narrow(3, kD, kD);
  XAttnPrefillOptions o;
  o.chunk_size = 512;
  const Shape shape = xattn_estimate_shape(q, c.key, o);

  DeviceOutputs paged(shape, q.shape()), whole(shape, q.shape());
  xattention_prefill_paged(dq, dk_cache, dv_cache, dtable, k_len, paged.sums, paged.mask, paged.out,
                           paged.lse.view(), o);
  xattention_prefill(dq, dkey, dvalue, whole.sums, whole.mask, whole.out, whole.lse.view(), o);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const auto got = paged.values(), want = whole.values();
  for (size_t i = 0; i < got.size(); ++i) EXPECT_EQ(got[i], want[i]) << "output " << i;

  // A captured call replays to the same bits.
  DeviceOutputs replayed(shape, q.shape());
  testing::CapturedGraph graph([&](cudaStream_t s) {
    XAttnPrefillOptions go = o;
    go.stream = s;
    xattention_prefill_paged(dq, dk_cache, dv_cache, dtable, k_len, replayed.sums, replayed.mask,
                             replayed.out, replayed.lse.view(), go);
  });
  ASSERT_TRUE(graph.ok());
  ASSERT_EQ(graph.replay(), cudaSuccess);
  const auto again = replayed.values();
  for (size_t i = 0; i < again.size(); ++i) EXPECT_EQ(again[i], want[i]) << "replay, output " << i;
}

INSTANTIATE_TEST_SUITE_P(PageSizes, GpuXAttnPrefillPaged, ::testing::Values(128, 800, 1000, 1601),
                         [](const auto& info) { return "page" + std::to_string(info.param); });

TEST(GpuXAttnPrefillPagedBroken, PageIdsOutsideTheCacheReadZeros) {
  SPARSE_ATTN_REQUIRE_GPU();
  auto rng = testing::make_rng();
  const PagedCache c(kB, kHkv, kD, 800, 2500, rng);
  const Tensor q = testing::random_tensor({kB, kHq, kLq, kD}, DType::kBF16, rng);
  Tensor table = Tensor::empty(c.table.shape(), DType::kI32);
  copy_into(table.view(), c.table.view());
  table.data_as<int32_t>()[1] = 1 << 30;
  table.data_as<int32_t>()[2] = -5;
  const Tensor dq = to_device(q), dcache = to_device(c.cache), dtable = to_device(table);
  const Shape shape = xattn_estimate_shape(q, c.key, XAttnEstimateOptions{});
  DeviceOutputs o(shape, q.shape());
  xattention_prefill_paged(dq, dcache.view().narrow(3, 0, kD), dcache.view().narrow(3, kD, kD),
                           dtable, 2500, o.sums, o.mask, o.out, o.lse.view());
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

// What the native estimate does not take is refused before the gather runs.
TEST(GpuXAttnPrefillPagedBroken, UnsupportedStrideIsRefusedBeforeAnyWork) {
  SPARSE_ATTN_REQUIRE_GPU();
  auto rng = testing::make_rng();
  const PagedCache c(kB, kHkv, kD, 800, 2500, rng);
  const Tensor q = testing::random_tensor({kB, kHq, kLq, kD}, DType::kBF16, rng);
  const Tensor dq = to_device(q), dcache = to_device(c.cache), dtable = to_device(c.table);
  XAttnPrefillOptions o;
  o.stride = 2;  // 64 groups a block
  const Shape shape = xattn_estimate_shape(q, c.key, o);
  DeviceOutputs out(shape, q.shape());
  testing::expect_error<NotSupportedError>(
      [&] {
        xattention_prefill_paged(dq, dcache.view().narrow(3, 0, kD),
                                 dcache.view().narrow(3, kD, kD), dtable, 2500, out.sums, out.mask,
                                 out.out, out.lse.view(), o);
      },
      "block_size");
}

}  // namespace
}  // namespace sparse_attn
