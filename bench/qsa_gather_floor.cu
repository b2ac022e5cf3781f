// The gather floor of QSA prefill (issue 13's selections): how fast the H200 can bring every
// row's selected K/V into shared memory once, with nothing computed on it. Any prefill kernel
// that reads each row's K/V (no sharing between rows) takes at least this long; against it,
// bench/qsa_prefill_bench.py's times say how much of a kernel's time is the gather.
//
// The cache is the engines' combined one, [pages, page, 2 KV heads, 2 x 256] bf16: a token's
// K and V of both KV heads are 2 KB of consecutive bytes, a 4-token block 8 KB inside a page.
// One CTA per row (rows in order, as the attention kernels take them) copies each selected
// block (and the tail) with one bulk copy into a ring of shared-memory slots; a slot is
// reused once its copy has landed. Ring depths 2, 4 and 8 slots (14, 7 and 3 CTAs per SM):
// the best is the floor. The selections are bench/qsa_prefill_bench.py's (random, window),
// drawn here with their own seed; page 64, pages scattered.
//
// Usage: qsa_gather_floor [n ...]   (default 16384 65536 131072)
#include <cuda_runtime.h>
#include <fmt/core.h>

#include <cute/arch/copy_sm90_tma.hpp>
#include <cutlass/arch/barrier.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "bench_util.h"

