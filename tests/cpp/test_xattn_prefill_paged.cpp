// xattention_prefill_paged on the host backends: bitwise the contiguous xattention_prefill on
// the keys and values its pages hold (shuffled page ids, page sizes that do and do not divide
// the keys, K and V as strided views of one [pages, page, Hkv, 2 D] cache, batch 2, GQA), for
// the reference and the CPU backend; and its validation.
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <random>
#include <vector>

#include "sparse_attn/errors.h"
#include "sparse_attn/xattn.h"
#include "test_util.h"
#include "test_xattn_util.h"

namespace sparse_attn {
namespace {

using testing::expect_error;
using testing::make_rng;
using testing::poison;
using testing::random_tensor;
using testing::to_vector;
using xattn_testing::PagedCache;

constexpr int64_t kB = 2, kHq = 4, kHkv = 2, kLq = 200, kD = 32;

struct Outputs {
  Tensor sums, mask, out, lse;
  Outputs(const TensorView& q, const TensorView& key) {
    const Shape shape = xattn_estimate_shape(q, key, XAttnEstimateOptions{});
    sums = Tensor::empty(shape, DType::kF32);
    mask = Tensor::empty(shape, DType::kBool);
    out = Tensor::empty(q.shape(), q.dtype());
    lse = Tensor::empty({kB, kHq, kLq}, DType::kF32);
    poison(sums);
    poison(out);
    poison(lse);
  }
};

class XAttentionPrefillPaged
    : public ::testing::TestWithParam<std::tuple<int64_t, int64_t, Backend>> {};

TEST_P(XAttentionPrefillPaged, EqualsTheContiguousPrefillOnThePagesKeys) {
  const auto [page_size, k_len, backend] = GetParam();
  auto rng = make_rng();
  const PagedCache c(kB, kHkv, kD, page_size, k_len, rng);
  const Tensor q = random_tensor({kB, kHq, kLq, kD}, DType::kBF16, rng);
  XAttnPrefillOptions o;
  o.backend = backend;
  o.threshold = 0.8;
  o.chunk_size = 256;
  Outputs paged(q.view(), c.key.view()), whole(q.view(), c.key.view());
  xattention_prefill_paged(q, c.k_cache, c.v_cache, c.table, k_len, paged.sums, paged.mask,
                           paged.out, paged.lse, o);
  xattention_prefill(q, c.key, c.value, whole.sums, whole.mask, whole.out, whole.lse, o);
  EXPECT_EQ(to_vector(paged.sums.view()), to_vector(whole.sums.view()));
  EXPECT_EQ(to_vector(paged.mask.view()), to_vector(whole.mask.view()));
  EXPECT_EQ(to_vector(paged.out.view()), to_vector(whole.out.view()));
  EXPECT_EQ(to_vector(paged.lse.view()), to_vector(whole.lse.view()));
}

INSTANTIATE_TEST_SUITE_P(
    Pages, XAttentionPrefillPaged,
    ::testing::Combine(::testing::Values(7, 100, 128), ::testing::Values(200, 450),
                       ::testing::Values(Backend::kReference, Backend::kNative)),
    [](const auto& info) {
      return "page" + std::to_string(std::get<0>(info.param)) + "_keys" +
             std::to_string(std::get<1>(info.param)) +
             (std::get<2>(info.param) == Backend::kNative ? "_cpu" : "_reference");
    });

struct PrefillPagedArgs : ::testing::Test {
  std::mt19937_64 rng = make_rng();
  PagedCache c{kB, kHkv, kD, 100, 450, rng};
  Tensor q = random_tensor({kB, kHq, kLq, kD}, DType::kBF16, rng);
  Outputs o{q.view(), c.key.view()};
  XAttnPrefillOptions po = [] {
    XAttnPrefillOptions x;
    x.backend = Backend::kReference;
    return x;
  }();
  void run(const TensorView& k_cache, const TensorView& v_cache, const TensorView& table,
           int64_t k_len) {
    xattention_prefill_paged(q, k_cache, v_cache, table, k_len, o.sums, o.mask, o.out, o.lse, po);
  }
};

TEST_F(PrefillPagedArgs, ValidArgumentsPass) {
  EXPECT_NO_THROW(run(c.k_cache, c.v_cache, c.table, 450));
}

TEST_F(PrefillPagedArgs, PageIdsOutsideTheCacheAreRejected) {
  Tensor table = Tensor::empty(c.table.shape(), DType::kI32);
  copy_into(table.view(), c.table.view());
  table.data_as<int32_t>()[1] = static_cast<int32_t>(c.k_cache.size(0));
  expect_error<ValueError>([&] { run(c.k_cache, c.v_cache, table, 450); }, "block_table");
  table.data_as<int32_t>()[1] = -1;
  expect_error<ValueError>([&] { run(c.k_cache, c.v_cache, table, 450); }, "block_table");
}

TEST_F(PrefillPagedArgs, KeyLengthIsBoundedByThePageTable) {
  expect_error<ValueError>([&] { run(c.k_cache, c.v_cache, c.table, 601); }, "k_len");
  expect_error<ValueError>([&] { run(c.k_cache, c.v_cache, c.table, -1); }, "k_len");
  // Causal: the query rows are the last Lq keys.
  expect_error<ValueError>([&] { run(c.k_cache, c.v_cache, c.table, kLq - 1); }, "k_len");
}

TEST_F(PrefillPagedArgs, CacheShapesAndTypesAreChecked) {
  expect_error<ValueError>([&] { run(c.k_cache, c.v_cache.narrow(0, 0, 2), c.table, 450); },
                           "v_cache");
  expect_error<ValueError>(
      [&] { run(c.k_cache.narrow(3, 0, 16), c.v_cache.narrow(3, 0, 16), c.table, 450); },
      "k_cache");
  Tensor f16 = Tensor::empty(c.k_cache.shape(), DType::kF16);
  expect_error<TypeError>([&] { run(f16, c.v_cache, c.table, 450); }, "k_cache");
  Tensor three_heads = Tensor::empty({c.k_cache.size(0), 100, 3, kD}, DType::kBF16);
  expect_error<ValueError>([&] { run(three_heads, three_heads, c.table, 450); }, "query");
}

TEST_F(PrefillPagedArgs, BlockTableShapeAndTypeAreChecked) {
  expect_error<ValueError>([&] { run(c.k_cache, c.v_cache, c.table.view().narrow(0, 0, 1), 450); },
                           "block_table");
  Tensor floats = Tensor::empty(c.table.shape(), DType::kF32);
  expect_error<TypeError>([&] { run(c.k_cache, c.v_cache, floats, 450); }, "block_table");
}

TEST_F(PrefillPagedArgs, OutMustNotOverlapTheCache) {
  const TensorView as_out = c.cache.view().as_strided(q.shape(), {kHq * kLq * kD, kLq * kD, kD, 1});
  expect_error<ValueError>(
      [&] {
        xattention_prefill_paged(q, c.k_cache, c.v_cache, c.table, 450, o.sums, o.mask, as_out,
                                 o.lse, po);
      },
      "out");
}

}  // namespace
}  // namespace sparse_attn
