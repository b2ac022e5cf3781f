// merge_attention_states on both host backends (the reference, and backend native on host
// tensors: the CPU backend) against a double-precision merge written here from the definition;
// the identity "the merge of a split is attention over the union"; bitwise reruns and layout
// independence; one test per validation rule.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "merge_cases.h"
#include "sparse_attn/errors.h"
#include "sparse_attn/merge.h"
#include "sparse_attn/qsa.h"
#include "sparse_attn/tensor.h"
#include "test_util.h"

namespace sparse_attn {
namespace {

using testing::all_close;
using testing::all_close_or_nan;
using testing::expect_error;
using testing::get;
using testing::make_rng;
using testing::merge_dtype_tag;
using testing::MergeStates;
using testing::poison;
using testing::random_merge_states;
using testing::set;
using testing::to_vector;

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kLseTol = 1e-5;  // FP32 LSEs of magnitude <= ~10
constexpr Backend kHostBackends[] = {Backend::kReference, Backend::kNative};
constexpr DType kStateDtypes[] = {DType::kF32, DType::kBF16, DType::kF16};

struct Expected {
  std::vector<double> out;  // [rows, heads, dim], row-major
  std::vector<double> lse;  // [rows, heads]
};

// docs/merge.md in double, through the views' strides: NaN for a row with a NaN or +inf LSE,
// 0 / -inf for a row with no finite LSE, else the exp(lse - max)-weighted mean of the partials
// whose LSE is finite and m + log(sum of weights).
Expected expected_merge(const TensorView& partial_out, const TensorView& partial_lse) {
  const int64_t n = partial_out.size(0), rows = partial_out.size(1);
  const int64_t heads = partial_out.size(2), dim = partial_out.size(3);
  Expected e;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t h = 0; h < heads; ++h) {
      std::vector<double> lse(n);
      double m = -kInf;
      bool nan_row = false;
      for (int64_t i = 0; i < n; ++i) {
        lse[i] = get(partial_lse, {i, r, h});
        nan_row |= std::isnan(lse[i]) || lse[i] == kInf;
        if (!std::isnan(lse[i])) m = std::max(m, lse[i]);
      }
      if (nan_row || m == -kInf) {
        e.out.insert(e.out.end(), dim, nan_row ? kNaN : 0.0);
        e.lse.push_back(nan_row ? kNaN : -kInf);
        continue;
      }
      std::vector<double> acc(dim, 0.0);
      double z = 0;
      for (int64_t i = 0; i < n; ++i) {
        if (lse[i] == -kInf) continue;
        const double w = std::exp(lse[i] - m);
        z += w;
        for (int64_t d = 0; d < dim; ++d) acc[d] += w * get(partial_out, {i, r, h, d});
      }
      for (double a : acc) e.out.push_back(a / z);
      e.lse.push_back(m + std::log(z));
    }
  }
  return e;
}

struct Merged {
  Tensor out, lse;
};

// Runs the merge into fresh poisoned contiguous outputs.
Merged run_merge(const TensorView& partial_out, const TensorView& partial_lse, DType out_dtype,
                 Backend backend) {
  Merged m{Tensor::empty(merge_attention_states_shape(partial_out), out_dtype),
           Tensor::empty({partial_out.size(1), partial_out.size(2)}, DType::kF32)};
  poison(m.out);
  poison(m.lse);
  MergeOptions o;
  o.backend = backend;
  merge_attention_states(partial_out, partial_lse, m.out, m.lse.view(), o);
  return m;
}

// Every element of both views has the same value (NaN payloads aside: doubles of the stored
// values, whose conversion is exact).
bool same_values(const TensorView& a, const TensorView& b) {
  const std::vector<double> x = to_vector(a), y = to_vector(b);
  return x.size() == y.size() && std::memcmp(x.data(), y.data(), x.size() * sizeof(double)) == 0;
}

void expect_matches(const Merged& m, const Expected& e, DType out_dtype, const std::string& what) {
  EXPECT_TRUE(all_close_or_nan(m.out, e.out, testing::default_atol(out_dtype),
                               testing::default_rtol(out_dtype)))
      << what;
  EXPECT_TRUE(all_close_or_nan(m.lse, e.lse, kLseTol, kLseTol)) << what;
}

