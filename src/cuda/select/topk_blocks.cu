// Native top-k of QSA's selection (qsa_topk_blocks, and the fused selections' second step): one
// CTA per row (rows strided over the grid), bit-exact with the reference
// (src/reference/qsa_select_ref.cpp).
//
// Each score maps to a 32-bit key whose unsigned order is the float order (-0 and +0 share one
// key, as they compare equal); non-finite scores are never counted or taken. A block's
// composite (key, ~id) is unique, and its descending order is the reference's (score
// descending, ties by ascending id). Per row:
//   0. a row of at most kRegisterScores scores a thread (8192 at 512 threads a row: the decode
//      rows of contexts up to 32K tokens) is read once, into registers. Its scores are binned
//      linearly between the row's lowest and highest (4096 bins: a row of dot products holds a few
//      scores a bin, where the key's first digit below holds ~100), each bin's start from the top
//      is counted, and every score in the bin of the k-th or above is stored at the next slot of
//      its bin; its final index is its bin's start plus the larger composites in its bin. One read,
//      no radix, no sort. A row whose scores do not spread (a crowded bin, or a range float cannot
//      scale) goes on to step 1;
//   1. one pass over the row histograms the first 12 bits of the keys; the bin holding the k-th
//      block is usually a few percent of the row;
//   2. one more pass copies the blocks of that bin and of the higher ones (the candidates, every
//      visible block when there are at most k) into shared memory;
//   3. the usual case, up to half the candidate buffer: the candidates are ordered by counting.
//      Their keys span a few first-digit bins, cut into 4096 equal ranges; a histogram of the
//      ranges, each range's start (the count of the ranges above it), each candidate copied to
//      the next slot of its range. A candidate's final index is its range's start plus the
//      number of larger composites in its range (ranges hold a few candidates), and the ones
//      below k are stored there: no sort.
//   4. otherwise (a crowded range: many equal or nearly equal scores, or many candidates) a
//      radix select finds the key T of the k-th block (digits of 12, 12 and 8 bits; a bin too
//      large for the candidate buffer is first narrowed by more passes over the row), the
//      blocks above T and the lowest-id ties at T are taken, and the selection is sorted by a
//      bitonic network.
//
// Per score, the first pass costs the key and one shared atomic, with no test or branch; the
// second two float compares and a bit of a mask, and a store only for the few scores at or
// above the bin (docs/perf-notes.md, issue 17, says where the rest of the time goes).
#include <cuda_runtime.h>

#include <algorithm>
#include <cfloat>
#include <climits>
#include <cstdint>
#include <type_traits>

#include "api/qsa_select_params.h"
#include "cuda/common/check.h"
#include "cuda/common/device_guard.h"
#include "cuda/common/device_props.h"
#include "cuda/common/kernel_attributes.h"
#include "cuda/select/expand_rule.cuh"
#include "cuda/select/topk_problem.h"