namespace sparse_attn::bench {
namespace {

constexpr int kBlocks = 512, kRecent = 64, kWidth = kBlocks + 1;  // 512 blocks + the tail
constexpr int kPage = 64;
constexpr int kTokenBytes = 2 * 2 * 256 * 2;  // K and V of both KV heads, bf16
constexpr int kSlotBytes = 4 * kTokenBytes;

// A selection entry: first token * 8 + token count (1..4), or -1.
std::vector<int32_t> selection(int64_t n, bool window, std::mt19937_64& rng) {
  std::vector<int32_t> sel(n * kWidth, -1), shared(kBlocks - kRecent);
  for (int64_t p = 0; p < n; ++p) {
    const int64_t vis = (p + 1) / 4;
    int32_t* row = &sel[p * kWidth];
    if (window && p % 64 == 0) {
      const int64_t from = std::max<int64_t>(1, (p + 1) / 4);
      for (int32_t& b : shared) {
        b = static_cast<int32_t>(std::uniform_int_distribution<int64_t>(0, from - 1)(rng));
      }
    }
    for (int j = 0; j < kBlocks; ++j) {
      int64_t b = -1;
      if (vis <= kBlocks) {
        b = j < vis ? j : -1;
      } else if (!window) {
        b = std::uniform_int_distribution<int64_t>(0, vis - 1)(rng);
      } else {
        b = j < kRecent ? vis - 1 - j : shared[j - kRecent];
      }
      if (b >= 0) row[j] = static_cast<int32_t>(4 * b * 8 + 4);
    }
    const int64_t tail = p + 1 - 4 * vis;
    if (tail > 0) row[kBlocks] = static_cast<int32_t>(4 * vis * 8 + tail);
  }
  return sel;
}

template <int kSlots>
__global__ void __launch_bounds__(32) gather_rows(const char* cache, const int32_t* table,
                                                  const int32_t* sel) {
  extern __shared__ __align__(128) char slots[];
  using Barrier = cutlass::arch::ClusterTransactionBarrier;
  __shared__ uint64_t landed[kSlots];
  if (threadIdx.x != 0) return;
  for (auto& b : landed) Barrier::init(&b, 1);
  cutlass::arch::fence_barrier_init();
  const int32_t* row = sel + static_cast<int64_t>(blockIdx.x) * kWidth;
  int issued = 0;
  for (int e = 0; e < kWidth; ++e) {
    const int32_t v = row[e];
    if (v < 0) continue;
    const int first = v >> 3, count = v & 7, slot = issued % kSlots;
    if (issued >= kSlots) Barrier::wait(&landed[slot], (issued / kSlots - 1) & 1);
    const int64_t token = static_cast<int64_t>(table[first / kPage]) * kPage + first % kPage;
    Barrier::arrive_and_expect_tx(&landed[slot], count * kTokenBytes);
    cute::SM90_BULK_COPY_G2S::copy(cache + token * kTokenBytes, &landed[slot],
                                   slots + slot * kSlotBytes, count * kTokenBytes);
    ++issued;
  }
  for (int i = std::max(0, issued - kSlots); i < issued; ++i) {
    Barrier::wait(&landed[i % kSlots], (i / kSlots) & 1);
  }
}

template <int kSlots>
Timing time_gather(Timer& timer, const char* cache, const int32_t* table, const int32_t* sel,
                   int64_t n) {
  constexpr int kSmem = kSlots * kSlotBytes;
  BENCH_CUDA(cudaFuncSetAttribute(gather_rows<kSlots>,
                                  cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
  return timer.time(
      [&](cudaStream_t s) {
        gather_rows<kSlots><<<static_cast<unsigned>(n), 32, kSmem, s>>>(cache, table, sel);
        BENCH_CUDA(cudaGetLastError());
      },
      2, 5);
}

int run(int argc, char** argv) {
  std::vector<int64_t> ns;
  for (int i = 1; i < argc; ++i) ns.push_back(std::stoll(argv[i]));
  if (ns.empty()) ns = {16384, 65536, 131072};
  Timer timer;
  const Ceilings c = report_device_and_ceilings(timer);
  fmt::print("{:24} {:>10} {:>9} {:>9} {:>9} {:>9} {:>10}\n", "case", "GB read", "2 slots",
             "4 slots", "8 slots", "floor ms", "TB/s");
  std::mt19937_64 rng(13);
  for (const int64_t n : ns) {
    const int64_t pages = (n + kPage - 1) / kPage;
    std::vector<int32_t> table(pages);
    std::iota(table.begin(), table.end(), 0);
    std::shuffle(table.begin(), table.end(), rng);
    char* cache = nullptr;
    int32_t *d_table = nullptr, *d_sel = nullptr;
    BENCH_CUDA(cudaMalloc(&cache, pages * kPage * kTokenBytes));
    BENCH_CUDA(cudaMemset(cache, 0, pages * kPage * kTokenBytes));
    BENCH_CUDA(cudaMalloc(&d_table, pages * sizeof(int32_t)));
    BENCH_CUDA(cudaMalloc(&d_sel, n * kWidth * sizeof(int32_t)));
    BENCH_CUDA(cudaMemcpy(d_table, table.data(), pages * sizeof(int32_t), cudaMemcpyHostToDevice));
    for (const bool window : {false, true}) {
      const std::vector<int32_t> sel = selection(n, window, rng);
      double bytes = 0;
      for (const int32_t v : sel) bytes += v < 0 ? 0 : (v & 7) * double{kTokenBytes};
      BENCH_CUDA(cudaMemcpy(d_sel, sel.data(), sel.size() * sizeof(int32_t),
                            cudaMemcpyHostToDevice));
      const double t2 = time_gather<2>(timer, cache, d_table, d_sel, n).median_ms;
      const double t4 = time_gather<4>(timer, cache, d_table, d_sel, n).median_ms;
      const double t8 = time_gather<8>(timer, cache, d_table, d_sel, n).median_ms;
      const double best = std::min({t2, t4, t8});
      fmt::print("{:24} {:10.1f} {:9.3f} {:9.3f} {:9.3f} {:9.3f} {:10.2f}\n",
                 fmt::format("{}_{}k_page{}", window ? "window" : "random", n / 1024, kPage),
                 bytes / 1e9, t2, t4, t8, best, bytes / (best * 1e-3) / 1e12);
    }
    BENCH_CUDA(cudaFree(cache));
    BENCH_CUDA(cudaFree(d_table));
    BENCH_CUDA(cudaFree(d_sel));
  }
  fmt::print("(HBM copy ceiling {:.2f} TB/s read + write)\n", c.copy_tbps);
  return 0;
}

}  // namespace
}  // namespace sparse_attn::bench

int main(int argc, char** argv) { return sparse_attn::bench::run(argc, argv); }
