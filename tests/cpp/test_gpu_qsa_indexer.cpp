// Native (CUDA) QSA indexer kernels against double-precision expectations computed here and
// against the reference backend run on the same CUDA tensors: fresh random inputs, outputs
// poisoned first, -inf positions exact. Also CUDA graph capture and replay with changed
// metadata. Every case skips cleanly without a GPU.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <numeric>
#include <optional>
#include <string>
#include <vector>

#include "gpu_test_util.h"
#include "sparse_attn/qsa.h"
#include "test_util.h"

namespace sparse_attn {
namespace {

using testing::all_close;
using testing::int32_tensor;
using testing::make_rng;
using testing::random_int32;
using testing::random_tensor;
using testing::to_device;
using testing::to_vector;

constexpr int64_t H = 4, D = 128;
constexpr double kInf = std::numeric_limits<double>::infinity();
// FP32 tensor-core accumulation of exact 16-bit products against exact double sums.
constexpr double kAtol = 1e-4, kRtol = 1e-4;

// A query row's 4 x 128 features and a key's 128, as doubles, for the expectation.
struct Flat {
  std::vector<double> v;
  explicit Flat(const Tensor& t) : v(to_vector(t.view())) {}
  const double* at(int64_t offset) const { return v.data() + offset; }
};

// scale * sum_h max(0, q_h . k) over flat row-major data.
double score(const double* q, const double* k, double scale) {
  double total = 0;
  for (int h = 0; h < H; ++h) {
    double dot = 0;
    for (int d = 0; d < D; ++d) dot += q[h * D + d] * k[d];
    total += std::max(dot, 0.0);
  }
  return scale * total;
}

// Runs `call` on a poisoned device output of `shape` and returns its host copy.
Tensor run_native(const Shape& shape, const std::function<void(const TensorView&)>& call) {
  Tensor out = testing::poisoned_device(shape, DType::kF32);
  call(out.view());
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  return Tensor::to_host(out.view());
}

// The native result must match the expectation, and the reference backend on the same CUDA
// inputs must agree with it.
void expect_matches(const Tensor& native, const std::vector<double>& expected,
                    const Tensor& reference) {
  EXPECT_TRUE(all_close(native.view(), expected, kAtol, kRtol)) << "native vs double";
  EXPECT_TRUE(all_close(native.view(), to_vector(reference.view()), kAtol, kRtol))
      << "native vs reference backend";
}

// The query's element type and the keys' (the query's, or FP8 e4m3, read unscaled).
struct Elements {
  DType q;
  bool fp8_keys;
  // Random keys of `shape`: FP8 codes of magnitude <= 1 (every finite code that small, zeros
  // and subnormals included), or uniform 16-bit values.
  Tensor keys(const Shape& shape, std::mt19937_64& rng) const {
    return fp8_keys ? testing::random_fp8(shape, rng, 1.f) : random_tensor(shape, q, rng);
  }
};

const std::vector<Elements> kElements{
    {DType::kBF16, false}, {DType::kF16, false}, {DType::kBF16, true}, {DType::kF16, true}};

std::string elements_name(const Elements& e) {
  return std::string(e.q == DType::kBF16 ? "bf16" : "fp16") + (e.fp8_keys ? "_fp8keys" : "");
}

class GpuIndexer : public ::testing::TestWithParam<Elements> {};

// ---------------------------------------------------------------------------------------
// qsa_mqa_prefill
// ---------------------------------------------------------------------------------------

std::vector<double> prefill_expected(const Tensor& q, const Tensor& k, const Tensor& starts,
                                     const Tensor& ends, double scale) {
  const Flat fq(q), fk(k);
  const int64_t rows = q.shape()[0], keys = k.shape()[0];
  std::vector<double> out;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t s = starts.data_as<int32_t>()[r], e = ends.data_as<int32_t>()[r];
    for (int64_t j = 0; j < keys; ++j)
      out.push_back(j >= s && j < e ? score(fq.at(r * H * D), fk.at(j * D), scale) : -kInf);
  }
  return out;
}

void check_prefill(Elements e, int64_t rows, int64_t keys, const Tensor& starts, const Tensor& ends,
                   std::optional<double> scale = std::nullopt) {
  auto rng = make_rng();
  Tensor q = random_tensor({rows, H, D}, e.q, rng);
  Tensor k = e.keys({keys, D}, rng);
  Tensor dq = to_device(q), dk = to_device(k), ds = to_device(starts), de = to_device(ends);
  MqaScoreOptions o;
  o.scale = scale;
  Tensor native = run_native(
      {rows, keys}, [&](const TensorView& out) { qsa_mqa_prefill(dq, dk, ds, de, out, o); });
  o.backend = Backend::kReference;
  Tensor reference = run_native(
      {rows, keys}, [&](const TensorView& out) { qsa_mqa_prefill(dq, dk, ds, de, out, o); });
  expect_matches(native,
                 prefill_expected(q, k, starts, ends, scale.value_or(1.0 / std::sqrt(128.0))),
                 reference);
}

TEST_P(GpuIndexer, PrefillRandomIntervalsIrregularShape) {
  SPARSE_ATTN_REQUIRE_GPU();
  auto rng = make_rng();
  const int64_t rows = 301, keys = 203;
  // Starts below 0 and ends past the keys are clamped; start >= end rows are all -inf.
  Tensor starts = random_int32({rows}, rng, -5, 150);
  Tensor ends = random_int32({rows}, rng, 0, 230);
  check_prefill(GetParam(), rows, keys, starts, ends, 0.3);
}

TEST_P(GpuIndexer, PrefillCausalSkipsMaskedTiles) {
  SPARSE_ATTN_REQUIRE_GPU();
  const int64_t rows = 1100, keys = rows / 4;
  std::vector<int32_t> s(rows, 0), e(rows);
  for (int64_t r = 0; r < rows; ++r) e[r] = static_cast<int32_t>((r + 1) / 4);
  check_prefill(GetParam(), rows, keys, int32_tensor({rows}, s), int32_tensor({rows}, e));
}

TEST(GpuIndexerPrefill, SlidingWindowRowsAndSingleKey) {
  SPARSE_ATTN_REQUIRE_GPU();
  const int64_t rows = 260, keys = 700;
  std::vector<int32_t> s(rows), e(rows);
  for (int64_t r = 0; r < rows; ++r) {
    s[r] = static_cast<int32_t>(2 * r);
    e[r] = static_cast<int32_t>(2 * r + 90);
  }
  check_prefill({DType::kBF16, false}, rows, keys, int32_tensor({rows}, s),
                int32_tensor({rows}, e));
  check_prefill({DType::kF16, true}, 3, 1, int32_tensor({3}, {0, 1, -1}),
                int32_tensor({3}, {1, 1, 5}));
}

TEST(GpuIndexerPrefill, StridedOutputLeavesSurroundingsUntouched) {
  SPARSE_ATTN_REQUIRE_GPU();
  auto rng = make_rng();
  const int64_t rows = 150, keys = 90;
  Tensor q = random_tensor({rows, H, D}, DType::kBF16, rng);
  Tensor k = random_tensor({keys, D}, DType::kBF16, rng);
  Tensor starts = random_int32({rows}, rng, 0, 40);
  Tensor ends = random_int32({rows}, rng, 20, 90);
  Tensor big = testing::poisoned_device({rows, keys + 13}, DType::kF32);
  // Columns [5, 5 + keys) of a wider buffer: odd row stride, so no 8-byte pair stores.
  TensorView out = big.view().narrow(1, 5, keys);
  qsa_mqa_prefill(to_device(q), to_device(k), to_device(starts), to_device(ends), out);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  Tensor host = Tensor::to_host(big.view());
  EXPECT_TRUE(all_close(host.view().narrow(1, 5, keys),
                        prefill_expected(q, k, starts, ends, 1.0 / std::sqrt(128.0)), kAtol,
                        kRtol));
  for (double v : to_vector(host.view().narrow(1, 0, 5))) EXPECT_TRUE(std::isnan(v));
  for (double v : to_vector(host.view().narrow(1, 5 + keys, 8))) EXPECT_TRUE(std::isnan(v));
}

// ---------------------------------------------------------------------------------------
// qsa_indexer_mqa_score
// ---------------------------------------------------------------------------------------

// One output row: where its query is (flat row of q), its request and position.
struct ScoreRow {
  int64_t q_row;
  int64_t req;
  int64_t pos;
  bool valid;
};

// Keys of request `req`, block `b`: the flat key index in `keys` or -1 (missing page).
using KeyOf = std::function<int64_t(int64_t req, int64_t b)>;

std::vector<double> score_expected(const Tensor& q, const Tensor& keys,
                                   const std::vector<ScoreRow>& rows, int64_t num_blocks,
                                   const KeyOf& key_of, double scale) {
  const Flat fq(q), fk(keys);
  std::vector<double> out;
  for (const ScoreRow& r : rows) {
    for (int64_t b = 0; b < num_blocks; ++b) {
      const int64_t key = r.valid && 4 * b + 3 <= r.pos ? key_of(r.req, b) : -1;
      out.push_back(key >= 0 ? score(fq.at(r.q_row * H * D), fk.at(key * D), scale) : -kInf);
    }
  }
  return out;
}

// Runs the score op natively and on the reference, both on CUDA tensors.
void check_score(const Tensor& q, const Tensor& keys, IndexerScoreOptions o,
                 const std::vector<double>& expected) {
  Tensor dq = to_device(q), dk = to_device(keys);
  const Shape shape = qsa_indexer_mqa_score_shape(dq, dk, o);
  Tensor native =
      run_native(shape, [&](const TensorView& out) { qsa_indexer_mqa_score(dq, dk, out, o); });
  o.backend = Backend::kReference;
  Tensor reference =
      run_native(shape, [&](const TensorView& out) { qsa_indexer_mqa_score(dq, dk, out, o); });
  expect_matches(native, expected, reference);
}

TEST_P(GpuIndexer, ScorePaddedPositionsAndSeqLens) {
  SPARSE_ATTN_REQUIRE_GPU();
  auto rng = make_rng();
  const int64_t B = 3, Q = 150, NB = 97;  // 150 rows per request: tiles straddle requests
  Tensor q = random_tensor({B, Q, H, D}, GetParam().q, rng);
  Tensor k = GetParam().keys({B, NB, D}, rng);
  Tensor pos = random_int32({B, Q}, rng, -3, 4 * NB + 10);
  Tensor seq = int32_tensor({B}, {150, 0, 77});
  Tensor dpos = to_device(pos), dseq = to_device(seq);
  IndexerScoreOptions o;
  o.query_positions = dpos.view();
  o.seq_lens_q = dseq.view();
  std::vector<ScoreRow> rows;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < Q; ++i)
      rows.push_back(
          {b * Q + i, b, pos.data_as<int32_t>()[b * Q + i], i < seq.data_as<int32_t>()[b]});
  check_score(q, k, o,
              score_expected(
                  q, k, rows, NB, [&](int64_t r, int64_t b) { return r * NB + b; },
                  1.0 / std::sqrt(128.0)));
}

