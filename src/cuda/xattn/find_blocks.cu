// Native find_blocks_chunked (XAttention's threshold selection, also the selection step of
// xattn_estimate and xattention_prefill): one CTA per row (b, h, i), rows strided over the
// grid, bitwise the block_mask of the reference (src/reference/xattn_estimate_ref.cpp,
// docs/xattention.md "Selection").
//
// Per row: the eligible non-forced blocks are sorted by a 32-bit key whose unsigned order is the
// reference's visit order (descending sum; the sort is stable and its input is in block order,
// so ties go to the lower index), with the block index as the value. The two FP64 sums must be
// the reference's bit for bit, so one thread adds the sums in visit order (forced blocks first)
// for T, leaving a checkpoint (the running sum C) every kChunk positions; then every chunk is
// walked in parallel from its checkpoint, which repeats the reference's walk exactly, and the
// first position with !(C < R) is the cut. The serial pass is the one long dependency chain
// (a dependent DADD per eligible block); the reference's walk, a second chain of up to that
// length, becomes kChunk adds per thread.
//
// Non-finite and signed-zero sums: -0 and +0 share a key (the reference's comparator finds them
// equal, so the index decides), +inf and -inf order as floats do, and every NaN takes the key
// after -inf. The reference's std::sort has no strict weak order when a NaN is eligible (a NaN
// compares equal to everything), so its visit order is unspecified there; its mask is not: T is
// NaN, R = threshold * T is NaN, so the walk stops at the first non-forced block and only forced
// blocks are kept (every eligible block at threshold 1), in any order. Keys decode back to
// their sums for the serial pass, and +0 pads its last chunk: a running sum that starts at +0 is
// never -0 (x + y is -0 only when both are), and for every other c, c + -0 == c + +0 == c, so
// the sums are the reference's bit for bit (NaN payloads aside, which no comparison sees).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cub/block/block_radix_sort.cuh>
#include <iterator>
#include <string>

#include "api/xattn_params.h"
#include "cuda/common/check.h"
#include "cuda/common/device_guard.h"
#include "cuda/common/device_props.h"
#include "cuda/common/kernel_attributes.h"
#include "sparse_attn/errors.h"

namespace sparse_attn {
namespace cuda::xattn {
namespace {

// Heads per launch: their thresholds travel in the kernel parameters (2 KiB of the 4 KiB), so a
// captured graph holds them by value; more heads take more launches.
constexpr int kMaxHeadsPerLaunch = 256;
// Visit positions per checkpoint of the serial pass: the length of each parallel walk.
constexpr int kChunk = 32;
// Keys of forced blocks and of the padding past the eligible ones: above every sum's key, so
// the first (eligible - forced) sorted positions are exactly the non-forced blocks.
constexpr uint32_t kLastKey = 0xffffffffu;
constexpr uint32_t kNanKey = 0xff800001u;  // right after -inf's key (0xff800000)

struct SelectProblem {
  int64_t batch;
  int64_t heads;  // heads of this launch: head_begin + [0, heads)
  int64_t head_begin;
  int64_t qb_begin;  // query blocks of this launch: qb_begin + [0, qb_count)
  int64_t qb_count;
  int64_t q_len, k_len, block_size, k_blocks;
  const float* sums;  // [batch, num_heads, q_blocks, k_blocks], any strides
  int64_t sums_stride[4];
  uint8_t* mask;  // [batch, num_heads, q_blocks, k_blocks], every element written
  int64_t mask_stride[4];
  bool causal, keep_sink, keep_recent;
  double thresholds[kMaxHeadsPerLaunch];  // of heads head_begin + [0, heads)
};

// The block of the last key that query block qb's last row sees (the reference's diagonal).
__host__ __device__ inline int64_t diagonal_block(int64_t qb, int64_t q_len, int64_t k_len,
                                                  int64_t block_size) {
  const int64_t last_row = std::min((qb + 1) * block_size, q_len) - 1;
  return (k_len - q_len + last_row) / block_size;
}

// Unsigned ascending order of the key == the visit order of non-forced blocks: descending sum,
// -0 == +0, NaN last (see the file comment).
__device__ __forceinline__ uint32_t visit_key(float x) {
  if (isnan(x)) return kNanKey;
  uint32_t u = __float_as_uint(x);
  if ((u << 1) == 0) u = 0;
  const uint32_t ascending = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  return ~ascending;
}

// The sum behind a key of visit_key (+0 for both zeros, a NaN for kNanKey).
__device__ __forceinline__ float key_sum(uint32_t key) {
  const uint32_t ascending = ~key;
  return __uint_as_float((ascending & 0x80000000u) ? (ascending & 0x7fffffffu) : ~ascending);
}

template <int kThreads, int kItems>
struct Tier {
  static constexpr int kCapacity = kThreads * kItems;  // eligible blocks a row may have
  static_assert(kCapacity % kChunk == 0, "whole chunks of checkpoints");
  using Sort = cub::BlockRadixSort<uint32_t, kThreads, kItems, int>;

