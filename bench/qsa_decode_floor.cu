// The floor of a decode batch: how fast one launch can take a row's selection from HBM to shared
// memory at all, timed as the decode bench times (CUDA graph of one launch, L2 flushed before
// each replay, events around the replay), with nothing computed on the data. Small batches
// (issue 15's B = 1 and 8 bars) show the latency chain; B = 128 at one split shows how much of
// the DRAM's bandwidth scattered rows of this size reach (bf16 rows of 512 bytes, or FP8 rows of
// 256, issue 16's bar), and FP8 with a CTA taking both KV heads of a row (rows named _2h: a
// token's two 256-byte rows are 512 contiguous bytes), and FP8 with the blocks chosen in adjacent
// pairs (fp8_pr: 8 contiguous tokens an access, as many bytes as a bf16 block's 4). The two FP8
// variants test whether request size or the unit of locality is what FP8's rows lack against
// bf16's (docs/perf-notes.md, issue 16, session 32). The chain is the one every paged sparse
// decode kernel has:
//   stage 0: the launch alone (each CTA writes one word);
//   stage 1: + the row's block ids (the hint, 512 blocks and the tail);
//   stage 2: + their page-table entries (loads that need the ids);
//   stage 3: + every selected K and V row of the CTA's blocks copied into shared memory with
//            cp.async, all in flight at once (loads that need the pages);
//   stage 4: + SplitKV's merge through global memory: each CTA stores a 16 KB FP32 partial and
//            the last CTA of a (row, KV head) to arrive (a counter it resets) reads them all.
//            This merge is the plain one (one CTA reads every partial, a few loads in flight a
//            thread), so its column says what such a merge costs, not a floor.
// CTAs: B rows x 2 KV heads (or one for both, _2h) x S splits of the row's 513 entries. The layout
// is the bench's: K and V pools [pages, 64, 2, 256] of bf16 or FP8 bytes, pages scattered, contexts
// uniform in [8K, 128K]. What a kernel takes beyond stage 3 at the same S is its compute, its
// pipeline and its merge.
//
// Usage: qsa_decode_floor
#include <cuda_runtime.h>
#include <fmt/core.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include "bench_util.h"

