// Native block-sparse attention (block_sparse_attention, _paged, and the padded layout of
// xattention_prefill's attention step) against the reference on fresh random inputs: every
// head dim and dtype, causal and not, q_len above and below k_len, dense / block-sparse /
// streaming heads, GQA, varlen batches with empty and 1-row sequences, page sizes smaller than a
// tile (8, 24), holding whole tiles (128, 256) and engine sizes whose tiles sometimes cross a
// page boundary (800, 1600), NaN in unused page slots, poisoned
// outputs (rows outside every sequence stay untouched), bitwise reruns and graph replay with
// new mask contents.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <optional>
#include <string>
#include <vector>

#include "api/xattn_params.h"
#include "gpu_test_util.h"
#include "reference/xattn_ref.h"
#include "sparse_attn/errors.h"
#include "sparse_attn/xattn.h"
#include "test_util.h"

namespace sparse_attn {
namespace {

using testing::to_device;
using testing::to_vector;

struct BsCase {
  std::string name;
  DType dtype = DType::kBF16;
  int64_t hq = 4, hkv = 2, d = 128;
  std::vector<int64_t> lq, lk;  // per sequence
  bool causal = true;
  int64_t page_size = 0;            // 0: varlen K/V
  std::vector<int32_t> head_types;  // empty: every head block-sparse
  std::vector<int32_t> streaming;   // (sink, local) per head
  double keep = 0.4;                // share of kept mask blocks
  bool lse = true;
  int64_t extra_q_rows = 0;  // rows after the last sequence (never written)
};

std::string case_name(const ::testing::TestParamInfo<BsCase>& info) { return info.param.name; }

// Host problem, device copies, and the reference's results.
struct Problem {
  BsCase c;
  int64_t batch = 0, total_q = 0, total_k = 0, max_q = 0, max_k = 0, sparse_heads = 0;
  int64_t num_pages = 0, max_pages = 0;
  Tensor q, k, v, cu_q, cu_k, mask, table, seqlens, out, lse;            // host
  Tensor dq, dk, dv, dcu_q, dcu_k, dmask, dtable, dseqlens, dout, dlse;  // device
  BlockSparseAttentionOptions opts;
};

Problem make_problem(const BsCase& c, std::mt19937_64& rng) {
  Problem pb;
  pb.c = c;
  pb.batch = static_cast<int64_t>(c.lq.size());
  std::vector<int32_t> cu_q{0}, cu_k{0};
  for (int64_t b = 0; b < pb.batch; ++b) {
    cu_q.push_back(static_cast<int32_t>(cu_q.back() + c.lq[b]));
    cu_k.push_back(static_cast<int32_t>(cu_k.back() + c.lk[b]));
  }
  pb.total_q = cu_q.back() + c.extra_q_rows;
  pb.total_k = cu_k.back();
  pb.max_q = *std::max_element(c.lq.begin(), c.lq.end());
  pb.max_k = *std::max_element(c.lk.begin(), c.lk.end());
  pb.q = testing::random_tensor({pb.total_q, c.hq, c.d}, c.dtype, rng, -2.f, 2.f);
  pb.cu_q = testing::int32_tensor({pb.batch + 1}, cu_q);
  if (c.page_size == 0) {
    pb.k = testing::random_tensor({std::max<int64_t>(pb.total_k, 1), c.hkv, c.d}, c.dtype, rng,
                                  -2.f, 2.f);
    pb.v = testing::random_tensor({std::max<int64_t>(pb.total_k, 1), c.hkv, c.d}, c.dtype, rng);
    pb.cu_k = testing::int32_tensor({pb.batch + 1}, cu_k);
  } else {
    // Pages shuffled over the pool; every slot no sequence owns holds NaN, so a kernel that
    // lets one into a product fails.
    pb.max_pages = (pb.max_k + c.page_size - 1) / c.page_size + 1;
    int64_t need = 0;
    for (int64_t l : c.lk) need += (l + c.page_size - 1) / c.page_size;
    pb.num_pages = need + 2;
    pb.k = testing::random_tensor({pb.num_pages, c.page_size, c.hkv, c.d}, c.dtype, rng, -2.f, 2.f);
    pb.v = testing::random_tensor({pb.num_pages, c.page_size, c.hkv, c.d}, c.dtype, rng);
    std::vector<int32_t> phys(pb.num_pages);
    std::iota(phys.begin(), phys.end(), 0);
    std::shuffle(phys.begin(), phys.end(), rng);
    std::vector<int32_t> table(pb.batch * pb.max_pages, -1);
    std::vector<bool> owned(pb.num_pages * c.page_size, false);
    for (int64_t b = 0, next = 0; b < pb.batch; ++b) {
      for (int64_t j = 0; j * c.page_size < c.lk[b]; ++j) {
        const int32_t page = phys[next++];
        table[b * pb.max_pages + j] = page;
        for (int64_t s = 0; s < c.page_size && j * c.page_size + s < c.lk[b]; ++s)
          owned[page * c.page_size + s] = true;
      }
    }
    for (int64_t i = 0; i < pb.num_pages * c.page_size; ++i) {
      if (owned[i]) continue;
      for (int64_t h = 0; h < c.hkv; ++h) {
        for (int64_t e = 0; e < c.d; ++e) {
          testing::set(pb.k.view(), {i / c.page_size, i % c.page_size, h, e}, NAN);
          testing::set(pb.v.view(), {i / c.page_size, i % c.page_size, h, e}, NAN);
        }
      }
    }
    pb.table = testing::int32_tensor({pb.batch, pb.max_pages}, table);
    std::vector<int32_t> lens(c.lk.begin(), c.lk.end());
    pb.seqlens = testing::int32_tensor({pb.batch}, lens);
  }
  std::vector<int32_t> types = c.head_types;
  if (types.empty()) types.assign(c.hq, 1);
  pb.sparse_heads = std::count(types.begin(), types.end(), 1);
  if (pb.sparse_heads > 0) {
    const Shape ms =
        block_sparse_attention_mask_shape(pb.batch, pb.sparse_heads, pb.max_q, pb.max_k);
    pb.mask = Tensor::empty(ms, DType::kBool);
    std::uniform_real_distribution<double> u01(0, 1);
    for (int64_t i = 0; i < pb.mask.numel(); ++i)
      pb.mask.data_as<uint8_t>()[i] = u01(rng) < c.keep ? 1 : 0;
  }
  pb.opts.backend = Backend::kReference;
  pb.opts.is_causal = c.causal;
  pb.opts.head_mask_type = c.head_types;
  pb.opts.streaming_info = c.streaming;

  pb.out = Tensor::empty(pb.q.shape(), c.dtype);
  testing::poison(pb.out.view());
  if (c.lse) {
    pb.lse = Tensor::empty({pb.total_q, c.hq}, DType::kF32);
    testing::poison(pb.lse.view());
  }
  pb.dq = to_device(pb.q);
  pb.dk = to_device(pb.k);
  pb.dv = to_device(pb.v);
  pb.dcu_q = to_device(pb.cu_q);
  if (c.page_size == 0) pb.dcu_k = to_device(pb.cu_k);
  if (c.page_size != 0) {
    pb.dtable = to_device(pb.table);
    pb.dseqlens = to_device(pb.seqlens);
  }
  if (pb.sparse_heads > 0) pb.dmask = to_device(pb.mask);
  pb.dout = testing::poisoned_device(pb.q.shape(), c.dtype);
  if (c.lse) pb.dlse = testing::poisoned_device({pb.total_q, c.hq}, DType::kF32);
  return pb;
}

std::optional<TensorView> opt(const Tensor& t, bool present) {
  if (!present) return std::nullopt;
  return t.view();
}

// Runs the op on the host tensors (reference) or the device tensors (native).
void run(Problem& pb, bool native, cudaStream_t stream = nullptr) {
  const BsCase& c = pb.c;
  BlockSparseAttentionOptions o = pb.opts;
  o.backend = native ? Backend::kNative : Backend::kReference;
  o.stream = stream;
  const bool has_mask = pb.sparse_heads > 0;
  if (c.page_size == 0) {
    block_sparse_attention(native ? pb.dq : pb.q, native ? pb.dk : pb.k, native ? pb.dv : pb.v,
                           native ? pb.dcu_q : pb.cu_q, native ? pb.dcu_k : pb.cu_k,
                           opt(native ? pb.dmask : pb.mask, has_mask), pb.max_q, pb.max_k,
                           native ? pb.dout : pb.out, opt(native ? pb.dlse : pb.lse, c.lse), o);
  } else {
    block_sparse_attention_paged(
        native ? pb.dq : pb.q, native ? pb.dk : pb.k, native ? pb.dv : pb.v,
        native ? pb.dtable : pb.table, native ? pb.dseqlens : pb.seqlens,
        native ? pb.dcu_q : pb.cu_q, opt(native ? pb.dmask : pb.mask, has_mask), pb.max_q, pb.max_k,
        native ? pb.dout : pb.out, opt(native ? pb.dlse : pb.lse, c.lse), o);
  }
}

// Native against the reference: -inf and NaN positions first (all_close), then tolerances;
// rows outside every sequence stay poisoned in both.
void expect_matches_reference(const Problem& pb) {
  const std::vector<double> want = to_vector(pb.out.view());
  const std::vector<double> got = to_vector(Tensor::to_host(pb.dout.view()).view());
  const int64_t written = (pb.total_q - pb.c.extra_q_rows) * pb.c.hq * pb.c.d;
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = written; i < got.size(); ++i) {
    ASSERT_TRUE(std::isnan(got[i])) << "row outside every sequence written at " << i;
  }
  Tensor o = Tensor::empty({written}, DType::kF32);
  for (int64_t i = 0; i < written; ++i) o.data_as<float>()[i] = static_cast<float>(got[i]);
  const std::vector<double> want_out(want.begin(), want.begin() + written);
  EXPECT_TRUE(testing::all_close(o.view(), want_out, 2 * testing::default_atol(pb.c.dtype),
                                 2 * testing::default_rtol(pb.c.dtype)))
      << "out";
  if (pb.c.lse) {
    const int64_t lse_written = (pb.total_q - pb.c.extra_q_rows) * pb.c.hq;
    const std::vector<double> lw = to_vector(pb.lse.view());
    const Tensor lg = Tensor::to_host(pb.dlse.view());
    EXPECT_TRUE(testing::all_close(lg.view().narrow(0, 0, lse_written / pb.c.hq),
                                   std::vector<double>(lw.begin(), lw.begin() + lse_written), 1e-3,
                                   1e-3))
        << "lse";
  }
}

class GpuBlockSparse : public ::testing::TestWithParam<BsCase> {};

TEST_P(GpuBlockSparse, MatchesReference) {
  SPARSE_ATTN_REQUIRE_GPU();
  auto rng = testing::make_rng();
  Problem pb = make_problem(GetParam(), rng);
  run(pb, false);
  run(pb, true);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  expect_matches_reference(pb);
}

std::vector<BsCase> cases() {
  std::vector<BsCase> v;
  for (DType dt : {DType::kBF16, DType::kF16}) {
    for (int64_t d : {64, 128, 256}) {
      BsCase c;
      c.name = std::string(dt == DType::kBF16 ? "bf16" : "fp16") + "_d" + std::to_string(d) +
               "_varlen_causal";
      c.dtype = dt;
      c.d = d;
      c.lq = {300, 1, 129};
      c.lk = {700, 5, 129};
      v.push_back(c);
    }
  }
  {
    BsCase c;
    c.name = "d128_not_causal_lq_above_lk";
    c.causal = false;
    c.lq = {400, 77};
    c.lk = {250, 900};
    v.push_back(c);
  }
  {
    BsCase c;
    c.name = "d128_causal_lq_above_lk_rows_see_nothing";
    c.lq = {500};
    c.lk = {200};
    c.keep = 0.8;
    v.push_back(c);
  }
  {
    BsCase c;
    c.name = "d64_heads_dense_sparse_streaming_gqa4";
    c.d = 64;
    c.hq = 8;
    c.hkv = 2;
    c.lq = {640, 200};
    c.lk = {1000, 700};
    c.head_types = {1, 0, -1, 1, -1, 0, 1, 1};
    c.streaming = {1, 2, 0, 0, 2, 1, 0, 0, 0, 3, 0, 0, 0, 0, 0, 0};
    v.push_back(c);
  }
  {
    BsCase c;
    c.name = "d256_all_dense_equals_causal_flash";
    c.d = 256;
    c.hq = 2;
    c.hkv = 1;
    c.lq = {333};
    c.lk = {333};
    c.head_types = {0, 0};
    v.push_back(c);
  }
  {
    BsCase c;
    c.name = "d128_nothing_kept_zero_and_minus_inf";
    c.lq = {200, 50};
    c.lk = {400, 60};
    c.keep = 0.0;
    v.push_back(c);
  }
  {
    BsCase c;
    c.name = "d128_empty_sequences_and_unwritten_tail_rows";
    c.lq = {0, 130, 0, 7};
    c.lk = {50, 260, 0, 7};
    c.extra_q_rows = 9;
    v.push_back(c);
  }
  {
    BsCase c;
    c.name = "d128_group8_no_lse";
    c.hq = 8;
    c.hkv = 1;
    c.lq = {256};
    c.lk = {1024};
    c.lse = false;
    v.push_back(c);
  }
  // Paged: pages that hold whole 128-key tiles, and pages that cut them (8-row pieces).
  for (int64_t page : {8, 24, 128, 256, 800, 1600}) {
    BsCase c;
    c.name = "d128_paged_page" + std::to_string(page);
    c.page_size = page;
    c.lq = {260, 3};
    c.lk = {1700, 1100};
    c.keep = 0.5;
    v.push_back(c);
  }
  {
    BsCase c;
    c.name = "d256_paged_page800_streaming";
    c.d = 256;
    c.hq = 2;
    c.hkv = 2;
    c.page_size = 800;
    c.lq = {200};
    c.lk = {1650};
    c.head_types = {-1, 1};
    c.streaming = {1, 3, 0, 0};
    v.push_back(c);
  }
  return v;
}

INSTANTIATE_TEST_SUITE_P(Forms, GpuBlockSparse, ::testing::ValuesIn(cases()), case_name);

// Same inputs, same bits.
TEST(GpuBlockSparseDeterminism, RerunsAreBitwiseEqual) {
  SPARSE_ATTN_REQUIRE_GPU();
  auto rng = testing::make_rng();
  BsCase c;
  c.lq = {700};
  c.lk = {1500};
  c.hq = 4;
  Problem pb = make_problem(c, rng);
  run(pb, true);
  const Tensor first = Tensor::to_host(pb.dout.view()), first_lse = Tensor::to_host(pb.dlse.view());
  for (int rep = 0; rep < 2; ++rep) {
    copy_into(pb.dout.view(), pb.out.view());  // poisoned host buffer
    run(pb, true);
    const Tensor again = Tensor::to_host(pb.dout.view()),
                 again_lse = Tensor::to_host(pb.dlse.view());
    ASSERT_EQ(std::memcmp(first.data(), again.data(), first.numel() * 2), 0);
    ASSERT_EQ(std::memcmp(first_lse.data(), again_lse.data(), first_lse.numel() * 4), 0);
  }
}

// A captured graph reads the mask and lengths current at replay.
TEST(GpuBlockSparseGraph, ReplayReadsCurrentMask) {
  SPARSE_ATTN_REQUIRE_GPU();
  auto rng = testing::make_rng();
  BsCase c;
  c.lq = {300, 100};
  c.lk = {900, 400};
  c.page_size = 64;
  Problem pb = make_problem(c, rng);
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  run(pb, true, stream);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  cudaGraph_t graph;
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), cudaSuccess);
  run(pb, true, stream);
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  cudaGraphExec_t exec;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  for (int step = 0; step < 2; ++step) {
    std::uniform_real_distribution<double> u01(0, 1);
    for (int64_t i = 0; i < pb.mask.numel(); ++i)
      pb.mask.data_as<uint8_t>()[i] = u01(rng) < 0.3 ? 1 : 0;
    copy_into(pb.dmask.view(), pb.mask.view());
    testing::poison(pb.out.view());
    copy_into(pb.dout.view(), pb.out.view());
    ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    run(pb, false);
    expect_matches_reference(pb);
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

// The padded [B, H, L, D] layout of xattention_prefill's attention step (its estimate has no
// native kernel yet, so the step is called through the backend entry), against the reference
// on the same params.
TEST(GpuBlockSparsePadded, PrefillLayoutMatchesReference) {
  SPARSE_ATTN_REQUIRE_GPU();
  auto rng = testing::make_rng();
  const int64_t B = 2, hq = 4, hkv = 2, lq = 300, lk = 520, d = 128;
  // [B, L, H, D] storage seen as [B, H, L, D] (a transpose), as prefill callers pass it.
  Tensor q = testing::random_tensor({B, lq, hq, d}, DType::kBF16, rng, -2.f, 2.f);
  Tensor k = testing::random_tensor({B, lk, hkv, d}, DType::kBF16, rng, -2.f, 2.f);
  Tensor v = testing::random_tensor({B, lk, hkv, d}, DType::kBF16, rng);
  const int64_t qb = (lq + 127) / 128, kb = (lk + 127) / 128;
  Tensor mask = Tensor::empty({B, hq, qb, kb}, DType::kBool);
  for (int64_t i = 0; i < mask.numel(); ++i) mask.data_as<uint8_t>()[i] = (i * 7) % 3 != 0;
  Tensor out_h = Tensor::empty({B, lq, hq, d}, DType::kBF16);
  Tensor lse_h = Tensor::empty({B, hq, lq}, DType::kF32);
  Tensor dq = to_device(q), dk = to_device(k), dv = to_device(v), dmask = to_device(mask);
  Tensor out_d = testing::poisoned_device({B, lq, hq, d}, DType::kBF16);
  Tensor lse_d = testing::poisoned_device({B, hq, lq}, DType::kF32);
  const std::vector<int32_t> types(hq, 1);
  auto params = [&](const Tensor& tq, const Tensor& tk, const Tensor& tv, const Tensor& tm,
                    const Tensor& to, const Tensor& tl) {
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
    a.q = tq.data();
    a.k = tk.data();
    a.v = tv.data();
    a.out = to.data();
    for (int64_t* s : {a.q_stride, a.out_stride}) {
      s[0] = lq * hq * d, s[1] = hq * d, s[2] = d, s[3] = 1;
    }
    for (int64_t* s : {a.k_stride, a.v_stride}) {
      s[0] = lk * hkv * d, s[1] = hkv * d, s[2] = d, s[3] = 1;
    }
    a.head_mask_type = types.data();
    a.block_mask = tm.data_as<const uint8_t>();
    a.mask_stride[0] = hq * qb * kb, a.mask_stride[1] = qb * kb, a.mask_stride[2] = kb,
    a.mask_stride[3] = 1;
    a.mask_q_blocks = qb;
    a.mask_k_blocks = kb;
    a.lse = const_cast<float*>(tl.data_as<float>());
    a.lse_stride[0] = hq * lq, a.lse_stride[1] = 1, a.lse_stride[2] = lq;
    a.softmax_scale = 1.0 / std::sqrt(static_cast<double>(d));
    a.causal = true;
    return a;
  };
  reference_block_sparse_attention(params(q, k, v, mask, out_h, lse_h));
  native_block_sparse_attention(params(dq, dk, dv, dmask, out_d, lse_d));
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_TRUE(testing::all_close(Tensor::to_host(out_d.view()).view(), to_vector(out_h.view()),
                                 2e-2, 2e-2));
  EXPECT_TRUE(testing::all_close(Tensor::to_host(lse_d.view()).view(), to_vector(lse_h.view()),
                                 1e-3, 1e-3));
}

// What the native kernel does not take is refused, naming the argument.
TEST(GpuBlockSparseValidation, UnsupportedNativeInputsRaiseNotSupported) {
  SPARSE_ATTN_REQUIRE_GPU();
  auto rng = testing::make_rng();
  BsCase c;
  c.lq = {64};
  c.lk = {64};
  c.d = 32;
  Problem pb = make_problem(c, rng);
  try {
    run(pb, true);
    FAIL() << "head dim 32 accepted";
  } catch (const NotSupportedError& e) {
    EXPECT_NE(std::string(e.what()).find("head dims 64, 128 and 256"), std::string::npos)
        << e.what();
  }
  c.d = 128;
  c.page_size = 12;
  Problem paged = make_problem(c, rng);
  EXPECT_THROW(run(paged, true), NotSupportedError);
}

}  // namespace
}  // namespace sparse_attn
