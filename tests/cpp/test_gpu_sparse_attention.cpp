// Native qsa_sparse_attention on the GPU against an independent double-precision oracle
// written here: every query/KV layout, SplitKV counts, gates, LSE, strided and sliced views,
// physical ids, invalid ids, very many rows, determinism and CUDA graph replay, on the per-row
// kernel (with and without SplitKV, prefill rows at one split among them), the gather, union
// and step kernels, and caller-owned workspaces.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <optional>
#include <string>
#include <vector>

#include "gpu_test_util.h"
#include "sparse_attn/errors.h"
#include "sparse_attn/qsa.h"
#include "sparse_attn/tensor.h"
#include "test_util.h"

namespace sparse_attn {
namespace {

using testing::to_device;
using testing::to_vector;

constexpr int64_t kD = 256;
constexpr double kInf = std::numeric_limits<double>::infinity();

enum class Gate { kNone, kElementwise, kPerHead };

struct Case {
  std::string name;
  DType dtype = DType::kBF16;
  int64_t hq = 24, hkv = 2;
  // Query layout: flattened rows (cu_seqlens_q) unless padded_q ([B, Q] with seq_lens_q).
  bool padded_q = false;
  std::vector<int64_t> q_rows;  // query rows per request
  std::vector<int64_t> q_real;  // flattened: seq_lens_q (rows past it are padding); empty: none
  std::vector<int64_t> k_lens;  // KV length per request
  bool paged = true;
  int64_t page_size = 64;
  bool hole_page = false;  // one block_table entry inside a sequence is -1
  int64_t width = 2051;
  double invalid_share = 0.15;  // ids that are -1, out of range or in the future
  Gate gate = Gate::kNone;
  bool lse = true;
  std::optional<int64_t> num_splits;
  bool positions = false;  // random query_positions (else the right-aligned default)
  // Flattened rows mapped by token_to_req instead of cu_seqlens; query_positions are passed
  // (random or right-aligned), as token_to_req requires.
  bool token_to_req = false;
  int64_t padding_rows = 0;      // with token_to_req: padding rows among the real ones
  bool pad_by_position = false;  // padding rows carry request 0's id at a negative position
                                 // (else request id -1)
  bool int64_metadata = false;   // every metadata tensor (ids, table, lengths, ...) as int64
  bool views = false;            // sliced inputs with offsets, strided out with bytes around it
  bool dense_v = false;          // with views: V stays dense, so K and V strides differ
  // Each row of a request repeats the previous row's ids with about 1 in 20 redrawn, as
  // neighbouring prefill rows do (the kernels then read mostly the same K/V rows).
  bool shared = false;
  // FP8 e4m3 K/V of random finite codes (subnormals included), dequantised by these scales.
  bool fp8 = false;
  double k_scale = 1.0, v_scale = 1.0;
};

std::string case_name(const ::testing::TestParamInfo<Case>& info) { return info.param.name; }

// Fills a device view with NaN before a run, so unwritten elements cannot pass.
void poison_device(const TensorView& view) {
  Tensor h = Tensor::empty(view.shape(), view.dtype());
  testing::poison(h.view());
  copy_into(view, h.view());
}

// Host-side problem: contents the oracle reads, and device tensors the kernel reads.
struct Problem {
  Case c;
  int64_t batch = 0, rows = 0, q_len = 0, num_pages = 0, max_pages = 0, kv_cap = 0;
  std::vector<int64_t> row_req, row_pos;  // per row; row_req -1 for padding rows
  Tensor q, k, v, idx, gate, block_table, cu_seqlens_q, seq_lens_q, seq_lens_k, positions,
      token_to_req;
};

Tensor host_i32(const Shape& shape, const std::vector<int32_t>& values) {
  return testing::int32_tensor(shape, values);
}

Problem make_problem(const Case& c, std::mt19937_64& rng) {
  Problem pb;
  pb.c = c;
  pb.batch = static_cast<int64_t>(c.q_rows.size());
  pb.q_len = c.padded_q ? *std::max_element(c.q_rows.begin(), c.q_rows.end()) : 0;
  pb.rows = c.padded_q ? pb.batch * pb.q_len
                       : std::accumulate(c.q_rows.begin(), c.q_rows.end(), int64_t{0});
  std::uniform_real_distribution<double> u01(0, 1);

  // Row -> (request, request-local index i). Padded: row b * Q + i. Flattened: the requests'
  // rows in order, or interleaved when token_to_req maps them (i counts earlier rows of the
  // same request).
  std::vector<int32_t> cu{0}, t2r;
  std::vector<int64_t> rank;
  for (int64_t b = 0; b < pb.batch; ++b) {
    const int64_t nrow = c.padded_q ? pb.q_len : c.q_rows[b];
    for (int64_t i = 0; i < nrow; ++i) {
      t2r.push_back(static_cast<int32_t>(b));
      rank.push_back(i);
    }
    cu.push_back(static_cast<int32_t>(cu.back() + c.q_rows[b]));
  }
  if (c.token_to_req) {
    std::vector<int64_t> order(pb.rows);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [](int64_t a, int64_t b) {
      return (a * 7919) % 5 < (b * 7919) % 5;  // a fixed interleave of the requests' rows
    });
    std::vector<int32_t> t2r2;
    std::vector<int64_t> seen(pb.batch, 0);
    rank.clear();
    for (int64_t r : order) {
      t2r2.push_back(t2r[r]);
      rank.push_back(seen[t2r[r]]++);
    }
    t2r = t2r2;
    // Padding rows of a graph-padded batch, spread among the real rows.
    for (int64_t j = 0; j < c.padding_rows; ++j) {
      const int64_t at = (j * 7 + 3) % (static_cast<int64_t>(t2r.size()) + 1);
      t2r.insert(t2r.begin() + at, -1);
      rank.insert(rank.begin() + at, 0);
    }
    pb.rows = static_cast<int64_t>(t2r.size());
  }
  // Real rows (i < seq_len_q) and their positions: explicit, or right-aligned.
  std::vector<int32_t> pos32;
  for (int64_t r = 0; r < pb.rows; ++r) {
    if (t2r[r] < 0) {  // a padding row: zero output, LSE -inf
      const int32_t p = c.pad_by_position ? static_cast<int32_t>(-1 - r % 3) : 7;
      if (c.pad_by_position) t2r[r] = 0;  // a live request id: the position marks it
      pb.row_req.push_back(-1);
      pb.row_pos.push_back(p);
      pos32.push_back(p);
      continue;
    }
    const int64_t b = t2r[r], i = rank[r];
    const int64_t seq_len_q = c.q_real.empty() ? c.q_rows[b] : c.q_real[b];
    int64_t p = c.k_lens[b] - seq_len_q + i;
    if (c.positions) p = std::uniform_int_distribution<int64_t>(0, c.k_lens[b] - 1)(rng);
    pb.row_req.push_back(i < seq_len_q ? b : -1);
    pb.row_pos.push_back(p);
    pos32.push_back(static_cast<int32_t>(p));
  }
  if (c.token_to_req) pb.token_to_req = host_i32({pb.rows}, t2r);

  // K/V storage and the block table.
  const int64_t max_k = *std::max_element(c.k_lens.begin(), c.k_lens.end());
  std::vector<int32_t> bt;
  if (c.paged) {
    pb.max_pages = (max_k + c.page_size - 1) / c.page_size + 1;
    int64_t need = 0;
    for (int64_t kl : c.k_lens) need += (kl + c.page_size - 1) / c.page_size;
    pb.num_pages = need + 3;
    std::vector<int32_t> phys(pb.num_pages);
    std::iota(phys.begin(), phys.end(), 0);
    std::shuffle(phys.begin(), phys.end(), rng);
    int64_t next = 0;
    bt.assign(pb.batch * pb.max_pages, -1);
    for (int64_t b = 0; b < pb.batch; ++b) {
      const int64_t np = (c.k_lens[b] + c.page_size - 1) / c.page_size;
      for (int64_t j = 0; j < np; ++j) bt[b * pb.max_pages + j] = phys[next++];
    }
    if (c.hole_page) bt[0] = -1;
    pb.kv_cap = pb.max_pages * c.page_size;
    pb.block_table = host_i32({pb.batch, pb.max_pages}, bt);
  } else {
    pb.kv_cap = max_k + 5;
  }
  const int64_t kv_outer = c.paged ? pb.num_pages : pb.batch;
  const int64_t kv_inner = c.paged ? c.page_size : pb.kv_cap;
  if (c.fp8) {
    pb.k = testing::random_fp8({kv_outer, kv_inner, c.hkv, kD}, rng, 448.f);
    pb.v = testing::random_fp8({kv_outer, kv_inner, c.hkv, kD}, rng, 448.f);
  } else {
    pb.k = testing::random_tensor({kv_outer, kv_inner, c.hkv, kD}, c.dtype, rng, -2.f, 2.f);
    pb.v = testing::random_tensor({kv_outer, kv_inner, c.hkv, kD}, c.dtype, rng);
  }
  pb.q = testing::random_tensor({pb.rows, c.hq, kD}, c.dtype, rng, -2.f, 2.f);

  // Selections: valid ids up to the position (duplicates allowed), mixed with -1,
  // out-of-range and future ids.
  std::vector<int32_t> ids(pb.rows * c.width);
  for (int64_t r = 0; r < pb.rows; ++r) {
    const int64_t b = pb.row_req[r] < 0 ? 0 : pb.row_req[r];
    const int64_t kl = c.k_lens[b], p = pb.row_pos[r];
    for (int64_t w = 0; w < c.width; ++w) {
      int64_t t;
      const double x = u01(rng);
      if (x < c.invalid_share / 3) {
        t = -1;
      } else if (x < 2 * c.invalid_share / 3) {
        t = kl + std::uniform_int_distribution<int64_t>(0, 1000)(rng);
      } else if (x < c.invalid_share) {
        t = std::min<int64_t>(p + 1 + std::uniform_int_distribution<int64_t>(0, 50)(rng),
                              std::numeric_limits<int32_t>::max());
      } else {
        t = std::uniform_int_distribution<int64_t>(0,
                                                   std::max<int64_t>(0, std::min(p, kl - 1)))(rng);
      }
      const bool keep = c.shared && r > 0 && pb.row_req[r - 1] == pb.row_req[r] && u01(rng) > 0.05;
      ids[r * c.width + w] = keep ? ids[(r - 1) * c.width + w] : static_cast<int32_t>(t);
    }
  }
  pb.idx = host_i32({pb.rows, c.width}, ids);
  if (c.gate == Gate::kElementwise)
    pb.gate = testing::random_tensor({pb.rows, c.hq, kD}, c.dtype, rng, -3.f, 3.f);
  if (c.gate == Gate::kPerHead)
    pb.gate = testing::random_tensor({pb.rows, c.hq}, c.dtype, rng, -3.f, 3.f);

