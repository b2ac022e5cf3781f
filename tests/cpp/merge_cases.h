// Partial attention states for the merge_attention_states suites (test_merge.cpp on the host
// backends, test_gpu_merge.cpp for the native CUDA kernel), drawn the way a split of real
// attention leaves them.
#pragma once

#include <cmath>
#include <limits>
#include <random>

#include "sparse_attn/tensor.h"
#include "test_util.h"

namespace sparse_attn::testing {

struct MergeStates {
  Tensor partial_out;  // [N, rows, heads, dim]
  Tensor partial_lse;  // FP32 [N, rows, heads]
};

// LSEs in [-4, 6] (weights spread over e^10), outputs in [-1, 1) rounded to `dtype`. About a
// quarter of the partials are empty, and every partial of row 0: LSE -inf with a NaN output
// (an empty split that wrote nothing), which the merge must not read.
inline MergeStates random_merge_states(int64_t n, int64_t rows, int64_t heads, int64_t dim,
                                       DType dtype, std::mt19937_64& rng) {
  MergeStates s{random_tensor({n, rows, heads, dim}, dtype, rng),
                random_tensor({n, rows, heads}, DType::kF32, rng, -4.f, 6.f)};
  std::bernoulli_distribution empty(0.25);
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t h = 0; h < heads; ++h) {
        if (r != 0 && !empty(rng)) continue;
        set(s.partial_lse, {i, r, h}, -std::numeric_limits<double>::infinity());
        for (int64_t d = 0; d < dim; ++d) {
          set(s.partial_out, {i, r, h, d}, std::numeric_limits<double>::quiet_NaN());
        }
      }
    }
  }
  return s;
}

// "fp32", "bf16", "fp16": parameter names of the merge cases.
inline const char* merge_dtype_tag(DType dtype) {
  return dtype == DType::kBF16 ? "bf16" : dtype == DType::kF16 ? "fp16" : "fp32";
}

}  // namespace sparse_attn::testing
