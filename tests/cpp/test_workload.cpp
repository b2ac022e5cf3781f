// The workload generator: shapes, determinism, and that the structure it promises is really in
// the attention (sinks, needles and locality draw the mass they should; the indexer finds
// them), checked with softmax attention computed here in double precision.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <numeric>
#include <set>

#include "sparse_attn/errors.h"
#include "sparse_attn/qsa_compress.h"
#include "sparse_attn/workload.h"
#include "test_util.h"

namespace sparse_attn {
namespace {

using testing::to_vector;

// Host copies of a workload's tensors as doubles, with softmax helpers.
struct Dense {
  explicit Dense(const Workload& w) : o(w.options), q(to_vector(w.query)), k(to_vector(w.key)) {
    if (o.indexer_heads > 0) {
      qi = to_vector(w.index_query);
      ki = to_vector(w.index_key);
    }
  }

  // Softmax probabilities of query row `row`, head h, over keys 0..position (causal).
  std::vector<double> probs(int64_t b, int64_t row, int64_t h) const {
    const int64_t D = o.head_dim, Hq = o.num_q_heads, Hkv = o.num_kv_heads;
    const int64_t pos = o.seq_len - o.query_len + row, g = h / (Hq / Hkv);
    const double scale = 1.0 / std::sqrt(double(D));
    std::vector<double> p(static_cast<size_t>(pos + 1));
    const double* qv = &q[((b * o.query_len + row) * Hq + h) * D];
    for (int64_t j = 0; j <= pos; ++j) {
      const double* kv = &k[((b * o.seq_len + j) * Hkv + g) * D];
      double s = 0;
      for (int64_t d = 0; d < D; ++d) s += qv[d] * kv[d];
      p[j] = scale * s;
    }
    const double mx = *std::max_element(p.begin(), p.end());
    double sum = 0;
    for (double& x : p) sum += (x = std::exp(x - mx));
    for (double& x : p) x /= sum;
    return p;
  }

  // QSA indexer score of every compressed key visible to query row `row` (4c+3 <= pos).
  std::vector<double> index_scores(int64_t b, int64_t row) const {
    const int64_t Di = o.indexer_dim, Hi = o.indexer_heads, blk = o.indexer_block;
    const int64_t pos = o.seq_len - o.query_len + row, nb = o.seq_len / blk;
    std::vector<double> s;
    for (int64_t c = 0; c < nb && blk * c + blk - 1 <= pos; ++c) {
      double acc = 0;
      for (int64_t h = 0; h < Hi; ++h) {
        double dot = 0;
        for (int64_t d = 0; d < Di; ++d)
          dot += qi[((b * o.query_len + row) * Hi + h) * Di + d] * ki[(b * nb + c) * Di + d];
        acc += std::max(dot, 0.0);
      }
      s.push_back(acc / std::sqrt(double(Di)));
    }
    return s;
  }