TEST(MergeShape, IsRowsHeadsDim) {
  Tensor po = Tensor::empty({3, 5, 2, 7}, DType::kBF16);
  EXPECT_EQ(merge_attention_states_shape(po), (Shape{5, 2, 7}));
  Tensor flat = Tensor::empty({3, 10, 7}, DType::kBF16);
  expect_error<ValueError>([&] { merge_attention_states_shape(flat); }, "partial_out");
}

// N partials x partial dtype x out dtype x backend.
using RandomParam = std::tuple<int64_t, DType, DType, Backend>;
class MergeRandom : public ::testing::TestWithParam<RandomParam> {};

TEST_P(MergeRandom, MatchesTheDefinition) {
  const auto [n, partial_dtype, out_dtype, backend] = GetParam();
  auto rng = make_rng();
  const MergeStates s = random_merge_states(n, 9, 3, 40, partial_dtype, rng);
  const Merged m = run_merge(s.partial_out, s.partial_lse, out_dtype, backend);
  expect_matches(m, expected_merge(s.partial_out, s.partial_lse), out_dtype, "");
  // Row 0 is empty in every partial.
  for (int64_t h = 0; h < 3; ++h) {
    EXPECT_EQ(get(m.lse, {0, h}), -kInf);
    for (int64_t d = 0; d < 40; ++d) EXPECT_EQ(get(m.out, {0, h, d}), 0.0);
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, MergeRandom,
                         ::testing::Combine(::testing::Values<int64_t>(1, 2, 5, 64),
                                            ::testing::ValuesIn(kStateDtypes),
                                            ::testing::ValuesIn(kStateDtypes),
                                            ::testing::ValuesIn(kHostBackends)),
                         [](const auto& info) {
                           return "n" + std::to_string(std::get<0>(info.param)) + "_" +
                                  merge_dtype_tag(std::get<1>(info.param)) + "_to_" +
                                  merge_dtype_tag(std::get<2>(info.param)) + "_" +
                                  backend_name(std::get<3>(info.param));
                         });

// Inputs as offset, permuted and strided views (partial_out stored [rows, N, heads, 2 dim + 1],
// every other feature), broadcast views (one LSE for all heads; one output row for all rows),
// and outputs inside larger poisoned buffers, whose gaps must stay poisoned.
TEST(MergeLayouts, StridedAndBroadcastInputsStridedOutputs) {
  auto rng = make_rng();
  const int64_t n = 4, rows = 5, heads = 3, dim = 16, pitch = 2 * dim + 1;
  Tensor po_buf = Tensor::empty({rows * n * heads * pitch + 1}, DType::kBF16);
  poison(po_buf);
  const TensorView po_strided = po_buf.view().as_strided(
      {n, rows, heads, dim}, {heads * pitch, n * heads * pitch, pitch, 2}, 1);
  copy_into(po_strided, testing::random_tensor({n, rows, heads, dim}, DType::kBF16, rng));
  Tensor po_row = testing::random_tensor({n, 1, heads, dim}, DType::kBF16, rng);
  const TensorView po_broadcast =
      po_row.view().as_strided({n, rows, heads, dim}, {heads * dim, 0, dim, 1});
  Tensor pl_head = testing::random_tensor({n, rows, 1}, DType::kF32, rng, -3.f, 3.f);
  set(pl_head, {1, 2, 0}, -kInf);
  const TensorView pl_broadcast = pl_head.view().as_strided({n, rows, heads}, {rows, 1, 0});

  for (const TensorView& po : {po_strided, po_broadcast}) {
    const Expected e = expected_merge(po, pl_broadcast);
    for (Backend backend : kHostBackends) {
      for (DType out_dtype : kStateDtypes) {
        const int64_t out_pitch = 2 * dim + 3;
        Tensor out_buf = Tensor::empty({rows * heads * out_pitch}, out_dtype);
        Tensor lse_buf = Tensor::empty({heads * rows + 2}, DType::kF32);
        poison(out_buf);
        poison(lse_buf);
        // out: every other feature; lse_out: transposed (heads outermost), offset 1.
        const TensorView out =
            out_buf.view().as_strided({rows, heads, dim}, {heads * out_pitch, out_pitch, 2}, 1);
        const TensorView lse = lse_buf.view().as_strided({rows, heads}, {1, rows}, 1);
        MergeOptions o;
        o.backend = backend;
        merge_attention_states(po, pl_broadcast, out, lse, o);
        const std::string what = std::string(backend_name(backend)) + " " +
                                 merge_dtype_tag(out_dtype) +
                                 (po.stride(1) == 0 ? " broadcast" : " strided");
        EXPECT_TRUE(all_close(out, e.out, testing::default_atol(out_dtype),
                              testing::default_rtol(out_dtype)))
            << what;
        EXPECT_TRUE(all_close(lse, e.lse, kLseTol, kLseTol)) << what;
        // Nothing outside the views was written: exactly their elements are no longer NaN.
        int64_t out_written = 0, lse_written = 0;
        for (double x : to_vector(out_buf)) out_written += !std::isnan(x);
        for (double x : to_vector(lse_buf)) lse_written += !std::isnan(x);
        EXPECT_EQ(out_written, out.numel()) << what;
        EXPECT_EQ(lse_written, lse.numel()) << what;
      }
    }
  }
}

TEST(MergeEdgeCases, AllEmptyRowsGiveExactlyZeroAndMinusInf) {
  auto rng = make_rng();
  MergeStates s = random_merge_states(3, 4, 2, 8, DType::kF16, rng);
  for (int64_t i = 0; i < 3; ++i) {
    for (int64_t h = 0; h < 2; ++h) {
      set(s.partial_lse, {i, 2, h}, -kInf);
      set(s.partial_lse, {i, 3, h}, -kInf);
      set(s.partial_out, {i, 3, h, 5}, kInf);  // garbage of any kind stays unread
    }
  }
  const Expected e = expected_merge(s.partial_out, s.partial_lse);
  for (Backend backend : kHostBackends) {
    for (DType out_dtype : kStateDtypes) {
      const Merged m = run_merge(s.partial_out, s.partial_lse, out_dtype, backend);
      const std::string what =
          std::string(backend_name(backend)) + " " + merge_dtype_tag(out_dtype);
      expect_matches(m, e, out_dtype, what);
      for (int64_t r : {0, 2, 3}) {
        for (int64_t h = 0; h < 2; ++h) {
          EXPECT_EQ(get(m.lse, {r, h}), -kInf) << what;
          for (int64_t d = 0; d < 8; ++d) EXPECT_EQ(get(m.out, {r, h, d}), 0.0) << what;
        }
      }
    }
  }
}

// An empty partial (LSE -inf) is not read: the merge equals, bit for bit, the merge without it,
// whatever its output holds.
TEST(MergeEdgeCases, EmptyPartialWithGarbageOutputIsIgnored) {
  auto rng = make_rng();
  const int64_t rows = 6, heads = 2, dim = 12;
  Tensor po = testing::random_tensor({3, rows, heads, dim}, DType::kBF16, rng);
  Tensor pl = testing::random_tensor({3, rows, heads}, DType::kF32, rng, -2.f, 2.f);
  const double garbage[] = {kNaN, kInf, -kInf, 1e30};
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t h = 0; h < heads; ++h) {
      set(pl, {1, r, h}, -kInf);
      for (int64_t d = 0; d < dim; ++d) set(po, {1, r, h, d}, garbage[(r + d) % 4]);
    }
  }
  // Partials 0 and 2 alone.
  Tensor po2 = Tensor::empty({2, rows, heads, dim}, DType::kBF16);
  Tensor pl2 = Tensor::empty({2, rows, heads}, DType::kF32);
  for (int64_t j = 0; j < 2; ++j) {
    copy_into(po2.view().select(0, j), po.view().select(0, 2 * j));
    copy_into(pl2.view().select(0, j), pl.view().select(0, 2 * j));
  }
  const Expected e = expected_merge(po, pl);
  for (Backend backend : kHostBackends) {
    for (DType out_dtype : kStateDtypes) {
      const Merged m = run_merge(po, pl, out_dtype, backend);
      const Merged without = run_merge(po2, pl2, out_dtype, backend);
      const std::string what =
          std::string(backend_name(backend)) + " " + merge_dtype_tag(out_dtype);
      EXPECT_TRUE(all_close(m.out, e.out, testing::default_atol(out_dtype),
                            testing::default_rtol(out_dtype)))
          << what;
      EXPECT_TRUE(same_values(m.out, without.out)) << what;
      EXPECT_TRUE(same_values(m.lse, without.lse)) << what;
    }
  }
}