  std::vector<int32_t> kl32(c.k_lens.begin(), c.k_lens.end());
  pb.seq_lens_k = host_i32({pb.batch}, kl32);
  pb.cu_seqlens_q = host_i32({pb.batch + 1}, cu);
  const std::vector<int64_t>& seq_q = c.q_real.empty() ? c.q_rows : c.q_real;
  std::vector<int32_t> ql32(seq_q.begin(), seq_q.end());
  pb.seq_lens_q = host_i32({pb.batch}, ql32);
  pb.positions = c.padded_q ? host_i32({pb.batch, pb.q_len}, pos32) : host_i32({pb.rows}, pos32);
  return pb;
}

struct Expected {
  std::vector<double> out;  // [rows, Hq, D]
  std::vector<double> lse;  // [rows, Hq]
};

// The oracle: plain loops in double over the row's valid entries, on K and V times their scales.
Expected oracle(const Problem& pb) {
  const Case& c = pb.c;
  const auto q = to_vector(pb.q.view());
  auto k = to_vector(pb.k.view()), v = to_vector(pb.v.view());
  for (double& x : k) x *= c.k_scale;
  for (double& x : v) x *= c.v_scale;
  const auto ids = to_vector(pb.idx.view());
  const std::vector<double> gate =
      c.gate == Gate::kNone ? std::vector<double>{} : to_vector(pb.gate.view());
  const std::vector<double> bt = c.paged ? to_vector(pb.block_table.view()) : std::vector<double>{};
  const int64_t group = c.hq / c.hkv;
  const double scale = 1.0 / std::sqrt(static_cast<double>(kD));
  Expected e{std::vector<double>(pb.rows * c.hq * kD, 0.0),
             std::vector<double>(pb.rows * c.hq, -kInf)};
  for (int64_t r = 0; r < pb.rows; ++r) {
    if (pb.row_req[r] < 0) continue;
    const int64_t b = pb.row_req[r], kl = c.k_lens[b], p = pb.row_pos[r];
    std::vector<int64_t> kv_rows;  // flat [outer, inner] row of each valid entry
    for (int64_t w = 0; w < c.width; ++w) {
      const int64_t t = static_cast<int64_t>(ids[r * c.width + w]);
      if (t < 0 || t >= kl || t > p) continue;
      if (c.paged) {
        const int64_t page = static_cast<int64_t>(bt[b * pb.max_pages + t / c.page_size]);
        if (page < 0 || page >= pb.num_pages) continue;
        kv_rows.push_back(page * c.page_size + t % c.page_size);
      } else {
        kv_rows.push_back(b * pb.kv_cap + t);
      }
    }
    for (int64_t h = 0; h < c.hq; ++h) {
      const int64_t kvh = h / group;
      std::vector<double> s(kv_rows.size());
      double mx = -kInf;
      for (size_t j = 0; j < kv_rows.size(); ++j) {
        double dot = 0;
        for (int64_t d = 0; d < kD; ++d) {
          dot += q[(r * c.hq + h) * kD + d] * k[(kv_rows[j] * c.hkv + kvh) * kD + d];
        }
        s[j] = dot * scale;
        mx = std::max(mx, s[j]);
      }
      if (kv_rows.empty()) continue;
      double sum = 0;
      for (double& x : s) sum += (x = std::exp(x - mx));
      e.lse[r * c.hq + h] = mx + std::log(sum);
      for (int64_t d = 0; d < kD; ++d) {
        double o = 0;
        for (size_t j = 0; j < kv_rows.size(); ++j)
          o += s[j] * v[(kv_rows[j] * c.hkv + kvh) * kD + d];
        o /= sum;
        if (c.gate == Gate::kElementwise) o /= 1 + std::exp(-gate[(r * c.hq + h) * kD + d]);
        if (c.gate == Gate::kPerHead) o /= 1 + std::exp(-gate[r * c.hq + h]);
        e.out[(r * c.hq + h) * kD + d] = o;
      }
    }
  }
  return e;
}

// A device copy of `host` placed inside a larger random buffer (extra leading rows/columns on
// its first and last axes), so the view has an offset and non-default strides. The columns
// added are 16 bytes' worth or more, which keeps the native kernels' vector-load rule.
TensorView embed(const Tensor& host, std::vector<Tensor>& keep, std::mt19937_64& rng) {
  const int64_t pad = host.dtype() == DType::kF8E4M3 ? 16 : 8;
  Shape big = host.shape();
  big.front() += 1;
  big.back() += pad;
  Tensor outer_host;
  if (host.dtype() == DType::kI32) {
    outer_host = testing::random_int32(big, rng, -5, 5);
  } else if (host.dtype() == DType::kI64) {
    outer_host = testing::widened(testing::random_int32(big, rng, -5, 5));
  } else {
    outer_host = testing::random_tensor(big, host.dtype(), rng);
  }
  Tensor outer = to_device(outer_host);
  keep.push_back(outer);
  TensorView view = outer.view()
                        .narrow(0, 1, host.shape().front())
                        .narrow(outer.view().dim() - 1, pad, host.shape().back());
  copy_into(view, host.view());
  return view;
}

struct DeviceProblem {
  std::vector<Tensor> keep;
  TensorView q, k, v, idx, out, lse;
  Tensor out_outer, out_outer_before;  // with views: out lives inside this buffer
  SparseAttentionOptions opts;
};

DeviceProblem to_device_problem(const Problem& pb, std::mt19937_64& rng) {
  const Case& c = pb.c;
  DeviceProblem dp;
  auto put = [&](const Tensor& h) -> TensorView {
    if (c.views && h.shape().size() >= 2) return embed(h, dp.keep, rng);
    Tensor d = to_device(h);
    dp.keep.push_back(d);
    return d.view();
  };
  // Metadata as int32, or (int64_metadata) the same values as int64.
  auto put_meta = [&](const Tensor& h) {
    return put(c.int64_metadata ? testing::widened(h.view()) : h);
  };
  dp.q = put(pb.q);
  dp.k = put(pb.k);
  if (c.dense_v) {
    Tensor d = to_device(pb.v);
    dp.keep.push_back(d);
    dp.v = d.view();
  } else {
    dp.v = put(pb.v);
  }
  dp.idx = put_meta(pb.idx);
  if (c.padded_q) {
    dp.q = dp.q.as_strided(
        {pb.batch, pb.q_len, c.hq, kD},
        {pb.q_len * dp.q.stride(0), dp.q.stride(0), dp.q.stride(1), dp.q.stride(2)});
    dp.idx = dp.idx.as_strided({pb.batch, pb.q_len, c.width},
                               {pb.q_len * dp.idx.stride(0), dp.idx.stride(0), dp.idx.stride(1)});
  }
  Shape out_shape = dp.q.shape();
  if (c.views) {
    // out = big[..., ::2] on the last axis, with a head of padding: every other byte around.
    Shape big = out_shape;
    big.back() *= 2;
    big[big.size() - 2] += 1;
    dp.out_outer_before = testing::random_tensor(big, c.dtype, rng);
    dp.out_outer = to_device(dp.out_outer_before);
    Shape strides(big.size());
    int64_t st = 1;
    for (int i = static_cast<int>(big.size()) - 1; i >= 0; --i) {
      strides[i] = st;
      st *= big[i];
    }
    Shape out_strides = strides;
    out_strides.back() = 2;
    dp.out = dp.out_outer.view().as_strided(out_shape, out_strides, strides[big.size() - 2]);
  } else {
    Tensor o = testing::poisoned_device(out_shape, c.dtype);
    dp.keep.push_back(o);
    dp.out = o.view();
  }
  if (c.lse) {
    Shape ls(out_shape.begin(), out_shape.end() - 1);
    Tensor l = testing::poisoned_device(ls, DType::kF32);
    dp.keep.push_back(l);
    dp.lse = l.view();
  }
  auto& o = dp.opts;
  o.backend = Backend::kNative;
  o.num_splits = c.num_splits;
  o.k_scale = c.k_scale;
  o.v_scale = c.v_scale;
  o.seq_lens_k = put_meta(pb.seq_lens_k);
  if (c.paged) {
    o.block_table = put_meta(pb.block_table);
    o.page_size = c.page_size;
  }
  if (c.padded_q || !c.q_real.empty()) o.seq_lens_q = put_meta(pb.seq_lens_q);
  if (c.token_to_req) {
    o.token_to_req = put_meta(pb.token_to_req);
  } else if (!c.padded_q) {
    o.cu_seqlens_q = put_meta(pb.cu_seqlens_q);
  }
  if (c.positions || c.token_to_req) o.query_positions = put_meta(pb.positions);
  if (c.gate != Gate::kNone) {
    TensorView g = put(pb.gate);
    if (c.padded_q) {
      Shape gs = {pb.batch, pb.q_len};
      Shape gst = {pb.q_len * g.stride(0), g.stride(0)};
      for (int d = 1; d < g.dim(); ++d) {
        gs.push_back(g.size(d));
        gst.push_back(g.stride(d));
      }
      g = g.as_strided(gs, gst);
    }
    o.gate = g;
  }
  return dp;
}

void expect_matches(const Problem& pb, const DeviceProblem& dp, const Expected& e) {
  Tensor out = Tensor::to_host(dp.out);
  // FP8 values reach 448 x v_scale: the output's rounding scales with them.
  const double atol = testing::default_atol(pb.c.dtype) * (pb.c.fp8 ? 448 * pb.c.v_scale : 1.0),
               rtol = testing::default_rtol(pb.c.dtype);
  EXPECT_TRUE(testing::all_close(out.view(), e.out, atol, rtol)) << "out";
  if (pb.c.lse) {
    Tensor lse = Tensor::to_host(dp.lse);
    EXPECT_TRUE(testing::all_close(lse.view(), e.lse, 2e-3, 2e-3)) << "lse";
  }
  if (pb.c.views) {
    // Every element of the outer buffer that is not part of `out` kept its bytes.
    Tensor after = Tensor::to_host(dp.out_outer.view());
    const auto a = to_vector(after.view()), b = to_vector(dp.out_outer_before.view());
    const int64_t last = dp.out_outer.shape().back(),
                  heads = dp.out_outer.shape()[dp.out_outer.view().dim() - 2];
    int64_t changed = 0;
    for (size_t i = 0; i < a.size(); ++i) {
      const int64_t col = static_cast<int64_t>(i) % last,
                    head = static_cast<int64_t>(i) / last % heads;
      const bool in_out = head >= 1 && col % 2 == 0;
      if (!in_out && std::memcmp(&a[i], &b[i], sizeof(double)) != 0) ++changed;
    }
    EXPECT_EQ(changed, 0) << "bytes around the out view were written";
  }
}

class GpuSparseAttention : public ::testing::TestWithParam<Case> {};

TEST_P(GpuSparseAttention, MatchesOracle) {
  SPARSE_ATTN_REQUIRE_GPU();
  auto rng = testing::make_rng();
  const Problem pb = make_problem(GetParam(), rng);
  DeviceProblem dp = to_device_problem(pb, rng);
  std::optional<TensorView> lse;
  if (pb.c.lse) lse = dp.lse;
  qsa_sparse_attention(dp.q, dp.k, dp.v, dp.idx, dp.out, lse, dp.opts);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  expect_matches(pb, dp, oracle(pb));
}

Case decode(std::string name, int64_t b) {
  Case c;
  c.name = std::move(name);
  c.q_rows.assign(b, 1);
  for (int64_t i = 0; i < b; ++i) c.k_lens.push_back(2500 + 977 * i % 6000);
  return c;
}

std::vector<Case> cases() {
  std::vector<Case> v;
  v.push_back(decode("decode_b8_canonical_page64_heuristic", 8));
  {
    Case c = decode("decode_b3_splits1", 3);
    c.num_splits = 1;
    v.push_back(c);
  }
  {
    Case c = decode("decode_b3_splits5_gate_elementwise", 3);
    c.num_splits = 5;
    c.gate = Gate::kElementwise;
    v.push_back(c);
  }
  {
    Case c = decode("decode_b2_splits1000_gate_per_head_nolse", 2);
    c.num_splits = 1000;
    c.gate = Gate::kPerHead;
    c.lse = false;
    v.push_back(c);
  }
  {
    // More splits than the merge kernel has threads: it walks its splits in chunks of 256.
    Case c = decode("decode_b1_width17000_splits266_merge_chunks", 1);
    c.k_lens = {20000};
    c.width = 17000;
    c.num_splits = 1000;  // capped at the 266 tiles
    c.gate = Gate::kElementwise;
    v.push_back(c);
  }
  {
    Case c = decode("decode_b4_page16_fp16_positions", 4);
    c.page_size = 16;
    c.dtype = DType::kF16;
    c.positions = true;
    v.push_back(c);
  }
  {
    Case c = decode("decode_b2_hole_page", 2);
    c.hole_page = true;
    v.push_back(c);
  }
  {
    // Token ids on the gather kernel (qsa_gather_kernel.cuh): rows whose valid ids fill its 33
    // tiles exactly (one split), one column past its limit (the per-row kernel), the
    // heuristic's cluster at B = 1, 16 splits of two tiles, an engine page size, dense K/V, and
    // padding rows among the rows of clusters.
    Case c = decode("decode_b2_width2112_all_valid_splits1", 2);
    c.k_lens = {5000, 2200};
    c.width = 2112;
    c.invalid_share = 0.0;
    c.num_splits = 1;
    v.push_back(c);
    c = decode("decode_b2_width2113_splits1_per_row", 2);
    c.width = 2113;
    c.num_splits = 1;
    v.push_back(c);
    // Top-2048 selections as token ids (8195 a row; block_indices stops at 512 blocks): the
    // gather kernel in at least 4 splits of 2112 ids, at the heuristic's count and at exactly 4,
    // FP8 too.
    c = decode("decode_b3_width8195_heuristic", 3);
    c.k_lens = {40000, 9001, 8300};
    c.width = 8195;
    c.num_splits.reset();
    v.push_back(c);
    c.name = "decode_b3_width8195_splits4";
    c.num_splits = 4;
    v.push_back(c);
    c = decode("decode_b1_heuristic_gate_elementwise", 1);
    c.k_lens = {33000};
    c.gate = Gate::kElementwise;
    v.push_back(c);
    // A group of 13 heads at the heuristic's 11 splits of 2051 token ids: the cluster merge's
    // 416 output chunks in shares of 38, the last one 36.
    c = decode("decode_b1_group13_heuristic", 1);
    c.hq = 26;
    c.k_lens = {33000};
    v.push_back(c);
    c = decode("decode_b3_width2048_splits16", 3);
    c.width = 2048;
    c.num_splits = 16;
    v.push_back(c);
    c = decode("decode_b4_page1600_heuristic", 4);
    c.page_size = 1600;
    c.k_lens = {33000, 1601, 3, 7000};
    v.push_back(c);
    c = Case{};  // padded (dense) K/V: one split, padded queries
    c.name = "decode_padded_q_dense_kv_splits1";
    c.padded_q = true;
    c.paged = false;
    c.q_rows = {1, 1, 1};
    c.k_lens = {3000, 64, 2051};
    c.num_splits = 1;
    c.gate = Gate::kPerHead;
    v.push_back(c);
    c = decode("decode_token_to_req_padding_rows_splits4", 3);
    c.token_to_req = true;
    c.padding_rows = 2;
    c.num_splits = 4;
    v.push_back(c);
  }
  {
    Case c;
    c.name = "prefill_flat_rows37_1_20_page16_width515";
    c.q_rows = {37, 1, 20};
    c.k_lens = {300, 40, 700};
    c.page_size = 16;
    c.width = 515;
    v.push_back(c);
  }
  {
    Case c;
    c.name = "prefill_flat_width4103_two_index_passes_gate";
    c.q_rows = {5, 4};
    c.k_lens = {5000, 4500};
    c.width = 4103;
    c.gate = Gate::kElementwise;
    v.push_back(c);
  }
  {
    Case c;
    c.name = "prefill_padded_q9_seqlens_9_4_0_page64";
    c.padded_q = true;
    c.q_rows = {9, 4, 0};
    c.k_lens = {400, 100, 64};
    c.width = 259;
    c.gate = Gate::kPerHead;
    v.push_back(c);
  }
  {
    Case c;
    c.name = "prefill_padded_q5_dense_kv_splits1";
    c.padded_q = true;
    c.paged = false;
    c.q_rows = {5, 3};
    c.k_lens = {200, 90};
    c.width = 131;
    c.num_splits = 1;
    v.push_back(c);
  }
  {
    Case c;
    c.name = "prefill_token_to_req_right_aligned_positions";
    c.token_to_req = true;
    c.q_rows = {6, 5, 7};
    c.k_lens = {120, 80, 300};
    c.width = 67;
    v.push_back(c);
  }
  {
    // Padding rows of a graph-padded batch among the real ones: request id -1, or a live
    // request id at a negative position; right-aligned and random positions; int32 and int64.
    for (bool by_position : {false, true}) {
      for (bool positions : {false, true}) {
        for (bool wide : {false, true}) {
          Case c;
          c.name = std::string("prefill_token_to_req_padding_rows") +
                   (by_position ? "_at_negative_positions" : "_id_minus_one") +
                   (positions ? "_random_positions" : "") + (wide ? "_int64" : "");
          c.token_to_req = true;
          c.positions = positions;
          c.padding_rows = 5;
          c.pad_by_position = by_position;
          c.int64_metadata = wide;
          c.q_rows = {6, 5, 7};
          c.k_lens = {120, 80, 300};
          c.width = 67;
          c.gate = by_position ? Gate::kElementwise : Gate::kNone;
          v.push_back(c);
        }
      }
    }
  }
  {
    Case c;
    c.name = "prefill_token_to_req_random_positions";
    c.token_to_req = true;
    c.positions = true;
    c.q_rows = {3, 1, 4};
    c.k_lens = {40, 7, 64};
    c.width = 40;
    v.push_back(c);
  }
  {
    Case c;
    c.name = "prefill_cu_seqlens_seq_lens_q_splits2";
    c.q_rows = {7, 3};
    c.q_real = {5, 3};
    c.k_lens = {900, 64};
    c.width = 333;
    c.num_splits = 2;
    v.push_back(c);
  }
  {
    // int64 metadata in the other layouts: decode with SplitKV, padded queries with dense K/V,
    // cu_seqlens_q with seq_lens_q, a hole page, sliced views.
    Case c = decode("decode_b3_splits5_int64", 3);
    c.num_splits = 5;
    c.hole_page = true;
    c.int64_metadata = true;
    v.push_back(c);
    c = decode("views_decode_b3_splits3_int64", 3);
    c.views = true;
    c.num_splits = 3;
    c.int64_metadata = true;
    v.push_back(c);
    c = Case{};
    c.name = "prefill_padded_q5_dense_kv_int64";
    c.padded_q = true;
    c.paged = false;
    c.q_rows = {5, 3};
    c.k_lens = {200, 90};
    c.width = 131;
    c.num_splits = 1;
    c.int64_metadata = true;
    v.push_back(c);
    c = Case{};
    c.name = "prefill_cu_seqlens_seq_lens_q_random_positions_int64";
    c.q_rows = {7, 3};
    c.q_real = {5, 3};
    c.k_lens = {900, 64};
    c.width = 333;
    c.positions = true;
    c.int64_metadata = true;
    v.push_back(c);
  }
  {
    Case c = decode("all_ids_invalid", 3);
    c.invalid_share = 1.0;
    c.gate = Gate::kElementwise;
    v.push_back(c);
  }
  {
    Case c = decode("views_sliced_inputs_strided_out_splits3", 3);
    c.views = true;
    c.num_splits = 3;
    c.gate = Gate::kElementwise;
    v.push_back(c);
  }
  {
    Case c = decode("views_k_sliced_v_dense_strides_differ", 2);
    c.views = true;
    c.dense_v = true;
    c.num_splits = 2;
    v.push_back(c);
  }
  {
    Case c;
    c.name = "views_prefill_padded_fp16_page16";
    c.views = true;
    c.padded_q = true;
    c.dtype = DType::kF16;
    c.q_rows = {3, 2};
    c.k_lens = {70, 33};
    c.page_size = 16;
    c.width = 99;
    v.push_back(c);
  }
  // Every group size on the gather kernel, and on the per-row kernel (one split asked for rows
  // past the gather kernel's 2112 ids a split).
  for (auto [hq, hkv] : std::vector<std::pair<int64_t, int64_t>>{
           {1, 1}, {3, 1}, {5, 5}, {16, 1}, {16, 2}, {32, 2}, {12, 4}}) {
    Case c;
    c.name = "group" + std::to_string(hq / hkv) + "_hq" + std::to_string(hq) + "_hkv" +
             std::to_string(hkv);
    c.hq = hq;
    c.hkv = hkv;
    c.q_rows = {3, 1};
    c.k_lens = {500, 90};
    c.width = 301;
    c.gate = hq % 2 ? Gate::kPerHead : Gate::kNone;
    v.push_back(c);
    c.name += "_perrow";
    c.k_lens = {3000, 2500};
    c.width = 2200;
    c.num_splits = 1;
    v.push_back(c);
  }
  {
    // Prefill rows at a group of 8 (16/2): the gather kernel's rows, whose padding head columns
    // are half of its 16 (OneSplit below: the per-row kernel's, at one split).
    Case c;
    c.name = "group8_prefill_shared";
    c.hq = 16;
    c.q_rows = {40, 12};
    c.k_lens = {3000, 2600};
    c.shared = true;
    c.gate = Gate::kElementwise;
    v.push_back(c);
  }
  return v;
}

INSTANTIATE_TEST_SUITE_P(Forms, GpuSparseAttention, ::testing::ValuesIn(cases()), case_name);

// The per-row kernel at one split on prefill rows: token ids past the gather kernel's 2112 a
// split where the caller asks for one split (sparse_attention_native.cpp), on the forms above
// with at least 10 rows a request on average, widened to 2200 ids, on random selections
// (little sharing between rows) and shared ones (neighbouring rows select mostly the same
// tokens), in BF16 and, for the first form, FP16.
std::vector<Case> one_split_cases() {
  std::vector<Case> v;
  for (const Case& base : cases()) {
    const int64_t batch = static_cast<int64_t>(base.q_rows.size());
    const int64_t rows = base.padded_q
                             ? batch * *std::max_element(base.q_rows.begin(), base.q_rows.end())
                             : std::accumulate(base.q_rows.begin(), base.q_rows.end(), int64_t{0});
    if (rows < 10 * batch) continue;
    const bool fp16_too = v.empty();
    for (bool shared : {false, true}) {
      if (base.shared && !shared) continue;
      Case c = base;
      c.num_splits = 1;
      if (c.width < 2200) {
        c.width = 2200;
        c.name += "_widened";
      }
      c.shared = shared;
      c.name += shared && !base.shared ? "_one_split_shared" : "_one_split";
      v.push_back(c);
      if (fp16_too) {
        c.dtype = DType::kF16;
        c.name = "fp16_" + c.name;
        v.push_back(c);
      }
    }
  }
  return v;
}

INSTANTIATE_TEST_SUITE_P(OneSplit, GpuSparseAttention, ::testing::ValuesIn(one_split_cases()),
                         case_name);

// FP8 K/V: every form above with FP8 caches (on whichever kernel the schedule picks),
// under a power-of-two pair of scales and a pair that is not.
std::vector<Case> fp8_cases() {
  std::vector<Case> v;
  int i = 0;
  for (Case c : cases()) {
    c.fp8 = true;
    const bool pow2 = i++ % 2 == 0;
    c.k_scale = pow2 ? 1.0 / 64 : 0.0113;
    c.v_scale = pow2 ? 1.0 / 128 : 0.0071;
    c.name = "fp8_" + c.name;
    v.push_back(c);
  }
  return v;
}

INSTANTIATE_TEST_SUITE_P(Fp8, GpuSparseAttention, ::testing::ValuesIn(fp8_cases()), case_name);

// Every finite e4m3 code read by the FP8 kernel, exactly: each row attends to one token (its
// own, by id), so its output is that token's V, exact in the output type with v_scale 1 (the
// sign of a zero is not kept: the weighted sum starts from +0), and
// head h's query is one-hot at dim d(r, h), so its LSE is scale x K[r, d(r, h)]. K and V hold
// the 254 finite codes in patterns that put every code under some checked (row, dim); the last
// row's token holds the two NaN codes in V's dims 0 and 1, which must come out NaN.
TEST(GpuSparseAttentionFp8, EveryFiniteCodeReadsExactly) {
  SPARSE_ATTN_REQUIRE_GPU();
  constexpr int64_t kHq = 24, kHkv = 2, kRows = 255, kPage = 64, kPages = 4;
  std::vector<uint8_t> finite;
  for (int code = 0; code < 256; ++code) {
    if ((code & 0x7f) != 0x7f) finite.push_back(static_cast<uint8_t>(code));
  }
  const int64_t n = static_cast<int64_t>(finite.size());
  ASSERT_EQ(n, 254);
  auto k_code = [&](int64_t t, int64_t kvh, int64_t d) {
    return finite[(t + 7 * d + 3 * kvh) % n];
  };
  auto v_code = [&](int64_t t, int64_t kvh, int64_t d) { return finite[(5 * t + d + kvh) % n]; };
  auto q_dim = [](int64_t r, int64_t h) { return (r + 11 * h) % kD; };
  // Token t on page t / kPage, pages in table order.
  Tensor k = Tensor::empty({kPages, kPage, kHkv, kD}, DType::kF8E4M3);
  Tensor v = Tensor::empty({kPages, kPage, kHkv, kD}, DType::kF8E4M3);
  for (int64_t t = 0; t < kPages * kPage; ++t) {
    for (int64_t kvh = 0; kvh < kHkv; ++kvh) {
      for (int64_t d = 0; d < kD; ++d) {
        k.data_as<uint8_t>()[(t * kHkv + kvh) * kD + d] = k_code(t, kvh, d);
        v.data_as<uint8_t>()[(t * kHkv + kvh) * kD + d] = v_code(t, kvh, d);
      }
    }
  }
  for (int64_t kvh = 0; kvh < kHkv; ++kvh) {
    v.data_as<uint8_t>()[(254 * kHkv + kvh) * kD + 0] = 0x7f;
    v.data_as<uint8_t>()[(254 * kHkv + kvh) * kD + 1] = 0xff;
  }
  auto v_value = [&](int64_t t, int64_t kvh, int64_t d) {
    return fp8_e4m3_to_float(v.data_as<uint8_t>()[(t * kHkv + kvh) * kD + d]);
  };
  std::vector<bool> checked(256, false);
  for (DType dtype : {DType::kBF16, DType::kF16}) {
    Tensor q = Tensor::empty({kRows, kHq, kD}, dtype);
    for (int64_t r = 0; r < kRows; ++r) {
      for (int64_t h = 0; h < kHq; ++h) {
        for (int64_t d = 0; d < kD; ++d) {
          store_from_float(q.data(), dtype, (r * kHq + h) * kD + d, d == q_dim(r, h) ? 1.f : 0.f);
        }
      }
    }
    std::vector<int32_t> ids(kRows), pos(kRows, kPages * kPage - 1);
    std::iota(ids.begin(), ids.end(), 0);
    Tensor dq = to_device(q), dk = to_device(k), dv = to_device(v);
    Tensor did = to_device(testing::int32_tensor({kRows, 1}, ids));
    Tensor dpos = to_device(testing::int32_tensor({kRows}, pos));
    Tensor dcu = to_device(testing::int32_tensor({2}, {0, kRows}));
    Tensor dtable = to_device(testing::int32_tensor({1, kPages}, {0, 1, 2, 3}));
    Tensor dlen = to_device(testing::int32_tensor({1}, {kPages * kPage}));
    Tensor out = testing::poisoned_device({kRows, kHq, kD}, dtype);
    Tensor lse = testing::poisoned_device({kRows, kHq}, DType::kF32);
    SparseAttentionOptions o;
    o.backend = Backend::kNative;
    o.block_table = dtable.view();
    o.page_size = kPage;
    o.seq_lens_k = dlen.view();
    o.cu_seqlens_q = dcu.view();
    o.query_positions = dpos.view();
    qsa_sparse_attention(dq.view(), dk.view(), dv.view(), did.view(), out.view(), lse.view(), o);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const Tensor ho = Tensor::to_host(out.view()), hl = Tensor::to_host(lse.view());
    const double scale = 1.0 / std::sqrt(static_cast<double>(kD));
    int64_t bad_out = 0, bad_lse = 0;
    for (int64_t r = 0; r < kRows; ++r) {
      for (int64_t h = 0; h < kHq; ++h) {
        const int64_t kvh = h / (kHq / kHkv), dk_at = q_dim(r, h);
        for (int64_t d = 0; d < kD; ++d) {
          const float want = v_value(r, kvh, d);
          const float got = load_as_float(ho.data(), dtype, (r * kHq + h) * kD + d);
          const bool same = std::isnan(want) ? std::isnan(got) : want == got;
          if (!same && ++bad_out <= 5) {
            ADD_FAILURE() << dtype_name(dtype) << " out[" << r << ", " << h << ", " << d
                          << "] = " << got << ", V code 0x" << std::hex
                          << int(v.data_as<uint8_t>()[(r * kHkv + kvh) * kD + d]) << " is " << want;
          }
        }
        const uint8_t kc = k_code(r, kvh, dk_at);
        checked[kc] = true;
        const double want = scale * fp8_e4m3_to_float(kc);
        const double got = hl.data_as<float>()[r * kHq + h];
        if (!(std::fabs(got - want) <= 1e-6 * std::fabs(want) + 1e-30) && ++bad_lse <= 5) {
          ADD_FAILURE() << dtype_name(dtype) << " lse[" << r << ", " << h << "] = " << got
                        << ", K code 0x" << std::hex << int(kc) << " gives " << want;
        }
      }
    }
    EXPECT_EQ(bad_out, 0) << dtype_name(dtype);
    EXPECT_EQ(bad_lse, 0) << dtype_name(dtype);
  }
  EXPECT_EQ(std::count(checked.begin(), checked.end(), true), 254) << "codes left unchecked";
}

// token_indices of one row as the expansion builds them from its hinted blocks: each block b
// with b >= 0 and 4b + 3 <= p gives 4b .. 4b+3 in order, then the tail 4 * ((p + 1) / 4) .. p.
// `row` holds the width's -1s on entry.
void expand_hint_row(const int32_t* blocks, int64_t nb, int64_t p, int32_t* row) {
  int64_t n = 0;
  for (int64_t j = 0; j < nb; ++j) {
    const int64_t b = blocks[j];
    if (b < 0 || 4 * b + 3 > p) continue;
    for (int t = 0; t < 4; ++t) row[n++] = static_cast<int32_t>(4 * b + t);
  }
  for (int64_t t = 4 * ((p + 1) / 4); t <= p; ++t) row[n++] = static_cast<int32_t>(t);
}

// The block hint with the compact-blocks contract and warp_specialized (canonical geometry):
// the result is the token-only one, on the structured path (page sizes divisible by 4, with
// and without SplitKV, the tail derived from the position) and where the hint is ignored (page
// size 6). Selections are built as the producer builds them: distinct visible blocks compacted
// to the front, expanded to 4 tokens each, the row's tail after them, -1 after that.
struct HintCase {
  int64_t page_size;
  std::optional<int64_t> num_splits;
  std::vector<int64_t> q_rows, k_lens;
  bool int64_metadata = false;  // block_indices and every other metadata tensor as int64
  int64_t padding_rows = 0;     // rows of request id -1 among the real ones (token_to_req)
  DType dtype = DType::kBF16;
};

// A compact-blocks hint of nb columns for every row of pb (distinct visible blocks in random
// order, -1 after them), with pb.idx replaced by its expansion.
std::vector<int32_t> compact_hint(Problem& pb, int64_t nb, std::mt19937_64& rng) {
  const int64_t width = pb.c.width;
  std::vector<int32_t> blocks(pb.rows * nb, -1), ids(pb.rows * width, -1);
  for (int64_t r = 0; r < pb.rows; ++r) {
    const int64_t p = pb.row_pos[r], visible = std::max<int64_t>(0, (p + 1) / 4);
    std::vector<int32_t> all(visible);
    std::iota(all.begin(), all.end(), 0);
    std::shuffle(all.begin(), all.end(), rng);
    all.resize(std::min<int64_t>(nb, visible));
    std::copy(all.begin(), all.end(), blocks.begin() + r * nb);
    expand_hint_row(&blocks[r * nb], nb, p, &ids[r * width]);
  }
  pb.idx = testing::int32_tensor({pb.rows, width}, ids);
  return blocks;
}

class GpuSparseAttentionBlockHint : public ::testing::TestWithParam<HintCase> {};

TEST_P(GpuSparseAttentionBlockHint, HintAndProducerContractGiveTheTokenResult) {
  SPARSE_ATTN_REQUIRE_GPU();
  auto rng = testing::make_rng();
  constexpr int64_t kNb = 100;
  Case c;
  c.q_rows = GetParam().q_rows;
  c.k_lens = GetParam().k_lens;
  c.page_size = GetParam().page_size;
  c.num_splits = GetParam().num_splits;
  c.width = 4 * kNb + 3;
  c.gate = Gate::kPerHead;
  c.int64_metadata = GetParam().int64_metadata;
  c.token_to_req = GetParam().padding_rows > 0;
  c.padding_rows = GetParam().padding_rows;
  c.dtype = GetParam().dtype;
  Problem pb = make_problem(c, rng);
  const std::vector<int32_t> blocks = compact_hint(pb, kNb, rng);
  DeviceProblem dp = to_device_problem(pb, rng);
  const Tensor hb = testing::int32_tensor({pb.rows, kNb}, blocks);
  Tensor db = to_device(c.int64_metadata ? testing::widened(hb.view()) : hb);
  dp.opts.block_indices = db.view();
  dp.opts.assume_compact_blocks = true;
  dp.opts.warp_specialized = true;
  qsa_sparse_attention(dp.q, dp.k, dp.v, dp.idx, dp.out, dp.lse, dp.opts);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  expect_matches(pb, dp, oracle(pb));
}

INSTANTIATE_TEST_SUITE_P(Pages, GpuSparseAttentionBlockHint, ::testing::ValuesIn([] {
                           return std::vector<HintCase>{
                               {64, std::nullopt, {37, 5}, {3000, 203}},
                               {16, 3, {1, 1, 1}, {5001, 2998, 401}},
                               {64, 1, {9}, {58}},
                               {6, std::nullopt, {7, 2}, {500, 66}},
                               // The union and gather kernels (one split, rows per request >= 10).
                               {16, 1, {40, 13}, {3000, 900}},
                               {64, std::nullopt, {37, 5}, {3000, 203}, true},
                               {16, 1, {40, 13}, {3000, 900}, true},
                               // Decode rows with one split: the gather kernel alone.
                               {64, 1, {1, 1, 1, 1, 1, 1}, {3000, 2051, 4, 777, 9000, 130}},
                               {1600, 1, {1, 1, 1, 1, 1}, {5000, 1601, 3, 3300, 96}, true},
                               // Decode rows with SplitKV on the gather kernel (a cluster a row
                               // and KV head): 100 blocks in 7 splits of one tile (16 asked),
                               // rows too short for some splits, padding rows (request id -1);
                               // the heuristic's count; fp16; and 17 splits, past the cluster
                               // limit (the per-row kernel).
                               {64, 16, {1, 1, 1, 1}, {9000, 3000, 130, 4}, false, 2},
                               {64, std::nullopt, {1, 1, 1}, {5000, 2051, 777}},
                               {1600, 5, {1, 1}, {5000, 3}, true, 1},
                               {16, 2, {1, 1, 1}, {700, 5001, 60}, false, 0, DType::kF16},
                               {64, 8, {2, 1}, {3000, 1500}},
                               {64, 17, {1, 1}, {9000, 3000}},
                               {64, 1, {1, 1, 1}, {3000, 2000, 500}, false, 2}};
                         }()),
                         [](const ::testing::TestParamInfo<HintCase>& info) {
                           return "page" + std::to_string(info.param.page_size) + "_splits" +
                                  (info.param.num_splits ? std::to_string(*info.param.num_splits)
                                                         : "auto") +
                                  "_rows" + std::to_string(info.param.q_rows.size()) +
                                  (info.param.int64_metadata ? "_int64" : "") +
                                  (info.param.padding_rows ? "_padding" : "") +
                                  (info.param.dtype == DType::kF16 ? "_fp16" : "");
                         });

// The block hint as an engine passes it: block_indices is the raw top-k of each row (unsorted,
// with duplicates, -1 and future blocks, among them the row's current incomplete block) and
// token_indices its expansion, which dropped every block with 4b + 3 > p and appended the
// tail. No compact-blocks promise. The result must be the token-only one on every kernel
// (union and gather with one split, per-row with SplitKV), on engine page sizes and on page 6,
// where the hint is ignored; the positions are given, as engines give them.
struct EngineHintCase {
  std::string name;
  int64_t page_size;
  std::optional<int64_t> num_splits;
  std::vector<int64_t> q_rows, k_lens;
  int64_t nb;
  bool fp8 = false;  // FP8 K/V (scales 0.0131 and 0.0093)
};

class GpuSparseAttentionEngineHint : public ::testing::TestWithParam<EngineHintCase> {};

TEST_P(GpuSparseAttentionEngineHint, RawTopkHintGivesTheTokenResult) {
  SPARSE_ATTN_REQUIRE_GPU();
  const EngineHintCase& hc = GetParam();
  auto rng = testing::make_rng();
  Case c;
  c.q_rows = hc.q_rows;
  c.k_lens = hc.k_lens;
  c.page_size = hc.page_size;
  c.num_splits = hc.num_splits;
  c.width = 4 * hc.nb + 3;
  c.gate = Gate::kElementwise;
  c.positions = true;
  c.fp8 = hc.fp8;
  if (hc.fp8) {
    c.k_scale = 0.0131;
    c.v_scale = 0.0093;
  }
  Problem pb = make_problem(c, rng);
  // Right-aligned positions (a prefill chunk at the end of its request), given explicitly.
  std::vector<int32_t> pos32(pb.rows);
  for (int64_t r = 0, first = 0, b = 0; r < pb.rows; ++r) {
    while (r >= first + c.q_rows[b]) first += c.q_rows[b++];
    pb.row_pos[r] = c.k_lens[b] - c.q_rows[b] + (r - first);
    pos32[r] = static_cast<int32_t>(pb.row_pos[r]);
  }
  pb.positions = testing::int32_tensor({pb.rows}, pos32);
  std::vector<int32_t> blocks(pb.rows * hc.nb), ids(pb.rows * c.width, -1);
  std::uniform_real_distribution<double> u01(0, 1);
  int64_t current_block_hints = 0;
  for (int64_t r = 0; r < pb.rows; ++r) {
    const int64_t p = pb.row_pos[r], vis = (p + 1) / 4;
    for (int64_t j = 0; j < hc.nb; ++j) {
      const double x = u01(rng);
      int64_t b;
      if (x < 0.05 || (vis == 0 && x < 0.5)) {
        b = -1;
      } else if (x < 0.15 || vis == 0) {
        b = vis + std::uniform_int_distribution<int64_t>(0, 2)(rng);  // vis: the current block
      } else {
        b = std::uniform_int_distribution<int64_t>(0, vis - 1)(rng);  // duplicates happen
      }
      if (b == vis && 4 * b <= p) ++current_block_hints;
      blocks[r * hc.nb + j] = static_cast<int32_t>(b);
    }
    expand_hint_row(&blocks[r * hc.nb], hc.nb, p, &ids[r * c.width]);
  }
  ASSERT_GT(current_block_hints, 0) << "no row hints its current incomplete block";
  pb.idx = testing::int32_tensor({pb.rows, c.width}, ids);
  DeviceProblem dp = to_device_problem(pb, rng);
  Tensor db = to_device(testing::int32_tensor({pb.rows, hc.nb}, blocks));
  dp.opts.block_indices = db.view();
  qsa_sparse_attention(dp.q, dp.k, dp.v, dp.idx, dp.out, dp.lse, dp.opts);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  expect_matches(pb, dp, oracle(pb));
}

INSTANTIATE_TEST_SUITE_P(
    Engine, GpuSparseAttentionEngineHint,
    ::testing::Values(
        EngineHintCase{"page1600_rows96_pos6900_nb512_rowtiles", 1600, 1, {96}, {6950}, 512},
        EngineHintCase{"page1600_rows40_3_requests_nb512_splits4",
                       1600,
                       4,
                       {40, 1, 9},
                       {6950, 3001, 2203},
                       512},
        EngineHintCase{
            "page800_rows60_25_nb128_heuristic", 800, std::nullopt, {60, 25}, {4001, 903}, 128},
        EngineHintCase{
            "page784_rows30_1_1_nb200_splits2", 784, 2, {30, 1, 1}, {5000, 1569, 786}, 200},
        EngineHintCase{"page1616_rows70_nb64_short_rows", 1616, 1, {70}, {70}, 64},
        EngineHintCase{"page6_hint_ignored_rows33_8", 6, std::nullopt, {33, 8}, {1203, 500}, 128},
        // Decode on the gather kernel's SplitKV clusters: the canonical 512 columns in 16
        // splits, the heuristic's count, FP8 in 3 splits and with the heuristic.
        EngineHintCase{"decode_page64_nb512_splits16", 64, 16, {1, 1, 1}, {6950, 3001, 40}, 512},
        EngineHintCase{
            "decode_page1600_nb512_heuristic", 1600, std::nullopt, {1, 1}, {33000, 2203}, 512},
        EngineHintCase{
            "fp8_decode_page800_nb200_splits3", 800, 3, {1, 1, 1}, {5000, 1569, 786}, 200, true},
        EngineHintCase{
            "fp8_decode_page64_nb512_heuristic", 64, std::nullopt, {1, 1}, {9001, 4103}, 512, true},
        EngineHintCase{"fp8_page1600_rows96_pos6900_nb512", 1600, 1, {96}, {6950}, 512, true},
        EngineHintCase{"decode_page64_b7_splits1_gather",
                       64,
                       1,
                       {1, 1, 1, 1, 1, 1, 1},
                       {6950, 3001, 2203, 5, 64, 900, 4097},
                       512},
        EngineHintCase{"fp8_decode_page800_b7_splits1_gather",
                       800,
                       1,
                       {1, 1, 1, 1, 1, 1, 1},
                       {6950, 3001, 2203, 5, 64, 900, 4097},
                       512,
                       true},
        EngineHintCase{"fp8_page64_rows40_3_requests_nb512_heuristic",
                       64,
                       std::nullopt,
                       {40, 1, 9},
                       {6950, 3001, 2203},
                       512,
                       true}),
    [](const ::testing::TestParamInfo<EngineHintCase>& info) { return info.param.name; });

// The union prefill kernel (qsa_union_problem.cuh) takes the row tiles whose rows' blocks fit
// its union: the window selection (a row at p with vis = (p + 1) / 4 > nb blocks takes
// its nb / 8 most recent blocks and the nb - nb / 8 blocks drawn, with replacement, for its
// aligned 64-position window from the blocks visible at the window's start; a row with
// vis <= nb takes blocks 0 .. vis - 1), with 2% of entries replaced by -1, a future or current
// block, or a duplicate. Tiles across two requests, and every other tile the kernel leaves,
// go to the gather kernel; the result must be the token-only one, and bitwise equal on a
// rerun. The random selection (a row with vis > nb takes nb blocks drawn with replacement
// from all it sees, with the same noise) leaves every tile of long rows to the gather kernel
// (qsa_gather_kernel.cuh).
struct UnionCase {
  std::string name;
  DType dtype;
  int64_t page_size;
  std::vector<int64_t> q_rows, k_lens;
  int64_t nb;
  Gate gate;
  bool lse;
  bool random = false;
  bool hole_page = false;       // one block_table entry inside a sequence is -1
  std::vector<int64_t> q_real;  // seq_lens_q (rows past it are padding); empty: none
  bool fp8 = false;             // FP8 K/V (scales 0.0107, 0.0189): every row on the gather kernel
  int64_t hq = 24, hkv = 2;
};

class GpuSparseAttentionUnion : public ::testing::TestWithParam<UnionCase> {};

// The case's problem, its rows right-aligned in their requests (positions given).
Problem union_problem(const UnionCase& uc, std::mt19937_64& rng) {
  Case c;
  c.dtype = uc.dtype;
  c.hq = uc.hq;
  c.hkv = uc.hkv;
  c.q_rows = uc.q_rows;
  c.k_lens = uc.k_lens;
  c.page_size = uc.page_size;
  c.hole_page = uc.hole_page;
  c.q_real = uc.q_real;
  c.num_splits = 1;
  c.width = 4 * uc.nb + 3;
  c.gate = uc.gate;
  c.lse = uc.lse;
  c.positions = true;
  c.fp8 = uc.fp8;
  if (uc.fp8) {
    c.k_scale = 0.0107;
    c.v_scale = 0.0189;
  }
  Problem pb = make_problem(c, rng);
  std::vector<int32_t> pos32(pb.rows);
  for (int64_t r = 0, first = 0, b = 0; r < pb.rows; ++r) {
    while (r >= first + c.q_rows[b]) first += c.q_rows[b++];
    pb.row_pos[r] = c.k_lens[b] - c.q_rows[b] + (r - first);
    pos32[r] = static_cast<int32_t>(pb.row_pos[r]);
  }
  pb.positions = testing::int32_tensor({pb.rows}, pos32);
  return pb;
}

// A fresh window (or random) selection with noise for every row of pb: sets pb.idx to its
// expansion and returns the block hint [rows, nb].
Tensor selection_hint(Problem& pb, int64_t nb, bool random, std::mt19937_64& rng) {
  const int64_t recent = nb / 8, width = pb.c.width;
  std::vector<int32_t> blocks(pb.rows * nb), ids(pb.rows * width, -1);
  std::uniform_real_distribution<double> u01(0, 1);
  std::vector<int32_t> window;
  int64_t window_of = -1;
  for (int64_t r = 0; r < pb.rows; ++r) {
    const int64_t p = pb.row_pos[r], vis = (p + 1) / 4;
    int32_t* row = &blocks[r * nb];
    if (vis <= nb) {
      for (int64_t j = 0; j < nb; ++j) row[j] = static_cast<int32_t>(j < vis ? j : -1);
    } else if (random) {
      for (int64_t j = 0; j < nb; ++j) {
        row[j] = static_cast<int32_t>(std::uniform_int_distribution<int64_t>(0, vis - 1)(rng));
      }
    } else {
      if (p / 64 != window_of || r == 0 || pb.row_req[r] != pb.row_req[r - 1]) {
        window_of = p / 64;
        const int64_t from = std::max<int64_t>(1, (64 * window_of + 1) / 4);
        window.assign(nb - recent, 0);
        for (int32_t& b : window) {
          b = static_cast<int32_t>(std::uniform_int_distribution<int64_t>(0, from - 1)(rng));
        }
      }
      for (int64_t j = 0; j < recent; ++j) row[j] = static_cast<int32_t>(vis - 1 - j);
      std::copy(window.begin(), window.end(), row + recent);
    }
    for (int64_t j = 0; j < nb; ++j) {
      const double x = u01(rng);
      if (x < 0.005) {
        row[j] = -1;
      } else if (x < 0.01) {
        row[j] = static_cast<int32_t>(vis + (x < 0.0075 ? 0 : 1));
      } else if (x < 0.02) {
        row[j] = row[std::uniform_int_distribution<int64_t>(0, nb - 1)(rng)];
      }
    }
    expand_hint_row(row, nb, p, &ids[r * width]);
  }
  pb.idx = testing::int32_tensor({pb.rows, width}, ids);
  return testing::int32_tensor({pb.rows, nb}, blocks);
}

TEST_P(GpuSparseAttentionUnion, SelectionGivesTheTokenResult) {
  SPARSE_ATTN_REQUIRE_GPU();
  const UnionCase& uc = GetParam();
  auto rng = testing::make_rng();
  Problem pb = union_problem(uc, rng);
  const Tensor blocks = selection_hint(pb, uc.nb, uc.random, rng);
  DeviceProblem dp = to_device_problem(pb, rng);
  Tensor db = to_device(blocks);
  dp.opts.block_indices = db.view();
  std::optional<TensorView> lse;
  if (uc.lse) lse = dp.lse;
  qsa_sparse_attention(dp.q, dp.k, dp.v, dp.idx, dp.out, lse, dp.opts);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  expect_matches(pb, dp, oracle(pb));
  const Tensor first = Tensor::to_host(dp.out);
  poison_device(dp.out);
  qsa_sparse_attention(dp.q, dp.k, dp.v, dp.idx, dp.out, lse, dp.opts);
  const Tensor again = Tensor::to_host(dp.out);
  ASSERT_EQ(std::memcmp(first.data(), again.data(), first.numel() * 2), 0);
}

INSTANTIATE_TEST_SUITE_P(
    Window, GpuSparseAttentionUnion,
    ::testing::Values(
        // Multi-token decode steps: 4 rows a request in 70 requests (enough CTAs for every SM
        // of an H200: the step kernel's, whose steps this selection's duplicates mostly leave
        // to the gather kernel), and 6 rows a request in 3 requests (too few: row by row).
        [] {
          UnionCase uc{"decode_steps_4_rows_70_requests_nb64",
                       DType::kBF16,
                       64,
                       {},
                       {},
                       64,
                       Gate::kElementwise,
                       true};
          for (int64_t b = 0; b < 70; ++b) {
            uc.q_rows.push_back(4);
            uc.k_lens.push_back(4 + 997 * b % 9000);
          }
          return uc;
        }(),
        UnionCase{"decode_steps_6_rows_a_request_page1600_nb200",
                  DType::kBF16,
                  1600,
                  {6, 6, 6},
                  {33000, 1602, 7},
                  200,
                  Gate::kPerHead,
                  true},
        UnionCase{
            "page64_nb512_rows150", DType::kBF16, 64, {150}, {5200}, 512, Gate::kElementwise, true},
        // A group of 8 (16/2): the union kernel takes groups of 12 to 16, so these prefill rows
        // run on the gather kernel with the hint.
        [] {
          UnionCase uc{"group8_page64_nb512_rows150",
                       DType::kBF16,
                       64,
                       {150},
                       {5200},
                       512,
                       Gate::kElementwise,
                       true};
          uc.hq = 16;
          return uc;
        }(),
        UnionCase{"page1600_two_requests_nb256",
                  DType::kBF16,
                  1600,
                  {97, 53},
                  {4100, 2000},
                  256,
                  Gate::kPerHead,
                  true},
        UnionCase{"page16_short_rows_nb64",
                  DType::kBF16,
                  16,
                  {40, 30},
                  {120, 60},
                  64,
                  Gate::kNone,
                  false},
        UnionCase{"fp16_page800_nb128",
                  DType::kF16,
                  800,
                  {64, 31},
                  {3000, 900},
                  128,
                  Gate::kElementwise,
                  true},
        UnionCase{"random_page64_nb512_rows150",
                  DType::kBF16,
                  64,
                  {150},
                  {5200},
                  512,
                  Gate::kElementwise,
                  true,
                  true},
        UnionCase{"random_fp16_page1600_two_requests_hole_nb256",
                  DType::kF16,
                  1600,
                  {97, 53},
                  {4100, 3300},
                  256,
                  Gate::kPerHead,
                  true,
                  true,
                  true},
        UnionCase{"random_page64_padding_rows_nb128",
                  DType::kBF16,
                  64,
                  {60, 40},
                  {3000, 2500},
                  128,
                  Gate::kElementwise,
                  true,
                  true,
                  false,
                  {50, 33}},
        UnionCase{"random_page4_short_rows_nb64",
                  DType::kBF16,
                  4,
                  {40, 30},
                  {120, 900},
                  64,
                  Gate::kNone,
                  false,
                  true},
        UnionCase{"fp8_window_page64_nb512_rows150",
                  DType::kBF16,
                  64,
                  {150},
                  {5200},
                  512,
                  Gate::kElementwise,
                  true,
                  false,
                  false,
                  {},
                  true},
        UnionCase{"fp8_random_fp16_page1600_hole_page_padding_rows",
                  DType::kF16,
                  1600,
                  {70, 33},
                  {4100, 3300},
                  256,
                  Gate::kPerHead,
                  true,
                  true,
                  true,
                  {60, 33},
                  true}),
    [](const ::testing::TestParamInfo<UnionCase>& info) { return info.param.name; });

// More rows than a grid's y/z limit: rows run on gridDim.x, on the gather kernel and (17
// splits asked for, past its cluster limit) the per-row kernel.
TEST(GpuSparseAttentionRows, MoreThan65535Rows) {
  SPARSE_ATTN_REQUIRE_GPU();
  auto rng = testing::make_rng();
  for (const std::optional<int64_t> splits :
       {std::optional<int64_t>{}, std::optional<int64_t>{17}}) {
    SCOPED_TRACE(splits ? "17 splits" : "heuristic splits");
    Case c;
    c.hq = 2;
    c.hkv = 1;
    c.q_rows = {70001};
    c.k_lens = {70001};
    c.width = 5;
    c.gate = Gate::kPerHead;
    c.num_splits = splits;
    const Problem pb = make_problem(c, rng);
    DeviceProblem dp = to_device_problem(pb, rng);
    qsa_sparse_attention(dp.q, dp.k, dp.v, dp.idx, dp.out, dp.lse, dp.opts);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    expect_matches(pb, dp, oracle(pb));
  }
}

// Same inputs, same bits, for the SplitKV path and the single-split path.
TEST(GpuSparseAttentionDeterminism, RerunsAreBitwiseEqual) {
  SPARSE_ATTN_REQUIRE_GPU();
  auto rng = testing::make_rng();
  // Decode with one and six splits (gather kernel at 2051 ids), and prefill rows with shared
  // selections of 2200 ids at one split (0: the per-row kernel, the gather kernel taking at most
  // 2112 ids a split).
  for (int64_t splits : {1, 6, 0}) {
    Case c = decode("det", 4);
    c.num_splits = splits == 0 ? 1 : splits;
    if (splits == 0) {
      c.q_rows = {70, 45};
      c.k_lens = {3000, 2100};
      c.width = 2200;
      c.shared = true;
    }
    c.gate = Gate::kElementwise;
    const Problem pb = make_problem(c, rng);
    DeviceProblem dp = to_device_problem(pb, rng);
    qsa_sparse_attention(dp.q, dp.k, dp.v, dp.idx, dp.out, dp.lse, dp.opts);
    const Tensor first = Tensor::to_host(dp.out), first_lse = Tensor::to_host(dp.lse);
    for (int rep = 0; rep < 3; ++rep) {
      poison_device(dp.out);
      qsa_sparse_attention(dp.q, dp.k, dp.v, dp.idx, dp.out, dp.lse, dp.opts);
      const Tensor again = Tensor::to_host(dp.out), again_lse = Tensor::to_host(dp.lse);
      ASSERT_EQ(std::memcmp(first.data(), again.data(), first.numel() * 2), 0) << splits;
      ASSERT_EQ(std::memcmp(first_lse.data(), again_lse.data(), first_lse.numel() * 4), 0);
    }
  }
}

// Physical ids into flattened K/V: no requests, no causal mask, duplicates counted, ids < 0
// or >= total_kv masked, the lse buffer written; rows with nothing valid give 0 and -inf.
// 2051 ids a row take the gather kernel at the heuristic's splits (2 in a cluster for 20
// (row, KV head) pairs) and at one split; 2200 ids (past one split's 2112) take it in at least
// 2 splits, and the per-row kernel where one split is asked for.
TEST(GpuSparseAttentionPhysical, MatchesOracleWithDuplicatesAndMaskedIds) {
  SPARSE_ATTN_REQUIRE_GPU();
  auto rng = testing::make_rng();
  const int64_t rows = 10, hq = 24, hkv = 2, total = 3000;
  Tensor q = testing::random_tensor({rows, hq, kD}, DType::kBF16, rng, -2.f, 2.f);
  Tensor k = testing::random_tensor({total, hkv, kD}, DType::kBF16, rng, -2.f, 2.f);
  Tensor v = testing::random_tensor({total, hkv, kD}, DType::kBF16, rng);
  Tensor dq = to_device(q), dk = to_device(k), dv = to_device(v);
  for (int64_t width : {2051, 2200}) {
    std::vector<int32_t> ids(rows * width);
    std::uniform_int_distribution<int32_t> any(-3, total + 3), some(0, 40);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t w = 0; w < width; ++w) {
        ids[r * width + w] = r == 4 ? -1 : (r == 2 ? some(rng) : any(rng));  // 2: duplicates
      }
    }
    Tensor didx = to_device(testing::int32_tensor({rows, width}, ids));
    Tensor out = testing::poisoned_device({rows, hq, kD}, DType::kBF16);
    Tensor lse = testing::poisoned_device({rows, hq}, DType::kF32);
    const testing::AttentionExpectation e =
        testing::expected_physical_attention(q.view(), k.view(), v.view(), ids, width, 1.0 / 16.0);
    for (std::optional<int64_t> splits : {std::optional<int64_t>{}, std::optional<int64_t>{1}}) {
      SCOPED_TRACE(::testing::Message()
                   << width << " ids, " << (splits ? "one split" : "heuristic"));
      SparseAttentionOptions o;
      o.selected_kv_indices = didx.view();
      o.num_splits = splits;
      poison_device(out.view());
      poison_device(lse.view());
      qsa_sparse_attention(dq, dk, dv, std::nullopt, out, lse.view(), o);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      EXPECT_TRUE(testing::all_close(Tensor::to_host(out.view()).view(), e.out, 1e-2, 1e-2));
      EXPECT_TRUE(testing::all_close(Tensor::to_host(lse.view()).view(), e.lse, 2e-3, 2e-3));
    }
  }
}