namespace sparse_attn {
namespace cuda::select {
namespace {

// Three shapes of CTA, measured (docs/perf-notes.md, issue 17): with rows for several waves,
// four 256-thread CTAs an SM hide each other's barrier and load latency (a row's fixed work is
// dozens of barriers); with fewer rows than the SMs hold, 512 threads a row finish each sooner;
// and with at most a row an SM, one CTA an SM lifts the register cap that two impose. The
// candidate buffer is what the CTA's share of shared memory allows.
template <int Threads, int CtasPerSm, int Candidates>
struct Config {
  static constexpr int kThreads = Threads;
  static constexpr int kWarps = Threads / 32;
  static constexpr int kCtasPerSm = CtasPerSm;
  static constexpr int kCandidates = Candidates;  // composites in dynamic shared memory
  static constexpr size_t kCandidateBytes = size_t{Candidates} * sizeof(uint64_t);
};
using ManyRows = Config<256, 4, 4096>;
using FewRows = Config<512, 2, 8192>;
// At most a row an SM (a decode batch): the same CTA, given all the registers it wants (step 0's
// 16 scores a thread spill at FewRows' 64).
using RowPerSm = Config<512, 1, 8192>;

constexpr int kMaxBins = 1 << 12;
// Global sort buffers (selections above kTopkMaxSharedSort) are capped at this many bytes in
// all, by running fewer CTAs.
constexpr int64_t kMaxGlobalSortBytes = int64_t{1} << 30;
// A warp's share of the sort in registers (two elements a lane); the sorted length is a power of
// two of at least this.
constexpr int kSortChunk = 64;

// The radix digits, most significant first: 12 + 12 + 8 bits. The first holds the sign, the
// exponent and 3 mantissa bits, so scores of one magnitude still spread over 8 bins an octave.
__device__ __forceinline__ int next_digit_bits(int shift) { return shift > 8 ? 12 : 8; }

// What a radix pass found: the digit whose bin holds the remaining-th largest value.
struct PassResult {
  int digit;        // the chosen digit
  int remaining;    // values still to take at and below the chosen prefix
  int digit_count;  // values that carry the chosen prefix
};

// The block-wide scans alternate between two copies of their shared outputs (by a round counter
// every thread advances alike), so a scan needs no barrier after its readers: the copy it
// writes was last read before the barrier of the scan in between.
template <typename C>
struct SharedStorage {
  // All zero between radix passes: each pass's scan clears the bins it reads, so a pass starts
  // with no clearing loop and no barrier for it.
  alignas(16) int hist[kMaxBins];
  int warp_sums[2][C::kWarps];
  PassResult result[2];
  int selected;                      // append cursor of the selection
  int candidates;                    // append cursor of the candidates
  unsigned work;                     // the placement's in-bin compares (sum of its bins' sizes^2)
  int digits[2];                     // the first pass's lowest and highest non-empty finite bins
  uint32_t warp_keys[2][C::kWarps];  // step 0: each warp's lowest and highest finite keys
  int threshold_bin;                 // step 0: the bin holding the k-th score
};

// The candidates are ordered by counting (the kernel's comment, step 3) while their in-range
// compares stay under this many a thread; rows with a crowded range take step 4 instead.
constexpr unsigned kRankComparesPerThread = 256;
// A thread's share of s.work saturates here (above every budget), so the sums fit 32 bits.
constexpr unsigned kWorkCap = 1u << 20;

// Zeroes s.hist; every thread calls it, and a barrier must pass before the bins are counted.
template <typename C>
__device__ void clear_bins(SharedStorage<C>& s) {
  for (int i = threadIdx.x; i < kMaxBins / 4; i += C::kThreads)
    reinterpret_cast<int4*>(s.hist)[i] = make_int4(0, 0, 0, 0);
}

// Unsigned order of the key == float order, for every float: f + 0 turns -0 into +0, so the two
// share one key (IEEE round-to-nearest; the build does not flush denormals), then negative
// values have every bit flipped and the others the sign bit only.
__device__ __forceinline__ uint32_t raw_key(float f) {
  const uint32_t u = __float_as_uint(__fadd_rn(f, 0.0f));
  return u ^ (static_cast<uint32_t>(static_cast<int32_t>(u) >> 31) | 0x80000000u);
}

// The keys of the finite scores are [key(-FLT_MAX), key(FLT_MAX)]; -inf and -NaN lie below,
// +inf and +NaN above. In the first digit (key >> 20) the non-finite keys fill bins 0-7 and
// 0xff8-0xfff, and nothing else does: the first pass counts every score and its scan ignores
// those bins, with no per-element test.
constexpr uint32_t kLowestFiniteKey = 0x00800000u, kHighestFiniteKey = 0xff7fffffu;
constexpr int kFirstDigitShift = 20;
__device__ __forceinline__ bool finite_first_digit(int bin) { return bin >= 8 && bin < 0xff8; }

// The key, or 0 (below every finite key) for a non-finite score.
__device__ __forceinline__ uint32_t order_key(float f) {
  const uint32_t k = raw_key(f);
  return k - kLowestFiniteKey <= kHighestFiniteKey - kLowestFiniteKey ? k : 0;
}

// The float whose key is `key` (+0 for the zeros' key).
__device__ __forceinline__ float key_value(uint32_t key) {
  return __uint_as_float(key & 0x80000000u ? key ^ 0x80000000u : ~key);
}

__device__ __forceinline__ uint64_t composite(uint32_t key, uint32_t id) {
  return (static_cast<uint64_t>(key) << 32) | (0xffffffffu - id);
}

// Inclusive sum of `v` over the lanes of the warp, up to this lane; every lane calls it.
__device__ __forceinline__ int warp_inclusive_sum(int v) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int d = 1; d < 32; d *= 2) {
    const int n = __shfl_up_sync(0xffffffffu, v, d);
    if (lane >= d) v += n;
  }
  return v;
}

// Exclusive sum of `v` over the threads of the block, and the block total; every thread calls it
// with the same `round`, which it advances.
template <typename C>
__device__ __forceinline__ int block_exclusive_sum(int v, SharedStorage<C>& s, int& round,
                                                   int& total) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  int* const warp_sums = s.warp_sums[round++ & 1];
  const int inclusive = warp_inclusive_sum(v);
  if (lane == 31) warp_sums[warp] = inclusive;
  __syncthreads();
  int before = inclusive - v;
  total = 0;
#pragma unroll
  for (int w = 0; w < C::kWarps; ++w) {
    const int n = warp_sums[w];
    if (w < warp) before += n;
    total += n;
  }
  return before;
}

// Where the radix select stands: the values carrying `prefix` in the bits at and above
// `shift` hold the k-th; `remaining` of them are still to take, `count` carry the prefix.
struct RadixState {
  uint32_t prefix = 0;
  int shift = 32;
  int remaining;
  int count = 0;
  __device__ bool carries(uint32_t v) const {
    return shift == 32 || (v >> shift) == (prefix >> shift);
  }
};

// Reads this thread's kBinsPerThread consecutive bins of s.hist, from the highest down:
// counts[i] is bin kMaxBins - 1 - first - i (first = tid * kBinsPerThread). Each thread reads
// its bins as 16-byte words (scalar loads kBinsPerThread words apart conflict that many ways)
// and, with `zero`, zeroes them: no other thread reads them. Returns where they are (null for
// a thread past the bins).
template <typename C>
__device__ __forceinline__ int4* read_bins(SharedStorage<C>& s, int bins,
                                           int (&counts)[kMaxBins / C::kThreads], bool zero) {
  constexpr int kBinsPerThread = kMaxBins / C::kThreads;
  static_assert(kMaxBins % C::kThreads == 0 && kBinsPerThread % 4 == 0,
                "each thread scans whole 16-byte words of bins");
  const int first = threadIdx.x * kBinsPerThread;
  int4* const h =
      first < bins ? reinterpret_cast<int4*>(s.hist + bins - kBinsPerThread - first) : nullptr;
  if (h) {
#pragma unroll
    for (int v = 0; v < kBinsPerThread / 4; ++v) {
      const int4 w = h[v];
      counts[kBinsPerThread - 1 - 4 * v] = w.x;
      counts[kBinsPerThread - 2 - 4 * v] = w.y;
      counts[kBinsPerThread - 3 - 4 * v] = w.z;
      counts[kBinsPerThread - 4 - 4 * v] = w.w;
      if (zero) h[v] = make_int4(0, 0, 0, 0);
    }
  }
  return h;
}

