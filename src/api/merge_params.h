// Params of merge_attention_states, filled by src/api/merge.cpp after validation and read by the
// reference (src/reference/merge_ref.cpp), the CPU backend (src/cpu/merge.cpp) and the native
// CUDA kernel (src/cuda/attention/merge_native.cu).
//
// The op merges N partial attention results over disjoint key sets (SplitKV splits, or the
// shards of a context-parallel group) into the result over their union:
//   m = max_i lse[i]; w_i = exp(lse[i] - m) (0 for lse -inf)
//   out = (sum_i w_i out[i]) / (sum_i w_i), lse_out = m + log(sum_i w_i),
// summed in order i = 0 .. N-1 (bitwise the same on every run). A (row, head) whose partials all
// have LSE -inf has no key at all: out 0, lse_out -inf. docs/merge.md states the rest.
//
// Everything here has passed validation: shapes agree, dtypes are right, outputs do not overlap
// inputs. Strides are in elements of their tensor and may be 0 (broadcast) on inputs.
#pragma once

#include <cstdint>

#include "sparse_attn/common.h"
#include "sparse_attn/tensor.h"

namespace sparse_attn::detail {

struct MergeParams {
  int64_t parts;  // N >= 1
  int64_t rows;
  int64_t heads;
  int64_t dim;

  DType out_dtype;  // of partial_out and of out: kF32, kBF16 or kF16 (each its own)
  DType partial_dtype;

  const void* partial_out;  // [parts, rows, heads, dim]
  int64_t po_part_stride;
  int64_t po_row_stride;
  int64_t po_head_stride;
  int64_t po_dim_stride;

  const float* partial_lse;  // [parts, rows, heads], natural log
  int64_t pl_part_stride;
  int64_t pl_row_stride;
  int64_t pl_head_stride;

  void* out;  // [rows, heads, dim]
  int64_t out_row_stride;
  int64_t out_head_stride;
  int64_t out_dim_stride;

  float* lse_out;  // nullable: [rows, heads], natural log
  int64_t lo_row_stride;
  int64_t lo_head_stride;

  int device_index;  // native only: the CUDA device of every pointer
  StreamHandle stream;
};

// Native (CUDA) entry point. A CUDA build defines it in src/cuda; a CPU-only build defines it to
// raise NotSupportedError (src/api/merge_native_cpu_only.cpp).
void native_merge_attention_states(const MergeParams& params);

}  // namespace sparse_attn::detail