TEST_P(GpuIndexer, ScorePaddedDefaultPositions) {
  SPARSE_ATTN_REQUIRE_GPU();
  auto rng = make_rng();
  const int64_t B = 2, Q = 300, NB = 75;
  Tensor q = random_tensor({B, Q, H, D}, GetParam().q, rng);
  Tensor k = GetParam().keys({B, NB, D}, rng);
  IndexerScoreOptions o;
  o.score_scale = 3.0;
  std::vector<ScoreRow> rows;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < Q; ++i) rows.push_back({b * Q + i, b, i, true});
  check_score(q, k, o,
              score_expected(
                  q, k, rows, NB, [&](int64_t r, int64_t b) { return r * NB + b; }, 1.0 / 3.0));
}

TEST_P(GpuIndexer, ScoreVarlenCuSeqlens) {
  SPARSE_ATTN_REQUIRE_GPU();
  auto rng = make_rng();
  const std::vector<int32_t> cu{0, 50, 50, 230, 237};  // request 1 is empty
  const int64_t total = cu.back(), NB = 60;
  Tensor q = random_tensor({total, H, D}, GetParam().q, rng);
  Tensor k = GetParam().keys({4, NB, D}, rng);
  Tensor dcu = to_device(int32_tensor({5}, cu));
  IndexerScoreOptions o;
  o.cu_seqlens_q = dcu.view();
  std::vector<ScoreRow> rows;
  for (int64_t r = 0; r < 4; ++r)
    for (int64_t i = cu[r]; i < cu[r + 1]; ++i) rows.push_back({i, r, i - cu[r], true});
  check_score(q, k, o,
              score_expected(
                  q, k, rows, NB, [&](int64_t r, int64_t b) { return r * NB + b; },
                  1.0 / std::sqrt(128.0)));
}

