// Benchmarks of native qsa_sparse_attention (issue 7, item 5), canonical 24/2/256 BF16, paged
// K/V with page size 64, pages scattered over the pool:
//   decode: B = 1, 8, 32, 128 requests, contexts uniform in [8K, 128K], one query row each,
//     2051-token selections (512 four-token blocks among the visible ones, plus the tail);
//     _32k rows: every request 32K tokens long (issue 15's comparison); _page1600 rows: pages
//     of 1600 tokens (an engine's large pages); _32k_nb1024 / _32k_nb2048 rows: top-1024 and
//     top-2048 selections (4099 / 8195 token ids) at 32K; _32k_g8 rows: a group of 8 query
//     heads a KV head (16/2) at 32K.
//     Floor: the selected K/V rows read once, plus Q, O, the element-wise gate and the
//     indices, at the copy ceiling measured in the same run. Each decode row is timed twice:
//     eager (the call between the two events, host work included: validation, workspace,
//     launches while the GPU idles) and graph (the call captured once into a CUDA graph and
//     replayed, as an engine replays its decode step: the GPU time of the kernels). Rates and
//     floor% use the graph time; floor% (eager) is next to it. Every batch runs with the
//     heuristic split count, with a caller-owned workspace (_ws: no pool allocation in the
//     call or the graph), and with explicit split counts (_s<N>, graph-timed), for the
//     heuristic. The _fp8 rows repeat the batches with FP8 e4m3 K/V (half the bytes); _hint
//     rows pass the blocks as block_indices too (the gather kernel, its SplitKV in clusters;
//     _hint_s<N> rows with explicit split counts). _phys rows pass the ids as physical rows of
//     the flattened cache (selected_kv_indices: an engine that expands its selection into
//     cache slots), with no request or page-table lookups and no gate. _r2 and _r4 rows:
//     multi-token decode steps, 2 or 4 query rows a request at consecutive positions whose
//     selections share 90% of their blocks (token path and _hint), graph-timed and eager with
//     the heuristic; floor: the union's bytes.
//     _fp8_f16q rows: FP8 K/V under FP16 queries (the widening's cost against _fp8). _b2b rows
//     (B = 1, 8): 20 calls back to back in one graph, the time a call (code and metadata in
//     L2, no launch gap; at these batches the K/V bytes fit L2 too). decode_b128_fp8_hint_b2b:
//     the same at B = 128, whose 272 MB of K/V do not fit L2: a layer after layer's steady state.
//   prefill: one request of 16K, 64K, 128K tokens, every row attending to its 2051-token
//     structured selection: the 64 most recent complete blocks plus the 448 most important
//     older ones under a fixed per-block importance, so neighbouring rows share most blocks
//     (the mean Jaccard of consecutive rows' block sets is printed). The useful FLOP rate
//     counts valid selected tokens only: 4 * tokens * Hq * D per row. 128K runs twice: token
//     path, and structured path (block_indices hint). The token path runs the gather kernel,
//     the hint the union kernel (tiles whose union it cannot hold: the gather kernel). Dense
//     cuDNN causal attention of the same shape is bench/sdpa_baseline.py's (same device call);
//     bench/qsa_prefill_bench.py times issue 13's selections against it in one process.
//   prefill_16k_random: 16K rows of uniformly random selections (little sharing between
//     rows). prefill_16k_{structured,random}_g8: the 16K rows at a group of 8 (16/2 heads).
//   prefill_<n>k_indexer: the same timing over selections made the way an engine makes them,
//     on the device: the structured workload's indexer inputs, native qsa_mqa_prefill, native
//     top-512 and native expansion (their times are in the note; only the attention call is
//     the row's time). 128K runs twice: token path and block hint (_hint).
//   phys_prefill_<n>k_structured: the structured selections at 1K, 4K and 16K rows passed as
//     physical rows of the flattened cache (selected_kv_indices), the form an engine holds
//     after expanding its selection into cache slots; no page table, no hint.
// Usage: qsa_sparse_attention_bench [results.csv]. Prints each row as it is measured.
// BENCH_ONLY=<prefix> runs the rows whose name starts with it (for a profiler run);
// BENCH_SWEEP=0 leaves out the explicit split-count rows.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "bench_util.h"
#include "sparse_attn/qsa.h"
#include "sparse_attn/qsa_select.h"
#include "sparse_attn/workload.h"

using namespace sparse_attn;
using namespace sparse_attn::bench;

