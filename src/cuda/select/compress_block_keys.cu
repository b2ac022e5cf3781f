// Native qsa_compress_block_keys: one warp per compressed key, memory-bound. Lane l holds dims
// l, l + 32, l + 64 and l + 96, so each of the 4 raw keys and the output are read and written
// as coalesced 64-byte rows, and a rotate_half pair (i, i + 32) of the 64 rotated dims sits in
// one lane (an interleaved pair (2j, 2j + 1) is one shuffle away). The math is the reference's
// (src/reference/qsa_compress_ref.cpp) in FP32; only the sum of squares runs in another order
// (a butterfly over lanes), so results agree within one rounding of the output dtype.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "api/qsa_compress_params.h"
#include "cuda/common/check.h"
#include "cuda/common/device_guard.h"
#include "cuda/common/device_props.h"
#include "cuda/common/elements.cuh"

namespace sparse_attn {
namespace cuda::select {
namespace {

constexpr int kWarpsPerCta = 4;
constexpr int kThreads = kWarpsPerCta * 32;
constexpr int64_t kDim = 128;     // the API admits only D == 128 here
constexpr int64_t kRopeDim = 64;  // and rope_dim == 64
constexpr int kDimsPerLane = kDim / 32;
constexpr int64_t kBlockTokens = detail::kCompressBlockTokens;
// Requests go on grid.y; more than this many loop over it.
constexpr int64_t kMaxGridY = 65535;
static_assert(kRopeDim == 2 * 32, "a rotate_half pair (i, i + 32) is dims 0 and 1 of one lane");

__device__ __forceinline__ int64_t floor_div4(int64_t a) {
  return a >= 0 ? a / kBlockTokens : -((-a + kBlockTokens - 1) / kBlockTokens);
}

// cos and sin for rotated dim d (frequency j) at position pos, as the reference computes them.
__device__ __forceinline__ void rope_factors(const detail::CompressBlockKeysParams& p, int64_t pos,
                                             int64_t d, int64_t j, float& c, float& s) {
  if (p.cos) {
    const int64_t col = p.rope_cols == p.rope_dim ? d : j;
    c = p.cos[pos * p.cos_row_stride + col * p.cos_col_stride];
    s = p.sin[pos * p.sin_row_stride + col * p.sin_col_stride];
    return;
  }
  const float inv_freq = static_cast<float>(pow(p.rope_theta, -2.0 * double(j) / double(kRopeDim)));
  const float angle = static_cast<float>(pos) * inv_freq;
  c = static_cast<float>(cos(double(angle)));
  s = static_cast<float>(sin(double(angle)));
}

__global__ void __launch_bounds__(kThreads)
    compress_block_keys_kernel(const detail::CompressBlockKeysParams p) {
  const int lane = threadIdx.x % 32;
  const int64_t total_rows = p.tokens_per_request;
  for (int64_t r = blockIdx.y; r < p.batch; r += gridDim.y) {
    int64_t begin = 0, rows = p.tokens_per_request;
    if (p.cu_seqlens) {
      // Clamped, so broken offsets (a caller promise) cannot reach outside the keys.
      begin = min(max(p.cu_seqlens[r * p.cu_seqlens_stride], int64_t{0}), total_rows);
      rows = min(max(p.cu_seqlens[(r + 1) * p.cu_seqlens_stride], begin), total_rows) - begin;
    }
    const int64_t start = p.start_positions ? p.start_positions[r * p.start_positions_stride] : 0;
    const int64_t first = max(int64_t{0}, floor_div4(start + kBlockTokens - 1));
    const int64_t end = floor_div4(start + rows);
    const int64_t row_base = p.cu_seqlens ? begin * p.keys_row_stride : r * p.keys_batch_stride;
    for (int64_t b = first + int64_t{blockIdx.x} * kWarpsPerCta + threadIdx.x / 32; b < end;
         b += int64_t{gridDim.x} * kWarpsPerCta) {
      const int64_t pos = kBlockTokens * b;
      if (p.cos && pos >= p.rope_rows) continue;
      const int64_t page_index = b / p.page_size;
      if (page_index >= p.max_pages) continue;
      const int64_t page =
          p.block_table
              ? p.block_table[r * p.block_table_row_stride + page_index * p.block_table_col_stride]
              : r;
      if (page < 0 || page >= p.num_pages) continue;

      // Mean of the 4 raw keys and the sum of squares over the 128 dims, in FP32.
      const int64_t row0 = row_base + (pos - start) * p.keys_row_stride;
      float y[kDimsPerLane];
      float sum_sq = 0.f;
#pragma unroll
      for (int k = 0; k < kDimsPerLane; ++k) {
        const int64_t col = (lane + 32 * k) * p.keys_col_stride;
        float sum = 0.f;
#pragma unroll
        for (int t = 0; t < kBlockTokens; ++t) {
          sum += load_float(p.keys, p.keys_dtype, row0 + t * p.keys_row_stride + col);
        }
        y[k] = sum / float(kBlockTokens);
        sum_sq += y[k] * y[k];
      }
#pragma unroll
      for (int offset = 16; offset > 0; offset /= 2) {
        sum_sq += __shfl_xor_sync(0xffffffffu, sum_sq, offset);
      }
      // RMSNorm with the (1 + w) weight.
      const float inv_rms = 1.f / sqrtf(sum_sq / float(kDim) + p.eps);
#pragma unroll
      for (int k = 0; k < kDimsPerLane; ++k) {
        y[k] = y[k] * inv_rms *
               (1.f + load_float(p.weight, p.weight_dtype, (lane + 32 * k) * p.weight_stride));
      }

      // RoPE on dims 0 .. 63 (k = 0, 1): the first of a pair takes -sin, the second +sin.
      float o[kDimsPerLane] = {y[0], y[1], y[2], y[3]};
      if (p.rope_style == RopeStyle::kRotateHalf) {
        float c0, s0, c1, s1;
        rope_factors(p, pos, lane, lane, c0, s0);
        rope_factors(p, pos, lane + 32, lane, c1, s1);
        o[0] = y[0] * c0 - y[1] * s0;
        o[1] = y[1] * c1 + y[0] * s1;
      } else {
        const bool first_of_pair = lane % 2 == 0;
#pragma unroll
        for (int k = 0; k < 2; ++k) {
          const float partner = __shfl_xor_sync(0xffffffffu, y[k], 1);
          const int64_t d = lane + 32 * k;
          float c, s;
          rope_factors(p, pos, d, d / 2, c, s);
          o[k] = first_of_pair ? y[k] * c - partner * s : y[k] * c + partner * s;
        }
      }
      const int64_t out0 = page * p.out_page_stride + (b % p.page_size) * p.out_slot_stride;
#pragma unroll
      for (int k = 0; k < kDimsPerLane; ++k) {
        store_float(p.out, p.out_dtype, out0 + (lane + 32 * k) * p.out_col_stride, o[k]);
      }
    }
  }
}

}  // namespace
}  // namespace cuda::select

void detail::native_compress_block_keys(const CompressBlockKeysParams& p) {
  using namespace cuda::select;
  if (p.batch == 0) return;
  cuda::DeviceGuard guard(p.device_index);
  const int sms = cuda::sm_count(p.device_index);
  // A request completes at most rows / 4 + 1 blocks (its rows need not start on a block); with
  // cu_seqlens that bound is taken over all the key rows. grid.x splits a request's blocks
  // over CTAs, up to about 16 CTAs per SM over all requests, enough to saturate HBM.
  const int64_t max_blocks = p.tokens_per_request / kBlockTokens + 1;
  const int64_t grid_y = std::min(p.batch, kMaxGridY);
  const int64_t wanted_x = (max_blocks + kWarpsPerCta - 1) / kWarpsPerCta;
  const int64_t cap_x = std::max<int64_t>(1, (int64_t{sms} * 16 + grid_y - 1) / grid_y);
  const dim3 grid(unsigned(std::min(wanted_x, cap_x)), unsigned(grid_y));
  compress_block_keys_kernel<<<grid, kThreads, 0, static_cast<cudaStream_t>(p.stream)>>>(p);
  SPARSE_ATTN_CUDA_CHECK_LAUNCH();
}

}  // namespace sparse_attn