// token_to_req with positions (required): interleaved requests, padding rows of a
// graph-padded batch marked by id -1 or by a live id at a negative position (-inf, no key
// read), and ids spread over many requests.
TEST_P(GpuIndexer, ScoreVarlenTokenToReqPaddingRows) {
  SPARSE_ATTN_REQUIRE_GPU();
  auto rng = make_rng();
  const int64_t total = 300, NB = 80, B = 3000;
  Tensor q = random_tensor({total, H, D}, GetParam().q, rng);
  Tensor k = GetParam().keys({B, NB, D}, rng);
  const std::vector<int32_t> ids{-1, 0, 7, 2047, 2048, 2999};
  std::uniform_int_distribution<size_t> pick(0, ids.size() - 1);
  std::vector<int32_t> t2r(total);
  for (auto& id : t2r) id = ids[pick(rng)];
  Tensor pos = random_int32({total}, rng, -4, 4 * NB + 3);  // negative: a padding row
  Tensor dt2r = to_device(int32_tensor({total}, t2r)), dpos = to_device(pos);
  IndexerScoreOptions o;
  o.token_to_req = dt2r.view();
  o.query_positions = dpos.view();
  std::vector<ScoreRow> rows;
  for (int64_t i = 0; i < total; ++i) {
    const int64_t p = pos.data_as<int32_t>()[i];
    rows.push_back({i, std::max<int64_t>(t2r[i], 0), p, t2r[i] >= 0 && p >= 0});
  }
  check_score(q, k, o,
              score_expected(
                  q, k, rows, NB, [&](int64_t r, int64_t b) { return r * NB + b; },
                  1.0 / std::sqrt(128.0)));
}