namespace {

constexpr int64_t kHq = 24, kHkv = 2, kD = 256, kPage = 64, kBlocks = 512, kRecent = 64;
constexpr int64_t kWidth = 4 * kBlocks + 3;

struct Result {
  std::string name;
  double ms;        // eager call; 0 where only the graph was timed
  double graph_ms;  // graph replay; 0 where not timed
  double tflops;    // useful: valid selected tokens only (graph time where measured)
  double tbps;      // counted bytes over time (graph time where measured)
  double floor_ms;  // HBM floor (decode); 0 where the floor is not a byte count
  std::string note;
};

Tensor int32_device(const std::vector<int32_t>& v, const Shape& shape) {
  Tensor h = Tensor::empty(shape, DType::kI32);
  std::copy(v.begin(), v.end(), h.data_as<int32_t>());
  Tensor d = Tensor::empty(shape, DType::kI32, Device::cuda());
  copy_into(d.view(), h.view());
  return d;
}

// A device tensor of random values for multi-GB caches: one 64 MB random block (made on the
// host) copied through it, which takes seconds less than drawing every element on the host.
// Repeated contents do not change a gather's speed; zeros could (METHOD.md).
Tensor random_pool(const Shape& shape, uint64_t seed, DType dtype = DType::kBF16) {
  constexpr int64_t kBlock = int64_t{1} << 25;  // elements
  Tensor t = Tensor::empty(shape, dtype, Device::cuda());
  const int64_t n = t.numel();
  const size_t es = dtype_size(dtype);
  Tensor block = random_device({std::min(n, kBlock)}, dtype, seed);
  for (int64_t at = 0; at < n; at += kBlock) {
    BENCH_CUDA(cudaMemcpy(static_cast<char*>(t.data()) + at * es, block.data(),
                          std::min(kBlock, n - at) * es, cudaMemcpyDeviceToDevice));
  }
  return t;
}

// Writes the token row (`width` ids) of a block selection: 4b..4b+3 per block, the tail
// 4*((p+1)/4)..p, valid ids first, -1 after. Returns the number of valid ids.
int64_t expand(const std::vector<int32_t>& blocks, int64_t p, int32_t* row,
               int64_t width = kWidth) {
  int64_t n = 0;
  for (int32_t b : blocks)
    for (int j = 0; j < 4; ++j) row[n++] = 4 * b + j;
  for (int64_t t = 4 * ((p + 1) / 4); t <= p; ++t) row[n++] = static_cast<int32_t>(t);
  std::fill(row + n, row + width, -1);
  return n;
}

// The physical rows of the flattened cache [pool * page] that a [rows, width] token-id matrix
// names (-1 stays -1); row r belongs to request r / rows_per_request of the page table.
std::vector<int32_t> physical_ids(const std::vector<int32_t>& ids, const Pages& pg, int64_t page,
                                  int64_t rows_per_request, int64_t width = kWidth) {
  std::vector<int32_t> phys(ids.size(), -1);
  for (size_t i = 0; i < ids.size(); ++i) {
    const int32_t* table_row = pg.table.data() + (i / width / rows_per_request) * pg.max_pages;
    const int32_t t = ids[i];
    if (t >= 0) phys[i] = static_cast<int32_t>(table_row[t / page] * page + t % page);
  }
  return phys;
}

// Decode runs of one batch: split counts, 0 = the heuristic's count.
struct DecodeRun {
  int splits;
  bool eager;         // also time the eager call
  bool workspace;     // pass a caller-owned workspace (no pool allocation in the call or graph)
  bool hint = false;  // pass the 512 blocks as block_indices too (rows named _hint)
  // Graph-time 20 calls back to back instead of one, L2 flushed before each replay only (rows
  // named _b2b): the call's cost with its code, metadata and (small batches) K/V in L2 and no
  // launch gap, against the flushed single replay's.
  bool back_to_back = false;
  // Pass the token ids as physical rows of the flattened cache (selected_kv_indices), the form
  // an engine that expands its selection into cache slots holds (rows named _phys): no request,
  // page-table or gate reads, so no gate in the output or the floor.
  bool physical = false;
};

// kv: K/V element type, bfloat16 or FP8 e4m3 (k_scale 1/64, v_scale 1/128; rows named _fp8).
// rows_per_request R > 1: a multi-token step (speculative tokens, MTP; rows named _r<R>): row i
// of request b sits at position len_b - R + i and keeps 90% of row 0's blocks, its other 10%
// drawn from the blocks it sees that row 0 did not pick. The floor counts the union of a
// request's selected tokens once (a kernel that shares them reads no more).
// qdtype: the query's (and out's, gate's) type; FP16 rows are named _f16q.
// The K/V geometry: `page` tokens a page, and every request `context` tokens long (0: uniform
// in [8K, 128K]); `blocks` selected a row (top-k, 4 * blocks + 3 token ids); `hq` query heads
// over the kHkv KV heads; `shape` names rows of another geometry than the default's.
struct DecodeGeometry {
  std::string shape;
  int64_t page = kPage;
  int64_t context = 0;
  int64_t blocks = kBlocks;
  int64_t hq = kHq;
};

void bench_decode(Timer& timer, const Ceilings& c, int64_t batch, DType kv,
                  const std::vector<DecodeRun>& runs, const std::function<void(Result)>& add,
                  int64_t rows_per_request = 1, DType qdtype = DType::kBF16,
                  const DecodeGeometry& geometry = {}) {
  const int64_t R = rows_per_request, rows = batch * R, page = geometry.page;
  const int64_t nb = geometry.blocks, width = 4 * nb + 3, hq = geometry.hq;
  std::mt19937_64 rng(100 + batch);
  std::uniform_int_distribution<int64_t> ctx(8192, 131072);
  std::vector<int64_t> lens(batch);
  for (auto& l : lens) l = geometry.context > 0 ? geometry.context : ctx(rng);
  const Pages pg = make_pages(lens, page, rng);
  std::vector<int32_t> ids(rows * width), hint(rows * nb, -1), pos(rows);
  int64_t valid = 0, distinct = 0;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t p = lens[b] - R, visible = (p + 1) / 4;
    std::vector<int32_t> all(visible);
    std::iota(all.begin(), all.end(), 0);
    std::shuffle(all.begin(), all.end(), rng);
    const std::vector<int32_t> rest(all.begin() + std::min<int64_t>(nb, visible), all.end());
    all.resize(std::min<int64_t>(nb, visible));
    std::vector<int32_t> tokens;  // the request's selected tokens, every row's
    for (int64_t i = 0; i < R; ++i) {
      std::vector<int32_t> mine = all;
      if (i > 0) {
        // 10% of row 0's blocks (its last ones after a shuffle) replaced by blocks row 0 left.
        std::shuffle(mine.begin(), mine.end(), rng);
        const int64_t swap = std::min<int64_t>(static_cast<int64_t>(mine.size()) / 10,
                                               static_cast<int64_t>(rest.size()));
        std::vector<int32_t> pick = rest;
        std::shuffle(pick.begin(), pick.end(), rng);
        std::copy(pick.begin(), pick.begin() + swap, mine.end() - swap);
      }
      std::sort(mine.begin(), mine.end());
      const int64_t r = b * R + i;
      pos[r] = static_cast<int32_t>(p + i);
      std::copy(mine.begin(), mine.end(), hint.begin() + r * nb);
      const int64_t n = expand(mine, p + i, &ids[r * width], width);
      valid += n;
      tokens.insert(tokens.end(), ids.begin() + r * width, ids.begin() + r * width + n);
    }
    std::sort(tokens.begin(), tokens.end());
    distinct += std::unique(tokens.begin(), tokens.end()) - tokens.begin();
  }
  std::vector<int32_t> lens32(lens.begin(), lens.end()), cu(batch + 1);
  for (int64_t b = 0; b <= batch; ++b) cu[b] = static_cast<int32_t>(b * R);
  Tensor q = random_device({rows, hq, kD}, qdtype, 1);
  Tensor gate = random_device({rows, hq, kD}, qdtype, 2);
  Tensor k = random_pool({pg.pool, page, kHkv, kD}, 3, kv);
  Tensor v = random_pool({pg.pool, page, kHkv, kD}, 4, kv);
  Tensor idx = int32_device(ids, {rows, width});
  Tensor phys_idx = int32_device(physical_ids(ids, pg, page, R, width), {rows, width});
  Tensor blocks = int32_device(hint, {rows, nb});
  Tensor table = int32_device(pg.table, {batch, pg.max_pages});
  Tensor dl = int32_device(lens32, {batch}), dcu = int32_device(cu, {batch + 1});
  Tensor dpos = int32_device(pos, {rows});
  Tensor out = Tensor::empty({rows, hq, kD}, qdtype, Device::cuda());
  Tensor lse = Tensor::empty({rows, hq}, DType::kF32, Device::cuda());
  const bool fp8 = kv == DType::kF8E4M3;
  const double bytes = 2.0 * distinct * kHkv * kD * dtype_size(kv) + 3.0 * rows * hq * kD * 2 +
                       4.0 * rows * width + 4.0 * rows * hq;
  const TensorView k_rows(k.view().data(), kv, Device::cuda(), {pg.pool * page, kHkv, kD});
  const TensorView v_rows(v.view().data(), kv, Device::cuda(), {pg.pool * page, kHkv, kD});
  for (const DecodeRun& run : runs) {
    SparseAttentionOptions o;
    if (run.physical) {
      o.selected_kv_indices = phys_idx.view();
    } else {
      o.block_table = table.view();
      o.seq_lens_k = dl.view();
      o.cu_seqlens_q = dcu.view();
      if (R > 1) o.query_positions = dpos.view();
      o.gate = gate.view();
    }
    const TensorView& kc = run.physical ? k_rows : k.view();
    const TensorView& vc = run.physical ? v_rows : v.view();
    const std::optional<TensorView> token_ids =
        run.physical ? std::nullopt : std::optional<TensorView>(idx.view());
    if (fp8) {
      o.k_scale = 1.0 / 64;
      o.v_scale = 1.0 / 128;
    }
    if (run.splits > 0) o.num_splits = run.splits;
    if (run.hint) o.block_indices = blocks.view();
    Tensor workspace;
    if (run.workspace) {
      const size_t ws = qsa_sparse_attention_workspace_size(q, kc, vc, token_ids, o);
      workspace = Tensor::empty({std::max<int64_t>(1, static_cast<int64_t>(ws))}, DType::kU8,
                                Device::cuda());
      if (ws > 0) o.workspace = workspace.view();
    }
    auto call = [&](cudaStream_t s) {
      o.stream = s;
      qsa_sparse_attention(q, kc, vc, token_ids, out, lse.view(), o);
    };
    const double eager_ms = run.eager ? timer.time(call).median_ms : 0.0;
    const double graph_ms = run.back_to_back ? timer.time_graph_back_to_back(call).median_ms
                                             : timer.time_graph(call).median_ms;
    const double sec = graph_ms * 1e-3;
    const double run_bytes = bytes - (run.physical ? 2.0 * rows * hq * kD : 0.0);  // less the gate
    add({fmt::format("decode_b{}{}{}{}{}{}{}{}{}{}", batch, geometry.shape,
                     R > 1 ? fmt::format("_r{}", R) : "", fp8 ? "_fp8" : "",
                     qdtype == DType::kF16 ? "_f16q" : "", run.hint ? "_hint" : "",
                     run.splits > 0 ? fmt::format("_s{}", run.splits) : "",
                     run.physical ? "_phys" : "", run.workspace ? "_ws" : "",
                     run.back_to_back ? "_b2b" : ""),
         eager_ms, graph_ms, 4.0 * valid * hq * kD / sec / 1e12, run_bytes / sec / 1e12,
         run_bytes / (c.copy_tbps * 1e12) * 1e3,
         fmt::format("{} splits, {}lse{}",
                     run.splits > 0 ? fmt::format("{}", run.splits) : "heuristic",
                     run.physical ? "physical ids, " : "gate, ",
                     run.workspace ? ", caller workspace" : "")});
  }
}

