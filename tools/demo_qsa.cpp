// The QSA pipeline of the demo: indexer scores -> top-k blocks -> expansion to tokens -> sparse
// attention, timed per stage: on every query row on a GPU, on the evaluated rows on the CPU.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "demo.h"
#include "dense.h"
#include "sparse_attn/dtype.h"
#include "sparse_attn/errors.h"
#include "sparse_attn/qsa.h"
#include "sparse_attn/qsa_select.h"

namespace sparse_attn::cli {
namespace {

// Heatmap accumulators: kept and visible token counts per (row bin, key bin).
struct SelectionMap {
  SelectionMap(int64_t rows, int64_t keys)
      : row_bins(std::min<int64_t>(rows, 200)),
        key_bins(std::min<int64_t>(keys, 400)),
        rows_(rows),
        keys_(keys),
        kept(static_cast<size_t>(row_bins * key_bins), 0.0),
        visible(static_cast<size_t>(row_bins * key_bins), 0.0) {}
  int64_t row_bin(int64_t i) const { return i * row_bins / rows_; }
  int64_t key_bin(int64_t t) const { return t * key_bins / keys_; }
  int64_t row_bins, key_bins, rows_, keys_;
  std::vector<double> kept, visible;
};

// Whether the indexer and sparse attention run natively for this geometry (probed on one
// row): only then does the pipeline run every row; the reference at GPU sizes would take hours.
bool native_pipeline(const Workload& w, Device dev, int64_t k, BackendPolicy& policy) {
  const WorkloadOptions& o = w.options;
  const std::vector<int64_t> row = {o.query_len - 1};
  const Tensor pos = to_device(int32_row({o.seq_len - 1}), dev);
  const Tensor qi = to_device(gather_rows(w.index_query, 0, row), dev);
  const Tensor bkeys = compressed_index_keys(w, 0, dev, policy);
  const Tensor scores = Tensor::empty({1, 1, bkeys.shape()[1]}, DType::kF32, dev);
  const bool indexer = policy.native_supported("qsa_indexer_mqa_score", [&](Backend be) {
    IndexerScoreOptions io;
    io.query_positions = pos.view();
    io.backend = be;
    qsa_indexer_mqa_score(qi, bkeys, scores, io);
  });
  // A selection of the last 4k + 3 tokens is enough to probe the attention kernel.
  const int64_t width = 4 * k + 3;
  Tensor tok_h = Tensor::empty({1, 1, width}, DType::kI32);
  for (int64_t j = 0; j < width; ++j)
    tok_h.data_as<int32_t>()[j] = int32_t(std::max<int64_t>(-1, o.seq_len - 1 - j));
  const Tensor tok = to_device(tok_h, dev);
  const Tensor q = to_device(gather_rows(w.query, 0, row), dev);
  const Tensor key = to_device(Tensor::to_host(request(w.key, 0)), dev);
  const Tensor value = to_device(Tensor::to_host(request(w.value, 0)), dev);
  const Tensor out = Tensor::empty({1, 1, o.num_q_heads, o.head_dim}, o.dtype, dev);
  const bool attention = policy.native_supported("qsa_sparse_attention", [&](Backend be) {
    SparseAttentionOptions so;
    so.query_positions = pos.view();
    so.backend = be;
    qsa_sparse_attention(q, key, value, tok.view(), out, std::nullopt, so);
  });
  return indexer && attention;
}

}  // namespace

MethodResult run_qsa_demo(const DemoOptions& opt, const Workload& w, const RunDevice& rd,
                          BackendPolicy& policy) {
  const WorkloadOptions& o = w.options;
  if (o.indexer_heads == 0)
    throw ValueError("QSA needs the indexer's inputs: pass --index-q and --index-k");
  const Device dev = rd.device;
  const int64_t Lk = o.seq_len, Lq = o.query_len, Hq = o.num_q_heads, D = o.head_dim;
  const int64_t k = opt.topk, width = 4 * k + 3;
  const int64_t qoff = Lk - Lq;
  // Metrics on `eval` rows; the pipeline runs every row when every step runs natively (a GPU,
  // or the CPU backend), else only the eval rows.
  const std::vector<int64_t> eval = sample_rows(w, opt.rows >= 0 ? opt.rows : 64);
  const std::vector<int64_t> rows = native_pipeline(w, dev, k, policy) ? sample_rows(w, 0) : eval;
  const int64_t R = static_cast<int64_t>(rows.size()), E = static_cast<int64_t>(eval.size());
  const bool all_rows = R == Lq;
  // Rows per call: small for the reference on the CPU so the progress line moves, large on a
  // GPU.
  const int64_t chunk = dev.is_cuda() ? 4096 : (all_rows ? 256 : 8);

  MethodResult res;
  res.method = "QSA";
  res.geometry = fmt::format("{}/{}/{}, indexer {}x{}, top-{} blocks, {} keys", Hq, o.num_kv_heads,
                             D, o.indexer_heads, o.indexer_dim, k, format_size(Lk));
  res.rows_total = Lq * o.batch;
  res.scope = all_rows ? fmt::format("all {} query rows", format_size(Lq * o.batch))
                       : fmt::format("the {} evaluated query rows only", R * o.batch);
  double t_select = 0, t_attn = 0;
  std::string b_select, b_attn;
  double sel_total = 0, vis_total = 0, recall_sum = 0, err2 = 0, ref2 = 0;
  int64_t recall_n = 0;
  SelectionMap map(R, Lk);

  for (int64_t b = 0; b < o.batch; ++b) {
    const Tensor key = to_device(Tensor::to_host(request(w.key, b)), dev);
    const Tensor value = to_device(Tensor::to_host(request(w.value, b)), dev);
    // The request's compressed keys from its raw ones, as an engine's prefill makes them.
    const Tensor bkeys = compressed_index_keys(w, b, dev, policy);
    std::vector<int64_t> eval_pos(eval.size());
    for (size_t i = 0; i < eval.size(); ++i) eval_pos[i] = qoff + eval[i];
    const DenseRows dense(gather_rows(w.query, b, eval), request(w.key, b), request(w.value, b),
                          eval_pos, "dense attention (evaluation)");
    res.dense_seconds += dense.seconds();

    Progress progress("QSA pipeline", R, "rows");
    int64_t next_eval = 0;  // rows and eval are sorted: walk both
    for (int64_t c0 = 0; c0 < R; c0 += chunk) {
      const int64_t n = std::min(chunk, R - c0);
      const std::vector<int64_t> crow(rows.begin() + c0, rows.begin() + c0 + n);
      std::vector<int64_t> cpos(crow);
      for (int64_t& p : cpos) p += qoff;
      const Tensor qi = to_device(gather_rows(w.index_query, b, crow), dev);
      const Tensor q = to_device(gather_rows(w.query, b, crow), dev);
      const Tensor pos = to_device(int32_row(cpos), dev);
      const Tensor top = Tensor::empty({1, n, k}, DType::kI32, dev);
      const Tensor tokens = Tensor::empty({1, n, width}, DType::kI32, dev);
      const Tensor out = Tensor::empty({1, n, Hq, D}, o.dtype, dev);
      const Tensor lse = Tensor::empty({1, n, Hq}, DType::kF32, dev);

      // Scores, top-k and the expansion to token ids in one op, as an engine selects. The
      // selected blocks are all visible, so their ids are also the attention's block hint.
      Stopwatch sw;
      const Backend bi = policy.run("qsa_indexer_select", [&](Backend be) {
        IndexerScoreOptions io;
        io.query_positions = pos.view();
        io.backend = be;
        SelectOptions so;
        so.token_indices = tokens.view();
        qsa_indexer_select(qi, bkeys, k, top, io, so);
      });
      synchronize(tokens);
      t_select += sw.seconds();
      b_select = backend_name(bi);

      sw.start();
      // The block hint needs 1 <= k <= 512 (the seed's limit); wider selections go without.
      const Backend ba = policy.run("qsa_sparse_attention", [&](Backend be) {
        SparseAttentionOptions so;
        so.query_positions = pos.view();
        if (k <= 512) so.block_indices = top.view();
        so.backend = be;
        qsa_sparse_attention(q, key, value, tokens.view(), out, lse.view(), so);
      });
      synchronize(out);
      t_attn += sw.seconds();
      b_attn = backend_name(ba);

      const Tensor tok_h = Tensor::to_host(tokens);
      const Tensor out_h = Tensor::to_host(out);
      for (int64_t i = 0; i < n; ++i) {
        const int64_t p = cpos[i];
        const int32_t* ids = tok_h.data_as<int32_t>() + i * width;
        std::vector<int64_t> sel;
        for (int64_t j = 0; j < width; ++j)
          if (ids[j] >= 0 && ids[j] <= p) sel.push_back(ids[j]);
        if (b == 0) {
          const int64_t rb = map.row_bin(c0 + i);
          for (int64_t t = 0; t <= p; ++t) map.visible[rb * map.key_bins + map.key_bin(t)] += 1;
          for (int64_t t : sel) map.kept[rb * map.key_bins + map.key_bin(t)] += 1;
        }
        while (next_eval < E && eval[next_eval] < crow[i]) ++next_eval;
        if (next_eval == E || eval[next_eval] != crow[i]) continue;
        const int64_t r = next_eval;  // index into the dense rows
        // Metrics against the dense rows.
        sel_total += double(sel.size()) * Hq;
        vis_total += double(p + 1) * Hq;
        for (int64_t h = 0; h < Hq; ++h) {
          double m = 0;
          for (int64_t t : sel) m += dense.prob(r, h, t);
          recall_sum += m;
          ++recall_n;
          const float* ref = dense.out(r, h);
          for (int64_t d = 0; d < D; ++d) {
            const double got = load_as_float(out_h.data(), out_h.dtype(), (i * Hq + h) * D + d);
            err2 += (got - ref[d]) * (got - ref[d]);
            ref2 += double(ref[d]) * ref[d];
          }
        }
        for (const Needle& nd : w.needles)
          if (nd.batch == b && p >= nd.query_begin && p < nd.query_end) {
            ++res.needle_total;
            if (std::find(sel.begin(), sel.end(), nd.key_pos) != sel.end()) ++res.needle_hits;
          }
      }
      progress.update(c0 + n);
    }
    progress.finish();
  }

  res.rows_evaluated = E * o.batch;
  res.density = sel_total / std::max(vis_total, 1.0);
  res.recall = recall_sum / std::max<int64_t>(recall_n, 1);
  res.rel_error = std::sqrt(err2 / std::max(ref2, 1e-300));
  res.stages = {{fmt::format("indexer select: scores, top-k, tokens ({})", b_select), t_select},
                {fmt::format("sparse attention ({})", b_attn), t_attn}};
  res.dense_label = fmt::format("dense attention ({} evaluated rows, host loop)", E * o.batch);

  if (!opt.plot.empty()) {
    Heatmap hm;
    hm.rows = map.row_bins;
    hm.cols = map.key_bins;
    hm.value.resize(static_cast<size_t>(hm.rows * hm.cols));
    for (size_t i = 0; i < hm.value.size(); ++i)
      hm.value[i] = map.visible[i] > 0 ? float(map.kept[i] / map.visible[i]) : -1.f;
    for (const Needle& nd : w.needles) {
      if (nd.batch != 0) continue;
      for (int64_t r = 0; r < R; ++r) {
        const int64_t p = qoff + rows[r];
        if (p < nd.query_begin || p >= nd.query_end) continue;
        const int64_t cell = map.row_bin(r) * map.key_bins + map.key_bin(nd.key_pos);
        hm.marks.push_back({map.row_bin(r), map.key_bin(nd.key_pos), map.kept[cell] > 0});
      }
    }
    hm.header = {"QSA: tokens kept per query row",
                 res.geometry + (all_rows ? ", all rows" : fmt::format(", {} sampled rows", R)),
                 "blue: fraction of the key bin kept   grey: visible, dropped   white: future",
                 "rings: needles (green kept, red missed); ticks: needle keys"};
    hm.x_label = "key position";
    hm.y_label = "query";
    hm.x_first = "0";
    hm.x_last = std::to_string(Lk - 1);
    hm.y_first = fmt::format("row {}", qoff + rows.front());
    hm.y_last = fmt::format("row {}", qoff + rows.back());
    write_heatmap_png(opt.plot, hm);
    res.notes.push_back("wrote " + opt.plot);
  }
  return res;
}

}  // namespace sparse_attn::cli
