// Native (CUDA) selection helpers against the CPU reference run on the same inputs: the outputs
// are integer ids, so every element must be equal, and so must the untouched gaps of strided
// outputs (poisoned first). Inputs are built for the hard parts of top-k: many ties (quantised
// scores, a constant row), -inf/+inf/NaN, -0 next to +0, denormals, causal -inf runs and empty
// rows, k above N_B, rows of 32K blocks, selections too large for shared memory, strided and
// batched views. Every case skips cleanly without a GPU.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "gpu_test_util.h"
#include "sparse_attn/errors.h"
#include "sparse_attn/qsa_select.h"
#include "test_util.h"

namespace sparse_attn {
namespace {

using testing::make_rng;
using testing::to_device;

constexpr float kInf = std::numeric_limits<float>::infinity();

// A logical tensor's place in a flat buffer: shape, strides and offset in elements.
struct Layout {
  Shape shape;
  Shape strides;
  int64_t offset = 0;

  int64_t buffer_elems() const {
    int64_t last = offset;
    for (size_t d = 0; d < shape.size(); ++d) {
      if (shape[d] == 0) return offset + 1;
      last += (shape[d] - 1) * strides[d];
    }
    return last + 1;
  }
};

// Row-major, or with the last axis stepped by `col_stride`, `pad` extra elements after each
// row and after each batch entry, and the view starting `offset` elements into its buffer.
Layout make_layout(const Shape& shape, bool strided) {
  Layout l{shape, Shape(shape.size()), strided ? 5 : 0};
  const int64_t col_stride = strided ? 2 : 1, pad = strided ? 3 : 0;
  int64_t stride = col_stride;
  for (int d = static_cast<int>(shape.size()) - 1; d >= 0; --d) {
    l.strides[d] = stride;
    stride = stride * std::max<int64_t>(shape[d], 1) + pad;  // positive even when empty
  }
  return l;
}

// One logical tensor held twice with the same layout: in a host buffer (for the reference) and
// in a device buffer (for the native kernels).
struct Mirrored {
  Tensor host_buf, dev_buf;
  TensorView host, dev;
};

Mirrored mirror(const Tensor& host_buf, const Layout& l) {
  Mirrored m{host_buf, to_device(host_buf), {}, {}};
  m.host = m.host_buf.view().as_strided(l.shape, l.strides, l.offset);
  m.dev = m.dev_buf.view().as_strided(l.shape, l.strides, l.offset);
  return m;
}

// An int32 output: both buffers poisoned, gaps included.
Mirrored poisoned_output(const Layout& l) {
  Tensor buf = Tensor::empty({l.buffer_elems()}, DType::kI32);
  testing::poison(buf.view());
  return mirror(buf, l);
}

// The native result (whole device buffer, gaps included) must equal the reference's buffer.
void expect_same_buffers(const Mirrored& m, const std::string& what) {
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const Tensor native = Tensor::to_host(m.dev_buf.view());
  const auto* a = native.data_as<int32_t>();
  const auto* e = m.host_buf.data_as<int32_t>();
  for (int64_t i = 0; i < native.numel(); ++i) {
    if (a[i] != e[i]) {
      FAIL() << what << ": first difference at buffer element " << i << ": native " << a[i]
             << ", reference " << e[i];
    }
  }
}

// ---------------------------------------------------------------------------------------
// qsa_topk_blocks
// ---------------------------------------------------------------------------------------

enum class Scores {
  kQuantised,  // few distinct values, non-finite ones, -0/+0 and denormals: ties everywhere
  kDistinct,   // uniform floats: ties rare
  kCausal,     // quantised, row r sees a prefix of about r / rows of the blocks (row 0: none)
  kConstant,   // every score equal: the whole selection is decided by the tie rule
  kBits,       // every 32-bit pattern alike: NaN payloads of both signs, denormals, infinities
  kNarrow,     // distinct values in [1, 1 + 2^-8): one bin of the first radix digit holds them all
  kTies,       // 65 finite values: bins linear in value hold runs of equal scores
  kSpecials,   // kQuantised without +-FLT_MAX: a finite range, so rows of it are binned by value
  kAlternate,  // even rows kDistinct, odd rows kTies
};

float quantised(std::mt19937_64& rng, bool extremes = true) {
  static const float special[] = {-kInf,         kInf,    NAN,     -0.f,     0.f,   FLT_TRUE_MIN,
                                  -FLT_TRUE_MIN, FLT_MIN, FLT_MAX, -FLT_MAX, 0.25f, -1.5f};
  std::uniform_int_distribution<int> pick(0, 3 * 12 - 1);
  const int i = pick(rng);
  if (i < 12) return extremes || std::fabs(special[i]) != FLT_MAX ? special[i] : 0.5f;
  return static_cast<float>(i % 9 - 4) * 0.125f;
}

// Fills `view` ([rows, N_B] or [B, Q, N_B]) row by row.
void fill_scores(const TensorView& view, Scores kind, std::mt19937_64& rng) {
  const int64_t nb = view.size(-1), q = view.size(-2);
  const int64_t rows = nb == 0 ? 0 : view.numel() / nb;
  std::uniform_real_distribution<float> uniform(-8.f, 8.f);
  std::uniform_int_distribution<uint32_t> bits;
  std::uniform_real_distribution<float> narrow(0.f, 1.f);
  std::uniform_int_distribution<int> ties(-32, 32);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t visible = kind == Scores::kCausal ? r * nb / rows : nb;
    const Scores row_kind =
        kind == Scores::kAlternate ? (r % 2 ? Scores::kTies : Scores::kDistinct) : kind;
    for (int64_t j = 0; j < nb; ++j) {
      float s = row_kind == Scores::kDistinct   ? uniform(rng)
                : row_kind == Scores::kSpecials ? quantised(rng, false)
                : row_kind == Scores::kConstant ? 1.f
                : row_kind == Scores::kBits     ? std::bit_cast<float>(bits(rng))
                : row_kind == Scores::kNarrow   ? 1.f + std::ldexp(narrow(rng), -8)
                : row_kind == Scores::kTies     ? static_cast<float>(ties(rng)) * 0.125f
                                                : quantised(rng);
      if (j >= visible) s = -kInf;
      if (view.dim() == 3) {
        testing::set(view, {r / q, r % q, j}, s);
      } else {
        testing::set(view, {r, j}, s);
      }
    }
  }
}

// Scores in `layout`, gaps filled with FLT_MAX: a kernel reading a gap would select it.
Mirrored make_scores(const Layout& layout, Scores kind, std::mt19937_64& rng) {
  Tensor buf = Tensor::empty({layout.buffer_elems()}, DType::kF32);
  std::fill_n(buf.data_as<float>(), buf.numel(), FLT_MAX);
  fill_scores(buf.view().as_strided(layout.shape, layout.strides, layout.offset), kind, rng);
  return mirror(buf, layout);
}

struct TopkCase {
  std::string name;
  Shape shape;  // scores
  int64_t k;
  Scores kind;
  bool strided;
};

class GpuTopk : public ::testing::TestWithParam<TopkCase> {};

TEST_P(GpuTopk, MatchesReferenceExactly) {
  SPARSE_ATTN_REQUIRE_GPU();
  const TopkCase& c = GetParam();
  auto rng = make_rng();
  const Mirrored scores = make_scores(make_layout(c.shape, c.strided), c.kind, rng);
  const Mirrored out =
      poisoned_output(make_layout(qsa_topk_blocks_shape(scores.host, c.k), c.strided));
  qsa_topk_blocks(scores.dev, c.k, out.dev);
  qsa_topk_blocks(scores.host, c.k, out.host);
  expect_same_buffers(out, "qsa_topk_blocks");
}

std::vector<TopkCase> topk_cases() {
  using S = Scores;
  return {
      {"rows1_nb1_k1", {1, 1}, 1, S::kQuantised, false},
      {"rows7_nb37_k4_quantised", {7, 37}, 4, S::kQuantised, false},
      {"rows5_nb37_k64_k_above_nb", {5, 37}, 64, S::kQuantised, false},
      {"rows3_nb0_k5_no_blocks", {3, 0}, 5, S::kQuantised, false},
      {"rows0_nb10_k4_no_rows", {0, 10}, 4, S::kQuantised, false},
      {"rows64_nb1000_k512_quantised", {64, 1000}, 512, S::kQuantised, false},
      {"rows33_nb4099_k512_causal", {33, 4099}, 512, S::kCausal, false},
      {"rows40_nb1500_k512_causal", {40, 1500}, 512, S::kCausal, false},
      {"rows16_nb32773_k512_quantised", {16, 32773}, 512, S::kQuantised, false},
      {"rows16_nb32773_k2048_distinct", {16, 32773}, 2048, S::kDistinct, false},
      {"rows24_nb32768_k512_causal", {24, 32768}, 512, S::kCausal, false},
      {"rows4_nb32768_k512_constant", {4, 32768}, 512, S::kConstant, false},
      {"rows4_nb3000_k2999_constant", {4, 3000}, 2999, S::kConstant, false},
      // Every visible block kept (visible <= k): ordered by counting (distinct), or, with one
      // crowded range of equal scores, sorted instead (constant).
      {"rows4_nb3000_k4000_distinct_all_kept", {4, 3000}, 4000, S::kDistinct, false},
      {"rows4_nb1000_k1000_constant_all_kept", {4, 1000}, 1000, S::kConstant, false},
      {"b3_q5_nb777_k100_strided", {3, 5, 777}, 100, S::kQuantised, true},
      {"rows9_nb2500_k300_strided_distinct", {9, 2500}, 300, S::kDistinct, true},
      {"rows3000_nb64_k8_many_rows", {3000, 64}, 8, S::kQuantised, false},
      // Rows read once into registers (at most 16 scores a thread), binned linearly in value:
      // at the boundary (8192 at 512 threads a row), with equal scores in the bins taken (ties),
      // and in ManyRows CTAs (4096 at 256 threads).
      {"rows8_nb8192_k512_distinct_registers", {8, 8192}, 512, S::kDistinct, false},
      {"rows8_nb8193_k512_distinct_past_registers", {8, 8193}, 512, S::kDistinct, false},
      {"rows8_nb8192_k512_ties_registers", {8, 8192}, 512, S::kTies, false},
      {"rows8_nb5000_k2048_ties_crowded", {8, 5000}, 2048, S::kTies, false},
      // Between one and two rows an SM (132 SMs on an H100 or H200): FewRows CTAs, two an SM,
      // where fewer rows take RowPerSm's (the same code at more registers).
      {"rows200_nb8192_k512_distinct_two_an_sm", {200, 8192}, 512, S::kDistinct, false},
      {"rows200_nb8192_k512_alternate_two_an_sm", {200, 8192}, 512, S::kAlternate, false},
      {"rows1000_nb4096_k512_distinct_many_rows_registers", {1000, 4096}, 512, S::kDistinct, false},
      // Step 0 with infinities, NaN, -0 / +0 and denormals in its range (every score kept, and
      // a few), and a CTA's rows alternating between step 0 and its fallback (crowded ties).
      {"rows64_nb256_k256_specials_registers", {64, 256}, 256, S::kSpecials, false},
      {"rows64_nb256_k32_specials_registers", {64, 256}, 32, S::kSpecials, false},
      {"rows1000_nb4096_k2048_alternate_many_rows_registers",
       {1000, 4096},
       2048,
       S::kAlternate,
       false},
      // ManyRows CTAs (rows past two CTAs an SM) on long rows: the blocks above the threshold
      // bin and the bin's own fit the 4096 candidates (distinct), or do not (narrow, k = 4090:
      // ~4200 of them, so the blocks above the narrowed bin are taken during the row pass).
      {"rows600_nb20000_k512_distinct_many_rows", {600, 20000}, 512, S::kDistinct, false},
      {"rows600_nb20000_k4090_narrow_many_rows", {600, 20000}, 4090, S::kNarrow, false},
      {"rows16_nb32768_k512_random_bits", {16, 32768}, 512, S::kBits, false},
      {"rows8_nb32768_k512_narrow", {8, 32768}, 512, S::kNarrow, false},
      {"rows8_nb9000_k5000_narrow", {8, 9000}, 5000, S::kNarrow, false},
      {"rows3_nb40000_k20000_global_sort_random_bits", {3, 40000}, 20000, S::kBits, false},
      {"rows3_nb40000_k20000_global_sort", {3, 40000}, 20000, S::kDistinct, false},
      {"rows3_nb40000_k20000_global_sort_quantised", {3, 40000}, 20000, S::kQuantised, false},
      {"rows3_nb20000_k30000_global_sort_k_above_nb", {3, 20000}, 30000, S::kCausal, false},
      {"rows3_nb5000_k20000_shared_sort_k_above_nb", {3, 5000}, 20000, S::kQuantised, false},
  };
}

INSTANTIATE_TEST_SUITE_P(Cases, GpuTopk, ::testing::ValuesIn(topk_cases()),
                         [](const auto& info) { return info.param.name; });

TEST(GpuTopkRuns, RepeatedCallsAreBitwiseEqual) {
  SPARSE_ATTN_REQUIRE_GPU();
  auto rng = make_rng();
  const Layout l = make_layout({32, 8191}, false);
  const Mirrored scores = make_scores(l, Scores::kQuantised, rng);
  const Mirrored first = poisoned_output(make_layout({32, 512}, false));
  const Mirrored second = poisoned_output(make_layout({32, 512}, false));
  qsa_topk_blocks(scores.dev, 512, first.dev);
  qsa_topk_blocks(scores.dev, 512, second.dev);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const Tensor a = Tensor::to_host(first.dev_buf.view());
  const Tensor b = Tensor::to_host(second.dev_buf.view());
  EXPECT_EQ(std::memcmp(a.data(), b.data(), a.numel() * sizeof(int32_t)), 0);
}

TEST(GpuTopkRuns, DeviceOutputForHostScoresIsRejected) {
  SPARSE_ATTN_REQUIRE_GPU();
  Tensor scores = Tensor::empty({2, 8}, DType::kF32);
  Tensor out = Tensor::empty({2, 4}, DType::kI32, Device::cuda(0));
  try {
    qsa_topk_blocks(scores, 4, out);
    FAIL() << "expected ValueError";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("out"), std::string::npos) << e.what();
  }
}

