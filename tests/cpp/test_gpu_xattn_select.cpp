// Native find_blocks_chunked against the reference on the same sums: the mask is bool, so every
// byte must be equal, and so must the gaps of strided masks (both buffers poisoned with 0xff
// first, which also shows that every element is written). Sums are drawn for the hard parts of
// the selection: exact ties (a few distinct values), zeros of both signs, infinities, negative
// sums, rows of 1 to 16384 blocks, causal rows that span several sort tiers, more heads than
// one launch takes, and a captured graph replayed on new sums. NaN rows are checked against
// their documented mask, not the reference (whose std::sort has no strict weak order there).
// Every case skips cleanly without a GPU.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "gpu_test_util.h"
#include "sparse_attn/errors.h"
#include "sparse_attn/xattn.h"
#include "test_util.h"

namespace sparse_attn {
namespace {

using testing::make_rng;
using testing::to_device;

constexpr float kInf = std::numeric_limits<float>::infinity();

enum class Sums {
  kTies,      // a few distinct values (+0, -0, powers of two, 1e-30): ties everywhere
  kZeros,     // every sum +0: the tie rule alone orders the row
  kUniform,   // uniform floats: ties rare
  kInfinite,  // ties plus +inf and -inf (a row with both has T = NaN: forced blocks only)
  kSigned,    // ties plus negative sums (C can fall again after reaching R)
};

float draw(Sums kind, std::mt19937_64& rng) {
  static const float ties[] = {0.f, -0.f, 0.125f, 0.25f, 0.5f, 1.f, 3.f, 1e-30f};
  const auto pick = [&](int n) { return static_cast<int>(rng() % static_cast<uint64_t>(n)); };
  switch (kind) {
    case Sums::kTies:
      return ties[pick(8)];
    case Sums::kZeros:
      return 0.f;
    case Sums::kUniform:
      return std::uniform_real_distribution<float>(0.f, 1.f)(rng);
    case Sums::kInfinite: {
      const int i = pick(200);
      return i == 0 ? kInf : i == 1 ? -kInf : ties[i % 8];
    }
    case Sums::kSigned: {
      static const float signed_values[] = {-1.f, -0.5f, -0.f, 0.25f, 1.f, 2.f};
      return signed_values[pick(6)];
    }
  }
  return 0.f;
}

struct Case {
  std::string name;
  Shape shape;  // [B, H, q_blocks, k_blocks]
  Sums sums = Sums::kTies;
  std::vector<double> thresholds;  // one: the threshold; else one per head
  bool causal = true;
  bool keep_sink = false;
  bool keep_recent = false;
  std::optional<int64_t> q_len, k_len;  // in tokens, block_size 128
  bool strided = false;  // both views strided: last axis step 2, padded rows, an offset
};

// Row-major, or with the last axis stepped by 2, 3 extra elements after every row and batch
// entry, and the view starting 5 elements into its buffer.
struct Layout {
  Shape strides;
  int64_t offset = 0;
  int64_t buffer_elems = 0;
};

Layout make_layout(const Shape& shape, bool strided) {
  Layout l{Shape(shape.size()), strided ? 5 : 0, 0};
  int64_t stride = strided ? 2 : 1;
  for (int d = static_cast<int>(shape.size()) - 1; d >= 0; --d) {
    l.strides[d] = stride;
    stride = stride * shape[d] + (strided ? 3 : 0);
  }
  l.buffer_elems = l.offset + 1;
  for (size_t d = 0; d < shape.size(); ++d) l.buffer_elems += (shape[d] - 1) * l.strides[d];
  return l;
}

FindBlocksOptions options_for(const Case& c) {
  FindBlocksOptions o;
  if (c.thresholds.size() == 1) {
    o.threshold = c.thresholds[0];
  } else {
    o.head_thresholds = c.thresholds;
  }
  o.causal = c.causal;
  o.keep_sink = c.keep_sink;
  o.keep_recent = c.keep_recent;
  o.q_len = c.q_len;
  o.k_len = c.k_len;
  return o;
}

// The sums of a case in a host buffer laid out as `l`, and the same buffer on the device.
struct SumsPair {
  Tensor host_buf, dev_buf;
  TensorView host, dev;
};

SumsPair make_sums(const Case& c, const Layout& l, std::mt19937_64& rng) {
  Tensor buf = Tensor::empty({l.buffer_elems}, DType::kF32);
  for (int64_t i = 0; i < l.buffer_elems; ++i) buf.data_as<float>()[i] = draw(c.sums, rng);
  SumsPair s{buf, to_device(buf), {}, {}};
  s.host = s.host_buf.view().as_strided(c.shape, l.strides, l.offset);
  s.dev = s.dev_buf.view().as_strided(c.shape, l.strides, l.offset);
  return s;
}

// A bool view over a byte buffer poisoned with 0xff, on the host and on the device.
struct MaskPair {
  Tensor host_buf, dev_buf;
  TensorView host, dev;
};

MaskPair make_mask(const Shape& shape, const Layout& l) {
  Tensor buf = Tensor::empty({l.buffer_elems}, DType::kU8);
  testing::poison(buf.view());
  MaskPair m{buf, to_device(buf), {}, {}};
  const auto as_bool = [&](const Tensor& t) {
    return TensorView(t.data(), DType::kBool, t.device(), {l.buffer_elems})
        .as_strided(shape, l.strides, l.offset);
  };
  m.host = as_bool(m.host_buf);
  m.dev = as_bool(m.dev_buf);
  return m;
}

// The whole device buffer, gaps included, must equal the reference's buffer byte for byte.
void expect_same_masks(const MaskPair& m, const Shape& shape, const std::string& what) {
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const Tensor native = Tensor::to_host(m.dev_buf.view());
  const auto* a = native.data_as<uint8_t>();
  const auto* e = m.host_buf.data_as<uint8_t>();
  for (int64_t i = 0; i < native.numel(); ++i) {
    if (a[i] != e[i]) {
      FAIL() << what << " " << shape_str(shape.data(), static_cast<int>(shape.size()))
             << ": first difference at buffer byte " << i << ": native " << int{a[i]}
             << ", reference " << int{e[i]};
    }
  }
}

void run_reference(const TensorView& sums, const TensorView& mask, FindBlocksOptions o) {
  o.backend = Backend::kReference;
  find_blocks_chunked(sums, mask, o);
}

class GpuXAttnSelect : public ::testing::TestWithParam<Case> {};

TEST_P(GpuXAttnSelect, MatchesReferenceBitwise) {
  SPARSE_ATTN_REQUIRE_GPU();
  const Case& c = GetParam();
  auto rng = make_rng();
  const Layout sums_layout = make_layout(c.shape, c.strided);
  const Layout mask_layout = make_layout(c.shape, c.strided);
  const SumsPair sums = make_sums(c, sums_layout, rng);
  const MaskPair mask = make_mask(c.shape, mask_layout);
  const FindBlocksOptions o = options_for(c);
  run_reference(sums.host, mask.host, o);
  find_blocks_chunked(sums.dev, mask.dev, o);
  expect_same_masks(mask, c.shape, c.name);
}

std::vector<Case> select_cases() {
  const std::vector<double> four = {0.0, 0.5, 0.9, 1.0};
  std::vector<Case> cases = {
      {"kb1_causal", {2, 3, 1, 1}, Sums::kTies, {0.9}},
      {"kb1_sink", {1, 2, 1, 1}, Sums::kTies, {0.5}, false, true},
      {"kb7_causal_half", {2, 2, 7, 7}, Sums::kTies, {0.5}},
      {"kb7_sink_recent_qlen", {2, 2, 3, 7}, Sums::kTies, {0.9}, false, true, true, 300, 850},
      {"kb7_zeros", {1, 4, 7, 7}, Sums::kZeros, four},
      {"kb256_causal_heads", {2, 4, 256, 256}, Sums::kTies, four},
      {"kb256_zeros_noncausal", {1, 4, 16, 256}, Sums::kZeros, four, false},
      {"kb256_strided_sink",
       {2, 3, 9, 256},
       Sums::kTies,
       {0.9, 0.0, 1.0},
       true,
       true,
       false,
       1100,
       32700,
       true},
      {"kb256_signed", {1, 4, 32, 256}, Sums::kSigned, four, false, true, true},
      {"kb256_infinite", {1, 4, 32, 256}, Sums::kInfinite, four},
      {"kb1500_causal_square", {1, 1, 1500, 1500}, Sums::kTies, {0.9}},  // tiers 256, 1K, 4K
      {"kb1500_last_queries",
       {1, 2, 12, 1500},
       Sums::kTies,
       {0.5, 0.9},
       true,
       false,
       false,
       1500,
       191923},
      {"kb1500_uniform_strided",
       {2, 2, 5, 1500},
       Sums::kUniform,
       {0.9},
       false,
       false,
       true,
       std::nullopt,
       std::nullopt,
       true},
      {"kb8192_causal",
       {1, 2, 4, 8192},
       Sums::kTies,
       {0.9, 0.5},
       true,
       false,
       false,
       512,
       8192 * 128},
      {"kb8192_infinite", {1, 2, 3, 8192}, Sums::kInfinite, {0.9}, false, true, true},
      {"kb16384_causal_heads", {1, 4, 2, 16384}, Sums::kTies, four},
      {"kb16384_zeros_strided",
       {1, 2, 2, 16384},
       Sums::kZeros,
       {0.9},
       false,
       true,
       true,
       std::nullopt,
       std::nullopt,
       true},
      {"kb16384_uniform", {1, 1, 2, 16384}, Sums::kUniform, {0.9}, false},
  };
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Cases, GpuXAttnSelect, ::testing::ValuesIn(select_cases()),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           return info.param.name;
                         });

// More heads than one launch's thresholds (256), per-head thresholds, in a captured graph that
// is replayed after the sums change: the graph holds the thresholds, not the sums.
TEST(GpuXAttnSelectGraph, ReplayOnNewSumsMatchesReference) {
  SPARSE_ATTN_REQUIRE_GPU();
  auto rng = make_rng();
  Case c{"graph", {2, 300, 3, 7}, Sums::kTies, {}, true, true};
  for (int h = 0; h < 300; ++h) c.thresholds.push_back((h % 5) * 0.25);
  const Layout l = make_layout(c.shape, false);
  SumsPair sums = make_sums(c, l, rng);
  const MaskPair mask = make_mask(c.shape, l);
  FindBlocksOptions o = options_for(c);
  testing::CapturedGraph graph([&](cudaStream_t stream) {
    FindBlocksOptions so = o;
    so.stream = stream;
    find_blocks_chunked(sums.dev, mask.dev, so);
  });
  ASSERT_TRUE(graph.ok());
  const SumsPair fresh = make_sums(c, l, rng);
  copy_into(sums.dev_buf.view(), fresh.host_buf.view());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  testing::poison(mask.host_buf.view());
  ASSERT_EQ(cudaMemset(mask.dev_buf.data(), 0xff, static_cast<size_t>(l.buffer_elems)),
            cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);  // the graph's stream does not wait for it
  ASSERT_EQ(graph.replay(), cudaSuccess);
  run_reference(fresh.host, mask.host, o);
  expect_same_masks(mask, c.shape, c.name);
}

// A NaN among a row's eligible sums makes T and R NaN: only forced blocks are kept, or every
// eligible block at threshold 1 (src/cuda/xattn/find_blocks.cu). Every row holds a NaN.
TEST(GpuXAttnSelectNaN, RowsWithNaNKeepForcedBlocks) {
  SPARSE_ATTN_REQUIRE_GPU();
  auto rng = make_rng();
  const Shape shape = {1, 2, 4, 300};
  Case c{"nan", shape, Sums::kTies, {0.5, 1.0}, true, true};
  const Layout l = make_layout(shape, false);
  SumsPair sums = make_sums(c, l, rng);
  auto* host = sums.host_buf.data_as<float>();
  for (int64_t row = 0; row < 2 * 4; ++row) {
    host[row * 300 + static_cast<int64_t>(rng() % 200)] = std::nanf("");
  }
  copy_into(sums.dev_buf.view(), sums.host_buf.view());
  const MaskPair mask = make_mask(shape, l);
  find_blocks_chunked(sums.dev, mask.dev, options_for(c));
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const Tensor got = Tensor::to_host(mask.dev_buf.view());
  // 4 query blocks at the end of 300 key blocks: query block i's diagonal is key block 296 + i.
  for (int64_t h = 0; h < 2; ++h) {
    for (int64_t i = 0; i < 4; ++i) {
      const int64_t diagonal = 296 + i;
      for (int64_t j = 0; j < 300; ++j) {
        const bool eligible = j <= diagonal;
        const bool want = h == 1 ? eligible : (j == 0 || j == diagonal);
        ASSERT_EQ(got.data_as<uint8_t>()[(h * 4 + i) * 300 + j], want ? 1 : 0)
            << "head " << h << " query block " << i << " key block " << j;
      }
    }
  }
}

TEST(GpuXAttnSelectLimits, MoreKeyBlocksThanTheLargestSortIsNotSupported) {
  SPARSE_ATTN_REQUIRE_GPU();
  const Shape shape = {1, 1, 1, 16385};
  Tensor sums = Tensor::empty(shape, DType::kF32, Device::cuda(0));
  Tensor mask = Tensor::empty(shape, DType::kBool, Device::cuda(0));
  testing::expect_error<NotSupportedError>([&] { find_blocks_chunked(sums, mask, {}); },
                                           "attn_sums");
}

}  // namespace
}  // namespace sparse_attn
