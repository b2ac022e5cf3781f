// Structured workload generator; include/sparse_attn/workload.h states the model.
#include "sparse_attn/workload.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <numbers>
#include <optional>

#include "api/check.h"
#include "api/qsa_compress_params.h"
#include "sparse_attn/dtype.h"

namespace sparse_attn {

WorkloadMode parse_workload_mode(std::string_view name) {
  if (name == "structured") return WorkloadMode::kStructured;
  if (name == "random") return WorkloadMode::kRandom;
  detail::throw_value_error("workload mode: expected \"structured\" or \"random\", got \"{}\"",
                            name);
}

const char* workload_mode_name(WorkloadMode mode) {
  return mode == WorkloadMode::kStructured ? "structured" : "random";
}

namespace {

// Counter-based randomness: every value is a hash of (seed, stream, indices), so the result
// is the same whatever the thread count or the order of generation.
enum Stream : uint64_t {
  kValueNoise = 1,
  kQueryNoise,
  kKeyNoise,
  kIndexQueryNoise,
  kIndexKeyNoise,
  kSegments,
  kTopic,
  kTokenContent,
  kRotaryProjection,
  kUnrotatedBasis,
  kHeadMix,
  kNeedlePlacement,
  kHeavyHitters,
  kIndexNormWeight,
};

uint64_t mix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

struct Rng {
  uint64_t seed;
  uint64_t hash(uint64_t stream, uint64_t a = 0, uint64_t b = 0, uint64_t c = 0,
                uint64_t d = 0) const {
    uint64_t h = mix64(seed ^ mix64(stream));
    h = mix64(h ^ a);
    h = mix64(h ^ (b * 0x9e3779b97f4a7c15ull));
    h = mix64(h ^ (c * 0xc2b2ae3d27d4eb4full));
    return mix64(h ^ (d * 0x165667b19e3779f9ull));
  }
  static double uniform(uint64_t h) { return (static_cast<double>(h >> 11) + 0.5) * 0x1.0p-53; }
  // Standard normal by Box-Muller from one hash and its remix.
  static double gaussian(uint64_t h) {
    const double u1 = uniform(h), u2 = uniform(mix64(h ^ 0xa5a5a5a5a5a5a5a5ull));
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * std::numbers::pi * u2);
  }
  double normal(uint64_t stream, uint64_t a = 0, uint64_t b = 0, uint64_t c = 0,
                uint64_t d = 0) const {
    return gaussian(hash(stream, a, b, c, d));
  }
  // Uniform integer in [lo, hi).
  int64_t range(int64_t lo, int64_t hi, uint64_t stream, uint64_t a, uint64_t b = 0) const {
    return lo + static_cast<int64_t>(hash(stream, a, b) % static_cast<uint64_t>(hi - lo));
  }
};

// How much a token's content differs from its segment's topic (0: identical tokens within a
// segment, 1: unrelated tokens). 0.3 keeps neighbours alike, as consecutive rows of a real
// model select nearly the same blocks, without making them copies.
constexpr double kTokenVariation = 0.15;
// How much query heads of one group differ from each other (perturbation of the latent).
constexpr double kHeadVariation = 0.3;

// The latent content of every token: unit vectors of rank r, constant topic per segment.
class Latent {
 public:
  Latent(const Rng& rng, int64_t batch, int64_t seq_len, int64_t rank, int64_t segment_len)
      : rank_(rank), seq_len_(seq_len), z_(static_cast<size_t>(batch * seq_len * rank)) {
    for (int64_t b = 0; b < batch; ++b) {
      int64_t seg = 0;
      for (int64_t start = 0; start < seq_len; ++seg) {
        // Lengths uniform in [len/2, 3len/2], so boundaries do not line up with blocks.
        const int64_t half = std::max<int64_t>(1, segment_len / 2);
        const int64_t len = rng.range(half, half + 2 * half + 1, kSegments, b, seg);
        const int64_t end = std::min(seq_len, start + len);
        for (int64_t t = start; t < end; ++t) {
          float* z = at(b, t);
          double norm2 = 0;
          for (int64_t i = 0; i < rank; ++i) {
            const double v =
                std::sqrt(1 - kTokenVariation * kTokenVariation) * rng.normal(kTopic, b, seg, i) +
                kTokenVariation * rng.normal(kTokenContent, b, t, i);
            z[i] = static_cast<float>(v);
            norm2 += v * v;
          }
          const double inv = 1.0 / std::sqrt(std::max(norm2, 1e-30));
          for (int64_t i = 0; i < rank; ++i) z[i] = static_cast<float>(z[i] * inv);
        }
        start = end;
      }
    }
  }
  const float* at(int64_t b, int64_t t) const { return z_.data() + (b * seq_len_ + t) * rank_; }
  float* at(int64_t b, int64_t t) { return z_.data() + (b * seq_len_ + t) * rank_; }
  int64_t rank() const { return rank_; }

