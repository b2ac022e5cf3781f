// Host staging for the reference backend: the reference computes on host memory, so CUDA
// tensors are copied to the host before the call and outputs copied back after it. CPU
// tensors pass through untouched (no copy). The copies are synchronous, which is why the
// reference is outside the graph-capture guarantee.
#pragma once

#include <optional>
#include <vector>

#include "sparse_attn/tensor.h"

namespace sparse_attn::detail {

class HostStaging {
 public:
  // A host view with the same shape as `v`: `v` itself on the CPU, a contiguous host copy
  // of it otherwise.
  TensorView input(const TensorView& v);
  std::optional<TensorView> input(const std::optional<TensorView>& v);

  // A host view to write into for the output `v`; commit() copies it back to `v` when `v`
  // lives on a device. The staged buffer starts as a copy of `v`, so elements the op leaves
  // alone keep their value.
  TensorView output(const TensorView& v);
  std::optional<TensorView> output(const std::optional<TensorView>& v);

  // Copies staged outputs back to their device tensors.
  void commit();

 private:
  std::vector<Tensor> keep_;  // host copies, alive until the staging object dies
  std::vector<std::pair<TensorView, TensorView>> writeback_;  // (device dst, host src)
};

}  // namespace sparse_attn::detail
