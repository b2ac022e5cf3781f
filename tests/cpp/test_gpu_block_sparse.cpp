// Native block-sparse attention on the GPU (block_sparse_attention, _paged, and the padded layout
// of xattention_prefill's attention step) against the reference on fresh random inputs: the
// shared forms (block_sparse_cases.h), bitwise reruns, graph replay with new mask contents,
// and every section size of the CTA order.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "api/xattn_params.h"
#include "block_sparse_cases.h"
#include "gpu_test_util.h"
#include "reference/xattn_ref.h"
#include "sparse_attn/errors.h"
#include "sparse_attn/xattn.h"
#include "test_util.h"

namespace sparse_attn {
namespace {

using testing::to_device;
using testing::to_vector;

using testing::BsCase;
using testing::case_name;
using testing::expect_matches_reference;
using testing::make_problem;
using testing::Problem;
using testing::run;

// A case with its native tensors on the GPU: device copies, outputs poisoned.
Problem make_device_problem(const BsCase& c, std::mt19937_64& rng) {
  Problem pb = make_problem(c, rng);
  pb.nq = to_device(pb.q);
  pb.nk = to_device(pb.k);
  pb.nv = to_device(pb.v);
  pb.ncu_q = to_device(pb.cu_q);
  if (c.page_size == 0) pb.ncu_k = to_device(pb.cu_k);
  if (c.page_size != 0) {
    pb.ntable = to_device(pb.table);
    pb.nseqlens = to_device(pb.seqlens);
  }
  if (pb.sparse_heads > 0) pb.nmask = to_device(pb.mask);
  pb.nout = testing::poisoned_device(pb.q.shape(), c.dtype);
  if (c.lse) pb.nlse = testing::poisoned_device({pb.total_q, c.hq}, DType::kF32);
  return pb;
}

class GpuBlockSparse : public ::testing::TestWithParam<BsCase> {};

TEST_P(GpuBlockSparse, MatchesReference) {
  SPARSE_ATTN_REQUIRE_GPU();
  auto rng = testing::make_rng();
  Problem pb = make_device_problem(GetParam(), rng);
  run(pb, false);
  run(pb, true);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  expect_matches_reference(pb);
}

INSTANTIATE_TEST_SUITE_P(Forms, GpuBlockSparse, ::testing::ValuesIn(testing::block_sparse_cases()),
                         case_name);

// More work items (128 query rows x head x sequence) than the H200 has SMs, so that each
// persistent CTA (d64, d128) walks several items and runs ahead into the next one: items of
// different lengths, items without rows (empty sequences, max_seqlen_q past a sequence), items
// whose rows see nothing, dense / sparse / streaming heads, paged. GPU only: the host reference
// of these takes seconds.
std::vector<BsCase> many_item_cases() {
  std::vector<BsCase> v;
  {
    BsCase c;
    c.name = "bf16_d128_many_items_varlen_mixed_heads";
    c.hq = 16;
    c.hkv = 4;
    c.lq = {1300, 0, 600, 130};
    c.lk = {1300, 40, 200, 1800};
    c.head_types = {1, 1, 0, 1, -1, 1, 1, 0, 1, 1, 1, -1, 1, 0, 1, 1};
    c.streaming.assign(2 * c.hq, 0);
    c.streaming[8] = 1, c.streaming[9] = 2, c.streaming[22] = 0, c.streaming[23] = 3;
    c.keep = 0.3;
    v.push_back(c);
  }
  {
    BsCase c;
    c.name = "fp16_d64_many_items_paged_page800";
    c.dtype = DType::kF16;
    c.d = 64;
    c.hq = 24;
    c.hkv = 2;
    c.page_size = 800;
    c.lq = {1000, 257};
    c.lk = {1700, 257};
    c.keep = 0.5;
    v.push_back(c);
  }
  {
    BsCase c;
    c.name = "bf16_d128_many_items_not_causal_no_lse";
    c.hq = 32;
    c.hkv = 8;
    c.causal = false;
    c.lq = {520};
    c.lk = {700};
    c.lse = false;
    v.push_back(c);
  }
  return v;
}
INSTANTIATE_TEST_SUITE_P(ManyItems, GpuBlockSparse, ::testing::ValuesIn(many_item_cases()),
                         case_name);

// The native tensors' metadata (offsets, lengths, page table) as int64, outputs poisoned again.
void widen_metadata(Problem& pb) {
  const auto wide = [](const Tensor& host) { return to_device(testing::widened(host.view())); };
  pb.ncu_q = wide(pb.cu_q);
  if (pb.c.page_size == 0) pb.ncu_k = wide(pb.cu_k);
  if (pb.c.page_size != 0) {
    pb.ntable = wide(pb.table);
    pb.nseqlens = wide(pb.seqlens);
  }
  pb.nout = testing::poisoned_device(pb.q.shape(), pb.c.dtype);
  if (pb.c.lse) pb.nlse = testing::poisoned_device({pb.total_q, pb.c.hq}, DType::kF32);
}

// int64 metadata is narrowed to int32 scratch on the stream before the kernel runs: the int32
// call's bits, and the reference's results, on every shared form.
TEST_P(GpuBlockSparse, Int64MetadataGivesTheInt32Bits) {
  SPARSE_ATTN_REQUIRE_GPU();
  auto rng = testing::make_rng();
  Problem pb = make_device_problem(GetParam(), rng);
  run(pb, false);
  run(pb, true);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const Tensor narrow = Tensor::to_host(pb.nout.view());
  const Tensor narrow_lse = pb.c.lse ? Tensor::to_host(pb.nlse.view()) : Tensor();
  widen_metadata(pb);
  run(pb, true);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  expect_matches_reference(pb);
  const Tensor wide = Tensor::to_host(pb.nout.view());
  EXPECT_EQ(std::memcmp(wide.data(), narrow.data(), narrow.numel() * 2), 0);
  if (pb.c.lse) {
    const Tensor wide_lse = Tensor::to_host(pb.nlse.view());
    EXPECT_EQ(std::memcmp(wide_lse.data(), narrow_lse.data(), narrow_lse.numel() * 4), 0);
  }
}

// Same inputs, same bits, whichever persistent CTA claims an item (192 items).
TEST(GpuBlockSparseDeterminism, RerunsAreBitwiseEqual) {
  SPARSE_ATTN_REQUIRE_GPU();
  auto rng = testing::make_rng();
  BsCase c;
  c.lq = {700};
  c.lk = {1500};
  c.hq = 32;
  c.hkv = 8;
  Problem pb = make_device_problem(c, rng);
  run(pb, true);
  const Tensor first = Tensor::to_host(pb.nout.view()), first_lse = Tensor::to_host(pb.nlse.view());
  for (int rep = 0; rep < 2; ++rep) {
    copy_into(pb.nout.view(), pb.out.view());  // poisoned host buffer
    run(pb, true);
    const Tensor again = Tensor::to_host(pb.nout.view()),
                 again_lse = Tensor::to_host(pb.nlse.view());
    ASSERT_EQ(std::memcmp(first.data(), again.data(), first.numel() * 2), 0);
    ASSERT_EQ(std::memcmp(first_lse.data(), again_lse.data(), first_lse.numel() * 4), 0);
  }
}

// A graph captured from one native run of `pb` (testing::CapturedGraph), replayed and checked
// by expect_replay_matches_reference.
struct CapturedRun {
  testing::CapturedGraph graph;