// A prefill selection on the device, one row per token of the request.
struct PrefillSelection {
  Tensor idx;        // int32 [tokens, kWidth]
  Tensor blocks;     // int32 [tokens, kBlocks], the block_indices hint
  double valid = 0;  // valid token ids over all rows
  double jaccard = 1;
  std::string note;  // what made it
};

// Jaccard index of two sorted block sets.
double jaccard_of(const std::vector<int32_t>& a, const std::vector<int32_t>& b) {
  std::vector<int32_t> inter;
  std::set_intersection(a.begin(), a.end(), b.begin(), b.end(), std::back_inserter(inter));
  return double(inter.size()) / double(a.size() + b.size() - inter.size());
}

// Synthetic selections made on the host: structured (recent blocks plus a fixed importance
// order) or uniformly random.
PrefillSelection synthetic_selection(int64_t tokens, bool structured) {
  std::mt19937_64 rng(7 + tokens);
  const int64_t nblocks = tokens / 4;
  // Importance order of blocks: a fixed random permutation (first = most important).
  std::vector<int32_t> order(nblocks);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  std::vector<int32_t> ids(tokens * kWidth), hint_blocks(tokens * kBlocks, -1);
  std::vector<int32_t> blocks, prev;
  PrefillSelection sel;
  double jaccard = 0;
  int64_t jaccard_rows = 0;
  for (int64_t p = 0; p < tokens; ++p) {
    const int64_t visible = (p + 1) / 4;
    blocks.clear();
    if (visible <= kBlocks) {
      for (int32_t b = 0; b < visible; ++b) blocks.push_back(b);
    } else if (structured) {
      for (int64_t b = visible - kRecent; b < visible; ++b)
        blocks.push_back(static_cast<int32_t>(b));
      for (size_t i = 0; i < order.size() && static_cast<int64_t>(blocks.size()) < kBlocks; ++i)
        if (order[i] < visible - kRecent) blocks.push_back(order[i]);
    } else {
      std::uniform_int_distribution<int64_t> pick(0, visible - 1);
      std::vector<char> taken(visible, 0);
      while (static_cast<int64_t>(blocks.size()) < kBlocks) {
        const int64_t b = pick(rng);
        if (!taken[b]) {
          taken[b] = 1;
          blocks.push_back(static_cast<int32_t>(b));
        }
      }
    }
    std::sort(blocks.begin(), blocks.end());
    if (visible > kBlocks && p % 97 == 0 && !prev.empty()) {
      jaccard += jaccard_of(blocks, prev);
      ++jaccard_rows;
    }
    prev = blocks;
    std::copy(blocks.begin(), blocks.end(), &hint_blocks[p * kBlocks]);
    sel.valid += double(expand(blocks, p, &ids[p * kWidth]));
  }
  sel.idx = int32_device(ids, {tokens, kWidth});
  sel.blocks = int32_device(hint_blocks, {tokens, kBlocks});
  sel.jaccard = jaccard_rows ? jaccard / jaccard_rows : 1.0;
  sel.note = structured ? "structured" : "random";
  return sel;
}

