// Native qsa_expand_blocks, bit-exact with the reference (src/reference/qsa_select_ref.cpp). A
// group of warps takes a row (rows strided over the grid's groups). A round hands each thread of
// the group a few ids, a warp's lanes adjacent ones; a ballot ranks the kept ids within the warp,
// and one barrier of the group shares each warp's counts, so every kept id knows its output slot
// (the kept ids before it): the outputs keep the input order and are compacted, as the
// reference writes them. A warp's kept blocks then have adjacent slots, so their tokens go out
// as one 16-byte store a block where the row is contiguous and aligned.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "api/qsa_select_params.h"
#include "cuda/common/check.h"
#include "cuda/common/device_guard.h"
#include "cuda/common/device_props.h"
#include "cuda/select/expand_rule.cuh"

namespace sparse_attn {
namespace cuda::select {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;

// Warps a row, chosen once per launch (measured, docs/perf-notes.md, issue 17): while the rows
// fit one wave of CTAs, a row's latency is the launch's, and four warps share its serial work;
// with more rows, one warp a row keeps four times the rows (and their loads) in flight an SM.
//
// Registers bound the CTAs an SM: one-warp rows get 64 a thread (8 CTAs, 32 rows an SM in
// flight, with 8 ids a lane); four-warp rows 128 (4 CTAs: one wave of rows is 4 an SM).
template <int kGroupWarps>
constexpr int kCtasPerSm = kGroupWarps == 1 ? 8 : 4;

template <int kGroupWarps>
__global__ void __launch_bounds__(kThreads, kCtasPerSm<kGroupWarps>)
    expand_blocks_kernel(const detail::ExpandBlocksParams p) {
  static_assert(kGroupWarps == 1 || kGroupWarps == kWarps);
  constexpr int kGroups = kWarps / kGroupWarps;
  constexpr int kGroupThreads = kGroupWarps * 32;
  // A round of four warps is QSA's default k of 512, so a decode row's loads are all in flight
  // before its one barrier; a warp alone takes 8 ids a lane, as many as 64 registers hold.
  constexpr int kIdsPerThread = kGroupWarps == 1 ? 8 : 4;
  constexpr int kRoundIds = kIdsPerThread * kGroupThreads;
  const auto group_barrier = [] {
    if constexpr (kGroupWarps == 1) {
      __syncwarp();
    } else {
      __syncthreads();
    }
  };
  // Kept ids of each (id, warp) slice of a group's round; two copies, alternating by round, so a
  // round needs no barrier after its readers (the copy it writes was read before the previous
  // round's barrier).
  __shared__ int counts[kGroups][2][kIdsPerThread][kGroupWarps];
  const int lane = threadIdx.x % 32, group = threadIdx.x / kGroupThreads;
  const int warp = threadIdx.x % kGroupThreads / 32, thread = threadIdx.x % kGroupThreads;
  const unsigned lanes_below = (1u << lane) - 1;
  const int64_t total_rows = p.batch * p.rows;
  const int64_t width = kBlockTokens * p.k + kBlockTokens - 1;
  int round = 0;
  for (int64_t r = int64_t{blockIdx.x} * kGroups + group; r < total_rows;
       r += int64_t{gridDim.x} * kGroups) {
    const int64_t b = r / p.rows, i = r % p.rows;
    const MetaPtr ids = p.block_ids + (b * p.block_ids_batch_stride + i * p.block_ids_row_stride);
    // Saturated, as the reference caps it: the outputs hold int32 token ids.
    const int64_t pos = p.query_positions.i32(b * p.query_positions_batch_stride +
                                              i * p.query_positions_row_stride);
    int32_t* tokens =
        p.token_indices + b * p.token_indices_batch_stride + i * p.token_indices_row_stride;
    int32_t* blocks = p.block_indices ? p.block_indices + b * p.block_indices_batch_stride +
                                            i * p.block_indices_row_stride
                                      : nullptr;
    const int64_t tcs = p.token_indices_col_stride;
    const bool vector_tokens = tcs == 1 && reinterpret_cast<uintptr_t>(tokens) % 16 == 0;

    int64_t kept = 0;  // uniform in the group: the kept ids of the rounds before
    for (int64_t base = 0; base < p.k; base += kRoundIds, round ^= 1) {
      // Saturated ids: one past the int32 range is never complete at an int32 position.
      int32_t id[kIdsPerThread];
#pragma unroll
      for (int u = 0; u < kIdsPerThread; ++u) {
        const int64_t j = base + u * kGroupThreads + thread;
        id[u] = j < p.k ? ids.i32(j * p.block_ids_col_stride) : -1;
      }
      unsigned keep = 0;  // bit u: id[u] is kept
#pragma unroll
      for (int u = 0; u < kIdsPerThread; ++u) {
        const bool kept_u = id[u] >= 0 && kBlockTokens * id[u] + kBlockTokens - 1 <= pos;
        keep |= unsigned{kept_u} << u;
        const unsigned ballot = __ballot_sync(0xffffffffu, kept_u);
        if (lane == 0) counts[group][round][u][warp] = __popc(ballot);
      }
      group_barrier();
      // Slices in id order: (u, warp) before (u, warp + 1) before (u + 1, 0).
      int before = 0;
#pragma unroll
      for (int u = 0; u < kIdsPerThread; ++u) {
        const bool kept_u = (keep >> u) & 1;
        // This lane's rank among its warp's kept ids of slice u (the ballot again: cheaper than
        // registers for every slice's).
        const int rank = __popc(__ballot_sync(0xffffffffu, kept_u) & lanes_below);
#pragma unroll
        for (int w = 0; w < kGroupWarps; ++w) {
          const int c = counts[group][round][u][w];
          if (kept_u && w == warp) {
            const int64_t slot = kept + before + rank;
            if (blocks) blocks[slot * p.block_indices_col_stride] = id[u];
            const int32_t first = static_cast<int32_t>(kBlockTokens * id[u]);
            if (vector_tokens) {
              reinterpret_cast<int4*>(tokens)[slot] =
                  make_int4(first, first + 1, first + 2, first + 3);
            } else {
#pragma unroll
              for (int64_t t = 0; t < kBlockTokens; ++t)
                tokens[(kBlockTokens * slot + t) * tcs] = first + static_cast<int32_t>(t);
            }
          }
          before += c;
        }
      }
      kept += before;
    }

    write_tail<int64_t>(tokens, tcs, pos, kBlockTokens * kept, width, thread, kGroupThreads);
    if (blocks) {
      for (int64_t j = kept + thread; j < p.k; j += kGroupThreads)
        blocks[j * p.block_indices_col_stride] = -1;
    }
  }
}

}  // namespace
}  // namespace cuda::select

void detail::native_expand_blocks(const ExpandBlocksParams& p) {
  using namespace cuda::select;
  const int64_t total_rows = p.batch * p.rows;
  if (total_rows == 0) return;
  cuda::DeviceGuard guard(p.device_index);
  const int64_t sms = cuda::sm_count(p.device_index);
  const auto stream = static_cast<cudaStream_t>(p.stream);
  if (total_rows <= sms * kCtasPerSm<kWarps>) {
    expand_blocks_kernel<kWarps><<<unsigned(total_rows), kThreads, 0, stream>>>(p);
  } else {
    const int64_t grid = std::min(sms * kCtasPerSm<1>, (total_rows + kWarps - 1) / kWarps);
    expand_blocks_kernel<1><<<unsigned(grid), kThreads, 0, stream>>>(p);
  }
  SPARSE_ATTN_CUDA_CHECK_LAUNCH();
}

}  // namespace sparse_attn
