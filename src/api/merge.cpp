// API boundary of merge_attention_states: validation (metadata only), backend choice, params
// filling. docs/merge.md is the user-facing statement of these rules.
#include "sparse_attn/merge.h"

#include <initializer_list>
#include <string_view>

#include "api/check.h"
#include "api/merge_params.h"
#include "api/staging.h"
#include "cpu/cpu_kernels.h"
#include "reference/merge_ref.h"

namespace sparse_attn {
namespace {

using detail::throw_value_error;

constexpr std::initializer_list<DType> kStateDtypes = {DType::kF32, DType::kBF16, DType::kF16};

void check_inputs(const TensorView& partial_out, const TensorView& partial_lse) {
  detail::check_dtype(partial_out, "partial_out", kStateDtypes);
  detail::check_rank(partial_out, "partial_out", {4});
  if (partial_out.size(0) < 1) {
    throw_value_error("partial_out: expected at least one partial (shape[0] >= 1), got shape {}",
                      partial_out.shape_str());
  }
  detail::check_data(partial_out, "partial_out");
  detail::check_dtype(partial_lse, "partial_lse", {DType::kF32});
  detail::check_shape(partial_lse, "partial_lse",
                      {partial_out.size(0), partial_out.size(1), partial_out.size(2)},
                      "partial_out.shape[:3]");
  detail::check_device(partial_lse, "partial_lse", partial_out.device(), "partial_out");
  detail::check_data(partial_lse, "partial_lse");
}

// An output of an exact shape on partial_out's device, writable element by element from many
// threads at once (no two elements at one address), sharing no byte with the inputs.
void check_output(const TensorView& t, const char* name, std::initializer_list<DType> dtypes,
                  const Shape& shape, std::string_view what, const TensorView& partial_out,
                  const TensorView& partial_lse) {
  if (detail::is_missing(t)) return;  // reported after the op's other checks
  detail::check_dtype(t, name, dtypes);
  detail::check_shape(t, name, shape, what);
  detail::check_device(t, name, partial_out.device(), "partial_out");
  detail::check_positive_strides(t, name);
  detail::check_no_self_overlap(t, name);
  detail::check_data(t, name);
  detail::check_no_overlap(t, name, partial_out, "partial_out");
  detail::check_no_overlap(t, name, partial_lse, "partial_lse");
}

detail::MergeParams make_params(const TensorView& partial_out, const TensorView& partial_lse,
                                const TensorView& out, const std::optional<TensorView>& lse_out,
                                StreamHandle stream) {
  detail::MergeParams p{};
  p.parts = partial_out.size(0);
  p.rows = partial_out.size(1);
  p.heads = partial_out.size(2);
  p.dim = partial_out.size(3);
  p.out_dtype = out.dtype();
  p.partial_dtype = partial_out.dtype();
  p.partial_out = partial_out.data();
  p.po_part_stride = partial_out.stride(0);
  p.po_row_stride = partial_out.stride(1);
  p.po_head_stride = partial_out.stride(2);
  p.po_dim_stride = partial_out.stride(3);
  p.partial_lse = partial_lse.data_as<const float>();
  p.pl_part_stride = partial_lse.stride(0);
  p.pl_row_stride = partial_lse.stride(1);
  p.pl_head_stride = partial_lse.stride(2);
  p.out = out.data();
  p.out_row_stride = out.stride(0);
  p.out_head_stride = out.stride(1);
  p.out_dim_stride = out.stride(2);
  if (lse_out) {
    p.lse_out = lse_out->data_as<float>();
    p.lo_row_stride = lse_out->stride(0);
    p.lo_head_stride = lse_out->stride(1);
  }
  p.device_index = partial_out.device().is_cuda() ? partial_out.device().index : 0;
  p.stream = stream;
  return p;
}

}  // namespace

Shape merge_attention_states_shape(const TensorView& partial_out) {
  detail::check_rank(partial_out, "partial_out", {4});
  return {partial_out.size(1), partial_out.size(2), partial_out.size(3)};
}

void merge_attention_states(const TensorView& partial_out, const TensorView& partial_lse,
                            const TensorView& out, const std::optional<TensorView>& lse_out,
                            const MergeOptions& options) {
  check_inputs(partial_out, partial_lse);
  const Shape out_shape = merge_attention_states_shape(partial_out);
  check_output(out, "out", kStateDtypes, out_shape, "partial_out.shape[1:]", partial_out,
               partial_lse);
  if (lse_out) {
    check_output(*lse_out, "lse_out", {DType::kF32}, {out_shape[0], out_shape[1]},
                 "partial_out.shape[1:3]", partial_out, partial_lse);
    detail::check_no_overlap(*lse_out, "lse_out", out, "out");
  }
  // Missing outputs (api/check.h) after both outputs' checks.
  detail::check_not_missing(out, "out");
  detail::check_not_missing(lse_out, "lse_out");
  // No (row, head) pair, or no feature and no LSE wanted: nothing to write. With dim 0 the
  // backends still write lse_out: the LSE of the union does not depend on the features.
  if (out.numel() == 0 && (!lse_out || lse_out->numel() == 0)) return;

  if (options.backend == Backend::kNative) {
    const detail::MergeParams p =
        make_params(partial_out, partial_lse, out, lse_out, options.stream);
    if (partial_out.device().is_cuda()) {
      detail::native_merge_attention_states(p);
    } else {
      cpu_merge_attention_states(p);
    }
    return;
  }
  detail::HostStaging host;
  const TensorView hpo = host.input(partial_out);
  const TensorView hpl = host.input(partial_lse);
  const TensorView hout = host.output(out);
  const std::optional<TensorView> hlse = host.output(lse_out);
  detail::reference_merge_attention_states(make_params(hpo, hpl, hout, hlse, options.stream));
  host.commit();
}

}  // namespace sparse_attn