// The second half of a radix pass, once s.hist holds the counts of the next digit (`bits`
// wide) and a barrier has passed: narrows the state to the digit whose bin holds the
// remaining-th largest, and zeroes the bins for the next pass. Returns how many values were
// counted. Every thread calls it, with the same `round`. Two barriers: in the scan, after the
// choice. With `first_digit_of_keys` (the first pass over a row's keys) the bins of non-finite
// keys count as empty, and s.digits gets the lowest and highest non-empty bins (visible after
// the next barrier).
template <typename C>
__device__ int choose_digit(SharedStorage<C>& s, RadixState& st, int& round, int bits,
                            bool first_digit_of_keys) {
  constexpr int kBinsPerThread = kMaxBins / C::kThreads;
  const int bins = 1 << bits;
  const int shift = st.shift - bits;
  // The chosen digit is where the running count from the top first reaches `remaining`.
  const int first = threadIdx.x * kBinsPerThread;
  int counts[kBinsPerThread] = {};
  read_bins<C>(s, bins, counts, true);
  if (first_digit_of_keys) {
#pragma unroll
    for (int i = 0; i < kBinsPerThread; ++i)
      if (!finite_first_digit(bins - 1 - (first + i))) counts[i] = 0;
  }
  int sum = 0;
#pragma unroll
  for (int i = 0; i < kBinsPerThread; ++i) sum += counts[i];
  PassResult* const result = &s.result[round & 1];
  int total = 0;
  int above = block_exclusive_sum<C>(sum, s, round, total);
  if (first_digit_of_keys && sum > 0 && (above == 0 || above + sum == total)) {
    // The thread holding the highest (lowest) non-empty bin.
#pragma unroll
    for (int i = kBinsPerThread - 1; i >= 0; --i)
      if (above == 0 && counts[i] > 0) s.digits[1] = bins - 1 - (first + i);
#pragma unroll
    for (int i = 0; i < kBinsPerThread; ++i)
      if (above + sum == total && counts[i] > 0) s.digits[0] = bins - 1 - (first + i);
  }
  if (total < st.remaining) return total;  // uniform: fewer values than wanted, nothing chosen
  if (above < st.remaining && above + sum >= st.remaining) {  // one thread: the crossing is here
#pragma unroll
    for (int i = 0; i < kBinsPerThread; ++i) {
      const int c = counts[i];
      if (above < st.remaining && above + c >= st.remaining)
        *result = PassResult{bins - 1 - (first + i), st.remaining - above, c};
      above += c;
    }
  }
  __syncthreads();
  const PassResult chosen = *result;
  st.prefix |= static_cast<uint32_t>(chosen.digit) << shift;
  st.shift = shift;
  st.remaining = chosen.remaining;
  st.count = chosen.digit_count;
  return total;
}

// Once s.hist holds counts (and a barrier has passed): replaces every bin's count by the
// number of values in the bins above it (where the bin's values start in descending order),
// adds the squared sizes of the bins that start below `wanted` (the bins of the wanted largest
// values) to s.work (one atomic a warp: shared 64-bit or contended atomics serialise), sets
// s.threshold_bin to the bin holding the wanted-th value when there are that many, and ends
// with a barrier. Every thread calls it, with the same `round`.
template <typename C>
__device__ void bin_starts(SharedStorage<C>& s, int& round, int wanted = INT_MAX) {
  constexpr int kBinsPerThread = kMaxBins / C::kThreads;
  int counts[kBinsPerThread] = {};
  int4* const h = read_bins<C>(s, kMaxBins, counts, false);
  int sum = 0;
#pragma unroll
  for (int i = 0; i < kBinsPerThread; ++i) sum += counts[i];
  int total = 0;
  int run = block_exclusive_sum<C>(sum, s, round, total);
  int start[kBinsPerThread];
  unsigned work = 0;
#pragma unroll
  for (int i = 0; i < kBinsPerThread; ++i) {
    start[i] = run;
    if (run < wanted) {
      const unsigned c = min(static_cast<unsigned>(counts[i]), 1024u);
      work = min(work + c * c, kWorkCap);
      if (run + counts[i] >= wanted)
        s.threshold_bin = kMaxBins - 1 - (threadIdx.x * kBinsPerThread + i);
    }
    run += counts[i];
  }
#pragma unroll
  for (int v = 0; v < kBinsPerThread / 4; ++v)
    h[v] = make_int4(start[kBinsPerThread - 1 - 4 * v], start[kBinsPerThread - 2 - 4 * v],
                     start[kBinsPerThread - 3 - 4 * v], start[kBinsPerThread - 4 - 4 * v]);
  work = __reduce_add_sync(0xffffffffu, work);
  if (threadIdx.x % 32 == 0 && work != 0) atomicAdd(&s.work, work);
  __syncthreads();
}

// Once the candidates placed[0, n) sit in their bins, bin d spanning [hist[d + 1], hist[d])
// (the top bin from 0) with bin(x) its bin: stores each at its index in descending order (its
// bin's start plus the larger composites in its bin) where that index is below k. Every thread
// calls it.
template <typename C, typename Bin>
__device__ __forceinline__ void store_ranked(const SharedStorage<C>& s, const uint64_t* placed,
                                             int n, int k, uint64_t* buf, Bin&& bin) {
  for (int c = threadIdx.x; c < n; c += C::kThreads) {
    const uint64_t x = placed[c];
    const int d = bin(x);
    const int end = s.hist[d];
    int index = d + 1 < kMaxBins ? s.hist[d + 1] : 0;
    for (int e = index; e < end; ++e) index += placed[e] > x;
    if (index < k) buf[index] = x;
  }
}

// One radix pass: histograms the next digit of the values visit(f) yields (f(value) per value,
// from every thread) that carry the state's prefix, then chooses the digit.
template <typename C, typename Visit>
__device__ int radix_pass(SharedStorage<C>& s, RadixState& st, int& round, Visit&& visit) {
  const int bits = next_digit_bits(st.shift);
  const int shift = st.shift - bits;
  const RadixState cur = st;
  visit([&](uint32_t v) {
    if (cur.carries(v)) atomicAdd(&s.hist[(v >> shift) & ((1 << bits) - 1)], 1);
  });
  __syncthreads();
  return choose_digit<C>(s, st, round, bits, false);
}

