// Native xattn_estimate on the GPU against the reference on fresh random inputs: block sums
// within 1e-5 relative (plus a small absolute floor for the near-zero sums of far blocks), every
// output element written (poisoned buffers), the mask exactly the reference selection of the
// native sums and, on these inputs, exactly the reference's own mask; strides 4 / 8 / 16, head
// dims 64 / 128 / 256, causal and not, Lq != Lk, partial stride groups, GQA, batches, strided
// views, several chunks, large score magnitudes, graph replay, and xattention_prefill natively.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "gpu_test_util.h"
#include "sparse_attn/errors.h"
#include "sparse_attn/xattn.h"
#include "test_util.h"

namespace sparse_attn {
namespace {

using testing::to_device;
using testing::to_vector;

std::vector<double> host_values(const TensorView& device_view) {
  return to_vector(Tensor::to_host(device_view).view());
}

struct EstimateCase {
  std::string name;
  int64_t batch = 1, hq = 4, hkv = 2, lq = 1024, lk = 1024, dim = 128, stride = 8;
  bool causal = true;
  DType dtype = DType::kBF16;
  int64_t chunk_size = 16384;
  double norm = 1.0;
  double threshold = 0.9;
  bool keep_sink = false;
  float range = 2.f;  // inputs uniform in [-range, range]
  // Relative tolerance of the sums. The tensor cores add a score's stride * head_dim products in
  // FP32 (the reference in FP64); that rounding is a fixed fraction of the products' magnitude,
  // and each weight exp(score) moves by the score's absolute error, so the tolerance grows with
  // the scores' scale.
  double rel_tol = 1e-5;
};

std::string case_name(const ::testing::TestParamInfo<EstimateCase>& info) {
  return info.param.name;
}

std::vector<EstimateCase> estimate_cases() {
  std::vector<EstimateCase> v;
  const auto add = [&](std::string name, auto&& edit) {
    EstimateCase c;
    c.name = std::move(name);
    edit(c);
    v.push_back(c);
  };
  add("s8_d128", [](EstimateCase&) {});
  add("s8_d128_fp16", [](EstimateCase& c) { c.dtype = DType::kF16; });
  add("s4_d64", [](EstimateCase& c) {
    c.stride = 4;
    c.dim = 64;
  });
  add("s16_d256", [](EstimateCase& c) {
    c.stride = 16;
    c.dim = 256;
  });
  add("partial_groups_q_shorter", [](EstimateCase& c) {
    c.lq = 901;
    c.lk = 2350;
  });
  add("non_causal", [](EstimateCase& c) {
    c.causal = false;
    c.lq = 700;
    c.lk = 1500;
    c.keep_sink = true;
  });
  add("many_tiles_gqa8", [](EstimateCase& c) {
    c.hq = 8;
    c.hkv = 1;
    c.lq = 3000;
    c.lk = 5000;
  });
  add("batch2_chunks", [](EstimateCase& c) {
    c.batch = 2;
    c.lq = 2000;
    c.lk = 2100;
    c.chunk_size = 256;  // eight chunks
  });
  add("large_scores", [](EstimateCase& c) {
    c.norm = 0.05;     // scores 20x larger: row maxima far apart across tiles
    c.rel_tol = 5e-5;  // 20x the scores' scale: 1.6e-5 measured on the H200
    c.lq = 1500;
    c.lk = 2500;
  });
  add("one_group", [](EstimateCase& c) {
    c.lq = 3;
    c.lk = 5;
    c.threshold = 0.5;
  });
  return v;
}

struct EstimateRun {
  Tensor q, k;            // host
  TensorView dq, dk;      // device views (possibly strided)
  Tensor dq_buf, dk_buf;  // their storage
  XAttnEstimateOptions o;
  Shape shape;
};

// Query/key on the device, as [B, L, H, D] storage seen as [B, H, L, D] when `transposed`.
EstimateRun make_run(const EstimateCase& c, bool transposed) {
  auto rng = testing::make_rng();
  EstimateRun r;
  r.q = testing::random_tensor({c.batch, c.hq, c.lq, c.dim}, c.dtype, rng, -c.range, c.range);
  r.k = testing::random_tensor({c.batch, c.hkv, c.lk, c.dim}, c.dtype, rng, -c.range, c.range);
  const auto device_view = [&](const Tensor& host, Tensor& buf) {
    if (!transposed) {
      buf = to_device(host);
      return buf.view();
    }
    const int64_t B = host.view().size(0), H = host.view().size(1), L = host.view().size(2),
                  D = host.view().size(3);
    Tensor blhd = Tensor::empty({B, L, H, D}, host.dtype());
    TensorView as_bhld = blhd.view().as_strided({B, H, L, D}, {L * H * D, D, H * D, 1});
    copy_into(as_bhld, host.view());
    buf = to_device(blhd);
    return buf.view().as_strided({B, H, L, D}, {L * H * D, D, H * D, 1});
  };
  r.dq = device_view(r.q, r.dq_buf);
  r.dk = device_view(r.k, r.dk_buf);
  r.o.stride = c.stride;
  r.o.norm = c.norm;
  r.o.causal = c.causal;
  r.o.keep_sink = c.keep_sink;
  r.o.threshold = c.threshold;
  r.o.chunk_size = c.chunk_size;
  r.shape = xattn_estimate_shape(r.q, r.k, r.o);
  return r;
}

// Sums within rel_tol of the reference's (1e-7 absolute for the near-zero ones); the mask equal
// to the reference selection of the native sums, and to the reference mask.
void expect_matches_reference(const EstimateRun& r, const Tensor& sums_d, const Tensor& mask_d,
                              double rel_tol = 1e-5) {
  XAttnEstimateOptions ro = r.o;
  ro.backend = Backend::kReference;
  Tensor sums = Tensor::empty(r.shape, DType::kF32), mask = Tensor::empty(r.shape, DType::kBool);
  xattn_estimate(r.q, r.k, sums, mask, ro);
  const std::vector<double> got = host_values(sums_d.view()), want = to_vector(sums.view());
  ASSERT_EQ(got.size(), want.size());
  int64_t bad = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    const bool ok = std::abs(got[i] - want[i]) <= rel_tol * std::abs(want[i]) + 1e-7;
    if (!ok && ++bad <= 5)
      ADD_FAILURE() << "sum " << i << ": got " << got[i] << ", want " << want[i];
  }
  EXPECT_EQ(bad, 0);