TEST(MergeEdgeCases, NanOrPlusInfLseMakesTheRowNan) {
  auto rng = make_rng();
  MergeStates s = random_merge_states(4, 6, 2, 8, DType::kBF16, rng);
  set(s.partial_lse, {2, 1, 0}, kNaN);  // next to finite LSEs
  set(s.partial_lse, {0, 2, 1}, kInf);
  for (int64_t i = 0; i < 4; ++i) set(s.partial_lse, {i, 3, 0}, i == 3 ? kNaN : -kInf);
  for (int64_t i = 0; i < 4; ++i) set(s.partial_lse, {i, 4, 1}, i == 0 ? -kInf : kInf);
  const Expected e = expected_merge(s.partial_out, s.partial_lse);
  for (Backend backend : kHostBackends) {
    for (DType out_dtype : kStateDtypes) {
      const Merged m = run_merge(s.partial_out, s.partial_lse, out_dtype, backend);
      const std::string what =
          std::string(backend_name(backend)) + " " + merge_dtype_tag(out_dtype);
      expect_matches(m, e, out_dtype, what);
      for (const auto& [r, h] : {std::pair{1, 0}, {2, 1}, {3, 0}, {4, 1}}) {
        EXPECT_TRUE(std::isnan(get(m.lse, {r, h}))) << what;
        for (int64_t d = 0; d < 8; ++d) EXPECT_TRUE(std::isnan(get(m.out, {r, h, d}))) << what;
      }
    }
  }
}

