// merge_attention_states: the result of attention over a union of disjoint key sets, from the
// results over each set. SplitKV decode splits a row's keys across CTAs and context parallelism
// shards them across GPUs; each part yields a partial output and its log-sum-exp (LSE), and this
// op combines N of them:
//
//   m = max_i lse[i];  w_i = exp(lse[i] - m)  (0 for lse -inf)
//   out = (sum_i w_i out[i]) / (sum_i w_i),  lse_out = m + log(sum_i w_i)
//
// per (row, head). docs/merge.md states the edge cases (empty rows, NaN) and the accumulation
// order; the reference backend (src/reference/merge_ref.cpp) is its executable form.
#pragma once

#include <optional>

#include "sparse_attn/common.h"
#include "sparse_attn/tensor.h"

namespace sparse_attn {

struct MergeOptions {
  // kNative: host tensors run the CPU backend, CUDA tensors a CUDA kernel on `stream`
  // (asynchronous, no allocation). kReference: the double-precision CPU loops; CUDA tensors are
  // staged through the host (synchronous).
  Backend backend = Backend::kNative;
  StreamHandle stream = nullptr;
};

// partial_out: [N, rows, heads, dim]. Returns [rows, heads, dim], the shape of out; lse_out is
// FP32 [rows, heads].
Shape merge_attention_states_shape(const TensorView& partial_out);

// partial_out: float32, bfloat16 or float16 [N, rows, heads, dim], N >= 1, any strides (0 for
// broadcast included). partial_lse: float32 [N, rows, heads], natural-log LSE of each partial,
// -inf for a partial that saw no key (as qsa_sparse_attention's lse writes it).
// out: float32, bfloat16 or float16 [rows, heads, dim] (its own dtype, which may differ from
// partial_out's), rounded once from FP32 to nearest even. lse_out: optional float32
// [rows, heads], natural log. All tensors on one device; outputs have positive strides, no two
// elements at one address, and share no byte with the inputs or each other.
//
// Per (row, head): all partials -inf -> out 0, lse_out -inf. A partial of weight 0 is not read
// (LSE -inf; in FP32 also one so far below the maximum that its weight underflows), so callers
// may leave the outputs of empty partials unwritten. An LSE that is NaN or +inf makes the row's
// out and lse_out NaN. dim 0: lse_out is still written. Each backend gives the same bits on
// every run.
void merge_attention_states(const TensorView& partial_out, const TensorView& partial_lse,
                            const TensorView& out,
                            const std::optional<TensorView>& lse_out = std::nullopt,
                            const MergeOptions& options = {});

}  // namespace sparse_attn