  Tensor native_sums = Tensor::to_host(sums_d.view());
  Tensor reselected = Tensor::empty(r.shape, DType::kBool);
  FindBlocksOptions fo;
  static_cast<BlockSelectOptions&>(fo) = ro;
  fo.q_len = r.q.view().size(2);
  fo.k_len = r.k.view().size(2);
  find_blocks_chunked(native_sums, reselected, fo);
  const std::vector<double> got_mask = host_values(mask_d.view());
  EXPECT_EQ(got_mask, to_vector(reselected.view())) << "the selection of the native sums";
  EXPECT_EQ(got_mask, to_vector(mask.view())) << "the reference mask";
}

class GpuXAttnEstimate : public ::testing::TestWithParam<EstimateCase> {};

TEST_P(GpuXAttnEstimate, MatchesReference) {
  SPARSE_ATTN_REQUIRE_GPU();
  const EstimateCase& c = GetParam();
  for (bool transposed : {false, true}) {
    SCOPED_TRACE(transposed ? "[B, L, H, D] storage" : "contiguous");
    EstimateRun r = make_run(c, transposed);
    Tensor sums = testing::poisoned_device(r.shape, DType::kF32);
    Tensor mask = testing::poisoned_device(r.shape, DType::kBool);
    xattn_estimate(r.dq, r.dk, sums, mask, r.o);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    expect_matches_reference(r, sums, mask, c.rel_tol);
  }
}

INSTANTIATE_TEST_SUITE_P(Forms, GpuXAttnEstimate, ::testing::ValuesIn(estimate_cases()), case_name);

TEST(GpuXAttnEstimateRuns, RerunsAreBitwiseAndChunkSizeChangesNothing) {
  SPARSE_ATTN_REQUIRE_GPU();
  EstimateCase c;
  c.lq = 2200;
  c.lk = 3000;
  EstimateRun r = make_run(c, false);
  std::vector<std::vector<double>> sums_of, masks_of;
  for (int64_t chunk : {16384, 16384, 128, 384}) {
    r.o.chunk_size = chunk;
    Tensor sums = testing::poisoned_device(r.shape, DType::kF32);
    Tensor mask = testing::poisoned_device(r.shape, DType::kBool);
    xattn_estimate(r.dq, r.dk, sums, mask, r.o);
    sums_of.push_back(host_values(sums.view()));
    masks_of.push_back(host_values(mask.view()));
  }
  for (size_t i = 1; i < sums_of.size(); ++i) {
    EXPECT_EQ(sums_of[i], sums_of[0]) << i;
    EXPECT_EQ(masks_of[i], masks_of[0]) << i;
  }
}

TEST(GpuXAttnEstimateRuns, GraphReplayReadsCurrentInputs) {
  SPARSE_ATTN_REQUIRE_GPU();
  EstimateCase c;
  c.lq = 1000;
  c.lk = 1800;
  EstimateRun r = make_run(c, false);
  Tensor sums = testing::poisoned_device(r.shape, DType::kF32);
  Tensor mask = testing::poisoned_device(r.shape, DType::kBool);
  testing::CapturedGraph graph([&](cudaStream_t s) {
    XAttnEstimateOptions o = r.o;
    o.stream = s;
    xattn_estimate(r.dq, r.dk, sums, mask, o);
  });
  ASSERT_TRUE(graph.ok());
  // New contents in the captured buffers, then a replay.
  auto rng = testing::make_rng();
  r.q = testing::random_tensor(r.q.shape(), c.dtype, rng, -2.f, 2.f);
  r.k = testing::random_tensor(r.k.shape(), c.dtype, rng, -2.f, 2.f);
  ASSERT_EQ(cudaMemcpy(r.dq_buf.data(), r.q.data(), r.q.numel() * 2, cudaMemcpyHostToDevice),
            cudaSuccess);
  ASSERT_EQ(cudaMemcpy(r.dk_buf.data(), r.k.data(), r.k.numel() * 2, cudaMemcpyHostToDevice),
            cudaSuccess);
  ASSERT_EQ(cudaMemset(sums.data(), 0xff, sums.numel() * sizeof(float)), cudaSuccess);  // NaN
  ASSERT_EQ(graph.replay(), cudaSuccess);
  expect_matches_reference(r, sums, mask);
}

TEST(GpuXAttnEstimateRuns, PrefillIsTheNativeEstimateThenBlockSparseAttention) {
  SPARSE_ATTN_REQUIRE_GPU();
  EstimateCase c;
  c.batch = 2;
  c.lq = 640;
  c.lk = 1100;
  EstimateRun r = make_run(c, false);
  auto rng = testing::make_rng();
  Tensor v = testing::random_tensor(r.k.shape(), c.dtype, rng);
  Tensor dv = to_device(v);
  XAttnPrefillOptions po;
  static_cast<XAttnEstimateOptions&>(po) = r.o;
  Tensor sums = testing::poisoned_device(r.shape, DType::kF32);
  Tensor mask = testing::poisoned_device(r.shape, DType::kBool);
  Tensor out = testing::poisoned_device(r.q.shape(), c.dtype);
  Tensor lse = testing::poisoned_device({c.batch, c.hq, c.lq}, DType::kF32);
  xattention_prefill(r.dq, r.dk, dv.view(), sums, mask, out, lse.view(), po);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  expect_matches_reference(r, sums, mask);

  // The attention step on the native mask, by the reference.
  Tensor mask_h = Tensor::to_host(mask.view());
  BlockSparseAttentionOptions ao;
  ao.backend = Backend::kReference;
  ao.head_mask_type.assign(static_cast<size_t>(c.hq), 1);
  const int64_t total_q = c.batch * c.lq, total_k = c.batch * c.lk;
  const auto rows_first = [](const Tensor& t) {  // [B, H, L, D] -> [B * L, H, D]
    const int64_t B = t.view().size(0), H = t.view().size(1), L = t.view().size(2),
                  D = t.view().size(3);
    Tensor o = Tensor::empty({B * L, H, D}, t.dtype());
    copy_into(o.view().as_strided({B, H, L, D}, {L * H * D, D, H * D, 1}), t.view());
    return o;
  };
  Tensor cu_q = testing::int32_tensor(
      {c.batch + 1}, {0, static_cast<int32_t>(c.lq), static_cast<int32_t>(total_q)});
  Tensor cu_k = testing::int32_tensor(
      {c.batch + 1}, {0, static_cast<int32_t>(c.lk), static_cast<int32_t>(total_k)});
  Tensor want = Tensor::empty({total_q, c.hq, c.dim}, c.dtype);
  block_sparse_attention(rows_first(r.q), rows_first(r.k), rows_first(v), cu_q, cu_k, mask_h.view(),
                         c.lq, c.lk, want, std::nullopt, ao);
  Tensor got = rows_first(Tensor::to_host(out.view()));
  const std::vector<double> g = to_vector(got.view()), w = to_vector(want.view());
  ASSERT_EQ(g.size(), w.size());
  int64_t bad = 0;
  for (size_t i = 0; i < w.size(); ++i) {
    if (!(std::abs(g[i] - w[i]) <= 2e-2 * std::abs(w[i]) + 2e-2) && ++bad <= 5) {
      ADD_FAILURE() << "out " << i << ": got " << g[i] << ", want " << w[i];
    }
  }
  EXPECT_EQ(bad, 0);
  for (double x : host_values(lse.view())) ASSERT_TRUE(std::isfinite(x));
}

// docs/xattention.md's chunking rule, natively: a causal query chunk [c, c + m) against keys
// [0, c + m), c a multiple of 128 and c + m one too or the prompt's end, gives bitwise the
// whole-prompt call's sums and mask rows, and its output and LSE rows within rounding.
TEST(GpuXAttnEstimateRuns, ChunkedPrefillGivesTheWholePromptsMaskRows) {
  SPARSE_ATTN_REQUIRE_GPU();
  EstimateCase c;
  c.lq = c.lk = 1000;
  EstimateRun r = make_run(c, false);
  auto rng = testing::make_rng();
  Tensor dv = to_device(testing::random_tensor(r.k.shape(), c.dtype, rng));
  XAttnPrefillOptions po;
  static_cast<XAttnEstimateOptions&>(po) = r.o;
  const auto prefill = [&](int64_t c0, int64_t end) {
    const TensorView q = r.dq.narrow(2, c0, end - c0), k = r.dk.narrow(2, 0, end),
                     v = dv.view().narrow(2, 0, end);
    const Shape shape = xattn_estimate_shape(q, k, po);
    std::vector<Tensor> o = {testing::poisoned_device(shape, DType::kF32),
                             testing::poisoned_device(shape, DType::kBool),
                             testing::poisoned_device(q.shape(), c.dtype),
                             testing::poisoned_device({1, c.hq, end - c0}, DType::kF32)};
    xattention_prefill(q, k, v, o[0], o[1], o[2], o[3].view(), po);
    return o;
  };
  const std::vector<Tensor> whole = prefill(0, 1000);
  for (const auto& [c0, end] : {std::pair<int64_t, int64_t>{384, 1000}, {128, 640}}) {
    SCOPED_TRACE("chunk [" + std::to_string(c0) + ", " + std::to_string(end) + ")");
    const std::vector<Tensor> chunk = prefill(c0, end);
    const int64_t qb0 = c0 / 128, qbs = (end - c0 + 127) / 128, kbs = (end + 127) / 128;
    for (int i = 0; i < 2; ++i) {  // sums, mask: the chunk's query blocks and its key blocks
      EXPECT_EQ(host_values(chunk[i].view()),
                host_values(whole[i].view().narrow(2, qb0, qbs).narrow(3, 0, kbs)))
          << (i == 0 ? "attn_sums" : "block_mask");
    }
    // Outputs and LSE within rounding: the attention kernel splits the keys by the call's shape
    // (fewer query tiles, more splits), so the order of its sums differs.
    for (int i = 2; i < 4; ++i) {
      const std::vector<double> got = host_values(chunk[i].view()),
                                want = host_values(whole[i].view().narrow(2, c0, end - c0));
      ASSERT_EQ(got.size(), want.size());
      int64_t bad = 0;
      for (size_t j = 0; j < want.size(); ++j) {
        const double tol = i == 2 ? 1e-2 * std::abs(want[j]) + 1e-3 : 1e-5 * std::abs(want[j]);
        if (!(std::abs(got[j] - want[j]) <= tol) && ++bad <= 3) {
          ADD_FAILURE() << (i == 2 ? "out " : "lse ") << j << ": " << got[j] << " vs " << want[j];
        }
      }
      EXPECT_EQ(bad, 0);
    }
  }
}

TEST(GpuXAttnEstimateRuns, UnsupportedGeometriesRaiseNotSupported) {
  SPARSE_ATTN_REQUIRE_GPU();
  EstimateCase c;
  c.lq = c.lk = 256;
  EstimateRun r = make_run(c, false);
  Tensor sums = testing::poisoned_device(r.shape, DType::kF32);
  Tensor mask = testing::poisoned_device(r.shape, DType::kBool);
  r.o.stride = 2;  // 64 groups a block
  testing::expect_error<NotSupportedError>([&] { xattn_estimate(r.dq, r.dk, sums, mask, r.o); },
                                           "block_size");
}

}  // namespace
}  // namespace sparse_attn
