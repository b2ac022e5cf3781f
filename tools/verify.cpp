// `sparse-attn verify`: one backend (native by default) against the reference, on a workload of
// the shapes given, printing the worst differences and where they are.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <map>
#include <numeric>

#include "commands.h"
#include "common.h"
#include "sparse_attn/dtype.h"
#include "sparse_attn/errors.h"
#include "sparse_attn/qsa.h"
#include "sparse_attn/qsa_select.h"
#include "sparse_attn/xattn.h"

namespace sparse_attn::cli {
namespace {

std::string index_str(int64_t flat, const Shape& shape) {
  std::vector<int64_t> idx(shape.size());
  for (int i = static_cast<int>(shape.size()) - 1; i >= 0; --i) {
    idx[i] = flat % std::max<int64_t>(shape[i], 1);
    flat /= std::max<int64_t>(shape[i], 1);
  }
  return shape_str(idx);
}

double value_at(const Tensor& t, int64_t i) {
  switch (t.dtype()) {
    case DType::kI32:
      return t.data_as<int32_t>()[i];
    case DType::kI64:
      return double(t.data_as<int64_t>()[i]);
    case DType::kBool:
    case DType::kU8:
      return t.data_as<uint8_t>()[i];
    default:
      return load_as_float(t.data(), t.dtype(), i);
  }
}

// Prints how `got` differs from `want` (host copies of the same shape); true when within
// atol + rtol * |want| everywhere and infinities/NaNs sit at the same places.
bool compare(const std::string& name, const TensorView& got_v, const TensorView& want_v,
             double atol, double rtol, int64_t show, const char* backend) {
  const Tensor got = Tensor::to_host(got_v), want = Tensor::to_host(want_v);
  const int64_t n = got.numel();
  int64_t bad = 0, nonfinite_mismatch = 0;
  std::vector<std::pair<double, int64_t>> worst;  // (excess over tolerance, index)
  double max_abs = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double a = value_at(got, i), e = value_at(want, i);
    if (!std::isfinite(a) || !std::isfinite(e)) {
      const bool same = (std::isnan(a) && std::isnan(e)) || a == e;
      if (!same) {
        ++nonfinite_mismatch;
        ++bad;
        worst.push_back({INFINITY, i});
      }
      continue;
    }
    const double diff = std::abs(a - e);
    max_abs = std::max(max_abs, diff);
    const double excess = diff - (atol + rtol * std::abs(e));
    if (excess > 0) ++bad;
    worst.push_back({diff / (atol + rtol * std::abs(e)), i});
  }
  const size_t k = std::min<size_t>(static_cast<size_t>(std::max<int64_t>(show, 0)), worst.size());
  std::partial_sort(worst.begin(), worst.begin() + k, worst.end(),
                    [](const auto& x, const auto& y) { return x.first > y.first; });
  std::printf(
      "  %-8s %s %s: max |diff| %.3g; %lld of %lld outside atol %.0e + rtol %.0e; "
      "%lld inf/NaN position mismatches -> %s\n",
      name.c_str(), shape_str(got.shape()).c_str(), dtype_name(got.dtype()), max_abs,
      static_cast<long long>(bad), static_cast<long long>(n), atol, rtol,
      static_cast<long long>(nonfinite_mismatch), bad == 0 ? "OK" : "MISMATCH");
  for (size_t j = 0; j < k && worst[j].first > 0; ++j) {
    const int64_t i = worst[j].second;
    std::printf("      at %-22s %s %-12.6g reference %-12.6g (|diff| / tolerance %.3g)\n",
                index_str(i, got.shape()).c_str(), backend, value_at(got, i), value_at(want, i),
                worst[j].first);
  }
  return bad == 0;
}

double atol_for(DType d) { return d == DType::kF32 ? 1e-4 : 2e-2; }
double rtol_for(DType d) { return d == DType::kF32 ? 1e-4 : 2e-2; }

struct Setup {
  const VerifyOptions& o;
  Device dev;
  Backend under_test;
  DType dtype;
};

// Runs op(backend, outputs) for the backend under test and the reference into fresh outputs
// (poisoned with NaN first), then compares them.
bool check(const Setup& s, const std::string& op,
           const std::vector<std::pair<std::string, Shape>>& shapes,
           const std::vector<DType>& dtypes,
           const std::function<void(Backend, const std::vector<Tensor>&)>& run,
           const std::vector<double>& atol, const std::vector<double>& rtol) {
  auto make = [&](Device dev) {
    std::vector<Tensor> outs;
    for (size_t i = 0; i < shapes.size(); ++i) {
      Tensor host = Tensor::empty(shapes[i].second, dtypes[i]);
      if (dtypes[i] == DType::kF32 || dtypes[i] == DType::kBF16 || dtypes[i] == DType::kF16) {
        for (int64_t j = 0; j < host.numel(); ++j) store_from_float(host.data(), dtypes[i], j, NAN);
      } else {
        std::memset(host.data(), 0x7f, host.numel() * dtype_size(dtypes[i]));
      }
      outs.push_back(to_device(host, dev));
    }
    return outs;
  };
  std::printf("%s\n", op.c_str());
  const auto test_outs = make(s.dev);
  try {
    run(s.under_test, test_outs);
  } catch (const NotSupportedError& e) {
    std::printf("  %s backend unavailable: %s\n", backend_name(s.under_test), e.what());
    return false;
  }
  const auto ref_outs = make(s.dev);
  run(Backend::kReference, ref_outs);
  bool ok = true;
  for (size_t i = 0; i < shapes.size(); ++i)
    ok &= compare(shapes[i].first, test_outs[i], ref_outs[i], atol[i], rtol[i], s.o.show,
                  backend_name(s.under_test));
  return ok;
}

TensorView heads_first(const TensorView& t) {
  return t.as_strided({t.size(0), t.size(2), t.size(1), t.size(3)},
                      {t.stride(0), t.stride(2), t.stride(1), t.stride(3)});
}

}  // namespace

