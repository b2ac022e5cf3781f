// xattn_estimate and find_blocks_chunked (the reference; the estimation cases also on the CPU
// backend, backend native on host tensors) against double-precision
// computations written here from docs/xattention.md: the estimate in upstream's form
// (explicitly interleaved Q/K, one matmul, masked softmax, block reshape-sum), the selection as
// a repeated pick of the largest remaining block.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "sparse_attn/errors.h"
#include "sparse_attn/xattn.h"
#include "test_util.h"
#include "test_xattn_util.h"

namespace sparse_attn {
namespace {

using testing::all_close;
using testing::get;
using testing::make_rng;
using testing::poison;
using testing::random_tensor;
using testing::to_vector;
using namespace xattn_testing;

// Expected attn_sums [B, Hq, q_blocks, k_blocks] (row-major, double), docs/xattention.md
// "Estimation", computed the way upstream's torch path does, with the exact causal rule.
std::vector<double> expected_sums(const TensorView& q, const TensorView& k, int64_t block,
                                  int64_t stride, double norm, bool causal) {
  const int64_t B = q.size(0), Hq = q.size(1), Lq = q.size(2), D = q.size(3);
  const int64_t Hkv = k.size(1), Lk = k.size(2);
  const int64_t S = stride;
  const int64_t nq = (Lq + S - 1) / S, nk = (Lk + S - 1) / S;
  const int64_t qb = (Lq + block - 1) / block, kb = (Lk + block - 1) / block;
  const int64_t per_block = block / S;
  std::vector<double> out(static_cast<size_t>(B * Hq * qb * kb), 0.0);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < Hq; ++h) {
      const int64_t hk = h / (Hq / Hkv);
      // Interleave: Qr[g] = concat_t Q[g*S + S-1-t], Kr[j] = concat_t K[j*S + t], zero past
      // the end of the sequence.
      std::vector<double> qr(static_cast<size_t>(nq * S * D), 0.0);
      std::vector<double> kr(static_cast<size_t>(nk * S * D), 0.0);
      for (int64_t g = 0; g < nq; ++g)
        for (int64_t t = 0; t < S; ++t)
          for (int64_t d = 0; d < D; ++d)
            if (g * S + S - 1 - t < Lq)
              qr[(g * S + t) * D + d] = get(q, {b, h, g * S + S - 1 - t, d});
      for (int64_t j = 0; j < nk; ++j)
        for (int64_t t = 0; t < S; ++t)
          for (int64_t d = 0; d < D; ++d)
            if (j * S + t < Lk) kr[(j * S + t) * D + d] = get(k, {b, hk, j * S + t, d});
      for (int64_t g = 0; g < nq; ++g) {
        // Position of the group's last real query row; key group j is hidden when its first
        // key comes after it.
        const int64_t last_query_pos = (Lk - Lq) + std::min(g * S + S - 1, Lq - 1);
        std::vector<double> logits(static_cast<size_t>(nk));
        double m = -INFINITY;
        for (int64_t j = 0; j < nk; ++j) {
          double s = 0;
          for (int64_t e = 0; e < S * D; ++e) s += qr[g * S * D + e] * kr[j * S * D + e];
          logits[j] =
              (causal && j * S > last_query_pos) ? -INFINITY : s / std::sqrt(double(D)) / S / norm;
          m = std::max(m, logits[j]);
        }
        double z = 0;
        for (double& l : logits) z += (l = std::exp(l - m));
        for (int64_t j = 0; j < nk; ++j) {
          out[((b * Hq + h) * qb + g / per_block) * kb + j / per_block] += logits[j] / z;
        }
      }
    }
  }
  return out;
}

// Both host backends: the reference and the CPU backend (backend native on host tensors).
constexpr Backend kHostBackends[] = {Backend::kReference, Backend::kNative};

XAttnEstimateOptions opts(int64_t stride = 8, int64_t chunk = 16384,
                          Backend backend = Backend::kReference) {
  XAttnEstimateOptions o;
  o.backend = backend;
  o.stride = stride;
  o.chunk_size = chunk;
  return o;
}