  WorkloadOptions o;
  std::vector<double> q, k, qi, ki;
};

// Ids of the k largest entries (ties to the lower id).
std::vector<int64_t> top_k(const std::vector<double>& s, size_t k) {
  std::vector<int64_t> ids(s.size());
  std::iota(ids.begin(), ids.end(), 0);
  k = std::min(k, ids.size());
  std::partial_sort(ids.begin(), ids.begin() + k, ids.end(),
                    [&](int64_t a, int64_t b) { return s[a] > s[b] || (s[a] == s[b] && a < b); });
  ids.resize(k);
  return ids;
}

WorkloadOptions small_qsa(uint64_t seed) {
  WorkloadOptions o;
  o.seed = seed;
  o.seq_len = 2048;
  o.num_q_heads = 4;
  o.num_kv_heads = 2;
  o.head_dim = 128;
  o.indexer_dim = 64;
  return o;
}

double sum_range(const std::vector<double>& p, int64_t lo, int64_t hi) {
  double s = 0;
  for (int64_t j = std::max<int64_t>(lo, 0); j < std::min<int64_t>(hi, p.size()); ++j) s += p[j];
  return s;
}

TEST(Workload, ShapesForQsaGeometry) {
  WorkloadOptions o;
  o.seq_len = 64;
  o.query_len = 16;
  const Workload w = make_workload(o);
  EXPECT_EQ(w.query.shape(), (Shape{1, 16, 24, 256}));
  EXPECT_EQ(w.key.shape(), (Shape{1, 64, 2, 256}));
  EXPECT_EQ(w.value.shape(), (Shape{1, 64, 2, 256}));
  EXPECT_EQ(w.index_query.shape(), (Shape{1, 16, 4, 128}));
  EXPECT_EQ(w.index_key.shape(), (Shape{1, 16, 128}));
  EXPECT_EQ(w.query.dtype(), DType::kBF16);
  EXPECT_EQ(w.query_position(0), 48);
  EXPECT_EQ(w.options.rotary_dims, 64);
}

TEST(Workload, ShapesForXAttentionGeometryWithoutIndexer) {
  WorkloadOptions o;
  o.batch = 2;
  o.seq_len = 130;  // not a multiple of the indexer block or of 128
  o.num_q_heads = 32;
  o.num_kv_heads = 8;
  o.head_dim = 128;
  o.indexer_heads = 0;
  o.dtype = DType::kF16;
  const Workload w = make_workload(o);
  EXPECT_EQ(w.query.shape(), (Shape{2, 130, 32, 128}));
  EXPECT_EQ(w.key.shape(), (Shape{2, 130, 8, 128}));
  EXPECT_EQ(w.index_query.data(), nullptr);
  EXPECT_EQ(w.index_key.data(), nullptr);
  EXPECT_EQ(w.query.dtype(), DType::kF16);
}

TEST(Workload, SameSeedGivesBitwiseSameTensorsAndOtherSeedsDiffer) {
  WorkloadOptions o = small_qsa(7);
  o.seq_len = 256;
  const Workload a = make_workload(o), b = make_workload(o);
  for (auto [x, y] : {std::pair{&a.query, &b.query},
                      {&a.key, &b.key},
                      {&a.value, &b.value},
                      {&a.index_query, &b.index_query},
                      {&a.index_key, &b.index_key}}) {
    const size_t bytes = x->numel() * dtype_size(x->dtype());
    EXPECT_EQ(std::memcmp(x->data(), y->data(), bytes), 0);
  }
  o.seed = 8;
  const Workload c = make_workload(o);
  EXPECT_NE(std::memcmp(a.key.data(), c.key.data(), a.key.numel() * 2), 0);
}

// The compressed keys are qsa_compress_block_keys' output for the workload's own raw keys,
// norm weight and RoPE: the op's definition, bit for bit (both run the reference).
TEST(Workload, CompressedKeysAreTheOpsOutputForTheRawKeys) {
  const Workload w = make_workload(small_qsa(1));
  ASSERT_EQ(w.index_key_raw.shape(), (Shape{1, w.options.seq_len, w.options.indexer_dim}));
  ASSERT_EQ(w.index_rotary_dims, w.options.indexer_dim / 2);
  const Tensor out = Tensor::empty(w.index_key.shape(), w.index_key.dtype());
  CompressBlockKeysOptions co;
  co.rope_theta = w.options.rope_theta;
  co.rope_dim = w.index_rotary_dims;
  co.eps = w.index_norm_eps;
  qsa_compress_block_keys(w.index_key_raw, w.index_norm_weight, out, co);
  EXPECT_EQ(std::memcmp(out.data(), w.index_key.data(), out.numel() * dtype_size(out.dtype())), 0);
  // RoPE keeps the norm and w is small, so the keys' RMS stays near 1.
  const auto k = to_vector(w.index_key);
  const int64_t Di = w.options.indexer_dim;
  for (int64_t c = 0; c < w.index_key.shape()[1]; c += 37) {
    double ms = 0;
    for (int64_t d = 0; d < Di; ++d) ms += k[c * Di + d] * k[c * Di + d];
    EXPECT_NEAR(std::sqrt(ms / Di), 1.0, 0.1) << "compressed key " << c;
  }
}

TEST(Workload, SinksDrawAttentionMassThatRandomKeysDoNot) {
  WorkloadOptions o = small_qsa(2);
  const Dense structured(make_workload(o));
  o.mode = WorkloadMode::kRandom;
  const Dense random(make_workload(o));
  double s_mass = 0, r_mass = 0;
  int n = 0;
  for (int64_t row = 512; row < o.seq_len; row += 97)
    for (int64_t h = 0; h < o.num_q_heads; ++h, ++n) {
      s_mass += sum_range(structured.probs(0, row, h), 0, o.num_sinks);
      r_mass += sum_range(random.probs(0, row, h), 0, o.num_sinks);
    }
  s_mass /= n;
  r_mass /= n;
  RecordProperty("sink_mass", std::to_string(s_mass));
  EXPECT_GT(s_mass, 0.1) << "mean attention mass on the sinks, structured";
  EXPECT_LT(s_mass, 0.6) << "sinks must not swallow everything";
  EXPECT_LT(r_mass, 0.02) << "mean attention mass on the first tokens, random";
}

TEST(Workload, NeedlesDrawTheirQueriesMassAndOnlyTheirs) {
  const WorkloadOptions o = small_qsa(3);
  const Workload w = make_workload(o);
  const Dense dense(w);
  ASSERT_EQ(w.needles.size(), size_t(o.num_needles));
  for (const Needle& n : w.needles) {
    EXPECT_GE(n.query_begin - n.key_pos, o.seq_len / 4) << "needle keys are far";
    EXPECT_EQ(n.query_end - n.query_begin, o.needle_queries);
    double mass = 0;
    for (int64_t h = 0; h < o.num_q_heads; ++h) {
      mass += dense.probs(0, n.query_begin + (n.query_end - n.query_begin) / 2, h)[n.key_pos];
      if (n.query_end < o.seq_len) {
        const auto after = dense.probs(0, n.query_end, h);
        EXPECT_LT(after[n.key_pos], 0.01) << "needle at " << n.key_pos << ", row after span";
      }
    }
    EXPECT_GT(mass / o.num_q_heads, 0.3) << "mean mass of the needle at " << n.key_pos;
  }
}

TEST(Workload, HeavyHittersDrawMoreMassThanOtherFarKeys) {
  const WorkloadOptions o = small_qsa(9);
  const Workload w = make_workload(o);
  const Dense dense(w);
  const auto& heavy = w.heavy_hitters.at(0);
  ASSERT_GT(heavy.size(), 10u);
  std::set<int64_t> special(heavy.begin(), heavy.end());
  for (const Needle& n : w.needles) special.insert(n.key_pos);
  double heavy_p = 0, other_p = 0;
  int64_t heavy_n = 0, other_n = 0;
  for (int64_t row = 1536; row < o.seq_len; row += 61)
    for (int64_t h = 0; h < o.num_q_heads; ++h) {
      const auto p = dense.probs(0, row, h);
      for (int64_t t = o.num_sinks; t < row - 512; ++t) {  // far from the local window
        if (std::binary_search(heavy.begin(), heavy.end(), t)) {
          heavy_p += p[t], ++heavy_n;
        } else if (!special.count(t)) {
          other_p += p[t], ++other_n;
        }
      }
    }
  EXPECT_GT(heavy_p / heavy_n, 10 * other_p / other_n)
      << "mean probability of a far heavy hitter vs another far key";
}

TEST(Workload, LocalWindowDrawsMoreMassThanInRandomMode) {
  WorkloadOptions o = small_qsa(4);
  const Dense structured(make_workload(o));
  o.mode = WorkloadMode::kRandom;
  const Dense random(make_workload(o));
  double s_mass = 0, r_mass = 0;
  int n = 0;
  for (int64_t row = 1024; row < o.seq_len; row += 101)
    for (int64_t h = 0; h < o.num_q_heads; ++h, ++n) {
      s_mass += sum_range(structured.probs(0, row, h), row - 63, row + 1);
      r_mass += sum_range(random.probs(0, row, h), row - 63, row + 1);
    }
  s_mass /= n;
  r_mass /= n;
  EXPECT_GT(s_mass, 0.2) << "mean mass on the last 64 tokens, structured";
  EXPECT_LT(r_mass, 0.1) << "mean mass on the last 64 tokens, random";
}

TEST(Workload, IndexerTopBlocksHoldTheNeedlesTheSinksAndTheDenseMass) {
  const WorkloadOptions o = small_qsa(5);
  const Workload w = make_workload(o);
  const Dense dense(w);
  const size_t k = 64;  // of 512 blocks: 12.5% of the context
  for (const Needle& n : w.needles) {
    const int64_t row = n.query_begin;
    const auto top = top_k(dense.index_scores(0, row), k);
    const std::set<int64_t> sel(top.begin(), top.end());
    EXPECT_TRUE(sel.count(n.key_pos / o.indexer_block)) << "needle at " << n.key_pos;
    EXPECT_TRUE(sel.count(0)) << "sink block, row " << row;
    double recall = 0;
    for (int64_t h = 0; h < o.num_q_heads; ++h) {
      const auto p = dense.probs(0, row, h);
      for (int64_t b : sel) recall += sum_range(p, b * 4, b * 4 + 4);
      recall += sum_range(p, (row + 1) / 4 * 4, row + 1);  // the incomplete block QSA always adds
    }
    EXPECT_GT(recall / o.num_q_heads, 0.8) << "attention mass in the indexer's blocks, row " << row;
  }
}

TEST(Workload, ConsecutiveRowsSelectNearlyTheSameBlocks) {
  const WorkloadOptions o = small_qsa(6);
  const Dense dense(make_workload(o));
  double jaccard = 0;
  int n = 0;
  for (int64_t row = 1000; row < o.seq_len - 4; row += 53, ++n) {
    const auto a = top_k(dense.index_scores(0, row), 64);
    const auto b = top_k(dense.index_scores(0, row + 4), 64);
    std::set<int64_t> sa(a.begin(), a.end()), sb(b.begin(), b.end()), un = sa;
    un.insert(sb.begin(), sb.end());
    jaccard += double(sa.size() + sb.size() - un.size()) / double(un.size());
  }
  jaccard /= n;
  RecordProperty("jaccard", std::to_string(jaccard));
  EXPECT_GT(jaccard, 0.6);
}

struct BadOption {
  const char* name;
  std::function<void(WorkloadOptions&)> set;
};

class WorkloadValidation : public ::testing::TestWithParam<BadOption> {};

TEST_P(WorkloadValidation, RaisesValueErrorNamingTheOption) {
  WorkloadOptions o;
  o.seq_len = 64;
  GetParam().set(o);
  try {
    make_workload(o);
    FAIL() << "no error for " << GetParam().name;
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find(GetParam().name), std::string::npos) << e.what();
  }
}

INSTANTIATE_TEST_SUITE_P(
    Options, WorkloadValidation,
    ::testing::Values(BadOption{"batch", [](auto& o) { o.batch = 0; }},
                      BadOption{"seq_len", [](auto& o) { o.seq_len = 0; }},
                      BadOption{"query_len", [](auto& o) { o.query_len = 65; }},
                      BadOption{"num_kv_heads", [](auto& o) { o.num_kv_heads = 0; }},
                      BadOption{"num_q_heads", [](auto& o) { o.num_q_heads = 3; }},
                      BadOption{"head_dim", [](auto& o) { o.head_dim = 0; }},
                      BadOption{"rotary_dims", [](auto& o) { o.rotary_dims = 3; }},
                      BadOption{"indexer_heads", [](auto& o) { o.indexer_heads = -1; }},
                      BadOption{"indexer_dim", [](auto& o) { o.indexer_dim = 1; }},
                      BadOption{"indexer_block", [](auto& o) { o.indexer_block = 3; }},
                      BadOption{"num_sinks", [](auto& o) { o.num_sinks = 65; }},
                      BadOption{"content_rank", [](auto& o) { o.content_rank = 0; }},
                      BadOption{"segment_len", [](auto& o) { o.segment_len = 0; }},
                      BadOption{"sink_logit", [](auto& o) { o.sink_logit = -1; }},
                      BadOption{"heavy_logit", [](auto& o) { o.heavy_logit = -1; }},
                      BadOption{"heavy_fraction", [](auto& o) { o.heavy_fraction = 1.5; }},
                      BadOption{"local_logit", [](auto& o) { o.local_logit = NAN; }},
                      BadOption{"topic_logit", [](auto& o) { o.topic_logit = INFINITY; }},
                      BadOption{"needle_logit", [](auto& o) { o.needle_logit = -2; }},
                      BadOption{"noise", [](auto& o) { o.noise = -0.5; }},
                      BadOption{"rope_theta", [](auto& o) { o.rope_theta = 0; }},
                      BadOption{"num_needles", [](auto& o) { o.num_needles = -1; }},
                      BadOption{"needle_queries", [](auto& o) { o.needle_queries = 0; }}),
    [](const auto& info) { return std::string(info.param.name); });

TEST(WorkloadValidation, NonFloatingDtypeIsATypeError) {
  WorkloadOptions o;
  o.seq_len = 8;
  o.dtype = DType::kI32;
  EXPECT_THROW(make_workload(o), TypeError);
}

TEST(WorkloadValidation, ModeNamesParseAndUnknownOnesRaise) {
  EXPECT_EQ(parse_workload_mode("random"), WorkloadMode::kRandom);
  EXPECT_EQ(parse_workload_mode("structured"), WorkloadMode::kStructured);
  EXPECT_THROW(parse_workload_mode("Structured"), ValueError);
}

TEST(WorkloadValidation, CudaDeviceWithoutCudaBuildRaisesNotCrashes) {
#ifdef SPARSE_ATTN_TEST_HAS_CUDA
  GTEST_SKIP() << "CUDA build: covered by the GPU cases";
#else
  WorkloadOptions o;
  o.seq_len = 8;
  o.device = Device::cuda();
  EXPECT_THROW(make_workload(o), Error);
#endif
}

}  // namespace
}  // namespace sparse_attn