CLI::App* add_verify_command(CLI::App& app, VerifyOptions& o) {
  auto* v = app.add_subcommand(
      "verify",
      "Check a backend (native by default) against the reference on a structured workload of "
      "the given shapes; prints the worst differences and where they are; exit code 1 on a "
      "mismatch, 3 when the backend is unavailable");
  v->add_option(
       "--op", o.op,
       "qsa-indexer, qsa-attention, xattn-estimate, block-sparse, xattention-prefill or all")
      ->check(CLI::IsMember({"qsa-indexer", "qsa-attention", "xattn-estimate", "block-sparse",
                             "xattention-prefill", "all"}))
      ->capture_default_str();
  v->add_option("--seq-len", o.seq_len, "keys per request")
      ->transform(size_validator())
      ->default_str("4k");
  v->add_option("--q-len", o.query_len, "query rows per request (the last tokens)")
      ->transform(size_validator())
      ->default_str("256");
  v->add_option("--batch", o.batch, "requests")->check(CLI::PositiveNumber)->capture_default_str();
  v->add_option("--topk", o.topk, "QSA blocks per row")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  v->add_option("--threshold", o.threshold, "XAttention threshold")
      ->check(CLI::Range(0.0, 1.0))
      ->capture_default_str();
  v->add_option("--stride", o.stride, "XAttention stride")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  v->add_option("--dtype", o.dtype, "bf16, fp16 or fp32")
      ->check(CLI::IsMember({"bf16", "fp16", "fp32"}))
      ->capture_default_str();
  v->add_option("--mode", o.mode, "structured or random workload")
      ->check(CLI::IsMember({"structured", "random"}))
      ->capture_default_str();
  v->add_option("--seed", o.seed, "random seed")->capture_default_str();
  v->add_option("--show", o.show, "worst elements printed per output")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  v->add_option("--device", o.device, "auto, cpu, cuda or cuda:N")->capture_default_str();
  v->add_option("--backend", o.backend, "the backend under test: native or reference")
      ->check(CLI::IsMember({"native", "reference", "tilelang"}))
      ->capture_default_str();
  return v;
}

