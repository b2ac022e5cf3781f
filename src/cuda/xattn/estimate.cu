// Native xattn_estimate: kernel parameters from the validated params, the chunk loop over query
// blocks (each chunk's scratch from the stream-ordered pool), the one dispatch from (dtype,
// groups per block) to an instantiation (instantiations/estimate_*.cu), then the native
// selection on the sums.
#include <cutlass/numeric_types.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <string>

#include "api/xattn_params.h"
#include "cuda/common/check.h"
#include "cuda/common/device_guard.h"
#include "cuda/common/device_props.h"
#include "cuda/common/tensor_map.h"
#include "cuda/common/workspace_pool.h"
#include "cuda/xattn/estimate.h"
#include "sparse_attn/errors.h"

namespace sparse_attn::cuda {
namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The host side of estimate_visible_groups (estimate_kernel.cuh).
int64_t visible_groups(const XAttnEstimateParams& e, int64_t k_groups, int64_t g) {
  if (!e.causal) return k_groups;
  const int64_t last = e.k_len - e.q_len + std::min(g * e.stride + e.stride - 1, e.q_len - 1);
  return std::min(last / e.stride + 1, k_groups);
}

// StridedRowsMap of a tensor [batch, heads, len, head_dim] with element strides (batch, head,
// row, ..).
StridedRowsMap strided_rows(const void* base, DType dtype, int64_t batch, int64_t heads,
                            int64_t len, int64_t head_dim, const int64_t* stride, int64_t S,
                            uint32_t box_groups) {
  const int64_t groups = ceil_div(len, S), rem = len % S;
  // A single row is never stepped over: any legal row stride (the head dim's) does.
  const int64_t row_stride = len > 1 ? stride[2] : head_dim;
  int64_t sizes[5] = {head_dim, S, groups, heads, batch};
  const int64_t strides[4] = {row_stride, S * row_stride, stride[1], stride[0]};
  const uint32_t box[5] = {64, 1, box_groups, 1, 1};
  StridedRowsMap m;
  m.full = tiled_tensor_map(base, dtype, 5, sizes, strides, box, "xattn_estimate");
  sizes[2] = std::max<int64_t>(groups - 1, 1);
  m.partial = tiled_tensor_map(base, dtype, 5, sizes, strides, box, "xattn_estimate");
  m.full_rows = static_cast<int32_t>(rem == 0 ? S : rem);
  m.partial_shift = groups == 1 ? 1 : 0;
  return m;
}

template <class Element>
void launch(int64_t groups_per_block, const XAttnEstimateKernelParams& p, int64_t batch_heads,
            int sms, cudaStream_t stream) {
  switch (groups_per_block) {
    case 8:
      return launch_xattn_estimate<Element, 8>(p, batch_heads, sms, stream);
    case 16:
      return launch_xattn_estimate<Element, 16>(p, batch_heads, sms, stream);
    default:
      return launch_xattn_estimate<Element, 32>(p, batch_heads, sms, stream);
  }
}

}  // namespace
}  // namespace sparse_attn::cuda

