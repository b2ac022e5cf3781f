// The XAttention pipeline of the demo: antidiagonal estimation with threshold selection
// (xattn_estimate), then block-sparse attention over the kept 128x128 blocks.
//
// All rows (a native pipeline: a GPU or the CPU backend; or --rows all): one estimate over the
// whole prompt and one varlen block_sparse_attention call; metrics on sampled rows. Sampled
// (the reference on the CPU): the estimate
// runs per sampled query block as a prefill chunk against all earlier keys, which gives exactly
// the whole prompt's mask rows (docs/xattention.md), and attention runs only on a short run of
// rows per block, each run one sequence over the shared K/V pages
// (block_sparse_attention_paged).
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <set>

#include "demo.h"
#include "dense.h"
#include "sparse_attn/dtype.h"
#include "sparse_attn/errors.h"
#include "sparse_attn/xattn.h"

namespace sparse_attn::cli {
namespace {

constexpr int64_t kBlock = 128;

// [B, L, H, D] -> the [B, H, L, D] view XAttention takes (no copy).
TensorView heads_first(const TensorView& t) {
  return t.as_strided({t.size(0), t.size(2), t.size(1), t.size(3)},
                      {t.stride(0), t.stride(2), t.stride(1), t.stride(3)});
}

// K/V of request b as pages of 128 tokens [pages, 128, Hkv, D] (zero-padded tail).
Tensor pages_of(const TensorView& host, int64_t b) {
  const int64_t L = host.size(1), H = host.size(2), D = host.size(3);
  const int64_t pages = (L + kBlock - 1) / kBlock;
  Tensor t = Tensor::empty({pages, kBlock, H, D}, host.dtype());
  std::memset(t.data(), 0, static_cast<size_t>(t.numel()) * dtype_size(t.dtype()));
  copy_into(t.view().as_strided({1, L, H, D}, {0, H * D, D, 1}), request(host, b));
  return t;
}

// Whether estimation and block-sparse attention run natively for this geometry (probed on
// the first query block): only then do whole-prompt calls run; the reference at GPU sizes
// would take hours.
bool native_pipeline(const Workload& w, Device dev, const DemoOptions& opt, BackendPolicy& policy) {
  const WorkloadOptions& o = w.options;
  const int64_t m = std::min(kBlock, o.query_len), Hq = o.num_q_heads, Hkv = o.num_kv_heads,
                D = o.head_dim;
  const int64_t end = o.seq_len - o.query_len + m;
  const Tensor q = to_device(Tensor::to_host(request(w.query, 0).narrow(1, 0, m)), dev);
  const Tensor k = to_device(Tensor::to_host(request(w.key, 0).narrow(1, 0, end)), dev);
  const Tensor v = to_device(Tensor::to_host(request(w.value, 0).narrow(1, 0, end)), dev);
  const int64_t kbs = (end + kBlock - 1) / kBlock;
  const Tensor sums = Tensor::empty({1, Hq, 1, kbs}, DType::kF32, dev);
  const Tensor mask = Tensor::empty({1, Hq, 1, kbs}, DType::kBool, dev);
  const bool estimate = policy.native_supported("xattn_estimate", [&](Backend be) {
    XAttnEstimateOptions e;
    e.threshold = opt.threshold;
    e.stride = opt.stride;
    e.backend = be;
    xattn_estimate(heads_first(q), heads_first(k), sums, mask, e);
  });
  const Tensor cu_q = to_device(int32_row({0, m}), dev), cu_k = to_device(int32_row({0, end}), dev);
  const Tensor out = Tensor::empty({m, Hq, D}, o.dtype, dev);
  const Tensor ones_h = Tensor::empty({1, Hq, 1, kbs}, DType::kBool);
  std::memset(ones_h.data(), 1, static_cast<size_t>(ones_h.numel()));
  const Tensor ones = to_device(ones_h, dev);
  const bool attention = policy.native_supported("block_sparse_attention", [&](Backend be) {
    BlockSparseAttentionOptions ao;
    ao.backend = be;
    block_sparse_attention(q.view().as_strided({m, Hq, D}, {Hq * D, D, 1}),
                           k.view().as_strided({end, Hkv, D}, {Hkv * D, D, 1}),
                           v.view().as_strided({end, Hkv, D}, {Hkv * D, D, 1}),
                           cu_q.view().select(0, 0), cu_k.view().select(0, 0), ones.view(), m, end,
                           out, std::nullopt, ao);
  });
  return estimate && attention;
}

}  // namespace

MethodResult run_xattn_demo(const DemoOptions& opt, const Workload& w, const RunDevice& rd,
                            BackendPolicy& policy) {
  const WorkloadOptions& o = w.options;
  const Device dev = rd.device;
  const int64_t Lk = o.seq_len, Lq = o.query_len, Hq = o.num_q_heads, Hkv = o.num_kv_heads,
                D = o.head_dim, B = o.batch, qoff = Lk - Lq;
  const int64_t qb = (Lq + kBlock - 1) / kBlock, kb = (Lk + kBlock - 1) / kBlock;
  // Whole-prompt calls when both steps run natively (a GPU, or the CPU backend), with --rows
  // all, or when chunks could not start on a block boundary of the prompt (then they would not
  // reproduce its mask rows exactly).
  const bool full = native_pipeline(w, dev, opt, policy) || opt.rows == 0 || qoff % kBlock != 0;

  // Evaluated rows. Sampled mode: query blocks evenly spaced (ending with the last) plus each
  // needle's block, and in each a contiguous run of rows (the needle rows, else the last 8),
  // so each block is one short sequence in the attention call.
  std::vector<int64_t> qblocks, rows;
  std::vector<std::pair<int64_t, int64_t>> runs;  // [first, last] row of each block's run
  if (full) {
    rows = sample_rows(w, opt.rows >= 0 ? opt.rows : 64);
    for (int64_t r : rows) qblocks.push_back(r / kBlock);
    qblocks.erase(std::unique(qblocks.begin(), qblocks.end()), qblocks.end());
  } else {
    const int64_t even = std::min(qb, opt.rows > 0 ? std::max<int64_t>(1, opt.rows / 8) : 6);
    std::set<int64_t> chosen;
    for (int64_t i = 0; i < even; ++i) chosen.insert(qb - 1 - i * qb / even);
    for (const Needle& n : w.needles)
      chosen.insert(((n.query_begin + n.query_end) / 2 - qoff) / kBlock);
    for (int64_t blk : chosen) {
      const int64_t first = blk * kBlock, last = std::min(Lq, first + kBlock) - 1;
      int64_t lo = std::max(first, last - 7), hi = last;
      bool needle = false;
      for (const Needle& n : w.needles) {
        const int64_t mid = (n.query_begin + n.query_end) / 2 - qoff;
        if (mid < first || mid > last) continue;
        lo = needle ? std::min(lo, mid - 2) : mid - 2;
        hi = needle ? std::max(hi, mid + 2) : mid + 2;
        needle = true;
      }
      lo = std::max(lo, first), hi = std::min(hi, last);
      qblocks.push_back(blk);
      runs.push_back({lo, hi});
      for (int64_t r = lo; r <= hi; ++r) rows.push_back(r);
    }
  }
  const int64_t R = static_cast<int64_t>(rows.size());

  XAttnEstimateOptions eo;
  eo.threshold = opt.threshold;
  eo.stride = opt.stride;
  eo.keep_sink = opt.keep_sink;

  MethodResult res;
  res.method = "XAttention";
  res.geometry =
      fmt::format("{}/{}/{}, block {}, stride {}, threshold {}{}, {} keys", Hq, Hkv, D, kBlock,
                  opt.stride, opt.threshold, opt.keep_sink ? ", keep_sink" : "", format_size(Lk));
  res.rows_total = Lq * B;
  double t_est = 0, t_attn = 0;
  std::string b_est, b_attn;
  double sel_total = 0, vis_total = 0, recall_sum = 0, err2 = 0, ref2 = 0;
  double ideal_tokens = 0, ideal_recall_sum = 0, same_budget_sum = 0;
  int64_t recall_n = 0;

  // Plot of request 0: rows = evaluated query blocks, cells = fraction of heads keeping.
  std::vector<int64_t> plot_blocks;
  std::vector<float> plot_value;

  for (int64_t b = 0; b < B; ++b) {
    std::vector<int64_t> positions(rows.size());
    for (size_t i = 0; i < rows.size(); ++i) positions[i] = qoff + rows[i];
    const DenseRows dense(gather_rows(w.query, b, rows), request(w.key, b), request(w.value, b),
                          positions, "dense attention (evaluation)");
    res.dense_seconds += dense.seconds();

    // mask_rows[i]: bool [Hq, kb] of query block qblocks[i], on the host.
    std::vector<std::vector<uint8_t>> mask_rows(qblocks.size());
    Tensor out_rows;  // [R, Hq, D] host: the sparse output of the evaluated rows
    const Tensor key_d = to_device(Tensor::to_host(request(w.key, b)), dev);
    const Tensor val_d = to_device(Tensor::to_host(request(w.value, b)), dev);

    if (full) {
      res.scope = fmt::format("all {} query rows", format_size(Lq * B));
      const Tensor q_d = to_device(Tensor::to_host(request(w.query, b)), dev);
      const Tensor sums = Tensor::empty({1, Hq, qb, kb}, DType::kF32, dev);
      const Tensor mask = Tensor::empty({1, Hq, qb, kb}, DType::kBool, dev);
      Stopwatch sw;
      b_est = backend_name(policy.run("xattn_estimate", [&](Backend be) {
        XAttnEstimateOptions e = eo;
        e.backend = be;
        xattn_estimate(heads_first(q_d), heads_first(key_d), sums, mask, e);
      }));
      synchronize(mask);
      t_est += sw.seconds();

      const Tensor cu_q = to_device(int32_row({0, Lq}), dev);
      const Tensor cu_k = to_device(int32_row({0, Lk}), dev);
      const Tensor out = Tensor::empty({Lq, Hq, D}, o.dtype, dev);
      const TensorView q3 = q_d.view().as_strided({Lq, Hq, D}, {Hq * D, D, 1});
      const TensorView k3 = key_d.view().as_strided({Lk, Hkv, D}, {Hkv * D, D, 1});
      const TensorView v3 = val_d.view().as_strided({Lk, Hkv, D}, {Hkv * D, D, 1});
      sw.start();
      b_attn = backend_name(policy.run("block_sparse_attention", [&](Backend be) {
        BlockSparseAttentionOptions ao;
        ao.backend = be;
        block_sparse_attention(q3, k3, v3, cu_q.view().select(0, 0), cu_k.view().select(0, 0),
                               mask.view(), Lq, Lk, out, std::nullopt, ao);
      }));
      synchronize(out);
      t_attn += sw.seconds();

      const Tensor mask_h = Tensor::to_host(mask);
      for (size_t i = 0; i < qblocks.size(); ++i) {
        mask_rows[i].resize(static_cast<size_t>(Hq * kb));
        for (int64_t h = 0; h < Hq; ++h)
          for (int64_t j = 0; j < kb; ++j)
            mask_rows[i][h * kb + j] = mask_h.data_as<uint8_t>()[(h * qb + qblocks[i]) * kb + j];
      }
      out_rows = gather_rows(
          Tensor::to_host(out).view().as_strided({1, Lq, Hq, D}, {0, Hq * D, D, 1}), 0, rows);
    } else {
      res.scope = fmt::format(
          "estimate: {} sampled query blocks of {}; attention: their {} "
          "evaluated rows",
          qblocks.size() * B, qb * B, R * B);
      Progress progress("XAttention estimate", static_cast<int64_t>(qblocks.size()), "blocks");
      for (size_t i = 0; i < qblocks.size(); ++i) {
        const int64_t r0 = qblocks[i] * kBlock, m = std::min(kBlock, Lq - r0);
        const int64_t end = qoff + r0 + m, kbi = (end + kBlock - 1) / kBlock;
        const Tensor q_d = to_device(Tensor::to_host(request(w.query, b).narrow(1, r0, m)), dev);
        const Tensor sums = Tensor::empty({1, Hq, 1, kbi}, DType::kF32, dev);
        const Tensor mask = Tensor::empty({1, Hq, 1, kbi}, DType::kBool, dev);
        Stopwatch sw;
        b_est = backend_name(policy.run("xattn_estimate", [&](Backend be) {
          XAttnEstimateOptions e = eo;
          e.backend = be;
          xattn_estimate(heads_first(q_d), heads_first(key_d.view().narrow(1, 0, end)), sums, mask,
                         e);
        }));
        synchronize(mask);
        t_est += sw.seconds();
        const Tensor mask_h = Tensor::to_host(mask);
        mask_rows[i].assign(static_cast<size_t>(Hq * kb), 0);
        for (int64_t h = 0; h < Hq; ++h)
          for (int64_t j = 0; j < kbi; ++j)
            mask_rows[i][h * kb + j] = mask_h.data_as<uint8_t>()[h * kbi + j];
        progress.update(static_cast<int64_t>(i + 1));
      }
      progress.finish();

      // One sequence per block run over the shared K/V pages: q rows = the run, keys = all
      // keys up to the run's last row (bottom-right alignment puts the rows at their places).
      const int64_t S = static_cast<int64_t>(runs.size());
      const Tensor kp = to_device(pages_of(w.key, b), dev);
      const Tensor vp = to_device(pages_of(w.value, b), dev);
      const int64_t pages = kp.shape()[0];
      Tensor table = Tensor::empty({S, pages}, DType::kI32);
      Tensor seqlens = Tensor::empty({S}, DType::kI32);
      Tensor cu_q = Tensor::empty({S + 1}, DType::kI32);
      Tensor bmask = Tensor::empty({S, Hq, 1, kb}, DType::kBool);
      int64_t max_k = 0, max_q = 0;
      cu_q.data_as<int32_t>()[0] = 0;
      for (int64_t i = 0; i < S; ++i) {
        for (int64_t p = 0; p < pages; ++p) table.data_as<int32_t>()[i * pages + p] = int32_t(p);
        const int64_t klen = qoff + runs[i].second + 1, qlen = runs[i].second - runs[i].first + 1;
        seqlens.data_as<int32_t>()[i] = int32_t(klen);
        cu_q.data_as<int32_t>()[i + 1] = cu_q.data_as<int32_t>()[i] + int32_t(qlen);
        max_k = std::max(max_k, klen);
        max_q = std::max(max_q, qlen);
        std::copy(mask_rows[i].begin(), mask_rows[i].end(), bmask.data_as<uint8_t>() + i * Hq * kb);
      }
      const int64_t kb_max = (max_k + kBlock - 1) / kBlock;
      const Tensor bmask_d = to_device(Tensor::to_host(bmask.view().narrow(3, 0, kb_max)), dev);
      const Tensor q_d = to_device(gather_rows(w.query, b, rows), dev);
      const Tensor out = Tensor::empty({R, Hq, D}, o.dtype, dev);
      const Tensor table_d = to_device(table, dev), seqlens_d = to_device(seqlens, dev),
                   cu_q_d = to_device(cu_q, dev);
      Stopwatch sw;
      b_attn = backend_name(policy.run("block_sparse_attention_paged", [&](Backend be) {
        BlockSparseAttentionOptions ao;
        ao.backend = be;
        block_sparse_attention_paged(q_d.view().select(0, 0), kp, vp, table_d, seqlens_d, cu_q_d,
                                     bmask_d.view(), max_q, max_k, out, std::nullopt, ao);
      }));
      synchronize(out);
      t_attn += sw.seconds();
      out_rows = Tensor::to_host(out);
    }

    // True block masses of the evaluated rows: bm[(r * Hq + h) * kb + j] is the dense softmax
    // mass of key block j (the keys of it the row sees), every row-head in parallel.
    std::vector<double> bm(static_cast<size_t>(R * Hq * kb), 0.0);
#pragma omp parallel for schedule(dynamic)
    for (int64_t rh = 0; rh < R * Hq; ++rh) {
      const int64_t r = rh / Hq, h = rh % Hq, p = positions[r];
      for (int64_t t = 0; t <= p; ++t) bm[rh * kb + t / kBlock] += dense.prob(r, h, t);
    }

    // Metrics on the evaluated rows, and beside them the ideal selections of the same rows.
    std::vector<int64_t> order;
    for (int64_t r = 0; r < R; ++r) {
      const int64_t p = positions[r];
      const size_t bi =
          std::lower_bound(qblocks.begin(), qblocks.end(), rows[r] / kBlock) - qblocks.begin();
      const uint8_t* mrow = mask_rows[bi].data();
      const int64_t seen = p / kBlock + 1;  // key blocks the row sees
      const auto block_tokens = [&](int64_t j) {
        return std::min(p, (j + 1) * kBlock - 1) - j * kBlock + 1;
      };
      for (int64_t h = 0; h < Hq; ++h) {
        const double* mass = &bm[(r * Hq + h) * kb];
        double m = 0;
        int64_t kept = 0, kept_blocks = 0;
        for (int64_t j = 0; j < seen; ++j) {
          if (!mrow[h * kb + j]) continue;
          kept += block_tokens(j);
          ++kept_blocks;
          m += mass[j];
        }
        sel_total += double(kept);
        vis_total += double(p + 1);
        recall_sum += m;
        ++recall_n;
        // Ideal: blocks by descending true mass until the threshold's share of it is kept (the
        // row's mass is 1); and the best kept_blocks blocks, the estimate's budget spent ideally.
        order.resize(static_cast<size_t>(seen));
        for (int64_t j = 0; j < seen; ++j) order[j] = j;
        std::stable_sort(order.begin(), order.end(),
                         [&](int64_t x, int64_t y) { return mass[x] > mass[y]; });
        double c = 0;
        for (int64_t i = 0; i < seen && c < opt.threshold; ++i) {
          ideal_tokens += double(block_tokens(order[i]));
          c += mass[order[i]];
        }
        ideal_recall_sum += c;
        double best = 0;
        for (int64_t i = 0; i < kept_blocks; ++i) best += mass[order[i]];
        same_budget_sum += best;
        const float* ref = dense.out(r, h);
        for (int64_t d = 0; d < D; ++d) {
          const double got = load_as_float(out_rows.data(), out_rows.dtype(), (r * Hq + h) * D + d);
          err2 += (got - ref[d]) * (got - ref[d]);
          ref2 += double(ref[d]) * ref[d];
        }
        for (const Needle& nd : w.needles)
          if (nd.batch == b && p >= nd.query_begin && p < nd.query_end) {
            ++res.needle_total;
            if (mrow[h * kb + nd.key_pos / kBlock]) ++res.needle_hits;
          }
      }
    }
    if (b == 0) {
      plot_blocks = qblocks;
      for (size_t i = 0; i < qblocks.size(); ++i) {
        const int64_t last = qoff + std::min(Lq, (qblocks[i] + 1) * kBlock) - 1;
        for (int64_t j = 0; j < kb; ++j) {
          if (j * kBlock > last) {
            plot_value.push_back(-1.f);
            continue;
          }
          int64_t n = 0;
          for (int64_t h = 0; h < Hq; ++h) n += mask_rows[i][h * kb + j];
          plot_value.push_back(float(n) / float(Hq));
        }
      }
    }
  }

  res.rows_evaluated = R * B;
  res.density = sel_total / std::max(vis_total, 1.0);
  res.recall = recall_sum / std::max<int64_t>(recall_n, 1);
  res.rel_error = std::sqrt(err2 / std::max(ref2, 1e-300));
  const double n = double(std::max<int64_t>(recall_n, 1));
  res.ideal = IdealSelection{opt.threshold, ideal_tokens / std::max(vis_total, 1.0),
                             ideal_recall_sum / n, same_budget_sum / n};
  res.stages = {{fmt::format("estimate + select ({})", b_est), t_est},
                {fmt::format("block-sparse attention ({})", b_attn), t_attn}};
  res.dense_label = fmt::format("dense attention ({} evaluated rows, host loop)", R * B);

  if (!opt.plot.empty()) {
    Heatmap hm;
    hm.rows = static_cast<int64_t>(plot_blocks.size());
    hm.cols = kb;
    hm.value = plot_value;
    for (const Needle& nd : w.needles) {
      if (nd.batch != 0) continue;
      for (size_t i = 0; i < plot_blocks.size(); ++i) {
        const int64_t first = qoff + plot_blocks[i] * kBlock,
                      last = qoff + std::min(Lq, (plot_blocks[i] + 1) * kBlock) - 1;
        if (last < nd.query_begin || first >= nd.query_end) continue;
        const int64_t j = nd.key_pos / kBlock;
        hm.marks.push_back({int64_t(i), j, hm.value[i * kb + j] > 0});
      }
    }
    hm.header = {
        "XAttention: kept 128x128 blocks",
        res.geometry + (full ? ", all query blocks"
                             : fmt::format(", {} sampled query blocks", plot_blocks.size())),
        fmt::format("blue: fraction of the {} heads keeping the block   white: future", Hq),
        "rings: needles (green kept by some head, red by none); ticks: needle key blocks"};
    hm.x_label = "key block";
    hm.y_label = "query";
    hm.x_first = "0";
    hm.x_last = std::to_string(kb - 1);
    hm.y_first = fmt::format("block {}", plot_blocks.front());
    hm.y_last = fmt::format("block {}", plot_blocks.back());
    write_heatmap_png(opt.plot, hm);
    res.notes.push_back("wrote " + opt.plot);
  }
  return res;
}

}  // namespace sparse_attn::cli