TEST(MergeEdgeCases, ZeroSizedAxes) {
  auto rng = make_rng();
  for (Backend backend : kHostBackends) {
    MergeOptions o;
    o.backend = backend;
    for (const Shape& shape : {Shape{2, 0, 3, 4}, Shape{2, 3, 0, 4}}) {
      Tensor po = Tensor::empty(shape, DType::kF32);
      Tensor pl = Tensor::empty({shape[0], shape[1], shape[2]}, DType::kF32);
      Tensor out = Tensor::empty({shape[1], shape[2], shape[3]}, DType::kF32);
      Tensor lse = Tensor::empty({shape[1], shape[2]}, DType::kF32);
      EXPECT_NO_THROW(merge_attention_states(po, pl, out, lse.view(), o));
    }
    // No features: the LSE of the union is still defined, and written.
    const MergeStates s = random_merge_states(3, 4, 2, 1, DType::kBF16, rng);
    Tensor po = Tensor::empty({3, 4, 2, 0}, DType::kBF16);
    Tensor out = Tensor::empty({4, 2, 0}, DType::kBF16);
    EXPECT_NO_THROW(merge_attention_states(po, s.partial_lse, out, std::nullopt, o));
    Tensor lse = Tensor::empty({4, 2}, DType::kF32);
    poison(lse);
    merge_attention_states(po, s.partial_lse, out, lse.view(), o);
    EXPECT_TRUE(all_close(lse, expected_merge(s.partial_out, s.partial_lse).lse, kLseTol, kLseTol))
        << backend_name(backend);
  }
}

TEST(MergeDeterminism, RerunsAreBitwiseEqual) {
  auto rng = make_rng();
  for (DType dtype : kStateDtypes) {
    const MergeStates s = random_merge_states(7, 64, 4, 128, dtype, rng);
    for (Backend backend : kHostBackends) {
      const Merged a = run_merge(s.partial_out, s.partial_lse, dtype, backend);
      const Merged b = run_merge(s.partial_out, s.partial_lse, dtype, backend);
      EXPECT_TRUE(same_values(a.out, b.out)) << backend_name(backend);
      EXPECT_TRUE(same_values(a.lse, b.lse)) << backend_name(backend);
    }
  }
}

