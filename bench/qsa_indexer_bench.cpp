// Benchmarks of the native QSA indexer kernels on the shapes of issue 6:
//   prefill (qsa_mqa_prefill): 4K, 16K, 64K tokens, bf16 or FP8 keys; rows = tokens, keys =
//     tokens / 4, causal row intervals [0, (r + 1) / 4). Floor: max(compute over the visible
//     128 x 64 tiles at the GEMM ceiling, bytes (output write + Q + K) at the copy ceiling).
//     Goal: >= 80%.
//   decode (qsa_mqa_decode): B = 1, 32, 128 requests of 8K..128K tokens (uniform), page
//     sizes 16, 64 and 200, bf16 or FP8 keys, 1, 2 or 4 query rows per request,
//     max_model_len = 128K / 4. Floor: K read + output write (+ Q, page table) at the copy
//     ceiling. Goal: >= 80% for B >= 32.
//   selection helpers (qsa_topk_blocks with k = 512, then qsa_expand_blocks with the block
//     hint) on native qsa_mqa_prefill scores of random inputs, every row seeing the complete
//     blocks before its position: prefill 16K, 64K and 128K (row r at position r), the last 4K
//     rows of a 128K prefill, decode B = 1 and 128 at positions uniform in [8K, 128K) over 32K
//     columns (graph-replayed; the expansion also as 20 launches back to back in one graph,
//     *_back_to_back, its inputs in L2 as in a decode step). Floor: scores read once plus ids written (top-k), ids read plus tokens and
//     hint written (expansion), at the copy ceiling. No goal: the reference point is the
//     attention that consumes the selection.
//   fused selections (issue 17; select_*), each beside the unfused path on the same inputs
//     (unfused_*: the score op into the full FP32 matrix, then qsa_topk_blocks, and at decode
//     qsa_expand_blocks): qsa_indexer_select on one request of 16K / 64K / 128K tokens (keys in
//     compressed pages of 212); qsa_mqa_decode_select at B = 1, 32, 128 of 32K-token contexts,
//     bf16 or FP8 keys, with token ids, graph-replayed. The bars stand in the floor
//     column (15 ms at 128K; 8 us at B = 1 and 60 us at B = 128): ratio >= 1 meets one.
// Usage: qsa_indexer_bench [results.csv] [--only PREFIX[,PREFIX...]]. Prints a table last.
// --only runs the benchmarks whose names start with one of the prefixes (for a profiler run);
// the ceilings are still measured first.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "bench_util.h"
#include "sparse_attn/qsa.h"
#include "sparse_attn/qsa_select.h"

using namespace sparse_attn;
using namespace sparse_attn::bench;

