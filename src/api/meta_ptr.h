// MetaPtr: how every backend reads integer metadata (positions, request ids, offsets, lengths,
// page tables, token and block ids). Callers store it as int32 or int64 (engines keep
// positions and request ids in int64); the library reads either dtype where it lies, without
// a conversion copy on the host or the device, through this one accessor. A params struct holds
// a MetaPtr where it would hold a `const int32_t*`, with the strides beside it as before.
//
// The element width is a runtime value that is the same for every thread of a launch, so the
// branch it costs per load is uniform; next to the K/V traffic the metadata steers it is noise,
// and one kernel instantiation serves both widths.
#pragma once

#include <cstdint>

#include "sparse_attn/tensor.h"

#if defined(__CUDACC__)
#define SPARSE_ATTN_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define SPARSE_ATTN_HOST_DEVICE inline
#endif

namespace sparse_attn {

class MetaPtr {
 public:
  MetaPtr() = default;
  // `data` holds int32 or int64 elements; validation has refused every other dtype.
  MetaPtr(const void* data, DType dtype) : data_(data), wide_(dtype == DType::kI64) {}

  SPARSE_ATTN_HOST_DEVICE explicit operator bool() const { return data_ != nullptr; }
  SPARSE_ATTN_HOST_DEVICE const void* data() const { return data_; }
  SPARSE_ATTN_HOST_DEVICE bool wide() const { return wide_; }  // int64 elements
  SPARSE_ATTN_HOST_DEVICE int element_size() const { return wide_ ? 8 : 4; }

  // Element i as stored (an int32 element widened).
  SPARSE_ATTN_HOST_DEVICE int64_t operator[](int64_t i) const {
    return wide_ ? load(static_cast<const int64_t*>(data_) + i)
                 : load(static_cast<const int32_t*>(data_) + i);
  }

  // Element i saturated to the int32 range, for kernels that keep ids in 32-bit registers. An
  // int32 tensor can hold the saturated value, so the kernels (which take every int32 value)
  // handle it; and it passes or fails every comparison with an int32-range bound (a length, a
  // page count) as the stored value does, so the result is the stored value's wherever the
  // bounds fit int32 (the native checks make sure they do).
  SPARSE_ATTN_HOST_DEVICE int32_t i32(int64_t i) const {
    const int64_t v = (*this)[i];
    return v < INT32_MIN ? INT32_MIN : (v > INT32_MAX ? INT32_MAX : static_cast<int32_t>(v));
  }

  // The elements as int32, for kernels whose launcher narrowed this metadata to int32
  // (cuda/common/narrow_metadata.h), so their hot loops load it with no width branch.
  SPARSE_ATTN_HOST_DEVICE const int32_t* narrowed() const {
    return static_cast<const int32_t*>(data_);
  }

  // The pointer `i` elements further on, and that element's address (for prefetches).
  SPARSE_ATTN_HOST_DEVICE MetaPtr operator+(int64_t i) const {
    MetaPtr p = *this;
    p.data_ = address(i);
    return p;
  }
  SPARSE_ATTN_HOST_DEVICE const void* address(int64_t i) const {
    return static_cast<const char*>(data_) + i * element_size();
  }

 private:
  // Metadata is never written while a kernel reads it, so device loads go through the
  // read-only path.
  template <typename T>
  SPARSE_ATTN_HOST_DEVICE static int64_t load(const T* p) {
#if defined(__CUDA_ARCH__)
    if constexpr (sizeof(T) == 8) {
      return __ldg(reinterpret_cast<const long long*>(p));
    } else {
      return __ldg(p);
    }
#else
    return *p;
#endif
  }

  const void* data_ = nullptr;
  bool wide_ = false;
};

// The MetaPtr of a validated metadata view.
inline MetaPtr meta_ptr(const TensorView& t) { return MetaPtr(t.data(), t.dtype()); }

}  // namespace sparse_attn
