// The library's stream-ordered workspace pool of a device, for the scratch buffers a native op
// needs between its kernels (SplitKV partials). It keeps freed memory (release threshold:
// never), so a decode step reuses the last step's memory instead of mapping new memory, and it
// leaves the device's default pool, which the caller may use, untouched. Under graph capture an
// allocation from it becomes a graph-owned node. Created on the first call on a device (a
// warm-up call before capture, as the seed asks); null for device indices past 63.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

namespace sparse_attn::cuda {

cudaMemPool_t workspace_pool(int device);

// Scratch of `bytes` from the pool (or the device's default pool where there is none), freed on
// `stream` when it goes out of scope: work enqueued on the stream before then may use it.
class StreamScratch {
 public:
  StreamScratch(size_t bytes, int device, cudaStream_t stream);
  ~StreamScratch();
  StreamScratch(const StreamScratch&) = delete;
  StreamScratch& operator=(const StreamScratch&) = delete;
  void* get() const { return ptr_; }

 private:
  void* ptr_ = nullptr;
  cudaStream_t stream_;
};

}  // namespace sparse_attn::cuda