// (page size, FP8 keys)
class GpuScorePaged : public ::testing::TestWithParam<std::tuple<int64_t, bool>> {};

TEST_P(GpuScorePaged, VarlenQueriesMissingAndOutOfRangePages) {
  SPARSE_ATTN_REQUIRE_GPU();
  auto rng = make_rng();
  const auto [page_size, fp8] = GetParam();
  const int64_t pages = 9, B = 2, max_pages = 5;
  const int64_t NB = max_pages * page_size;
  const std::vector<int32_t> cu{0, 140, 260};
  const int64_t total = cu.back();
  Tensor q = random_tensor({total, H, D}, DType::kBF16, rng);
  Tensor cache = Elements{DType::kBF16, fp8}.keys({pages, page_size, 1, D}, rng);
  // -1 and >= pages give -inf columns.
  Tensor table = int32_tensor({B, max_pages}, {3, -1, 0, 8, 9, 7, 2, 100, 5, 1});
  Tensor pos = random_int32({total}, rng, 0, int32_t(4 * NB + 3));
  Tensor dcu = to_device(int32_tensor({3}, cu)), dtable = to_device(table), dpos = to_device(pos);
  IndexerScoreOptions o;
  o.cu_seqlens_q = dcu.view();
  o.block_table = dtable.view();
  o.query_positions = dpos.view();
  std::vector<ScoreRow> rows;
  for (int64_t r = 0; r < B; ++r)
    for (int64_t i = cu[r]; i < cu[r + 1]; ++i)
      rows.push_back({i, r, pos.data_as<int32_t>()[i], true});
  const KeyOf key_of = [&](int64_t r, int64_t b) -> int64_t {
    const int64_t page = table.data_as<int32_t>()[r * max_pages + b / page_size];
    return page < 0 || page >= pages ? -1 : page * page_size + b % page_size;
  };
  check_score(q, cache, o, score_expected(q, cache, rows, NB, key_of, 1.0 / std::sqrt(128.0)));
}

INSTANTIATE_TEST_SUITE_P(PageSizes, GpuScorePaged,
                         ::testing::Combine(::testing::Values(8, 16, 64, 212), ::testing::Bool()),
                         [](const auto& info) {
                           return "page" + std::to_string(std::get<0>(info.param)) +
                                  (std::get<1>(info.param) ? "_fp8keys" : "");
                         });

// ---------------------------------------------------------------------------------------
// qsa_mqa_decode
// ---------------------------------------------------------------------------------------

struct DecodeCase {
  Tensor q;      // host [B, R, H, D]
  Tensor cache;  // host [pages, page_size, 1, D], the query's dtype or FP8
  Tensor table;  // host [B, max_pages]
  Tensor lens;   // host [B] (R == 1) or [B, R]
  int64_t max_model_len;
};

int64_t rows_of(const DecodeCase& c) { return c.q.shape()[1]; }