// Selections as a serving engine makes them, all on the device: the structured workload's
// indexer inputs (include/sparse_attn/workload.h: sinks, heavy hitters, needles, local
// segments), native qsa_mqa_prefill scores of each row against the complete blocks before it,
// native top-512 and native expansion. Rows go through the indexer and top-k in chunks so the
// FP32 score matrix stays at most 2 GB. The pipeline runs twice; the second run's stages are
// timed with events (sums over the chunks) and reported in the note.
PrefillSelection indexer_selection(Timer& timer, int64_t tokens) {
  WorkloadOptions wo;  // structured, seed 0, indexer 4 x 128 over 4-token blocks
  wo.seq_len = tokens;
  // The indexer inputs have their own projections and noise streams and do not depend on the
  // attention geometry, so a 1-head, 2-dim attention part gives the same ones without drawing
  // the 24/2/256 Q/K/V on the host; the timed attention reads random pools (values do not
  // change its speed).
  wo.num_q_heads = 1;
  wo.num_kv_heads = 1;
  wo.head_dim = 2;
  wo.device = Device::cuda();
  const Workload w = make_workload(wo);
  const int64_t nb = w.index_key.shape()[1];
  const TensorView q = w.index_query.view().select(0, 0);  // [tokens, 4, 128]
  const TensorView k = w.index_key.view().select(0, 0);    // [nb, 128]
  // Row p (position p) sees the complete blocks [0, (p + 1) / 4).
  std::vector<int32_t> starts(tokens, 0), ends(tokens), pos(tokens);
  for (int64_t p = 0; p < tokens; ++p) {
    ends[p] = static_cast<int32_t>((p + 1) / 4);
    pos[p] = static_cast<int32_t>(p);
  }
  const Tensor d_starts = int32_device(starts, {tokens});
  const Tensor d_ends = int32_device(ends, {tokens});
  const Tensor d_pos = int32_device(pos, {tokens});
  const int64_t chunk = std::min<int64_t>(tokens, 16384);
  const Tensor scores = Tensor::empty({chunk, nb}, DType::kF32, Device::cuda());
  const Tensor top = Tensor::empty({tokens, kBlocks}, DType::kI32, Device::cuda());
  PrefillSelection sel;
  sel.idx = Tensor::empty({tokens, kWidth}, DType::kI32, Device::cuda());
  sel.blocks = Tensor::empty({tokens, kBlocks}, DType::kI32, Device::cuda());

  const cudaStream_t s = timer.stream();
  cudaEvent_t ev[4];
  for (cudaEvent_t& e : ev) BENCH_CUDA(cudaEventCreate(&e));
  const auto elapsed = [](cudaEvent_t a, cudaEvent_t b) {
    float ms = 0;
    BENCH_CUDA(cudaEventSynchronize(b));
    BENCH_CUDA(cudaEventElapsedTime(&ms, a, b));
    return double(ms);
  };
  double score_ms = 0, topk_ms = 0, expand_ms = 0;
  for (int run = 0; run < 2; ++run) {
    score_ms = topk_ms = 0;
    for (int64_t r0 = 0; r0 < tokens; r0 += chunk) {
      const int64_t n = std::min(chunk, tokens - r0);
      const TensorView sc = scores.view().narrow(0, 0, n);
      MqaScoreOptions so;
      so.stream = s;
      BENCH_CUDA(cudaEventRecord(ev[0], s));
      qsa_mqa_prefill(q.narrow(0, r0, n), k, d_starts.view().narrow(0, r0, n),
                      d_ends.view().narrow(0, r0, n), sc, so);
      BENCH_CUDA(cudaEventRecord(ev[1], s));
      qsa_topk_blocks(sc, kBlocks, top.view().narrow(0, r0, n), s);
      BENCH_CUDA(cudaEventRecord(ev[2], s));
      score_ms += elapsed(ev[0], ev[1]);
      topk_ms += elapsed(ev[1], ev[2]);
    }
    BENCH_CUDA(cudaEventRecord(ev[2], s));
    qsa_expand_blocks(top, d_pos, sel.idx, sel.blocks.view(), s);
    BENCH_CUDA(cudaEventRecord(ev[3], s));
    expand_ms = elapsed(ev[2], ev[3]);
  }
  for (cudaEvent_t e : ev) BENCH_CUDA(cudaEventDestroy(e));

  // Valid ids and the consecutive-row Jaccard of the kept block sets, from the hint.
  const Tensor hb = Tensor::to_host(sel.blocks.view());
  std::vector<int32_t> blocks, prev;
  double jaccard = 0;
  int64_t jaccard_rows = 0;
  for (int64_t p = 0; p < tokens; ++p) {
    const int32_t* row = hb.data_as<int32_t>() + p * kBlocks;
    blocks.assign(row, std::find(row, row + kBlocks, -1));
    std::sort(blocks.begin(), blocks.end());
    sel.valid += double(4 * blocks.size() + (p + 1) % 4);
    if (p / 4 > kBlocks) {  // this row and the previous one have full selections
      jaccard += jaccard_of(blocks, prev);
      ++jaccard_rows;
    }
    prev = blocks;
  }
  sel.jaccard = jaccard_rows ? jaccard / jaccard_rows : 1.0;
  sel.note = fmt::format(
      "indexer selection (native indexer {:.2f} ms, top-k {:.2f} ms, expansion {:.2f} ms)",
      score_ms, topk_ms, expand_ms);
  return sel;
}

