// Native qsa_expand_blocks: one warp per row (rows strided over the grid), bit-exact with the
// reference (src/reference/qsa_select_ref.cpp). The warp walks the row's block ids 32 at a
// time; a ballot gives each kept id its output slot (the kept ids before it), so the outputs
// keep the input order and are compacted, as the reference writes them.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "api/qsa_select_params.h"
#include "cuda/common/check.h"
#include "cuda/common/device_guard.h"
#include "cuda/common/device_props.h"

namespace sparse_attn {
namespace cuda::select {
namespace {

constexpr int kWarpsPerCta = 8;
constexpr int kThreads = kWarpsPerCta * 32;
constexpr int64_t kBlockTokens = 4;  // block b covers tokens 4b .. 4b + 3
constexpr int kLoadsInFlight = 8;

__global__ void __launch_bounds__(kThreads)
    expand_blocks_kernel(const detail::ExpandBlocksParams p) {
  const int lane = threadIdx.x % 32;
  const int64_t total_rows = p.batch * p.rows;
  const int64_t width = kBlockTokens * p.k + kBlockTokens - 1;
  for (int64_t r = int64_t{blockIdx.x} * kWarpsPerCta + threadIdx.x / 32; r < total_rows;
       r += int64_t{gridDim.x} * kWarpsPerCta) {
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

    // Kept blocks, compacted in input order. kLoadsInFlight ids a lane are loaded before any
    // is used: the stores between them would otherwise make each load wait for the last.
    int64_t kept = 0;
    for (int64_t base = 0; base < p.k; base += 32 * kLoadsInFlight) {
      int64_t id[kLoadsInFlight];
#pragma unroll
      for (int u = 0; u < kLoadsInFlight; ++u) {
        const int64_t j = base + 32 * u + lane;
        id[u] = j < p.k ? ids[j * p.block_ids_col_stride] : -1;
      }
#pragma unroll
      for (int u = 0; u < kLoadsInFlight; ++u) {
        const bool keep = id[u] >= 0 && kBlockTokens * id[u] + kBlockTokens - 1 <= pos;
        const unsigned ballot = __ballot_sync(0xffffffffu, keep);
        if (keep) {
          const int64_t slot = kept + __popc(ballot & ((1u << lane) - 1));
          if (blocks) blocks[slot * p.block_indices_col_stride] = static_cast<int32_t>(id[u]);
#pragma unroll
          for (int64_t t = 0; t < kBlockTokens; ++t) {
            tokens[(kBlockTokens * slot + t) * tcs] =
                static_cast<int32_t>(kBlockTokens * id[u] + t);
          }
        }
        kept += __popc(ballot);
      }
    }

    // The tail of the incomplete block holding the query (none for p < 0), then padding.
    const int64_t tail_start = kBlockTokens * ((pos + 1) / kBlockTokens);
    const int64_t tail = pos >= 0 ? pos - tail_start + 1 : 0;
    const int64_t filled = kBlockTokens * kept;
    if (lane < tail) tokens[(filled + lane) * tcs] = static_cast<int32_t>(tail_start + lane);
    for (int64_t j = filled + tail + lane; j < width; j += 32) tokens[j * tcs] = -1;
    if (blocks) {
      for (int64_t j = kept + lane; j < p.k; j += 32) blocks[j * p.block_indices_col_stride] = -1;
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
  const int sms = cuda::sm_count(p.device_index);
  const int64_t needed = (total_rows + kWarpsPerCta - 1) / kWarpsPerCta;
  const int64_t grid = std::min<int64_t>(needed, int64_t{sms} * 64);
  expand_blocks_kernel<<<unsigned(grid), kThreads, 0, static_cast<cudaStream_t>(p.stream)>>>(p);
  SPARSE_ATTN_CUDA_CHECK_LAUNCH();
}

}  // namespace sparse_attn