namespace sparse_attn {

void native_xattn_estimate(const XAttnEstimateParams& e) {
  using cuda::ceil_div;
  using cuda::kEstimateBlockM;
  using cuda::kEstimateBlockN;
  cuda::DeviceGuard guard(e.device_index);
  auto stream = static_cast<cudaStream_t>(e.stream);
  const int sms = cuda::sm_count(e.device_index);
  const int64_t batch_heads = e.batch * e.num_q_heads;
  if (batch_heads * e.q_blocks * e.k_blocks == 0) return;  // no sums, no mask elements

  const int64_t gpb = e.block_size / e.stride;  // validated: 8, 16 or 32
  const int64_t q_groups = ceil_div(e.q_len, e.stride), k_groups = ceil_div(e.k_len, e.stride);
  cuda::XAttnEstimateKernelParams p;
  p.tma_q = cuda::strided_rows(e.q, e.dtype, e.batch, e.num_q_heads, e.q_len, e.head_dim,
                               e.q_stride, e.stride, kEstimateBlockM);
  p.tma_k = cuda::strided_rows(e.k, e.dtype, e.batch, e.num_q_heads / e.group, e.k_len, e.head_dim,
                               e.k_stride, e.stride, kEstimateBlockN);
  p.batch_heads = static_cast<int32_t>(batch_heads);
  p.num_q_heads = static_cast<int32_t>(e.num_q_heads);
  p.group = static_cast<int32_t>(e.group);
  p.head_dim = static_cast<int32_t>(e.head_dim);
  p.q_len = static_cast<int32_t>(e.q_len);
  p.k_len = static_cast<int32_t>(e.k_len);
  p.stride = static_cast<int32_t>(e.stride);
  p.q_groups = static_cast<int32_t>(q_groups);
  p.k_groups = static_cast<int32_t>(k_groups);
  p.offset = static_cast<int32_t>(e.k_len - e.q_len);
  p.causal = e.causal;
  p.scale_log2 = static_cast<float>(e.score_scale * M_LOG2E);
  p.attn_sums = e.attn_sums;
  for (int i = 0; i < 4; ++i) p.sums_stride[i] = e.sums_stride[i];
  p.k_blocks = static_cast<int32_t>(e.k_blocks);

  // Key tiles never straddle a row of the scratch: its pitch is whole key tiles of blocks.
  const int64_t key_tiles = ceil_div(k_groups, kEstimateBlockN);
  p.lse_pitch = key_tiles * (kEstimateBlockN / gpb);
  // Chunks of query blocks: chunk_size rows (the bound on the scratch the caller chose), at most
  // kEstimateMaxMTiles query tiles (the prefix table in the kernel parameters).
  const int64_t max_chunk = cuda::kEstimateMaxMTiles * kEstimateBlockM / gpb;
  const int64_t chunk_blocks = std::min({e.chunk_size / e.block_size, max_chunk, e.q_blocks});
  const cuda::StreamScratch scratch(
      static_cast<size_t>(batch_heads * chunk_blocks * gpb * p.lse_pitch) * sizeof(float),
      e.device_index, stream);
  p.lse = static_cast<float*>(scratch.get());

  for (int64_t qb0 = 0; qb0 < e.q_blocks; qb0 += chunk_blocks) {
    const int64_t blocks = std::min(chunk_blocks, e.q_blocks - qb0);
    p.q_block0 = static_cast<int32_t>(qb0);
    p.chunk_q_blocks = static_cast<int32_t>(blocks);
    p.group0 = static_cast<int32_t>(qb0 * gpb);
    p.group_end = static_cast<int32_t>(std::min((qb0 + blocks) * gpb, q_groups));
    p.m_tiles = static_cast<int32_t>(ceil_div(p.group_end - p.group0, kEstimateBlockM));
    p.tile_prefix[0] = 0;
    for (int mt = 0; mt < p.m_tiles; ++mt) {
      const int64_t last =
          std::min<int64_t>(p.group0 + (mt + 1) * kEstimateBlockM, p.group_end) - 1;
      const int64_t tiles = ceil_div(cuda::visible_groups(e, k_groups, last), kEstimateBlockN);
      p.tile_prefix[mt + 1] = p.tile_prefix[mt] + static_cast<int32_t>(tiles);
    }
    if (batch_heads * p.tile_prefix[p.m_tiles] > INT_MAX) {
      throw NotSupportedError(
          "xattn_estimate: backend 'native' launches one CTA per (batch, head, 128 query groups, "
          "256 key groups), at most 2^31 - 1 per chunk; got " +
          std::to_string(batch_heads * p.tile_prefix[p.m_tiles]) + ": pass a smaller chunk_size");
    }
    if (e.dtype == DType::kBF16) {  // validated: bf16 or fp16
      cuda::launch<cutlass::bfloat16_t>(gpb, p, batch_heads, sms, stream);
    } else {
      cuda::launch<cutlass::half_t>(gpb, p, batch_heads, sms, stream);
    }
  }
  native_find_blocks(e.select);
}

}  // namespace sparse_attn