// Caller-owned workspace (destination passing): the size is what the call needs (nonzero where
// SplitKV or the row-rank pass runs), a poisoned buffer of that size, given or returned by a
// workspace_allocator, gives the oracle's result, and one byte less is refused naming the
// workspace and the size.
struct WorkspaceCase {
  std::string name;
  Case c;
  bool needs_workspace;
};

class GpuSparseAttentionWorkspace : public ::testing::TestWithParam<WorkspaceCase> {};

TEST_P(GpuSparseAttentionWorkspace, PoisonedCallerWorkspaceMatchesOracle) {
  SPARSE_ATTN_REQUIRE_GPU();
  auto rng = testing::make_rng();
  const Problem pb = make_problem(GetParam().c, rng);
  DeviceProblem dp = to_device_problem(pb, rng);
  const size_t bytes = qsa_sparse_attention_workspace_size(dp.q, dp.k, dp.v, dp.idx, dp.opts);
  EXPECT_EQ(bytes > 0, GetParam().needs_workspace) << bytes;
  // At least one byte, so that a zero-byte requirement still gets a (poisoned) buffer.
  Tensor workspace =
      testing::poisoned_device({static_cast<int64_t>(std::max<size_t>(bytes, 1))}, DType::kU8);
  dp.opts.workspace = workspace.view();
  std::optional<TensorView> lse;
  if (pb.c.lse) lse = dp.lse;
  qsa_sparse_attention(dp.q, dp.k, dp.v, dp.idx, dp.out, lse, dp.opts);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  expect_matches(pb, dp, oracle(pb));

  // The same from an allocator: asked once for exactly the size, and only when it is nonzero.
  int calls = 0;
  dp.opts.workspace.reset();
  dp.opts.workspace_allocator = [&](size_t asked) {
    ++calls;
    EXPECT_EQ(asked, bytes);
    poison_device(workspace.view());
    return workspace.view();
  };
  poison_device(dp.out);
  qsa_sparse_attention(dp.q, dp.k, dp.v, dp.idx, dp.out, lse, dp.opts);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(calls, bytes > 0 ? 1 : 0);
  expect_matches(pb, dp, oracle(pb));

  if (bytes == 0) return;
  dp.opts.workspace_allocator = [&](size_t asked) {
    return workspace.view().narrow(0, 0, static_cast<int64_t>(asked) - 1);
  };
  EXPECT_THROW(qsa_sparse_attention(dp.q, dp.k, dp.v, dp.idx, dp.out, lse, dp.opts), ValueError);
  dp.opts.workspace_allocator = nullptr;
  dp.opts.workspace = workspace.view().narrow(0, 0, static_cast<int64_t>(bytes) - 1);
  try {
    qsa_sparse_attention(dp.q, dp.k, dp.v, dp.idx, dp.out, lse, dp.opts);
    FAIL() << "a workspace one byte short was accepted";
  } catch (const ValueError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("workspace"), std::string::npos) << msg;
    EXPECT_NE(msg.find(std::to_string(bytes)), std::string::npos) << msg;
  }
}

