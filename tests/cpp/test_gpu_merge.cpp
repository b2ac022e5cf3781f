// Native (CUDA) merge_attention_states against the reference run on host copies of the same
// inputs: NaN and infinity positions equal, values within the output dtype's tolerance (the
// kernel sums in FP32, the reference in double), gaps of strided outputs untouched; broadcast
// inputs; reruns and CUDA-graph replays bitwise equal; the reference backend on CUDA tensors
// (staged through the host) equal to it on host tensors. Every case skips without a GPU.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <ostream>
#include <string>
#include <vector>

#include "gpu_test_util.h"
#include "merge_cases.h"
#include "sparse_attn/merge.h"
#include "test_util.h"

namespace sparse_attn {
namespace {

using testing::all_close_or_nan;
using testing::make_rng;
using testing::merge_dtype_tag;
using testing::MergeStates;
using testing::random_merge_states;
using testing::set;
using testing::to_vector;

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kLseTol = 1e-5;

// One logical tensor held twice with one layout, in a host buffer (for the reference) and a
// device buffer (for the kernel): contiguous, or (strided) every other element of the last axis
// after an offset of 3, so that the kernel sees gaps it must neither read as data nor write.
struct Mirrored {
  Tensor host_buf, dev_buf;
  TensorView host, dev;
};

Mirrored mirror(const Tensor& values, bool strided) {
  const Shape shape = values.shape();
  Shape strides(shape.size());
  const int64_t offset = strided ? 3 : 0;
  int64_t stride = strided ? 2 : 1;
  for (int d = static_cast<int>(shape.size()) - 1; d >= 0; --d) {
    strides[d] = stride;
    stride *= std::max<int64_t>(shape[d], 1);
  }
  Mirrored m;
  m.host_buf = Tensor::empty({offset + stride}, values.dtype());
  testing::poison(m.host_buf);
  m.host = m.host_buf.view().as_strided(shape, strides, offset);
  copy_into(m.host, values);
  m.dev_buf = testing::to_device(m.host_buf);
  m.dev = m.dev_buf.view().as_strided(shape, strides, offset);
  return m;
}

Tensor poisoned(const Shape& shape, DType dtype) {
  Tensor t = Tensor::empty(shape, dtype);
  testing::poison(t);
  return t;
}

// The device buffer (gaps included) against the host one the reference wrote: NaN at the same
// places (the gaps stay poisoned, NaN rows are NaN), the rest within tolerance.
void expect_close_buffers(const Mirrored& m, double atol, double rtol, const std::string& what) {
  const Tensor native = Tensor::to_host(m.dev_buf.view());
  EXPECT_TRUE(all_close_or_nan(native, to_vector(m.host_buf), atol, rtol)) << what;
}

bool same_bytes(const Tensor& a, const Tensor& b) {
  return a.numel() == b.numel() &&
         std::memcmp(a.data(), b.data(), a.numel() * dtype_size(a.dtype())) == 0;
}

struct GpuMergeCase {
  std::string name;
  int64_t n, rows, heads, dim;
  DType partial_dtype, out_dtype;
  bool strided = false;
};

void PrintTo(const GpuMergeCase& c, std::ostream* os) { *os << c.name; }

std::vector<GpuMergeCase> gpu_cases() {
  std::vector<GpuMergeCase> cases;
  const DType dtypes[] = {DType::kF32, DType::kBF16, DType::kF16};
  for (DType pd : dtypes) {
    for (DType od : dtypes) {
      cases.push_back(
          {std::string(merge_dtype_tag(pd)) + "_to_" + merge_dtype_tag(od), 4, 37, 3, 128, pd, od});
    }
  }
  const DType bf = DType::kBF16;
  // Partial counts from one to more than a CTA has threads; head dims odd, tiny and above one
  // thread's share; grids past 65535 CTAs in one dimension.
  cases.push_back({"n1_d128", 1, 20, 8, 128, bf, bf});
  cases.push_back({"n2_d64", 2, 50, 4, 64, bf, bf});
  cases.push_back({"n64_d256", 64, 9, 2, 256, bf, DType::kF32});
  cases.push_back({"n1000_d128", 1000, 3, 2, 128, DType::kF32, DType::kF32});
  cases.push_back({"n5_d7", 5, 11, 3, 7, DType::kF16, DType::kF16});
  cases.push_back({"n3_d1", 3, 11, 3, 1, bf, bf});
  cases.push_back({"n3_d576", 3, 6, 2, 576, bf, bf});
  cases.push_back({"rows70000", 2, 70000, 1, 8, bf, bf});
  cases.push_back({"strided_n5_d128", 5, 13, 4, 128, bf, bf, true});
  cases.push_back({"strided_n2_d33_fp16_to_fp32", 2, 13, 4, 33, DType::kF16, DType::kF32, true});
  return cases;
}

class GpuMerge : public ::testing::TestWithParam<GpuMergeCase> {};

TEST_P(GpuMerge, NativeMatchesReferenceAndRerunsBitwise) {
  SPARSE_ATTN_REQUIRE_GPU();
  const GpuMergeCase& c = GetParam();
  auto rng = make_rng();
  MergeStates s = random_merge_states(c.n, c.rows, c.heads, c.dim, c.partial_dtype, rng);
  if (c.rows > 2) {  // a NaN and a +inf LSE next to finite ones
    set(s.partial_lse, {0, 1, 0}, kNaN);
    set(s.partial_lse, {c.n - 1, 2, c.heads - 1}, kInf);
  }
  const Mirrored po = mirror(s.partial_out, c.strided);
  const Mirrored pl = mirror(s.partial_lse, c.strided);
  const Mirrored out = mirror(poisoned({c.rows, c.heads, c.dim}, c.out_dtype), c.strided);
  const Mirrored lse = mirror(poisoned({c.rows, c.heads}, DType::kF32), c.strided);
  MergeOptions ref;
  ref.backend = Backend::kReference;
  merge_attention_states(po.host, pl.host, out.host, lse.host, ref);
  merge_attention_states(po.dev, pl.dev, out.dev, lse.dev);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  expect_close_buffers(out, testing::default_atol(c.out_dtype), testing::default_rtol(c.out_dtype),
                       "out");
  expect_close_buffers(lse, kLseTol, kLseTol, "lse_out");

  const Tensor first_out = Tensor::to_host(out.dev_buf.view());
  const Tensor first_lse = Tensor::to_host(lse.dev_buf.view());
  const Mirrored out2 = mirror(poisoned({c.rows, c.heads, c.dim}, c.out_dtype), c.strided);
  const Mirrored lse2 = mirror(poisoned({c.rows, c.heads}, DType::kF32), c.strided);
  merge_attention_states(po.dev, pl.dev, out2.dev, lse2.dev);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_TRUE(same_bytes(first_out, Tensor::to_host(out2.dev_buf.view())));
  EXPECT_TRUE(same_bytes(first_lse, Tensor::to_host(lse2.dev_buf.view())));
}

INSTANTIATE_TEST_SUITE_P(Cases, GpuMerge, ::testing::ValuesIn(gpu_cases()),
                         [](const auto& info) { return info.param.name; });

// Stride-0 inputs on the device: one output row for every row, one LSE for every head.
TEST(GpuMergeLayouts, BroadcastInputs) {
  SPARSE_ATTN_REQUIRE_GPU();
  auto rng = make_rng();
  const int64_t n = 3, rows = 10, heads = 4, dim = 128;
  const Tensor po_row = testing::random_tensor({n, 1, heads, dim}, DType::kBF16, rng);
  Tensor pl_head = testing::random_tensor({n, rows, 1}, DType::kF32, rng, -3.f, 3.f);
  set(pl_head, {1, 4, 0}, -kInf);
  const Tensor po_dev = testing::to_device(po_row), pl_dev = testing::to_device(pl_head);
  const Shape po_shape{n, rows, heads, dim}, po_strides{heads * dim, 0, dim, 1};
  const Shape pl_shape{n, rows, heads}, pl_strides{rows, 1, 0};
  Tensor out = poisoned({rows, heads, dim}, DType::kBF16),
         lse = poisoned({rows, heads}, DType::kF32);
  MergeOptions ref;
  ref.backend = Backend::kReference;
  merge_attention_states(po_row.view().as_strided(po_shape, po_strides),
                         pl_head.view().as_strided(pl_shape, pl_strides), out, lse.view(), ref);
  const Tensor nout = testing::poisoned_device({rows, heads, dim}, DType::kBF16);
  const Tensor nlse = testing::poisoned_device({rows, heads}, DType::kF32);
  merge_attention_states(po_dev.view().as_strided(po_shape, po_strides),
                         pl_dev.view().as_strided(pl_shape, pl_strides), nout, nlse.view());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_TRUE(all_close_or_nan(Tensor::to_host(nout), to_vector(out), 1e-2, 1e-2));
  EXPECT_TRUE(all_close_or_nan(Tensor::to_host(nlse), to_vector(lse), kLseTol, kLseTol));
}

// The reference on CUDA tensors stages them through the host: the same bits as on host tensors.
TEST(GpuMergeLayouts, ReferenceOnCudaTensorsMatchesHost) {
  SPARSE_ATTN_REQUIRE_GPU();
  auto rng = make_rng();
  const MergeStates s = random_merge_states(6, 17, 3, 96, DType::kF16, rng);
  const Mirrored po = mirror(s.partial_out, true), pl = mirror(s.partial_lse, false);
  const Mirrored out = mirror(poisoned({17, 3, 96}, DType::kBF16), true);
  const Mirrored lse = mirror(poisoned({17, 3}, DType::kF32), true);
  MergeOptions ref;
  ref.backend = Backend::kReference;
  merge_attention_states(po.host, pl.host, out.host, lse.host, ref);
  merge_attention_states(po.dev, pl.dev, out.dev, lse.dev, ref);
  EXPECT_TRUE(same_bytes(out.host_buf, Tensor::to_host(out.dev_buf.view())));
  EXPECT_TRUE(same_bytes(lse.host_buf, Tensor::to_host(lse.dev_buf.view())));
}

// Zero rows: nothing to do. Zero features: lse_out is still written, as the reference writes it.
TEST(GpuMergeLayouts, ZeroSizedAxes) {
  SPARSE_ATTN_REQUIRE_GPU();
  auto rng = make_rng();
  const Tensor po = Tensor::empty({2, 0, 3, 8}, DType::kBF16, Device::cuda(0));
  const Tensor pl = Tensor::empty({2, 0, 3}, DType::kF32, Device::cuda(0));
  const Tensor out = Tensor::empty({0, 3, 8}, DType::kBF16, Device::cuda(0));
  EXPECT_NO_THROW(merge_attention_states(po, pl, out));
  const MergeStates s = random_merge_states(2, 5, 3, 1, DType::kBF16, rng);
  const Tensor po0 = Tensor::empty({2, 5, 3, 0}, DType::kBF16, Device::cuda(0));
  const Tensor out0 = Tensor::empty({5, 3, 0}, DType::kBF16, Device::cuda(0));
  const Tensor nlse = testing::poisoned_device({5, 3}, DType::kF32);
  merge_attention_states(po0, testing::to_device(s.partial_lse), out0, nlse.view());
  Tensor out_ref = Tensor::empty({5, 3, 1}, DType::kBF16), lse_ref = poisoned({5, 3}, DType::kF32);
  MergeOptions ref;
  ref.backend = Backend::kReference;
  merge_attention_states(s.partial_out, s.partial_lse, out_ref, lse_ref.view(), ref);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_TRUE(all_close_or_nan(Tensor::to_host(nlse), to_vector(lse_ref), kLseTol, kLseTol));
}

// A graph captured from one native call on a stream of its own reads the inputs current at
// replay (nothing is allocated or staged inside the capture).
TEST(GpuMergeGraph, ReplayReadsCurrentInputs) {
  SPARSE_ATTN_REQUIRE_GPU();
  auto rng = make_rng();
  const int64_t n = 4, rows = 12, heads = 2, dim = 128;
  MergeStates s = random_merge_states(n, rows, heads, dim, DType::kBF16, rng);
  const Tensor po = testing::to_device(s.partial_out), pl = testing::to_device(s.partial_lse);
  const Tensor nout = testing::poisoned_device({rows, heads, dim}, DType::kBF16);
  const Tensor nlse = testing::poisoned_device({rows, heads}, DType::kF32);
  testing::CapturedGraph graph([&](cudaStream_t stream) {
    MergeOptions o;
    o.stream = stream;
    merge_attention_states(po, pl, nout, nlse.view(), o);
  });
  ASSERT_TRUE(graph.ok());
  for (int step = 0; step < 2; ++step) {
    s = random_merge_states(n, rows, heads, dim, DType::kBF16, rng);
    copy_into(po.view(), s.partial_out.view());
    copy_into(pl.view(), s.partial_lse.view());
    ASSERT_EQ(graph.replay(), cudaSuccess);
    Tensor out = poisoned({rows, heads, dim}, DType::kBF16),
           lse = poisoned({rows, heads}, DType::kF32);
    MergeOptions ref;
    ref.backend = Backend::kReference;
    merge_attention_states(s.partial_out, s.partial_lse, out, lse.view(), ref);
    EXPECT_TRUE(all_close_or_nan(Tensor::to_host(nout), to_vector(out), 1e-2, 1e-2)) << step;
    EXPECT_TRUE(all_close_or_nan(Tensor::to_host(nlse), to_vector(lse), kLseTol, kLseTol)) << step;
  }
}

}  // namespace
}  // namespace sparse_attn
