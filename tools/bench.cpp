// `sparse-attn bench`: the shared benchmark cases (include/sparse_attn/bench_cases.h), timed
// on the chosen device, as a table and as JSON lines, with TFLOP/s, TB/s and the ratio of the
// floor (the least time the work can take at the measured ceilings) to the measured time.
#include <fmt/format.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <numeric>
#include <sstream>

#include "commands.h"
#include "common.h"
#include "sparse_attn/bench_cases.h"
#include "sparse_attn/cpu.h"
#include "sparse_attn/dtype.h"
#include "sparse_attn/errors.h"
#include "sparse_attn/qsa.h"
#include "sparse_attn/qsa_select.h"
#include "sparse_attn/xattn.h"

namespace sparse_attn::cli {
namespace {

TensorView heads_first(const TensorView& t) {
  return t.as_strided({t.size(0), t.size(2), t.size(1), t.size(3)},
                      {t.stride(0), t.stride(2), t.stride(1), t.stride(3)});
}

// Memory ceiling: the best of three copies of a large buffer (bytes read + written / time).
double measure_bandwidth(Device dev) {
  const int64_t n = dev.is_cuda() ? (int64_t(1) << 28) : (int64_t(1) << 26);  // bytes
  const Tensor a = Tensor::empty({n / 4}, DType::kF32, dev),
               b = Tensor::empty({n / 4}, DType::kF32, dev);
  if (!dev.is_cuda()) std::memset(a.data(), 1, static_cast<size_t>(n));
  double best = INFINITY;
  for (int i = 0; i < 4; ++i) {
    Stopwatch sw;
    if (dev.is_cuda())
      copy_into(b, a);
    else
      std::memcpy(b.data(), a.data(), static_cast<size_t>(n));
    synchronize(b);
    if (i > 0) best = std::min(best, sw.seconds());
  }
  return 2.0 * double(n) / best;
}

struct Prepared {
  std::function<void(Backend)> call;
  TensorView sync_on;
  std::vector<Tensor> keep;  // inputs and outputs, alive while timing
  double kept_fraction = 1.0;
};

// Token selections the way the pipeline makes them: indexer scores, top-k, expansion (on the
// run's device and backend); rows in chunks so the score matrix stays small. Host results.
Tensor select_tokens(const Workload& w, int64_t k, const std::vector<int64_t>& positions_per_req,
                     Tensor* blocks_out, Device dev, BackendPolicy& policy) {
  const int64_t B = w.options.batch, Lq = w.options.query_len, NB = w.index_key.shape()[1];
  const int64_t width = 4 * k + 3, chunk = dev.is_cuda() ? 4096 : 1024;
  Tensor tokens = Tensor::empty({B, Lq, width}, DType::kI32);
  Tensor blocks = Tensor::empty({B, Lq, k}, DType::kI32);
  for (int64_t b = 0; b < B; ++b) {
    const Tensor ki = compressed_index_keys(w, b, dev, policy);
    for (int64_t r0 = 0; r0 < Lq; r0 += chunk) {
      const int64_t n = std::min(chunk, Lq - r0);
      std::vector<int64_t> pos(positions_per_req.begin() + r0, positions_per_req.begin() + r0 + n);
      const Tensor p = to_device(int32_row(pos), dev);
      const Tensor qi = to_device(Tensor::to_host(request(w.index_query, b).narrow(1, r0, n)), dev);
      const Tensor scores = Tensor::empty({1, n, NB}, DType::kF32, dev);
      policy.run("qsa_indexer_mqa_score", [&](Backend be) {
        IndexerScoreOptions io;
        io.query_positions = p.view();
        io.backend = be;
        qsa_indexer_mqa_score(qi, ki, scores, io);
      });
      const Tensor top = Tensor::empty({1, n, k}, DType::kI32, dev);
      qsa_topk_blocks(scores, k, top);
      const Tensor tok = Tensor::empty({1, n, width}, DType::kI32, dev);
      const Tensor blk = Tensor::empty({1, n, k}, DType::kI32, dev);
      qsa_expand_blocks(top, p, tok, blk.view());
      copy_into(request(tokens, b).narrow(1, r0, n), tok);
      copy_into(request(blocks, b).narrow(1, r0, n), blk);
    }
  }
  if (blocks_out) *blocks_out = blocks;
  return tokens;
}

Prepared prepare(const BenchCase& c, Device dev, BackendPolicy& policy) {
  WorkloadOptions wo = c.workload;
  wo.device = Device::cpu();
  const Workload w = make_workload(wo);
  const int64_t B = wo.batch, T = wo.seq_len, Lq = w.options.query_len;
  const int64_t Hq = wo.num_q_heads, Hkv = wo.num_kv_heads, D = wo.head_dim;
  Prepared p;
  auto dv = [&](const Tensor& t) {
    p.keep.push_back(to_device(t, dev));
    return p.keep.back();
  };
  switch (c.op) {
    case BenchOp::kIndexerPrefill: {
      const Tensor qi = dv(w.index_query), ki = dv(w.index_key);
      const Tensor out = dv(Tensor::empty({B, Lq, ki.shape()[1]}, DType::kF32));
      p.call = [=](Backend be) {
        IndexerScoreOptions io;
        io.backend = be;
        qsa_indexer_mqa_score(qi, ki, out, io);
      };
      p.sync_on = out;
      break;
    }
    case BenchOp::kIndexerDecode: {
      const int64_t nb = w.index_key.shape()[1], Di = wo.indexer_dim, ps = c.page_size;
      const int64_t ppr = (nb + ps - 1) / ps;
      Tensor cache = Tensor::empty({B * ppr, ps, 1, Di}, wo.dtype);
      std::memset(cache.data(), 0, cache.numel() * dtype_size(wo.dtype));
      Tensor table = Tensor::empty({B, ppr}, DType::kI32), lens = Tensor::empty({B}, DType::kI32);
      for (int64_t b = 0; b < B; ++b) {
        // Pages of a request are scattered (a reversed order), as in a long-running server.
        for (int64_t i = 0; i < ppr; ++i)
          table.data_as<int32_t>()[b * ppr + i] = int32_t((b + 1) * ppr - 1 - i);
        lens.data_as<int32_t>()[b] = int32_t(nb);
      }
      const Tensor q = dv(Tensor::to_host(w.index_query.view().select(1, 0)));
      const Tensor kc = dv(cache), pt = dv(table), cl = dv(lens);
      // The cache filled the way an engine fills it: each request's raw keys compressed
      // straight into its pages (the fused path, native on a GPU).
      for (int64_t b = 0; b < B; ++b) {
        compress_index_keys_into(w, b, kc, pt.view().narrow(0, b, 1), policy);
      }
      const Tensor out = dv(Tensor::empty({B, ppr * ps}, DType::kF32));
      const int64_t max_len = ppr * ps;
      p.call = [=](Backend be) {
        MqaScoreOptions mo;
        mo.backend = be;
        qsa_mqa_decode(q, kc, pt, cl, max_len, out, mo);
      };
      p.sync_on = out;
      break;
    }
    case BenchOp::kSparseDecode: {
      const int64_t ps = c.page_size, ppr = (T + ps - 1) / ps;
      const Tensor tokens = select_tokens(w, c.topk, {T - 1}, nullptr, dev, policy);
      Tensor kc = Tensor::empty({B * ppr, ps, Hkv, D}, wo.dtype);
      Tensor vc = Tensor::empty({B * ppr, ps, Hkv, D}, wo.dtype);
      std::memset(kc.data(), 0, kc.numel() * dtype_size(wo.dtype));
      std::memset(vc.data(), 0, vc.numel() * dtype_size(wo.dtype));
      Tensor table = Tensor::empty({B, ppr}, DType::kI32), lens = Tensor::empty({B}, DType::kI32);
      for (int64_t b = 0; b < B; ++b) {
        for (int64_t i = 0; i < ppr; ++i)
          table.data_as<int32_t>()[b * ppr + i] = int32_t((b + 1) * ppr - 1 - i);
        lens.data_as<int32_t>()[b] = int32_t(T);
        for (int64_t i = 0; i < ppr; ++i) {
          const int64_t n = std::min(ps, T - i * ps), page = (b + 1) * ppr - 1 - i;
          copy_into(kc.view().select(0, page).narrow(0, 0, n),
                    w.key.view().select(0, b).narrow(0, i * ps, n));
          copy_into(vc.view().select(0, page).narrow(0, 0, n),
                    w.value.view().select(0, b).narrow(0, i * ps, n));
        }
      }
      const Tensor q = dv(w.query), k = dv(kc), v = dv(vc), pt = dv(table), sl = dv(lens),
                   tok = dv(tokens);
      const Tensor out = dv(Tensor::empty(w.query.shape(), wo.dtype));
      p.call = [=](Backend be) {
        SparseAttentionOptions so;
        so.block_table = pt.view();
        so.seq_lens_k = sl.view();
        so.backend = be;
        qsa_sparse_attention(q, k, v, tok.view(), out, std::nullopt, so);
      };
      p.sync_on = out;
      break;
    }
    case BenchOp::kSparsePrefill: {
      std::vector<int64_t> pos(static_cast<size_t>(Lq));
      std::iota(pos.begin(), pos.end(), T - Lq);
      Tensor blocks;
      const Tensor tokens = select_tokens(w, c.topk, pos, &blocks, dev, policy);
      const Tensor q = dv(w.query), k = dv(w.key), v = dv(w.value), tok = dv(tokens),
                   blk = dv(blocks);
      const Tensor out = dv(Tensor::empty(w.query.shape(), wo.dtype));
      const int64_t topk = c.topk;
      p.call = [=](Backend be) {
        SparseAttentionOptions so;
        if (topk <= 512) so.block_indices = blk.view();
        so.backend = be;
        qsa_sparse_attention(q, k, v, tok.view(), out, std::nullopt, so);
      };
      p.sync_on = out;
      break;
    }
    case BenchOp::kXAttnEstimate:
    case BenchOp::kBlockSparse: {
      const Tensor q = dv(w.query), k = dv(w.key), v = dv(w.value);
      XAttnEstimateOptions eo;
      const Shape ms = xattn_estimate_shape(heads_first(q), heads_first(k), eo);
      const Tensor sums = dv(Tensor::empty(ms, DType::kF32)),
                   mask = dv(Tensor::empty(ms, DType::kBool));
      auto estimate = [=](Backend be) {
        XAttnEstimateOptions e;
        e.backend = be;
        xattn_estimate(heads_first(q), heads_first(k), sums, mask, e);
      };
      if (c.op == BenchOp::kXAttnEstimate) {
        p.call = estimate;
        p.sync_on = mask;
        break;
      }
      policy.run("xattn_estimate", estimate);
      const Tensor mh = Tensor::to_host(mask);
      int64_t kept = 0, causal = 0;
      const int64_t qb = ms[2], kb = ms[3];
      for (int64_t h = 0; h < ms[1]; ++h)
        for (int64_t i = 0; i < qb; ++i)
          for (int64_t j = 0; j <= std::min(kb - 1, i + (kb - qb)); ++j, ++causal)
            kept += mh.data_as<uint8_t>()[(h * qb + i) * kb + j];
      p.kept_fraction = double(kept) / double(std::max<int64_t>(causal, 1));
      std::vector<int64_t> cq, ck;
      for (int64_t b = 0; b <= B; ++b) cq.push_back(b * Lq), ck.push_back(b * T);
      const Tensor cu_q = dv(int32_row(cq)), cu_k = dv(int32_row(ck));
      const Tensor out = dv(Tensor::empty({B * Lq, Hq, D}, wo.dtype));
      p.call = [=](Backend be) {
        BlockSparseAttentionOptions ao;
        ao.backend = be;
        block_sparse_attention(q.view().as_strided({B * Lq, Hq, D}, {Hq * D, D, 1}),
                               k.view().as_strided({B * T, Hkv, D}, {Hkv * D, D, 1}),
                               v.view().as_strided({B * T, Hkv, D}, {Hkv * D, D, 1}),
                               cu_q.view().select(0, 0), cu_k.view().select(0, 0), mask.view(), Lq,
                               T, out, std::nullopt, ao);
      };
      p.sync_on = out;
      break;
    }
  }
  return p;
}

bool selected(const BenchCase& c, const std::string& spec, bool gpu) {
  if (spec == "default") return c.gpu_size == gpu;
  if (spec == "all") return true;
  std::stringstream ss(spec);
  std::string item;
  while (std::getline(ss, item, ','))
    if (!item.empty() && c.name.rfind(item, 0) == 0) return true;
  return false;
}

}  // namespace

CLI::App* add_bench_command(CLI::App& app, BenchOptions& o) {
  auto* b = app.add_subcommand(
      "bench",
      "Time the shared benchmark cases: a table on the terminal (time, TFLOP/s, TB/s, floor and "
      "floor/time) and, with --json, one JSON line per case");
  b->add_option("--cases", o.cases,
                "default (the GPU set with a GPU, the cpu/ set without), all, list, or "
                "comma-separated names or name prefixes (e.g. sparse-decode,cpu/)")
      ->capture_default_str();
  b->add_option("--json", o.json, "append one JSON object per case to this file");
  b->add_option("--warmup", o.warmup, "untimed runs per case")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  b->add_option("--reps", o.reps,
                "timed runs per case (the median is reported); 0: 10 on a GPU, "
                "1 on the CPU")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  b->add_option("--peak-tflops", o.peak_tflops,
                "compute ceiling for the floor; 0: measured on the CPU, the H100/H200 SXM "
                "BF16 dense spec (989 TFLOP/s) on a GPU")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  b->add_option("--peak-tbs", o.peak_tbs, "memory ceiling in TB/s; 0: measured (a large copy)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  return b;
}

int run_bench(const BenchOptions& o) {
  const auto cases = standard_bench_cases();
  if (o.cases == "list") {
    for (const auto& c : cases)
      std::printf("%-36s %-32s %s\n", c.name.c_str(), bench_op_name(c.op),
                  c.gpu_size ? "GPU set" : "CPU set");
    return 0;
  }
  const RunDevice rd = choose_device(o.device);
  const bool gpu = rd.device.is_cuda();
  std::vector<BenchCase> run;
  for (const auto& c : cases)
    if (selected(c, o.cases, gpu)) run.push_back(c);
  if (run.empty())
    throw ValueError(
        fmt::format("--cases: '{}' matches no case (--cases list shows them)", o.cases));
  BackendPolicy policy(o.backend, rd.device);
  const int64_t reps = o.reps > 0 ? o.reps : (gpu ? 10 : 1);

  const double bw = o.peak_tbs > 0 ? o.peak_tbs * 1e12 : measure_bandwidth(rd.device);
  const std::string bw_src = o.peak_tbs > 0 ? "--peak-tbs" : "measured: large copy";
  double peak = o.peak_tflops * 1e12;
  std::string peak_src = "--peak-tflops";
  if (peak <= 0 && gpu) {
    peak = 989e12;
    peak_src = "H100/H200 SXM BF16 dense spec, not measured; --peak-tflops overrides";
  } else if (peak <= 0) {
    peak = 2 * measure_cpu_fma_rate();
    peak_src = fmt::format("measured: FP32 fused multiply-adds ({}) on {} threads",
                           cpu_backend_isa(), omp_get_max_threads());
  }
  std::printf(
      "sparse-attn bench on %s; ceilings: %.3g TB/s (%s), %.3g TFLOP/s (%s); median of "
      "%lld runs after %lld warm-up\n",
      rd.why.c_str(), bw / 1e12, bw_src.c_str(), peak / 1e12, peak_src.c_str(),
      static_cast<long long>(reps), static_cast<long long>(o.warmup));
  std::printf("%-36s %-10s %12s %10s %10s %12s %10s\n", "case", "backend", "time", "TFLOP/s",
              "TB/s", "floor", "floor/time");

  std::ofstream json;
  if (!o.json.empty()) {
    json.open(o.json, std::ios::app);
    if (!json) throw ValueError(fmt::format("--json {}: cannot open for appending", o.json));
  }
  // GPU-size cases run natively or not at all: the reference at those sizes takes hours.
  BackendPolicy native_only(o.backend == "auto" ? "native" : o.backend, rd.device);
  for (const auto& c : run) {
    BackendPolicy& pol = gpu && c.gpu_size ? native_only : policy;
    Prepared p;
    try {
      p = prepare(c, rd.device, pol);
      if (gpu && c.gpu_size) pol.run(bench_op_name(c.op), p.call);
    } catch (const NotSupportedError& e) {
      std::printf("%-36s skipped: %s\n", c.name.c_str(), e.what());
      continue;
    }
    Backend used = Backend::kReference;
    for (int64_t i = 0; i < o.warmup; ++i) used = pol.run(bench_op_name(c.op), p.call);
    std::vector<double> times;
    Progress progress(c.name, reps, "runs");
    for (int64_t i = 0; i < reps; ++i) {
      Stopwatch sw;
      used = pol.run(bench_op_name(c.op), p.call);
      synchronize(p.sync_on);
      times.push_back(sw.seconds());
      progress.update(i + 1);
    }
    progress.finish();
    std::sort(times.begin(), times.end());
    const double t = times[times.size() / 2];
    const BenchWork work = bench_work(c, p.kept_fraction);
    const double floor = std::max(work.flops / peak, work.bytes / bw);
    std::printf("%-36s %-10s %12s %10.4g %10.4g %12s %9.1f%%\n", c.name.c_str(), backend_name(used),
                format_seconds(t).c_str(), work.flops / t / 1e12, work.bytes / t / 1e12,
                format_seconds(floor).c_str(), 100 * floor / t);
    if (json) {
      nlohmann::json j = {{"case", c.name},
                          {"op", bench_op_name(c.op)},
                          {"device", rd.device.str()},
                          {"backend", backend_name(used)},
                          {"time_s", t},
                          {"times_s", times},
                          {"flops", work.flops},
                          {"bytes", work.bytes},
                          {"tflops", work.flops / t / 1e12},
                          {"tbs", work.bytes / t / 1e12},
                          {"floor_s", floor},
                          {"floor_over_time", floor / t},
                          {"peak_tflops", peak / 1e12},
                          {"peak_tbs", bw / 1e12},
                          {"kept_fraction", p.kept_fraction}};
      json << j.dump() << '\n';
    }
  }
  for (const auto& n : policy.notes()) std::printf("note: %s\n", n.c_str());
  return 0;
}

}  // namespace sparse_attn::cli