  explicit CapturedRun(Problem& pb) : graph([&](cudaStream_t s) { run(pb, true, s); }) {}
  bool ok() const { return graph.ok(); }
  // Poisons the outputs, replays, and checks them against the reference on pb's current
  // inputs (the caller has copied its changed metadata to the device).
  void expect_replay_matches_reference(Problem& pb) const {
    testing::poison(pb.out.view());
    copy_into(pb.nout.view(), pb.out.view());
    ASSERT_EQ(graph.replay(), cudaSuccess);
    run(pb, false);
    expect_matches_reference(pb);
  }
};

// A captured graph reads the mask and lengths current at replay. 192 work items: persistent
// CTAs claim most of them from the counter, which each replay zeroes again.
TEST(GpuBlockSparseGraph, ReplayReadsCurrentMask) {
  SPARSE_ATTN_REQUIRE_GPU();
  auto rng = testing::make_rng();
  BsCase c;
  c.lq = {300, 100};
  c.lk = {900, 400};
  c.hq = 32;
  c.hkv = 8;
  c.page_size = 64;
  Problem pb = make_device_problem(c, rng);
  CapturedRun captured(pb);
  ASSERT_TRUE(captured.ok());
  for (int step = 0; step < 2; ++step) {
    std::uniform_real_distribution<double> u01(0, 1);
    for (int64_t i = 0; i < pb.mask.numel(); ++i)
      pb.mask.data_as<uint8_t>()[i] = u01(rng) < 0.3 ? 1 : 0;
    copy_into(pb.nmask.view(), pb.mask.view());
    captured.expect_replay_matches_reference(pb);
  }
}

// With int64 metadata the capture holds the narrowing (a stream-ordered allocation, the copy
// kernel, the free): a replay narrows the lengths and page table current at replay.
TEST(GpuBlockSparseGraph, ReplayNarrowsCurrentInt64Metadata) {
  SPARSE_ATTN_REQUIRE_GPU();
  auto rng = testing::make_rng();
  BsCase c;
  c.lq = {300, 100};
  c.lk = {900, 400};
  c.page_size = 64;
  Problem pb = make_device_problem(c, rng);
  widen_metadata(pb);
  CapturedRun captured(pb);
  ASSERT_TRUE(captured.ok());
  for (int64_t shorter : {0, 1}) {
    // Shorter sequences (fewer keys, a table whose last pages now go unused) at replay.
    std::vector<int32_t> lens(pb.seqlens.numel());
    for (int64_t b = 0; b < pb.seqlens.numel(); ++b) {
      lens[b] = pb.seqlens.data_as<int32_t>()[b] - static_cast<int32_t>(100 * (shorter + 1) + b);
    }
    pb.seqlens = testing::int32_tensor(pb.seqlens.shape(), lens);
    copy_into(pb.nseqlens.view(), testing::widened(pb.seqlens.view()).view());
    captured.expect_replay_matches_reference(pb);
  }
}

// Padded [B, H, L, D] problems given to the backend entries directly (BlockSparseAttnParams):
// q and out stored [B, lq, hq, d], k and v [B, lk, hkv, d] (the transposes prefill callers
// pass), one mask slice per head of type 1, lse [B, hq, lq].
struct PaddedProblem {
  int64_t B, hq, hkv, lq, lk, d;
  std::vector<int32_t> types;  // per query head
  Tensor q, k, v, mask, dq, dk, dv, dmask;