  struct Smem {
    union {
      typename Sort::TempStorage sort;
      float visit_sums[kCapacity];  // sums of the non-forced blocks in visit order
      uint8_t keep[kCapacity];      // by block index, once the cut is known
    };
    double checkpoint[kCapacity / kChunk];  // C before non-forced position c * kChunk
    double required;                        // R = threshold * T
    int cut;                                // first non-forced position not kept
  };
};

template <int kThreads, int kItems>
__global__ void __launch_bounds__(kThreads)
    find_blocks_kernel(const __grid_constant__ SelectProblem p) {
  using T = Tier<kThreads, kItems>;
  extern __shared__ __align__(16) unsigned char smem_bytes[];
  auto& s = *reinterpret_cast<typename T::Smem*>(smem_bytes);
  const int tid = threadIdx.x;
  const int64_t rows = p.batch * p.heads * p.qb_count;

  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const int64_t qb = p.qb_begin + row % p.qb_count;
    const int64_t head = (row / p.qb_count) % p.heads;
    const int64_t b = row / p.qb_count / p.heads;
    const int64_t h = p.head_begin + head;
    const float* x = p.sums + b * p.sums_stride[0] + h * p.sums_stride[1] + qb * p.sums_stride[2];
    uint8_t* mask = p.mask + b * p.mask_stride[0] + h * p.mask_stride[1] + qb * p.mask_stride[2];
    const int64_t xs = p.sums_stride[3], ms = p.mask_stride[3];

    const int diagonal = static_cast<int>(diagonal_block(qb, p.q_len, p.k_len, p.block_size));
    const int eligible = p.causal ? diagonal + 1 : static_cast<int>(p.k_blocks);
    const bool force_diagonal = p.causal || p.keep_recent;
    const bool force_sink = p.keep_sink;
    const double threshold = p.thresholds[head];

    if (threshold >= 1.0) {  // every eligible block, as the reference decides before any sum
      for (int64_t j = tid; j < p.k_blocks; j += kThreads) mask[j * ms] = j < eligible;
      continue;  // shared memory untouched: the next row needs no barrier
    }

    // Sort the non-forced eligible blocks into visit order.
    uint32_t keys[kItems];
    int index[kItems];
#pragma unroll
    for (int i = 0; i < kItems; ++i) {
      const int j = tid * kItems + i;
      const bool forced = (force_diagonal && j == diagonal) || (force_sink && j == 0);
      index[i] = j;
      keys[i] = j < eligible && !forced ? visit_key(x[j * xs]) : kLastKey;
    }
    typename T::Sort(s.sort).Sort(keys, index);
    const int forced_count =
        int{force_diagonal} + int{force_sink} - int{force_diagonal && force_sink && diagonal == 0};
    const int non_forced = eligible - forced_count;
    __syncthreads();  // the sort's storage becomes visit_sums
    // +0 pads the last chunk: it leaves every running sum as it is (see the file comment).
    const int padded = (non_forced + kChunk - 1) / kChunk * kChunk;
#pragma unroll
    for (int i = 0; i < kItems; ++i) {
      const int pos = tid * kItems + i;  // blocked arrangement: thread tid holds these positions
      if (pos < padded) s.visit_sums[pos] = pos < non_forced ? key_sum(keys[i]) : 0.0f;
    }
    __syncthreads();

    // T, in the reference's order: forced blocks by ascending index, then visit order.
    if (tid == 0) {
      double c = 0.0;
      if (force_sink) c += static_cast<double>(x[0]);
      if (force_diagonal && !(force_sink && diagonal == 0)) {
        c += static_cast<double>(x[diagonal * xs]);
      }
      // A window of kAhead quads is loaded ahead of the adds, so that only the FP64 adds wait
      // on each other (loads past the row stay inside the array and are never added).
      constexpr int kAhead = 4, kQuads = T::kCapacity / 4;
      static_assert(kChunk % (4 * kAhead) == 0, "the window's slots repeat every chunk");
      const float4* sums4 = reinterpret_cast<const float4*>(s.visit_sums);
      float4 window[kAhead];
#pragma unroll
      for (int q = 0; q < kAhead; ++q) window[q] = sums4[q];
      for (int base = 0; base < non_forced; base += kChunk) {
        s.checkpoint[base / kChunk] = c;
#pragma unroll
        for (int q = 0; q < kChunk / 4; ++q) {
          const float4 v = window[q % kAhead];
          window[q % kAhead] = sums4[std::min(base / 4 + q + kAhead, kQuads - 1)];
          c += static_cast<double>(v.x);
          c += static_cast<double>(v.y);
          c += static_cast<double>(v.z);
          c += static_cast<double>(v.w);
        }
      }
      s.required = threshold * c;
      s.cut = non_forced;
    }
    __syncthreads();

    // The walk, chunk by chunk from the checkpoints: a non-forced block is kept while C < R.
    const double required = s.required;
    for (int base = tid * kChunk; base < non_forced; base += kThreads * kChunk) {
      double c = s.checkpoint[base / kChunk];
      const int end = std::min(non_forced, base + kChunk);
      for (int pos = base; pos < end; ++pos) {
        if (!(c < required)) {
          atomicMin(&s.cut, pos);
          break;
        }
        c += static_cast<double>(s.visit_sums[pos]);
      }
    }
    __syncthreads();

    // Kept: forced blocks and the non-forced ones before the cut; keep overwrites visit_sums.
    const int cut = s.cut;
#pragma unroll
    for (int i = 0; i < kItems; ++i) {
      const int pos = tid * kItems + i;
      if (pos < non_forced) s.keep[index[i]] = pos < cut;
    }
    if (tid == 0) {
      if (force_sink) s.keep[0] = 1;
      if (force_diagonal) s.keep[diagonal] = 1;
    }
    __syncthreads();
    for (int64_t j = tid; j < p.k_blocks; j += kThreads) mask[j * ms] = j < eligible && s.keep[j];
    __syncthreads();  // the next row's sort reuses keep
  }
}

template <int kThreads, int kItems>
void launch_tier(const SelectProblem& t, int sms, cudaStream_t stream) {
  constexpr auto kernel = find_blocks_kernel<kThreads, kItems>;
  constexpr int bytes = sizeof(typename Tier<kThreads, kItems>::Smem);
  if constexpr (bytes > 48 * 1024) opt_in_shared_memory<kernel>(bytes);
  // Rows of one launch cost about the same: enough CTAs to fill every SM, each looping.
  const int64_t grid = std::min(t.batch * t.heads * t.qb_count, int64_t{sms} * 16);
  kernel<<<static_cast<unsigned>(grid), kThreads, bytes, stream>>>(t);
  SPARSE_ATTN_CUDA_CHECK_LAUNCH();
}

struct TierEntry {
  int64_t capacity;
  void (*launch)(const SelectProblem&, int, cudaStream_t);
};

template <int kThreads, int kItems>
constexpr TierEntry tier() {
  return {Tier<kThreads, kItems>::kCapacity, &launch_tier<kThreads, kItems>};
}

// A row is sorted by the smallest tier that holds its eligible blocks, so short rows (256
// blocks at 32K tokens, the first query blocks of a causal call) do not pay for a 16K-key sort.
// Registers bound the residency, not shared memory: 56 to 73 per thread up to 4096 keys (2 to 4
// CTAs per SM), 128 for 8K and 16K keys (one CTA per SM; the 16K tier spills a few hundred
// bytes to L1).
constexpr TierEntry kTiers[] = {tier<128, 2>(), tier<256, 4>(), tier<512, 8>(), tier<512, 16>(),
                                tier<512, 32>()};
constexpr int64_t kMaxKeyBlocks = kTiers[std::size(kTiers) - 1].capacity;

}  // namespace
}  // namespace cuda::xattn

