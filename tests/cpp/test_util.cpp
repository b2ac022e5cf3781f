#include "test_util.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <sstream>

namespace sparse_attn::testing {

std::mt19937_64 make_rng() {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  std::string name = info ? std::string(info->test_suite_name()) + "." + info->name() : "none";
  return std::mt19937_64(std::hash<std::string>{}(name) ^ 0x5eed5eedull);
}

namespace {

// Calls f(flat_offset_in_elements, logical_index) for every element of the view.
template <typename F>
void for_each_element(const TensorView& v, F&& f) {
  const int nd = v.dim();
  std::vector<int64_t> idx(nd, 0);
  const int64_t n = v.numel();
  for (int64_t e = 0; e < n; ++e) {
    int64_t off = 0;
    for (int k = 0; k < nd; ++k) off += idx[k] * v.stride(k);
    f(off, idx);
    for (int k = nd - 1; k >= 0; --k) {
      if (++idx[k] < v.size(k)) break;
      idx[k] = 0;
    }
  }
}

double load(const TensorView& v, int64_t off) {
  switch (v.dtype()) {
    case DType::kI32:
      return v.data_as<int32_t>()[off];
    case DType::kI64:
      return static_cast<double>(v.data_as<int64_t>()[off]);
    case DType::kBool:
      return v.data_as<uint8_t>()[off] != 0;
    case DType::kU8:
      return v.data_as<uint8_t>()[off];
    default:
      return load_as_float(v.data(), v.dtype(), off);
  }
}

void store(const TensorView& v, int64_t off, double x) {
  switch (v.dtype()) {
    case DType::kI32:
      v.data_as<int32_t>()[off] = static_cast<int32_t>(x);
      break;
    case DType::kI64:
      v.data_as<int64_t>()[off] = static_cast<int64_t>(x);
      break;
    case DType::kBool:
      v.data_as<uint8_t>()[off] = x != 0;
      break;
    case DType::kU8:
      v.data_as<uint8_t>()[off] = static_cast<uint8_t>(x);
      break;
    default:
      store_from_float(v.data(), v.dtype(), off, static_cast<float>(x));
  }
}

}  // namespace

Tensor random_tensor(const Shape& shape, DType dtype, std::mt19937_64& rng, float lo, float hi) {
  Tensor t = Tensor::empty(shape, dtype);
  std::uniform_real_distribution<float> dist(lo, hi);
  for_each_element(t.view(), [&](int64_t off, const auto&) { store(t.view(), off, dist(rng)); });
  return t;
}

Tensor random_fp8(const Shape& shape, std::mt19937_64& rng, float limit) {
  Tensor t = Tensor::empty(shape, DType::kF8E4M3);
  std::uniform_int_distribution<int> code(0, 255);
  for (int64_t i = 0; i < t.numel(); ++i) {
    uint8_t c;
    do {
      c = static_cast<uint8_t>(code(rng));
    } while ((c & 0x7f) == 0x7f || std::fabs(fp8_e4m3_to_float(c)) > limit);
    t.data_as<uint8_t>()[i] = c;
  }
  return t;
}

Tensor random_int32(const Shape& shape, std::mt19937_64& rng, int32_t lo, int32_t hi) {
  Tensor t = Tensor::empty(shape, DType::kI32);
  std::uniform_int_distribution<int32_t> dist(lo, hi);
  for (int64_t i = 0; i < t.numel(); ++i) t.data_as<int32_t>()[i] = dist(rng);
  return t;
}

Tensor int32_tensor(const Shape& shape, const std::vector<int32_t>& values) {
  Tensor t = Tensor::empty(shape, DType::kI32);
  EXPECT_EQ(static_cast<size_t>(t.numel()), values.size());
  std::memcpy(t.data(), values.data(), values.size() * sizeof(int32_t));
  return t;
}

Tensor int64_tensor(const Shape& shape, const std::vector<int64_t>& values) {
  Tensor t = Tensor::empty(shape, DType::kI64);
  EXPECT_EQ(static_cast<size_t>(t.numel()), values.size());
  std::memcpy(t.data(), values.data(), values.size() * sizeof(int64_t));
  return t;
}

Tensor widened(const TensorView& view) {
  const Tensor host = Tensor::to_host(view);
  Tensor w = Tensor::empty(host.shape(), DType::kI64);
  for (int64_t i = 0; i < host.numel(); ++i) w.data_as<int64_t>()[i] = host.data_as<int32_t>()[i];
  if (!view.device().is_cuda()) return w;
  Tensor d = Tensor::empty(host.shape(), DType::kI64, view.device());
  copy_into(d, w);
  return d;
}

void poison(const TensorView& view) {
  // uint8 (workspace bytes): 0xff everywhere, which reads back as NaN through any float view.
  const double p = view.dtype() == DType::kU8 ? 0xff
                   : (view.dtype() == DType::kI32 || view.dtype() == DType::kI64)
                       ? 0x7f7f7f7f
                       : std::numeric_limits<double>::quiet_NaN();
  for_each_element(view, [&](int64_t off, const auto&) { store(view, off, p); });
}

double get(const TensorView& view, const std::vector<int64_t>& index) {
  int64_t off = 0;
  for (size_t k = 0; k < index.size(); ++k) off += index[k] * view.stride(static_cast<int>(k));
  return load(view, off);
}

void set(const TensorView& view, const std::vector<int64_t>& index, double value) {
  int64_t off = 0;
  for (size_t k = 0; k < index.size(); ++k) off += index[k] * view.stride(static_cast<int>(k));
  store(view, off, value);
}

std::vector<double> to_vector(const TensorView& view) {
  std::vector<double> out;
  out.reserve(view.numel());
  for_each_element(view, [&](int64_t off, const auto&) { out.push_back(load(view, off)); });
  return out;
}

namespace {

// all_close, and with nan_expected all_close_or_nan.
::testing::AssertionResult compare(const TensorView& actual, const std::vector<double>& expected,
                                   double atol, double rtol, bool nan_expected) {
  const std::vector<double> a = to_vector(actual);
  if (a.size() != expected.size()) {
    return ::testing::AssertionFailure()
           << "size mismatch: actual " << a.size() << ", expected " << expected.size();
  }
  auto index_of = [&](size_t flat) {
    std::ostringstream s;
    s << "[";
    std::vector<int64_t> idx(actual.dim());
    for (int k = actual.dim() - 1; k >= 0; --k) {
      idx[k] = static_cast<int64_t>(flat % actual.size(k));
      flat /= actual.size(k);
    }
    for (int k = 0; k < actual.dim(); ++k) s << (k ? ", " : "") << idx[k];
    return s.str() + "]";
  };
  double worst = -1;
  size_t worst_i = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double x = a[i];
    const double e = expected[i];
    if (nan_expected && std::isnan(e)) {
      if (!std::isnan(x)) {
        return ::testing::AssertionFailure() << "expected NaN at " << index_of(i) << ", got " << x;
      }
      continue;
    }
    if (std::isnan(x)) {
      return ::testing::AssertionFailure() << "NaN at " << index_of(i) << " (expected " << e << ")";
    }
    if (std::isinf(e) || std::isinf(x)) {
      if (x != e) {
        return ::testing::AssertionFailure()
               << "infinity mismatch at " << index_of(i) << ": actual " << x << ", expected " << e;
      }
      continue;
    }
    const double excess = std::abs(x - e) - (atol + rtol * std::abs(e));
    if (excess > worst) {
      worst = excess;
      worst_i = i;
    }
  }
  if (worst > 0) {
    return ::testing::AssertionFailure()
           << "worst difference at " << index_of(worst_i) << ": actual " << a[worst_i]
           << ", expected " << expected[worst_i] << " (atol " << atol << ", rtol " << rtol << ")";
  }
  return ::testing::AssertionSuccess();
}

}  // namespace

