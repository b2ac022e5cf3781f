// The CPU backend's QSA indexer ops (backend 'native' on host tensors) against the reference on
// fresh random inputs: every query form (padded, cu_seqlens_q, token_to_req; positions and
// seq_lens_q), logical and paged keys (page sizes 1 to 64, missing and out-of-range pages),
// prefill windows clamped to the keys, decode contexts past the table, other head counts and
// dims, strided inputs. The products of two 16-bit values are exact in FP32 and both backends
// sum over the head dim in order, so the outputs are compared bit for bit. Broken metadata is
// the reference's ValueError.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "sparse_attn/errors.h"
#include "sparse_attn/qsa.h"
#include "test_util.h"

namespace sparse_attn {
namespace {

using testing::int32_tensor;
using testing::make_rng;
using testing::poison;
using testing::random_int32;
using testing::random_tensor;

// Runs `call(backend, out)` on both host backends into poisoned outputs; the bits must agree.
template <class Call>
void expect_same_bits(const Shape& out_shape, Call call, const std::string& what) {
  Tensor ref = Tensor::empty(out_shape, DType::kF32), cpu = Tensor::empty(out_shape, DType::kF32);
  poison(ref);
  poison(cpu);
  call(Backend::kReference, ref.view());
  call(Backend::kNative, cpu.view());
  EXPECT_EQ(std::memcmp(ref.data(), cpu.data(), ref.numel() * 4), 0) << what;
}

struct ScoreCase {
  std::string name;
  DType dtype = DType::kBF16;
  int64_t heads = 4, dim = 128;
  std::string q_form = "padded";  // padded, cu_seqlens, token_to_req
  int64_t page_size = 0;          // 0: logical keys
  bool positions = false, seq_lens_q = false;
};

class CpuIndexerScore : public ::testing::TestWithParam<ScoreCase> {};

TEST_P(CpuIndexerScore, SameBitsAsTheReference) {
  const ScoreCase& c = GetParam();
  auto rng = make_rng();
  const int64_t B = 3, rows = 37, nb = 90;
  const bool padded = c.q_form == "padded";
  Tensor q = padded ? random_tensor({B, rows, c.heads, c.dim}, c.dtype, rng, -2.f, 2.f)
                    : random_tensor({B * rows, c.heads, c.dim}, c.dtype, rng, -2.f, 2.f);
  IndexerScoreOptions o;
  Tensor keys, table, cu, t2r, pos, lens;
  if (c.page_size == 0) {
    keys = random_tensor({B, nb, c.dim}, c.dtype, rng, -2.f, 2.f);
  } else {
    const int64_t pages = (nb + c.page_size - 1) / c.page_size, pool = B * pages + 2;
    keys = random_tensor({pool, c.page_size, c.dim}, c.dtype, rng, -2.f, 2.f);
    table = random_int32({B, pages}, rng, -1, static_cast<int32_t>(pool + 1));  // some masked
    o.block_table = table.view();
    o.page_size = c.page_size;
  }
  if (c.q_form == "cu_seqlens") {
    cu = int32_tensor({B + 1}, {0, 10, 10, static_cast<int32_t>(B * rows)});
    o.cu_seqlens_q = cu.view();
  } else if (c.q_form == "token_to_req") {
    t2r = random_int32({B * rows}, rng, -1, static_cast<int32_t>(B - 1));  // -1: padding rows
    o.token_to_req = t2r.view();
    o.num_requests = B;
  }
  if (c.positions || c.q_form == "token_to_req") {  // token_to_req needs them
    pos = padded ? random_int32({B, rows}, rng, -5, 4 * nb + 8)
                 : random_int32({B * rows}, rng, -5, 4 * nb + 8);
    o.query_positions = pos.view();
  }
  if (c.seq_lens_q && padded) {
    lens = int32_tensor({B}, {static_cast<int32_t>(rows), 0, 20});
    o.seq_lens_q = lens.view();
  }
  const Shape shape = qsa_indexer_mqa_score_shape(q, keys, o);
  expect_same_bits(
      shape,
      [&](Backend b, const TensorView& out) {
        IndexerScoreOptions x = o;
        x.backend = b;
        qsa_indexer_mqa_score(q, keys, out, x);
      },
      c.name);
}

std::vector<ScoreCase> score_cases() {
  std::vector<ScoreCase> v;
  for (const char* form : {"padded", "cu_seqlens", "token_to_req"}) {
    for (int64_t page : {0, 1, 7, 16, 64}) {
      ScoreCase c;
      c.q_form = form;
      c.page_size = page;
      c.positions = page % 2 == 1 || page == 0;
      c.seq_lens_q = true;
      c.name = std::string(form) + "_page" + std::to_string(page);
      v.push_back(c);
    }
  }
  ScoreCase c;
  c.name = "fp16_heads3_dim40_positions";
  c.dtype = DType::kF16;
  c.heads = 3;
  c.dim = 40;
  c.positions = true;
  v.push_back(c);
  c.name = "bf16_heads1_dim16_paged5";
  c.dtype = DType::kBF16;
  c.heads = 1;
  c.dim = 16;
  c.page_size = 5;
  v.push_back(c);
  return v;
}

INSTANTIATE_TEST_SUITE_P(Forms, CpuIndexerScore, ::testing::ValuesIn(score_cases()),
                         [](const auto& info) { return info.param.name; });

TEST(CpuIndexerPrefill, WindowsClampedToTheKeysSameBits) {
  auto rng = make_rng();
  for (DType dt : {DType::kBF16, DType::kF16}) {
    const int64_t rows = 150, keys = 333;
    Tensor q = random_tensor({rows, 4, 128}, dt, rng, -2.f, 2.f);
    Tensor k = random_tensor({keys, 128}, dt, rng, -2.f, 2.f);
    Tensor starts = random_int32({rows}, rng, -20, 350);
    Tensor ends = random_int32({rows}, rng, -20, 400);
    expect_same_bits(
        {rows, keys},
        [&](Backend b, const TensorView& out) {
          MqaScoreOptions o;
          o.backend = b;
          qsa_mqa_prefill(q, k, starts, ends, out, o);
        },
        "prefill");
    // Strided inputs: every other row of a taller q, k seen through a [keys, 1, 128] view.
    Tensor q2 = random_tensor({2 * rows, 4, 128}, dt, rng);
    TensorView qs = q2.view().as_strided({rows, 4, 128}, {2 * 4 * 128, 128, 1});
    TensorView k3 = k.view().as_strided({keys, 1, 128}, {128, 128, 1});
    expect_same_bits(
        {rows, keys},
        [&](Backend b, const TensorView& out) {
          MqaScoreOptions o;
          o.backend = b;
          qsa_mqa_prefill(qs, k3, starts, ends, out, o);
        },
        "prefill strided");
  }
}

TEST(CpuIndexerDecode, ContextsAndPagesMaskedSameBits) {
  auto rng = make_rng();
  for (int64_t page : {1, 8, 16, 64, 200}) {
    const int64_t B = 6, max_pages = 7, pool = 30, max_len = 500;
    Tensor q = random_tensor({B, 4, 128}, DType::kBF16, rng, -2.f, 2.f);
    Tensor cache = random_tensor({pool, page, 128}, DType::kBF16, rng, -2.f, 2.f);
    Tensor table = random_int32({B, max_pages}, rng, -2, static_cast<int32_t>(pool + 2));
    Tensor lens = int32_tensor({B}, {0, 1, 37, 499, 5000, -3});  // past the table, negative
    expect_same_bits(
        {B, max_len},
        [&](Backend b, const TensorView& out) {
          MqaScoreOptions o;
          o.backend = b;
          qsa_mqa_decode(q, cache, table, lens, max_len, out, o);
        },
        "decode page " + std::to_string(page));
  }
}

TEST(CpuIndexerScore, BrokenMetadataIsTheReferencesValueError) {
  auto rng = make_rng();
  Tensor q = random_tensor({20, 4, 128}, DType::kBF16, rng);
  Tensor keys = random_tensor({2, 10, 128}, DType::kBF16, rng);
  Tensor out = Tensor::empty({20, 10}, DType::kF32);
  for (Backend b : {Backend::kReference, Backend::kNative}) {
    IndexerScoreOptions o;
    o.backend = b;
    Tensor cu = int32_tensor({3}, {0, 15, 12});
    o.cu_seqlens_q = cu.view();
    EXPECT_THROW(qsa_indexer_mqa_score(q, keys, out, o), ValueError) << backend_name(b);
    o.cu_seqlens_q.reset();
    Tensor t2r = int32_tensor({20}, std::vector<int32_t>(20, 2));
    Tensor pos = int32_tensor({20}, std::vector<int32_t>(20, 9));
    o.token_to_req = t2r.view();
    o.query_positions = pos.view();
    o.num_requests = 2;
    try {
      qsa_indexer_mqa_score(q, keys, out, o);
      ADD_FAILURE() << "request id 2 of 2 accepted";
    } catch (const ValueError& e) {
      EXPECT_NE(std::string(e.what()).find("token_to_req"), std::string::npos) << e.what();
    }
  }
}

}  // namespace
}  // namespace sparse_attn