namespace {

struct Result {
  std::string name;
  double ms;
  double tflops;  // achieved, exact visible FLOPs
  double tbps;    // achieved, counted bytes
  double floor_ms;
  std::string floor_kind;
  double goal;        // 0: no goal
  double compute_ms;  // the two floors behind floor_ms
  double memory_ms;
};

Tensor int32_device(const std::vector<int32_t>& v, const Shape& shape) {
  Tensor h = Tensor::empty(shape, DType::kI32);
  std::copy(v.begin(), v.end(), h.data_as<int32_t>());
  Tensor d = Tensor::empty(shape, DType::kI32, Device::cuda());
  copy_into(d.view(), h.view());
  return d;
}

constexpr double kFlopPerScore = 2.0 * 4 * 128;  // 4 heads x 128 features, multiply + add

// Key bytes per element: bfloat16 or FP8 e4m3 keys.
double key_bytes(DType k) { return k == DType::kF8E4M3 ? 1.0 : 2.0; }
std::string key_tag(DType k) { return k == DType::kF8E4M3 ? "_fp8" : ""; }

Result bench_prefill(Timer& timer, const Ceilings& c, int64_t tokens, DType kdt) {
  const int64_t rows = tokens, keys = tokens / 4;
  Tensor q = random_device({rows, 4, 128}, DType::kBF16, 11);
  Tensor k = random_device({keys, 128}, kdt, 12);
  std::vector<int32_t> starts(rows, 0), ends(rows);
  for (int64_t r = 0; r < rows; ++r) ends[r] = static_cast<int32_t>((r + 1) / 4);
  Tensor ds = int32_device(starts, {rows}), de = int32_device(ends, {rows});
  Tensor out = Tensor::empty({rows, keys}, DType::kF32, Device::cuda());
  const Timing t = timer.time([&](cudaStream_t s) {
    MqaScoreOptions o;
    o.stream = s;
    qsa_mqa_prefill(q, k, ds, de, out, o);
  });
  double visible = 0, tile_scores = 0;
  for (int64_t r = 0; r < rows; ++r) visible += ends[r];
  for (int64_t r0 = 0; r0 < rows; r0 += 128) {
    const int64_t max_end = ends[std::min(rows, r0 + 128) - 1];
    tile_scores += double((max_end + 63) / 64) * 128 * 64;
  }
  const double bytes =
      4.0 * rows * keys + 2.0 * rows * 512 + key_bytes(kdt) * keys * 128 + 8.0 * rows;
  const double compute_ms = kFlopPerScore * tile_scores / (c.gemm_tflops * 1e12) * 1e3;
  const double memory_ms = bytes / (c.copy_tbps * 1e12) * 1e3;
  const double s = t.median_ms * 1e-3;
  return {fmt::format("prefill_{}k{}", tokens / 1024, key_tag(kdt)),
          t.median_ms,
          kFlopPerScore * visible / s / 1e12,
          bytes / s / 1e12,
          std::max(compute_ms, memory_ms),
          compute_ms > memory_ms ? "compute" : "write",
          0.8,
          compute_ms,
          memory_ms};
}

// R query rows per request (multi-token decode) share the request's keys: every row sees them.
std::string decode_name(int64_t batch, int64_t page_size, DType kdt, int64_t rows) {
  return fmt::format("decode_b{}_page{}{}{}", batch, page_size, key_tag(kdt),
                     rows > 1 ? fmt::format("_rows{}", rows) : "");
}

Result bench_decode(Timer& timer, const Ceilings& c, int64_t batch, int64_t page_size, DType kdt,
                    int64_t rows) {
  const int64_t max_model_len = 131072 / 4;
  const int64_t max_pages = (max_model_len + page_size - 1) / page_size;
  std::mt19937_64 rng(1000 * batch + page_size);
  std::uniform_int_distribution<int64_t> tokens(8192, 131072);
  std::vector<int32_t> lens(batch);
  int64_t pool = 0;
  for (auto& l : lens) {
    l = static_cast<int32_t>(tokens(rng) / 4);
    pool += (l + page_size - 1) / page_size;
  }
  // Pages scattered over the pool, as a cache allocator leaves them; unused entries are -1.
  std::vector<int32_t> perm(pool);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  std::vector<int32_t> table(batch * max_pages, -1);
  int64_t next = 0;
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t p = 0; p < (lens[b] + page_size - 1) / page_size; ++p)
      table[b * max_pages + p] = perm[next++];
  Tensor q = random_device({batch, rows, 4, 128}, DType::kBF16, 21);
  Tensor cache = random_device({pool, page_size, 1, 128}, kdt, 22);
  std::vector<int32_t> row_lens;
  for (int32_t l : lens) row_lens.insert(row_lens.end(), rows, l);
  Tensor dt = int32_device(table, {batch, max_pages});
  Tensor dl = rows == 1 ? int32_device(lens, {batch}) : int32_device(row_lens, {batch, rows});
  Tensor out = Tensor::empty({batch * rows, max_model_len}, DType::kF32, Device::cuda());
  const Timing t = timer.time([&](cudaStream_t s) {
    MqaScoreOptions o;
    o.stream = s;
    qsa_mqa_decode(q, cache, dt, dl, max_model_len, out, o);
  });
  const double keys = std::accumulate(lens.begin(), lens.end(), 0.0);
  const double bytes = 128.0 * key_bytes(kdt) * keys + 4.0 * batch * rows * max_model_len +
                       1024.0 * batch * rows + 4.0 * keys / page_size;
  const double s = t.median_ms * 1e-3;
  const double memory_ms = bytes / (c.copy_tbps * 1e12) * 1e3;
  return {decode_name(batch, page_size, kdt, rows),
          t.median_ms,
          kFlopPerScore * keys * rows / s / 1e12,
          bytes / s / 1e12,
          memory_ms,
          "hbm",
          batch >= 32 ? 0.8 : 0.0,
          kFlopPerScore * keys * rows / (c.gemm_tflops * 1e12) * 1e3,
          memory_ms};
}

