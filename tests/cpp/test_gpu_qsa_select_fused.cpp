// Native (CUDA) fused selections (qsa_indexer_select, qsa_mqa_decode_select) against the
// reference backend run on the same CUDA tensors: every form of select_fused_cases.h the native
// kernels take (H = 4, D = 128, R <= 4), quantised inputs (many ties), k from 1 to 2048, scratch
// budgets of 1, 7 and 64 rows per chunk and the default, a caller's workspace, outputs poisoned
// first (0x7f7f7f7f): the outputs are integers, so every element must be equal. Also CUDA graph
// capture and replay with changed metadata, and the native limits. Every case skips cleanly
// without a GPU.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "gpu_test_util.h"
#include "select_fused_cases.h"
#include "sparse_attn/errors.h"
#include "sparse_attn/qsa_select.h"
#include "test_util.h"

namespace sparse_attn {
namespace {

using testing::DecodeForm;
using testing::DecodeInputs;
using testing::IndexerForm;
using testing::IndexerInputs;
using testing::make_rng;
using testing::poisoned_device;
using testing::to_device;

Shape with_last(Shape s, int64_t last) {
  s.push_back(last);
  return s;
}

// A device copy of a host tensor, or nothing for an absent one.
Tensor device_copy(const Tensor& host) { return host.data() ? to_device(host) : Tensor(); }

// The three outputs of a selection over `rows` on the device, poisoned.
struct DeviceSelection {
  Tensor ids, tokens, counts;

  DeviceSelection(const Shape& rows, int64_t k)
      : ids(poisoned_device(with_last(rows, k), DType::kI32)),
        tokens(poisoned_device(with_last(rows, 4 * k + 3), DType::kI32)),
        counts(poisoned_device(rows, DType::kI32)) {}

  SelectOptions options(size_t budget) const {
    SelectOptions s;
    s.token_indices = tokens.view();
    s.valid_counts = counts.view();
    s.max_workspace_bytes = budget;
    return s;
  }
};

// Every element of the native outputs equals the reference's.
void expect_same(const DeviceSelection& native, const DeviceSelection& reference,
                 const std::string& what) {
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess) << what;
  const std::pair<const Tensor*, const Tensor*> pairs[] = {{&native.ids, &reference.ids},
                                                           {&native.tokens, &reference.tokens},
                                                           {&native.counts, &reference.counts}};
  const char* names[] = {"block_ids", "token_indices", "valid_counts"};
  for (int i = 0; i < 3; ++i) {
    const Tensor a = Tensor::to_host(pairs[i].first->view());
    const Tensor e = Tensor::to_host(pairs[i].second->view());
    for (int64_t j = 0; j < a.numel(); ++j) {
      if (a.data_as<int32_t>()[j] != e.data_as<int32_t>()[j]) {
        FAIL() << what << ": " << names[i] << " differs first at element " << j << ": native "
               << a.data_as<int32_t>()[j] << ", reference " << e.data_as<int32_t>()[j];
      }
    }
  }
}

// Budgets holding the scores of 1, 7 and 64 rows, and the default.
std::vector<size_t> budgets(int64_t num_blocks) {
  const size_t row = 4 * static_cast<size_t>(num_blocks);
  return {row, 7 * row, 64 * row, kQsaSelectWorkspaceBytes};
}

// A uint8 device workspace of at least `bytes` (16 when none is needed: a given workspace must
// still be a valid one).
Tensor workspace_of(size_t bytes) {
  return Tensor::empty({static_cast<int64_t>(std::max<size_t>(bytes, 16))}, DType::kU8,
                       Device::cuda(0));
}

// ---------------------------------------------------------------------------------------
// qsa_indexer_select
// ---------------------------------------------------------------------------------------

// An indexer call's tensors on the device; `options` views them.
struct DeviceIndexer {
  Tensor q, keys, table, cu, t2r, pos, lens;
  IndexerScoreOptions options;