std::vector<double> decode_expected(const DecodeCase& c, double scale) {
  const Flat fq(c.q), fk(c.cache);
  const int64_t B = c.q.shape()[0], R = rows_of(c), pages = c.cache.shape()[0];
  const int64_t ps = c.cache.shape()[1], max_pages = c.table.shape()[1];
  const std::vector<double> lens = to_vector(c.lens.view());
  std::vector<double> out;
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t r = 0; r < R; ++r) {
      for (int64_t col = 0; col < c.max_model_len; ++col) {
        const int64_t pi = col / ps;
        const int64_t page =
            pi < max_pages ? c.table.data_as<int32_t>()[b * max_pages + pi] : int64_t{-1};
        const bool ok = col < lens[b * R + r] && page >= 0 && page < pages;
        out.push_back(
            ok ? score(fq.at((b * R + r) * H * D), fk.at((page * ps + col % ps) * D), scale)
               : -kInf);
      }
    }
  }
  return out;
}

// R query rows per request, each with its own context length (some past the page table,
// some 0: a padding row); page ids include -1 and == pages.
DecodeCase random_decode(Elements e, int64_t B, int64_t R, int64_t page_size, int64_t pages,
                         int64_t max_pages, int64_t max_model_len, std::mt19937_64& rng) {
  const Shape lens = R == 1 ? Shape{B} : Shape{B, R};
  DecodeCase c{random_tensor({B, R, H, D}, e.q, rng), e.keys({pages, page_size, 1, D}, rng),
               random_int32({B, max_pages}, rng, -1, int32_t(pages)),
               random_int32(lens, rng, 0, int32_t(max_pages * page_size + 20)), max_model_len};
  return c;
}
Tensor run_decode(const DecodeCase& c, const TensorView& dq, const TensorView& dk,
                  Backend backend) {
  Tensor dt = to_device(c.table), dl = to_device(c.lens);
  MqaScoreOptions o;
  o.backend = backend;
  return run_native({c.q.shape()[0] * rows_of(c), c.max_model_len}, [&](const TensorView& out) {
    qsa_mqa_decode(dq, dk, dt, dl, c.max_model_len, out, o);
  });
}

// (elements, page size, query rows per request)
class GpuDecode : public ::testing::TestWithParam<std::tuple<Elements, int64_t, int64_t>> {};

TEST_P(GpuDecode, MasksContextMissingAndOutOfRangePages) {
  SPARSE_ATTN_REQUIRE_GPU();
  auto rng = make_rng();
  const auto [elements, page_size, R] = GetParam();
  const int64_t max_pages = 600 / page_size + 1;
  // max_model_len cuts inside the page table; 5 requests, 40 pages.
  DecodeCase c = random_decode(elements, 5, R, page_size, 40, max_pages, 557, rng);
  Tensor dq = to_device(c.q), dk = to_device(c.cache);
  expect_matches(run_decode(c, dq, dk, Backend::kNative),
                 decode_expected(c, 1.0 / std::sqrt(128.0)),
                 run_decode(c, dq, dk, Backend::kReference));
}

INSTANTIATE_TEST_SUITE_P(Forms, GpuDecode,
                         ::testing::Combine(::testing::ValuesIn(kElements),
                                            ::testing::Values(1, 3, 8, 64, 200, 212),
                                            ::testing::Values(1, 2, 3, 4)),
                         [](const auto& info) {
                           return elements_name(std::get<0>(info.param)) + "_page" +
                                  std::to_string(std::get<1>(info.param)) + "_rows" +
                                  std::to_string(std::get<2>(info.param));
                         });

// A [B, H, D] query, and the engine layout of a key cache: K as a strided view of one
// [pages, page, 1, 2 * D] allocation (keys and something else side by side), long pages.
TEST(GpuIndexerDecode, ThreeDimensionalQueryAndStridedLongPages) {
  SPARSE_ATTN_REQUIRE_GPU();
  auto rng = make_rng();
  for (bool fp8 : {false, true}) {
    const Elements e{DType::kBF16, fp8};
    const int64_t pages = 6, page_size = 400, B = 3;
    DecodeCase c = random_decode(e, B, 1, page_size, pages, 4, 1700, rng);
    Tensor wide = e.keys({pages, page_size, 1, 2 * D}, rng);
    const Shape strides{page_size * 2 * D, 2 * D, 2 * D, 1};
    const TensorView view = wide.view().as_strided({pages, page_size, 1, D}, strides);
    c.cache = Tensor::to_host(view);
    Tensor dwide = to_device(wide);
    const TensorView dk = dwide.view().as_strided({pages, page_size, 1, D}, strides);
    Tensor dq = to_device(Tensor::to_host(c.q.view().select(1, 0)));
    expect_matches(run_decode(c, dq, dk, Backend::kNative),
                   decode_expected(c, 1.0 / std::sqrt(128.0)),
                   run_decode(c, dq, dk, Backend::kReference));
  }
}

