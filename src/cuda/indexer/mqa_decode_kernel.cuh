// The paged decode kernel: one query (4 heads x 128) per request against its paged keys.
//
// Decode reads every visible key once and does 1 KFLOP per 256-byte key, so it is bound by
// HBM bandwidth; the kernel's job is to keep enough bytes in flight. Each warp streams its
// own 128 keys through a 4-stage cp.async ring in shared memory (16 keys = 4 KB a stage), so
// up to 12 KB per warp are in flight without holding registers, and warps never wait for
// each other (no CTA barrier). The page table is read once per warp up front, and each copy
// instruction covers whole 512-byte key pairs (docs/perf-notes.md has the versions before).
//
// The MMA puts 16 keys on M (A from shared memory, permuted-K layout of mma.cuh) and the 4
// heads on N (n8, the other 4 columns zero): the tensor cores do the dot products at 50%
// column occupancy, far above what the bandwidth needs.
//
// A CTA covers 512 columns of one request (4 warps x 128); columns past the context length
// or on missing pages are -inf, and groups wholly past the context only store.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cute/arch/copy_sm80.hpp>

#include "cuda/common/check.h"
#include "cuda/common/mma.cuh"
#include "cuda/indexer/mqa_problem.h"

namespace sparse_attn::cuda::indexer::decode {

inline constexpr int kWarps = 4;
inline constexpr int kThreads = kWarps * 32;
inline constexpr int kGroupKeys = 16;                     // one m16 tile
inline constexpr int kGroupsPerWarp = 8;
inline constexpr int kStages = 4;                         // groups in flight per warp
inline constexpr int kChunks = kDim * 2 / 16;             // 16-byte chunks per key (16)
inline constexpr int kKeysPerWarp = kGroupKeys * kGroupsPerWarp;  // 128
inline constexpr int kKeysPerCta = kWarps * kKeysPerWarp;         // 512
inline constexpr int kChunksPerLane = kGroupKeys * kChunks / 32;  // 8 copies per lane a group

struct SharedStorage {
  // [warp][stage][key][chunk], chunk XOR-swizzled by key parity as in the rows kernel.
  uint4 keys[kWarps][kStages][kGroupKeys][kChunks];
};

__device__ __forceinline__ int swizzle(int key, int chunk) { return chunk ^ ((key & 1) << 2); }

// 8 features [f, f + 8) of a 16-bit row as one 16-byte fragment, element by element (broadcast
// or unaligned strides).
__device__ __forceinline__ uint4 gather8(const uint16_t* row, int64_t f, int64_t stride) {
  uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint32_t lo = __ldg(row + (f + 2 * i) * stride);
    const uint32_t hi = __ldg(row + (f + 2 * i + 1) * stride);
    w[i] = lo | (hi << 16);
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    mqa_decode_kernel(const DecodeProblem p, int64_t chunks, bool vec_k) {
  extern __shared__ uint4 smem_raw[];
  SharedStorage& s = *reinterpret_cast<SharedStorage*>(smem_raw);
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, c = lane % 4;
  const int64_t b = blockIdx.x / chunks;
  const int64_t c0 = (blockIdx.x % chunks) * kKeysPerCta + int64_t(warp) * kKeysPerWarp;
  const int64_t c1 = std::min<int64_t>(c0 + kKeysPerWarp, p.max_model_len);
  float* const out = p.out + b * p.out_batch_stride;
  // Columns >= limit are -inf: past the context, the output, or the page table.
  const int64_t limit = std::min(std::min<int64_t>(__ldg(p.context_lens + b * p.context_lens_stride),
                                                   p.max_model_len),
                                 p.max_pages << p.page_size_log2);
  if (c0 >= c1) return;
  if (c0 >= limit) {
    for (int64_t i = c0 + lane; i < c1; i += 32) out[i * p.out_col_stride] = -INFINITY;
    return;
  }

  // B operand: Q of head g (lanes of groups 4..7 hold the zero padding of n8).
  uint4 qf[4] = {};
  if (g < kHeads) {
    const auto* q = static_cast<const uint16_t*>(p.q) + b * p.q_batch_stride + g * p.q_head_stride;
#pragma unroll
    for (int pp = 0; pp < 4; ++pp) qf[pp] = gather8(q, 32 * pp + 8 * c, p.q_dim_stride);
  }

  const auto* k = static_cast<const uint16_t*>(p.k_cache);
  const int32_t* pages = p.page_table + b * p.page_table_batch_stride;
  const int64_t slot_mask = (int64_t(1) << p.page_size_log2) - 1;
  const int groups = int((std::min(c1, limit) - c0 + kGroupKeys - 1) / kGroupKeys);
  // Page of key `lane` (lanes < 16) of every group, all looked up before the first copy so the
  // page-table latency is paid once, not once per group; -1: past the limit or missing.
  int32_t page[kGroupsPerWarp];
#pragma unroll
  for (int i = 0; i < kGroupsPerWarp; ++i) {
    const int64_t n = c0 + i * kGroupKeys + lane;
    int64_t pg = -1;
    if (i < groups && lane < kGroupKeys && n < limit)
      pg = __ldg(pages + (n >> p.page_size_log2) * p.page_table_page_stride);
    page[i] = pg >= 0 && pg < p.num_pages ? int32_t(pg) : -1;
  }
  // Copy instruction j moves keys 2j and 2j + 1 (512 contiguous bytes when they share a page):
  // lane l takes chunk l % 16 of key 2j + l / 16.
  const auto issue = [&](int i) {
    const int32_t pg_i = page[i];
#pragma unroll
    for (int j = 0; j < kChunksPerLane; ++j) {
      const int key = 2 * j + lane / kChunks, chunk = lane % kChunks;
      const int32_t pg = __shfl_sync(0xffffffffu, pg_i, key);
      const uint16_t* src = pg < 0 ? k
                                   : k + pg * p.k_page_stride +
                                         ((c0 + i * kGroupKeys + key) & slot_mask) * p.k_slot_stride;
      uint4& dst = s.keys[warp][i % kStages][key][swizzle(key, chunk)];
      if (vec_k) {
        // Missing keys are zero-filled without a global read.
        cute::SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<uint4>::copy(
            *reinterpret_cast<const uint4*>(src + chunk * 8), dst, pg >= 0);
      } else {
        dst = pg >= 0 ? gather8(src, chunk * 8, p.k_dim_stride) : uint4{};
      }
    }
  };

#pragma unroll
  for (int st = 0; st < kStages - 1; ++st) {
    if (st < groups) issue(st);
    cute::cp_async_fence();
  }
  // Unrolled so that page[] is indexed by constants and stays in registers.
#pragma unroll
  for (int i = 0; i < kGroupsPerWarp; ++i) {
    if (i >= groups) break;
    const int pre = i + kStages - 1;
    // Everyone has finished reading the stage `pre` reuses (group i - 1) before it is refilled.
    __syncwarp();
    if (pre < groups) issue(pre);
    cute::cp_async_fence();
    cute::cp_async_wait<kStages - 1>();
    __syncwarp();

    // S^T = K Q^T: rows are keys, columns heads
    const uint4(*keys)[kChunks] = s.keys[warp][i % kStages];
    float acc[4] = {};
#pragma unroll
    for (int pp = 0; pp < 4; ++pp) {
      const uint4 lo = keys[g][swizzle(g, 4 * pp + c)];
      const uint4 hi = keys[g + 8][swizzle(g + 8, 4 * pp + c)];
      mma_pair<T>(acc, lo, hi, qf[pp]);
    }
    // Thread (g, c) holds heads 2c, 2c+1 of keys g and g+8; heads 4..7 are the zero padding.
    float s_lo = relu(acc[0]) + relu(acc[1]);
    float s_hi = relu(acc[2]) + relu(acc[3]);
    s_lo += __shfl_xor_sync(0xffffffffu, s_lo, 1);
    s_hi += __shfl_xor_sync(0xffffffffu, s_hi, 1);
    // Lane r holds the page of key r: whether the key exists.
    const bool ok_lo = __shfl_sync(0xffffffffu, page[i], g) >= 0;
    const bool ok_hi = __shfl_sync(0xffffffffu, page[i], g + 8) >= 0;
    // Quad lane 0 writes key g, quad lane 1 key g + 8.
    if (c < 2) {
      const int64_t n = c0 + i * kGroupKeys + 8 * c + g;
      const bool ok = c == 0 ? ok_lo : ok_hi;
      if (n < c1) out[n * p.out_col_stride] = ok ? p.scale * (c == 0 ? s_lo : s_hi) : -INFINITY;
    }
  }
  cute::cp_async_wait<0>();
  // Columns past the last group that touches the context.
  for (int64_t n = c0 + int64_t(groups) * kGroupKeys + lane; n < c1; n += 32)
    out[n * p.out_col_stride] = -INFINITY;
}

}  // namespace sparse_attn::cuda::indexer::decode

namespace sparse_attn::cuda::indexer {

template <typename T>
void launch_mqa_decode(const DecodeProblem& p, cudaStream_t stream) {
  using namespace decode;
  if (p.batch == 0 || p.max_model_len == 0) return;
  const int64_t chunks = (p.max_model_len + kKeysPerCta - 1) / kKeysPerCta;
  if (chunks * p.batch > INT_MAX) throw Error("qsa_mqa_decode: batch x max_model_len too large");
  // cp.async needs unit feature stride and 16-byte aligned key rows; other layouts are
  // gathered element by element.
  const bool vec_k = p.k_dim_stride == 1 && reinterpret_cast<uintptr_t>(p.k_cache) % 16 == 0 &&
                     (p.k_page_stride % 8 == 0 || p.num_pages <= 1) && p.k_slot_stride % 8 == 0;
  const auto kernel = mqa_decode_kernel<T>;
  constexpr int kSmem = sizeof(SharedStorage);
  SPARSE_ATTN_CUDA_CHECK(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
  kernel<<<unsigned(chunks * p.batch), kThreads, kSmem, stream>>>(p, chunks, vec_k);
  SPARSE_ATTN_CUDA_CHECK_LAUNCH();
}

}  // namespace sparse_attn::cuda::indexer