// Calls group(x, j) with kUnroll vectors of four scores x[u] (columns j[u] to j[u] + 3) and
// f1(score, column) for the columns [lo, hi) of a row, each column once, spread over the
// threads: group on 16-byte loads where the row is contiguous, kUnroll of them in flight per
// thread, f1 on the rest. Every thread of the block makes the same group calls (vectors past the
// row are NaN), so group may use warp collectives; f1 may not. Columns are below 2^31 (num_blocks
// is checked), so they are 32-bit here.
constexpr int kUnroll = 4;
template <typename C, typename Group, typename F1>
__device__ __forceinline__ void for_each_score(const float* row, int64_t stride, int lo, int hi,
                                               Group&& group, F1&& f1) {
  constexpr int kThreads = C::kThreads;
  const int tid = threadIdx.x;
  if (stride != 1) {
    for (int j = lo + tid; j < hi; j += kThreads) f1(row[j * stride], j);
    return;
  }
  const float* p = row + lo;
  const int n = hi - lo;
  const int head = min(n, int((16 - (reinterpret_cast<uintptr_t>(p) & 15)) & 15) / 4);
  if (tid < head) f1(p[tid], lo + tid);
  const float4* v = reinterpret_cast<const float4*>(p + head);
  const int nv = (n - head) / 4;
  for (int base = 0; base < nv; base += kUnroll * kThreads) {
    float4 x[kUnroll];
    int j[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int i = base + u * kThreads + tid;
      x[u] = i < nv ? __ldg(v + i) : make_float4(NAN, NAN, NAN, NAN);
      j[u] = lo + head + 4 * i;
    }
    group(x, j);
  }
  const int tail = head + 4 * nv;
  if (tail + tid < n) f1(p[tail + tid], lo + tail + tid);
}

// f(score, column) for every score of for_each_score's groups.
template <typename F>
__device__ __forceinline__ auto each_score(F&& f) {
  return [&f](const float4(&x)[kUnroll], const int(&j)[kUnroll]) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      f(x[u].x, j[u]);
      f(x[u].y, j[u] + 1);
      f(x[u].z, j[u] + 2);
      f(x[u].w, j[u] + 3);
    }
  };
}

// f(key, column) for the finite scores of a row's columns [lo, hi).
template <typename C, typename F>
__device__ __forceinline__ void for_each_key(const float* row, int64_t stride, int lo, int hi,
                                             F&& f) {
  const auto f1 = [&](float x, int j) {
    const uint32_t key = order_key(x);
    if (key != 0) f(key, j);
  };
  for_each_score<C>(row, stride, lo, hi, each_score(f1), f1);
}

// The first pass over a row: the histogram of the first digit of every score's key, with no
// test per score (finite_first_digit), then the choice.
template <typename C>
__device__ int first_pass(SharedStorage<C>& s, RadixState& st, int& round, const float* row,
                          int64_t stride, int lo, int hi) {
  int* const hist = s.hist;
  const auto count = [&](float x, int) { atomicAdd(hist + (raw_key(x) >> kFirstDigitShift), 1); };
  for_each_score<C>(row, stride, lo, hi, each_score(count), count);
  __syncthreads();
  return choose_digit<C>(s, st, round, 32 - kFirstDigitShift, true);
}

// The scores of a row whose keys are finite and at least `lowest` (a finite key) are the ones
// `at_least(lowest)` accepts: two float compares (NaN fails both).
__device__ __forceinline__ auto at_least(uint32_t lowest) {
  const float low = key_value(lowest);
  return [low](float x) { return x >= low && x <= FLT_MAX; };
}

// Stores every score of a row's columns [lo, hi) that `wanted` accepts: store(slot, score,
// column), at slots taken from *cursor. Every thread calls it. Per group of kUnroll vectors a
// thread keeps its tests as a bit mask, and its warp makes one scan of the counts and one shared
// atomic; a score costs its test and a bit, and a store only when it is taken.
template <typename C, typename Wanted, typename Store>
__device__ __forceinline__ void append_scores(const float* row, int64_t stride, int lo, int hi,
                                              Wanted wanted, int* cursor, Store&& store) {
  static_assert(4 * kUnroll <= 32, "a group's tests fit one mask");
  const int lane = threadIdx.x % 32;
  const auto one = [&](float x, int j) {
    if (wanted(x)) store(atomicAdd(cursor, 1), x, j);
  };
  const auto group = [&](const float4(&x)[kUnroll], const int(&j)[kUnroll]) {
    uint32_t mask = 0;
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      mask |= uint32_t{wanted(x[u].x)} << (4 * u);
      mask |= uint32_t{wanted(x[u].y)} << (4 * u + 1);
      mask |= uint32_t{wanted(x[u].z)} << (4 * u + 2);
      mask |= uint32_t{wanted(x[u].w)} << (4 * u + 3);
    }
    const int n = __popc(mask);
    const int inclusive = warp_inclusive_sum(n);
    int first = 0;
    if (lane == 31 && inclusive > 0) first = atomicAdd(cursor, inclusive);
    int slot = __shfl_sync(0xffffffffu, first, 31) + inclusive - n;
    if (mask != 0) {
      // A few scores a thread, mostly none: the loop runs over the set bits only, reading the
      // scores by index (from local memory) rather than testing all of them.
      float v[4 * kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        v[4 * u] = x[u].x;
        v[4 * u + 1] = x[u].y;
        v[4 * u + 2] = x[u].z;
        v[4 * u + 3] = x[u].w;
      }
      do {
        const unsigned b = __ffs(mask) - 1;
        mask &= mask - 1;
        store(slot++, v[b], j[0] + (b / 4) * (4 * C::kThreads) + b % 4);
      } while (mask != 0);
    }
  };
  for_each_score<C>(row, stride, lo, hi, group, one);
}

// The bitonic network's compare-exchange of the element a lane holds with the one lane ^ stride
// holds: in a descending run the lower index of the pair keeps the larger value, in an
// ascending run the smaller. One 64-bit compare and a select (max and min would be two of each).
__device__ __forceinline__ uint64_t exchange_across_lanes(uint64_t x, int stride, bool descending) {
  const uint64_t y = __shfl_xor_sync(0xffffffffu, x, stride);
  const bool keep_larger = ((threadIdx.x & stride) == 0) == descending;
  return (y > x) == keep_larger ? y : x;
}