// ---------------------------------------------------------------------------------------
// qsa_expand_blocks
// ---------------------------------------------------------------------------------------

struct ExpandCase {
  std::string name;
  Shape ids_shape;  // [rows, k] or [B, Q, k]
  bool with_blocks;
  bool strided;
};

class GpuExpand : public ::testing::TestWithParam<ExpandCase> {};

// Block ids from -2 to past the positions (future blocks), positions from -3 up, so every rule
// (padding, future blocks, each tail length, negative positions) is hit.
TEST_P(GpuExpand, MatchesReferenceExactly) {
  SPARSE_ATTN_REQUIRE_GPU();
  const ExpandCase& c = GetParam();
  auto rng = make_rng();
  const int64_t k = c.ids_shape.back();
  const int32_t max_pos = static_cast<int32_t>(8 * k + 8);
  const Layout ids_layout = make_layout(c.ids_shape, c.strided);
  Tensor ids_buf = Tensor::empty({ids_layout.buffer_elems()}, DType::kI32);
  std::fill_n(ids_buf.data_as<int32_t>(), ids_buf.numel(), 0);
  const Tensor ids_values = testing::random_int32(c.ids_shape, rng, -2, max_pos / 4 + 2);
  copy_into(ids_buf.view().as_strided(ids_layout.shape, ids_layout.strides, ids_layout.offset),
            ids_values.view());
  const Mirrored ids = mirror(ids_buf, ids_layout);

  const Shape rows_shape(c.ids_shape.begin(), c.ids_shape.end() - 1);
  const Tensor positions = testing::random_int32(rows_shape, rng, -3, max_pos);
  const Tensor dev_positions = to_device(positions);

  const Mirrored tokens =
      poisoned_output(make_layout(qsa_expand_blocks_token_shape(ids.host), c.strided));
  std::optional<Mirrored> blocks;
  if (c.with_blocks) blocks = poisoned_output(make_layout(c.ids_shape, c.strided));
  qsa_expand_blocks(ids.dev, dev_positions, tokens.dev,
                    blocks ? std::optional<TensorView>(blocks->dev) : std::nullopt);
  qsa_expand_blocks(ids.host, positions, tokens.host,
                    blocks ? std::optional<TensorView>(blocks->host) : std::nullopt);
  expect_same_buffers(tokens, "token_indices");
  if (blocks) expect_same_buffers(*blocks, "block_indices");
}

