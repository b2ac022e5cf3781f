// Device memory: allocation, dense and strided copies in every direction, CUDA errors.
#include <gtest/gtest.h>

#include "gpu_test_util.h"
#include "sparse_attn/errors.h"
#include "sparse_attn/qsa_select.h"
#include "sparse_attn/tensor.h"
#include "test_util.h"

namespace sparse_attn {
namespace {

using testing::make_rng;
using testing::to_vector;

TEST(GpuDeviceMemory, DenseRoundTripIsExact) {
  SPARSE_ATTN_REQUIRE_GPU();
  auto rng = make_rng();
  Tensor host = testing::random_tensor({37, 129}, DType::kBF16, rng);
  Tensor dev = testing::to_device(host);
  EXPECT_TRUE(dev.device().is_cuda());
  Tensor back = Tensor::to_host(dev.view());
  EXPECT_EQ(to_vector(back.view()), to_vector(host.view()));
}

TEST(GpuDeviceMemory, StridedDeviceSourceCopiesItsElementsOnly) {
  SPARSE_ATTN_REQUIRE_GPU();
  auto rng = make_rng();
  Tensor host = testing::random_tensor({6, 10}, DType::kF32, rng);
  Tensor dev = testing::to_device(host);
  Tensor back = Tensor::to_host(dev.view().narrow(1, 3, 4));
  EXPECT_EQ(to_vector(back.view()), to_vector(host.view().narrow(1, 3, 4)));
}

TEST(GpuDeviceMemory, StridedDeviceDestinationKeepsTheBytesAroundIt) {
  SPARSE_ATTN_REQUIRE_GPU();
  auto rng = make_rng();
  Tensor outer = testing::random_tensor({5, 9}, DType::kF16, rng);
  Tensor dev = testing::to_device(outer);
  Tensor src = testing::random_tensor({5, 4}, DType::kF16, rng);
  copy_into(dev.view().narrow(1, 2, 4), src.view());
  copy_into(outer.view().narrow(1, 2, 4), src.view());
  EXPECT_EQ(to_vector(Tensor::to_host(dev.view()).view()), to_vector(outer.view()));
}

TEST(GpuDeviceMemory, DeviceToDeviceStridedCopy) {
  SPARSE_ATTN_REQUIRE_GPU();
  auto rng = make_rng();
  Tensor host = testing::random_tensor({4, 8}, DType::kF32, rng);
  Tensor a = testing::to_device(host);
  Tensor b = testing::poisoned_device({8, 4}, DType::kF32);
  // Transposed view of b as the destination.
  TensorView bt = b.view().as_strided({4, 8}, {1, 4});
  copy_into(bt, a.view());
  Tensor back = Tensor::to_host(b.view());
  for (int i = 0; i < 4; ++i) {
    for (int j = 0; j < 8; ++j) {
      EXPECT_EQ(testing::get(back.view(), {j, i}), testing::get(host.view(), {i, j}));
    }
  }
}

TEST(GpuDeviceMemory, FailedAllocationNamesTheCallAndLocation) {
  SPARSE_ATTN_REQUIRE_GPU();
  try {
    Tensor::empty({int64_t{1} << 50}, DType::kF32, Device::cuda(0));
    FAIL() << "an allocation of 4 PiB succeeded";
  } catch (const ValueError&) {
    FAIL() << "a CUDA failure must not be reported as the caller's ValueError";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("cudaMalloc"), std::string::npos) << msg;
    EXPECT_NE(msg.find("device_memory.cpp"), std::string::npos) << msg;
    EXPECT_NE(msg.find("cudaErrorMemoryAllocation"), std::string::npos) << msg;
  }
  // The failure was reported once: the next native op launches and checks its launch cleanly.
  Tensor scores = Tensor::empty({2, 8}, DType::kF32, Device::cuda(0));
  Tensor host = Tensor::empty({2, 8}, DType::kF32);
  for (int64_t i = 0; i < host.numel(); ++i) host.data_as<float>()[i] = static_cast<float>(i);
  copy_into(scores.view(), host.view());
  Tensor ids = Tensor::empty({2, 4}, DType::kI32, Device::cuda(0));
  EXPECT_NO_THROW(qsa_topk_blocks(scores.view(), 4, ids.view()));
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

}  // namespace
}  // namespace sparse_attn
