// Native qsa_topk_blocks: one CTA per row (rows strided over the grid), bit-exact with the
// reference (src/reference/qsa_select_ref.cpp).
//
// Each finite score maps to a 32-bit key whose unsigned order is the float order (-0 and +0
// share one key, as they compare equal); non-finite scores map to 0, below every finite key,
// and are never counted. A radix select over the keys (digits of 12, 12 and 8 bits) finds the
// key T of the k-th best visible block and how many blocks keyed T are needed. A gather pass then
// takes every block keyed above T and the needed ones keyed T in ascending block id (a block-wide
// scan keeps the id order), so the selected set is exactly the reference's. The set is sorted
// by the 64-bit composite (key, ~id) descending: composites are unique, so the order is the
// reference's (score descending, ties by ascending id) whatever order the gather produced.
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>

#include "api/qsa_select_params.h"
#include "cuda/common/check.h"
#include "cuda/common/device_guard.h"
#include "cuda/common/device_props.h"

namespace sparse_attn {
namespace cuda::select {
namespace {

constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;
// Digits of the radix select, most significant first: 12 + 12 + 8 bits. The first digit holds
// the sign, the exponent and 3 mantissa bits, so scores of one magnitude still spread over
// several bins (fewer same-bin atomics and fewer candidates left for the next pass than with
// 8-bit digits), and three passes instead of four read the row.
constexpr int kPasses = 3;
__host__ __device__ constexpr int digit_bits(int pass) { return pass < 2 ? 12 : 8; }
constexpr int kMaxBins = 1 << 12;
constexpr int kBinsPerThread = kMaxBins / kThreads;
static_assert(digit_bits(0) + digit_bits(1) + digit_bits(2) == 32, "the digits cover the key");
static_assert(kMaxBins % kThreads == 0, "each thread scans whole bins");
// Selections of up to this many blocks are sorted in shared memory (128 KiB of composites);
// larger ones (k and the visible count both above it) sort in a global workspace.
constexpr int64_t kMaxSharedSort = 16384;
constexpr int64_t kMaxGlobalSortBytes = int64_t{1} << 30;

struct TopkProblem {
  int64_t total_rows;
  int64_t rows;  // per batch entry
  int64_t num_blocks;
  int64_t k;
  const float* scores;
  int64_t scores_batch_stride, scores_row_stride, scores_col_stride;
  int32_t* out;
  int64_t out_batch_stride, out_row_stride, out_col_stride;
  int64_t sort_capacity;  // a power of two >= min(k, num_blocks): composites per row
  uint64_t* global_sort;  // [gridDim.x, sort_capacity], or null to sort in shared memory
};

struct SharedStorage {
  int hist[kMaxBins];
  int warp_sums[kWarps];
  int visible;      // finite scores in the row
  int digit;        // the chosen digit of this pass
  int remaining;    // blocks still to take at and below the chosen prefix
  int digit_count;  // blocks that carry the chosen prefix
  int selected;     // gather cursor
};

// Unsigned order of the key == float order of finite scores; 0 for -inf, +inf and NaN.
__device__ __forceinline__ uint32_t order_key(float f) {
  if (!isfinite(f)) return 0;
  uint32_t u = __float_as_uint(f);
  if ((u << 1) == 0) u = 0;  // -0 == +0
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Exclusive sum of `v` over the threads of the block, and the block total; every thread calls it.
__device__ __forceinline__ int block_exclusive_sum(int v, int* warp_sums, int& total) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  int inclusive = v;
#pragma unroll
  for (int d = 1; d < 32; d *= 2) {
    const int n = __shfl_up_sync(0xffffffffu, inclusive, d);
    if (lane >= d) inclusive += n;
  }
  if (lane == 31) warp_sums[warp] = inclusive;
  __syncthreads();
  int before = inclusive - v;
  total = 0;
  for (int w = 0; w < kWarps; ++w) {
    const int n = warp_sums[w];
    if (w < warp) before += n;
    total += n;
  }
  __syncthreads();
  return before;
}

// Sorts buf[0..n) descending; n is a power of two.
__device__ void bitonic_sort_descending(uint64_t* buf, int64_t n) {
  for (int64_t size = 2; size <= n; size *= 2) {
    for (int64_t stride = size / 2; stride > 0; stride /= 2) {
      for (int64_t i = threadIdx.x; i < n / 2; i += kThreads) {
        const int64_t lo = 2 * i - (i & (stride - 1));
        const int64_t hi = lo + stride;
        const bool descending = (lo & size) == 0;
        const uint64_t a = buf[lo], b = buf[hi];
        if (descending ? a < b : a > b) {
          buf[lo] = b;
          buf[hi] = a;
        }
      }
      __syncthreads();
    }
  }
}

__global__ void __launch_bounds__(kThreads) topk_blocks_kernel(const TopkProblem p) {
  extern __shared__ uint64_t shared_sort[];
  __shared__ SharedStorage s;
  uint64_t* buf = p.global_sort ? p.global_sort + blockIdx.x * p.sort_capacity : shared_sort;
  const int tid = threadIdx.x, lane = tid % 32;
  const int64_t nb = p.num_blocks;

  for (int64_t r = blockIdx.x; r < p.total_rows; r += gridDim.x) {
    const float* row =
        p.scores + (r / p.rows) * p.scores_batch_stride + (r % p.rows) * p.scores_row_stride;
    int32_t* out = p.out + (r / p.rows) * p.out_batch_stride + (r % p.rows) * p.out_row_stride;
    const auto key_at = [&](int64_t j) { return order_key(row[j * p.scores_col_stride]); };

    // Radix select of the threshold key, most significant digit first.
    uint32_t threshold = 0;  // 0 with take_all: every visible block is kept
    int64_t ties_needed = 0;
    bool take_all = false, all_ties = false;
    int64_t remaining = p.k;
    int shift = 32;
    for (int pass = 0; pass < kPasses; ++pass) {
      const int bins = 1 << digit_bits(pass);
      const uint32_t high_mask = pass == 0 ? 0u : ~0u << shift;
      shift -= digit_bits(pass);
      for (int i = tid; i < bins; i += kThreads) s.hist[i] = 0;
      if (tid == 0) s.selected = 0;
      __syncthreads();
      // Histogram of the digit over the blocks that carry the prefix chosen so far. Lanes
      // with the same bin add once (ties and scores of one magnitude share bins).
      for (int64_t base = 0; base < nb; base += kThreads) {
        const int64_t j = base + tid;
        const uint32_t key = j < nb ? key_at(j) : 0;
        const bool counted = key != 0 && (key & high_mask) == threshold;
        const unsigned active = __ballot_sync(0xffffffffu, counted);
        if (counted) {
          const int bin = static_cast<int>((key >> shift) & (bins - 1));
          const unsigned peers = __match_any_sync(active, bin);
          if ((peers & ((1u << lane) - 1)) == 0) atomicAdd(&s.hist[bin], __popc(peers));
        }
      }
      __syncthreads();
      // Bins from the highest digit down, kBinsPerThread consecutive ones per thread: the
      // chosen digit is where the running count first reaches `remaining`.
      const auto count_at = [&](int from_top) {
        return from_top < bins ? s.hist[bins - 1 - from_top] : 0;
      };
      const int first = tid * kBinsPerThread;
      int sum = 0;
      for (int i = 0; i < kBinsPerThread; ++i) sum += count_at(first + i);
      int total = 0;
      int above = block_exclusive_sum(sum, s.warp_sums, total);
      if (pass == 0 && tid == 0) s.visible = total;
      for (int i = 0; i < kBinsPerThread; ++i) {
        const int c = count_at(first + i);
        if (above < remaining && above + c >= remaining) {
          s.digit = bins - 1 - (first + i);
          s.remaining = static_cast<int>(remaining - above);
          s.digit_count = c;
        }
        above += c;
      }
      __syncthreads();
      if (pass == 0 && s.visible <= p.k) {
        take_all = true;
        break;
      }
      threshold |= static_cast<uint32_t>(s.digit) << shift;
      remaining = s.remaining;
      if (pass == kPasses - 1) {
        ties_needed = remaining;
        all_ties = remaining == s.digit_count;
      }
    }
    const int64_t selected = take_all ? s.visible : p.k;

    // Gather: keys above the threshold, and the first ties_needed ties in block-id order.
    int64_t ties_before = 0;
    for (int64_t base = 0; base < nb; base += kThreads) {
      const int64_t j = base + tid;
      const uint32_t key = j < nb ? key_at(j) : 0;
      const bool tie = !take_all && key == threshold;
      bool take = key > threshold || (tie && all_ties);
      if (!take_all && !all_ties && ties_before < ties_needed) {
        int total = 0;
        const int before = block_exclusive_sum(tie, s.warp_sums, total);
        take = take || (tie && ties_before + before < ties_needed);
        ties_before += total;
      }
      if (take) {
        const int pos = atomicAdd(&s.selected, 1);
        buf[pos] = (static_cast<uint64_t>(key) << 32) | (0xffffffffu - static_cast<uint32_t>(j));
      }
    }

    // Sort (padding composites of 0 sort last) and emit, -1 beyond the selection.
    int64_t n = 1;
    while (n < selected) n *= 2;
    for (int64_t i = selected + tid; i < n; i += kThreads) buf[i] = 0;
    __syncthreads();
    bitonic_sort_descending(buf, n);
    for (int64_t j = tid; j < p.k; j += kThreads) {
      out[j * p.out_col_stride] =
          j < selected ? static_cast<int32_t>(0xffffffffu - static_cast<uint32_t>(buf[j])) : -1;
    }
    __syncthreads();
  }
}

}  // namespace
}  // namespace cuda::select

void detail::native_topk_blocks(const TopkBlocksParams& p) {
  using namespace cuda::select;
  const int64_t total_rows = p.batch * p.rows;
  if (total_rows == 0) return;
  cuda::DeviceGuard guard(p.device_index);
  const auto stream = static_cast<cudaStream_t>(p.stream);

  TopkProblem t{};
  t.total_rows = total_rows;
  t.rows = p.rows;
  t.num_blocks = p.num_blocks;
  t.k = p.k;
  t.scores = p.scores;
  t.scores_batch_stride = p.scores_batch_stride;
  t.scores_row_stride = p.scores_row_stride;
  t.scores_col_stride = p.scores_col_stride;
  t.out = p.out;
  t.out_batch_stride = p.out_batch_stride;
  t.out_row_stride = p.out_row_stride;
  t.out_col_stride = p.out_col_stride;
  t.sort_capacity = 1;
  while (t.sort_capacity < std::min(p.k, p.num_blocks)) t.sort_capacity *= 2;

  const int sms = cuda::sm_count(p.device_index);
  const auto kernel = topk_blocks_kernel;
  if (t.sort_capacity <= kMaxSharedSort) {
    // Rows are independent and equally long: enough CTAs for every SM, each looping over rows.
    const int64_t grid = std::min<int64_t>(total_rows, int64_t{sms} * 16);
    const size_t smem = static_cast<size_t>(t.sort_capacity) * sizeof(uint64_t);
    SPARSE_ATTN_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                int(kMaxSharedSort * 8)));
    kernel<<<unsigned(grid), kThreads, smem, stream>>>(t);
    SPARSE_ATTN_CUDA_CHECK_LAUNCH();
    return;
  }
  // Large selections: one resident wave of CTAs, each with its own global sort buffer, fewer
  // CTAs where the buffers would pass kMaxGlobalSortBytes.
  const int64_t per_cta = t.sort_capacity * int64_t{sizeof(uint64_t)};
  const int64_t grid = std::clamp<int64_t>(kMaxGlobalSortBytes / per_cta, 1,
                                           std::min<int64_t>(total_rows, int64_t{sms} * 2));
  const size_t bytes = static_cast<size_t>(grid * t.sort_capacity) * sizeof(uint64_t);
  void* workspace = nullptr;
  SPARSE_ATTN_CUDA_CHECK(cudaMallocAsync(&workspace, bytes, stream));
  t.global_sort = static_cast<uint64_t*>(workspace);
  kernel<<<unsigned(grid), kThreads, 0, stream>>>(t);
  const cudaError_t launch = cudaGetLastError();
  SPARSE_ATTN_CUDA_CHECK(cudaFreeAsync(workspace, stream));
  cuda::check(launch, "kernel launch", __FILE__, __LINE__);
}

}  // namespace sparse_attn