INSTANTIATE_TEST_SUITE_P(
    Cases, GpuExpand,
    ::testing::Values(ExpandCase{"rows1_k1", {1, 1}, true, false},
                      ExpandCase{"rows50_k3", {50, 3}, false, false},
                      ExpandCase{"rows5_k0_tail_only", {5, 0}, true, false},
                      ExpandCase{"rows200_k512_blocks", {200, 512}, true, false},
                      ExpandCase{"rows64_k2048", {64, 2048}, true, false},
                      ExpandCase{"b2_q7_k37_strided", {2, 7, 37}, true, true},
                      ExpandCase{"rows33_k100_strided_tokens_only", {33, 100}, false, true},
                      ExpandCase{"rows70000_k4_many_rows", {70000, 4}, true, false},
                      // More rows than one wave of CTAs (one warp a row), full rounds and a
                      // partial one.
                      ExpandCase{"rows5000_k600_many_rows", {5000, 600}, true, false},
                      ExpandCase{"b40_q100_k37_many_rows_strided", {40, 100, 37}, true, true}),
    [](const auto& info) { return info.param.name; });

// int64 block ids and positions (values past the int32 range among them: positions above
// INT32_MAX read as INT32_MAX, ids past it are never complete) give the reference's ids.
TEST(GpuExpandInt64, MatchesReferenceExactly) {
  SPARSE_ATTN_REQUIRE_GPU();
  auto rng = make_rng();
  const int64_t rows = 300, k = 40;
  std::vector<int64_t> ids(rows * k), pos(rows);
  std::uniform_int_distribution<int64_t> id(-3, 60), p(-5, 250), pick(0, 9);
  constexpr int64_t kBig = int64_t{1} << 40;
  for (auto& x : ids) x = pick(rng) == 0 ? (pick(rng) % 2 ? kBig : -kBig) : id(rng);
  for (int64_t r = 0; r < rows; ++r) {
    pos[r] = r % 50 == 7 ? kBig + r : (r % 50 == 8 ? int64_t{INT32_MAX} : p(rng));
  }
  const Tensor host_ids = testing::int64_tensor({rows, k}, ids);
  const Tensor host_pos = testing::int64_tensor({rows}, pos);
  const Tensor dev_ids = to_device(host_ids), dev_pos = to_device(host_pos);
  const Mirrored tokens = poisoned_output(make_layout({rows, 4 * k + 3}, false));
  const Mirrored blocks = poisoned_output(make_layout({rows, k}, false));
  qsa_expand_blocks(dev_ids, dev_pos, tokens.dev, blocks.dev);
  qsa_expand_blocks(host_ids, host_pos, tokens.host, blocks.host);
  expect_same_buffers(tokens, "token_indices");
  expect_same_buffers(blocks, "block_indices");
}