// The same logical states stored three ways (contiguous; heads outermost; every third feature
// after an offset) give the same bits, into contiguous and strided outputs alike.
TEST(MergeDeterminism, ResultDoesNotDependOnMemoryLayout) {
  auto rng = make_rng();
  const int64_t n = 6, rows = 33, heads = 4, dim = 64;
  const MergeStates s = random_merge_states(n, rows, heads, dim, DType::kF16, rng);
  Tensor po_heads = Tensor::empty({heads, n, rows, dim}, DType::kF16);
  Tensor pl_heads = Tensor::empty({heads, rows, n}, DType::kF32);
  Tensor po_sparse = Tensor::empty({n * rows * heads * dim * 3 + 5}, DType::kF16);
  const TensorView po_views[] = {
      s.partial_out,
      po_heads.view().as_strided({n, rows, heads, dim}, {rows * dim, dim, n * rows * dim, 1}),
      po_sparse.view().as_strided({n, rows, heads, dim},
                                  {rows * heads * dim * 3, heads * dim * 3, dim * 3, 3}, 5)};
  const TensorView pl_views[] = {
      s.partial_lse, pl_heads.view().as_strided({n, rows, heads}, {1, n, rows * n}), s.partial_lse};
  for (int k = 1; k < 3; ++k) copy_into(po_views[k], s.partial_out);
  copy_into(pl_views[1], s.partial_lse);
  for (Backend backend : kHostBackends) {
    const Merged first = run_merge(po_views[0], pl_views[0], DType::kBF16, backend);
    for (int k = 0; k < 3; ++k) {
      Tensor out_buf = Tensor::empty({rows * heads * dim * 2}, DType::kBF16);
      const TensorView out =
          out_buf.view().as_strided({rows, heads, dim}, {1, rows, rows * heads * 2});
      Tensor lse = Tensor::empty({rows, heads}, DType::kF32);
      MergeOptions o;
      o.backend = backend;
      merge_attention_states(po_views[k], pl_views[k], out, lse.view(), o);
      EXPECT_TRUE(same_values(out, first.out)) << backend_name(backend) << " layout " << k;
      EXPECT_TRUE(same_values(lse, first.lse)) << backend_name(backend) << " layout " << k;
    }
  }
}

// What SplitKV and context parallelism rely on: attention over a selection split into disjoint
// parts, merged, is attention over the whole selection. qsa_sparse_attention's reference (physical
// ids) computes the three parts and the whole; some rows leave a part, or everything, empty.
TEST(MergeIdentity, MergeOfASplitEqualsAttentionOverTheUnion) {
  auto rng = make_rng();
  const int64_t rows = 7, hq = 4, hkv = 2, d = 32, total = 40, width = 15, parts = 3;
  Tensor q = testing::random_tensor({rows, hq, d}, DType::kBF16, rng, -2.f, 2.f);
  Tensor k = testing::random_tensor({total, hkv, d}, DType::kBF16, rng, -2.f, 2.f);
  Tensor v = testing::random_tensor({total, hkv, d}, DType::kBF16, rng);
  std::vector<int32_t> ids(rows * width);
  std::uniform_int_distribution<int32_t> id(-3, total + 2);  // some masked (< 0, >= total)
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < width; ++j) {
      const bool part1_empty = r == 3 && j / (width / parts) == 1;
      ids[r * width + j] = r == 5 || part1_empty ? -1 : id(rng);
    }
  }
  SparseAttentionOptions o;
  o.backend = Backend::kReference;
  o.scale = 0.2;
  auto attend = [&](const std::vector<int32_t>& sel, const TensorView& out, const TensorView& lse) {
    Tensor t = testing::int32_tensor({rows, width}, sel);
    SparseAttentionOptions call = o;
    call.selected_kv_indices = t.view();
    qsa_sparse_attention(q, k, v, std::nullopt, out, lse, call);
  };
  Tensor whole_out = Tensor::empty({rows, hq, d}, DType::kBF16);
  Tensor whole_lse = Tensor::empty({rows, hq}, DType::kF32);
  attend(ids, whole_out, whole_lse);
  // Part p keeps columns [p w / 3, (p + 1) w / 3) of each row, -1 elsewhere.
  Tensor po = Tensor::empty({parts, rows, hq, d}, DType::kBF16);
  Tensor pl = Tensor::empty({parts, rows, hq}, DType::kF32);
  poison(po);
  for (int64_t p = 0; p < parts; ++p) {
    std::vector<int32_t> sel(ids.size(), -1);
    for (size_t i = 0; i < ids.size(); ++i) {
      if (static_cast<int64_t>(i) % width / (width / parts) == p) sel[i] = ids[i];
    }
    attend(sel, po.view().select(0, p), pl.view().select(0, p));
  }
  ASSERT_EQ(get(pl, {1, 3, 0}), -kInf);  // the empty part of row 3
  for (Backend backend : kHostBackends) {
    for (DType out_dtype : {DType::kBF16, DType::kF32}) {
      const Merged m = run_merge(po, pl, out_dtype, backend);
      const std::string what =
          std::string(backend_name(backend)) + " " + merge_dtype_tag(out_dtype);
      // Both sides round to bf16 once (the partials, the whole call): within two roundings.
      EXPECT_TRUE(all_close(m.out, to_vector(whole_out), 2e-2, 2e-2)) << what;
      EXPECT_TRUE(all_close(m.lse, to_vector(whole_lse), 1e-4, 1e-4)) << what;
    }
  }
}

