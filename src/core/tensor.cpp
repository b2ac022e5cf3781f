#include "sparse_attn/tensor.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "core/device_memory.h"
#include "sparse_attn/errors.h"

namespace sparse_attn {

size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kBF16:
    case DType::kF16:
      return 2;
    case DType::kF32:
    case DType::kI32:
      return 4;
    case DType::kI64:
      return 8;
    case DType::kBool:
    case DType::kU8:
    case DType::kF8E4M3:
      return 1;
  }
  return 0;
}

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kBF16:
      return "bfloat16";
    case DType::kF16:
      return "float16";
    case DType::kF32:
      return "float32";
    case DType::kI32:
      return "int32";
    case DType::kI64:
      return "int64";
    case DType::kBool:
      return "bool";
    case DType::kU8:
      return "uint8";
    case DType::kF8E4M3:
      return "float8_e4m3fn";
  }
  return "?";
}

std::string Device::str() const {
  return type == DeviceType::kCPU ? std::string("cpu") : "cuda:" + std::to_string(index);
}

std::string shape_str(const int64_t* dims, int ndim) {
  std::string s = "[";
  for (int i = 0; i < ndim; ++i) {
    if (i) s += ", ";
    s += std::to_string(dims[i]);
  }
  return s + "]";
}

std::string shape_str(const Shape& shape) {
  return shape_str(shape.data(), static_cast<int>(shape.size()));
}

namespace {

void check_rank(size_t ndim) {
  if (ndim > static_cast<size_t>(TensorView::kMaxDims)) {
    throw ValueError("TensorView: at most " + std::to_string(TensorView::kMaxDims) +
                     " dimensions are supported, got " + std::to_string(ndim));
  }
}

// The rank of a view given as a shape and a strides vector, which must agree.
int common_rank(const Shape& shape, const Shape& strides) {
  check_rank(shape.size());
  if (strides.size() != shape.size()) {
    throw ValueError("TensorView: shape " + sparse_attn::shape_str(shape) + " and strides " +
                     sparse_attn::shape_str(strides) + " differ in length");
  }
  return static_cast<int>(shape.size());
}

Shape contiguous_strides(const Shape& shape) {
  Shape strides(shape.size());
  int64_t s = 1;
  for (size_t i = shape.size(); i-- > 0;) {
    strides[i] = s;
    s *= std::max<int64_t>(shape[i], 1);
  }
  return strides;
}

}  // namespace

TensorView::TensorView(void* data, DType dtype, Device device, const Shape& shape)
    : TensorView(data, dtype, device, shape, contiguous_strides(shape)) {}

TensorView::TensorView(void* data, DType dtype, Device device, const Shape& shape,
                       const Shape& strides)
    : TensorView(data, dtype, device, common_rank(shape, strides), shape.data(), strides.data()) {}

TensorView::TensorView(void* data, DType dtype, Device device, int ndim, const int64_t* shape,
                       const int64_t* strides)
    : data_(data), dtype_(dtype), device_(device), ndim_(ndim) {
  if (ndim < 0) throw ValueError("TensorView: negative rank " + std::to_string(ndim));
  check_rank(static_cast<size_t>(ndim));
  for (int i = 0; i < ndim_; ++i) {
    if (shape[i] < 0) {
      throw ValueError("TensorView: negative size in shape " + sparse_attn::shape_str(shape, ndim));
    }
    shape_[i] = shape[i];
    strides_[i] = strides[i];
  }
}

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int i = 0; i < ndim_; ++i) n *= shape_[i];
  return n;
}

bool TensorView::is_contiguous() const {
  int64_t expected = 1;
  for (int i = ndim_ - 1; i >= 0; --i) {
    if (shape_[i] != 1 && strides_[i] != expected) return false;
    expected *= shape_[i];
  }
  return true;
}

std::pair<uintptr_t, uintptr_t> TensorView::byte_range() const {
  const auto base = reinterpret_cast<uintptr_t>(data_);
  if (numel() == 0) return {base, base};
  int64_t lo = 0;
  int64_t hi = 0;
  for (int i = 0; i < ndim_; ++i) {
    const int64_t extent = (shape_[i] - 1) * strides_[i];
    if (extent < 0) {
      lo += extent;
    } else {
      hi += extent;
    }
  }
  const auto es = static_cast<int64_t>(element_size());
  return {static_cast<uintptr_t>(static_cast<int64_t>(base) + lo * es),
          static_cast<uintptr_t>(static_cast<int64_t>(base) + (hi + 1) * es)};
}