// ---------------------------------------------------------------------------------------
// Both, as a caller chains them, on a stream of its own
// ---------------------------------------------------------------------------------------

TEST(GpuSelectPipeline, TopkThenExpandOnAStreamMatchesReference) {
  SPARSE_ATTN_REQUIRE_GPU();
  auto rng = make_rng();
  const int64_t rows = 96, nb = 6000, k = kQsaTopkBlocks;
  const Mirrored scores = make_scores(make_layout({rows, nb}, false), Scores::kCausal, rng);
  // Row r's scores see about r * nb / rows blocks; its position is the last token of those.
  std::vector<int32_t> pos(rows);
  for (int64_t r = 0; r < rows; ++r) pos[r] = static_cast<int32_t>(4 * (r * nb / rows) + r % 4);
  const Tensor positions = testing::int32_tensor({rows}, pos);
  const Tensor dev_positions = to_device(positions);

  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  const Mirrored ids = poisoned_output(make_layout({rows, k}, false));
  const Mirrored tokens = poisoned_output(make_layout({rows, 4 * k + 3}, false));
  const Mirrored blocks = poisoned_output(make_layout({rows, k}, false));
  qsa_topk_blocks(scores.dev, k, ids.dev, stream);
  qsa_expand_blocks(ids.dev, dev_positions, tokens.dev, blocks.dev, stream);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  ASSERT_EQ(cudaStreamDestroy(stream), cudaSuccess);

  qsa_topk_blocks(scores.host, k, ids.host);
  qsa_expand_blocks(ids.host, positions, tokens.host, blocks.host);
  expect_same_buffers(ids, "block ids");
  expect_same_buffers(tokens, "token_indices");
  expect_same_buffers(blocks, "block_indices");
}

