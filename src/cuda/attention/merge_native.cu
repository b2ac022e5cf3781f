// merge_attention_states on CUDA tensors: one CTA per (row, head) pair (a grid-stride loop over
// them), the merge of merge.cuh over its partials. Bound by the partials' bytes; the element types
// are read and written through a switch on the dtype (uniform over the grid), not templates: one
// kernel serves every combination.
#include <algorithm>
#include <climits>

#include "api/merge_params.h"
#include "cuda/attention/merge.cuh"
#include "cuda/common/check.h"
#include "cuda/common/device_guard.h"
#include "cuda/common/device_props.h"
#include "cuda/common/elements.cuh"

namespace sparse_attn::cuda {
namespace {

constexpr int kThreads = 128;
constexpr int kPerThread = 2;  // features a thread merges per pass: 256 a CTA pass

__global__ void __launch_bounds__(kThreads)
    merge_attention_states_kernel(const __grid_constant__ detail::MergeParams p) {
  __shared__ LseMergeSmem<kThreads> sm;
  constexpr float kLog2e = 1.4426950408889634f;
  const int64_t pairs = p.rows * p.heads;
  for (int64_t pair = blockIdx.x; pair < pairs; pair += gridDim.x) {
    const int64_t r = pair / p.heads, h = pair % p.heads;
    const float* lse = p.partial_lse + r * p.pl_row_stride + h * p.pl_head_stride;
    const int64_t part0 = r * p.po_row_stride + h * p.po_head_stride;
    const auto lse2 = [&](int s) { return lse[s * p.pl_part_stride] * kLog2e; };
    const auto part = [&](int s, int d) {
      return load_float(p.partial_out, p.partial_dtype,
                        part0 + s * p.po_part_stride + d * p.po_dim_stride);
    };
    // One pass at least: with dim 0 the LSE is still written.
    for (int d0 = 0; d0 == 0 || d0 < p.dim; d0 += kThreads * kPerThread) {
      float o[kPerThread];
      const float m2 = merge_lse_partials<kThreads, kPerThread>(
          static_cast<int>(p.parts), d0, static_cast<int>(p.dim), lse2, part, o, sm);
#pragma unroll
      for (int j = 0; j < kPerThread; ++j) {
        const int64_t d = d0 + threadIdx.x + j * kThreads;
        if (d < p.dim) {
          store_float(p.out, p.out_dtype,
                      r * p.out_row_stride + h * p.out_head_stride + d * p.out_dim_stride, o[j]);
        }
      }
      if (d0 == 0 && threadIdx.x == 0 && p.lse_out) {
        p.lse_out[r * p.lo_row_stride + h * p.lo_head_stride] = m2 * 0.69314718055994531f;
      }
    }
  }
}

}  // namespace
}  // namespace sparse_attn::cuda

namespace sparse_attn::detail {

void native_merge_attention_states(const MergeParams& p) {
  if (p.rows == 0 || p.heads == 0) return;
  if (p.parts > INT_MAX || p.dim > INT_MAX) {
    throw Error("merge_attention_states: internal: more than 2^31 partials or features");
  }
  cuda::DeviceGuard guard(p.device_index);
  // A few resident waves of CTAs; each loops over its (row, head) pairs.
  const int64_t grid =
      std::min<int64_t>(p.rows * p.heads, int64_t{cuda::sm_count(p.device_index)} * 16);
  cuda::merge_attention_states_kernel<<<static_cast<unsigned>(grid), cuda::kThreads, 0,
                                        static_cast<cudaStream_t>(p.stream)>>>(p);
  SPARSE_ATTN_CUDA_CHECK_LAUNCH();
}

}  // namespace sparse_attn::detail
