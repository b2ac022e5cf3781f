// Tensor views and owning buffers.
//
// TensorView is what every API function takes: a non-owning description of memory that the
// caller owns (a torch tensor, a numpy array, a cudaMalloc'd block). Shapes and strides are
// in elements, strides may be any non-negative value (broadcast axes have stride 0), and the
// data pointer already includes any storage offset.
//
// Tensor owns host (and, in CUDA builds, device) memory. It exists for tests, examples and
// the CLI; library functions never allocate outputs themselves.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

namespace sparse_attn {

// kU8: raw bytes (workspace buffers, and FP8 caches stored as uint8 until their format is
// named). kF8E4M3: FP8 e4m3 in the "fn" variant (OCP / torch.float8_e4m3fn: no infinities,
// S.1111.111 is NaN, largest finite 448), the format of FP8 K/V and indexer caches.
enum class DType : uint8_t { kBF16, kF16, kF32, kI32, kI64, kBool, kU8, kF8E4M3 };

// Bytes per element.
size_t dtype_size(DType dtype);
// "bfloat16", "float16", "float32", "int32", "int64", "bool", "uint8", "float8_e4m3fn"
// (torch's names).
const char* dtype_name(DType dtype);

enum class DeviceType : uint8_t { kCPU, kCUDA };

struct Device {
  DeviceType type = DeviceType::kCPU;
  int index = 0;  // CUDA ordinal; 0 for the CPU

  static Device cpu() { return {}; }
  static Device cuda(int index = 0) { return {DeviceType::kCUDA, index}; }
  bool is_cuda() const { return type == DeviceType::kCUDA; }
  bool operator==(const Device& o) const {
    return type == o.type && (type == DeviceType::kCPU || index == o.index);
  }
  bool operator!=(const Device& o) const { return !(*this == o); }
  std::string str() const;  // "cpu" or "cuda:N"
};

using Shape = std::vector<int64_t>;

// Renders a shape as "[2, 3, 4]" for error messages.
std::string shape_str(const int64_t* dims, int ndim);
std::string shape_str(const Shape& shape);

class TensorView {
 public:
  static constexpr int kMaxDims = 6;

  TensorView() = default;
  // Contiguous (row-major) view.
  TensorView(void* data, DType dtype, Device device, const Shape& shape);
  // Strided view; strides in elements.
  TensorView(void* data, DType dtype, Device device, const Shape& shape, const Shape& strides);
  // The same from arrays of `ndim` sizes and strides (a DLPack import's), without building
  // vectors on a per-call path.
  TensorView(void* data, DType dtype, Device device, int ndim, const int64_t* shape,
             const int64_t* strides);

  void* data() const { return data_; }
  template <typename T>
  T* data_as() const {
    return static_cast<T*>(data_);
  }
  DType dtype() const { return dtype_; }
  Device device() const { return device_; }
  int dim() const { return ndim_; }
  // Negative d counts from the end, as in torch. d must be in range (checked by the caller).
  int64_t size(int d) const { return shape_[d < 0 ? d + ndim_ : d]; }
  int64_t stride(int d) const { return strides_[d < 0 ? d + ndim_ : d]; }
  const int64_t* sizes() const { return shape_.data(); }
  const int64_t* strides() const { return strides_.data(); }
  Shape shape() const { return Shape(shape_.begin(), shape_.begin() + ndim_); }
  int64_t numel() const;
  size_t element_size() const { return dtype_size(dtype_); }
  bool is_contiguous() const;
  std::string shape_str() const { return sparse_attn::shape_str(shape_.data(), ndim_); }

  // The byte range [lo, hi) that the view's elements occupy; {p, p} for an empty view.
  // Used for overlap checks.
  std::pair<uintptr_t, uintptr_t> byte_range() const;

  // Byte offset of the element at `index` (one entry per dimension).
  int64_t offset_of(std::initializer_list<int64_t> index) const;

  // A view of the same memory with new shape/strides, starting `offset` elements further on.
  TensorView as_strided(const Shape& shape, const Shape& strides, int64_t offset = 0) const;
  // The sub-view at index `i` of dimension `d` (the dimension is removed).
  TensorView select(int d, int64_t i) const;
  // Elements [start, stop) of dimension d.
  TensorView narrow(int d, int64_t start, int64_t length) const;

 private:
  void* data_ = nullptr;
  DType dtype_ = DType::kF32;
  Device device_{};
  int ndim_ = 0;
  std::array<int64_t, kMaxDims> shape_{};
  std::array<int64_t, kMaxDims> strides_{};
};

// True when the two views touch at least one common byte (conservatively, by byte range).
bool views_overlap(const TensorView& a, const TensorView& b);

// An owning, contiguous buffer. Copyable handles share the storage (like torch tensors).
class Tensor {
 public:
  Tensor() = default;
  // Uninitialised memory of the given shape on the given device.
  static Tensor empty(const Shape& shape, DType dtype, Device device = Device::cpu());
  // Host copy of any view (CPU or CUDA); strides are made contiguous.
  static Tensor to_host(const TensorView& view);

  const TensorView& view() const { return view_; }
  operator const TensorView&() const { return view_; }
  void* data() const { return view_.data(); }
  template <typename T>
  T* data_as() const {
    return view_.data_as<T>();
  }
  int64_t numel() const { return view_.numel(); }
  Shape shape() const { return view_.shape(); }
  DType dtype() const { return view_.dtype(); }
  Device device() const { return view_.device(); }

 private:
  std::shared_ptr<void> storage_;
  TensorView view_;
};

// Copies src into dst elementwise (same shape and dtype; any strides; host or device, where the
// build supports the device). Used by the reference backend to stage CUDA tensors.
void copy_into(const TensorView& dst, const TensorView& src);

}  // namespace sparse_attn