int64_t TensorView::offset_of(std::initializer_list<int64_t> index) const {
  int64_t off = 0;
  int d = 0;
  for (int64_t i : index) off += i * strides_[d++];
  return off * static_cast<int64_t>(element_size());
}

TensorView TensorView::as_strided(const Shape& shape, const Shape& strides, int64_t offset) const {
  auto* p = static_cast<char*>(data_) + offset * static_cast<int64_t>(element_size());
  return TensorView(p, dtype_, device_, shape, strides);
}

TensorView TensorView::select(int d, int64_t i) const {
  if (d < 0) d += ndim_;
  Shape shape;
  Shape strides;
  for (int k = 0; k < ndim_; ++k) {
    if (k == d) continue;
    shape.push_back(shape_[k]);
    strides.push_back(strides_[k]);
  }
  return as_strided(shape, strides, i * strides_[d]);
}

TensorView TensorView::narrow(int d, int64_t start, int64_t length) const {
  if (d < 0) d += ndim_;
  Shape shape = this->shape();
  shape[d] = length;
  return as_strided(shape, Shape(strides_.begin(), strides_.begin() + ndim_), start * strides_[d]);
}

bool views_overlap(const TensorView& a, const TensorView& b) {
  if (a.numel() == 0 || b.numel() == 0) return false;
  if (a.device() != b.device()) return false;
  const auto [alo, ahi] = a.byte_range();
  const auto [blo, bhi] = b.byte_range();
  return alo < bhi && blo < ahi;
}

Tensor Tensor::empty(const Shape& shape, DType dtype, Device device) {
  Tensor t;
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  // Round up to 64 bytes so vector loads in tests never run past the allocation.
  const size_t bytes = ((std::max<int64_t>(n, 1) * dtype_size(dtype)) + 63) / 64 * 64;
  if (device.is_cuda()) {
    t.storage_ = detail::device_alloc(bytes, device);
  } else {
    void* p = std::aligned_alloc(64, bytes);
    if (p == nullptr)
      throw Error("Tensor::empty: host allocation of " + std::to_string(bytes) + " bytes failed");
    t.storage_ = std::shared_ptr<void>(p, std::free);
  }
  t.view_ = TensorView(t.storage_.get(), dtype, device, shape);
  return t;
}

Tensor Tensor::to_host(const TensorView& view) {
  Tensor t = empty(view.shape(), view.dtype(), Device::cpu());
  copy_into(t.view(), view);
  return t;
}

namespace {

// Walks every element of `dst`/`src` (same shape) and copies it; both on the host.
void host_strided_copy(const TensorView& dst, const TensorView& src) {
  const int nd = dst.dim();
  const int64_t es = static_cast<int64_t>(dst.element_size());
  const int64_t n = dst.numel();
  std::array<int64_t, TensorView::kMaxDims> idx{};
  auto* d = static_cast<char*>(dst.data());
  const auto* s = static_cast<const char*>(src.data());
  for (int64_t e = 0; e < n; ++e) {
    int64_t doff = 0;
    int64_t soff = 0;
    for (int k = 0; k < nd; ++k) {
      doff += idx[k] * dst.stride(k);
      soff += idx[k] * src.stride(k);
    }
    std::memcpy(d + doff * es, s + soff * es, es);
    for (int k = nd - 1; k >= 0; --k) {
      if (++idx[k] < dst.size(k)) break;
      idx[k] = 0;
    }
  }
}

}  // namespace

void copy_into(const TensorView& dst, const TensorView& src) {
  if (dst.shape() != src.shape() || dst.dtype() != src.dtype()) {
    throw ValueError("copy_into: dst " + dst.shape_str() + " " + dtype_name(dst.dtype()) +
                     " does not match src " + src.shape_str() + " " + dtype_name(src.dtype()));
  }
  if (dst.numel() == 0) return;
  if (!dst.device().is_cuda() && !src.device().is_cuda()) {
    host_strided_copy(dst, src);
    return;
  }
  detail::device_copy(dst, src);
}

}  // namespace sparse_attn
