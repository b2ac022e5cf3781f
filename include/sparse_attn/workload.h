// Structured attention workloads: Q/K/V (and QSA indexer inputs) whose attention looks like a
// real long-context model's, for tests, benchmarks, the CLI and the Python package.
//
// A structured workload builds every vector from a few named parts, each with a strength given
// as the softmax logit (scale * q.k, in nats) it contributes, so the knobs mean the same thing
// at every head_dim:
//   - locality: low-rank content vectors (rank `content_rank`, constant within segments of
//     about `segment_len` tokens) rotated by RoPE in the first `rotary_dims` dimensions; a
//     query and a key of the same content score `local_logit` at distance 0, decaying with
//     distance as the RoPE frequencies dephase (partial rotary, as in Qwen3-Next);
//   - topic: the same content, unrotated, in the other dimensions: keys of the query's segment
//     score `topic_logit` whatever their distance;
//   - sinks: the first `num_sinks` keys share a direction with every query (`sink_logit`);
//   - heavy hitters: a `heavy_fraction` of the other keys, spread through the context, share
//     another such direction (`heavy_logit`): tokens most queries attend a little, which keeps
//     consecutive rows' selections alike, as on real models;
//   - needles: `num_needles` far keys each share a private direction with a span of
//     `needle_queries` later query rows (`needle_logit`), the retrieval pattern;
//   - noise: i.i.d. Gaussian noise, `noise` times the RMS of the structured part.
// Sink, heavy-hitter and needle directions are orthogonal to the topic subspace and to each
// other (as far as the unrotated dimensions allow), so they add exactly their logit.
// The plain random mode draws every element i.i.d. N(0, 1) instead, for contrast.
//
// The QSA indexer inputs come from the same latent structure (same segments, sinks and
// needles) through their own projections: raw (unrotated) indexer keys per token, compressed as
// the model does it, by qsa_compress_block_keys' definition (the mean of raw keys 4b..4b+3,
// RMS-normed with weight (1 + w) for a small drawn w, eps 1e-6, then RoPE at position 4b on the
// first indexer_dim / 2 dims, rotate_half, with rope_theta); indexer queries per indexer head,
// rotated at their own positions. So the indexer's top-k finds the sinks, the needles and the
// local blocks.
//
// Generation is deterministic for a given seed (a counter-based generator: the result does not
// depend on the thread count) and runs on the host; CUDA outputs are copied to the device.
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

#include "sparse_attn/tensor.h"

namespace sparse_attn {

enum class WorkloadMode : uint8_t { kStructured, kRandom };
// "structured" or "random"; ValueError otherwise.
WorkloadMode parse_workload_mode(std::string_view name);
const char* workload_mode_name(WorkloadMode mode);

struct WorkloadOptions {
  WorkloadMode mode = WorkloadMode::kStructured;
  uint64_t seed = 0;
  // Geometry. Queries are the last `query_len` tokens of each request (0: all of them, a
  // whole-prompt prefill), so query row i sits at position seq_len - query_len + i.
  int64_t batch = 1;
  int64_t seq_len = 8192;
  int64_t query_len = 0;
  int64_t num_q_heads = 24;
  int64_t num_kv_heads = 2;
  int64_t head_dim = 256;
  // QSA indexer inputs; indexer_heads = 0 skips them (XAttention workloads).
  int64_t indexer_heads = 4;
  int64_t indexer_dim = 128;
  int64_t indexer_block = 4;  // raw tokens per compressed key: QSA's 4 (the only valid value)
  DType dtype = DType::kBF16;
  Device device = Device::cpu();

  // Structure (structured mode only). Logits are in nats of scale * q.k, scale 1/sqrt(D).
  int64_t num_sinks = 4;
  double sink_logit = 10.5;
  double heavy_fraction = 0.02;
  double heavy_logit = 4.0;
  int64_t content_rank = 16;
  int64_t segment_len = 512;
  double local_logit = 10.0;
  double topic_logit = 2.0;
  int64_t rotary_dims = 0;  // 0: head_dim / 4 (indexer_dim / 2 for the indexer), even
  double rope_theta = 10000.0;
  int64_t num_needles = 8;
  double needle_logit = 15.0;
  int64_t needle_queries = 16;  // consecutive query rows that retrieve each needle
  double noise = 0.1;
};

// A retrieval needle: the key at `key_pos` strongly matches query positions
// [query_begin, query_end) of request `batch`, in every head. Positions are request-local.
struct Needle {
  int64_t batch = 0;
  int64_t key_pos = 0;
  int64_t query_begin = 0;
  int64_t query_end = 0;
};

struct Workload {
  WorkloadOptions options;  // as given, with defaults resolved (query_len, rotary_dims)
  Tensor query;             // [B, Lq, Hq, D]
  Tensor key;               // [B, Lk, Hkv, D]
  Tensor value;             // [B, Lk, Hkv, D]
  Tensor index_query;       // [B, Lq, Hi, Di]; empty when indexer_heads == 0
  Tensor index_key;         // [B, Lk / indexer_block, Di] compressed keys; likewise
  // What index_key is compressed from, for callers that compress themselves (the demo and the
  // bench run qsa_compress_block_keys natively): the raw keys [B, Lk, Di] (dtype), the norm's
  // w [Di] (FP32), its eps, and RoPE on the first index_rotary_dims dims from
  // options.rope_theta, rotate_half. Empty / 0 when indexer_heads == 0.
  Tensor index_key_raw;
  Tensor index_norm_weight;
  double index_norm_eps = 1e-6;
  int64_t index_rotary_dims = 0;
  std::vector<Needle> needles;                      // empty in random mode
  std::vector<std::vector<int64_t>> heavy_hitters;  // [batch]: key positions; empty if random

  // Request-local position of query row i.
  int64_t query_position(int64_t i) const { return options.seq_len - options.query_len + i; }
};

// ValueError naming the option when a size, count or strength is out of range.
Workload make_workload(const WorkloadOptions& options);

// Compressed indexer keys from raw per-token keys (host), by qsa_compress_block_keys'
// definition with a zero norm weight (w = 0: a plain RMSNorm), eps 1e-6 and RoPE on the first
// rotary_dims dims (even; rotate_half) from rope_theta: the workload files' raw keys, whose
// model weights are unknown. raw: floating [B, L, Di], any strides; out: floating
// [B, L / 4, Di] (a trailing partial block is dropped: only complete blocks are compressed).
void compress_index_keys(const TensorView& raw, const TensorView& out, double rope_theta,
                         int64_t rotary_dims);

}  // namespace sparse_attn