 private:
  int64_t rank_, seq_len_;
  std::vector<float> z_;
};

// The projections of one vector space (the attention heads or the indexer): per key head the
// rotary content projection, the unrotated orthonormal basis (topic columns, then the sink,
// heavy-hitter
// direction, then one direction per needle) and, per query head, the latent perturbation.
class Space {
 public:
  Space(const Rng& rng, uint64_t space_id, int64_t dim, int64_t rotary_dims, int64_t rank,
        int64_t key_heads, int64_t query_heads, int64_t num_needles, double softmax_scale,
        const WorkloadOptions& o)
      : dim_(dim),
        rot_(rotary_dims),
        rank_(rank),
        group_(query_heads / key_heads),
        num_needles_(num_needles) {
    const int64_t un = dim - rotary_dims;
    topic_cols_ = std::min(rank, un);
    // Strengths: scale * (a v).(a v) = logit for unit-norm v.
    auto amp = [&](double logit) { return static_cast<float>(std::sqrt(logit / softmax_scale)); };
    a_rot_ = rotary_dims > 0 ? amp(o.local_logit) : 0.f;
    a_topic_ = un > 0 ? amp(o.topic_logit) : 0.f;
    a_sink_ = amp(o.sink_logit);
    a_heavy_ = amp(o.heavy_logit);
    a_needle_ = amp(o.needle_logit);
    noise_std_ = static_cast<float>(
        o.noise * std::sqrt((a_rot_ * a_rot_ + a_topic_ * a_topic_) / static_cast<double>(dim)));

    rotary_.resize(static_cast<size_t>(key_heads * rotary_dims * rank));
    for (int64_t g = 0; g < key_heads; ++g)
      for (int64_t i = 0; i < rotary_dims * rank; ++i)
        rotary_[g * rotary_dims * rank + i] = static_cast<float>(
            rng.normal(kRotaryProjection, space_id, g, i) / std::sqrt(double(rotary_dims)));

    // Gram-Schmidt while the unrotated space has room; random unit vectors after that.
    const int64_t nvec = topic_cols_ + 2 + num_needles;
    basis_.assign(static_cast<size_t>(key_heads * nvec * un), 0.f);
    for (int64_t g = 0; g < key_heads && un > 0; ++g) {
      for (int64_t j = 0; j < nvec; ++j) {
        std::vector<double> v(static_cast<size_t>(un));
        for (int64_t i = 0; i < un; ++i) v[i] = rng.normal(kUnrotatedBasis, space_id, g, j, i);
        const int64_t orth_against = j < un ? j : 0;
        for (int64_t k = 0; k < orth_against; ++k) {
          const float* e = basis(g, k);
          double dot = 0;
          for (int64_t i = 0; i < un; ++i) dot += v[i] * e[i];
          for (int64_t i = 0; i < un; ++i) v[i] -= dot * e[i];
        }
        double n2 = 0;
        for (double x : v) n2 += x * x;
        const double inv = 1.0 / std::sqrt(std::max(n2, 1e-30));
        float* out = basis(g, j);
        for (int64_t i = 0; i < un; ++i) out[i] = static_cast<float>(v[i] * inv);
      }
    }

    // Query head h sees the latent through M_h = I + kHeadVariation * N(0, 1/r); keys use I.
    mix_.resize(static_cast<size_t>(query_heads * rank * rank));
    for (int64_t h = 0; h < query_heads; ++h)
      for (int64_t i = 0; i < rank; ++i)
        for (int64_t j = 0; j < rank; ++j)
          mix_[(h * rank + i) * rank + j] =
              static_cast<float>((i == j ? 1.0 : 0.0) +
                                 kHeadVariation * rng.normal(kHeadMix, space_id, h, i * rank + j) /
                                     std::sqrt(double(rank)));

    inv_freq_.resize(static_cast<size_t>(rotary_dims / 2));
    for (int64_t i = 0; i < rotary_dims / 2; ++i)
      inv_freq_[i] = std::pow(o.rope_theta, -2.0 * double(i) / double(rotary_dims));
  }

