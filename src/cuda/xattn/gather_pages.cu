// xattention_prefill_paged's gather (native_gather_pages): the keys and values of every request
// from their pages into contiguous [batch, k_len, Hkv, D] scratch, in 16-byte pieces. The
// estimate reads each key S D / 64 times over and the attention kernel reads contiguous rows by
// TMA, so one pass over the cache costs far less than either would reading pages themselves.
#include <cuda_runtime.h>

#include <algorithm>

#include "api/xattn_params.h"
#include "cuda/common/check.h"
#include "cuda/common/device_guard.h"
#include "cuda/common/workspace_pool.h"

namespace sparse_attn {
namespace cuda::xattn {
namespace {

// One thread per 16-byte piece of K and of V; `pieces` = D / 8 per (request, key, head).
__global__ void gather_pages_kernel(const __grid_constant__ PagedGatherParams p, uint4* k_out,
                                    uint4* v_out, int64_t total, int pieces) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < total;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t piece = i % pieces, row = i / pieces;  // row: (b, t, h)
    const int64_t h = row % p.num_kv_heads, t = row / p.num_kv_heads % p.k_len,
                  b = row / p.num_kv_heads / p.k_len;
    const int64_t page =
        p.block_table[b * p.block_table_stride[0] + (t / p.page_size) * p.block_table_stride[1]];
    uint4 k = make_uint4(0, 0, 0, 0), v = k;
    if (page >= 0 && page < p.num_pages) {
      const int64_t slot = t % p.page_size;
      k = __ldg(reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(p.k_cache) +
                                               page * p.k_stride[0] + slot * p.k_stride[1] +
                                               h * p.k_stride[2]) +
                piece);
      v = __ldg(reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(p.v_cache) +
                                               page * p.v_stride[0] + slot * p.v_stride[1] +
                                               h * p.v_stride[2]) +
                piece);
    }
    k_out[i] = k;
    v_out[i] = v;
  }
}

}  // namespace
}  // namespace cuda::xattn

void native_gather_pages(const PagedGatherParams& p,
                         const std::function<void(const void* k, const void* v)>& use) {
  cuda::DeviceGuard guard(p.device_index);
  const auto stream = static_cast<cudaStream_t>(p.stream);
  const int pieces = static_cast<int>(p.head_dim / 8);  // validated: 64, 128 or 256
  const int64_t total = p.batch * p.k_len * p.num_kv_heads * pieces;
  const size_t bytes = static_cast<size_t>(total) * 16;
  const cuda::StreamScratch k(bytes, p.device_index, stream), v(bytes, p.device_index, stream);
  if (total > 0) {
    constexpr int kThreads = 256;
    const int64_t blocks = std::min<int64_t>((total + kThreads - 1) / kThreads, 65536);
    cuda::xattn::gather_pages_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
        p, static_cast<uint4*>(k.get()), static_cast<uint4*>(v.get()), total, pieces);
    SPARSE_ATTN_CUDA_CHECK_LAUNCH();
  }
  use(k.get(), v.get());
}

}  // namespace sparse_attn