  PaddedProblem(int64_t B_, int64_t hq_, int64_t hkv_, int64_t lq_, int64_t lk_, int64_t d_,
                std::vector<int32_t> types_, std::mt19937_64& rng)
      : B(B_), hq(hq_), hkv(hkv_), lq(lq_), lk(lk_), d(d_), types(std::move(types_)) {
    q = testing::random_tensor({B, lq, hq, d}, DType::kBF16, rng, -2.f, 2.f);
    k = testing::random_tensor({B, lk, hkv, d}, DType::kBF16, rng, -2.f, 2.f);
    v = testing::random_tensor({B, lk, hkv, d}, DType::kBF16, rng);
    mask = Tensor::empty({B, sparse_heads(), qb(), kb()}, DType::kBool);
    for (int64_t i = 0; i < mask.numel(); ++i) mask.data_as<uint8_t>()[i] = (i * 7) % 3 != 0;
    dq = to_device(q), dk = to_device(k), dv = to_device(v), dmask = to_device(mask);
  }
  int64_t qb() const { return (lq + 127) / 128; }
  int64_t kb() const { return (lk + 127) / 128; }
  int64_t sparse_heads() const { return std::count(types.begin(), types.end(), 1); }
  Tensor out_host() const { return Tensor::empty({B, lq, hq, d}, DType::kBF16); }
  Tensor lse_host() const { return Tensor::empty({B, hq, lq}, DType::kF32); }
  Tensor out_device() const { return testing::poisoned_device({B, lq, hq, d}, DType::kBF16); }
  Tensor lse_device() const { return testing::poisoned_device({B, hq, lq}, DType::kF32); }