struct Estimated {
  Tensor sums, mask;
};

Estimated run_estimate(const TensorView& q, const TensorView& k, const XAttnEstimateOptions& o) {
  const Shape shape = xattn_estimate_shape(q, k, o);
  Estimated e{Tensor::empty(shape, DType::kF32), Tensor::empty(shape, DType::kBool)};
  poison(e.sums);
  std::fill_n(e.mask.data_as<uint8_t>(), e.mask.numel(), uint8_t{0x5a});  // neither 0 nor 1
  xattn_estimate(q, k, e.sums, e.mask, o);
  return e;
}

// ---------------------------------------------------------------------------------------
// Estimation
// ---------------------------------------------------------------------------------------

struct EstimateCase {
  std::string name;
  int64_t batch, hq, hkv, lq, lk, dim, stride, chunk;
  bool causal;
  Backend backend = Backend::kReference;
};

void PrintTo(const EstimateCase& c, std::ostream* os) { *os << c.name; }

class XAttnEstimate : public ::testing::TestWithParam<EstimateCase> {};

TEST_P(XAttnEstimate, SumsAndMaskMatchDoubleComputation) {
  const EstimateCase& c = GetParam();
  auto rng = make_rng();
  Tensor q = random_tensor({c.batch, c.hq, c.lq, c.dim}, DType::kBF16, rng, -2.f, 2.f);
  Tensor k = random_tensor({c.batch, c.hkv, c.lk, c.dim}, DType::kBF16, rng, -2.f, 2.f);
  XAttnEstimateOptions o = opts(c.stride, c.chunk, c.backend);
  o.causal = c.causal;
  o.threshold = 0.85;
  const Estimated e = run_estimate(q, k, o);
  const std::vector<double> want = expected_sums(q, k, 128, c.stride, 1.0, c.causal);
  EXPECT_TRUE(all_close(e.sums, want, 1e-6, 1e-5));
  // Every query block's sums add up to its number of stride groups (each softmax sums to 1).
  const int64_t qb = e.sums.shape()[2], kb = e.sums.shape()[3];
  for (int64_t i = 0; i < qb; ++i) {
    double row = 0;
    for (int64_t j = 0; j < kb; ++j) row += get(e.sums, {0, 0, i, j});
    const int64_t rows = std::min<int64_t>(128, c.lq - 128 * i);
    EXPECT_NEAR(row, double((rows + c.stride - 1) / c.stride), 1e-4) << "query block " << i;
  }
  SelectRule rule;
  rule.thresholds.assign(c.hq, 0.85);
  rule.causal = c.causal;
  rule.q_len = c.lq;
  rule.k_len = c.lk;
  EXPECT_EQ(to_vector(e.mask), expected_mask(e.sums, rule));
}

std::vector<EstimateCase> estimate_cases() {
  return {
      // Lengths that are multiples of stride, 128 and chunk_size, and that are not.
      {"len256_chunk256_stride8", 1, 2, 2, 256, 256, 16, 8, 256, true},
      {"len512_chunk256_stride4", 1, 2, 1, 512, 512, 16, 4, 256, true},
      {"len300_stride8_not_mult128", 1, 2, 2, 300, 300, 16, 8, 256, true},
      {"len333_not_mult_stride", 1, 2, 2, 333, 333, 16, 8, 256, true},
      {"len141_stride16", 2, 2, 2, 141, 141, 8, 16, 128, true},
      {"len1_single_row", 1, 1, 1, 1, 1, 8, 8, 128, true},
      // Lq < Lk at offsets that are and are not whole blocks or strides.
      {"q128_k384_offset256", 1, 2, 2, 128, 384, 16, 8, 256, true},
      {"q100_k357_offset257", 1, 2, 2, 100, 357, 16, 8, 256, true},
      {"q200_k201_offset1", 1, 2, 1, 200, 201, 16, 8, 128, true},
      {"q5_k700_offset695", 1, 1, 1, 5, 700, 16, 8, 256, true},
      // GQA groups 1, 4, 8.
      {"gqa1_hq4_hkv4", 1, 4, 4, 260, 260, 16, 8, 256, true},
      {"gqa4_hq8_hkv2", 2, 8, 2, 260, 300, 16, 8, 256, true},
      {"gqa8_hq8_hkv1", 1, 8, 1, 260, 260, 16, 8, 256, true},
      // Without the causal mask.
      {"noncausal_len300", 1, 2, 2, 300, 300, 16, 8, 256, false},
      {"noncausal_q77_k333", 1, 4, 2, 77, 333, 16, 4, 128, false},
      {"noncausal_q300_k140_more_queries_than_keys", 1, 2, 1, 300, 140, 16, 8, 256, false},
  };
}