TEST(GpuIndexerDecode, KeyCacheAndQueryWithFeatureStrideTwoAreGathered) {
  SPARSE_ATTN_REQUIRE_GPU();
  auto rng = make_rng();
  const int64_t pages = 10, page_size = 16, B = 3, R = 2;
  for (bool fp8 : {false, true}) {
    const Elements e{DType::kF16, fp8};
    DecodeCase c = random_decode(e, B, R, page_size, pages, 8, 300, rng);
    // Every other feature of a wider cache and query: no 16-byte vector loads possible.
    Tensor wide = e.keys({pages, page_size, 1, 2 * D}, rng);
    const Shape strides{page_size * 2 * D, 2 * D, 2 * D, 2};
    c.cache = Tensor::to_host(wide.view().as_strided({pages, page_size, 1, D}, strides));
    Tensor wide_q = random_tensor({B, R, H, 2 * D}, DType::kF16, rng);
    const Shape q_strides{R * H * 2 * D, H * 2 * D, 2 * D, 2};
    c.q = Tensor::to_host(wide_q.view().as_strided({B, R, H, D}, q_strides));
    Tensor dwide = to_device(wide), dwide_q = to_device(wide_q);
    const TensorView dk = dwide.view().as_strided({pages, page_size, 1, D}, strides);
    const TensorView dq = dwide_q.view().as_strided({B, R, H, D}, q_strides);
    expect_matches(run_decode(c, dq, dk, Backend::kNative),
                   decode_expected(c, 1.0 / std::sqrt(128.0)),
                   run_decode(c, dq, dk, Backend::kReference));
  }
}

TEST(GpuIndexerDecode, BroadcastQueryAndWidthPastThePageTable) {
  SPARSE_ATTN_REQUIRE_GPU();
  auto rng = make_rng();
  const int64_t B = 4, R = 3, page_size = 16;
  DecodeCase c =
      random_decode({DType::kBF16, false}, B, R, page_size, 12, 6, 200, rng);  // 96 < 200
  // One query row broadcast to every row of every request: [B, R, H, D], strides 0.
  Tensor q1 = random_tensor({H, D}, DType::kBF16, rng);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t r = 0; r < R; ++r) copy_into(c.q.view().select(0, b).select(0, r), q1.view());
  Tensor dq1 = to_device(q1);
  const TensorView broadcast = dq1.view().as_strided({B, R, H, D}, {0, 0, D, 1});
  Tensor dk = to_device(c.cache);
  expect_matches(run_decode(c, broadcast, dk, Backend::kNative),
                 decode_expected(c, 1.0 / std::sqrt(128.0)),
                 run_decode(c, broadcast, dk, Backend::kReference));
}

// ---------------------------------------------------------------------------------------
// CUDA graphs: capture once, change the metadata in place, replay
// ---------------------------------------------------------------------------------------

// Captures `call` on a fresh stream (after one warm-up launch) and returns a replay function.
class Graph {
 public:
  explicit Graph(const std::function<void(cudaStream_t)>& call) {
    EXPECT_EQ(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), cudaSuccess);
    call(stream_);
    EXPECT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
    EXPECT_EQ(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal), cudaSuccess);
    call(stream_);
    EXPECT_EQ(cudaStreamEndCapture(stream_, &graph_), cudaSuccess);
    EXPECT_EQ(cudaGraphInstantiate(&exec_, graph_, 0), cudaSuccess);
  }
  ~Graph() {
    cudaGraphExecDestroy(exec_);
    cudaGraphDestroy(graph_);
    cudaStreamDestroy(stream_);
  }
  void replay() {
    EXPECT_EQ(cudaGraphLaunch(exec_, stream_), cudaSuccess);
    EXPECT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
  }

 private:
  cudaStream_t stream_ = nullptr;
  cudaGraph_t graph_ = nullptr;
  cudaGraphExec_t exec_ = nullptr;
};

