// API boundary of the selection helpers: validation (metadata only), params, and the backend:
// native kernels for CUDA tensors, the reference loops for host tensors.
#include "sparse_attn/qsa_select.h"

#include <climits>
#include <string_view>

#include "api/check.h"
#include "api/qsa_select_params.h"
#include "reference/qsa_select_ref.h"

namespace sparse_attn {
namespace {

using detail::throw_value_error;

constexpr int64_t kBlockTokens = 4;

// Strides of a [rows, n] or [B, Q, n] view as (batch, row, col); batch stride 0 for 2-D.
struct Strides3 {
  int64_t batch, row, col;
};
Strides3 strides3(const TensorView& t) {
  return t.dim() == 3 ? Strides3{t.stride(0), t.stride(1), t.stride(2)}
                      : Strides3{0, t.stride(0), t.stride(1)};
}

Shape with_last(const TensorView& t, int64_t last) {
  Shape s = t.shape();
  s.back() = last;
  return s;
}

// An int32 output of an exact shape on `device`, writable by strides (no two elements at one
// address: each element is written once, by one thread of many).
void check_int32_out(const TensorView& t, const char* name, const Shape& shape,
                     std::string_view what, Device device, const char* device_ref) {
  if (detail::is_missing(t)) return;  // reported after the op's other checks
  detail::check_dtype(t, name, {DType::kI32});
  detail::check_shape(t, name, shape, what);
  detail::check_device(t, name, device, device_ref);
  detail::check_positive_strides(t, name);
  detail::check_no_self_overlap(t, name);
  detail::check_data(t, name);
}

void check_block_ids(const TensorView& block_ids) {
  detail::check_metadata_dtype(block_ids, "block_ids");
  detail::check_rank(block_ids, "block_ids", {2, 3});
  detail::check_data(block_ids, "block_ids");
}

}  // namespace

Shape qsa_topk_blocks_shape(const TensorView& scores, int64_t k) {
  detail::check_rank(scores, "scores", {2, 3});
  // Block ids are int32, so no row has more than INT32_MAX blocks to select.
  if (k < 1 || k > INT32_MAX) {
    throw_value_error("k: expected 1 to {} blocks per row (block ids are int32), got {}", INT32_MAX,
                      k);
  }
  return with_last(scores, k);
}

void qsa_topk_blocks(const TensorView& scores, int64_t k, const TensorView& out,
                     StreamHandle stream) {
  const Shape shape = qsa_topk_blocks_shape(scores, k);
  detail::check_dtype(scores, "scores", {DType::kF32});
  detail::check_data(scores, "scores");
  if (scores.size(-1) > INT32_MAX) {
    throw_value_error("scores: block ids must fit int32, got {} blocks per row", scores.size(-1));
  }
  check_int32_out(out, "out", shape, "scores.shape[:-1] + [k]", scores.device(), "scores");
  detail::check_no_overlap(out, "out", scores, "scores");
  detail::check_not_missing(out, "out");

  const Strides3 ss = strides3(scores);
  const Strides3 os = strides3(out);
  detail::TopkBlocksParams p{};
  p.batch = scores.dim() == 3 ? scores.size(0) : 1;
  p.rows = scores.size(-2);
  p.num_blocks = scores.size(-1);
  p.k = k;
  p.scores = scores.data_as<const float>();
  p.scores_batch_stride = ss.batch;
  p.scores_row_stride = ss.row;
  p.scores_col_stride = ss.col;
  p.out = out.data_as<int32_t>();
  p.out_batch_stride = os.batch;
  p.out_row_stride = os.row;
  p.out_col_stride = os.col;
  p.device_index = scores.device().is_cuda() ? scores.device().index : 0;
  p.stream = stream;
  if (scores.device().is_cuda()) {
    detail::native_topk_blocks(p);
  } else {
    detail::reference_topk_blocks(p);
  }
}

Shape qsa_expand_blocks_token_shape(const TensorView& block_ids) {
  check_block_ids(block_ids);
  const int64_t k = block_ids.size(-1);
  // Token ids 4b + 3 and the width 4k + 3 must fit int32.
  if (k > (INT32_MAX - 3) / kBlockTokens) {
    throw_value_error("block_ids: expected at most {} blocks per row, got {}",
                      (INT32_MAX - 3) / kBlockTokens, k);
  }
  return with_last(block_ids, kBlockTokens * k + kBlockTokens - 1);
}

void qsa_expand_blocks(const TensorView& block_ids, const TensorView& query_positions,
                       const TensorView& token_indices,
                       const std::optional<TensorView>& block_indices, StreamHandle stream) {
  const Shape token_shape = qsa_expand_blocks_token_shape(block_ids);
  const Device dev = block_ids.device();
  const Shape rows_shape(token_shape.begin(), token_shape.end() - 1);
  detail::check_metadata_dtype(query_positions, "query_positions");
  detail::check_shape(query_positions, "query_positions", rows_shape, "block_ids.shape[:-1]");
  detail::check_device(query_positions, "query_positions", dev, "block_ids");
  detail::check_data(query_positions, "query_positions");
  check_int32_out(token_indices, "token_indices", token_shape, "block_ids.shape[:-1] + [4k + 3]",
                  dev, "block_ids");
  detail::check_no_overlap(token_indices, "token_indices", block_ids, "block_ids");
  detail::check_no_overlap(token_indices, "token_indices", query_positions, "query_positions");
  if (block_indices) {
    check_int32_out(*block_indices, "block_indices", block_ids.shape(), "block_ids.shape", dev,
                    "block_ids");
    detail::check_no_overlap(*block_indices, "block_indices", block_ids, "block_ids");
    detail::check_no_overlap(*block_indices, "block_indices", query_positions, "query_positions");
    detail::check_no_overlap(*block_indices, "block_indices", token_indices, "token_indices");
  }
  // Missing outputs (api/check.h) after both outputs' checks: a given block_indices is
  // checked even when token_indices is missing.
  detail::check_not_missing(token_indices, "token_indices");
  detail::check_not_missing(block_indices, "block_indices");

  const Strides3 is = strides3(block_ids);
  const Strides3 ts = strides3(token_indices);
  detail::ExpandBlocksParams p{};
  p.batch = block_ids.dim() == 3 ? block_ids.size(0) : 1;
  p.rows = block_ids.size(-2);
  p.k = block_ids.size(-1);
  p.block_ids = meta_ptr(block_ids);
  p.block_ids_batch_stride = is.batch;
  p.block_ids_row_stride = is.row;
  p.block_ids_col_stride = is.col;
  p.query_positions = meta_ptr(query_positions);
  p.query_positions_batch_stride = query_positions.dim() == 2 ? query_positions.stride(0) : 0;
  p.query_positions_row_stride = query_positions.stride(-1);
  p.token_indices = token_indices.data_as<int32_t>();
  p.token_indices_batch_stride = ts.batch;
  p.token_indices_row_stride = ts.row;
  p.token_indices_col_stride = ts.col;
  if (block_indices) {
    const Strides3 bs = strides3(*block_indices);
    p.block_indices = block_indices->data_as<int32_t>();
    p.block_indices_batch_stride = bs.batch;
    p.block_indices_row_stride = bs.row;
    p.block_indices_col_stride = bs.col;
  }
  p.device_index = dev.is_cuda() ? dev.index : 0;
  p.stream = stream;
  if (dev.is_cuda()) {
    detail::native_expand_blocks(p);
  } else {
    detail::reference_expand_blocks(p);
  }
}

}  // namespace sparse_attn