// The stages of merge size `size` with strides 32 down to 1 on a warp's 64 consecutive elements
// from `base`: the lane holds elements base + lane (a) and base + lane + 32 (b); element i is in
// a descending run iff i & size is 0.
template <typename Index>
__device__ __forceinline__ void merge_in_registers(uint64_t& a, uint64_t& b, Index base,
                                                   Index size) {
  const int lane = threadIdx.x % 32;
  const bool da = ((base + lane) & size) == 0, db = ((base + lane + 32) & size) == 0;
  if (size >= 64 && (b > a) == da) {
    const uint64_t t = a;
    a = b;
    b = t;
  }
#pragma unroll
  for (int stride = 16; stride > 0; stride /= 2) {
    if (2 * stride > size) continue;
    a = exchange_across_lanes(a, stride, da);
    b = exchange_across_lanes(b, stride, db);
  }
}

// Sorts buf[0..n) descending; n is a power of two, at least kSortChunk. Of the network's stages
// (45 at n = 512) only those with strides of 64 and more go through memory, one barrier each;
// the others run on each warp's 64-element chunks in registers, with shuffles. Index is int for
// a sort in shared memory, int64_t for a global buffer.
template <typename C, typename Index>
__device__ void bitonic_sort_descending(uint64_t* buf, Index n) {
  constexpr Index kChunk = kSortChunk;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const auto chunks = [&](auto&& merge) {
    for (Index base = warp * kChunk; base < n; base += C::kWarps * kChunk) {
      uint64_t a = buf[base + lane], b = buf[base + lane + 32];
      merge(a, b, base);
      buf[base + lane] = a;
      buf[base + lane + 32] = b;
    }
    __syncthreads();
  };
  chunks([](uint64_t& a, uint64_t& b, Index base) {
#pragma unroll
    for (int l = 1; l <= 6; ++l) merge_in_registers<Index>(a, b, base, Index{1} << l);
  });
  static_assert(kSortChunk == 64, "the register stages above are sizes 2 to 64");
  for (Index size = 2 * kChunk; size <= n; size *= 2) {
    for (Index stride = size / 2; stride >= kChunk; stride /= 2) {
      for (Index i = threadIdx.x; i < n / 2; i += C::kThreads) {
        const Index lo = 2 * i - (i & (stride - 1));
        const Index hi = lo + stride;
        const bool descending = (lo & size) == 0;
        const uint64_t a = buf[lo], b = buf[hi];
        if ((b > a) == descending) {
          buf[lo] = b;
          buf[hi] = a;
        }
      }
      __syncthreads();
    }
    chunks([size](uint64_t& a, uint64_t& b, Index base) { merge_in_registers(a, b, base, size); });
  }
}

// Writes the sorted selection buf[0..selected) as block ids (then -1), and, when asked, its
// expansion to token ids at position `pos` and their count (qsa_expand_blocks' rule: block b is
// kept iff 4b + 3 <= pos, in order, then the tail of the current block, then -1). k is at most
// INT32_MAX, and 4k + 3 fits 32 bits where there are tokens (both checked at the API), so the
// loops count in 32 bits: the row's last phase is a chain of dependent instructions, and 64-bit
// counters lengthened it. The selection's ids are below `hi` (the row's columns end).
template <typename C>
__device__ void emit_row(const TopkProblem& p, SharedStorage<C>& s, int& round, const uint64_t* buf,
                         int selected, int64_t r, int32_t pos, int hi) {
  constexpr int kThreads = C::kThreads;
  const int tid = threadIdx.x;
  const auto id_at = [&](int j) {
    return static_cast<int32_t>(0xffffffffu - static_cast<uint32_t>(buf[j]));
  };
  const int64_t b = r / p.rows, i = r % p.rows;
  const auto k = static_cast<uint32_t>(p.k);
  {
    const int64_t cs = p.out_col_stride;
    int32_t* o = p.out + b * p.out_batch_stride + i * p.out_row_stride + tid * cs;
    for (uint32_t j = tid; j < k; j += kThreads, o += kThreads * cs)
      *o = j < static_cast<uint32_t>(selected) ? id_at(static_cast<int>(j)) : -1;
  }
  if (!p.tokens && !p.counts) return;
  const int64_t tcs = p.tokens_col_stride;
  int32_t* const tokens =
      p.tokens ? p.tokens + b * p.tokens_batch_stride + i * p.tokens_row_stride : nullptr;
  // Block id's 4 tokens, as the slot-th kept block: the row's tokens 4 slot .. 4 slot + 3.
  const auto write_block = [&](int slot, int32_t id) {
    int32_t* t = tokens + int64_t{kBlockTokens} * slot * tcs;
#pragma unroll
    for (int e = 0; e < kBlockTokens; ++e) t[e * tcs] = kBlockTokens * id + e;
  };
  // Block id is kept iff 4 id + 3 <= pos, i.e. id < (pos + 1) / 4 (pos >= -1).
  const auto kept_below = static_cast<int32_t>((int64_t{pos} + 1) / kBlockTokens);
  int kept = 0;  // uniform: block totals
  if (hi <= kept_below) {
    // Every column is a complete block in the past (a decode row's usual window): the whole
    // selection is kept, block j's tokens at 4 j, with no scan and its barrier.
    if (tokens) {
      for (int j = tid; j < selected; j += kThreads) write_block(j, id_at(j));
    }
    kept = selected;
  }
  for (int base = kept; base < selected; base += kThreads) {
    const int j = base + tid;
    const int32_t id = j < selected ? id_at(j) : -1;
    const bool keep = id >= 0 && id < kept_below;
    int total = 0;
    const int before = block_exclusive_sum<C>(keep, s, round, total);
    if (keep && tokens) write_block(kept + before, id);
    kept += total;
  }
  const int filled = kBlockTokens * kept;
  const int tail =
      write_tail<int>(tokens, tcs, pos, filled,
                      kBlockTokens * static_cast<int>(k) + kBlockTokens - 1, tid, kThreads);
  if (p.counts && tid == 0)
    p.counts[b * p.counts_batch_stride + i * p.counts_row_stride] = filled + tail;
}