std::vector<EstimateCase> on_cpu_backend(std::vector<EstimateCase> v) {
  for (EstimateCase& c : v) c.backend = Backend::kNative;
  return v;
}

INSTANTIATE_TEST_SUITE_P(Cases, XAttnEstimate, ::testing::ValuesIn(estimate_cases()),
                         [](const auto& info) { return info.param.name; });
INSTANTIATE_TEST_SUITE_P(CpuBackend, XAttnEstimate,
                         ::testing::ValuesIn(on_cpu_backend(estimate_cases())),
                         [](const auto& info) { return info.param.name; });

TEST(XAttnEstimateLayout, TransposedBLHDViewEqualsContiguous) {
  auto rng = make_rng();
  const int64_t B = 2, H = 4, Hkv = 2, L = 200, D = 16;
  Tensor q_blhd = random_tensor({B, L, H, D}, DType::kF16, rng);
  Tensor k_blhd = random_tensor({B, L, Hkv, D}, DType::kF16, rng);
  // [B, L, H, D] seen as [B, H, L, D] without a copy.
  TensorView q = q_blhd.view().as_strided({B, H, L, D}, {L * H * D, D, H * D, 1});
  TensorView k = k_blhd.view().as_strided({B, Hkv, L, D}, {L * Hkv * D, D, Hkv * D, 1});
  for (Backend backend : kHostBackends) {
    const Estimated e = run_estimate(q, k, opts(8, 16384, backend));
    EXPECT_TRUE(all_close(e.sums, expected_sums(q, k, 128, 8, 1.0, true), 1e-6, 1e-5))
        << backend_name(backend);
  }
}

TEST(XAttnEstimateLayout, StridedOutputsAreWrittenThroughTheirStrides) {
  auto rng = make_rng();
  Tensor q = random_tensor({1, 2, 260, 16}, DType::kBF16, rng);
  Tensor k = random_tensor({1, 2, 260, 16}, DType::kBF16, rng);
  // Outputs as the transposes of [B, k_blocks, H, q_blocks] buffers.
  Tensor sums_buf = Tensor::empty({1, 3, 2, 3}, DType::kF32);
  Tensor mask_buf = Tensor::empty({1, 3, 2, 3}, DType::kBool);
  TensorView sums = sums_buf.view().as_strided({1, 2, 3, 3}, {18, 3, 1, 6});
  TensorView mask = mask_buf.view().as_strided({1, 2, 3, 3}, {18, 3, 1, 6});
  for (Backend backend : kHostBackends) {
    poison(sums_buf);
    xattn_estimate(q, k, sums, mask, opts(8, 16384, backend));
    EXPECT_TRUE(all_close(sums, expected_sums(q, k, 128, 8, 1.0, true), 1e-6, 1e-5))
        << backend_name(backend);
  }
}

TEST(XAttnEstimateNorm, NormDividesTheScores) {
  auto rng = make_rng();
  Tensor q = random_tensor({1, 2, 256, 16}, DType::kBF16, rng, -3.f, 3.f);
  Tensor k = random_tensor({1, 2, 384, 16}, DType::kBF16, rng, -3.f, 3.f);
  for (Backend backend : kHostBackends) {
    XAttnEstimateOptions o = opts(8, 16384, backend);
    o.norm = 0.5;
    const Estimated e = run_estimate(q, k, o);
    EXPECT_TRUE(all_close(e.sums, expected_sums(q, k, 128, 8, 0.5, true), 1e-6, 1e-5))
        << backend_name(backend);
  }
}

