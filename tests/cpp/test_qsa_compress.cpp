// qsa_compress_block_keys against an implementation written here from the model's definition
// (issue 17; docs/qsa.md, "Compressed keys"), in double: the mean of each complete group of 4
// raw keys, RMS-normed with weight (1 + w) and eps, RoPE on the first rope_dim dims at the
// group's first position 4b. Plus one test per validation rule.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "sparse_attn/errors.h"
#include "sparse_attn/qsa_compress.h"
#include "test_util.h"

namespace sparse_attn {
namespace {

using testing::get;
using testing::int32_tensor;
using testing::make_rng;
using testing::random_tensor;

constexpr int64_t kD = 128;

// The RoPE a call uses, for the test-local definition.
struct Rope {
  std::optional<Tensor> cos, sin;  // FP32 [positions, 32 or 64]
  double theta = 0;                // when no tables
  RopeStyle style = RopeStyle::kRotateHalf;
  int64_t dim = 64;

  // cos and sin for rotated dim d at position pos.
  std::pair<double, double> at(int64_t pos, int64_t d) const {
    const int64_t half = dim / 2;
    const int64_t j = style == RopeStyle::kInterleaved ? d / 2 : d % half;
    if (cos) {
      const int64_t col = cos->shape()[1] == dim ? d : j;
      return {get(*cos, {pos, col}), get(*sin, {pos, col})};
    }
    // transformers: FP32 inverse frequency and FP32 angle.
    const float inv_freq = static_cast<float>(std::pow(theta, -2.0 * double(j) / double(dim)));
    const double angle = static_cast<float>(pos) * inv_freq;
    return {std::cos(angle), std::sin(angle)};
  }
};

// The compressed key of the block whose 4 raw keys are rows row0 .. row0 + 3 of `keys`
// ([rows, D]), at position pos.
std::vector<double> expected_key(const TensorView& keys, int64_t row0, int64_t pos,
                                 const TensorView& w, double eps, const Rope& rope) {
  const int64_t D = keys.size(-1);
  std::vector<double> y(D);
  double ms = 0;
  for (int64_t d = 0; d < D; ++d) {
    double s = 0;
    for (int64_t t = 0; t < 4; ++t) s += get(keys, {row0 + t, d});
    y[d] = s / 4;
    ms += y[d] * y[d] / double(D);
  }
  for (int64_t d = 0; d < D; ++d) y[d] = y[d] / std::sqrt(ms + eps) * (1 + get(w, {d}));
  std::vector<double> out = y;
  const int64_t half = rope.dim / 2;
  for (int64_t d = 0; d < rope.dim; ++d) {
    const auto [c, s] = rope.at(pos, d);
    if (rope.style == RopeStyle::kRotateHalf) {
      out[d] = d < half ? y[d] * c - y[d + half] * s : y[d] * c + y[d - half] * s;
    } else {
      out[d] = d % 2 == 0 ? y[d] * c - y[d + 1] * s : y[d] * c + y[d - 1] * s;
    }
  }
  return out;
}

double tolerance(DType dtype, double expected) {
  // One rounding to the output dtype, plus the FP32 computation's own error.
  const double ulp = dtype == DType::kBF16 ? 0x1p-8 : 0x1p-11;
  return 2e-5 + 1.01 * ulp * std::abs(expected);
}

// Expects row `slot` of `out2d` ([slots, D]) to hold `expected`.
void expect_row(const TensorView& out2d, int64_t slot, const std::vector<double>& expected,
                const std::string& what) {
  for (int64_t d = 0; d < static_cast<int64_t>(expected.size()); ++d) {
    const double got = get(out2d, {slot, d});
    ASSERT_NEAR(got, expected[d], tolerance(out2d.dtype(), expected[d])) << what << ", dim " << d;
  }
}

// Expects row `slot` of `out2d` to be untouched (still poisoned: NaN).
void expect_untouched(const TensorView& out2d, int64_t slot, const std::string& what) {
  for (int64_t d = 0; d < out2d.size(-1); ++d) {
    ASSERT_TRUE(std::isnan(get(out2d, {slot, d}))) << what << ", dim " << d;
  }
}

Rope table_rope(std::mt19937_64& rng, int64_t positions, int64_t cols, RopeStyle style) {
  Rope r;
  r.style = style;
  // Random angles: any table is valid input; cos^2 + sin^2 = 1 keeps values realistic.
  Tensor c = Tensor::empty({positions, cols}, DType::kF32);
  Tensor s = Tensor::empty({positions, cols}, DType::kF32);
  std::uniform_real_distribution<double> angle(-3.2, 3.2);
  for (int64_t i = 0; i < positions * cols; ++i) {
    const double a = angle(rng);
    c.data_as<float>()[i] = float(std::cos(a));
    s.data_as<float>()[i] = float(std::sin(a));
  }
  r.cos = c;
  r.sin = s;
  return r;
}

CompressBlockKeysOptions options_of(const Rope& rope, double eps = 1e-6) {
  CompressBlockKeysOptions o;
  if (rope.cos) {
    o.cos = rope.cos->view();
    o.sin = rope.sin->view();
  } else {
    o.rope_theta = rope.theta;
  }
  o.rope_style = rope.style;
  o.rope_dim = rope.dim;
  o.eps = eps;
  return o;
}

Tensor poisoned(const Shape& shape, DType dtype) {
  Tensor t = Tensor::empty(shape, dtype);
  testing::poison(t.view());
  return t;
}

struct DtypeStyle {
  DType dtype;
  RopeStyle style;
  int64_t cols;
};

class CompressSingle : public ::testing::TestWithParam<DtypeStyle> {};

// One request of 23 tokens: 5 complete blocks, the trailing group of 3 is not written.
TEST_P(CompressSingle, CompleteBlocksOnlyAndTheTailIsNotWritten) {
  const auto [dtype, style, cols] = GetParam();
  auto rng = make_rng();
  const Tensor keys = random_tensor({23, kD}, dtype, rng, -2.f, 2.f);
  const Tensor w = random_tensor({kD}, DType::kF32, rng, -0.5f, 0.5f);
  const Rope rope = table_rope(rng, 24, cols, style);
  const Tensor out = poisoned({6, kD}, dtype);
  qsa_compress_block_keys(keys, w, out, options_of(rope, 1e-5));
  for (int64_t b = 0; b < 5; ++b) {
    expect_row(out, b, expected_key(keys, 4 * b, 4 * b, w, 1e-5, rope),
               "block " + std::to_string(b));
  }
  expect_untouched(out, 5, "block 5 (tokens 20 .. 22 only)");
  EXPECT_EQ(qsa_compress_block_keys_shape(keys), (Shape{5, kD}));
}

INSTANTIATE_TEST_SUITE_P(Layouts, CompressSingle,
                         ::testing::Values(DtypeStyle{DType::kBF16, RopeStyle::kRotateHalf, 32},
                                           DtypeStyle{DType::kBF16, RopeStyle::kRotateHalf, 64},
                                           DtypeStyle{DType::kF16, RopeStyle::kRotateHalf, 32},
                                           DtypeStyle{DType::kBF16, RopeStyle::kInterleaved, 32},
                                           DtypeStyle{DType::kF16, RopeStyle::kInterleaved, 64}),
                         [](const auto& info) {
                           return std::string(dtype_name(info.param.dtype)) +
                                  (info.param.style == RopeStyle::kRotateHalf ? "_rotate_half"
                                                                              : "_interleaved") +
                                  "_cols" + std::to_string(info.param.cols);
                         });

TEST(CompressBlockKeys, RopeThetaMatchesTransformersFrequencies) {
  auto rng = make_rng();
  const Tensor keys = random_tensor({1, 4096 + 8, kD}, DType::kBF16, rng);
  const Tensor w = random_tensor({kD}, DType::kBF16, rng, -0.3f, 0.3f);
  Rope rope;
  rope.theta = 1e7;
  const Tensor out = poisoned({1, 1026, kD}, DType::kBF16);
  qsa_compress_block_keys(keys, w, out, options_of(rope));
  const TensorView k0 = keys.view().select(0, 0), o0 = out.view().select(0, 0);
  for (int64_t b : {0, 1, 7, 513, 1025}) {
    expect_row(o0, b, expected_key(k0, 4 * b, 4 * b, w, 1e-6, rope), "block " + std::to_string(b));
  }
}

// Padded [B, L, D] keys with start positions: a group is complete only when its 4 positions
// are rows of the call; rows before the first multiple of 4 belong to a block of an earlier
// call (or, at negative positions, to none).
TEST(CompressBlockKeys, StartPositionsAlignGroupsToPositions) {
  auto rng = make_rng();
  const int64_t B = 4, L = 10;
  const Tensor keys = random_tensor({B, L, kD}, DType::kF16, rng);
  const Tensor w = random_tensor({kD}, DType::kF32, rng, -0.5f, 0.5f);
  const Rope rope = table_rope(rng, 40, 32, RopeStyle::kRotateHalf);
  const std::vector<int32_t> starts = {0, 3, 8, -5};
  const Tensor start = int32_tensor({B}, starts);
  const Tensor out = poisoned({B, 6, kD}, DType::kF16);
  CompressBlockKeysOptions o = options_of(rope);
  o.start_positions = start.view();
  qsa_compress_block_keys(keys, w, out, o);
  // Complete blocks: start 0 -> 0, 1; start 3 -> 1, 2 (positions 4 .. 11); start 8 -> 2, 3;
  // start -5 -> 0 (positions 0 .. 3 are rows 5 .. 8).
  const std::vector<std::vector<int64_t>> written = {{0, 1}, {1, 2}, {2, 3}, {0}};
  for (int64_t r = 0; r < B; ++r) {
    const TensorView kr = keys.view().select(0, r), orow = out.view().select(0, r);
    for (int64_t b = 0; b < 6; ++b) {
      const std::string what = "request " + std::to_string(r) + " block " + std::to_string(b);
      const auto& wr = written[r];
      if (std::find(wr.begin(), wr.end(), b) != wr.end()) {
        expect_row(orow, b, expected_key(kr, 4 * b - starts[r], 4 * b, w, 1e-6, rope), what);
      } else {
        expect_untouched(orow, b, what);
      }
    }
  }
}

// Varlen keys into a paged cache whose pages hold 3 keys, so consecutive blocks of a request
// land on different, scattered pages; -1 and out-of-range page ids drop their blocks.
TEST(CompressBlockKeys, VarlenIntoPagesOfAnySize) {
  for (const int64_t page_size : {1, 3, 5}) {
    auto rng = make_rng();
    const std::vector<int32_t> cu = {0, 13, 13, 34};
    const int64_t B = 3, max_pages = 6, pages = 20;
    const Tensor keys = random_tensor({34, kD}, DType::kBF16, rng);
    const Tensor w = random_tensor({kD}, DType::kBF16, rng, -0.5f, 0.5f);
    const Rope rope = table_rope(rng, 32, 64, RopeStyle::kRotateHalf);
    std::vector<int32_t> table(B * max_pages);
    // 7 is coprime with 20: every entry a different page.
    for (int64_t i = 0; i < B * max_pages; ++i) table[i] = int32_t((7 * i + 3) % pages);
    table[2 * max_pages + 1] = -1;     // request 2's second page is missing
    table[2 * max_pages + 2] = pages;  // and its third is out of range
    const Tensor bt = int32_tensor({B, max_pages}, table);
    const Tensor cus = int32_tensor({B + 1}, cu);
    const Tensor start = int32_tensor({B}, {0, 0, 2});
    const Tensor out = poisoned({pages, page_size, 1, kD}, DType::kBF16);
    CompressBlockKeysOptions o = options_of(rope);
    o.cu_seqlens = cus.view();
    o.start_positions = start.view();
    o.block_table = bt.view();
    o.page_size = page_size;
    qsa_compress_block_keys(keys, w, out, o);

    std::vector<bool> touched(pages * page_size, false);
    const std::vector<int64_t> starts = {0, 0, 2};
    for (int64_t r = 0; r < B; ++r) {
      const int64_t rows = cu[r + 1] - cu[r], s = starts[r];
      const TensorView kr = keys.view().narrow(0, cu[r], rows);
      for (int64_t b = (s + 3) / 4; 4 * b + 3 < s + rows; ++b) {
        if (b / page_size >= max_pages) continue;
        const int32_t page = table[r * max_pages + b / page_size];
        if (page < 0 || page >= pages) continue;
        touched[page * page_size + b % page_size] = true;
        expect_row(out.view().select(2, 0).select(0, page), b % page_size,
                   expected_key(kr, 4 * b - s, 4 * b, w, 1e-6, rope),
                   "page_size " + std::to_string(page_size) + " request " + std::to_string(r) +
                       " block " + std::to_string(b));
      }
    }
    for (int64_t i = 0; i < pages * page_size; ++i) {
      if (!touched[i]) {
        expect_untouched(out.view().select(2, 0).select(0, i / page_size), i % page_size,
                         "untouched slot " + std::to_string(i));
      }
    }
  }
}

// Decode appends: a prefill of 10 tokens writes blocks 0 and 1; the step that brings token 11
// passes tokens 8 .. 11 from position 8 and writes block 2 only. The cache then equals one
// call over all 12 tokens.
TEST(CompressBlockKeys, DecodeAppendsOnlyTheCompletedBlock) {
  auto rng = make_rng();
  const Tensor keys = random_tensor({12, kD}, DType::kBF16, rng);
  const Tensor w = random_tensor({kD}, DType::kF32, rng, -0.5f, 0.5f);
  Rope rope;
  rope.theta = 10000;
  const Tensor bt = int32_tensor({1, 2}, {1, 0});
  const Tensor cache = poisoned({2, 2, kD}, DType::kBF16);
  CompressBlockKeysOptions o = options_of(rope);
  o.block_table = bt.view();
  qsa_compress_block_keys(keys.view().narrow(0, 0, 10), w, cache, o);
  expect_untouched(cache.view().select(0, 0), 0, "block 2 before its last token");
  const Tensor start = int32_tensor({1}, {8});
  o.start_positions = start.view();
  qsa_compress_block_keys(keys.view().narrow(0, 8, 4), w, cache, o);
  expect_untouched(cache.view().select(0, 0), 1, "block 3");
  const Tensor whole = poisoned({3, kD}, DType::kBF16);
  qsa_compress_block_keys(keys, w, whole, options_of(rope));
  for (int64_t b = 0; b < 3; ++b) {
    const TensorView page = cache.view().select(0, b < 2 ? 1 : 0);
    for (int64_t d = 0; d < kD; ++d) {
      ASSERT_EQ(get(page, {b % 2, d}), get(whole, {b, d})) << "block " << b << " dim " << d;
    }
  }
}

// Strided keys (a slice of a wider buffer, every other row) and a strided out view; the gaps of
// out stay untouched.
TEST(CompressBlockKeys, StridedViews) {
  auto rng = make_rng();
  const Tensor buf = random_tensor({16, 2 * kD + 8}, DType::kBF16, rng);
  const TensorView keys = buf.view().as_strided({8, kD}, {2 * (2 * kD + 8), 2}, 3);
  const Tensor w = random_tensor({kD}, DType::kF16, rng, -0.5f, 0.5f);
  const Rope rope = table_rope(rng, 8, 32, RopeStyle::kInterleaved);
  const Tensor obuf = poisoned({4, 3 * kD}, DType::kBF16);
  const TensorView out = obuf.view().as_strided({2, kD}, {2 * 3 * kD, 3}, 1);
  qsa_compress_block_keys(keys, w, out, options_of(rope));
  for (int64_t b = 0; b < 2; ++b) {
    expect_row(out, b, expected_key(keys, 4 * b, 4 * b, w, 1e-6, rope),
               "block " + std::to_string(b));
  }
  int64_t written = 0;
  for (int64_t i = 0; i < obuf.numel(); ++i)
    written += !std::isnan(get(obuf, {i / (3 * kD), i % (3 * kD)}));
  EXPECT_EQ(written, 2 * kD);
}

// The reference on any D and rope_dim (the native kernel needs 128 and 64); rope_dim 0 is a
// plain (1 + w) RMSNorm of the mean.
TEST(CompressBlockKeys, ReferenceTakesAnyDimAndRopeDim) {
  auto rng = make_rng();
  for (const auto [D, rd] : {std::pair<int64_t, int64_t>{64, 32}, {40, 0}, {16, 16}}) {
    const Tensor keys = random_tensor({8, D}, DType::kF16, rng);
    const Tensor w = random_tensor({D}, DType::kF32, rng, -0.5f, 0.5f);
    Rope rope;
    rope.theta = 500;
    rope.dim = rd;
    const Tensor out = poisoned({2, D}, DType::kF16);
    CompressBlockKeysOptions o = options_of(rope);
    o.backend = Backend::kReference;
    qsa_compress_block_keys(keys, w, out, o);
    for (int64_t b = 0; b < 2; ++b) {
      expect_row(out, b, expected_key(keys, 4 * b, 4 * b, w, 1e-6, rope),
                 "D " + std::to_string(D) + " rope_dim " + std::to_string(rd));
    }
  }
}

// ---------------------------------------------------------------------------------------
// Validation: each malformed call raises the documented error naming the argument.
// ---------------------------------------------------------------------------------------

struct Call {
  Tensor keys = Tensor::empty({8, kD}, DType::kBF16);
  Tensor w = Tensor::empty({kD}, DType::kF32);
  Tensor out = Tensor::empty({2, kD}, DType::kBF16);
  Tensor cos = Tensor::empty({8, 32}, DType::kF32);
  Tensor sin = Tensor::empty({8, 32}, DType::kF32);
  std::optional<TensorView> out_view;  // instead of out
  CompressBlockKeysOptions o;
  Call() {
    std::memset(keys.data(), 0, keys.numel() * 2);
    std::memset(w.data(), 0, w.numel() * 4);
    std::memset(cos.data(), 0, cos.numel() * 4);
    std::memset(sin.data(), 0, sin.numel() * 4);
    o.cos = cos.view();
    o.sin = sin.view();
  }
  void run() { qsa_compress_block_keys(keys, w, out_view ? *out_view : out.view(), o); }
};

template <typename E>
void expect_error(const std::function<void(Call&)>& change, const std::string& prefix) {
  Call c;
  change(c);
  try {
    c.run();
    ADD_FAILURE() << "no error; expected one starting with '" << prefix << "'";
  } catch (const E& e) {
    EXPECT_EQ(std::string(e.what()).rfind(prefix, 0), 0u) << e.what();
  }
}

TEST(CompressBlockKeysValidation, AValidCallRuns) {
  Call c;
  c.run();
}

TEST(CompressBlockKeysValidation, Dtypes) {
  expect_error<TypeError>([](Call& c) { c.keys = Tensor::empty({8, kD}, DType::kF32); }, "keys:");
  expect_error<TypeError>([](Call& c) { c.out = Tensor::empty({2, kD}, DType::kF16); }, "out:");
  expect_error<TypeError>([](Call& c) { c.w = Tensor::empty({kD}, DType::kI32); }, "weight:");
  expect_error<TypeError>(
      [](Call& c) {
        c.cos = Tensor::empty({8, 32}, DType::kBF16);
        c.o.cos = c.cos.view();
      },
      "cos:");
  expect_error<TypeError>(
      [](Call& c) {
        static const Tensor cu = Tensor::empty({2}, DType::kF32);
        c.o.cu_seqlens = cu.view();
      },
      "cu_seqlens:");
}

TEST(CompressBlockKeysValidation, Shapes) {
  expect_error<ValueError>([](Call& c) { c.keys = Tensor::empty({kD}, DType::kBF16); }, "keys:");
  expect_error<ValueError>([](Call& c) { c.w = Tensor::empty({64}, DType::kF32); }, "weight:");
  expect_error<ValueError>([](Call& c) { c.out = Tensor::empty({2, 64}, DType::kBF16); }, "out:");
  expect_error<ValueError>(
      [](Call& c) {
        c.out = Tensor::empty({1, 2, kD}, DType::kBF16);
      },
      "out:");
  expect_error<ValueError>(
      [](Call& c) {
        c.cos = Tensor::empty({8, 48}, DType::kF32);
        c.o.cos = c.cos.view();
      },
      "cos:");
  expect_error<ValueError>(
      [](Call& c) {
        c.sin = Tensor::empty({9, 32}, DType::kF32);
        c.o.sin = c.sin.view();
      },
      "sin:");
  expect_error<ValueError>(
      [](Call& c) {
        static const Tensor s = int32_tensor({2}, {0, 0});
        c.o.start_positions = s.view();
      },
      "start_positions:");
  expect_error<ValueError>(
      [](Call& c) {
        static const Tensor cu = int32_tensor({2}, {0, 8});
        c.keys = Tensor::empty({1, 8, kD}, DType::kBF16);
        c.o.cu_seqlens = cu.view();
      },
      "cu_seqlens:");
  expect_error<ValueError>(
      [](Call& c) {
        static const Tensor bt = int32_tensor({2, 1}, {0, 1});
        c.o.block_table = bt.view();
        c.out = Tensor::empty({2, 4, kD}, DType::kBF16);
      },
      "block_table:");
  expect_error<ValueError>(
      [](Call& c) {
        static const Tensor bt = int32_tensor({1, 1}, {0});
        c.o.block_table = bt.view();
        c.out = Tensor::empty({2, 4, 2, kD}, DType::kBF16);
      },
      "out:");
  expect_error<ValueError>(
      [](Call& c) {
        static const Tensor bt = int32_tensor({1, 1}, {0});
        c.o.block_table = bt.view();
        c.out = Tensor::empty({2, 4, kD}, DType::kBF16);
        c.o.page_size = 8;
      },
      "page_size:");
  expect_error<ValueError>([](Call& c) { c.o.page_size = 2; }, "page_size:");
}

TEST(CompressBlockKeysValidation, RopeAndScalars) {
  expect_error<ValueError>([](Call& c) { c.o.sin.reset(); }, "sin:");
  expect_error<ValueError>([](Call& c) { c.o.cos.reset(); }, "cos:");
  expect_error<ValueError>([](Call& c) { c.o.rope_theta = 1e4; }, "rope_theta:");
  expect_error<ValueError>(
      [](Call& c) {
        c.o.cos.reset();
        c.o.sin.reset();
      },
      "rope_theta:");
  expect_error<ValueError>(
      [](Call& c) {
        c.o.cos.reset();
        c.o.sin.reset();
        c.o.rope_theta = -1;
      },
      "rope_theta:");
  expect_error<ValueError>([](Call& c) { c.o.rope_dim = 63; }, "rope_dim:");
  expect_error<ValueError>([](Call& c) { c.o.rope_dim = 130; }, "rope_dim:");
  expect_error<ValueError>([](Call& c) { c.o.eps = -1e-6; }, "eps:");
  expect_error<ValueError>([](Call& c) { c.o.eps = std::nan(""); }, "eps:");
  expect_error<ValueError>([](Call& c) { c.o.eps = 1e300; }, "eps:");
  EXPECT_THROW(parse_rope_style("neox"), ValueError);
  EXPECT_EQ(parse_rope_style("interleaved"), RopeStyle::kInterleaved);
}

TEST(CompressBlockKeysValidation, OutputLayoutAndOverlap) {
  // out on the keys' own memory.
  expect_error<ValueError>(
      [](Call& c) {
        c.out = Tensor::empty({2, kD}, DType::kBF16);
        c.out_view = c.keys.view().narrow(0, 0, 2);
      },
      "out:");
  // A broadcast out: both blocks at one address.
  expect_error<ValueError>(
      [](Call& c) {
        c.out_view = c.out.view().select(0, 0).as_strided({2, kD}, {0, 1});
      },
      "out:");
}

// Broken promised contents: the reference raises before writing anything.
TEST(CompressBlockKeysValidation, ReferenceReadsPromisedContents) {
  expect_error<ValueError>(
      [](Call& c) {
        static const Tensor cu = int32_tensor({3}, {0, 6, 5});
        c.o.cu_seqlens = cu.view();
        c.out = Tensor::empty({2, 2, kD}, DType::kBF16);
      },
      "cu_seqlens:");
  expect_error<ValueError>(
      [](Call& c) {
        c.cos = Tensor::empty({4, 32}, DType::kF32);
        c.sin = Tensor::empty({4, 32}, DType::kF32);
        c.o.cos = c.cos.view();
        c.o.sin = c.sin.view();
      },
      "cos, sin:");
}

}  // namespace
}  // namespace sparse_attn
