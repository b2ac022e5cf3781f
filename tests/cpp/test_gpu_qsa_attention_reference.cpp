// The reference backend on CUDA tensors: inputs are staged to the host and outputs copied back
// into the caller's (strided) device views, giving bitwise the result of the host call.
#include <gtest/gtest.h>

#include <cmath>

#include "gpu_test_util.h"
#include "sparse_attn/qsa.h"
#include "sparse_attn/tensor.h"
#include "test_util.h"

namespace sparse_attn {
namespace {

using testing::make_rng;
using testing::to_vector;

TEST(GpuSparseAttentionReference, DeviceTensorsMatchHostCallBitwise) {
  SPARSE_ATTN_REQUIRE_GPU();
  auto rng = make_rng();
  Tensor q = testing::random_tensor({2, 3, 4, 64}, DType::kBF16, rng);
  Tensor k = testing::random_tensor({7, 4, 2, 64}, DType::kBF16, rng);
  Tensor v = testing::random_tensor({7, 4, 2, 64}, DType::kBF16, rng);
  Tensor table = testing::int32_tensor({2, 3}, {3, -1, 0, 6, 9, 1});
  Tensor ids = testing::random_int32({2, 3, 9}, rng, -1, 12);
  Tensor gate = testing::random_tensor({2, 3, 4}, DType::kBF16, rng, -3, 3);

  SparseAttentionOptions o;
  o.backend = Backend::kReference;
  o.block_table = table.view();
  o.gate = gate.view();
  Tensor out_h = Tensor::empty({2, 3, 4, 64}, DType::kBF16);
  Tensor lse_h = Tensor::empty({2, 3, 4}, DType::kF32);
  qsa_sparse_attention(q, k, v, ids.view(), out_h, lse_h.view(), o);

  Tensor qd = testing::to_device(q), kd = testing::to_device(k), vd = testing::to_device(v);
  Tensor tabled = testing::to_device(table), idsd = testing::to_device(ids);
  Tensor gated = testing::to_device(gate);
  Tensor out_buf = testing::poisoned_device({2, 3, 4, 70}, DType::kBF16);
  TensorView out_d = out_buf.view().narrow(3, 3, 64);
  Tensor lse_d = testing::poisoned_device({2, 3, 4}, DType::kF32);
  o.block_table = tabled.view();
  o.gate = gated.view();
  qsa_sparse_attention(qd, kd, vd, idsd.view(), out_d, lse_d.view(), o);

  EXPECT_EQ(to_vector(Tensor::to_host(out_d).view()), to_vector(out_h.view()));
  const std::vector<double> lse_back = to_vector(Tensor::to_host(lse_d.view()).view());
  const std::vector<double> lse_want = to_vector(lse_h.view());
  ASSERT_EQ(lse_back.size(), lse_want.size());
  for (size_t i = 0; i < lse_want.size(); ++i) EXPECT_EQ(lse_back[i], lse_want[i]) << i;
  // The 6 columns around the device view are still poison.
  const Tensor around = Tensor::to_host(out_buf.view());
  int64_t nan = 0;
  for (double x : to_vector(around.view())) nan += std::isnan(x) ? 1 : 0;
  EXPECT_EQ(nan, 2 * 3 * 4 * 6);
}

}  // namespace
}  // namespace sparse_attn
