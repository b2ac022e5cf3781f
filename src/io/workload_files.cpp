// A workload from users' tensor files: shapes checked against each other, names in messages.
#include <fmt/format.h>

#include <cstring>

#include "sparse_attn/errors.h"
#include "sparse_attn/io.h"

namespace sparse_attn {
namespace {

// Loads a floating tensor of rank `rank`, or rank - 1 (then a batch axis of 1 is added).
Tensor load_batched(const std::string& spec, int rank, std::string_view layout) {
  Tensor t = load_tensor(spec);
  if (t.dtype() != DType::kBF16 && t.dtype() != DType::kF16 && t.dtype() != DType::kF32)
    throw TypeError(
        fmt::format("{}: expected a floating tensor (bfloat16, float16, float32), got "
                    "{}",
                    spec, dtype_name(t.dtype())));
  if (int(t.shape().size()) == rank - 1) {
    Shape s = t.shape();
    s.insert(s.begin(), 1);
    Tensor b = Tensor::empty(s, t.dtype());
    std::memcpy(b.data(), t.data(), t.numel() * dtype_size(t.dtype()));
    return b;
  }
  if (int(t.shape().size()) != rank)
    throw ValueError(fmt::format("{}: expected shape {} (or without the batch axis), got {}", spec,
                                 layout, shape_str(t.shape())));
  return t;
}

void expect(bool ok, const std::string& spec, std::string_view what, int64_t want, int64_t got) {
  if (!ok) throw ValueError(fmt::format("{}: {} must be {}, got {}", spec, what, want, got));
}

Tensor to_device(Tensor host, Device device) {
  if (!device.is_cuda()) return host;
  Tensor t = Tensor::empty(host.shape(), host.dtype(), device);
  copy_into(t.view(), host.view());
  return t;
}

}  // namespace

Workload load_workload(const WorkloadFiles& files, Device device) {
  if (files.query.empty() || files.key.empty() || files.value.empty())
    throw ValueError("load_workload: query, key and value files are all required");
  if (files.index_query.empty() != files.index_key.empty())
    throw ValueError(
        "load_workload: give both indexer files (index_query and index_key) or "
        "neither");
  Workload w;
  w.query = load_batched(files.query, 4, "[B, Lq, Hq, D]");
  w.key = load_batched(files.key, 4, "[B, Lk, Hkv, D]");
  w.value = load_batched(files.value, 4, "[B, Lk, Hkv, D]");
  const Shape q = w.query.shape(), k = w.key.shape(), v = w.value.shape();
  if (w.key.dtype() != w.query.dtype() || w.value.dtype() != w.query.dtype())
    throw TypeError(fmt::format("{} ({}), {} ({}), {} ({}): query, key and value need one dtype",
                                files.query, dtype_name(w.query.dtype()), files.key,
                                dtype_name(w.key.dtype()), files.value,
                                dtype_name(w.value.dtype())));
  expect(k[0] == q[0], files.key, "the batch size (shape[0]) of the query", q[0], k[0]);
  expect(k[2] >= 1 && q[2] % k[2] == 0, files.key,
         fmt::format("a divisor of the query's {} heads: KV heads (shape[2])", q[2]), q[2], k[2]);
  expect(k[3] == q[3], files.key, "the query's head dim (shape[3])", q[3], k[3]);
  if (v != k)
    throw ValueError(fmt::format("{}: value shape {} must equal the key's {}", files.value,
                                 shape_str(v), shape_str(k)));
  expect(q[1] <= k[1], files.query, "at most the key length: query rows (shape[1])", k[1], q[1]);
  expect(q[1] >= 1 && k[1] >= 1, files.query, "at least 1: query and key lengths", 1,
         std::min(q[1], k[1]));

  WorkloadOptions& o = w.options;
  o.batch = q[0];
  o.seq_len = k[1];
  o.query_len = q[1];
  o.num_q_heads = q[2];
  o.num_kv_heads = k[2];
  o.head_dim = q[3];
  o.dtype = w.query.dtype();
  o.device = device;
  o.indexer_heads = 0;
  o.num_sinks = 0;
  o.num_needles = 0;

  if (!files.index_query.empty()) {
    w.index_query = load_batched(files.index_query, 4, "[B, Lq, Hi, Di]");
    Tensor ik = load_batched(files.index_key, 3, "[B, Lk / 4, Di] or [B, Lk, Di]");
    const Shape iq = w.index_query.shape(), ks = ik.shape();
    expect(iq[0] == q[0] && iq[1] == q[1], files.index_query,
           "the query's [B, Lq] in shape[0:2]: the same rows", q[0] * q[1], iq[0] * iq[1]);
    expect(ks[0] == q[0], files.index_key, "the query's batch size (shape[0])", q[0], ks[0]);
    expect(ks[2] == iq[3], files.index_key, "the indexer query's dim (shape[2])", iq[3], ks[2]);
    o.indexer_heads = iq[2];
    o.indexer_dim = iq[3];
    if (ks[1] == k[1] && k[1] / o.indexer_block != k[1]) {
      // The model's compression with what a file does not hold: w = 0, the default
      // rope_theta, RoPE on the first half of the dims (as the generator's).
      w.index_key = Tensor::empty({ks[0], k[1] / o.indexer_block, ks[2]}, ik.dtype());
      compress_index_keys(ik.view(), w.index_key.view(), o.rope_theta, (ks[2] / 2) & ~int64_t{1});
    } else if (ks[1] == k[1] / o.indexer_block) {
      w.index_key = ik;
    } else {
      throw ValueError(
          fmt::format("{}: shape[1] must be the key length {} (raw keys) or {} "
                      "(compressed, one per {} tokens), got {}",
                      files.index_key, k[1], k[1] / o.indexer_block, o.indexer_block, ks[1]));
    }
    w.index_query = to_device(w.index_query, device);
    w.index_key = to_device(w.index_key, device);
  }
  w.query = to_device(w.query, device);
  w.key = to_device(w.key, device);
  w.value = to_device(w.value, device);
  return w;
}

}  // namespace sparse_attn