// Captured once into a CUDA graph, replayed after the scores and positions changed: the
// replay reads the current contents.
TEST(GpuSelectPipeline, GraphReplayReadsCurrentInputs) {
  SPARSE_ATTN_REQUIRE_GPU();
  auto rng = make_rng();
  const int64_t rows = 40, nb = 3000, k = kQsaTopkBlocks;
  const Layout l = make_layout({rows, nb}, false);
  const Mirrored scores = make_scores(l, Scores::kQuantised, rng);
  const Mirrored later = make_scores(l, Scores::kCausal, rng);
  const Tensor positions = testing::random_int32({rows}, rng, -3, int32_t(4 * nb + 3));
  const Tensor later_positions = testing::random_int32({rows}, rng, -3, int32_t(4 * nb + 3));
  const Tensor dev_positions = to_device(positions);
  const Mirrored ids = poisoned_output(make_layout({rows, k}, false));
  const Mirrored tokens = poisoned_output(make_layout({rows, 4 * k + 3}, false));
  const Mirrored blocks = poisoned_output(make_layout({rows, k}, false));

  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), cudaSuccess);
  qsa_topk_blocks(scores.dev, k, ids.dev, stream);
  qsa_expand_blocks(ids.dev, dev_positions, tokens.dev, blocks.dev, stream);
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);

  copy_into(scores.dev_buf.view(), later.host_buf.view());
  copy_into(dev_positions.view(), later_positions.view());
  ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  EXPECT_EQ(cudaGraphExecDestroy(exec), cudaSuccess);
  EXPECT_EQ(cudaGraphDestroy(graph), cudaSuccess);
  EXPECT_EQ(cudaStreamDestroy(stream), cudaSuccess);

  qsa_topk_blocks(later.host, k, ids.host);
  qsa_expand_blocks(ids.host, later_positions, tokens.host, blocks.host);
  expect_same_buffers(ids, "block ids");
  expect_same_buffers(tokens, "token_indices");
  expect_same_buffers(blocks, "block_indices");
}

}  // namespace
}  // namespace sparse_attn