// SplitKV partials are the per-row kernel's: the cases that need them select more token ids
// than the gather kernel takes in its 16 splits (2112 a split), whose SplitKV merges in a
// cluster.
Case wide_decode(int64_t b) {
  Case c = decode("w", b);
  c.width = 16 * 2112 + 1;
  return c;
}

std::vector<WorkspaceCase> workspace_cases() {
  std::vector<WorkspaceCase> v;
  v.push_back({"decode_b1_heuristic_splits", wide_decode(1), true});
  {
    Case c = wide_decode(3);
    c.num_splits = 4;
    c.gate = Gate::kElementwise;
    v.push_back({"decode_b3_splits4_gate", c, true});
  }
  {
    Case c = decode("w", 3);
    c.num_splits = 4;
    v.push_back({"decode_b3_splits4_gather_cluster_needs_none", c, false});
  }
  {
    Case c = decode("w", 2);
    c.num_splits = 1;
    v.push_back({"decode_b2_one_split_needs_none", c, false});
  }
  {
    // token_to_req rows are never counted: no scratch beyond the SplitKV partials.
    Case c;
    c.token_to_req = true;
    c.padding_rows = 2;
    c.q_rows = {6, 5, 7};
    c.k_lens = {120, 80, 300};
    c.width = 67;
    c.num_splits = 1;
    v.push_back({"prefill_token_to_req_one_split_needs_none", c, false});
  }
  {
    Case c;
    c.token_to_req = true;
    c.q_rows = {2, 1};
    c.k_lens = {3000, 2500};
    c.width = 6337;  // 4 splits of 2112 at the fewest: 3 asked for run on the per-row kernel
    c.num_splits = 3;
    c.int64_metadata = true;
    v.push_back({"token_to_req_splits3_partials_int64", c, true});
  }
  return v;
}