  // Writes the structured vector (before noise) of one token into out[dim].
  // query_head < 0 builds a key of key head `g`; the sink, heavy and needle flags select the
  // extra parts (queries carry the sink and heavy-hitter directions always).
  void build(float* out, const float* z, int64_t pos, int64_t query_head, int64_t g, bool sink,
             bool heavy, const std::vector<int64_t>& needles, std::vector<float>& scratch) const {
    const int64_t r = rank_, un = dim_ - rot_;
    scratch.resize(static_cast<size_t>(r + rot_));
    float* zz = scratch.data();
    if (query_head >= 0) {
      const float* m = &mix_[query_head * r * r];
      for (int64_t i = 0; i < r; ++i) {
        float acc = 0;
        for (int64_t j = 0; j < r; ++j) acc += m[i * r + j] * z[j];
        zz[i] = acc;
      }
    } else {
      std::copy(z, z + r, zz);
    }
    // Rotary part: RoPE (half-split pairs (i, i + rot/2)) of the content projection.
    float* c = zz + r;
    const float* a = &rotary_[g * rot_ * r];
    for (int64_t d = 0; d < rot_; ++d) {
      float acc = 0;
      for (int64_t i = 0; i < r; ++i) acc += a[d * r + i] * zz[i];
      c[d] = a_rot_ * acc;
    }
    const int64_t half = rot_ / 2;
    for (int64_t i = 0; i < half; ++i) {
      const double ang = double(pos) * inv_freq_[i];
      const double cs = std::cos(ang), sn = std::sin(ang);
      out[i] = static_cast<float>(c[i] * cs - c[i + half] * sn);
      out[i + half] = static_cast<float>(c[i] * sn + c[i + half] * cs);
    }
    // Unrotated part: topic, sink, heavy hitters, needles.
    float* u = out + rot_;
    std::fill(u, u + un, 0.f);
    for (int64_t k = 0; k < topic_cols_; ++k) {
      const float* e = basis(g, k);
      const float w = a_topic_ * zz[k];
      for (int64_t i = 0; i < un; ++i) u[i] += w * e[i];
    }
    if (un == 0) return;
    if (sink) {
      const float* e = basis(g, topic_cols_);
      for (int64_t i = 0; i < un; ++i) u[i] += a_sink_ * e[i];
    }
    if (heavy) {
      const float* e = basis(g, topic_cols_ + 1);
      for (int64_t i = 0; i < un; ++i) u[i] += a_heavy_ * e[i];
    }
    for (int64_t j : needles) {
      const float* e = basis(g, topic_cols_ + 2 + j);
      const float a = query_head >= 0 ? a_needle_ : a_needle_ * key_needle_gain_;
      for (int64_t i = 0; i < un; ++i) u[i] += a * e[i];
    }
  }

  // A needle is one token of its compressed block; scaling its raw key by the block size
  // keeps the needle at full strength in the block mean, as a trained indexer must for
  // retrieval to work at all.
  void set_key_needle_gain(float gain) { key_needle_gain_ = gain; }
  int64_t group() const { return group_; }
  float noise_std() const { return noise_std_; }

 private:
  const float* basis(int64_t g, int64_t j) const {
    return &basis_[(g * (topic_cols_ + 2 + num_needles_) + j) * (dim_ - rot_)];
  }
  float* basis(int64_t g, int64_t j) {
    return &basis_[(g * (topic_cols_ + 2 + num_needles_) + j) * (dim_ - rot_)];
  }