TEST(XAttnEstimateChunked, ChunkAgainstEarlierKeysEqualsFullPrefillRows) {
  auto rng = make_rng();
  const int64_t L = 700, H = 4, Hkv = 2, D = 16;
  Tensor q = random_tensor({1, H, L, D}, DType::kBF16, rng, -2.f, 2.f);
  Tensor k = random_tensor({1, Hkv, L, D}, DType::kBF16, rng, -2.f, 2.f);
  XAttnEstimateOptions o = opts(8, 256);
  o.keep_sink = true;
  const Estimated full = run_estimate(q, k, o);
  // Chunks start on 128-token boundaries, end on one or at the prompt's end; chunk_size
  // differs from the chunk length on purpose (it never changes a result).
  for (auto [start, end] :
       {std::pair<int64_t, int64_t>{0, 256}, {256, 384}, {384, 700}, {128, 700}, {640, 700}}) {
    SCOPED_TRACE("chunk [" + std::to_string(start) + ", " + std::to_string(end) + ")");
    TensorView qc = q.view().narrow(2, start, end - start);
    TensorView kc = k.view().narrow(2, 0, end);
    const Estimated part = run_estimate(qc, kc, o);
    const int64_t qb0 = start / 128, nqb = part.sums.shape()[2], nkb = part.sums.shape()[3];
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < nqb; ++i)
        for (int64_t j = 0; j < full.sums.shape()[3]; ++j) {
          const double fs = get(full.sums, {0, h, qb0 + i, j});
          const double fm = get(full.mask, {0, h, qb0 + i, j});
          if (j < nkb) {
            ASSERT_EQ(get(part.sums, {0, h, i, j}), fs) << h << " " << i << " " << j;
            ASSERT_EQ(get(part.mask, {0, h, i, j}), fm) << h << " " << i << " " << j;
          } else {
            ASSERT_EQ(fs, 0.0);  // the full prompt's rows never see the chunk's future
            ASSERT_EQ(fm, 0.0);
          }
        }
  }
}

TEST(XAttnEstimateChunked, ChunkSizeNeverChangesTheResult) {
  auto rng = make_rng();
  Tensor q = random_tensor({1, 2, 600, 16}, DType::kBF16, rng);
  Tensor k = random_tensor({1, 2, 650, 16}, DType::kBF16, rng);
  const Estimated a = run_estimate(q, k, opts(8, 128));
  const Estimated b = run_estimate(q, k, opts(8, 16384));
  EXPECT_EQ(to_vector(a.sums), to_vector(b.sums));
  EXPECT_EQ(to_vector(a.mask), to_vector(b.mask));
}

// ---------------------------------------------------------------------------------------
// Selection through the estimate: threshold extremes, sink/recent, per-head thresholds
// ---------------------------------------------------------------------------------------

TEST(XAttnEstimateSelect, ThresholdOneKeepsEveryCausalBlock) {
  auto rng = make_rng();
  const int64_t Lq = 300, Lk = 500;
  Tensor q = random_tensor({1, 2, Lq, 16}, DType::kBF16, rng, -4.f, 4.f);
  Tensor k = random_tensor({1, 2, Lk, 16}, DType::kBF16, rng, -4.f, 4.f);
  XAttnEstimateOptions o = opts();
  o.threshold = 1.0;
  const Estimated e = run_estimate(q, k, o);
  for (int64_t i = 0; i < 3; ++i)
    for (int64_t j = 0; j < 4; ++j) {
      const int64_t last_key = (Lk - Lq) + std::min<int64_t>(128 * i + 127, Lq - 1);
      EXPECT_EQ(get(e.mask, {0, 1, i, j}), j <= last_key / 128 ? 1.0 : 0.0) << i << " " << j;
    }
}