// Step 0 of the kernel's comment, for a row of at most kRegisterScores scores a thread
// (columns [lo, hi)). Returns true with the row's selection in order in buf[0, selected)
// (selected = min(visible scores, k)) and s.hist still holding the placement's bin ends, to be
// cleared after a barrier; false, with s.hist and s.work zero again after a barrier, when the
// row's scores do not spread enough for it. Every thread calls it; the outcome is uniform.
constexpr int kRegisterScores = 16;
template <typename C>
__device__ bool select_in_registers(SharedStorage<C>& s, int& round, const float* row, int64_t cs,
                                    int lo, int hi, int k, uint64_t* cand, uint64_t* buf,
                                    int& selected) {
  constexpr int kThreads = C::kThreads;
  static_assert(kRegisterScores * kThreads <= C::kCandidates, "every visible score fits cand");
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  // Column lo + tid + i * kThreads; NaN past the row. The row's columns are few enough for
  // 32-bit offsets, and a unit stride makes them immediates of one base: the index arithmetic
  // of 16 64-bit column offsets was a quarter of the row's instructions.
  float x[kRegisterScores];
  const int n = hi - lo;
  if (cs == 1) {
    const float* const base = row + lo + tid;
#pragma unroll
    for (int i = 0; i < kRegisterScores; ++i)
      x[i] = tid + i * kThreads < n ? base[i * kThreads] : NAN;
  } else {
    const float* const base = row + (int64_t{lo} + tid) * cs;
    const int64_t step = kThreads * cs;
#pragma unroll
    for (int i = 0; i < kRegisterScores; ++i) x[i] = tid + i * kThreads < n ? base[i * step] : NAN;
  }
  const auto finite = [](float v) { return fabsf(v) <= FLT_MAX; };
  // The thread's lowest and highest finite scores as floats (-0 and +0 may come out either way:
  // they share a key), then as keys for the warp's integer reductions; +inf and -inf, the
  // identities, have keys above and below every finite one.
  float low_f = INFINITY, high_f = -INFINITY;
  int visible = 0;
#pragma unroll
  for (int i = 0; i < kRegisterScores; ++i) {
    const bool f = finite(x[i]);
    low_f = fminf(low_f, f ? x[i] : INFINITY);
    high_f = fmaxf(high_f, f ? x[i] : -INFINITY);
    visible += f;
  }
  uint32_t lowest = __reduce_min_sync(0xffffffffu, raw_key(low_f));
  uint32_t highest = __reduce_max_sync(0xffffffffu, raw_key(high_f));
  if (lane == 0) {
    s.warp_keys[0][warp] = lowest;
    s.warp_keys[1][warp] = highest;
  }
  int total = 0;
  block_exclusive_sum<C>(visible, s, round, total);  // its barrier publishes warp_keys too
  visible = total;
#pragma unroll
  for (int w = 0; w < C::kWarps; ++w) {
    lowest = min(lowest, s.warp_keys[0][w]);
    highest = max(highest, s.warp_keys[1][w]);
  }
  // Bins linear in value: rounding keeps bin() monotone (x > y gives bin(x) >= bin(y), equal
  // scores share a bin), so the descending order is (bin, composite) descending.
  const float low = key_value(lowest), range = key_value(highest) - low;
  // Any positive finite scale keeps the bins monotone, so the approximate division will do (an
  // exact one has a slow path: a call, with every live register spilled around it).
  const float scale = __fdividef(float{kMaxBins}, range);
  if (visible == 0 || !(range > 0.0f && range <= FLT_MAX && scale > 0.0f && scale <= FLT_MAX))
    return false;
  const auto bin = [&](float v) { return min(kMaxBins - 1, __float2int_rz((v - low) * scale)); };
  // No branch a score: a non-finite one adds 0, to a bin of its own thread's (no conflicts).
#pragma unroll
  for (int i = 0; i < kRegisterScores; ++i) {
    const bool f = finite(x[i]);
    atomicAdd(&s.hist[f ? bin(x[i]) : tid % kMaxBins], int{f});
  }
  __syncthreads();
  selected = min(visible, k);
  bin_starts<C>(s, round, selected);
  if (s.work > kRankComparesPerThread * kThreads) {
    __syncthreads();  // every thread has read s.work
    clear_bins(s);
    if (tid == 0) s.work = 0;
    __syncthreads();
    return false;
  }
  const int threshold = s.threshold_bin;
#pragma unroll
  for (int i = 0; i < kRegisterScores; ++i) {
    if (finite(x[i]) && bin(x[i]) >= threshold) {
      const auto j = static_cast<uint32_t>(lo + tid + i * kThreads);
      cand[atomicAdd(&s.hist[bin(x[i])], 1)] = composite(raw_key(x[i]), j);
    }
  }
  __syncthreads();
  // The candidates are cand[0, hist[threshold]); a candidate's bin is its score's, which its
  // key gives back exactly.
  store_ranked<C>(s, cand, s.hist[threshold], k, buf,
                  [&](uint64_t x) { return bin(key_value(static_cast<uint32_t>(x >> 32))); });
  return true;
}