  int64_t dim_, rot_, rank_, group_, num_needles_, topic_cols_ = 0;
  float a_rot_ = 0, a_topic_ = 0, a_sink_ = 0, a_heavy_ = 0, a_needle_ = 0, noise_std_ = 0;
  float key_needle_gain_ = 1;
  std::vector<float> rotary_, basis_, mix_;
  std::vector<double> inv_freq_;
};

void check_option(bool ok, std::string_view name, std::string_view expected, double got) {
  if (!ok)
    detail::throw_value_error("workload option {}: expected {}, got {}", name, expected, got);
}

void validate(const WorkloadOptions& o) {
  check_option(o.batch >= 1, "batch", ">= 1", double(o.batch));
  check_option(o.seq_len >= 1, "seq_len", ">= 1", double(o.seq_len));
  check_option(o.query_len >= 0 && o.query_len <= o.seq_len, "query_len",
               "0 (all tokens) to seq_len", double(o.query_len));
  check_option(o.num_kv_heads >= 1, "num_kv_heads", ">= 1", double(o.num_kv_heads));
  check_option(o.num_q_heads >= 1 && o.num_q_heads % o.num_kv_heads == 0, "num_q_heads",
               fmt::format("a positive multiple of num_kv_heads ({})", o.num_kv_heads),
               double(o.num_q_heads));
  check_option(o.head_dim >= 1, "head_dim", ">= 1", double(o.head_dim));
  check_option(o.rotary_dims >= 0 && o.rotary_dims <= o.head_dim && o.rotary_dims % 2 == 0,
               "rotary_dims", "an even number from 0 (default) to head_dim", double(o.rotary_dims));
  check_option(o.indexer_heads >= 0, "indexer_heads", ">= 0 (0: no indexer inputs)",
               double(o.indexer_heads));
  if (o.indexer_heads > 0) {
    check_option(o.indexer_dim >= 2, "indexer_dim", ">= 2", double(o.indexer_dim));
    check_option(o.indexer_block == detail::kCompressBlockTokens, "indexer_block",
                 "4 (QSA compresses 4 tokens per key)", double(o.indexer_block));
  }
  if (o.dtype != DType::kBF16 && o.dtype != DType::kF16 && o.dtype != DType::kF32)
    throw TypeError(
        fmt::format("workload option dtype: expected bfloat16, float16 or float32, "
                    "got {}",
                    dtype_name(o.dtype)));
  check_option(o.num_sinks >= 0 && o.num_sinks <= o.seq_len, "num_sinks", "0 to seq_len",
               double(o.num_sinks));
  check_option(o.content_rank >= 1, "content_rank", ">= 1", double(o.content_rank));
  check_option(o.segment_len >= 1, "segment_len", ">= 1", double(o.segment_len));
  auto logit = [](double v, std::string_view name) {
    check_option(std::isfinite(v) && v >= 0, name, "a finite logit >= 0", v);
  };
  logit(o.sink_logit, "sink_logit");
  logit(o.heavy_logit, "heavy_logit");
  check_option(o.heavy_fraction >= 0 && o.heavy_fraction <= 1, "heavy_fraction", "0 to 1",
               o.heavy_fraction);
  logit(o.local_logit, "local_logit");
  logit(o.topic_logit, "topic_logit");
  logit(o.needle_logit, "needle_logit");
  check_option(std::isfinite(o.noise) && o.noise >= 0, "noise", "a finite value >= 0", o.noise);
  check_option(std::isfinite(o.rope_theta) && o.rope_theta > 1, "rope_theta", "> 1", o.rope_theta);
  check_option(o.num_needles >= 0, "num_needles", ">= 0", double(o.num_needles));
  check_option(o.needle_queries >= 1, "needle_queries", ">= 1", double(o.needle_queries));
  if (o.mode == WorkloadMode::kStructured && o.num_needles > 0)
    check_option(o.seq_len >= o.num_sinks + 2, "seq_len",
                 fmt::format(">= num_sinks + 2 ({}) to place needles", o.num_sinks + 2),
                 double(o.seq_len));
}

// Places needle keys in the first half of the context (after the sinks) and their query
// spans at least a quarter of the context later, so they are far from the local window.
std::vector<Needle> place_needles(const Rng& rng, const WorkloadOptions& o) {
  std::vector<Needle> needles;
  const int64_t qoff = o.seq_len - o.query_len;
  // The span shrinks in tiny contexts so that it still starts after the needle's key.
  const int64_t span = std::min({o.needle_queries, o.query_len, o.seq_len - o.num_sinks - 1});
  for (int64_t j = 0; j < o.num_needles; ++j) {
    const int64_t b = j % o.batch;
    int64_t far = o.seq_len / 4;
    int64_t lo = std::max(qoff, o.num_sinks + 1 + far);
    const int64_t hi = o.seq_len - span;  // last allowed span start
    if (lo > hi) {
      far = 0;
      lo = std::max(qoff, o.num_sinks + 1);
    }
    const int64_t start = rng.range(lo, hi + 1, kNeedlePlacement, j, 0);
    const int64_t key_hi = std::clamp<int64_t>(std::min(start - far, o.seq_len / 2),
                                               o.num_sinks + 1, std::max(start, o.num_sinks + 1));
    const int64_t key = rng.range(o.num_sinks, key_hi, kNeedlePlacement, j, 1);
    needles.push_back({b, key, start, start + span});
  }
  return needles;
}

Tensor to_device(Tensor host, Device device) {
  if (!device.is_cuda()) return host;
  Tensor t = Tensor::empty(host.shape(), host.dtype(), device);
  copy_into(t.view(), host.view());
  return t;
}

}  // namespace

