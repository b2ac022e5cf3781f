// FP8 e4m3 caches (docs/qsa.md, "FP8 caches"): the e4m3fn decode of every code and the encoder's
// rounding; qsa_sparse_attention with FP8 K/V and the indexer ops with FP8 keys on the reference
// and CPU backends, against independent computations; the validation rules of the FP8 arguments.
// The native CUDA kernel's FP8 K/V are tested in test_gpu_sparse_attention.cpp (the Fp8 suites).
//
// Two oracles: a power-of-two scale makes every dequantised value exact in bfloat16, so the FP8
// call must equal, bit for bit, the same backend's call on bfloat16 copies of the dequantised
// values (the FP32 math after the load is the same); any other scale is checked against the
// double-precision attention of test_util on the dequantised values.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "sparse_attn/dtype.h"
#include "sparse_attn/errors.h"
#include "sparse_attn/qsa.h"
#include "test_util.h"

namespace sparse_attn {
namespace {

using testing::all_close;
using testing::make_rng;
using testing::random_fp8;
using testing::random_int32;
using testing::random_tensor;
using testing::to_vector;

// The value of an e4m3fn code from its definition, in double: (-1)^s * 2^(e - 7) * (1 + m / 8),
// subnormals (e == 0) 2^-6 * m / 8, NaN for e == 15 and m == 7.
double e4m3fn_value(unsigned code) {
  const unsigned s = code >> 7, e = (code >> 3) & 15u, m = code & 7u;
  if (e == 15 && m == 7) return std::numeric_limits<double>::quiet_NaN();
  const double mag = e == 0 ? std::ldexp(m / 8.0, -6) : std::ldexp(1.0 + m / 8.0, int(e) - 7);
  return s ? -mag : mag;
}

TEST(DType, Fp8E4M3DecodesEveryCode) {
  EXPECT_EQ(dtype_size(DType::kF8E4M3), 1u);
  EXPECT_STREQ(dtype_name(DType::kF8E4M3), "float8_e4m3fn");
  for (unsigned code = 0; code < 256; ++code) {
    const float got = fp8_e4m3_to_float(static_cast<uint8_t>(code));
    const double want = e4m3fn_value(code);
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << code;
    } else {
      EXPECT_EQ(static_cast<double>(got), want) << code;
      EXPECT_EQ(std::signbit(got), code >= 128) << code;  // -0.0 for 0x80
    }
  }
  EXPECT_TRUE(std::isnan(fp8_e4m3_to_float(0x7f)));
  EXPECT_TRUE(std::isnan(fp8_e4m3_to_float(0xff)));
  EXPECT_EQ(fp8_e4m3_to_float(0x7e), 448.f);  // no infinity: S.1111.110 is the largest value
  EXPECT_EQ(fp8_e4m3_to_float(0x78), 256.f);  // exponent 15 holds finite values
  EXPECT_EQ(fp8_e4m3_to_float(0x38), 1.f);
  EXPECT_EQ(fp8_e4m3_to_float(0x01), 0x1p-9f);  // smallest subnormal
  EXPECT_EQ(fp8_e4m3_to_float(0x07), 7 * 0x1p-9f);
  EXPECT_EQ(fp8_e4m3_to_float(0x08), 0x1p-6f);  // smallest normal
  const uint8_t bytes[] = {0x38, 0xfe};
  EXPECT_EQ(load_as_float(bytes, DType::kF8E4M3, 1), -448.f);
}

TEST(DType, Fp8E4M3EncodeRoundsAsTorch) {
  for (unsigned code = 0; code < 256; ++code) {
    if ((code & 0x7f) == 0x7f) continue;
    EXPECT_EQ(float_to_fp8_e4m3(fp8_e4m3_to_float(static_cast<uint8_t>(code))), code) << code;
  }
  EXPECT_EQ(float_to_fp8_e4m3(1.f + 1.f / 16), 0x38);  // halfway 1 .. 1.125: to even (1)
  EXPECT_EQ(float_to_fp8_e4m3(1.f + 3.f / 16), 0x3a);  // halfway 1.125 .. 1.25: to even (1.25)
  EXPECT_EQ(float_to_fp8_e4m3(0x1p-10f), 0x00);        // half the smallest subnormal: to even 0
  EXPECT_EQ(float_to_fp8_e4m3(3 * 0x1p-10f), 0x02);    // 1.5 subnormal steps: to even (2)
  EXPECT_EQ(float_to_fp8_e4m3(-0x1p-7f), 0x84);        // subnormal -4 * 2^-9
  EXPECT_EQ(float_to_fp8_e4m3(460.f), 0x7e);           // rounds down to 448
  EXPECT_EQ(float_to_fp8_e4m3(464.f), 0x7e);           // the tie goes to even (448)
  EXPECT_EQ(float_to_fp8_e4m3(465.f), 0x7f);           // past it: NaN, torch does not saturate
  EXPECT_EQ(float_to_fp8_e4m3(-1e9f), 0xff);
  EXPECT_EQ(float_to_fp8_e4m3(std::numeric_limits<float>::infinity()), 0x7f);
  EXPECT_EQ(float_to_fp8_e4m3(std::nanf("")) & 0x7f, 0x7f);
  EXPECT_EQ(round_to(DType::kF8E4M3, 0.3f), 0.3125f);
}

// The dequantised values stored x scale, computed in FP32 as the spec says, held in `dtype`
// (exact for bfloat16 when the scale is a power of two).
Tensor dequantised(const Tensor& fp8, float scale, DType dtype) {
  Tensor t = Tensor::empty(fp8.shape(), dtype);
  for (int64_t i = 0; i < fp8.numel(); ++i) {
    const float v = fp8_e4m3_to_float(fp8.data_as<uint8_t>()[i]) * scale;
    store_from_float(t.data(), dtype, i, v);
    EXPECT_EQ(load_as_float(t.data(), dtype, i), v) << "not exact in " << dtype_name(dtype);
  }
  return t;
}

// The same bytes as uint8, as engines hand them over.
TensorView as_u8(const TensorView& t) {
  return TensorView(t.data(), DType::kU8, t.device(), t.shape(),
                    Shape(t.strides(), t.strides() + t.dim()));
}

bool same_bits(const Tensor& a, const Tensor& b) {
  return a.numel() == b.numel() &&
         std::memcmp(a.data(), b.data(), a.numel() * dtype_size(a.dtype())) == 0;
}

// A paged logical call: query [2, 5, 4, 64], K/V pages [5, 4, 2, 64], block_table [2, 3] with a
// missing page, ids with -1 and out-of-range entries, seq_lens_k.
struct PagedAttention {
  static constexpr int64_t B = 2, Q = 5, Hq = 4, Hkv = 2, D = 64, W = 9;
  std::mt19937_64 rng = make_rng();
  Tensor q = random_tensor({B, Q, Hq, D}, DType::kBF16, rng);
  Tensor k8 = random_fp8({5, 4, Hkv, D}, rng, 448.f);
  Tensor v8 = random_fp8({5, 4, Hkv, D}, rng, 448.f);
  Tensor ids = random_int32({B, Q, W}, rng, -1, 13);
  Tensor table = testing::int32_tensor({B, 3}, {3, 0, -1, 4, 1, 2});
  Tensor seq_lens_k = testing::int32_tensor({B}, {10, 12});

