// Validation pieces shared by the XAttention entry points (xattn_estimate.cpp,
// xattn_attention.cpp, xattn_prefill.cpp). Like api/check.h they read metadata only.
#pragma once

#include <initializer_list>
#include <string_view>
#include <utility>
#include <vector>

#include "api/xattn_params.h"
#include "sparse_attn/tensor.h"
#include "sparse_attn/xattn.h"

namespace sparse_attn::detail {

// ceil(a / b) for a >= 0, b > 0, without forming a + b - 1 (lengths and block sizes are the
// caller's int64 values, up to INT64_MAX).
inline int64_t ceil_div(int64_t a, int64_t b) { return a / b + (a % b != 0); }

// An output: dtype, exact shape, device, data pointer, positive strides, no two elements at
// one address. Nothing for a missing output (api/check.h): the op calls check_not_missing
// once every other argument is checked.
void check_xattn_output(const TensorView& t, std::string_view name, DType dtype, const Shape& shape,
                        std::string_view what, Device device, std::string_view device_of);

// A floating input of the attention family: dtype BF16, FP16 or FP32, and when `like` is
// given, the same dtype and device as it (`like_name` names it in messages).
void check_float_input(const TensorView& t, std::string_view name, const TensorView* like,
                       std::string_view like_name);

// ValueError unless Hq is a positive multiple of Hkv (GQA).
void check_gqa(int64_t hq, int64_t hkv, std::string_view q_name, std::string_view kv_name);

// Checks the selection options (block_size, thresholds) for `num_heads` heads.
void check_select_options(const BlockSelectOptions& o, int64_t num_heads);
// One threshold per head, from options that passed check_select_options. Called once the
// outputs are checked too: the head count comes from an input, which may be a broadcast view
// of any size, while the outputs' memory (no broadcasting there) bounds it.
std::vector<double> head_thresholds(const BlockSelectOptions& o, int64_t num_heads);

// NotSupportedError unless the native block-sparse attention kernel takes these tensors (16-bit
// dtype, head dim 64 / 128 / 256, at most 256 query heads; every tensor's head dim contiguous
// and its other strides and data pointer 16-byte aligned, as TMA and the 16-byte stores need).
// `tensors` are (view, name) pairs of the floating inputs and the output.
void check_native_block_sparse(
    std::initializer_list<std::pair<const TensorView*, const char*>> tensors, int64_t num_q_heads,
    std::string_view op);

// NotSupportedError unless the native estimate takes this problem: the block-sparse kernel's
// tensor rules for query and key, block_size / stride of 8, 16 or 32 (the key groups of a key
// block that one quad of threads reduces), and at most 2^30 query rows and keys (the kernels'
// 32-bit row arithmetic).
void check_native_estimate(const TensorView& query, const TensorView& key,
                           const XAttnEstimateParams& p, std::string_view op);

// Checks query [B, Hq, Lq, D], key [B, Hkv, Lk, D] and the estimation options (not the
// thresholds); returns the estimate params with sizes and scalars decided, no pointers.
XAttnEstimateParams check_estimate_inputs(const TensorView& query, const TensorView& key,
                                          const XAttnEstimateOptions& o);

// Checks the estimate's outputs: FP32 / bool with the shape from `p`, on the query's device,
// disjoint from each other and from query and key. Missing ones are skipped (the caller
// reports them after its remaining checks).
void check_estimate_outputs(const XAttnEstimateParams& p, const TensorView& query,
                            const TensorView& key, const TensorView& attn_sums,
                            const TensorView& block_mask);

// Fills the pointers and strides of the estimate (and its selection step) from these views.
void fill_estimate_pointers(XAttnEstimateParams& p, const TensorView& query, const TensorView& key,
                            const TensorView& attn_sums, const TensorView& block_mask);

// Copies the first n strides of t into `out`.
void copy_strides(const TensorView& t, int64_t* out, int n);

}  // namespace sparse_attn::detail