void native_find_blocks(const BlockSelectParams& p) {
  using namespace cuda::xattn;
  if (p.batch == 0 || p.num_heads == 0 || p.q_blocks == 0 || p.k_blocks == 0) return;
  // A row's eligible blocks go through one shared-memory sort; the last query block sees every
  // key block (bottom-right alignment), so k_blocks bounds every row.
  if (p.k_blocks > kMaxKeyBlocks) {
    throw NotSupportedError("attn_sums: backend 'native' selects among at most " +
                            std::to_string(kMaxKeyBlocks) + " key blocks per query block (" +
                            std::to_string(kMaxKeyBlocks * p.block_size) + " keys at block_size " +
                            std::to_string(p.block_size) + "), got " + std::to_string(p.k_blocks) +
                            "; pass backend='reference' for longer sequences");
  }
  cuda::DeviceGuard guard(p.device_index);
  const auto stream = static_cast<cudaStream_t>(p.stream);
  const int sms = cuda::sm_count(p.device_index);

  SelectProblem t{};
  t.batch = p.batch;
  t.q_len = p.q_len;
  t.k_len = p.k_len;
  t.block_size = p.block_size;
  t.k_blocks = p.k_blocks;
  t.sums = p.attn_sums;
  t.mask = p.block_mask;
  std::copy(p.sums_stride, p.sums_stride + 4, t.sums_stride);
  std::copy(p.mask_stride, p.mask_stride + 4, t.mask_stride);
  t.causal = p.causal;
  t.keep_sink = p.keep_sink;
  t.keep_recent = p.keep_recent;

  // Eligible blocks per query block: k_blocks, or the diagonal + 1 (non-decreasing in qb).
  const auto eligible = [&](int64_t qb) {
    return p.causal ? diagonal_block(qb, p.q_len, p.k_len, p.block_size) + 1 : p.k_blocks;
  };
  for (int64_t h0 = 0; h0 < p.num_heads; h0 += kMaxHeadsPerLaunch) {
    t.head_begin = h0;
    t.heads = std::min<int64_t>(kMaxHeadsPerLaunch, p.num_heads - h0);
    std::copy(p.thresholds + h0, p.thresholds + h0 + t.heads, t.thresholds);
    int64_t qb0 = 0;
    for (const TierEntry& tier : kTiers) {
      // The query blocks [qb0, qb1) whose eligible blocks fit this tier (and no smaller one).
      int64_t qb1 = qb0, hi = p.q_blocks;
      while (qb1 < hi) {
        const int64_t mid = qb1 + (hi - qb1) / 2;
        if (eligible(mid) <= tier.capacity) {
          qb1 = mid + 1;
        } else {
          hi = mid;
        }
      }
      if (qb1 == qb0) continue;
      t.qb_begin = qb0;
      t.qb_count = qb1 - qb0;
      tier.launch(t, sms, stream);
      qb0 = qb1;
    }
  }
}

}  // namespace sparse_attn