// Times qsa_sparse_attention alone over a selection: token path, with the block hint, or as
// physical rows of the flattened cache.
Result time_prefill(Timer& timer, int64_t tokens, const PrefillSelection& sel, bool hint,
                    const std::string& name, bool physical = false, int64_t hq = kHq) {
  std::mt19937_64 rng(11 + tokens);
  const std::vector<int64_t> lens{tokens};
  const Pages pg = make_pages(lens, kPage, rng);
  Tensor q = random_pool({tokens, hq, kD}, 5);
  Tensor k = random_pool({pg.pool, kPage, kHkv, kD}, 6);
  Tensor v = random_pool({pg.pool, kPage, kHkv, kD}, 7);
  Tensor table = int32_device(pg.table, {1, pg.max_pages});
  Tensor out = Tensor::empty({tokens, hq, kD}, DType::kBF16, Device::cuda());
  SparseAttentionOptions o;
  // Physical: the same ids as rows of the flattened cache (the decode rows' _phys).
  Tensor phys_idx;
  const TensorView k_rows(k.view().data(), DType::kBF16, Device::cuda(),
                          {pg.pool * kPage, kHkv, kD});
  const TensorView v_rows(v.view().data(), DType::kBF16, Device::cuda(),
                          {pg.pool * kPage, kHkv, kD});
  if (physical) {
    const Tensor host = Tensor::to_host(sel.idx.view());
    const int32_t* ids = host.data_as<int32_t>();
    phys_idx = int32_device(physical_ids({ids, ids + tokens * kWidth}, pg, kPage, tokens),
                            {tokens, kWidth});
    o.selected_kv_indices = phys_idx.view();
  } else {
    o.block_table = table.view();
    if (hint) o.block_indices = sel.blocks.view();
  }
  const Timing t = timer.time(
      [&](cudaStream_t s) {
        o.stream = s;
        if (physical) {
          qsa_sparse_attention(q, k_rows, v_rows, std::nullopt, out, std::nullopt, o);
        } else {
          qsa_sparse_attention(q, k, v, sel.idx.view(), out, std::nullopt, o);
        }
      },
      1, 5);
  const double sec = t.median_ms * 1e-3;
  const double bytes = 2.0 * sel.valid * kHkv * kD * 2 + 2.0 * tokens * hq * kD * 2;
  return {name,
          t.median_ms,
          0.0,
          4.0 * sel.valid * hq * kD / sec / 1e12,
          bytes / sec / 1e12,
          0.0,
          fmt::format("{}, mean valid {:.0f}/row, consecutive-row Jaccard {:.3f}", sel.note,
                      sel.valid / tokens, sel.jaccard)};
}