namespace sparse_attn::bench {
namespace {

constexpr int kBlocks = 512, kEntries = kBlocks + 1, kPage = 64, kHkv = 2, kD = 256;
constexpr int kThreads = 256;
constexpr int kBufBytes = 64 * 1024;  // copies land here, overwriting each other
constexpr int kPartFloats = 16 * kD;  // a split's partial: 16 heads x 256

struct Args {
  const int32_t* hint;   // [B, 512] block ids
  const int32_t* lens;   // [B]
  const int32_t* table;  // [B, max_pages]
  int max_pages;
  const char* k;  // [pool, 64, 2, 256], row_bytes a (token, KV head)
  const char* v;
  int row_bytes;      // 512 (bf16) or 256 (FP8)
  int heads_per_cta;  // 1, or 2: a CTA copies both KV heads' rows of its tokens
  float* partials;    // [pairs, S, 16 * 256], pairs = B * 2 / heads_per_cta
  int* counters;      // [pairs], zero between launches
  float* out;         // [pairs * S] (stages 0-3), [pairs, 16 * 256] (stage 4)
  int splits;
  int stage;
};

__global__ void __launch_bounds__(kThreads) decode_chain(const Args a) {
  extern __shared__ __align__(128) char buf[];
  __shared__ int32_t first_token[kEntries];
  __shared__ int32_t page_of[kEntries];
  const int tid = threadIdx.x;
  const int split = blockIdx.x % a.splits, pair = blockIdx.x / a.splits;
  const int pairs_per_row = kHkv / a.heads_per_cta;
  const int kvh = pair % pairs_per_row, r = pair / pairs_per_row;
  const int per = (kEntries + a.splits - 1) / a.splits;
  const int e0 = split * per, e1 = min(kEntries, e0 + per), n = max(0, e1 - e0);
  float acc = 0.f;
  if (a.stage >= 1) {
    const int len = a.lens[r];
    for (int e = tid; e < n; e += kThreads) {
      const int ent = e0 + e;
      // The tail entry: the last (len % 4 or 4) tokens.
      const int tok = ent < kBlocks ? 4 * a.hint[r * kBlocks + ent] : ((len - 1) / 4) * 4;
      first_token[e] = tok;
      if (a.stage >= 2) page_of[e] = a.table[r * a.max_pages + tok / kPage];
      acc += static_cast<float>(tok);
    }
    __syncthreads();
  }
  if (a.stage >= 3) {
    // Chunk c of an entry: K or V (c / (4 pieces)), token c / pieces % 4, 16 bytes c % pieces
    // of its row (with _2h, of both heads' adjacent rows); every chunk of the split's entries in
    // flight at once.
    const int pieces = a.heads_per_cta * a.row_bytes / 16, chunks = 2 * 4 * pieces;
    const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(buf));
    for (int i = tid; i < n * chunks; i += kThreads) {
      const int e = i / chunks, c = i % chunks;
      const int which = c / (4 * pieces), tok_in = c / pieces % 4, piece = c % pieces;
      const int64_t token =
          static_cast<int64_t>(page_of[e]) * kPage + (first_token[e] + tok_in) % kPage;
      const char* src = (which ? a.v : a.k) + (token * kHkv + kvh) * a.row_bytes + piece * 16;
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst + (i * 16) % kBufBytes),
                   "l"(src));
    }
    asm volatile("cp.async.wait_all;\n" ::: "memory");
    __syncthreads();
    acc += reinterpret_cast<const float*>(buf)[tid];
  }
  if (a.stage < 4) {
    if (tid == 0) a.out[blockIdx.x] = acc;
    return;
  }
  float* part = a.partials + (static_cast<int64_t>(pair) * a.splits + split) * kPartFloats;
  for (int i = tid; i < kPartFloats; i += kThreads) part[i] = acc + i;
  __threadfence();
  __syncthreads();
  __shared__ int last;
  if (tid == 0) {
    last = atomicAdd(&a.counters[pair], 1) == a.splits - 1;
    if (last) a.counters[pair] = 0;  // ready for the next launch
  }
  __syncthreads();
  if (!last) return;
  __threadfence();
  for (int i = tid; i < kPartFloats; i += kThreads) {
    float s = 0.f;
    for (int j = 0; j < a.splits; ++j) {
      s += __ldcg(a.partials + (static_cast<int64_t>(pair) * a.splits + j) * kPartFloats + i);
    }
    a.out[static_cast<int64_t>(pair) * kPartFloats + i] = s;
  }
}

