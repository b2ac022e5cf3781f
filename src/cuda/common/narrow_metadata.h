// int32 copies of int64 metadata on the device, for kernels that read ids as int32 (their hot
// loops issue a pass's loads together, which one width branch a load would break up). The
// copies are made on the call's stream with no host read of the values, so a captured graph
// narrows the metadata current at replay. Each value saturates to the int32 range; the bounds
// the kernels compare it with (rows, key lengths, page counts) fit int32 (the native checks
// make sure), so a saturated value is exactly as in or out of range as the stored one.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <optional>
#include <vector>

#include "api/meta_ptr.h"
#include "cuda/common/workspace_pool.h"

namespace sparse_attn::cuda {

// One call's narrowed metadata, in one stream-ordered scratch allocation freed on the stream
// when the object goes (after the launches that read it are queued).
class NarrowedMetadata {
 public:
  NarrowedMetadata(int device, cudaStream_t stream) : device_(device), stream_(stream) {}

  // If `field` holds int64 elements, [rows, cols] of them at the given strides (in elements;
  // col_stride null for one column): finish() copies them into contiguous int32 and points
  // `field` and the strides there (row stride cols, column stride 1). Others are left alone.
  void narrow(MetaPtr& field, int64_t rows, int64_t cols, int64_t& row_stride,
              int64_t* col_stride = nullptr);

  // Allocates the scratch, queues the copies and redirects the fields.
  void finish();

 private:
  struct Part {
    MetaPtr* field;
    int64_t* row_stride;
    int64_t* col_stride;
    MetaPtr src;
    int64_t rows, cols, src_row_stride, src_col_stride, offset;
  };
  int device_;
  cudaStream_t stream_;
  std::vector<Part> parts_;
  int64_t total_ = 0;
  std::optional<StreamScratch> scratch_;
};

}  // namespace sparse_attn::cuda