  // The params on the host tensors (device false) or the device tensors, writing out and lse.
  BlockSparseAttnParams params(bool device, const Tensor& out, const Tensor& lse) const {
    BlockSparseAttnParams a;
    a.batch = B;
    a.num_q_heads = hq;
    a.num_kv_heads = hkv;
    a.group = hq / hkv;
    a.head_dim = d;
    a.block_size = 128;
    a.max_seqlen_q = lq;
    a.max_seqlen_k = lk;
    a.total_q = B * lq;
    a.kv_layout = XAttnKVLayout::kPadded;
    a.q = (device ? dq : q).data();
    a.k = (device ? dk : k).data();
    a.v = (device ? dv : v).data();
    a.out = out.data();
    for (int64_t* s : {a.q_stride, a.out_stride}) {
      s[0] = lq * hq * d, s[1] = hq * d, s[2] = d, s[3] = 1;
    }
    for (int64_t* s : {a.k_stride, a.v_stride}) {
      s[0] = lk * hkv * d, s[1] = hkv * d, s[2] = d, s[3] = 1;
    }
    a.head_mask_type = types.data();
    if (sparse_heads() > 0) {
      a.block_mask = (device ? dmask : mask).data_as<const uint8_t>();
      a.mask_stride[0] = sparse_heads() * qb() * kb(), a.mask_stride[1] = qb() * kb(),
      a.mask_stride[2] = kb(), a.mask_stride[3] = 1;
    }
    a.mask_q_blocks = qb();
    a.mask_k_blocks = kb();
    a.lse = const_cast<float*>(lse.data_as<float>());
    a.lse_stride[0] = hq * lq, a.lse_stride[1] = 1, a.lse_stride[2] = lq;
    a.softmax_scale = 1.0 / std::sqrt(static_cast<double>(d));
    a.causal = true;
    return a;
  }
};

// The padded layout of xattention_prefill's attention step, called through the backend entry
// (so that the mask is the test's, not an estimate's), against the reference on the same params.
TEST(GpuBlockSparsePadded, PrefillLayoutMatchesReference) {
  SPARSE_ATTN_REQUIRE_GPU();
  auto rng = testing::make_rng();
  const PaddedProblem pb(2, 4, 2, 300, 520, 128, {1, 1, 1, 1}, rng);
  Tensor out_h = pb.out_host(), lse_h = pb.lse_host();
  Tensor out_d = pb.out_device(), lse_d = pb.lse_device();
  reference_block_sparse_attention(pb.params(false, out_h, lse_h));
  native_block_sparse_attention(pb.params(true, out_d, lse_d));
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_TRUE(testing::all_close(Tensor::to_host(out_d.view()).view(), to_vector(out_h.view()),
                                 2e-2, 2e-2));
  EXPECT_TRUE(testing::all_close(Tensor::to_host(lse_d.view()).view(), to_vector(lse_h.view()),
                                 1e-3, 1e-3));
}

// The CTA order in sections of (sequence, query head) units (BlockSparseFwdParams::section):
// every section size, including ones that do not divide the units and a last section of one,
// gives the same bits, which match the reference. The problem has tiles whose rows see no key
// (q_len above k_len, causal), a dense head, and tiles that reach past the keys.
TEST(GpuBlockSparseSections, EverySectionSizeGivesTheSameBits) {
  SPARSE_ATTN_REQUIRE_GPU();
  auto rng = testing::make_rng();
  for (int64_t d : {128, 256}) {
    const PaddedProblem pb(3, 4, 2, 700, 450, d, {1, 0, 1, 1}, rng);  // 12 units
    Tensor out_h = pb.out_host(), lse_h = pb.lse_host();
    reference_block_sparse_attention(pb.params(false, out_h, lse_h));
    Tensor out_d = pb.out_device(), lse_d = pb.lse_device();
    native_block_sparse_attention(pb.params(true, out_d, lse_d));
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const Tensor first = Tensor::to_host(out_d.view()), first_lse = Tensor::to_host(lse_d.view());
    EXPECT_TRUE(testing::all_close(first.view(), to_vector(out_h.view()), 2e-2, 2e-2)) << d;
    EXPECT_TRUE(testing::all_close(first_lse.view(), to_vector(lse_h.view()), 1e-3, 1e-3)) << d;
    for (int64_t section : {1, 2, 5, 11, 12}) {
      out_d = pb.out_device(), lse_d = pb.lse_device();
      BlockSparseAttnParams a = pb.params(true, out_d, lse_d);
      a.section = section;
      native_block_sparse_attention(a);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      const Tensor again = Tensor::to_host(out_d.view()), again_lse = Tensor::to_host(lse_d.view());
      ASSERT_EQ(std::memcmp(first.data(), again.data(), first.numel() * 2), 0)
          << d << " " << section;
      ASSERT_EQ(std::memcmp(first_lse.data(), again_lse.data(), first_lse.numel() * 4), 0)
          << d << " " << section;
    }
  }
}

// SplitKV (BlockSparseFwdParams::splits): every split count, including more splits than a work
// tile has key blocks (empty splits) and the largest, matches the reference; a rerun with the
// same count gives the same bits, and so does a captured graph's replay (the partials' scratch
// is a graph-owned allocation then).
TEST(GpuBlockSparseSplits, EverySplitCountMatchesTheReference) {
  SPARSE_ATTN_REQUIRE_GPU();
  auto rng = testing::make_rng();
  for (int64_t d : {64, 128, 256}) {
    const PaddedProblem pb(1, 4, 2, 200, 1500, d, {1, 0, 1, 1}, rng);  // 8 tiles, 12 key blocks
    Tensor out_h = pb.out_host(), lse_h = pb.lse_host();
    reference_block_sparse_attention(pb.params(false, out_h, lse_h));
    for (int64_t splits : {1, 2, 5, 12, 64}) {
      Tensor out_d = pb.out_device(), lse_d = pb.lse_device();
      BlockSparseAttnParams a = pb.params(true, out_d, lse_d);
      a.num_splits = splits;
      native_block_sparse_attention(a);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      const Tensor got = Tensor::to_host(out_d.view()), got_lse = Tensor::to_host(lse_d.view());
      EXPECT_TRUE(testing::all_close(got.view(), to_vector(out_h.view()), 2e-2, 2e-2))
          << d << " " << splits;
      EXPECT_TRUE(testing::all_close(got_lse.view(), to_vector(lse_h.view()), 1e-3, 1e-3))
          << d << " " << splits;
      out_d = pb.out_device(), lse_d = pb.lse_device();
      a = pb.params(true, out_d, lse_d);
      a.num_splits = splits;
      cudaStream_t stream;
      ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
      a.stream = stream;
      cudaGraph_t graph;
      ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), cudaSuccess);
      native_block_sparse_attention(a);
      ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
      cudaGraphExec_t exec;
      ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
      ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
      ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
      const Tensor again = Tensor::to_host(out_d.view()), again_lse = Tensor::to_host(lse_d.view());
      EXPECT_EQ(std::memcmp(got.data(), again.data(), got.numel() * 2), 0) << d << " " << splits;
      EXPECT_EQ(std::memcmp(got_lse.data(), again_lse.data(), got_lse.numel() * 4), 0)
          << d << " " << splits;
      cudaGraphExecDestroy(exec);
      cudaGraphDestroy(graph);
      cudaStreamDestroy(stream);
    }
  }
}

// What the native kernel does not take is refused, naming the argument.
TEST(GpuBlockSparseValidation, UnsupportedNativeInputsRaiseNotSupported) {
  SPARSE_ATTN_REQUIRE_GPU();
  auto rng = testing::make_rng();
  BsCase c;
  c.lq = {64};
  c.lk = {64};
  c.d = 32;
  Problem pb = make_device_problem(c, rng);
  try {
    run(pb, true);
    FAIL() << "head dim 32 accepted";
  } catch (const NotSupportedError& e) {
    EXPECT_NE(std::string(e.what()).find("head dims 64, 128 and 256"), std::string::npos)
        << e.what();
  }
  c.d = 128;
  c.page_size = 12;
  Problem paged = make_device_problem(c, rng);
  EXPECT_THROW(run(paged, true), NotSupportedError);
}

}  // namespace
}  // namespace sparse_attn
