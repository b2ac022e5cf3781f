#include "cuda/common/workspace_pool.h"

#include <array>
#include <cstdint>
#include <mutex>

#include "cuda/common/check.h"

namespace sparse_attn::cuda {

cudaMemPool_t workspace_pool(int device) {
  static std::mutex mutex;
  static std::array<cudaMemPool_t, 64> pools{};
  if (device < 0 || device >= static_cast<int>(pools.size())) return nullptr;
  std::lock_guard<std::mutex> lock(mutex);
  if (pools[device] == nullptr) {
    cudaMemPoolProps props = {};
    props.allocType = cudaMemAllocationTypePinned;
    props.location.type = cudaMemLocationTypeDevice;
    props.location.id = device;
    cudaMemPool_t pool = nullptr;
    SPARSE_ATTN_CUDA_CHECK(cudaMemPoolCreate(&pool, &props));
    uint64_t keep = UINT64_MAX;
    SPARSE_ATTN_CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep));
    pools[device] = pool;
  }
  return pools[device];
}

StreamScratch::StreamScratch(size_t bytes, int device, cudaStream_t stream) : stream_(stream) {
  if (bytes == 0) return;
  cudaMemPool_t pool = workspace_pool(device);
  SPARSE_ATTN_CUDA_CHECK(pool ? cudaMallocFromPoolAsync(&ptr_, bytes, pool, stream)
                              : cudaMallocAsync(&ptr_, bytes, stream));
}

// A destructor cannot throw; a failing cudaFreeAsync means the context is already gone.
StreamScratch::~StreamScratch() {
  if (ptr_) cudaFreeAsync(ptr_, stream_);
}

}  // namespace sparse_attn::cuda
