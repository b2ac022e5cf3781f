#include "gpu_test_util.h"
#include "test_util.h"

namespace sparse_attn::testing {

bool gpu_available() {
  static const bool available = [] {
    int n = 0;
    return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
  }();
  return available;
}

Tensor to_device(const Tensor& host) {
  Tensor d = Tensor::empty(host.shape(), host.dtype(), Device::cuda(0));
  copy_into(d.view(), host.view());
  return d;
}

Tensor poisoned_device(const Shape& shape, DType dtype) {
  Tensor h = Tensor::empty(shape, dtype);
  poison(h.view());
  return to_device(h);
}

}  // namespace sparse_attn::testing