// ---------------------------------------------------------------------------------------
// Validation: one test per rule, each error naming its argument.
// ---------------------------------------------------------------------------------------

// A valid call; each test breaks one argument.
struct MergeCall {
  Tensor po = Tensor::empty({2, 3, 4, 5}, DType::kF32);
  Tensor pl = Tensor::empty({2, 3, 4}, DType::kF32);
  Tensor out_t = Tensor::empty({3, 4, 5}, DType::kBF16);
  Tensor lse_t = Tensor::empty({3, 4}, DType::kF32);
  TensorView partial_out = po, partial_lse = pl, out = out_t;
  std::optional<TensorView> lse_out = lse_t.view();

  MergeCall() {
    for (int64_t i = 0; i < po.numel(); ++i) po.data_as<float>()[i] = 0.5f;
    for (int64_t i = 0; i < pl.numel(); ++i) pl.data_as<float>()[i] = 0.f;
  }
  void invoke() const { merge_attention_states(partial_out, partial_lse, out, lse_out); }
};

TensorView on_cuda(const TensorView& t) {
  return TensorView(t.data(), t.dtype(), Device::cuda(0), t.shape(),
                    Shape(t.strides(), t.strides() + t.dim()));
}

TEST(MergeValidation, ValidCallRuns) { EXPECT_NO_THROW(MergeCall().invoke()); }

TEST(MergeValidation, PartialOutDtype) {
  MergeCall c;
  Tensor t = Tensor::empty({2, 3, 4, 5}, DType::kI32);
  c.partial_out = t;
  expect_error<TypeError>([&] { c.invoke(); }, "partial_out");
}

TEST(MergeValidation, PartialOutRank) {
  MergeCall c;
  c.partial_out = c.po.view().as_strided({2, 12, 5}, {60, 5, 1});
  expect_error<ValueError>([&] { c.invoke(); }, "partial_out");
}

TEST(MergeValidation, PartialOutNeedsAPartial) {
  MergeCall c;
  c.partial_out = c.po.view().narrow(0, 0, 0);
  c.partial_lse = c.pl.view().narrow(0, 0, 0);
  expect_error<ValueError>([&] { c.invoke(); }, "partial_out");
}

TEST(MergeValidation, PartialOutData) {
  MergeCall c;
  c.partial_out = TensorView(nullptr, DType::kF32, Device::cpu(), {2, 3, 4, 5});
  expect_error<ValueError>([&] { c.invoke(); }, "partial_out");
}

TEST(MergeValidation, PartialLseDtype) {
  MergeCall c;
  Tensor t = Tensor::empty({2, 3, 4}, DType::kBF16);
  c.partial_lse = t;
  expect_error<TypeError>([&] { c.invoke(); }, "partial_lse");
}

TEST(MergeValidation, PartialLseShape) {
  for (const Shape& shape : {Shape{1, 3, 4}, Shape{2, 4, 4}, Shape{2, 3, 3}, Shape{2, 12}}) {
    MergeCall c;
    Tensor t = Tensor::empty(shape, DType::kF32);
    c.partial_lse = t;
    expect_error<ValueError>([&] { c.invoke(); }, "partial_lse");
  }
}

TEST(MergeValidation, PartialLseDevice) {
  MergeCall c;
  c.partial_lse = on_cuda(c.pl);
  expect_error<ValueError>([&] { c.invoke(); }, "partial_lse");
}

TEST(MergeValidation, PartialLseData) {
  MergeCall c;
  c.partial_lse = TensorView(nullptr, DType::kF32, Device::cpu(), {2, 3, 4});
  expect_error<ValueError>([&] { c.invoke(); }, "partial_lse");
}

// The rules both outputs follow, one test each per output.
enum class OutputRule {
  kDtype,
  kShape,
  kDevice,
  kBroadcast,
  kOverlappingElements,
  kData,
  kAliasesPartialOut,
  kAliasesPartialLse
};

const char* rule_name(OutputRule r) {
  switch (r) {
    case OutputRule::kDtype:
      return "dtype";
    case OutputRule::kShape:
      return "shape";
    case OutputRule::kDevice:
      return "device";
    case OutputRule::kBroadcast:
      return "broadcast";
    case OutputRule::kOverlappingElements:
      return "overlapping_elements";
    case OutputRule::kData:
      return "data";
    case OutputRule::kAliasesPartialOut:
      return "aliases_partial_out";
    default:
      return "aliases_partial_lse";
  }
}