INSTANTIATE_TEST_SUITE_P(Forms, GpuSparseAttentionWorkspace, ::testing::ValuesIn(workspace_cases()),
                         [](const ::testing::TestParamInfo<WorkspaceCase>& info) {
                           return info.param.name;
                         });

// One call of dp's problem captured on a stream of its own (testing::CapturedGraph); dp's
// options keep that stream.
// The next decode step of a captured problem: new selections and positions (the metadata a
// replay must read afresh), the same Q, K, V, gate and page table (the captured buffers).
Problem next_step(const Case& c, const Problem& pb, std::mt19937_64& rng) {
  Problem next = make_problem(c, rng);
  next.q = pb.q;
  next.k = pb.k;
  next.v = pb.v;
  next.gate = pb.gate;
  next.block_table = pb.block_table;
  next.num_pages = pb.num_pages;
  next.max_pages = pb.max_pages;
  return next;
}

testing::CapturedGraph capture(DeviceProblem& dp) {
  return testing::CapturedGraph([&](cudaStream_t stream) {
    dp.opts.stream = stream;
    qsa_sparse_attention(dp.q, dp.k, dp.v, dp.idx, dp.out, dp.lse, dp.opts);
  });
}

// A graph captured with a caller-owned workspace (no allocation node in it) replays correctly.
TEST(GpuSparseAttentionWorkspaceGraph, CapturedWithCallerWorkspace) {
  SPARSE_ATTN_REQUIRE_GPU();
  auto rng = testing::make_rng();
  Case c = wide_decode(2);  // the per-row kernel's SplitKV partials
  c.positions = true;
  Problem pb = make_problem(c, rng);
  DeviceProblem dp = to_device_problem(pb, rng);
  const size_t bytes = qsa_sparse_attention_workspace_size(dp.q, dp.k, dp.v, dp.idx, dp.opts);
  ASSERT_GT(bytes, 0u);
  Tensor workspace = testing::poisoned_device({static_cast<int64_t>(bytes)}, DType::kU8);
  dp.opts.workspace = workspace.view();
  const testing::CapturedGraph captured = capture(dp);
  ASSERT_TRUE(captured.ok());

  Problem next = next_step(c, pb, rng);
  copy_into(dp.idx, next.idx.view());
  copy_into(*dp.opts.query_positions, next.positions.view());
  poison_device(dp.out);
  poison_device(workspace.view());
  ASSERT_EQ(captured.replay(), cudaSuccess);
  expect_matches(next, dp, oracle(next));
}