  // out and lse of one call with these K/V.
  std::pair<Tensor, Tensor> run(const TensorView& k, const TensorView& v, Backend backend,
                                SparseAttentionOptions o) {
    o.backend = backend;
    o.block_table = table.view();
    o.seq_lens_k = seq_lens_k.view();
    Tensor out = Tensor::empty({B, Q, Hq, D}, DType::kBF16);
    Tensor lse = Tensor::empty({B, Q, Hq}, DType::kF32);
    qsa_sparse_attention(q, k, v, ids.view(), out, lse.view(), o);
    return {out, lse};
  }
};

TEST(QsaFp8, AttentionEqualsTheBf16PathOnDequantisedValues) {
  PagedAttention c;
  SparseAttentionOptions fp8;
  fp8.k_scale = 0.0078125;  // 2^-7: the dequantised values stay exact in bfloat16
  fp8.v_scale = 0.5;
  const Tensor kb = dequantised(c.k8, 0x1p-7f, DType::kBF16);
  const Tensor vb = dequantised(c.v8, 0.5f, DType::kBF16);
  for (Backend backend : {Backend::kReference, Backend::kNative}) {  // native on host: CPU
    const auto [want_out, want_lse] = c.run(kb, vb, backend, {});
    const auto [out, lse] = c.run(c.k8, c.v8, backend, fp8);
    EXPECT_TRUE(same_bits(out, want_out)) << backend_name(backend);
    EXPECT_TRUE(same_bits(lse, want_lse)) << backend_name(backend);
    // uint8 storage with the format named reads the same bytes the same way.
    SparseAttentionOptions named = fp8;
    named.kv_cache_dtype = DType::kF8E4M3;
    const auto [out_u8, lse_u8] = c.run(as_u8(c.k8), as_u8(c.v8), backend, named);
    EXPECT_TRUE(same_bits(out_u8, want_out)) << backend_name(backend);
    EXPECT_TRUE(same_bits(lse_u8, want_lse)) << backend_name(backend);
  }
}

TEST(QsaFp8, PhysicalAttentionMatchesDoublePrecisionOnDequantisedValues) {
  constexpr int64_t rows = 7, Hq = 8, Hkv = 2, D = 32, total = 19, W = 6;
  auto rng = make_rng();
  const Tensor q = random_tensor({rows, Hq, D}, DType::kBF16, rng);
  const Tensor k8 = random_fp8({total, Hkv, D}, rng, 4.f);
  const Tensor v8 = random_fp8({total, Hkv, D}, rng, 448.f);
  const Tensor ids = random_int32({rows, W}, rng, -2, total + 2);
  const float k_scale = 0.37f, v_scale = 3.1e-3f;  // not powers of two
  const Tensor kf = dequantised(k8, k_scale, DType::kF32);
  const Tensor vf = dequantised(v8, v_scale, DType::kF32);
  std::vector<int32_t> id_values(ids.data_as<int32_t>(), ids.data_as<int32_t>() + ids.numel());
  const double scale = 1 / std::sqrt(double(D));
  const testing::AttentionExpectation want =
      testing::expected_physical_attention(q, kf, vf, id_values, W, scale);
  for (Backend backend : {Backend::kReference, Backend::kNative}) {
    SparseAttentionOptions o;
    o.backend = backend;
    o.selected_kv_indices = ids.view();
    o.k_scale = k_scale;
    o.v_scale = v_scale;
    Tensor out = Tensor::empty({rows, Hq, D}, DType::kBF16);
    Tensor lse = Tensor::empty({rows, Hq}, DType::kF32);
    qsa_sparse_attention(q, k8, v8, std::nullopt, out, lse.view(), o);
    EXPECT_TRUE(all_close(out, want.out, 1e-2 * v_scale * 448, 1e-2)) << backend_name(backend);
    EXPECT_TRUE(all_close(lse, want.lse, 1e-4, 1e-4)) << backend_name(backend);
  }
}

// The three indexer forms with FP8 keys equal their runs on bfloat16 copies of the keys (every
// e4m3 value is exact in bfloat16), on both host backends.
TEST(QsaFp8, IndexerOpsReadFp8KeysUnscaled) {
  constexpr int64_t H = 4, D = 32;
  auto rng = make_rng();
  const Tensor q = random_tensor({2, 9, H, D}, DType::kBF16, rng);
  const Tensor cache8 = random_fp8({3, 4, 1, D}, rng, 448.f);
  const Tensor cache16 = dequantised(cache8, 1.f, DType::kBF16);
  const Tensor table = testing::int32_tensor({2, 2}, {2, 0, -1, 1});
  const Tensor q_rows = random_tensor({6, H, D}, DType::kF16, rng);
  const Tensor k8 = random_fp8({7, D}, rng, 448.f);
  const Tensor k16 = dequantised(k8, 1.f, DType::kF16);
  const Tensor starts = testing::int32_tensor({6}, {0, 1, 2, -3, 5, 4});
  const Tensor ends = testing::int32_tensor({6}, {7, 3, 9, 2, 5, 6});
  const Tensor q_dec = random_tensor({2, H, D}, DType::kBF16, rng);
  const Tensor context_lens = testing::int32_tensor({2}, {6, 7});
  for (Backend backend : {Backend::kReference, Backend::kNative}) {
    for (bool u8 : {false, true}) {
      const std::string what = std::string(backend_name(backend)) + (u8 ? " uint8" : " fp8");
      IndexerScoreOptions so;
      so.backend = backend;
      so.block_table = table.view();
      MqaScoreOptions mo;
      mo.backend = backend;
      if (u8) so.kv_cache_dtype = mo.kv_cache_dtype = DType::kF8E4M3;
      auto keys = [&](const Tensor& t) { return u8 ? as_u8(t) : t.view(); };

      Tensor want = Tensor::empty({2, 9, 8}, DType::kF32),
             got = Tensor::empty({2, 9, 8}, DType::kF32);
      IndexerScoreOptions so16 = so;
      so16.kv_cache_dtype.reset();
      qsa_indexer_mqa_score(q, cache16, want, so16);
      qsa_indexer_mqa_score(q, keys(cache8), got, so);
      EXPECT_TRUE(same_bits(got, want)) << "score " << what;
      EXPECT_EQ(qsa_indexer_mqa_score_shape(q, keys(cache8), so), (Shape{2, 9, 8}));

      MqaScoreOptions mo16 = mo;
      mo16.kv_cache_dtype.reset();
      want = Tensor::empty({6, 7}, DType::kF32), got = Tensor::empty({6, 7}, DType::kF32);
      qsa_mqa_prefill(q_rows, k16, starts, ends, want, mo16);
      qsa_mqa_prefill(q_rows, keys(k8), starts, ends, got, mo);
      EXPECT_TRUE(same_bits(got, want)) << "prefill " << what;
      EXPECT_EQ(qsa_mqa_prefill_shape(q_rows, keys(k8), mo), (Shape{6, 7}));

      want = Tensor::empty({2, 10}, DType::kF32), got = Tensor::empty({2, 10}, DType::kF32);
      qsa_mqa_decode(q_dec, cache16, table, context_lens, 10, want, mo16);
      qsa_mqa_decode(q_dec, keys(cache8), table, context_lens, 10, got, mo);
      EXPECT_TRUE(same_bits(got, want)) << "decode " << what;
    }
  }
}

// A check that the call raises E with every fragment in its message.
template <typename E, typename F>
void expect_error(F&& call, std::initializer_list<const char*> fragments) {
  try {
    call();
    ADD_FAILURE() << "no error";
  } catch (const E& e) {
    for (const char* f : fragments) {
      EXPECT_NE(std::string(e.what()).find(f), std::string::npos) << e.what() << " / " << f;
    }
  }
}

#ifndef SPARSE_ATTN_TEST_HAS_CUDA
// The same view labelled cuda:0: validation reads no contents, and in a build without CUDA the
// calls fail before any kernel could run.
TensorView on_cuda(const TensorView& t) {
  return TensorView(t.data(), t.dtype(), Device::cuda(0), t.shape(),
                    Shape(t.strides(), t.strides() + t.dim()));
}
#endif

TEST(QsaFp8, AttentionValidation) {
  PagedAttention c;
  const Tensor kb = dequantised(c.k8, 1.f, DType::kBF16);
  const Tensor vb = dequantised(c.v8, 1.f, DType::kBF16);
  auto run = [&](const TensorView& k, const TensorView& v, SparseAttentionOptions o) {
    return [&c, k, v, o] { c.run(k, v, Backend::kReference, o); };
  };
  SparseAttentionOptions o;
  o.k_scale = 2;
  expect_error<ValueError>(run(kb, vb, o), {"k_scale: expected 1.0 for bfloat16 K/V", "got 2"});
  o = {};
  o.v_scale = 0.5;
  expect_error<ValueError>(run(kb, vb, o), {"v_scale: expected 1.0 for bfloat16", "FP8"});
  for (double bad : {0.0, -1.0, std::nan(""), std::numeric_limits<double>::infinity(), 1e39}) {
    o = {};
    o.k_scale = bad;
    expect_error<ValueError>(run(c.k8, c.v8, o), {"k_scale: expected a value representable"});
    o = {};
    o.v_scale = bad;
    expect_error<ValueError>(run(c.k8, c.v8, o), {"v_scale: expected a value representable"});
  }
  expect_error<TypeError>(run(as_u8(c.k8), as_u8(c.v8), {}),
                          {"key: uint8 storage", "kv_cache_dtype='fp8_e4m3'"});
  expect_error<TypeError>(run(c.k8, as_u8(c.v8), {}), {"value: uint8 storage", "kv_cache_dtype"});
  expect_error<TypeError>(run(c.k8, vb, {}), {"value: expected dtype float8_e4m3fn, got bfloat16"});
  expect_error<TypeError>(run(kb, c.v8, {}), {"value: expected dtype bfloat16, got float8_e4m3fn"});
  const Tensor k16 = dequantised(c.k8, 1.f, DType::kF16);
  expect_error<TypeError>(run(k16, k16, {}), {"key: expected dtype bfloat16 (the query's) or "
                                              "float8_e4m3fn (FP8 K/V), got float16"});
  o = {};
  o.kv_cache_dtype = DType::kF8E4M3;
  expect_error<TypeError>(run(c.k8, vb, o), {"value: kv_cache_dtype float8_e4m3fn reads uint8"});
  o.kv_cache_dtype = DType::kF32;
  expect_error<ValueError>(run(c.k8, c.v8, o), {"kv_cache_dtype: expected float8_e4m3fn"});
  o.kv_cache_dtype = DType::kBF16;
  expect_error<TypeError>(run(c.k8, c.v8, o), {"key: expected dtype bfloat16 (kv_cache_dtype)"});
  EXPECT_NO_THROW(run(kb, vb, o)());  // naming the 16-bit dtype only confirms it
}

TEST(QsaFp8, IndexerValidation) {
  constexpr int64_t H = 4, D = 128;
  auto rng = make_rng();
  const Tensor q = random_tensor({3, H, D}, DType::kBF16, rng);
  const Tensor k8 = random_fp8({5, D}, rng, 448.f);
  const Tensor rows = testing::int32_tensor({3}, {0, 0, 0});
  const Tensor cache8 = random_fp8({2, 8, 1, D}, rng, 448.f);
  const Tensor table = testing::int32_tensor({3, 1}, {0, 1, 0});
  const Tensor lens = testing::int32_tensor({3}, {1, 2, 3});
  const Tensor q_idx = random_tensor({3, 4, H, D}, DType::kBF16, rng);
  const Tensor keys8 = random_fp8({3, 2, D}, rng, 448.f);
  Tensor out = Tensor::empty({3, 5}, DType::kF32);
  MqaScoreOptions mo;
  mo.backend = Backend::kReference;
  expect_error<TypeError>([&] { qsa_mqa_prefill(q, as_u8(k8), rows, rows, out, mo); },
                          {"k: uint8 storage", "kv_cache_dtype"});
  expect_error<TypeError>([&] { qsa_mqa_prefill_shape(q, as_u8(k8), mo); }, {"k: uint8 storage"});
  Tensor dec = Tensor::empty({3, 16}, DType::kF32);
  expect_error<TypeError>([&] { qsa_mqa_decode(q, as_u8(cache8), table, lens, 16, dec, mo); },
                          {"k_cache: uint8 storage"});
  Tensor scores = Tensor::empty({3, 4, 2}, DType::kF32);
  IndexerScoreOptions so;
  so.backend = Backend::kReference;
  expect_error<TypeError>([&] { qsa_indexer_mqa_score(q_idx, as_u8(keys8), scores, so); },
                          {"block_keys: uint8 storage"});
  const Tensor k32 = Tensor::empty({5, D}, DType::kF32);
  expect_error<TypeError>([&] { qsa_mqa_prefill(q, k32, rows, rows, out, mo); },
                          {"k: expected dtype bfloat16 (the dtype of q) or float8_e4m3fn"});

#ifndef SPARSE_ATTN_TEST_HAS_CUDA
  // Native on CUDA reads FP8 keys in all three ops: the calls pass validation and meet this
  // build's missing kernels (test_gpu_qsa_indexer.cpp runs them on a GPU).
  mo.backend = Backend::kNative;
  so.backend = Backend::kNative;
  expect_error<NotSupportedError>(
      [&] {
        qsa_mqa_prefill(on_cuda(q), on_cuda(k8), on_cuda(rows), on_cuda(rows), on_cuda(out), mo);
      },
      {"qsa_mqa_prefill: backend 'native' needs a CUDA build"});
  expect_error<NotSupportedError>(
      [&] {
        qsa_mqa_decode(on_cuda(q), on_cuda(cache8), on_cuda(table), on_cuda(lens), 16, on_cuda(dec),
                       mo);
      },
      {"qsa_mqa_decode: backend 'native' needs a CUDA build"});
  so.kv_cache_dtype = DType::kF8E4M3;
  expect_error<NotSupportedError>(
      [&] { qsa_indexer_mqa_score(on_cuda(q_idx), on_cuda(as_u8(keys8)), on_cuda(scores), so); },
      {"qsa_indexer_mqa_score: backend 'native' needs a CUDA build"});
#endif
}

}  // namespace
}  // namespace sparse_attn
