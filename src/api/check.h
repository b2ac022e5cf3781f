// Validation helpers for the API boundary. Every check names the argument, says what was
// expected and what came, and reads only metadata (shape, strides, dtype, device, pointer),
// never tensor contents. Kernels and the reference trust what passed these checks.
//
// Every op checks all of its inputs before any of its outputs, and builds nothing sized by an
// input (per-head tables) before the outputs are checked: an input may be a broadcast view
// of any logical size, an output's size is backed by memory.
//
// An output may be passed missing (a default-constructed TensorView, see is_missing): the op
// skips that output's checks, checks every other argument (inputs and the outputs given),
// and then raises ValueError naming the first missing output, before it builds or runs
// anything. The Python wrappers pass one in place of each output they could not allocate, so
// that a malformed call (a wrong lse next to a broadcast input of 2**40 rows) still gets the
// error naming what is wrong, and an error naming a missing output means the call is
// well-formed (_runtime.explain_allocation_failure).
#pragma once

#include <fmt/format.h>

#include <initializer_list>
#include <optional>
#include <string>
#include <string_view>

#include "sparse_attn/errors.h"
#include "sparse_attn/tensor.h"

namespace sparse_attn::detail {

template <typename... Args>
[[noreturn]] void throw_value_error(fmt::format_string<Args...> f, Args&&... args) {
  throw ValueError(fmt::format(f, std::forward<Args>(args)...));
}

template <typename... Args>
[[noreturn]] void throw_type_error(fmt::format_string<Args...> f, Args&&... args) {
  throw TypeError(fmt::format(f, std::forward<Args>(args)...));
}

template <typename... Args>
[[noreturn]] void throw_not_supported(fmt::format_string<Args...> f, Args&&... args) {
  throw NotSupportedError(fmt::format(f, std::forward<Args>(args)...));
}

// "bfloat16 or float16" for messages.
std::string dtype_list(std::initializer_list<DType> dtypes);

// TypeError unless t's dtype is one of `allowed`.
void check_dtype(const TensorView& t, std::string_view name, std::initializer_list<DType> allowed);

// TypeError unless t is integer metadata: int32 or int64, read as stored (api/meta_ptr.h).
void check_metadata_dtype(const TensorView& t, std::string_view name);

// A cache tensor whose bytes may be FP8 e4m3 (K/V, the indexer's compressed keys), with the
// caller's kv_cache_dtype `format`: returns t, retyped to kF8E4M3 when that format is named
// (uint8 storage then reads as FP8). TypeError for uint8 without the format named (its bytes
// could be any 8-bit format), for FP8 named over storage that is neither uint8 nor FP8 e4m3, and
// for BF16/FP16 named over another dtype; ValueError naming kv_cache_dtype for other formats.
TensorView resolve_cache_dtype(const TensorView& t, std::string_view name,
                               const std::optional<DType>& format);

// ValueError unless t has one of the given ranks.
void check_rank(const TensorView& t, std::string_view name, std::initializer_list<int> ranks);

// ValueError unless t.size(d) == expected; `what` says where the expectation comes from
// (e.g. "query.shape[0]").
void check_size(const TensorView& t, std::string_view name, int d, int64_t expected,
                std::string_view what);

// ValueError unless t's shape equals `expected` exactly.
void check_shape(const TensorView& t, std::string_view name, const Shape& expected,
                 std::string_view what);

// ValueError unless t lives on `device` (the device of `ref_name`).
void check_device(const TensorView& t, std::string_view name, Device device,
                  std::string_view ref_name);

// ValueError unless the pointer is non-null when the view has elements.
void check_data(const TensorView& t, std::string_view name);

// ValueError unless every stride of an axis longer than 1 is positive (outputs must not
// broadcast or run backwards).
void check_positive_strides(const TensorView& t, std::string_view name);

// ValueError when two different indices of t address the same element (e.g. shape [4, 4] with
// strides [2, 1]), so writes to an output never race or clobber each other.
void check_no_self_overlap(const TensorView& t, std::string_view name);

// ValueError unless the leading `n` axes collapse into one row axis without a copy
// (stride[i] == size[i+1] * stride[i+1] for each adjacent pair of axes longer than 1).
void check_row_view(const TensorView& t, std::string_view name, int n);

// ValueError with the seed's message unless t satisfies the vector-load layout rules of the
// native score/prefill kernels: unit feature stride, 16-byte aligned data pointer, and every
// outer axis longer than 1 with a positive stride whose byte span is a multiple of 16.
void check_vector_load_layout(const TensorView& t, std::string_view name);

// True for a missing output: a default-constructed TensorView (no dimensions, no data). No
// tensor import produces one (a 0-d tensor has an element, so memory), and no op has 0-d
// outputs.
inline bool is_missing(const TensorView& t) { return t.dim() == 0 && t.data() == nullptr; }

// ValueError naming the output unless it is given (not is_missing). Called once every other
// argument of the op is checked; the output's own checks skip a missing view.
void check_not_missing(const TensorView& t, std::string_view name);
inline void check_not_missing(const std::optional<TensorView>& t, std::string_view name) {
  if (t) check_not_missing(*t, name);
}

// ValueError unless the output `out` shares no byte with the input `in` (nothing to check
// when either is a missing output).
void check_no_overlap(const TensorView& out, std::string_view out_name, const TensorView& in,
                      std::string_view in_name);

// The one rule for scale-like arguments (softmax and score scales, XAttention's norm): the
// kernels apply them in FP32, so ValueError unless `value` is a positive
// finite number that stays one when rounded to float32 (1e39 would become inf, 1e-46 zero).
// Returns the rounded value.
float check_float32_scale(double value, std::string_view name);
// The same rule for a value the op computes from the argument `name` (whose value is
// `argument`) and applies in FP32; `derived` says how, e.g. "1 / score_scale".
float check_float32_scale(double value, std::string_view name, std::string_view derived,
                          double argument);

// a * b for two sizes (>= 0) that come from different arguments (a block table's width times a
// page size, a block count times a block size), whose product need not fit int64 even though
// each tensor's own element count does: ValueError naming `name` when it does not. `what` says
// what the product is ("max_pages * page_size").
int64_t checked_size_product(int64_t a, int64_t b, std::string_view name, std::string_view what);

// Byte alignment the scratch buffers of ops (workspace arguments) must have.
constexpr size_t kWorkspaceAlignment = 16;

// The scratch buffer of an op: TypeError unless uint8; ValueError unless one contiguous axis on
// `device` (the device of `ref_name`), kWorkspaceAlignment-aligned. Overlap with the op's
// tensors is the caller's check.
void check_workspace(const TensorView& t, std::string_view name, Device device,
                     std::string_view ref_name);
// ValueError unless the scratch buffer holds at least `required` bytes (`size_fn` names the
// function that tells the caller that size).
void check_workspace_size(const TensorView& t, std::string_view name, size_t required,
                          std::string_view size_fn);

}  // namespace sparse_attn::detail