Result bench_prefill(Timer& timer, int64_t tokens, bool structured, bool hint, int64_t hq = kHq) {
  return time_prefill(timer, tokens, synthetic_selection(tokens, structured), hint,
                      fmt::format("prefill_{}k_{}{}", tokens / 1024,
                                  structured ? "structured" : "random", hint ? "_hint" : ""),
                      false, hq);
}

}  // namespace

int main(int argc, char** argv) {
  Timer timer;
  const Ceilings c = report_device_and_ceilings(timer);
  // One launch's fixed cost under the same timing (flush, events): a 4-byte memset.
  void* tiny = nullptr;
  BENCH_CUDA(cudaMalloc(&tiny, 4));
  const double launch_ms =
      timer.time([&](cudaStream_t s) { BENCH_CUDA(cudaMemsetAsync(tiny, 0, 4, s)); }).median_ms;
  fmt::print("one launch (4-byte memset, same timing): {:.4f} ms\n", launch_ms);
  // Each row is printed as soon as it is measured, so a failure later keeps the earlier ones.
  fmt::print("\n{:<30} {:>9} {:>9} {:>8} {:>7} {:>9} {:>6} {:>7}  {}\n", "benchmark", "ms",
             "graph ms", "TFLOP/s", "TB/s", "floor ms", "floor%", "(eager)", "note");
  std::vector<Result> results;
  auto ms_or_dash = [](double ms) { return ms > 0 ? fmt::format("{:.4f}", ms) : "-"; };
  auto pct = [](double floor_ms, double ms) {
    return floor_ms > 0 && ms > 0 ? fmt::format("{:.0f}%", 100 * floor_ms / ms) : "-";
  };
  auto add = [&](Result r) {
    const double timed = r.graph_ms > 0 ? r.graph_ms : r.ms;
    fmt::print("{:<30} {:>9} {:>9} {:>8.1f} {:>7.2f} {:>9.4f} {:>6} {:>7}  {}\n", r.name,
               ms_or_dash(r.ms), ms_or_dash(r.graph_ms), r.tflops, r.tbps, r.floor_ms,
               pct(r.floor_ms, timed), pct(r.floor_ms, r.ms), r.note);
    std::fflush(stdout);
    results.push_back(std::move(r));
  };
  const char* only_env = std::getenv("BENCH_ONLY");
  const std::string only = only_env ? only_env : "";
  auto want = [&](const std::string& name) { return name.rfind(only, 0) == 0; };
  const char* sweep_env = std::getenv("BENCH_SWEEP");
  const bool sweep = sweep_env == nullptr || std::string(sweep_env) != "0";
  for (int64_t b : {1, 8, 32, 128}) {
    if (!want(fmt::format("decode_b{}", b))) continue;
    std::vector<DecodeRun> runs = {{0, true, false},
                                   {0, false, true},
                                   {0, true, false, true},
                                   {0, true, false, false, false, true}};
    if (b <= 8) {
      runs.push_back({0, false, false, false, true});
      runs.push_back({0, false, false, true, true});
    }
    if (sweep) {
      // The hint's counts include ones that divide its 33 tiles evenly (3 and 11: 11 and 3
      // tiles a split) against the powers of two, whose last split carries a tile more.
      for (int splits : {1, 2, 4, 8, 16, 33}) runs.push_back({splits, false, false});
      for (int splits : {1, 2, 3, 4, 6, 8, 11, 16}) runs.push_back({splits, false, false, true});
    }
    bench_decode(timer, c, b, DType::kBF16, runs, add);
  }
  for (int64_t b : {1, 8, 32, 128}) {
    for (int64_t r : {2, 4}) {
      if (!want(fmt::format("decode_b{}_r{}", b, r))) continue;
      bench_decode(timer, c, b, DType::kBF16, {{0, true, false}, {0, true, false, true}}, add, r);
    }
  }
  for (int64_t b : {1, 8, 32, 128}) {
    if (!want(fmt::format("decode_b{}_fp8", b))) continue;
    std::vector<DecodeRun> runs = {{0, true, false}, {0, true, false, true}};
    if (b == 128) runs.push_back({0, false, false, true, true});
    if (sweep) {
      for (int splits : {1, 2, 4, 8, 16, 33}) runs.push_back({splits, false, false});
      for (int splits : {1, 2, 4, 8, 16}) runs.push_back({splits, false, false, true});
    }
    bench_decode(timer, c, b, DType::kF8E4M3, runs, add);
  }
  // The 32K case of issue 15's comparison (every request at position 32767) and an engine's
  // large pages (1600 tokens, contexts as the default rows'), token ids and the hint.
  for (int64_t b : {1, 8, 32, 128}) {
    const std::vector<DecodeRun> runs = {{0, true, false}, {0, true, false, true}};
    if (want(fmt::format("decode_b{}_32k", b))) {
      bench_decode(timer, c, b, DType::kBF16, runs, add, 1, DType::kBF16, {"_32k", kPage, 32768});
    }
    if (want(fmt::format("decode_b{}_page1600", b))) {
      bench_decode(timer, c, b, DType::kBF16, runs, add, 1, DType::kBF16, {"_page1600", 1600});
    }
  }
  // Wider top-k than the seed's 512 (the selection ops return up to 2048 blocks) at 32K
  // contexts, as token ids (block_indices takes at most 512 blocks).
  for (int64_t b : {1, 32, 128}) {
    for (int64_t nb : {1024, 2048}) {
      const std::string shape = fmt::format("_32k_nb{}", nb);
      if (!want(fmt::format("decode_b{}{}", b, shape))) continue;
      bench_decode(timer, c, b, DType::kBF16, {{0, true, false}}, add, 1, DType::kBF16,
                   {shape, kPage, 32768, nb});
    }
  }
  // A group of 8 query heads a KV head (16/2), which the kernels' 16 head columns hold with 8 of
  // padding, at 32K contexts and in prefill.
  for (int64_t b : {1, 32, 128}) {
    if (!want(fmt::format("decode_b{}_32k_g8", b))) continue;
    bench_decode(timer, c, b, DType::kBF16, {{0, true, false}, {0, true, false, true}}, add, 1,
                 DType::kBF16, {"_32k_g8", kPage, 32768, kBlocks, 16});
  }
  // FP8 K/V under FP16 queries: the gather kernel widens e4m3 to FP16 in one conversion a code
  // pair, against four instructions a pair to BF16 (cuda/common/fp8.cuh), so these rows against
  // the bf16 _fp8 rows measure what the widening costs.
  for (int64_t b : {32, 128}) {
    if (!want(fmt::format("decode_b{}_fp8_f16q", b))) continue;
    bench_decode(timer, c, b, DType::kF8E4M3, {{0, false, false, true}}, add, 1, DType::kF16);
  }
  auto prefill_row = [&](const std::string& name, const std::function<Result()>& run) {
    if (!want(name)) return;
    Result r = run();
    r.name = name;
    add(std::move(r));
  };
  for (int64_t n : {16384, 65536, 131072}) {
    prefill_row(fmt::format("prefill_{}k_structured", n / 1024),
                [&] { return bench_prefill(timer, n, true, false); });
  }
  prefill_row("prefill_16k_random", [&] { return bench_prefill(timer, 16384, false, false); });
  for (const bool structured : {true, false}) {
    prefill_row(fmt::format("prefill_16k_{}_g8", structured ? "structured" : "random"),
                [&] { return bench_prefill(timer, 16384, structured, false, 16); });
  }
  for (int64_t n : {1024, 4096, 16384}) {
    const std::string name = fmt::format("phys_prefill_{}k_structured", n / 1024);
    if (!want(name)) continue;
    const PrefillSelection sel = synthetic_selection(n, true);
    prefill_row(name, [&] { return time_prefill(timer, n, sel, false, name, true); });
  }
  prefill_row("prefill_128k_structured_hint",
              [&] { return bench_prefill(timer, 131072, true, true); });
  for (int64_t n : {16384, 65536, 131072}) {
    const std::string name = fmt::format("prefill_{}k_indexer", n / 1024);
    if (!want(name)) continue;
    const PrefillSelection sel = indexer_selection(timer, n);
    prefill_row(name, [&] { return time_prefill(timer, n, sel, false, name); });
    if (n == 131072) {
      prefill_row(name + "_hint",
                  [&] { return time_prefill(timer, n, sel, true, name + "_hint"); });
    }
  }

  if (argc > 1) {
    std::FILE* f = std::fopen(argv[1], "w");
    if (f == nullptr) {
      fmt::print(stderr, "cannot write {}\n", argv[1]);
      return 2;
    }
    fmt::print(f, "name,ms,graph_ms,useful_tflops,tbps,floor_ms,note,copy_tbps,gemm_tflops\n");
    for (const Result& r : results)
      fmt::print(f, "{},{:.5f},{:.5f},{:.2f},{:.3f},{:.5f},\"{}\",{:.3f},{:.1f}\n", r.name, r.ms,
                 r.graph_ms, r.tflops, r.tbps, r.floor_ms, r.note, c.copy_tbps, c.gemm_tflops);
    std::fclose(f);
  }
  return 0;
}