TEST(XAttnEstimateSelect, ThresholdNearZeroKeepsOnlyForcedBlocks) {
  auto rng = make_rng();
  Tensor q = random_tensor({1, 2, 640, 16}, DType::kBF16, rng);
  Tensor k = random_tensor({1, 2, 640, 16}, DType::kBF16, rng);
  for (bool sink : {false, true}) {
    XAttnEstimateOptions o = opts();
    o.threshold = 1e-9;
    o.keep_sink = sink;
    const Estimated e = run_estimate(q, k, o);
    for (int64_t i = 0; i < 5; ++i)
      for (int64_t j = 0; j < 5; ++j) {
        const bool forced = j == i || (sink && j == 0);
        EXPECT_EQ(get(e.mask, {0, 0, i, j}), forced ? 1.0 : 0.0) << sink << " " << i << " " << j;
      }
  }
}

TEST(XAttnEstimateSelect, PerHeadThresholdsApplyToTheirHead) {
  auto rng = make_rng();
  Tensor q = random_tensor({1, 4, 512, 16}, DType::kBF16, rng, -3.f, 3.f);
  Tensor k = random_tensor({1, 2, 512, 16}, DType::kBF16, rng, -3.f, 3.f);
  XAttnEstimateOptions o = opts();
  o.head_thresholds = {0.0, 0.5, 0.9, 1.0};
  const Estimated e = run_estimate(q, k, o);
  SelectRule rule;
  rule.thresholds = o.head_thresholds;
  rule.q_len = rule.k_len = 512;
  EXPECT_EQ(to_vector(e.mask), expected_mask(e.sums, rule));
  // Head 3 (threshold 1) is dense causal, head 0 (threshold 0) is the diagonal only.
  for (int64_t i = 0; i < 4; ++i)
    for (int64_t j = 0; j < 4; ++j) {
      EXPECT_EQ(get(e.mask, {0, 3, i, j}), j <= i ? 1.0 : 0.0);
      EXPECT_EQ(get(e.mask, {0, 0, i, j}), j == i ? 1.0 : 0.0);
    }
}

TEST(XAttnEstimateSelect, NonCausalKeepRecentAndSinkForceTheirBlocks) {
  auto rng = make_rng();
  Tensor q = random_tensor({1, 2, 256, 16}, DType::kBF16, rng);
  Tensor k = random_tensor({1, 2, 640, 16}, DType::kBF16, rng);
  XAttnEstimateOptions o = opts();
  o.causal = false;
  o.keep_recent = true;
  o.keep_sink = true;
  o.threshold = 0.0;
  const Estimated e = run_estimate(q, k, o);
  // Queries sit at positions 384..639: their diagonal blocks are 3 and 4.
  for (int64_t i = 0; i < 2; ++i)
    for (int64_t j = 0; j < 5; ++j)
      EXPECT_EQ(get(e.mask, {0, 1, i, j}), (j == 0 || j == 3 + i) ? 1.0 : 0.0) << i << " " << j;
}

// ---------------------------------------------------------------------------------------
// find_blocks_chunked on given sums
// ---------------------------------------------------------------------------------------

Tensor run_find_blocks(const TensorView& sums, const FindBlocksOptions& o) {
  Tensor mask = Tensor::empty(sums.shape(), DType::kBool);
  std::fill_n(mask.data_as<uint8_t>(), mask.numel(), uint8_t{0x5a});
  find_blocks_chunked(sums, mask, o);
  return mask;
}

FindBlocksOptions find_opts() {
  FindBlocksOptions o;
  o.backend = Backend::kReference;
  return o;
}

