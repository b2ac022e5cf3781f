#include <algorithm>

#include "cuda/common/check.h"
#include "cuda/common/narrow_metadata.h"

namespace sparse_attn::cuda {
namespace {

__global__ void narrow_metadata_kernel(MetaPtr src, int64_t rows, int64_t cols, int64_t row_stride,
                                       int64_t col_stride, int32_t* dst) {
  const int64_t n = rows * cols;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    dst[i] = src.i32(i / cols * row_stride + i % cols * col_stride);
  }
}

}  // namespace

void NarrowedMetadata::narrow(MetaPtr& field, int64_t rows, int64_t cols, int64_t& row_stride,
                              int64_t* col_stride) {
  if (!field || !field.wide()) return;
  parts_.push_back({&field, &row_stride, col_stride, field, rows, cols, row_stride,
                    col_stride ? *col_stride : 0, total_});
  total_ += rows * cols;
}

void NarrowedMetadata::finish() {
  if (total_ == 0) return;
  scratch_.emplace(static_cast<size_t>(total_) * sizeof(int32_t), device_, stream_);
  int32_t* base = static_cast<int32_t*>(scratch_->get());
  for (const Part& part : parts_) {
    const int64_t n = part.rows * part.cols;
    if (n > 0) {
      const int threads = 256;
      const int64_t blocks = std::min<int64_t>((n + threads - 1) / threads, 1024);
      narrow_metadata_kernel<<<static_cast<unsigned>(blocks), threads, 0, stream_>>>(
          part.src, part.rows, part.cols, part.src_row_stride, part.src_col_stride,
          base + part.offset);
      SPARSE_ATTN_CUDA_CHECK_LAUNCH();
    }
    *part.field = MetaPtr(base + part.offset, DType::kI32);
    *part.row_stride = part.cols;
    if (part.col_stride) *part.col_stride = 1;
  }
}

}  // namespace sparse_attn::cuda
