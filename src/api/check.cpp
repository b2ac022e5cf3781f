#include "api/check.h"

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

namespace sparse_attn::detail {

std::string dtype_list(std::initializer_list<DType> dtypes) {
  std::string s;
  size_t i = 0;
  for (DType d : dtypes) {
    if (i > 0) s += (i + 1 == dtypes.size()) ? " or " : ", ";
    s += dtype_name(d);
    ++i;
  }
  return s;
}

void check_dtype(const TensorView& t, std::string_view name, std::initializer_list<DType> allowed) {
  for (DType d : allowed) {
    if (t.dtype() == d) return;
  }
  throw_type_error("{}: expected dtype {}, got {}", name, dtype_list(allowed),
                   dtype_name(t.dtype()));
}

void check_metadata_dtype(const TensorView& t, std::string_view name) {
  check_dtype(t, name, {DType::kI32, DType::kI64});
}

TensorView resolve_cache_dtype(const TensorView& t, std::string_view name,
                               const std::optional<DType>& format) {
  if (!format) {
    if (t.dtype() == DType::kU8) {
      throw_type_error(
          "{}: uint8 storage is read as FP8 e4m3 only when the format is named: pass "
          "kv_cache_dtype='fp8_e4m3' (DType::kF8E4M3), or a float8_e4m3fn view of it",
          name);
    }
    return t;
  }
  if (*format == DType::kBF16 || *format == DType::kF16) {
    if (t.dtype() != *format) {
      throw_type_error("{}: expected dtype {} (kv_cache_dtype), got {}", name, dtype_name(*format),
                       dtype_name(t.dtype()));
    }
    return t;
  }
  if (*format != DType::kF8E4M3) {
    throw_value_error(
        "kv_cache_dtype: expected float8_e4m3fn (FP8 e4m3), bfloat16, float16 or none (read {} "
        "as its dtype), got {}",
        name, dtype_name(*format));
  }
  if (t.dtype() != DType::kU8 && t.dtype() != DType::kF8E4M3) {
    throw_type_error(
        "{}: kv_cache_dtype float8_e4m3fn reads uint8 or float8_e4m3fn storage, got {}; leave "
        "kv_cache_dtype unset for {} caches",
        name, dtype_name(t.dtype()), dtype_name(t.dtype()));
  }
  return TensorView(t.data(), DType::kF8E4M3, t.device(), t.dim(), t.sizes(), t.strides());
}

void check_rank(const TensorView& t, std::string_view name, std::initializer_list<int> ranks) {
  std::string expected;
  size_t i = 0;
  for (int r : ranks) {
    if (t.dim() == r) return;
    if (i > 0) expected += (i + 1 == ranks.size()) ? " or " : ", ";
    expected += std::to_string(r);
    ++i;
  }
  throw_value_error("{}: expected {} dimensions, got shape {}", name, expected, t.shape_str());
}

void check_size(const TensorView& t, std::string_view name, int d, int64_t expected,
                std::string_view what) {
  if (t.size(d) != expected) {
    throw_value_error("{}: expected shape[{}] == {} ({}), got shape {}", name, d, expected, what,
                      t.shape_str());
  }
}

void check_shape(const TensorView& t, std::string_view name, const Shape& expected,
                 std::string_view what) {
  if (t.shape() != expected) {
    throw_value_error("{}: expected shape {} ({}), got {}", name, shape_str(expected), what,
                      t.shape_str());
  }
}

void check_device(const TensorView& t, std::string_view name, Device device,
                  std::string_view ref_name) {
  if (t.device() != device) {
    throw_value_error("{}: expected device {} (the device of {}), got {}", name, device.str(),
                      ref_name, t.device().str());
  }
}

void check_data(const TensorView& t, std::string_view name) {
  if (t.numel() > 0 && t.data() == nullptr) {
    throw_value_error("{}: data pointer is null for a tensor of shape {}", name, t.shape_str());
  }
}

void check_positive_strides(const TensorView& t, std::string_view name) {
  for (int d = 0; d < t.dim(); ++d) {
    if (t.size(d) > 1 && t.stride(d) <= 0) {
      throw_value_error("{}: expected positive strides, got stride {} on axis {} (shape {})", name,
                        t.stride(d), d, t.shape_str());
    }
  }
}

void check_no_self_overlap(const TensorView& t, std::string_view name) {
  // Sorted by stride, each axis must step past everything the smaller-stride axes span.
  std::vector<std::pair<int64_t, int64_t>> axes;  // (stride, size) of axes longer than 1
  for (int d = 0; d < t.dim(); ++d) {
    if (t.size(d) > 1) axes.emplace_back(t.stride(d), t.size(d));
  }
  std::sort(axes.begin(), axes.end());
  int64_t span = 0;  // largest offset reachable with the axes so far
  for (const auto& [stride, size] : axes) {
    if (stride <= span) {
      throw_value_error(
          "{}: elements overlap each other (shape {}, strides {}); outputs need a "
          "non-overlapping layout",
          name, t.shape_str(), shape_str(t.strides(), t.dim()));
    }
    span += stride * (size - 1);
  }
}

void check_row_view(const TensorView& t, std::string_view name, int n) {
  // Axes of size 1 do not constrain the collapse; compare each longer axis with the next longer.
  int64_t inner_stride = 0;
  int64_t inner_size = 1;
  bool have_inner = false;
  for (int d = n - 1; d >= 0; --d) {
    if (t.size(d) == 1) continue;
    if (have_inner && t.stride(d) != inner_stride * inner_size) {
      throw_value_error(
          "{}: batch/query axes must form a zero-copy row view (stride[{}] == {} expected, got {}; "
          "shape {}); pass a flattened tensor instead",
          name, d, inner_stride * inner_size, t.stride(d), t.shape_str());
    }
    inner_stride = t.stride(d);
    inner_size = t.size(d);
    have_inner = true;
  }
}

void check_vector_load_layout(const TensorView& t, std::string_view name) {
  const int64_t es = static_cast<int64_t>(t.element_size());
  bool ok = t.dim() == 0 || t.size(-1) <= 1 || t.stride(-1) == 1;
  ok = ok && reinterpret_cast<uintptr_t>(t.data()) % 16 == 0;
  for (int d = 0; ok && d + 1 < t.dim(); ++d) {
    if (t.size(d) > 1) ok = t.stride(d) > 0 && (t.stride(d) * es) % 16 == 0;
  }
  if (!ok) {
    throw_value_error(
        "{}: vector loads require unit feature stride and 16-byte alignment; pass a contiguous "
        "copy or adjust the slice offsets instead (shape {}, strides {}, data_ptr % 16 = {})",
        name, t.shape_str(), shape_str(t.strides(), t.dim()),
        reinterpret_cast<uintptr_t>(t.data()) % 16);
  }
}

void check_not_missing(const TensorView& t, std::string_view name) {
  if (is_missing(t)) {
    throw_value_error(
        "{}: missing output (an empty TensorView: nothing allocated); the other arguments passed "
        "their checks",
        name);
  }
}

void check_no_overlap(const TensorView& out, std::string_view out_name, const TensorView& in,
                      std::string_view in_name) {
  if (is_missing(out) || is_missing(in)) return;
  if (views_overlap(out, in)) {
    throw_value_error("{}: output memory overlaps {}; outputs must not alias inputs", out_name,
                      in_name);
  }
}

namespace {

bool positive_finite_float32(double value) {
  const float f = static_cast<float>(value);
  return std::isfinite(value) && std::isfinite(f) && f > 0.f;
}

}  // namespace

float check_float32_scale(double value, std::string_view name) {
  if (!positive_finite_float32(value)) {
    throw_value_error("{}: expected a value representable as a positive finite float32, got {}",
                      name, value);
  }
  return static_cast<float>(value);
}

float check_float32_scale(double value, std::string_view name, std::string_view derived,
                          double argument) {
  if (!positive_finite_float32(value)) {
    throw_value_error(
        "{}: expected {} to be representable as a positive finite float32, got {} = {} ({} = {})",
        name, derived, derived, value, name, argument);
  }
  return static_cast<float>(value);
}

int64_t checked_size_product(int64_t a, int64_t b, std::string_view name, std::string_view what) {
  int64_t product = 0;
  if (__builtin_mul_overflow(a, b, &product)) {
    throw_value_error("{}: {} = {} * {} does not fit in 64 bits", name, what, a, b);
  }
  return product;
}

void check_workspace(const TensorView& t, std::string_view name, Device device,
                     std::string_view ref_name) {
  check_dtype(t, name, {DType::kU8});
  check_rank(t, name, {1});
  check_device(t, name, device, ref_name);
  if (t.size(0) > 1 && t.stride(0) != 1) {
    throw_value_error("{}: expected a contiguous byte buffer (stride 1), got stride {}", name,
                      t.stride(0));
  }
  check_data(t, name);
  if (reinterpret_cast<uintptr_t>(t.data()) % kWorkspaceAlignment != 0) {
    throw_value_error("{}: expected a {}-byte aligned data pointer, got {}", name,
                      kWorkspaceAlignment, t.data());
  }
}

void check_workspace_size(const TensorView& t, std::string_view name, size_t required,
                          std::string_view size_fn) {
  if (static_cast<uint64_t>(t.size(0)) < required) {
    throw_value_error("{}: expected at least {} bytes ({} for these arguments), got {} bytes", name,
                      required, size_fn, t.size(0));
  }
}

}  // namespace sparse_attn::detail