// A captured graph reads the metadata current at replay: new ids, lengths and positions
// written into the same buffers change the result accordingly.
TEST(GpuSparseAttentionGraph, ReplayReadsCurrentMetadata) {
  SPARSE_ATTN_REQUIRE_GPU();
  auto rng = testing::make_rng();
  Case c = decode("graph", 4);
  c.gate = Gate::kElementwise;
  c.positions = true;
  Problem pb = make_problem(c, rng);
  DeviceProblem dp = to_device_problem(pb, rng);
  const testing::CapturedGraph captured = capture(dp);
  ASSERT_TRUE(captured.ok());

  for (int step = 0; step < 2; ++step) {
    // New selections and positions, written into the captured buffers.
    Problem next = next_step(c, pb, rng);
    copy_into(dp.idx, next.idx.view());
    copy_into(*dp.opts.query_positions, next.positions.view());
    poison_device(dp.out);
    ASSERT_EQ(captured.replay(), cudaSuccess);
    expect_matches(next, dp, oracle(next));
  }
}

// Decode on the gather kernel's SplitKV clusters, captured once: replays read the current
// hint, token ids and positions, and match eager calls bit for bit (the cluster's merge runs in
// a fixed order).
TEST(GpuSparseAttentionClusterGraph, ReplayReadsCurrentHintAndMatchesEagerBits) {
  SPARSE_ATTN_REQUIRE_GPU();
  auto rng = testing::make_rng();
  constexpr int64_t kNb = 512;
  Case c = decode("cluster_graph", 3);
  c.width = 4 * kNb + 3;
  c.gate = Gate::kElementwise;
  c.positions = true;
  c.num_splits = 16;
  Problem pb = make_problem(c, rng);
  const std::vector<int32_t> blocks = compact_hint(pb, kNb, rng);
  DeviceProblem dp = to_device_problem(pb, rng);
  Tensor db = to_device(testing::int32_tensor({pb.rows, kNb}, blocks));
  dp.opts.block_indices = db.view();
  const testing::CapturedGraph captured = capture(dp);
  ASSERT_TRUE(captured.ok());
  for (int step = 0; step < 2; ++step) {
    Problem next = next_step(c, pb, rng);
    const std::vector<int32_t> next_blocks = compact_hint(next, kNb, rng);
    copy_into(dp.idx, next.idx.view());
    copy_into(db.view(), testing::int32_tensor({pb.rows, kNb}, next_blocks).view());
    copy_into(*dp.opts.query_positions, next.positions.view());
    poison_device(dp.out);
    ASSERT_EQ(captured.replay(), cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    expect_matches(next, dp, oracle(next));
    const Tensor replayed = Tensor::to_host(dp.out), replayed_lse = Tensor::to_host(dp.lse);
    poison_device(dp.out);
    dp.opts.stream = nullptr;
    qsa_sparse_attention(dp.q, dp.k, dp.v, dp.idx, dp.out, dp.lse, dp.opts);
    const Tensor eager = Tensor::to_host(dp.out), eager_lse = Tensor::to_host(dp.lse);
    ASSERT_EQ(std::memcmp(replayed.data(), eager.data(), eager.numel() * 2), 0);
    ASSERT_EQ(std::memcmp(replayed_lse.data(), eager_lse.data(), eager_lse.numel() * 4), 0);
  }
}

// A row listing one block 300 times: the union record keeps a byte per count, so its tile
// goes to the gather kernel; the block still counts 300 times, and the other tiles stay the
// union kernel's.
TEST(GpuSparseAttentionUnionCounts, BlockListed300TimesCountsEveryTime) {
  SPARSE_ATTN_REQUIRE_GPU();
  auto rng = testing::make_rng();
  const UnionCase uc{"counts", DType::kBF16, 64, {40}, {6000}, 512, Gate::kNone, true};
  Problem pb = union_problem(uc, rng);
  Tensor blocks = selection_hint(pb, uc.nb, false, rng);
  const int64_t r = 13, p = pb.row_pos[r], width = pb.c.width;
  int32_t* row = blocks.data_as<int32_t>() + r * uc.nb;
  std::fill(row, row + 300, static_cast<int32_t>((p + 1) / 4 - 3));
  int32_t* ids = pb.idx.data_as<int32_t>() + r * width;
  std::fill(ids, ids + width, -1);
  expand_hint_row(row, uc.nb, p, ids);
  DeviceProblem dp = to_device_problem(pb, rng);
  Tensor db = to_device(blocks);
  dp.opts.block_indices = db.view();
  qsa_sparse_attention(dp.q, dp.k, dp.v, dp.idx, dp.out, dp.lse, dp.opts);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  expect_matches(pb, dp, oracle(pb));
}

// More row tiles than one build + attention launch pair takes (QsaUnionConfig::kChunkTiles
// tiles of 10 rows): every chunk, the last one partial, gives what the gather kernel gives
// for the same token ids without the hint (the oracle's cost at 20K rows is left to the
// smaller cases above, which check both kernels against it).
TEST(GpuSparseAttentionUnionChunks, RowsPastOneChunkMatchTheTokenPath) {
  SPARSE_ATTN_REQUIRE_GPU();
  auto rng = testing::make_rng();
  const UnionCase uc{"chunks", DType::kBF16, 64, {20500}, {21000}, 16, Gate::kElementwise, false};
  Problem pb = union_problem(uc, rng);
  const Tensor blocks = selection_hint(pb, uc.nb, false, rng);
  DeviceProblem dp = to_device_problem(pb, rng);
  qsa_sparse_attention(dp.q, dp.k, dp.v, dp.idx, dp.out, std::nullopt, dp.opts);
  const std::vector<double> token_path = to_vector(Tensor::to_host(dp.out).view());
  Tensor db = to_device(blocks);
  dp.opts.block_indices = db.view();
  poison_device(dp.out);
  qsa_sparse_attention(dp.q, dp.k, dp.v, dp.idx, dp.out, std::nullopt, dp.opts);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  // Each side is within the oracle tolerance of the exact result.
  EXPECT_TRUE(testing::all_close(Tensor::to_host(dp.out).view(), token_path,
                                 2 * testing::default_atol(uc.dtype),
                                 2 * testing::default_rtol(uc.dtype)));
}

// The union kernel and the gather kernel after it (the tile flags in a pool workspace the
// graph owns) replay with the hint and token ids current at replay: new window selections,
// tiles of two requests among them.
TEST(GpuSparseAttentionUnionGraph, ReplayReadsCurrentHint) {
  SPARSE_ATTN_REQUIRE_GPU();
  auto rng = testing::make_rng();
  const UnionCase uc{"graph", DType::kBF16, 64, {97, 53}, {4100, 2000}, 256, Gate::kPerHead, true};
  Problem pb = union_problem(uc, rng);
  const Tensor blocks = selection_hint(pb, uc.nb, false, rng);
  DeviceProblem dp = to_device_problem(pb, rng);
  Tensor db = to_device(blocks);
  dp.opts.block_indices = db.view();
  const testing::CapturedGraph captured = capture(dp);
  ASSERT_TRUE(captured.ok());
  for (int step = 0; step < 2; ++step) {
    const Tensor next = selection_hint(pb, uc.nb, false, rng);
    copy_into(dp.idx, pb.idx.view());
    copy_into(db.view(), next.view());
    poison_device(dp.out);
    ASSERT_EQ(captured.replay(), cudaSuccess);
    expect_matches(pb, dp, oracle(pb));
  }
}

// Multi-token decode steps on the step kernel (qsa_step_kernel.cuh): R rows a request at
// consecutive positions (the union problem's right-aligned rows), each row's hint `shared` of
// its blocks from a pool the request's rows share and the rest its own, distinct within the
// row (a row that sees at most nb blocks lists all of them), with 3% of entries -1 and 1% a
// block the row cannot see whole (its tail block or the next). Every `dup_every`-th request
// lists one block twice in its first row: the step kernel leaves that step to the gather
// kernel, and the block counts twice. With `tokens`, the rows pass the hint's expansion as
// token ids alone (2% of them then replaced by -1 or a token after the row's position). The batch
// is large enough that the requests' CTAs fill an H200 (B * Hkv >= 132), which is where the
// schedule takes the step kernel: its only workspace is then the steps' flags (checked through the
// public size, with a poisoned caller workspace).
struct StepCase {
  std::string name;
  DType dtype;
  int64_t page_size;
  std::vector<int64_t> q_rows;  // rows a request (R each, or uneven: steps across requests)
  int64_t nb;
  Gate gate;
  double shared = 0.9;
  int dup_every = 0;
  bool hole_page = false;
  std::vector<int64_t> q_real;  // seq_lens_q: rows past it are padding; empty: none
  bool tokens = false;          // token ids without the hint
  int64_t hq = 24, hkv = 2;
};

std::vector<int64_t> step_rows(int64_t batch, int64_t r) { return std::vector<int64_t>(batch, r); }

Tensor step_hint(Problem& pb, const StepCase& sc, std::mt19937_64& rng) {
  const int64_t nb = sc.nb, width = pb.c.width;
  std::vector<int32_t> blocks(pb.rows * nb, -1), ids(pb.rows * width, -1);
  std::uniform_real_distribution<double> u01(0, 1);
  // Distinct blocks of [0, vis) not in `taken`, `n` of them (fewer if there are not enough).
  auto draw = [&](int64_t vis, int64_t n, std::vector<int32_t>& taken) {
    std::vector<int32_t> out;
    for (int tries = 0; static_cast<int64_t>(out.size()) < n && tries < 50 * n + 100; ++tries) {
      const auto b = static_cast<int32_t>(std::uniform_int_distribution<int64_t>(0, vis - 1)(rng));
      if (std::find(taken.begin(), taken.end(), b) != taken.end()) continue;
      taken.push_back(b);
      out.push_back(b);
    }
    return out;
  };
  std::vector<int32_t> pool;
  for (int64_t r = 0; r < pb.rows; ++r) {
    const int64_t p = pb.row_pos[r], vis = (p + 1) / 4;
    int32_t* row = &blocks[r * nb];
    if (r == 0 || pb.row_req[r] != pb.row_req[r - 1]) {
      std::vector<int32_t> none;
      pool =
          vis > nb ? draw(vis, static_cast<int64_t>(sc.shared * nb), none) : std::vector<int32_t>{};
    }
    if (vis <= nb) {
      for (int64_t j = 0; j < vis; ++j) row[j] = static_cast<int32_t>(j);
    } else {
      std::vector<int32_t> taken = pool;
      const std::vector<int32_t> own = draw(vis, nb - static_cast<int64_t>(pool.size()), taken);
      std::copy(pool.begin(), pool.end(), row);
      std::copy(own.begin(), own.end(), row + pool.size());
      std::shuffle(row, row + nb, rng);
    }
    for (int64_t j = 0; j < nb; ++j) {
      const double x = u01(rng);
      if (x < 0.03) {
        row[j] = -1;
      } else if (x < 0.04) {
        row[j] = static_cast<int32_t>(vis + (x < 0.035 ? 0 : 1));
      }
    }
    const bool first_of_request = r == 0 || pb.row_req[r] != pb.row_req[r - 1];
    if (sc.dup_every > 0 && first_of_request && pb.row_req[r] % sc.dup_every == 0 && vis >= 2) {
      row[0] = static_cast<int32_t>(vis - 2);
      row[1] = row[0];
    }
    int32_t* row_ids = &ids[r * width];
    expand_hint_row(row, nb, p, row_ids);
    for (int64_t j = 0; sc.tokens && j < width; ++j) {
      const double x = u01(rng);
      if (x < 0.01) {
        row_ids[j] = -1;
      } else if (x < 0.02) {
        row_ids[j] = static_cast<int32_t>(p + 1 + std::uniform_int_distribution<int>(0, 9)(rng));
      }
    }
  }
  pb.idx = testing::int32_tensor({pb.rows, width}, ids);
  return testing::int32_tensor({pb.rows, nb}, blocks);
}

class GpuSparseAttentionStep : public ::testing::TestWithParam<StepCase> {};

TEST_P(GpuSparseAttentionStep, UnionOfTheRowsGivesTheTokenResult) {
  SPARSE_ATTN_REQUIRE_GPU();
  const StepCase& sc = GetParam();
  auto rng = testing::make_rng();
  UnionCase uc{sc.name, sc.dtype, sc.page_size, sc.q_rows, {}, sc.nb, sc.gate, true};
  uc.hole_page = sc.hole_page;
  uc.q_real = sc.q_real;
  uc.hq = sc.hq;
  uc.hkv = sc.hkv;
  // KV lengths from a few hundred tokens (rows that see fewer than nb blocks) to 4 * nb + 8K
  // (longer caches only cost the host time to fill them: the selections read nb blocks a row).
  for (size_t b = 0; b < sc.q_rows.size(); ++b) {
    uc.k_lens.push_back(b % 7 == 3 ? 40 + 13 * static_cast<int64_t>(b) % 200
                                   : 4 * sc.nb + 7919 * static_cast<int64_t>(b) % 8000);
  }
  Problem pb = union_problem(uc, rng);
  const Tensor blocks = step_hint(pb, sc, rng);
  DeviceProblem dp = to_device_problem(pb, rng);
  Tensor db = to_device(blocks);
  if (!sc.tokens) dp.opts.block_indices = db.view();
  const size_t bytes = qsa_sparse_attention_workspace_size(dp.q, dp.k, dp.v, dp.idx, dp.opts);
  int sms = 0;
  ASSERT_EQ(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0), cudaSuccess);
  if (!sc.tokens && sc.hkv * static_cast<int64_t>(sc.q_rows.size()) >= sms) {  // B * Hkv >= SMs
    EXPECT_EQ(bytes, 256u) << "the steps' flags alone: the schedule did not take the step kernel";
  }
  Tensor workspace =
      testing::poisoned_device({static_cast<int64_t>(std::max<size_t>(bytes, 1))}, DType::kU8);
  dp.opts.workspace = workspace.view();
  qsa_sparse_attention(dp.q, dp.k, dp.v, dp.idx, dp.out, dp.lse, dp.opts);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  expect_matches(pb, dp, oracle(pb));
  const Tensor first = Tensor::to_host(dp.out);
  poison_device(dp.out);
  qsa_sparse_attention(dp.q, dp.k, dp.v, dp.idx, dp.out, dp.lse, dp.opts);
  const Tensor again = Tensor::to_host(dp.out);
  ASSERT_EQ(std::memcmp(first.data(), again.data(), first.numel() * 2), 0);
}

