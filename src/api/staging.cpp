#include "api/staging.h"

namespace sparse_attn::detail {

TensorView HostStaging::input(const TensorView& v) {
  if (!v.device().is_cuda()) return v;
  keep_.push_back(Tensor::to_host(v));
  return keep_.back().view();
}

std::optional<TensorView> HostStaging::input(const std::optional<TensorView>& v) {
  if (!v) return std::nullopt;
  return input(*v);
}

TensorView HostStaging::output(const TensorView& v) {
  if (!v.device().is_cuda()) return v;
  keep_.push_back(Tensor::to_host(v));
  writeback_.emplace_back(v, keep_.back().view());
  return keep_.back().view();
}

std::optional<TensorView> HostStaging::output(const std::optional<TensorView>& v) {
  if (!v) return std::nullopt;
  return output(*v);
}

void HostStaging::commit() {
  for (const auto& [dst, src] : writeback_) copy_into(dst, src);
  writeback_.clear();
}

}  // namespace sparse_attn::detail
