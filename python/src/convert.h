// Conversions from Python call arguments to the C++ API's types, shared by the op bindings.
//
// Tensors arrive as any object with __dlpack__ (torch, numpy, cupy, jax) and become
// TensorViews that borrow the caller's memory for the duration of one call. Scalars and
// options arrive as plain Python objects; each conversion names the argument in its error, so
// a float passed where a tensor goes (or the reverse) is a TypeError that says which argument.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "sparse_attn/common.h"
#include "sparse_attn/tensor.h"

namespace sparse_attn::python {

namespace nb = nanobind;

// The placeholder for an output the caller could not allocate (_C.MISSING_OUTPUT, a plain
// object): passed where an op binding takes an output, it becomes a missing TensorView
// (default-constructed), which the C++ op reports by name only after checking every other
// argument (src/api/check.h). _runtime.explain_allocation_failure passes it. Created once, by
// the module's init.
nb::handle missing_output();

// Keeps the DLPack imports of one call alive while the C++ call runs (the views borrow their
// memory). Fixed capacity: no allocation on the hot path; an op binding with more tensor
// arguments than this is a programming error caught on its first call.
class Borrowed {
 public:
  // `name` appears in error messages. Writable views refuse read-only producers (a read-only
  // numpy array passed as `out`).
  TensorView tensor(nb::handle obj, const char* name, bool writable = false);
  std::optional<TensorView> optional_tensor(nb::handle obj, const char* name,
                                            bool writable = false);

 private:
  static constexpr int kCapacity = 16;
  std::array<nb::ndarray<nb::ro>, kCapacity> inputs_;
  std::array<nb::ndarray<>, kCapacity> outputs_;
  int num_inputs_ = 0;
  int num_outputs_ = 0;
};

// None -> nullopt; int/float (and numpy scalars, 0-d tensors through __float__) -> double.
std::optional<double> optional_float(nb::handle obj, const char* name);
double to_float(nb::handle obj, const char* name);
// None -> nullopt; int (and anything with __index__, not bool or float) -> int64_t.
std::optional<int64_t> optional_int(nb::handle obj, const char* name);
int64_t to_int(nb::handle obj, const char* name);
// bool (or numpy.bool_) only.
bool to_bool(nb::handle obj, const char* name);
// None -> empty; a list or tuple of numbers (Python converts tensors with tolist() first).
std::vector<int32_t> to_int32_list(nb::handle obj, const char* name);
std::vector<double> to_float_list(nb::handle obj, const char* name);
// A str.
std::string to_str(nb::handle obj, const char* name);
// A str naming the backend ("native", "tilelang", "reference").
Backend to_backend(nb::handle obj);
// A dtype: a torch.dtype, a numpy dtype or type, or a name ("bfloat16").
DType to_dtype(nb::handle obj, const char* name);
// kv_cache_dtype (how cache bytes are read): None or "auto" -> nullopt (the tensor's dtype);
// "fp8", "fp8_e4m3", "float8_e4m3fn" or torch.float8_e4m3fn -> kF8E4M3; other FP8 formats raise
// NotSupportedError; anything else is a dtype as to_dtype reads it.
std::optional<DType> to_kv_cache_dtype(nb::handle obj, const char* name);
// The caller's stream as an integer (torch's cuda_stream); 0 is the legacy default stream.
StreamHandle to_stream(nb::handle obj);

// Python's type name of obj, for messages.
const char* py_type_name(nb::handle obj);

}  // namespace sparse_attn::python
