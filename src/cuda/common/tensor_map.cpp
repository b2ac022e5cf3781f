#include "cuda/common/tensor_map.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <string>

#include "cuda/common/check.h"
#include "sparse_attn/errors.h"

namespace sparse_attn::cuda {
namespace {

using EncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*,
                                 const cuuint64_t*, const cuuint64_t*, const cuuint32_t*,
                                 const cuuint32_t*, CUtensorMapInterleave, CUtensorMapSwizzle,
                                 CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

// cuTensorMapEncodeTiled through the runtime's entry-point lookup, so the library does not link
// the driver library (a CPU-only machine loads it without one).
EncodeTiled encode_tiled(const char* op) {
  static const EncodeTiled fn = [] {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult found{};
    SPARSE_ATTN_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000,
                                                            cudaEnableDefault, &found));
    return found == cudaDriverEntryPointSuccess ? reinterpret_cast<EncodeTiled>(ptr) : nullptr;
  }();
  if (fn == nullptr)
    throw Error(std::string(op) + ": the CUDA driver has no cuTensorMapEncodeTiled");
  return fn;
}

}  // namespace

CUtensorMap tiled_tensor_map(const void* base, DType dtype, int rank, const int64_t* sizes,
                             const int64_t* strides, const uint32_t* box, const char* op) {
  CUtensorMap map{};
  if (base == nullptr) return map;
  constexpr int64_t kElem = 2;
  cuuint64_t dims[5], byte_strides[4];
  cuuint32_t boxes[5], element_strides[5];
  for (int i = 0; i < rank; ++i) {
    dims[i] = static_cast<cuuint64_t>(std::max<int64_t>(sizes[i], 1));
    boxes[i] = box[i];
    element_strides[i] = 1;
    if (i > 0)
      byte_strides[i - 1] = sizes[i] > 1 ? static_cast<cuuint64_t>(strides[i - 1] * kElem) : 16;
  }
  const CUresult r = encode_tiled(op)(
      &map,
      dtype == DType::kBF16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
      static_cast<cuuint32_t>(rank), const_cast<void*>(base), dims, byte_strides, boxes,
      element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
      CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    throw Error(std::string(op) + ": cuTensorMapEncodeTiled failed with CUresult " +
                std::to_string(static_cast<int>(r)));
  }
  return map;
}

}  // namespace sparse_attn::cuda