INSTANTIATE_TEST_SUITE_P(
    Decode, GpuSparseAttentionStep,
    ::testing::Values(
        // 70 requests: 70 CTAs of both KV heads.
        StepCase{"r4_b70_page64_nb512", DType::kBF16, 64, step_rows(70, 4), 512,
                 Gate::kElementwise},
        // 140 requests: 140 CTAs, more than one wave on 132 SMs.
        StepCase{"r3_b140_fp16_page1600_nb256", DType::kF16, 1600, step_rows(140, 3), 256,
                 Gate::kPerHead},
        StepCase{"r2_b70_page16_nb64_hole_page_padding_rows", DType::kBF16, 16, step_rows(70, 2),
                 64, Gate::kNone, 0.9, 0, true,
                 [] {
                   std::vector<int64_t> real(70, 2);
                   for (size_t b = 0; b < real.size(); b += 5) real[b] = b % 10 == 0 ? 1 : 0;
                   return real;
                 }()},
        // Independent selections: four rows' unions of up to 2052 blocks (129 tiles).
        StepCase{"r4_b70_independent_nb512", DType::kBF16, 800, step_rows(70, 4), 512,
                 Gate::kElementwise, 0.0},
        // Hkv = 4 at a group of 16 (no padding column): each step's two CTAs, the second on KV
        // heads 2 and 3.
        StepCase{"r4_b40_hkv4_group16_page64_nb256",
                 DType::kBF16,
                 64,
                 step_rows(40, 4),
                 256,
                 Gate::kPerHead,
                 0.9,
                 0,
                 false,
                 {},
                 false,
                 64,
                 4},
        // Duplicates in every third request, and requests of 3 and 5 rows (steps that span two
        // requests): those steps go to the gather kernel, the rest stay the step kernel's.
        StepCase{"r4_b70_duplicates_uneven_requests_nb128", DType::kBF16, 64,
                 [] {
                   std::vector<int64_t> rows = step_rows(70, 4);
                   for (size_t b = 0; b + 1 < rows.size(); b += 8) rows[b] = 3, rows[b + 1] = 5;
                   return rows;
                 }(),
                 128, Gate::kElementwise, 0.9, 3},
        // Token ids alone: steps the gather kernel takes row by row (the step kernel takes the
        // hint only).
        StepCase{"tokens_r4_b70_page64_nb512",
                 DType::kBF16,
                 64,
                 step_rows(70, 4),
                 512,
                 Gate::kElementwise,
                 0.9,
                 0,
                 false,
                 {},
                 true},
        StepCase{"tokens_r3_b140_fp16_page1600_duplicates",
                 DType::kF16,
                 1600,
                 step_rows(140, 3),
                 256,
                 Gate::kPerHead,
                 0.9,
                 4,
                 false,
                 {},
                 true},
        // Request 0 (1024 tokens, every block listed) loses its first page of 16 tokens.
        StepCase{"tokens_r2_b70_page16_hole_page_nb256",
                 DType::kBF16,
                 16,
                 step_rows(70, 2),
                 256,
                 Gate::kElementwise,
                 0.9,
                 0,
                 true,
                 {},
                 true},
        StepCase{"tokens_r4_b70_independent_nb512_padding_rows", DType::kBF16, 16, step_rows(70, 4),
                 512, Gate::kNone, 0.0, 0, false,
                 [] {
                   std::vector<int64_t> real(70, 4);
                   for (size_t b = 0; b < real.size(); b += 6) real[b] = b % 12 == 0 ? 2 : 0;
                   return real;
                 }(),
                 true}),
    [](const ::testing::TestParamInfo<StepCase>& info) { return info.param.name; });

