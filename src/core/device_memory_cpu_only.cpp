// Device-memory hooks of a build without CUDA: every use names what is missing.
#include "core/device_memory.h"
#include "sparse_attn/errors.h"

namespace sparse_attn::detail {

std::shared_ptr<void> device_alloc(size_t, Device device) {
  throw NotSupportedError("cannot allocate on " + device.str() +
                          ": this sparse_attn build has no CUDA support");
}

void device_copy(const TensorView& dst, const TensorView& src) {
  const Device d = dst.device().is_cuda() ? dst.device() : src.device();
  throw NotSupportedError("cannot copy to or from " + d.str() +
                          ": this sparse_attn build has no CUDA support");
}

}  // namespace sparse_attn::detail