// kSharedSort: the selection is sorted in dynamic shared memory (then global_sort is null),
// otherwise in the CTA's part of global_sort (sort_capacity composites a CTA).
template <typename C, bool kSharedSort>
__global__ void __launch_bounds__(C::kThreads, C::kCtasPerSm)
    topk_kernel(const TopkProblem p, uint64_t* global_sort, int64_t sort_capacity) {
  constexpr int kThreads = C::kThreads, kCandidates = C::kCandidates;
  using SortIndex = std::conditional_t<kSharedSort, int, int64_t>;
  // Dynamic shared memory: the candidates (composites), then the selection when it is sorted
  // here.
  extern __shared__ uint4 dynamic_smem[];
  __shared__ SharedStorage<C> s;
  auto* smem = reinterpret_cast<char*>(dynamic_smem);
  uint64_t* const cand = reinterpret_cast<uint64_t*>(smem);  // [kCandidates]
  uint64_t* buf;
  if constexpr (kSharedSort) {
    buf = reinterpret_cast<uint64_t*>(smem + C::kCandidateBytes);
  } else {
    buf = global_sort + blockIdx.x * sort_capacity;
  }
  const int tid = threadIdx.x;
  for (int i = tid; i < kMaxBins; i += kThreads) s.hist[i] = 0;
  int round = 0;  // of the block-wide scans (SharedStorage)
  __syncthreads();
  // A programmatic launch (launch_topk) reads the previous grid's scores only after it has
  // completed; otherwise a no-op.
  cudaGridDependencySynchronize();

  for (int64_t r = p.row_begin + blockIdx.x; r < p.row_end; r += gridDim.x) {
    const int64_t l = r - p.row_begin;
    const int64_t score_batch = l / p.score_rows, score_row = l % p.score_rows;
    const float* row =
        p.scores + score_batch * p.scores_batch_stride + score_row * p.scores_row_stride;
    int lo = 0, hi = static_cast<int>(p.num_blocks);
    int32_t pos = -1;
    if (p.windows) {
      const RowWindow w = p.windows[l];
      lo = w.lo;
      hi = w.hi;
      pos = w.pos;
    }
    const int64_t cs = p.scores_col_stride;
    const auto visit_row = [&](auto&& f) {
      for_each_key<C>(row, cs, lo, hi, [&](uint32_t key, int) { f(key); });
    };
    const auto append = [&](uint64_t c) { buf[atomicAdd(&s.selected, 1)] = c; };
    const auto candidate = [&](int c, float x, int j) {
      cand[c] = composite(raw_key(x), static_cast<uint32_t>(j));
    };
    if (tid == 0) {
      s.selected = s.candidates = 0;
      s.work = 0;
    }

    const int k = static_cast<int>(std::min<int64_t>(p.k, INT_MAX));
    int register_selected = 0;
    if (hi - lo <= kRegisterScores * kThreads &&
        select_in_registers<C>(s, round, row, cs, lo, hi, k, cand, buf, register_selected)) {
      __syncthreads();
      clear_bins(s);  // the placement's bin ends; the next barrier is the row's last
      emit_row<C>(p, s, round, buf, register_selected, r, pos, hi);
      __syncthreads();
      continue;
    }

    RadixState st;
    st.remaining = k;
    // The first pass leaves s.hist zero and s.digits the range of the first digits present.
    const int visible = first_pass<C>(s, st, round, row, cs, lo, hi);
    const bool all = visible <= k;  // every visible block is kept
    // The candidates: every visible block, or those of the threshold bin and above.
    const int64_t counted = all ? visible : int64_t{k} - st.remaining + st.count;
    const int selected = std::min(visible, k);

    // The radix select of the k-th composite among the candidates cand[0, nc), and the
    // selection appended to buf (unsorted).
    const auto resolve_candidates = [&](int nc) {
      const auto visit_candidates = [&](auto&& f) {
        for (int c = tid; c < nc; c += kThreads) f(static_cast<uint32_t>(cand[c] >> 32));
      };
      while (st.shift > 0) radix_pass<C>(s, st, round, visit_candidates);
      // st.prefix is the key T; st.remaining of its st.count blocks are taken.
      const uint32_t t = st.prefix;
      RadixState ids;  // over ~id of the blocks keyed T: the lowest ids first
      ids.remaining = st.remaining;
      if (st.remaining < st.count) {
        const auto visit_ties = [&](auto&& f) {
          for (int c = tid; c < nc; c += kThreads)
            if (static_cast<uint32_t>(cand[c] >> 32) == t) f(static_cast<uint32_t>(cand[c]));
        };
        while (ids.shift > 0) radix_pass<C>(s, ids, round, visit_ties);
      }
      for (int c = tid; c < nc; c += kThreads) {
        const uint32_t key = static_cast<uint32_t>(cand[c] >> 32);
        if (key > t || (key == t && static_cast<uint32_t>(cand[c]) >= ids.prefix)) append(cand[c]);
      }
    };

    bool sorted = false;
    if (2 * counted <= kCandidates) {
      // The candidates, then their order by counting: a histogram over 4096 equal ranges of
      // their keys, each range's start from the top, each candidate stored at the next slot of
      // its range in the buffer's upper half; a candidate's index is then its range's start
      // plus the larger composites of its range.
      const int nc = static_cast<int>(counted);
      append_scores<C>(row, cs, lo, hi, at_least(all ? kLowestFiniteKey : st.prefix), &s.candidates,
                       candidate);
      __syncthreads();
      sorted = true;
      if (nc > 0) {
        const uint32_t base = all ? uint32_t(s.digits[0]) << kFirstDigitShift : st.prefix;
        const uint32_t span = ((uint32_t(s.digits[1]) + 1) << kFirstDigitShift) - base;
        const int shift = max(0, 32 - __clz(static_cast<int>(span - 1)) - 12);
        const auto range = [&](uint64_t x) {
          return static_cast<int>((static_cast<uint32_t>(x >> 32) - base) >> shift);
        };
        for (int c = tid; c < nc; c += kThreads) atomicAdd(&s.hist[range(cand[c])], 1);
        __syncthreads();
        bin_starts<C>(s, round);
        uint64_t* const placed = cand + kCandidates / 2;
        for (int c = tid; c < nc; c += kThreads)
          placed[atomicAdd(&s.hist[range(cand[c])], 1)] = cand[c];
        __syncthreads();
        if (s.work <= kRankComparesPerThread * kThreads) {
          store_ranked<C>(s, placed, nc, k, buf, range);
        } else {
          // A crowded range (many equal or nearly equal scores): select and sort instead.
          sorted = false;
          clear_bins(s);
          __syncthreads();
          if (all) {
            for (int c = tid; c < nc; c += kThreads) buf[c] = cand[c];
          } else {
            resolve_candidates(nc);
          }
        }
      }
    } else {
      if (all) {
        append_scores<C>(row, cs, lo, hi, at_least(kLowestFiniteKey), &s.selected,
                         [&](int c, float x, int j) { buf[c] = composite(raw_key(x), j); });
      } else {
        // Narrow the threshold bin over the row until it fits the candidate buffer.
        while (st.count > kCandidates && st.shift > 0) radix_pass<C>(s, st, round, visit_row);
        if (st.count <= kCandidates) {
          if (k - st.remaining + st.count <= kCandidates) {
            // The blocks above the bin and the bin's are the candidates.
            append_scores<C>(row, cs, lo, hi, at_least(st.prefix), &s.candidates, candidate);
          } else {
            // Too many blocks above the bin (a large k): they are taken at once.
            const uint32_t top = st.prefix | ((1u << st.shift) - 1);
            for_each_key<C>(row, cs, lo, hi, [&](uint32_t key, int j) {
              const uint64_t c = composite(key, static_cast<uint32_t>(j));
              if (key > top) {
                append(c);
              } else if (key >= st.prefix) {
                cand[atomicAdd(&s.candidates, 1)] = c;
              }
            });
          }
          __syncthreads();
          resolve_candidates(s.candidates);
        } else {
          // More than kCandidates blocks share the key T: the ties are taken in id order.
          const uint32_t t = st.prefix;
          const int needed = st.remaining;
          int ties_before = 0;  // uniform
          for (int base = lo; base < hi; base += kThreads) {
            const int j = base + tid;
            const uint32_t key = j < hi ? order_key(row[j * cs]) : 0;
            if (key > t) append(composite(key, static_cast<uint32_t>(j)));
            if (ties_before < needed) {
              int total = 0;
              const int before = block_exclusive_sum<C>(key == t, s, round, total);
              if (key == t && ties_before + before < needed)
                append(composite(key, static_cast<uint32_t>(j)));
              ties_before += total;
            }
          }
        }
      }
    }
    __syncthreads();

    if (sorted) {
      clear_bins(s);  // the placement's starts; the next barrier is the row's last
    } else {
      // Sort (padding composites of 0 sort last).
      SortIndex n = kSortChunk;
      while (n < selected) n *= 2;
      for (SortIndex i = selected + tid; i < n; i += kThreads) buf[i] = 0;
      __syncthreads();
      bitonic_sort_descending<C>(buf, n);
    }
    emit_row<C>(p, s, round, buf, selected, r, pos, hi);
    __syncthreads();
  }
}