// Top-512 and expansion for query rows at `positions`, over `keys` score columns.
std::vector<Result> bench_select(Timer& timer, const Ceilings& c, const std::string& tag,
                                 const std::vector<int32_t>& positions, int64_t keys) {
  constexpr int64_t kTopk = kQsaTopkBlocks, kWidth = 4 * kTopk + 3;
  const int64_t rows = static_cast<int64_t>(positions.size());
  std::vector<int32_t> starts(rows, 0), ends(rows);
  for (int64_t r = 0; r < rows; ++r) ends[r] = (positions[r] + 1) / 4;
  Tensor q = random_device({rows, 4, 128}, DType::kBF16, 31);
  Tensor k = random_device({keys, 128}, DType::kBF16, 32);
  Tensor ds = int32_device(starts, {rows}), de = int32_device(ends, {rows});
  Tensor dp = int32_device(positions, {rows});
  Tensor scores = Tensor::empty({rows, keys}, DType::kF32, Device::cuda());
  qsa_mqa_prefill(q, k, ds, de, scores);
  // On the legacy default stream: the timer's non-blocking stream does not wait for it.
  BENCH_CUDA(cudaDeviceSynchronize());
  Tensor ids = Tensor::empty({rows, kTopk}, DType::kI32, Device::cuda());
  Tensor tokens = Tensor::empty({rows, kWidth}, DType::kI32, Device::cuda());
  Tensor blocks = Tensor::empty({rows, kTopk}, DType::kI32, Device::cuda());
  // Decode steps are graph-replayed by engines; eager timing adds a launch a kernel.
  const bool graph = tag.rfind("decode", 0) == 0;
  const auto time = [&](const std::function<void(cudaStream_t)>& f) {
    return graph ? timer.time_graph(f) : timer.time(f);
  };
  const Timing tk = time([&](cudaStream_t s) { qsa_topk_blocks(scores, kTopk, ids, s); });
  const Timing te =
      time([&](cudaStream_t s) { qsa_expand_blocks(ids, dp, tokens, blocks.view(), s); });
  const double topk_bytes = 4.0 * rows * keys + 4.0 * rows * kTopk;
  const double expand_bytes = 4.0 * rows * (kTopk + 1) + 4.0 * rows * (kWidth + kTopk);
  const auto result = [&](const std::string& name, const Timing& t, double bytes) {
    const double floor_ms = bytes / (c.copy_tbps * 1e12) * 1e3;
    return Result{name, t.median_ms, 0.0,     bytes / (t.median_ms * 1e-3) / 1e12, floor_ms, "hbm",
                  0.0,  0.0,         floor_ms};
  };
  std::vector<Result> out = {result("topk_" + tag, tk, topk_bytes),
                             result("expand_" + tag, te, expand_bytes)};
  if (graph) {
    const Timing tb = timer.time_graph_back_to_back(
        [&](cudaStream_t s) { qsa_expand_blocks(ids, dp, tokens, blocks.view(), s); });
    out.push_back(result("expand_" + tag + "_back_to_back", tb, expand_bytes));
  }
  return out;
}


// The fused selections against the unfused path (scores into the full FP32 matrix, then
// qsa_topk_blocks) on the same inputs: keys in compressed pages of 212 (an engine's 848-token
// attention page), top-512.
constexpr int64_t kSelectPage = 212;

// A paged cache for `lens[b]` keys per request, pages scattered over the pool.
struct PagedKeys {
  Tensor cache, table;
};
PagedKeys paged_keys(const std::vector<int64_t>& lens, int64_t max_pages, DType kdt,
                     uint64_t seed) {
  std::mt19937_64 rng(seed);
  int64_t pool = 0;
  for (int64_t l : lens) pool += (l + kSelectPage - 1) / kSelectPage;
  std::vector<int32_t> perm(pool);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  const int64_t batch = static_cast<int64_t>(lens.size());
  std::vector<int32_t> table(batch * max_pages, -1);
  int64_t next = 0;
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t p = 0; p < (lens[b] + kSelectPage - 1) / kSelectPage; ++p)
      table[b * max_pages + p] = perm[next++];
  return {random_device({pool, kSelectPage, 1, 128}, kdt, seed + 1),
          int32_device(table, {batch, max_pages})};
}

Result select_result(const std::string& name, const Timing& t, double goal_ms) {
  // The bar stands in the floor columns: ratio >= 1 meets it.
  return {name, t.median_ms, 0.0, 0.0, goal_ms, goal_ms > 0 ? "bar" : "-", 0.0, 0.0, 0.0};
}

