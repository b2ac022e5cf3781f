#include "cuda/common/device_props.h"

#include <cuda_runtime_api.h>

#include <array>
#include <atomic>

#include "cuda/common/check.h"

namespace sparse_attn::cuda {
namespace {

// One cache per attribute, a slot per device (0: not read yet; devices past the table are read
// every time).
template <cudaDeviceAttr kAttribute>
int cached_attribute(int device) {
  static std::array<std::atomic<int>, 64> cache{};
  const bool slot = device >= 0 && device < static_cast<int>(cache.size());
  if (slot && cache[device] != 0) return cache[device];
  int value = 0;
  SPARSE_ATTN_CUDA_CHECK(cudaDeviceGetAttribute(&value, kAttribute, device));
  if (slot) cache[device] = value;
  return value;
}

}  // namespace

int sm_count(int device) { return cached_attribute<cudaDevAttrMultiProcessorCount>(device); }
int l2_cache_bytes(int device) { return cached_attribute<cudaDevAttrL2CacheSize>(device); }

}  // namespace sparse_attn::cuda