TEST(FindBlocksChunked, RandomSumsMatchTheSelectionRule) {
  auto rng = make_rng();
  for (bool causal : {true, false}) {
    for (bool sink : {false, true}) {
      Tensor sums = random_tensor({2, 3, 5, 9}, DType::kF32, rng, 0.f, 1.f);
      FindBlocksOptions o = find_opts();
      o.causal = causal;
      o.keep_sink = sink;
      o.keep_recent = !sink;
      o.head_thresholds = {0.3, 0.7, 0.95};
      o.q_len = 600;
      o.k_len = 1100;
      SelectRule rule;
      rule.thresholds = o.head_thresholds;
      rule.causal = causal;
      rule.keep_sink = sink;
      rule.keep_recent = !sink;
      rule.q_len = 600;
      rule.k_len = 1100;
      EXPECT_EQ(to_vector(run_find_blocks(sums, o)), expected_mask(sums, rule))
          << "causal " << causal << " sink " << sink;
    }
  }
}

TEST(FindBlocksChunked, SeedExampleSelectsFourBlocks) {
  // The seed's worked example: [0.05, 0.30, 0.40, 0.15, 0.10] at 0.9 keeps blocks 2, 1, 3, 4.
  Tensor sums = Tensor::empty({1, 1, 1, 5}, DType::kF32);
  const float v[] = {0.05f, 0.30f, 0.40f, 0.15f, 0.10f};
  std::copy(v, v + 5, sums.data_as<float>());
  FindBlocksOptions o = find_opts();
  o.causal = false;
  EXPECT_EQ(to_vector(run_find_blocks(sums, o)), (std::vector<double>{0, 1, 1, 1, 1}));
}

TEST(FindBlocksChunked, TiesGoToTheLowerBlockIndex) {
  // Four equal non-forced blocks; 0.5 of the mass needs two of them: blocks 1 and 2 (lowest).
  Tensor sums = Tensor::empty({1, 1, 1, 5}, DType::kF32);
  const float v[] = {0.25f, 0.25f, 0.25f, 0.25f, 0.0f};
  std::copy(v, v + 5, sums.data_as<float>());
  FindBlocksOptions o = find_opts();
  o.causal = false;
  o.keep_sink = true;
  o.threshold = 0.6;
  // Forced block 0 counts first (0.25), then ties 1, 2 in index order: before block 2 the sum
  // is 0.5 < 0.6, before block 3 it is 0.75.
  EXPECT_EQ(to_vector(run_find_blocks(sums, o)), (std::vector<double>{1, 1, 1, 0, 0}));
}

TEST(FindBlocksChunked, DefaultLengthsPlaceTheDiagonalBottomRight) {
  // 2 query blocks against 4 key blocks without lengths: the diagonal of row i is block 2 + i.
  Tensor sums = Tensor::empty({1, 1, 2, 4}, DType::kF32);
  std::fill_n(sums.data_as<float>(), 8, 1.0f);
  FindBlocksOptions o = find_opts();
  o.threshold = 0.0;
  EXPECT_EQ(to_vector(run_find_blocks(sums, o)), (std::vector<double>{0, 0, 1, 0, 0, 0, 0, 1}));
}

TEST(FindBlocksChunked, BlocksPastTheCausalLimitAreNeverKept) {
  // Large sums beyond the limit (which the estimate never produces) still stay unselected.
  Tensor sums = Tensor::empty({1, 1, 2, 4}, DType::kF32);
  const float v[] = {0.1f, 0.2f, 5.0f, 7.0f, 0.1f, 0.2f, 5.0f, 7.0f};
  std::copy(v, v + 8, sums.data_as<float>());
  FindBlocksOptions o = find_opts();
  o.threshold = 1.0;
  o.q_len = 200;
  o.k_len = 450;  // row 127 sits at position 377 (block 2), row 199 at 449 (block 3)
  EXPECT_EQ(to_vector(run_find_blocks(sums, o)), (std::vector<double>{1, 1, 1, 0, 1, 1, 1, 1}));
  o.threshold = 0.0;
  EXPECT_EQ(to_vector(run_find_blocks(sums, o)), (std::vector<double>{0, 0, 1, 0, 0, 0, 0, 1}));
}

}  // namespace
}  // namespace sparse_attn