::testing::AssertionResult all_close(const TensorView& actual, const std::vector<double>& expected,
                                     double atol, double rtol) {
  return compare(actual, expected, atol, rtol, false);
}

::testing::AssertionResult all_close_or_nan(const TensorView& actual,
                                            const std::vector<double>& expected, double atol,
                                            double rtol) {
  return compare(actual, expected, atol, rtol, true);
}

AttentionExpectation expected_physical_attention(const TensorView& q, const TensorView& k,
                                                 const TensorView& v,
                                                 const std::vector<int32_t>& ids, int64_t width,
                                                 double scale) {
  const int64_t rows = q.size(0), hq = q.size(1), d = q.size(2), hkv = k.size(1), total = k.size(0);
  const std::vector<double> qv = to_vector(q), kv = to_vector(k), vv = to_vector(v);
  AttentionExpectation e{std::vector<double>(rows * hq * d, 0.0),
                         std::vector<double>(rows * hq, -std::numeric_limits<double>::infinity())};
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t h = 0; h < hq; ++h) {
      const int64_t g = h / (hq / hkv);
      std::vector<double> s;
      std::vector<int64_t> tokens;
      for (int64_t w = 0; w < width; ++w) {
        const int64_t t = ids[r * width + w];
        if (t < 0 || t >= total) continue;
        double dot = 0;
        for (int64_t x = 0; x < d; ++x) dot += qv[(r * hq + h) * d + x] * kv[(t * hkv + g) * d + x];
        s.push_back(dot * scale);
        tokens.push_back(t);
      }
      if (s.empty()) continue;
      const double mx = *std::max_element(s.begin(), s.end());
      double sum = 0;
      for (double& x : s) sum += (x = std::exp(x - mx));
      e.lse[r * hq + h] = mx + std::log(sum);
      for (int64_t x = 0; x < d; ++x) {
        double acc = 0;
        for (size_t j = 0; j < s.size(); ++j) acc += s[j] * vv[(tokens[j] * hkv + g) * d + x];
        e.out[(r * hq + h) * d + x] = acc / sum;
      }
    }
  }
  return e;
}

double default_atol(DType dtype) {
  return dtype == DType::kBF16 ? 1e-2 : dtype == DType::kF16 ? 2e-3 : 1e-4;
}
double default_rtol(DType dtype) {
  return dtype == DType::kBF16 ? 1e-2 : dtype == DType::kF16 ? 2e-3 : 1e-4;
}

}  // namespace sparse_attn::testing
