#include "api/xattn_checks.h"

#include <cmath>
#include <cstdint>

#include "api/check.h"

namespace sparse_attn::detail {

void check_xattn_output(const TensorView& t, std::string_view name, DType dtype, const Shape& shape,
                        std::string_view what, Device device, std::string_view device_of) {
  if (is_missing(t)) return;  // the op reports it once the other arguments are checked
  check_dtype(t, name, {dtype});
  check_shape(t, name, shape, what);
  check_device(t, name, device, device_of);
  check_data(t, name);
  check_positive_strides(t, name);
  check_no_self_overlap(t, name);
}

void check_float_input(const TensorView& t, std::string_view name, const TensorView* like,
                       std::string_view like_name) {
  check_dtype(t, name, {DType::kBF16, DType::kF16, DType::kF32});
  if (like != nullptr) {
    if (t.dtype() != like->dtype()) {
      throw_type_error("{}: expected dtype {} (the dtype of {}), got {}", name,
                       dtype_name(like->dtype()), like_name, dtype_name(t.dtype()));
    }
    check_device(t, name, like->device(), like_name);
  }
  check_data(t, name);
}

void check_gqa(int64_t hq, int64_t hkv, std::string_view q_name, std::string_view kv_name) {
  if (hkv < 1 || hq < 1 || hq % hkv != 0) {
    throw_value_error(
        "{}: expected a number of heads that is a positive multiple of the {} heads of {} "
        "(GQA), got {}",
        q_name, hkv, kv_name, hq);
  }
}

void check_select_options(const BlockSelectOptions& o, int64_t num_heads) {
  if (o.block_size < 1) {
    throw_value_error("block_size: expected a positive number of tokens, got {}", o.block_size);
  }
  auto check_one = [](double t, std::string_view name) {
    if (!(t >= 0.0 && t <= 1.0)) {
      throw_value_error("{}: expected a fraction of the attention mass in [0, 1], got {}", name, t);
    }
  };
  if (o.head_thresholds.empty()) {
    check_one(o.threshold, "threshold");
    return;
  }
  if (static_cast<int64_t>(o.head_thresholds.size()) != num_heads) {
    throw_value_error("head_thresholds: expected one threshold per query head ({}), got {}",
                      num_heads, o.head_thresholds.size());
  }
  for (size_t h = 0; h < o.head_thresholds.size(); ++h) {
    check_one(o.head_thresholds[h], fmt::format("head_thresholds[{}]", h));
  }
}

std::vector<double> head_thresholds(const BlockSelectOptions& o, int64_t num_heads) {
  if (!o.head_thresholds.empty()) return o.head_thresholds;
  return std::vector<double>(static_cast<size_t>(num_heads), o.threshold);
}

void check_native_block_sparse(
    std::initializer_list<std::pair<const TensorView*, const char*>> tensors, int64_t num_q_heads,
    std::string_view op) {
  const TensorView& q = *tensors.begin()->first;
  if (q.dtype() != DType::kBF16 && q.dtype() != DType::kF16) {
    throw_not_supported("{}: backend 'native' of {} takes bfloat16 or float16 tensors, got {}",
                        tensors.begin()->second, op, dtype_name(q.dtype()));
  }
  const int64_t d = q.size(-1);
  if (d != 64 && d != 128 && d != 256) {
    throw_not_supported("{}: backend 'native' of {} supports head dims 64, 128 and 256, got {}",
                        tensors.begin()->second, op, d);
  }
  if (num_q_heads > 256) {
    throw_not_supported("{}: backend 'native' of {} supports at most 256 query heads, got {}",
                        tensors.begin()->second, op, num_q_heads);
  }
  for (const auto& [t, name] : tensors) {
    const int64_t elem = static_cast<int64_t>(t->element_size());
    bool aligned = reinterpret_cast<uintptr_t>(t->data()) % 16 == 0 && t->stride(-1) == 1;
    for (int i = 0; i + 1 < t->dim(); ++i)
      aligned &= t->size(i) == 1 || t->stride(i) * elem % 16 == 0;
    if (!aligned) {
      throw_not_supported(
          "{}: backend 'native' of {} needs the head dim contiguous (stride 1) and the other "
          "strides and the data pointer 16-byte aligned, got strides {} at address {}",
          name, op, shape_str(t->strides(), t->dim()), fmt::ptr(t->data()));
    }
  }
}

void check_native_estimate(const TensorView& query, const TensorView& key,
                           const XAttnEstimateParams& p, std::string_view op) {
  check_native_block_sparse({{&query, "query"}, {&key, "key"}}, p.num_q_heads, op);
  const int64_t groups = p.block_size / p.stride;
  if (groups != 8 && groups != 16 && groups != 32) {
    throw_not_supported(
        "block_size: backend 'native' of {} takes block_size / stride of 8, 16 or 32 (block 128 "
        "with stride 16, 8 or 4), got block_size {} and stride {}",
        op, p.block_size, p.stride);
  }
  constexpr int64_t kMaxLen = int64_t{1} << 30;
  if (p.q_len > kMaxLen || p.k_len > kMaxLen) {
    throw_not_supported(
        "query: backend 'native' of {} takes at most 2^30 query rows and keys, got Lq = {} and "
        "Lk = {}",
        op, p.q_len, p.k_len);
  }
}

void copy_strides(const TensorView& t, int64_t* out, int n) {
  for (int d = 0; d < n; ++d) out[d] = t.stride(d);
}

}  // namespace sparse_attn::detail
