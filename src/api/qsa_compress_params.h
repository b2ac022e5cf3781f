// Params of qsa_compress_block_keys (include/sparse_attn/qsa_compress.h), filled by
// src/api/qsa_compress.cpp after validation. Strides are int64, in elements.
#pragma once

#include <cstdint>

#include "api/meta_ptr.h"
#include "sparse_attn/common.h"
#include "sparse_attn/qsa_compress.h"
#include "sparse_attn/tensor.h"

namespace sparse_attn::detail {

// QSA compresses 4 tokens into one key.
inline constexpr int64_t kCompressBlockTokens = 4;

struct CompressBlockKeysParams {
  int64_t batch;  // requests
  int64_t dim;    // D
  // Raw keys. Request r owns rows [cu_seqlens[r], cu_seqlens[r + 1]) when cu_seqlens is set,
  // else rows [0, tokens_per_request) of batch entry r.
  const void* keys;
  DType keys_dtype;  // bf16/fp16 at the API; the workload generator also passes fp32
  int64_t keys_batch_stride;
  int64_t keys_row_stride;
  int64_t keys_col_stride;
  int64_t tokens_per_request;  // rows per request; with cu_seqlens, all the key rows
  MetaPtr cu_seqlens;          // [batch + 1] or null
  int64_t cu_seqlens_stride;
  MetaPtr start_positions;  // [batch], position of each request's row 0; null: 0
  int64_t start_positions_stride;
  const void* weight;  // [dim]: the norm multiplies by 1 + weight
  DType weight_dtype;
  int64_t weight_stride;
  float eps;
  // RoPE on dims [0, rope_dim): tables [rope_rows, rope_cols] (rope_cols is rope_dim / 2 or
  // rope_dim), or, when cos is null, frequencies from rope_theta.
  int64_t rope_dim;
  RopeStyle rope_style;
  const float* cos;
  const float* sin;
  int64_t cos_row_stride, cos_col_stride;
  int64_t sin_row_stride, sin_col_stride;
  int64_t rope_rows;
  int64_t rope_cols;
  double rope_theta;
  // Destination: block b of request r is slot b % page_size of page
  // block_table[r, b / page_size]; without a block table, page r with page_size = N_B and
  // max_pages = 1 (the contiguous [B, N_B, D] layout).
  void* out;
  DType out_dtype;
  int64_t out_page_stride;
  int64_t out_slot_stride;
  int64_t out_col_stride;
  int64_t num_pages;
  int64_t page_size;
  MetaPtr block_table;  // [batch, max_pages] or null
  int64_t block_table_row_stride;
  int64_t block_table_col_stride;
  int64_t max_pages;
  int device_index;     // native only: the CUDA device of every pointer
  StreamHandle stream;  // native only
};

// The reference definition on host views whose checks are the caller's, in any floating dtype
// (fp32 included): padded keys [B, L, D] -> out [B, L / 4, D], every block written. For the
// workload generator and the workload files, whose raw keys may be fp32.
void reference_compress_padded_keys(const TensorView& keys, const TensorView& weight,
                                    const TensorView& out, const CompressBlockKeysOptions& options);

// The native entry point, for CUDA tensors with dim == 128 and rope_dim == 64 (checked by the
// API). A CUDA build defines it in src/cuda/select/compress_block_keys.cu; a CPU-only build
// raises NotSupportedError (src/api/qsa_compress_native_cpu_only.cpp).
void native_compress_block_keys(const CompressBlockKeysParams& params);

}  // namespace sparse_attn::detail