// One request of `tokens` prompt tokens: q_idx [1, tokens, 4, 128], every row causal.
std::vector<Result> bench_select_prefill(Timer& timer, int64_t tokens) {
  const int64_t nb = tokens / 4, max_pages = (nb + kSelectPage - 1) / kSelectPage;
  Tensor q = random_device({1, tokens, 4, 128}, DType::kBF16, 41);
  const PagedKeys keys = paged_keys({nb}, max_pages, DType::kBF16, 42);
  IndexerScoreOptions o;
  o.block_table = keys.table.view();
  Tensor ids = Tensor::empty({1, tokens, kQsaTopkBlocks}, DType::kI32, Device::cuda());
  Tensor ids_unfused = Tensor::empty({1, tokens, kQsaTopkBlocks}, DType::kI32, Device::cuda());
  const std::string tag = fmt::format("{}k", tokens / 1024);
  std::vector<Result> out;
  out.push_back(select_result("select_prefill_" + tag, timer.time([&](cudaStream_t s) {
    IndexerScoreOptions so = o;
    so.stream = s;
    qsa_indexer_select(q, keys.cache, kQsaTopkBlocks, ids, so);
  }), tokens == 131072 ? 15.0 : 0.0));
  {
    Tensor scores = Tensor::empty({1, tokens, max_pages * kSelectPage}, DType::kF32,
                                  Device::cuda());
    out.push_back(select_result("unfused_prefill_" + tag, timer.time([&](cudaStream_t s) {
      IndexerScoreOptions so = o;
      so.stream = s;
      qsa_indexer_mqa_score(q, keys.cache, scores, so);
      qsa_topk_blocks(scores, kQsaTopkBlocks, ids_unfused, s);
    }), 0.0));
  }
  BENCH_CUDA(cudaDeviceSynchronize());
  Tensor a = Tensor::to_host(ids.view()), b = Tensor::to_host(ids_unfused.view());
  if (std::memcmp(a.data(), b.data(), sizeof(int32_t) * a.numel()) != 0)
    fmt::print(stderr, "select_prefill_{}: fused and unfused block ids differ\n", tag);
  return out;
}