int run_verify(const VerifyOptions& o) {
  if (o.query_len < 1 || o.query_len > o.seq_len)
    throw ValueError(
        fmt::format("--q-len: expected 1 to --seq-len ({}), got {}", o.seq_len, o.query_len));
  const RunDevice rd = choose_device(o.device);
  const std::map<std::string, DType> dts = {
      {"bf16", DType::kBF16}, {"fp16", DType::kF16}, {"fp32", DType::kF32}};
  const Setup s{o, rd.device, parse_backend(o.backend), dts.at(o.dtype)};
  std::printf(
      "sparse-attn verify: %s against reference on %s; batch %lld, %s keys, %s query "
      "rows, %s, %s workload, seed %llu\n",
      backend_name(s.under_test), rd.why.c_str(), static_cast<long long>(o.batch),
      format_size(o.seq_len).c_str(), format_size(o.query_len).c_str(), o.dtype.c_str(),
      o.mode.c_str(), static_cast<unsigned long long>(o.seed));
  const bool all = o.op == "all";
  bool ok = true, unavailable = false;
  auto record = [&](bool r, bool ran) {
    ok &= r;
    unavailable |= !ran;
  };

  WorkloadOptions wo;
  wo.mode = parse_workload_mode(o.mode);
  wo.seed = o.seed;
  wo.batch = o.batch;
  wo.seq_len = o.seq_len;
  wo.query_len = o.query_len;
  wo.dtype = s.dtype;
  const int64_t B = o.batch, Lk = o.seq_len, Lq = o.query_len, qoff = Lk - Lq;
  Tensor pos_h = Tensor::empty({B, Lq}, DType::kI32);
  for (int64_t i = 0; i < B * Lq; ++i) pos_h.data_as<int32_t>()[i] = int32_t(qoff + i % Lq);

  if (all || o.op == "qsa-indexer" || o.op == "qsa-attention") {
    const Workload w = make_workload(wo);  // 24/2/256, indexer 4x128
    const Device dev = rd.device;
    const Tensor qi = to_device(w.index_query, dev), ki = to_device(w.index_key, dev);
    const Tensor pos = to_device(pos_h, dev);
    const int64_t NB = ki.shape()[1];
    if (all || o.op == "qsa-indexer") {
      bool ran = true;
      const bool r = check(s,
                           fmt::format("qsa_indexer_mqa_score  q_idx {}  block_keys {}",
                                       shape_str(qi.shape()), shape_str(ki.shape())),
                           {{"scores", {B, Lq, NB}}}, {DType::kF32},
                           [&](Backend be, const std::vector<Tensor>& out) {
                             IndexerScoreOptions io;
                             io.query_positions = pos.view();
                             io.backend = be;
                             try {
                               qsa_indexer_mqa_score(qi, ki, out[0], io);
                             } catch (const NotSupportedError&) {
                               ran = false;
                               throw;
                             }
                           },
                           {1e-3}, {1e-3});
      record(r, ran);
    }
    if (all || o.op == "qsa-attention") {
      // Selections from the reference indexer, as the pipeline makes them.
      const Tensor scores = Tensor::empty({B, Lq, NB}, DType::kF32);
      IndexerScoreOptions io;
      io.query_positions = pos_h.view();
      io.backend = Backend::kReference;
      qsa_indexer_mqa_score(w.index_query, w.index_key, scores, io);
      const Tensor top = Tensor::empty({B, Lq, o.topk}, DType::kI32);
      qsa_topk_blocks(scores, o.topk, top);
      const int64_t width = 4 * o.topk + 3;
      const Tensor tokens = Tensor::empty({B, Lq, width}, DType::kI32);
      qsa_expand_blocks(top, pos_h, tokens);
      const Tensor q = to_device(w.query, dev), k = to_device(w.key, dev),
                   v = to_device(w.value, dev), tok = to_device(tokens, dev);
      bool ran = true;
      const bool r = check(
          s,
          fmt::format("qsa_sparse_attention  query {}  key {}  token_indices {}",
                      shape_str(q.shape()), shape_str(k.shape()), shape_str(tok.shape())),
          {{"out", q.shape()}, {"lse", {B, Lq, w.options.num_q_heads}}}, {s.dtype, DType::kF32},
          [&](Backend be, const std::vector<Tensor>& out) {
            SparseAttentionOptions so;
            so.query_positions = pos.view();
            so.backend = be;
            try {
              qsa_sparse_attention(q, k, v, tok.view(), out[0], out[1].view(), so);
            } catch (const NotSupportedError&) {
              ran = false;
              throw;
            }
          },
          {atol_for(s.dtype), 1e-3}, {rtol_for(s.dtype), 1e-3});
      record(r, ran);
    }
  }

  if (all || o.op == "xattn-estimate" || o.op == "block-sparse" || o.op == "xattention-prefill") {
    WorkloadOptions xo = wo;
    xo.num_q_heads = 32, xo.num_kv_heads = 8, xo.head_dim = 128, xo.indexer_heads = 0;
    const Workload w = make_workload(xo);
    const Device dev = rd.device;
    const Tensor q = to_device(w.query, dev), k = to_device(w.key, dev),
                 v = to_device(w.value, dev);
    XAttnEstimateOptions eo;
    eo.threshold = o.threshold;
    eo.stride = o.stride;
    const Shape ms = xattn_estimate_shape(heads_first(q), heads_first(k), eo);
    if (all || o.op == "xattn-estimate") {
      bool ran = true;
      const bool r = check(s,
                           fmt::format("xattn_estimate  query {}  key {} (as [B, H, L, D])",
                                       shape_str(q.shape()), shape_str(k.shape())),
                           {{"sums", ms}, {"mask", ms}}, {DType::kF32, DType::kBool},
                           [&](Backend be, const std::vector<Tensor>& out) {
                             XAttnEstimateOptions e = eo;
                             e.backend = be;
                             try {
                               xattn_estimate(heads_first(q), heads_first(k), out[0], out[1], e);
                             } catch (const NotSupportedError&) {
                               ran = false;
                               throw;
                             }
                           },
                           {1e-4, 0}, {1e-3, 0});
      record(r, ran);
    }
    if (all || o.op == "block-sparse") {
      const Tensor sums = Tensor::empty(ms, DType::kF32), mask = Tensor::empty(ms, DType::kBool);
      XAttnEstimateOptions e = eo;
      e.backend = Backend::kReference;
      xattn_estimate(heads_first(w.query), heads_first(w.key), sums, mask, e);
      const int64_t Hq = xo.num_q_heads, Hkv = xo.num_kv_heads, D = xo.head_dim;
      std::vector<int64_t> cq, ck;
      for (int64_t b = 0; b <= B; ++b) cq.push_back(b * Lq), ck.push_back(b * Lk);
      const Tensor cu_q = to_device(int32_row(cq), dev), cu_k = to_device(int32_row(ck), dev);
      const Tensor mask_d = to_device(mask, dev);
      bool ran = true;
      const bool r =
          check(s,
                fmt::format("block_sparse_attention  q [{}, {}, {}]  k [{}, {}, {}]  mask {}",
                            B * Lq, Hq, D, B * Lk, Hkv, D, shape_str(ms)),
                {{"out", {B * Lq, Hq, D}}, {"lse", {B * Lq, Hq}}}, {s.dtype, DType::kF32},
                [&](Backend be, const std::vector<Tensor>& out) {
                  BlockSparseAttentionOptions ao;
                  ao.backend = be;
                  try {
                    block_sparse_attention(q.view().as_strided({B * Lq, Hq, D}, {Hq * D, D, 1}),
                                           k.view().as_strided({B * Lk, Hkv, D}, {Hkv * D, D, 1}),
                                           v.view().as_strided({B * Lk, Hkv, D}, {Hkv * D, D, 1}),
                                           cu_q.view().select(0, 0), cu_k.view().select(0, 0),
                                           mask_d.view(), Lq, Lk, out[0], out[1].view(), ao);
                  } catch (const NotSupportedError&) {
                    ran = false;
                    throw;
                  }
                },
                {atol_for(s.dtype), 1e-3}, {rtol_for(s.dtype), 1e-3});
      record(r, ran);
    }
    if (all || o.op == "xattention-prefill") {
      const int64_t Hq = xo.num_q_heads, D = xo.head_dim;
      bool ran = true;
      const bool r =
          check(s,
                fmt::format("xattention_prefill  query {}  key/value {} (as [B, H, L, D])",
                            shape_str(q.shape()), shape_str(k.shape())),
                {{"sums", ms}, {"mask", ms}, {"out", {B, Hq, Lq, D}}, {"lse", {B, Hq, Lq}}},
                {DType::kF32, DType::kBool, s.dtype, DType::kF32},
                [&](Backend be, const std::vector<Tensor>& out) {
                  XAttnPrefillOptions po;
                  static_cast<XAttnEstimateOptions&>(po) = eo;
                  po.backend = be;
                  try {
                    xattention_prefill(heads_first(q), heads_first(k), heads_first(v), out[0],
                                       out[1], out[2], out[3].view(), po);
                  } catch (const NotSupportedError&) {
                    ran = false;
                    throw;
                  }
                },
                {1e-4, 0, atol_for(s.dtype), 1e-3}, {1e-3, 0, rtol_for(s.dtype), 1e-3});
      record(r, ran);
    }
  }
  if (unavailable) {
    std::printf("result: the %s backend is unavailable for some ops (see above)%s\n",
                backend_name(s.under_test),
                rd.device.is_cuda() ? "" : "; native kernels need a CUDA build and a GPU");
    return 3;
  }
  std::printf("result: %s\n", ok ? "all outputs match the reference" : "MISMATCH (see above)");
  return ok ? 0 : 1;
}

}  // namespace sparse_attn::cli