// The step kernel and the gather kernel after it (the steps' flags in a pool workspace the graph
// owns) replay with the hint and token ids current at replay: new selections each time, with
// duplicate steps among them, so the flags change between replays.
TEST(GpuSparseAttentionStepGraph, ReplayReadsCurrentSelections) {
  SPARSE_ATTN_REQUIRE_GPU();
  auto rng = testing::make_rng();
  const StepCase sc{"graph", DType::kBF16, 64, step_rows(70, 4), 128, Gate::kPerHead, 0.9, 3};
  UnionCase uc{sc.name, sc.dtype, sc.page_size, sc.q_rows, {}, sc.nb, sc.gate, true};
  for (size_t b = 0; b < sc.q_rows.size(); ++b) {
    uc.k_lens.push_back(600 + 911 * static_cast<int64_t>(b) % 6000);
  }
  Problem pb = union_problem(uc, rng);
  const Tensor blocks = step_hint(pb, sc, rng);
  DeviceProblem dp = to_device_problem(pb, rng);
  Tensor db = to_device(blocks);
  dp.opts.block_indices = db.view();
  const testing::CapturedGraph captured = capture(dp);
  ASSERT_TRUE(captured.ok());
  for (int step = 0; step < 2; ++step) {
    StepCase next = sc;
    next.dup_every = step == 0 ? 2 : 5;
    const Tensor hint = step_hint(pb, next, rng);
    copy_into(dp.idx, pb.idx.view());
    copy_into(db.view(), hint.view());
    poison_device(dp.out);
    ASSERT_EQ(captured.replay(), cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    expect_matches(pb, dp, oracle(pb));
  }
}

}  // namespace
}  // namespace sparse_attn
