// Device memory hooks of the CUDA build (declared in core/device_memory.h).
#include "core/device_memory.h"

#include <optional>
#include <vector>

#include "cuda/common/check.h"
#include "cuda/common/device_guard.h"
#include "sparse_attn/errors.h"

namespace sparse_attn::detail {
namespace {

using cuda::DeviceGuard;

// The bytes [lo, hi) a view touches, as a pointer and a length.
struct Span {
  char* base;
  size_t bytes;
};
Span span_of(const TensorView& v) {
  const auto [lo, hi] = v.byte_range();
  return {reinterpret_cast<char*>(lo), static_cast<size_t>(hi - lo)};
}

// A host copy of the whole byte span of a device view, with a view of the same strides into
// it, so that strided device views can be read and written element by element on the host.
struct HostMirror {
  std::vector<char> bytes;
  TensorView view;
  Span span;

  explicit HostMirror(const TensorView& v) : span(span_of(v)) {
    bytes.resize(span.bytes);
    SPARSE_ATTN_CUDA_CHECK(cudaMemcpy(bytes.data(), span.base, span.bytes, cudaMemcpyDefault));
    const auto offset = static_cast<char*>(v.data()) - span.base;
    view = TensorView(bytes.data() + offset, v.dtype(), Device::cpu(), v.shape(),
                      Shape(v.strides(), v.strides() + v.dim()));
  }
  void write_back() const {
    SPARSE_ATTN_CUDA_CHECK(cudaMemcpy(span.base, bytes.data(), span.bytes, cudaMemcpyDefault));
  }
};

// The copy itself: dense on both sides one cudaMemcpy, otherwise through host mirrors.
void copy_synchronously(const TensorView& dst, const TensorView& src);

}  // namespace

std::shared_ptr<void> device_alloc(size_t bytes, Device device) {
  DeviceGuard guard(device.index);
  void* p = nullptr;
  SPARSE_ATTN_CUDA_CHECK(cudaMalloc(&p, bytes));
  // A deleter cannot throw; a failing cudaFree means the context is already gone.
  return std::shared_ptr<void>(p, [](void* q) { cudaFree(q); });
}

void device_copy(const TensorView& dst, const TensorView& src) {
  const Device device = dst.device().is_cuda() ? dst.device() : src.device();
  DeviceGuard guard(device.index);
  // The caller's work may be on any stream, including non-blocking ones that the legacy
  // stream of cudaMemcpy does not wait for, and a host-to-device cudaMemcpy may return before
  // its DMA lands. Synchronising the device before and after makes the copy see all earlier
  // work and be complete for all later work, whichever streams those use.
  SPARSE_ATTN_CUDA_CHECK(cudaDeviceSynchronize());
  copy_synchronously(dst, src);
  SPARSE_ATTN_CUDA_CHECK(cudaDeviceSynchronize());
}

namespace {

void copy_synchronously(const TensorView& dst, const TensorView& src) {
  // Dense on both sides: one copy. Strided: through host mirrors of the byte spans, which
  // keeps the bytes between a strided destination's elements as they were. Both are
  // synchronous, as the reference's staging needs.
  if (dst.is_contiguous() && src.is_contiguous()) {
    SPARSE_ATTN_CUDA_CHECK(
        cudaMemcpy(dst.data(), src.data(), dst.numel() * dst.element_size(), cudaMemcpyDefault));
    return;
  }
  std::optional<HostMirror> src_mirror;
  TensorView host_src = src;
  if (src.device().is_cuda()) {
    src_mirror.emplace(src);
    host_src = src_mirror->view;
  }
  if (!dst.device().is_cuda()) {
    copy_into(dst, host_src);
    return;
  }
  HostMirror dst_mirror(dst);
  copy_into(dst_mirror.view, host_src);
  dst_mirror.write_back();
}

}  // namespace

}  // namespace sparse_attn::detail