// Metadata in int64 (positions, request ids, offsets, lengths, tables, intervals) is read as
// stored: the native scores equal the int32 call's bit for bit, and the reference's.
TEST(GpuIndexerScore, Int64MetadataMatchesInt32) {
  SPARSE_ATTN_REQUIRE_GPU();
  auto rng = make_rng();
  const auto both = [](const std::function<Tensor(bool wide)>& run) {
    const Tensor narrow = run(false), wide = run(true);
    EXPECT_EQ(to_vector(wide.view()), to_vector(narrow.view()));
  };
  const auto dev = [](const Tensor& host, bool wide) {
    return to_device(wide ? testing::widened(host.view()) : host);
  };
  // Score: padded with positions and seq_lens_q; varlen by cu_seqlens_q over a paged cache;
  // token_to_req with padding rows.
  const int64_t B = 2, Q = 90, NB = 64, page_size = 16, pages = 7;
  Tensor qp = to_device(random_tensor({B, Q, H, D}, DType::kBF16, rng));
  Tensor qv = to_device(random_tensor({B * Q, H, D}, DType::kBF16, rng));
  Tensor keys = to_device(random_tensor({B, NB, D}, DType::kBF16, rng));
  Tensor cache = to_device(random_tensor({pages, page_size, 1, D}, DType::kBF16, rng));
  Tensor pos_p = random_int32({B, Q}, rng, -3, 4 * NB + 3);
  Tensor pos_v = random_int32({B * Q}, rng, -3, 4 * NB + 3);
  Tensor seq = int32_tensor({B}, {90, 41});
  Tensor cu = int32_tensor({B + 1}, {0, 100, 180});
  Tensor table = int32_tensor({B, 4}, {3, -1, 0, 6, 7, 2, 5, 1});
  Tensor t2r = random_int32({B * Q}, rng, -1, 1);
  Tensor kp = to_device(random_tensor({200, D}, DType::kBF16, rng));
  Tensor starts = random_int32({B * Q}, rng, -5, 150), ends = random_int32({B * Q}, rng, 0, 230);
  DecodeCase c = random_decode({DType::kBF16, false}, 5, 1, 16, 40, 30, 300, rng);
  Tensor dq = to_device(c.q), dk = to_device(c.cache);
  for (Backend backend : {Backend::kNative, Backend::kReference}) {
    both([&](bool wide) {
      Tensor dpos = dev(pos_p, wide), dseq = dev(seq, wide);
      IndexerScoreOptions o;
      o.backend = backend;
      o.query_positions = dpos.view();
      o.seq_lens_q = dseq.view();
      return run_native({B, Q, NB},
                        [&](const TensorView& out) { qsa_indexer_mqa_score(qp, keys, out, o); });
    });
    both([&](bool wide) {
      Tensor dcu = dev(cu, wide), dtable = dev(table, wide), dpos = dev(pos_v, wide);
      IndexerScoreOptions o;
      o.backend = backend;
      o.cu_seqlens_q = dcu.view();
      o.block_table = dtable.view();
      o.query_positions = dpos.view();
      return run_native({B * Q, 4 * page_size},
                        [&](const TensorView& out) { qsa_indexer_mqa_score(qv, cache, out, o); });
    });
    both([&](bool wide) {
      Tensor dt2r = dev(t2r, wide), dpos = dev(pos_v, wide);
      IndexerScoreOptions o;
      o.backend = backend;
      o.token_to_req = dt2r.view();
      o.query_positions = dpos.view();
      return run_native({B * Q, NB},
                        [&](const TensorView& out) { qsa_indexer_mqa_score(qv, keys, out, o); });
    });
    // Prefill intervals and decode tables / lengths.
    both([&](bool wide) {
      Tensor ds = dev(starts, wide), de = dev(ends, wide);
      MqaScoreOptions o;
      o.backend = backend;
      return run_native({B * Q, 200},
                        [&](const TensorView& out) { qsa_mqa_prefill(qv, kp, ds, de, out, o); });
    });
    both([&](bool wide) {
      Tensor dt = dev(c.table, wide), dl = dev(c.lens, wide);
      MqaScoreOptions o;
      o.backend = backend;
      return run_native({5, c.max_model_len}, [&](const TensorView& out) {
        qsa_mqa_decode(dq, dk, dt, dl, c.max_model_len, out, o);
      });
    });
  }
}