int run() {
  Timer timer;
  report_device_and_ceilings(timer);
  BENCH_CUDA(
      cudaFuncSetAttribute(decode_chain, cudaFuncAttributeMaxDynamicSharedMemorySize, kBufBytes));
  const std::vector<int> split_counts = {4, 8, 16, 32, 64};
  fmt::print("graph-replayed, L2 flushed, us (median of 15)\n{:8} {:>6} {:>6}", "case", "CTAs", "");
  for (const char* s : {"launch", "+ids", "+pages", "+K/V", "+merge"}) fmt::print(" {:>8}", s);
  fmt::print("\n");
  // B = 128 at one split, bf16 and FP8 rows (and FP8 a CTA for both heads, or its blocks in
  // adjacent pairs): the bandwidth the scattered rows reach.
  struct Case {
    int batch, row_bytes, heads_per_cta = 1;
    bool paired = false;  // the blocks come in adjacent pairs: 8 contiguous tokens an access
  };
  for (const Case cs : {Case{1, 512}, Case{8, 512}, Case{32, 512}, Case{128, 512}, Case{128, 256},
                        Case{128, 256, 2}, Case{128, 256, 1, true}}) {
    const int batch = cs.batch;
    std::mt19937_64 rng(100 + batch);
    std::uniform_int_distribution<int64_t> ctx(8192, 131072);
    std::vector<int64_t> lens(batch);
    for (auto& l : lens) l = ctx(rng);
    const Pages pg = make_pages(lens, kPage, rng);
    std::vector<int32_t> hint(batch * kBlocks);
    for (int b = 0; b < batch; ++b) {
      const int unit = cs.paired ? 2 : 1;
      std::vector<int32_t> all((lens[b] - 1) / (4 * unit));
      std::iota(all.begin(), all.end(), 0);
      std::shuffle(all.begin(), all.end(), rng);
      std::sort(all.begin(), all.begin() + kBlocks / unit);
      for (int i = 0; i < kBlocks; ++i) hint[b * kBlocks + i] = unit * all[i / unit] + i % unit;
    }
    auto upload = [](const std::vector<int32_t>& h) {
      int32_t* d = nullptr;
      BENCH_CUDA(cudaMalloc(&d, h.size() * sizeof(int32_t)));
      BENCH_CUDA(cudaMemcpy(d, h.data(), h.size() * sizeof(int32_t), cudaMemcpyHostToDevice));
      return d;
    };
    Args a{};
    a.hint = upload(hint);
    a.lens = upload(std::vector<int32_t>(lens.begin(), lens.end()));
    a.table = upload(pg.table);
    a.max_pages = static_cast<int>(pg.max_pages);
    a.row_bytes = cs.row_bytes;
    a.heads_per_cta = cs.heads_per_cta;
    const size_t pool_bytes = static_cast<size_t>(pg.pool) * kPage * kHkv * a.row_bytes;
    char *k = nullptr, *v = nullptr;
    BENCH_CUDA(cudaMalloc(&k, pool_bytes));
    BENCH_CUDA(cudaMalloc(&v, pool_bytes));
    BENCH_CUDA(cudaMemset(k, 0, pool_bytes));
    BENCH_CUDA(cudaMemset(v, 0, pool_bytes));
    a.k = k;
    a.v = v;
    const int pairs = batch * kHkv / cs.heads_per_cta;
    BENCH_CUDA(cudaMalloc(&a.partials, sizeof(float) * pairs * 64 * kPartFloats));
    BENCH_CUDA(cudaMalloc(&a.counters, sizeof(int) * pairs));
    BENCH_CUDA(cudaMemset(a.counters, 0, sizeof(int) * pairs));
    BENCH_CUDA(cudaMalloc(&a.out, sizeof(float) * pairs * std::max(64, kPartFloats)));
    for (const int s : batch == 128 ? std::vector<int>{1} : split_counts) {
      if (pairs * s > 2 * 132 * 2) continue;  // past two waves this is no longer a latency case
      a.splits = s;
      fmt::print("b{}_s{:<5} {:>6} {:>6}", batch, s, pairs * s,
                 cs.row_bytes == 256 ? (cs.heads_per_cta == 2 ? "fp8_2h"
                                        : cs.paired           ? "fp8_pr"
                                                              : "fp8")
                                     : "");
      for (int stage = 0; stage <= 4; ++stage) {
        a.stage = stage;
        const Timing t = timer.time_graph([&](cudaStream_t st) {
          decode_chain<<<pairs * s, kThreads, kBufBytes, st>>>(a);
          BENCH_CUDA(cudaGetLastError());
        });
        fmt::print(" {:8.2f}", t.median_ms * 1e3);
      }
      fmt::print("\n");
    }
    for (void* p : {static_cast<void*>(const_cast<int32_t*>(a.hint)),
                    static_cast<void*>(const_cast<int32_t*>(a.lens)),
                    static_cast<void*>(const_cast<int32_t*>(a.table)), static_cast<void*>(k),
                    static_cast<void*>(v), static_cast<void*>(a.partials),
                    static_cast<void*>(a.counters), static_cast<void*>(a.out)}) {
      BENCH_CUDA(cudaFree(p));
    }
  }
  return 0;
}

}  // namespace
}  // namespace sparse_attn::bench

int main() { return sparse_attn::bench::run(); }