int64_t sort_capacity(const TopkProblem& p) {
  int64_t c = kSortChunk;
  while (c < std::min(p.k, p.num_blocks)) c *= 2;
  return c;
}

// Rows are independent: enough CTAs for every SM, each looping over rows; fewer where their
// global sort buffers would pass kMaxGlobalSortBytes.
template <typename C>
int64_t topk_grid(const TopkProblem& p, int device) {
  const int64_t grid =
      std::min<int64_t>(p.row_end - p.row_begin, int64_t{sm_count(device)} * C::kCtasPerSm);
  const int64_t capacity = sort_capacity(p);
  if (capacity <= kTopkMaxSharedSort) return grid;
  return std::clamp<int64_t>(kMaxGlobalSortBytes / (capacity * int64_t{sizeof(uint64_t)}), 1, grid);
}

// The one choice of CTA shape: RowPerSm for at most a row an SM, ManyRows once the rows fill
// more than one wave of FewRows.
template <typename F>
void with_config(const TopkProblem& p, int device, F&& f) {
  const int64_t rows = p.row_end - p.row_begin, sms = sm_count(device);
  if (rows > sms * FewRows::kCtasPerSm) {
    f(ManyRows{});
  } else if (rows > sms) {
    f(FewRows{});
  } else {
    f(RowPerSm{});
  }
}

}  // namespace

size_t topk_global_sort_bytes(const TopkProblem& p, int device) {
  const int64_t c = sort_capacity(p);
  if (c <= kTopkMaxSharedSort || p.row_end <= p.row_begin) return 0;
  size_t bytes = 0;
  with_config(p, device, [&](auto cfg) {
    bytes = static_cast<size_t>(topk_grid<decltype(cfg)>(p, device) * c) * sizeof(uint64_t);
  });
  return bytes;
}

void launch_topk(const TopkProblem& p, void* global_sort, int device, cudaStream_t stream,
                 bool programmatic) {
  if (p.row_end <= p.row_begin) return;
  const int64_t capacity = sort_capacity(p);
  const bool shared = capacity <= kTopkMaxSharedSort;
  with_config(p, device, [&](auto cfg) {
    using C = decltype(cfg);
    const size_t smem =
        C::kCandidateBytes + (shared ? static_cast<size_t>(capacity) * sizeof(uint64_t) : 0);
    const auto run = [&](auto shared_sort) {
      constexpr bool kShared = decltype(shared_sort)::value;
      opt_in_shared_memory<topk_kernel<C, kShared>>(
          int(C::kCandidateBytes + kTopkMaxSharedSort * 8));
      cudaLaunchAttribute attr;
      const cudaLaunchConfig_t cfg =
          programmatic_launch_config(dim3(static_cast<unsigned>(topk_grid<C>(p, device))),
                                     C::kThreads, smem, stream, attr, programmatic);
      SPARSE_ATTN_CUDA_CHECK(
          cudaLaunchKernelEx(&cfg, topk_kernel<C, kShared>, p,
                             kShared ? nullptr : static_cast<uint64_t*>(global_sort), capacity));
    };
    if (shared) {
      run(std::true_type{});
    } else {
      run(std::false_type{});
    }
  });
}

}  // namespace cuda::select

void detail::native_topk_blocks(const TopkBlocksParams& p) {
  using namespace cuda::select;
  if (p.batch * p.rows == 0) return;
  cuda::DeviceGuard guard(p.device_index);
  const auto stream = static_cast<cudaStream_t>(p.stream);
  TopkProblem t{};
  t.row_begin = 0;
  t.row_end = p.batch * p.rows;
  t.rows = p.rows;
  t.score_rows = p.rows;
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
  const size_t bytes = topk_global_sort_bytes(t, p.device_index);
  if (bytes == 0) {
    launch_topk(t, nullptr, p.device_index, stream);
    return;
  }
  // Selections above kTopkMaxSharedSort blocks sort in a per-CTA global buffer (docs/qsa.md).
  void* workspace = nullptr;
  SPARSE_ATTN_CUDA_CHECK(cudaMallocAsync(&workspace, bytes, stream));
  try {
    launch_topk(t, workspace, p.device_index, stream);
  } catch (...) {
    cudaFreeAsync(workspace, stream);
    throw;
  }
  SPARSE_ATTN_CUDA_CHECK(cudaFreeAsync(workspace, stream));
}

}  // namespace sparse_attn