  explicit DeviceIndexer(const IndexerInputs& in)
      : q(to_device(in.q)),
        keys(to_device(in.keys)),
        table(device_copy(in.table)),
        cu(device_copy(in.cu)),
        t2r(device_copy(in.t2r)),
        pos(device_copy(in.pos)),
        lens(device_copy(in.lens)),
        options(in.options) {
    auto view = [](const Tensor& t) -> std::optional<TensorView> {
      return t.data() ? std::optional<TensorView>(t.view()) : std::nullopt;
    };
    options.block_table = view(table);
    options.cu_seqlens_q = view(cu);
    options.token_to_req = view(t2r);
    options.query_positions = view(pos);
    options.seq_lens_q = view(lens);
  }
};

std::vector<IndexerForm> native_indexer_forms() {
  std::vector<IndexerForm> v;
  for (const IndexerForm& f : testing::indexer_forms()) {
    if (f.heads == 4 && f.dim == 128) v.push_back(f);
  }
  return v;
}

class GpuIndexerSelect : public ::testing::TestWithParam<IndexerForm> {};

TEST_P(GpuIndexerSelect, MatchesReferenceExactly) {
  SPARSE_ATTN_REQUIRE_GPU();
  auto rng = make_rng();
  const IndexerInputs in = testing::make_indexer_inputs(GetParam(), rng);
  const DeviceIndexer d(in);
  const int64_t nb = qsa_indexer_mqa_score_shape(in.q, in.keys, in.options).back();
  for (int64_t k : {int64_t{1}, int64_t{16}, nb + 5, int64_t{2048}}) {
    IndexerScoreOptions ro = d.options;
    ro.backend = Backend::kReference;
    const DeviceSelection reference(in.rows, k);
    qsa_indexer_select(d.q, d.keys, k, reference.ids, ro,
                       reference.options(kQsaSelectWorkspaceBytes));
    for (size_t budget : budgets(nb)) {
      const std::string what = "k " + std::to_string(k) + " budget " + std::to_string(budget);
      const DeviceSelection native(in.rows, k);
      qsa_indexer_select(d.q, d.keys, k, native.ids, d.options, native.options(budget));
      expect_same(native, reference, what);
      // The same with a workspace of the size the size function gives.
      SelectOptions s = native.options(budget);
      const Tensor w =
          workspace_of(qsa_indexer_select_workspace_size(d.q, d.keys, k, d.options, s));
      s.workspace = w.view();
      const DeviceSelection again(in.rows, k);
      s.token_indices = again.tokens.view();
      s.valid_counts = again.counts.view();
      qsa_indexer_select(d.q, d.keys, k, again.ids, d.options, s);
      expect_same(again, reference, what + " with a workspace");
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Forms, GpuIndexerSelect, ::testing::ValuesIn(native_indexer_forms()),
                         [](const auto& info) { return info.param.name; });

TEST(GpuIndexerSelectRuns, BlockIdsOnlyAndRepeatedCallsAreBitwiseEqual) {
  SPARSE_ATTN_REQUIRE_GPU();
  auto rng = make_rng();
  const IndexerInputs in =
      testing::make_indexer_inputs({.name = "x", .q_form = "cu_seqlens", .page_size = 16}, rng);
  const DeviceIndexer d(in);
  const DeviceSelection first(in.rows, 512), second(in.rows, 512), all(in.rows, 512);
  qsa_indexer_select(d.q, d.keys, 512, first.ids, d.options);
  qsa_indexer_select(d.q, d.keys, 512, second.ids, d.options);
  qsa_indexer_select(d.q, d.keys, 512, all.ids, d.options, all.options(kQsaSelectWorkspaceBytes));
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const Tensor a = Tensor::to_host(first.ids), b = Tensor::to_host(second.ids),
               c = Tensor::to_host(all.ids);
  EXPECT_EQ(std::memcmp(a.data(), b.data(), a.numel() * 4), 0);
  EXPECT_EQ(std::memcmp(a.data(), c.data(), a.numel() * 4), 0);
}

TEST(GpuIndexerSelectRuns, NativeLimitsAreNotSupported) {
  SPARSE_ATTN_REQUIRE_GPU();
  auto rng = make_rng();
  const IndexerInputs in = testing::make_indexer_inputs({.name = "x"}, rng);
  const DeviceIndexer d(in);
  const int64_t k = 16385;  // above kNativeSelectMaxK
  const DeviceSelection out(in.rows, k);
  testing::expect_error<NotSupportedError>(
      [&] { qsa_indexer_select(d.q, d.keys, k, out.ids, d.options); }, "k");
  const IndexerInputs small =
      testing::make_indexer_inputs({.name = "y", .positions = true, .heads = 3, .dim = 40}, rng);
  const DeviceIndexer ds(small);
  const DeviceSelection out3(small.rows, 4);
  EXPECT_THROW(qsa_indexer_select(ds.q, ds.keys, 4, out3.ids, ds.options), NotSupportedError);
  // A workspace below the size function's is a ValueError naming it.
  SelectOptions s;
  const size_t need = qsa_indexer_select_workspace_size(d.q, d.keys, 512, d.options, s);
  if (need > 16) {
    const Tensor w = workspace_of(need - 16);
    s.workspace = w.view();
    const DeviceSelection o(in.rows, 512);
    testing::expect_error<ValueError>(
        [&] { qsa_indexer_select(d.q, d.keys, 512, o.ids, d.options, s); }, "workspace");
  }
}

// Captured once, replayed after the positions changed: the replay reads the current ones.
TEST(GpuIndexerSelectGraph, ReplayReadsCurrentPositions) {
  SPARSE_ATTN_REQUIRE_GPU();
  auto rng = make_rng();
  const IndexerInputs in =
      testing::make_indexer_inputs({.name = "x", .q_form = "token_to_req", .page_size = 16}, rng);
  const DeviceIndexer d(in);
  const int64_t k = 64;
  const size_t budget = 7 * 4 * qsa_indexer_mqa_score_shape(in.q, in.keys, in.options).back();
  const DeviceSelection native(in.rows, k);
  const Tensor w = workspace_of(
      qsa_indexer_select_workspace_size(d.q, d.keys, k, d.options, native.options(budget)));
  testing::CapturedGraph graph([&](cudaStream_t stream) {
    IndexerScoreOptions o = d.options;
    o.stream = stream;
    SelectOptions s = native.options(budget);
    s.workspace = w.view();
    qsa_indexer_select(d.q, d.keys, k, native.ids, o, s);
  });
  ASSERT_TRUE(graph.ok());
  for (int step = 0; step < 2; ++step) {
    const Tensor pos = testing::random_int32(in.pos.shape(), rng, -5, 4 * 90 + 8);
    copy_into(d.pos.view(), pos.view());
    copy_into(native.ids.view(), poisoned_device(native.ids.shape(), DType::kI32).view());
    ASSERT_EQ(graph.replay(), cudaSuccess);
    IndexerScoreOptions ro = d.options;
    ro.backend = Backend::kReference;
    const DeviceSelection reference(in.rows, k);
    qsa_indexer_select(d.q, d.keys, k, reference.ids, ro, reference.options(budget));
    expect_same(native, reference, "replay " + std::to_string(step));
  }
}

// ---------------------------------------------------------------------------------------
// qsa_mqa_decode_select
// ---------------------------------------------------------------------------------------

struct DeviceDecode {
  Tensor q, cache, table, lens, pos;

  explicit DeviceDecode(const DecodeInputs& in)
      : q(to_device(in.q)),
        cache(to_device(in.cache)),
        table(to_device(in.table)),
        lens(to_device(in.lens)),
        pos(device_copy(in.pos)) {}

  SelectOptions with_positions(SelectOptions s) const {
    if (pos.data()) s.query_positions = pos.view();
    return s;
  }
};

class GpuDecodeSelect : public ::testing::TestWithParam<DecodeForm> {};

TEST_P(GpuDecodeSelect, MatchesReferenceExactly) {
  SPARSE_ATTN_REQUIRE_GPU();
  auto rng = make_rng();
  const DecodeForm& f = GetParam();
  const DecodeInputs in = testing::make_decode_inputs(f, rng);
  const DeviceDecode d(in);
  const Shape rows{f.batch * f.rows};
  for (int64_t k : {int64_t{1}, int64_t{64}, f.max_model_len + 1, int64_t{2048}}) {
    auto select_options = [&](const DeviceSelection& out, size_t budget) {
      SelectOptions s;
      s.max_workspace_bytes = budget;
      return f.positions ? d.with_positions(out.options(budget)) : s;
    };
    MqaScoreOptions ro;
    ro.backend = Backend::kReference;
    const DeviceSelection reference(rows, k);
    qsa_mqa_decode_select(d.q, d.cache, d.table, d.lens, in.max_model_len, k, reference.ids, ro,
                          select_options(reference, kQsaSelectWorkspaceBytes));
    for (size_t budget : budgets(f.max_model_len)) {
      const std::string what = "k " + std::to_string(k) + " budget " + std::to_string(budget);
      const DeviceSelection native(rows, k);
      SelectOptions s = select_options(native, budget);
      const Tensor w = workspace_of(qsa_mqa_decode_select_workspace_size(
          d.q, d.cache, d.table, d.lens, in.max_model_len, k, {}, s));
      if (budget == 7 * 4 * static_cast<size_t>(f.max_model_len)) s.workspace = w.view();
      qsa_mqa_decode_select(d.q, d.cache, d.table, d.lens, in.max_model_len, k, native.ids, {}, s);
      expect_same(native, reference, what);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Forms, GpuDecodeSelect, ::testing::ValuesIn(testing::decode_forms()),
                         [](const auto& info) { return info.param.name; });

// Captured once, replayed after the context lengths, pages and positions changed.
TEST(GpuDecodeSelectGraph, ReplayReadsCurrentMetadata) {
  SPARSE_ATTN_REQUIRE_GPU();
  auto rng = make_rng();
  const DecodeForm f{.name = "x", .rows = 3};
  const DecodeInputs in = testing::make_decode_inputs(f, rng);
  const DeviceDecode d(in);
  const Shape rows{f.batch * f.rows};
  const int64_t k = 32;
  const DeviceSelection native(rows, k);
  const SelectOptions s = d.with_positions(native.options(kQsaSelectWorkspaceBytes));
  const Tensor w = workspace_of(qsa_mqa_decode_select_workspace_size(d.q, d.cache, d.table, d.lens,
                                                                     in.max_model_len, k, {}, s));
  testing::CapturedGraph graph([&](cudaStream_t stream) {
    MqaScoreOptions o;
    o.stream = stream;
    SelectOptions sw = s;
    sw.workspace = w.view();
    qsa_mqa_decode_select(d.q, d.cache, d.table, d.lens, in.max_model_len, k, native.ids, o, sw);
  });
  ASSERT_TRUE(graph.ok());
  for (int step = 0; step < 2; ++step) {
    const DecodeInputs next = testing::make_decode_inputs(f, rng);
    copy_into(d.table.view(), next.table.view());
    copy_into(d.lens.view(), next.lens.view());
    copy_into(d.pos.view(), next.pos.view());
    copy_into(native.tokens.view(), poisoned_device(native.tokens.shape(), DType::kI32).view());
    ASSERT_EQ(graph.replay(), cudaSuccess);
    MqaScoreOptions ro;
    ro.backend = Backend::kReference;
    const DeviceSelection reference(rows, k);
    qsa_mqa_decode_select(d.q, d.cache, d.table, d.lens, in.max_model_len, k, reference.ids, ro,
                          d.with_positions(reference.options(kQsaSelectWorkspaceBytes)));
    expect_same(native, reference, "replay " + std::to_string(step));
  }
}

TEST(GpuDecodeSelectRuns, MoreThanFourRowsIsNotSupported) {
  SPARSE_ATTN_REQUIRE_GPU();
  auto rng = make_rng();
  const DecodeInputs in = testing::make_decode_inputs({.name = "x", .rows = 5}, rng);
  const DeviceDecode d(in);
  const DeviceSelection out({6 * 5}, 8);
  testing::expect_error<NotSupportedError>(
      [&] {
        qsa_mqa_decode_select(d.q, d.cache, d.table, d.lens, in.max_model_len, 8, out.ids, {},
                              d.with_positions(out.options(kQsaSelectWorkspaceBytes)));
      },
      "q");
}

}  // namespace
}  // namespace sparse_attn
