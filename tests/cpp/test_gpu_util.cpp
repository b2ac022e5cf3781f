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

CapturedGraph::CapturedGraph(const std::function<void(cudaStream_t)>& call) {
  if (cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking) != cudaSuccess) return;
  call(stream_);
  if (cudaStreamSynchronize(stream_) != cudaSuccess) return;
  if (cudaStreamBeginCapture(stream_, cudaStreamCaptureModeGlobal) != cudaSuccess) return;
  call(stream_);
  if (cudaStreamEndCapture(stream_, &graph_) != cudaSuccess) return;
  if (cudaGraphInstantiate(&exec_, graph_, 0) != cudaSuccess) exec_ = nullptr;
}

CapturedGraph::~CapturedGraph() {
  if (exec_) cudaGraphExecDestroy(exec_);
  if (graph_) cudaGraphDestroy(graph_);
  if (stream_) cudaStreamDestroy(stream_);
}

cudaError_t CapturedGraph::replay() const {
  const cudaError_t launched = cudaGraphLaunch(exec_, stream_);
  return launched != cudaSuccess ? launched : cudaStreamSynchronize(stream_);
}

}  // namespace sparse_attn::testing