namespace {

// qsa_compress_block_keys' definition on host views (fp32 included): raw [B, L, Di] -> out.
void compress_with(const TensorView& raw, const TensorView& weight, const TensorView& out,
                   double eps, double rope_theta, int64_t rotary_dims) {
  CompressBlockKeysOptions co;
  co.eps = eps;
  co.rope_theta = rope_theta;
  co.rope_dim = rotary_dims;
  detail::reference_compress_padded_keys(raw, weight, out, co);
}

}  // namespace

void compress_index_keys(const TensorView& raw, const TensorView& out, double rope_theta,
                         int64_t rotary_dims) {
  detail::check_rank(raw, "raw", {3});
  detail::check_rank(out, "out", {3});
  detail::check_dtype(raw, "raw", {DType::kBF16, DType::kF16, DType::kF32});
  detail::check_dtype(out, "out", {DType::kBF16, DType::kF16, DType::kF32});
  const int64_t B = raw.size(0), L = raw.size(1), Di = raw.size(2);
  detail::check_shape(out, "out", {B, L / detail::kCompressBlockTokens, Di},
                      "[raw.shape[0], raw.shape[1] / 4, raw.shape[2]]");
  if (rotary_dims < 0 || rotary_dims > Di || rotary_dims % 2 != 0) {
    detail::throw_value_error("rotary_dims: expected an even number from 0 to {}, got {}", Di,
                              rotary_dims);
  }
  if (!(rope_theta > 0) || !std::isfinite(rope_theta)) {
    detail::throw_value_error("rope_theta: expected a finite number > 0, got {}", rope_theta);
  }
  if (raw.device().is_cuda() || out.device().is_cuda())
    detail::throw_not_supported("compress_index_keys: host tensors only, got {} and {}",
                                raw.device().str(), out.device().str());
  Tensor zero = Tensor::empty({Di}, DType::kF32);
  std::fill_n(zero.data_as<float>(), Di, 0.f);
  compress_with(raw, zero, out, 1e-6, rope_theta, rotary_dims);
}