class MergeOutputValidation : public ::testing::TestWithParam<std::tuple<std::string, OutputRule>> {
};

TEST_P(MergeOutputValidation, ErrorNamesTheOutput) {
  const auto& [name, rule] = GetParam();
  MergeCall c;
  const TensorView good = name == "out" ? c.out : *c.lse_out;
  Shape strides(good.strides(), good.strides() + good.dim());
  Shape bigger = good.shape();
  ++bigger.back();
  std::vector<float> elsewhere(128);
  Tensor wrong_dtype = Tensor::empty(good.shape(), name == "out" ? DType::kI32 : DType::kBF16);
  TensorView bad;
  switch (rule) {
    case OutputRule::kDtype:
      bad = wrong_dtype;
      break;
    case OutputRule::kShape:
      bad = TensorView(elsewhere.data(), good.dtype(), Device::cpu(), bigger);
      break;
    case OutputRule::kDevice:
      bad = on_cuda(good);
      break;
    case OutputRule::kBroadcast:
      strides[0] = 0;
      bad = good.as_strided(good.shape(), strides);
      break;
    case OutputRule::kOverlappingElements:  // positive strides, the first axis a step of one
      strides[0] = 1;
      bad = good.as_strided(good.shape(), strides);
      break;
    case OutputRule::kData:
      bad = TensorView(nullptr, good.dtype(), Device::cpu(), good.shape());
      break;
    case OutputRule::kAliasesPartialOut:
      bad = TensorView(c.po.data(), good.dtype(), Device::cpu(), good.shape());
      break;
    case OutputRule::kAliasesPartialLse:
      bad = TensorView(c.pl.data(), good.dtype(), Device::cpu(), good.shape());
      break;
  }
  if (name == "out") {
    c.out = bad;
  } else {
    c.lse_out = bad;
  }
  if (rule == OutputRule::kDtype) {
    expect_error<TypeError>([&] { c.invoke(); }, name);
  } else {
    expect_error<ValueError>([&] { c.invoke(); }, name);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Rules, MergeOutputValidation,
    ::testing::Combine(::testing::Values("out", "lse_out"),
                       ::testing::Values(OutputRule::kDtype, OutputRule::kShape,
                                         OutputRule::kDevice, OutputRule::kBroadcast,
                                         OutputRule::kOverlappingElements, OutputRule::kData,
                                         OutputRule::kAliasesPartialOut,
                                         OutputRule::kAliasesPartialLse)),
    [](const auto& info) {
      return std::get<0>(info.param) + "_" + rule_name(std::get<1>(info.param));
    });

TEST(MergeValidation, LseOutOverlapsOut) {
  MergeCall c;
  Tensor t = Tensor::empty({3, 4, 5}, DType::kF32);
  c.out = t;
  c.lse_out = t.view().select(2, 0);
  expect_error<ValueError>([&] { c.invoke(); }, "lse_out");
}

// A missing output (api/check.h) is reported after every other argument is checked.
TEST(MergeValidation, MissingOutIsReportedLast) {
  MergeCall c;
  c.out = TensorView();
  expect_error<ValueError>([&] { c.invoke(); }, "out");
  Tensor bad_lse = Tensor::empty({3, 4}, DType::kBF16);
  c.lse_out = bad_lse.view();
  expect_error<TypeError>([&] { c.invoke(); }, "lse_out");
  c.lse_out = TensorView();
  c.out = c.out_t;
  expect_error<ValueError>([&] { c.invoke(); }, "lse_out");
}

TEST(MergeValidation, NativeCudaTensorsNeedACudaBuild) {
#ifdef SPARSE_ATTN_TEST_HAS_CUDA
  GTEST_SKIP() << "the views are host memory labelled cuda:0; a CUDA build would launch on them";
#else
  MergeCall c;
  c.partial_out = on_cuda(c.po);
  c.partial_lse = on_cuda(c.pl);
  c.out = on_cuda(c.out_t);
  c.lse_out = on_cuda(c.lse_t);
  expect_error<NotSupportedError>([&] { c.invoke(); }, "merge_attention_states");
#endif
}

}  // namespace
}  // namespace sparse_attn