TEST(GpuIndexerGraph, PrefillReplayReadsCurrentIntervals) {
  SPARSE_ATTN_REQUIRE_GPU();
  auto rng = make_rng();
  const int64_t rows = 200, keys = 130;
  Tensor q = random_tensor({rows, H, D}, DType::kBF16, rng);
  Tensor k = random_tensor({keys, D}, DType::kBF16, rng);
  Tensor starts = random_int32({rows}, rng, 0, 60), ends = random_int32({rows}, rng, 30, 130);
  Tensor dq = to_device(q), dk = to_device(k), ds = to_device(starts), de = to_device(ends);
  Tensor out = testing::poisoned_device({rows, keys}, DType::kF32);
  Graph graph([&](cudaStream_t s) {
    MqaScoreOptions o;
    o.stream = s;
    qsa_mqa_prefill(dq, dk, ds, de, out, o);
  });
  Tensor starts2 = random_int32({rows}, rng, 0, 60), ends2 = random_int32({rows}, rng, 30, 130);
  copy_into(ds.view(), starts2.view());
  copy_into(de.view(), ends2.view());
  copy_into(out.view(), testing::poisoned_device({rows, keys}, DType::kF32).view());
  graph.replay();
  EXPECT_TRUE(all_close(Tensor::to_host(out.view()).view(),
                        prefill_expected(q, k, starts2, ends2, 1.0 / std::sqrt(128.0)), kAtol,
                        kRtol));
}

TEST(GpuIndexerGraph, ScoreReplayReadsCurrentPositions) {
  SPARSE_ATTN_REQUIRE_GPU();
  auto rng = make_rng();
  const int64_t B = 2, Q = 40, NB = 30;
  Tensor q = random_tensor({B, Q, H, D}, DType::kF16, rng);
  Tensor k = random_tensor({B, NB, D}, DType::kF16, rng);
  Tensor pos = random_int32({B, Q}, rng, 0, 4 * NB);
  Tensor dq = to_device(q), dk = to_device(k), dpos = to_device(pos);
  Tensor out = testing::poisoned_device({B, Q, NB}, DType::kF32);
  Graph graph([&](cudaStream_t s) {
    IndexerScoreOptions o;
    o.query_positions = dpos.view();
    o.stream = s;
    qsa_indexer_mqa_score(dq, dk, out, o);
  });
  Tensor pos2 = random_int32({B, Q}, rng, 0, 4 * NB);
  copy_into(dpos.view(), pos2.view());
  copy_into(out.view(), testing::poisoned_device({B, Q, NB}, DType::kF32).view());
  graph.replay();
  std::vector<ScoreRow> rows;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < Q; ++i)
      rows.push_back({b * Q + i, b, pos2.data_as<int32_t>()[b * Q + i], true});
  EXPECT_TRUE(all_close(
      Tensor::to_host(out.view()).view(),
      score_expected(
          q, k, rows, NB, [&](int64_t r, int64_t b) { return r * NB + b; }, 1.0 / std::sqrt(128.0)),
      kAtol, kRtol));
}

TEST(GpuIndexerGraph, DecodeReplayReadsCurrentLengthsAndPages) {
  SPARSE_ATTN_REQUIRE_GPU();
  auto rng = make_rng();
  DecodeCase c = random_decode({DType::kBF16, false}, 6, 1, 32, 20, 8, 256, rng);
  Tensor dq = to_device(c.q), dk = to_device(c.cache), dt = to_device(c.table),
         dl = to_device(c.lens);
  Tensor out = testing::poisoned_device({6, 256}, DType::kF32);
  Graph graph([&](cudaStream_t s) {
    MqaScoreOptions o;
    o.stream = s;
    qsa_mqa_decode(dq, dk, dt, dl, 256, out, o);
  });
  c.table = random_int32({6, 8}, rng, -1, 20);
  c.lens = random_int32({6}, rng, 0, 270);
  copy_into(dt.view(), c.table.view());
  copy_into(dl.view(), c.lens.view());
  copy_into(out.view(), testing::poisoned_device({6, 256}, DType::kF32).view());
  graph.replay();
  EXPECT_TRUE(all_close(Tensor::to_host(out.view()).view(),
                        decode_expected(c, 1.0 / std::sqrt(128.0)), kAtol, kRtol));
}

INSTANTIATE_TEST_SUITE_P(Elements, GpuIndexer, ::testing::ValuesIn(kElements),
                         [](const auto& info) { return elements_name(info.param); });

}  // namespace
}  // namespace sparse_attn