Workload make_workload(const WorkloadOptions& options) {
  validate(options);
  WorkloadOptions o = options;
  if (o.query_len == 0) o.query_len = o.seq_len;
  const bool structured = o.mode == WorkloadMode::kStructured;
  const bool indexer = o.indexer_heads > 0;
  const int64_t B = o.batch, Lk = o.seq_len, Lq = o.query_len, Hq = o.num_q_heads,
                Hkv = o.num_kv_heads, D = o.head_dim, qoff = Lk - Lq;
  const int64_t rot = o.rotary_dims > 0 ? o.rotary_dims : (D / 4) & ~int64_t{1};
  const int64_t Hi = o.indexer_heads, Di = o.indexer_dim, blk = o.indexer_block;
  const int64_t rot_i =
      std::min<int64_t>(o.rotary_dims > 0 ? o.rotary_dims : Di / 2, Di) & ~int64_t{1};
  const int64_t nblocks = indexer ? Lk / blk : 0;
  o.rotary_dims = rot;

  Workload w;
  w.query = Tensor::empty({B, Lq, Hq, D}, o.dtype);
  w.key = Tensor::empty({B, Lk, Hkv, D}, o.dtype);
  w.value = Tensor::empty({B, Lk, Hkv, D}, o.dtype);
  if (indexer) {
    w.index_query = Tensor::empty({B, Lq, Hi, Di}, o.dtype);
    w.index_key = Tensor::empty({B, nblocks, Di}, o.dtype);
  }
  const Rng rng{o.seed};
  if (structured) w.needles = place_needles(rng, o);

  void* const q = w.query.data();
  void* const k = w.key.data();
  void* const v = w.value.data();
  void* const qi = indexer ? w.index_query.data() : nullptr;
  const DType dt = o.dtype;

#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < Lk; ++t)
      for (int64_t i = 0; i < Hkv * D; ++i)
        store_from_float(v, dt, (b * Lk + t) * Hkv * D + i,
                         static_cast<float>(rng.normal(kValueNoise, b, t, i)));

  if (!structured) {
#pragma omp parallel for collapse(2) schedule(static)
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = 0; t < Lk; ++t) {
        for (int64_t i = 0; i < Hkv * D; ++i)
          store_from_float(k, dt, (b * Lk + t) * Hkv * D + i,
                           static_cast<float>(rng.normal(kKeyNoise, b, t, i)));
        if (t >= qoff)
          for (int64_t i = 0; i < Hq * D; ++i)
            store_from_float(q, dt, (b * Lq + t - qoff) * Hq * D + i,
                             static_cast<float>(rng.normal(kQueryNoise, b, t, i)));
        if (indexer && t >= qoff)
          for (int64_t i = 0; i < Hi * Di; ++i)
            store_from_float(qi, dt, (b * Lq + t - qoff) * Hi * Di + i,
                             static_cast<float>(rng.normal(kIndexQueryNoise, b, t, i)));
      }
  }

  // Structured mode: latent content, then every vector from its parts.
  const int64_t rank = o.content_rank;
  std::optional<Latent> latent;
  std::optional<Space> attn, index;
  if (structured) {
    latent.emplace(rng, B, Lk, rank, o.segment_len);
    attn.emplace(rng, 0, D, rot, rank, Hkv, Hq, o.num_needles, 1.0 / std::sqrt(double(D)), o);
    if (indexer) {
      index.emplace(rng, 1, Di, rot_i, rank, 1, Hi, o.num_needles, 1.0 / std::sqrt(double(Di)), o);
      index->set_key_needle_gain(static_cast<float>(blk));
    }
  }
  // Heavy hitters: keys after the sinks that every query attends a little (H2O's observation).
  auto is_heavy = [&](int64_t b, int64_t t) {
    return t >= o.num_sinks && Rng::uniform(rng.hash(kHeavyHitters, b, t)) < o.heavy_fraction;
  };
  if (structured) {
    w.heavy_hitters.resize(static_cast<size_t>(B));
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = 0; t < Lk; ++t)
        if (is_heavy(b, t)) w.heavy_hitters[b].push_back(t);
  }
  // Needles each token carries: as a key (at key_pos) and as a query (inside the span).
  auto key_needles = [&](int64_t b, int64_t t) {
    std::vector<int64_t> ids;
    for (size_t j = 0; j < w.needles.size(); ++j)
      if (w.needles[j].batch == b && w.needles[j].key_pos == t) ids.push_back(int64_t(j));
    return ids;
  };
  auto query_needles = [&](int64_t b, int64_t t) {
    std::vector<int64_t> ids;
    for (size_t j = 0; j < w.needles.size(); ++j)
      if (w.needles[j].batch == b && t >= w.needles[j].query_begin && t < w.needles[j].query_end)
        ids.push_back(int64_t(j));
    return ids;
  };

  if (structured) {
#pragma omp parallel
    {
      std::vector<float> vec(static_cast<size_t>(std::max(D, Di))), scratch;
#pragma omp for collapse(2) schedule(static)
      for (int64_t b = 0; b < B; ++b)
        for (int64_t t = 0; t < Lk; ++t) {
          const float* z = latent->at(b, t);
          const bool sink = t < o.num_sinks, heavy = is_heavy(b, t);
          const auto kn = key_needles(b, t);
          for (int64_t g = 0; g < Hkv; ++g) {
            attn->build(vec.data(), z, t, -1, g, sink, heavy, kn, scratch);
            for (int64_t d = 0; d < D; ++d)
              store_from_float(
                  k, dt, ((b * Lk + t) * Hkv + g) * D + d,
                  vec[d] + attn->noise_std() * float(rng.normal(kKeyNoise, b, t, g * D + d)));
          }
          if (t < qoff) continue;
          const auto qn = query_needles(b, t);
          for (int64_t h = 0; h < Hq; ++h) {
            attn->build(vec.data(), z, t, h, h / attn->group(), true, true, qn, scratch);
            for (int64_t d = 0; d < D; ++d)
              store_from_float(
                  q, dt, ((b * Lq + t - qoff) * Hq + h) * D + d,
                  vec[d] + attn->noise_std() * float(rng.normal(kQueryNoise, b, t, h * D + d)));
          }
          if (!indexer) continue;
          for (int64_t h = 0; h < Hi; ++h) {
            index->build(vec.data(), z, t, h, 0, true, true, qn, scratch);
            for (int64_t d = 0; d < Di; ++d)
              store_from_float(qi, dt, ((b * Lq + t - qoff) * Hi + h) * Di + d,
                               vec[d] + index->noise_std() *
                                            float(rng.normal(kIndexQueryNoise, b, t, h * Di + d)));
          }
        }
    }
  }

  // Raw indexer keys of every token (in the workload's dtype, as the model's projection gives
  // them), then compressed by the model's definition: the rotation comes after the group mean,
  // at the block's position 4b, so the raw keys are built unrotated (position 0).
  if (indexer) {
    w.index_key_raw = Tensor::empty({B, Lk, Di}, dt);
    void* const rk = w.index_key_raw.data();
#pragma omp parallel
    {
      std::vector<float> vec(static_cast<size_t>(Di)), scratch;
#pragma omp for collapse(2) schedule(static)
      for (int64_t b = 0; b < B; ++b)
        for (int64_t t = 0; t < Lk; ++t) {
          if (structured)
            index->build(vec.data(), latent->at(b, t), 0, -1, 0, t < o.num_sinks, is_heavy(b, t),
                         key_needles(b, t), scratch);
          for (int64_t d = 0; d < Di; ++d)
            store_from_float(rk, dt, (b * Lk + t) * Di + d,
                             structured ? vec[d] + index->noise_std() *
                                                       float(rng.normal(kIndexKeyNoise, b, t, d))
                                        : float(rng.normal(kIndexKeyNoise, b, t, d)));
        }
    }
    // A trained norm weight is near 0 (it starts there); 0.1 keeps the (1 + w) factor visible.
    w.index_norm_weight = Tensor::empty({Di}, DType::kF32);
    for (int64_t d = 0; d < Di; ++d)
      w.index_norm_weight.data_as<float>()[d] = float(0.1 * rng.normal(kIndexNormWeight, d));
    w.index_rotary_dims = rot_i;
    compress_with(w.index_key_raw, w.index_norm_weight, w.index_key, w.index_norm_eps, o.rope_theta,
                  rot_i);
  }

  w.query = to_device(w.query, o.device);
  w.key = to_device(w.key, o.device);
  w.value = to_device(w.value, o.device);
  if (indexer) {
    w.index_query = to_device(w.index_query, o.device);
    w.index_key = to_device(w.index_key, o.device);
    w.index_key_raw = to_device(w.index_key_raw, o.device);
    w.index_norm_weight = to_device(w.index_norm_weight, o.device);
  }
  w.options = o;
  return w;
}

}  // namespace sparse_attn