namespace sparse_attn {
namespace {

// Raw keys from files: the op's definition with w = 0 (a plain RMSNorm of the mean) and RoPE.
TEST(CompressIndexKeys, PlainRmsNormOfTheMeanThenRope) {
  auto rng = testing::make_rng();
  const Tensor raw = testing::random_tensor({2, 9, 6}, DType::kF32, rng);
  const Tensor out = Tensor::empty({2, 2, 6}, DType::kF32);
  testing::poison(out);
  compress_index_keys(raw, out, 100.0, 4);
  std::vector<double> want;
  for (int64_t b = 0; b < 2; ++b)
    for (int64_t c = 0; c < 2; ++c) {
      std::vector<double> m(6, 0.0);
      for (int64_t t = 4 * c; t < 4 * c + 4; ++t)
        for (int64_t d = 0; d < 6; ++d) m[d] += testing::get(raw, {b, t, d}) / 4;
      double ms = 0;
      for (double x : m) ms += x * x / 6;
      for (double& x : m) x /= std::sqrt(ms + 1e-6);
      std::vector<double> r = m;
      for (int64_t j = 0; j < 2; ++j) {  // rotate_half pairs (j, j + 2) at position 4c
        const double inv_freq = static_cast<float>(std::pow(100.0, -2.0 * double(j) / 4.0));
        const double angle = static_cast<float>(static_cast<float>(4 * c) * float(inv_freq));
        r[j] = m[j] * std::cos(angle) - m[j + 2] * std::sin(angle);
        r[j + 2] = m[j + 2] * std::cos(angle) + m[j] * std::sin(angle);
      }
      want.insert(want.end(), r.begin(), r.end());
    }
  EXPECT_TRUE(testing::all_close(out, want, 1e-5, 1e-5));
}

TEST(CompressIndexKeys, WrongArgumentsNameThem) {
  const Tensor raw = Tensor::empty({1, 8, 4}, DType::kF32);
  const Tensor out = Tensor::empty({1, 3, 4}, DType::kF32);
  try {
    compress_index_keys(raw, out, 1e4, 2);
    FAIL() << "no error";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("out"), std::string::npos) << e.what();
  }
  EXPECT_THROW(compress_index_keys(raw, Tensor::empty({1, 2, 4}, DType::kI32), 1e4, 2), TypeError);
  EXPECT_THROW(compress_index_keys(raw, Tensor::empty({1, 2, 4}, DType::kF32), 1e4, 3), ValueError);
}

}  // namespace
}  // namespace sparse_attn
