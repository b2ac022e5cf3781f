// Shared helpers for the C++ tests: random tensors, poisoning, element access and comparison
// against double-precision expectations (inf positions first, then tolerances, worst position
// printed on failure).
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "sparse_attn/dtype.h"
#include "sparse_attn/errors.h"
#include "sparse_attn/tensor.h"

namespace sparse_attn::testing {

// Seeded from the test name plus a fixed salt so failures reproduce, yet every test draws
// different inputs.
std::mt19937_64 make_rng();

// Uniform values in [lo, hi), rounded to `dtype` (floating dtypes) on the host.
Tensor random_tensor(const Shape& shape, DType dtype, std::mt19937_64& rng, float lo = -1.f,
                     float hi = 1.f);
// An FP8 e4m3 tensor of random finite codes (uniform over the codes, subnormals and zeros
// included) whose values lie in [-limit, limit].
Tensor random_fp8(const Shape& shape, std::mt19937_64& rng, float limit);
// Uniform int32 in [lo, hi].
Tensor random_int32(const Shape& shape, std::mt19937_64& rng, int32_t lo, int32_t hi);
// int32 / int64 tensor from values (row-major).
Tensor int32_tensor(const Shape& shape, const std::vector<int32_t>& values);
Tensor int64_tensor(const Shape& shape, const std::vector<int64_t>& values);
// A contiguous int64 copy of an int32 view, on the view's device: the same metadata as int64.
Tensor widened(const TensorView& view);

// Fills every byte of the view's elements with a poison pattern: NaN for floating dtypes,
// 0x7f7f7f7f-style garbage for integers, 0xff for uint8 (NaN when read as floats).
void poison(const TensorView& view);

// Element access through strides, as double.
double get(const TensorView& view, const std::vector<int64_t>& index);
void set(const TensorView& view, const std::vector<int64_t>& index, double value);
// Every element in row-major order of the logical shape, as double.
std::vector<double> to_vector(const TensorView& view);

// Compares `actual` (row-major logical order) with `expected`: infinities must match exactly
// (same sign, same positions), no NaN may appear, then |a - e| <= atol + rtol * |e|.
// Reports the worst element and its index on failure.
::testing::AssertionResult all_close(const TensorView& actual, const std::vector<double>& expected,
                                     double atol, double rtol);
// The same, except that `actual` must be NaN exactly where `expected` is NaN.
::testing::AssertionResult all_close_or_nan(const TensorView& actual,
                                            const std::vector<double>& expected, double atol,
                                            double rtol);

// Double-precision attention in physical-id mode, the oracle of the selected_kv_indices tests:
// q [rows, Hq, D], k/v [total, Hkv, D] (any strides), ids [rows, width] row-major. Ids < 0 or
// >= total are skipped, duplicates count, query head h reads KV head h / (Hq / Hkv). Rows with
// no valid id give output 0 and LSE -inf. Both results are row-major ([rows, Hq, D], [rows, Hq]).
struct AttentionExpectation {
  std::vector<double> out;
  std::vector<double> lse;
};
AttentionExpectation expected_physical_attention(const TensorView& q, const TensorView& k,
                                                 const TensorView& v,
                                                 const std::vector<int32_t>& ids, int64_t width,
                                                 double scale);

// Runs f and expects exactly the error kind E (a ValueError expectation rejects the
// NotSupportedError subclass) with a message that starts by naming `argument`.
template <typename E, typename F>
void expect_error(F&& f, const std::string& argument) {
  try {
    f();
    ADD_FAILURE() << "no error; expected one naming " << argument;
  } catch (const E& e) {
    const std::string msg = e.what();
    EXPECT_EQ(msg.rfind(argument + ":", 0), 0u)
        << "message does not start with '" << argument << ":': " << msg;
    if constexpr (std::is_same_v<E, ValueError>) {
      EXPECT_EQ(dynamic_cast<const NotSupportedError*>(&e), nullptr)
          << "NotSupportedError where a ValueError was expected: " << msg;
    }
  } catch (const std::exception& e) {
    ADD_FAILURE() << "wrong error kind for " << argument << ": " << e.what();
  }
}

// Tolerances for an output stored in `dtype` (accumulated in FP32).
double default_atol(DType dtype);
double default_rtol(DType dtype);

}  // namespace sparse_attn::testing