// B requests at 32K tokens (8192 compressed keys) each, one query row at position 32767,
// graph-replayed; the fused op also expands to token ids.
std::vector<Result> bench_select_decode(Timer& timer, int64_t batch, DType kdt) {
  const int64_t nb = 32768 / 4, max_pages = (nb + kSelectPage - 1) / kSelectPage;
  Tensor q = random_device({batch, 4, 128}, DType::kBF16, 51);
  const PagedKeys keys = paged_keys(std::vector<int64_t>(batch, nb), max_pages, kdt, 52);
  Tensor lens = int32_device(std::vector<int32_t>(batch, int32_t(nb)), {batch});
  Tensor pos = int32_device(std::vector<int32_t>(batch, 32767), {batch});
  Tensor ids = Tensor::empty({batch, kQsaTopkBlocks}, DType::kI32, Device::cuda());
  Tensor tokens = Tensor::empty({batch, 4 * kQsaTopkBlocks + 3}, DType::kI32, Device::cuda());
  Tensor scores = Tensor::empty({batch, nb}, DType::kF32, Device::cuda());
  SelectOptions sel;
  sel.token_indices = tokens.view();
  sel.query_positions = pos.view();
  const std::string tag = fmt::format("b{}{}", batch, key_tag(kdt));
  std::vector<Result> out;
  out.push_back(select_result("select_decode_" + tag, timer.time_graph([&](cudaStream_t s) {
    MqaScoreOptions o;
    o.stream = s;
    qsa_mqa_decode_select(q, keys.cache, keys.table, lens, nb, kQsaTopkBlocks, ids, o, sel);
  }), batch == 128 ? 0.060 : batch == 1 ? 0.008 : 0.0));
  out.push_back(select_result("unfused_decode_" + tag, timer.time_graph([&](cudaStream_t s) {
    MqaScoreOptions o;
    o.stream = s;
    qsa_mqa_decode(q, keys.cache, keys.table, lens, nb, scores, o);
    qsa_topk_blocks(scores, kQsaTopkBlocks, ids, s);
    qsa_expand_blocks(ids, pos, tokens, std::nullopt, s);
  }), 0.0));
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  std::string csv_path, only;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--only" && i + 1 < argc) {
      only = argv[++i];
    } else {
      csv_path = arg;
    }
  }
  Timer timer;
  const Ceilings c = report_device_and_ceilings(timer);

  std::vector<Result> results;
  std::vector<std::string> prefixes;  // --only's comma-separated list
  for (size_t at = 0; at <= only.size();) {
    const size_t comma = std::min(only.find(',', at), only.size());
    prefixes.push_back(only.substr(at, comma - at));
    at = comma + 1;
  }
  const auto wanted = [&](const std::string& name) {
    return std::any_of(prefixes.begin(), prefixes.end(),
                       [&](const std::string& prefix) { return name.rfind(prefix, 0) == 0; });
  };
  for (DType kdt : {DType::kBF16, DType::kF8E4M3})
    for (int64_t tokens : {4096, 16384, 65536})
      if (wanted(fmt::format("prefill_{}k{}", tokens / 1024, key_tag(kdt))))
        results.push_back(bench_prefill(timer, c, tokens, kdt));
  // Pages of 16 and 64 keys, and 200 (an engine's 800-token attention page); FP8 keys; 2 and 4
  // query rows per request (multi-token decode).
  struct DecodeCase {
    int64_t page_size;
    DType kdt;
    int64_t rows;
  };
  const DecodeCase decode_cases[] = {{16, DType::kBF16, 1},    {64, DType::kBF16, 1},
                                     {200, DType::kBF16, 1},   {64, DType::kF8E4M3, 1},
                                     {200, DType::kF8E4M3, 1}, {64, DType::kBF16, 2},
                                     {64, DType::kBF16, 4}};
  for (int64_t batch : {1, 32, 128})
    for (const DecodeCase& d : decode_cases)
      if (wanted(decode_name(batch, d.page_size, d.kdt, d.rows)))
        results.push_back(bench_decode(timer, c, batch, d.page_size, d.kdt, d.rows));

  struct SelectCase {
    std::string tag;
    std::vector<int32_t> positions;
    int64_t keys;
  };
  const auto select_cases = [] {
    std::vector<SelectCase> cases;
    for (int64_t tokens : {16384, 65536, 131072}) {
      std::vector<int32_t> pos(tokens);
      std::iota(pos.begin(), pos.end(), 0);
      cases.push_back({fmt::format("prefill_{}k", tokens / 1024), pos, tokens / 4});
    }
    std::vector<int32_t> chunk(4096);
    std::iota(chunk.begin(), chunk.end(), 131072 - 4096);
    cases.push_back({"prefill_128k_last4k", chunk, 131072 / 4});
    std::mt19937_64 rng(77);
    std::uniform_int_distribution<int32_t> ctx(8192, 131071);
    for (int64_t batch : {1, 128}) {
      std::vector<int32_t> decode(batch);
      for (int32_t& p : decode) p = ctx(rng);
      cases.push_back({fmt::format("decode_b{}", batch), decode, 131072 / 4});
    }
    return cases;
  };
  for (const SelectCase& sc : select_cases())
    if (wanted("topk_" + sc.tag) || wanted("expand_" + sc.tag))
      for (Result& r : bench_select(timer, c, sc.tag, sc.positions, sc.keys))
        results.push_back(std::move(r));

  for (int64_t tokens : {16384, 65536, 131072})
    if (wanted(fmt::format("select_prefill_{}k", tokens / 1024)))
      for (Result& r : bench_select_prefill(timer, tokens)) results.push_back(std::move(r));
  for (DType kdt : {DType::kBF16, DType::kF8E4M3})
    for (int64_t batch : {1, 32, 128})
      if (wanted(fmt::format("select_decode_b{}{}", batch, key_tag(kdt))))
        for (Result& r : bench_select_decode(timer, batch, kdt)) results.push_back(std::move(r));

  if (!csv_path.empty()) {
    std::FILE* f = std::fopen(csv_path.c_str(), "w");
    if (f == nullptr) {
      fmt::print(stderr, "cannot write {}\n", csv_path);
      return 2;
    }
    fmt::print(f,
               "name,ms,tflops,tbps,floor_ms,floor_kind,compute_floor_ms,memory_floor_ms,"
               "ratio,goal,copy_tbps,gemm_tflops\n");
    for (const Result& r : results)
      fmt::print(f, "{},{:.5f},{:.2f},{:.3f},{:.5f},{},{:.5f},{:.5f},{:.3f},{},{:.3f},{:.1f}\n",
                 r.name, r.ms, r.tflops, r.tbps, r.floor_ms, r.floor_kind, r.compute_ms,
                 r.memory_ms, r.floor_ms / r.ms, r.goal, c.copy_tbps, c.gemm_tflops);
    std::fclose(f);
  }
  fmt::print("\n{:<26} {:>9} {:>8} {:>7} {:>9} {:>8} {:>6} {:>5}\n", "benchmark", "ms", "TFLOP/s",
             "TB/s", "floor ms", "floor", "ratio", "goal");
  for (const Result& r : results) {
    const double ratio = r.floor_ms / r.ms;
    fmt::print("{:<26} {:>9.4f} {:>8.1f} {:>7.2f} {:>9.4f} {:>8} {:>6.2f} {:>5}\n", r.name, r.ms,
               r.tflops, r.tbps, r.floor_ms, r.floor_kind, ratio,
               r.goal == 0 ? "-" : (ratio >= r.goal ? "met" : "MISS"));
  }
  return 0;
}
