#include "convert.h"

#include <fmt/format.h>

#include <cstdint>
#include <string>
#include <string_view>

#include "sparse_attn/errors.h"

namespace sparse_attn::python {

namespace {

namespace dl = nb::dlpack;

std::string dlpack_dtype_name(dl::dtype dt) {
  const char* kind = "unknown";
  switch (static_cast<dl::dtype_code>(dt.code)) {
    case dl::dtype_code::Int:
      kind = "int";
      break;
    case dl::dtype_code::UInt:
      kind = "uint";
      break;
    case dl::dtype_code::Float:
      kind = "float";
      break;
    case dl::dtype_code::Bfloat:
      kind = "bfloat";
      break;
    case dl::dtype_code::Complex:
      kind = "complex";
      break;
    case dl::dtype_code::Bool:
      return "bool";
    case dl::dtype_code::Float8_E4M3FN:
      return "float8_e4m3fn";
    default:
      return fmt::format("DLPack dtype code {} ({} bits)", dt.code, dt.bits);
  }
  return fmt::format("{}{}", kind, dt.bits);
}

DType dtype_of(dl::dtype dt, const char* name) {
  using C = dl::dtype_code;
  if (dt.lanes == 1) {
    switch (static_cast<C>(dt.code)) {
      case C::Float:
        if (dt.bits == 16) return DType::kF16;
        if (dt.bits == 32) return DType::kF32;
        break;
      case C::Bfloat:
        if (dt.bits == 16) return DType::kBF16;
        break;
      case C::Int:
        if (dt.bits == 32) return DType::kI32;
        if (dt.bits == 64) return DType::kI64;
        break;
      case C::UInt:
        if (dt.bits == 8) return DType::kU8;
        break;
      case C::Bool:
        return DType::kBool;
      case C::Float8_E4M3FN:
        if (dt.bits == 8) return DType::kF8E4M3;
        break;
      default:
        break;
    }
  }
  throw TypeError(fmt::format(
      "{}: tensors of dtype {} are not supported (sparse_attn takes bfloat16, float16, float32, "
      "float8_e4m3fn, int32, int64, bool and uint8 tensors)",
      name, dlpack_dtype_name(dt)));
}

Device device_of(int type, int id, const char* name) {
  switch (type) {
    case 1:  // kDLCPU
    case 3:  // kDLCUDAHost: pinned host memory, addressed by the CPU
      return Device::cpu();
    case 2:   // kDLCUDA
    case 13:  // kDLCUDAManaged
      return Device::cuda(id);
    default:
      throw ValueError(fmt::format(
          "{}: tensors on DLPack device type {} are not supported (expected CPU or CUDA)", name,
          type));
  }
}

// The view of a DLPack tensor (data already includes any byte offset). Null strides mean
// compact row-major, as DLPack defines them.
TensorView view_of(void* data, dl::dtype dt, int32_t device_type, int32_t device_id, int ndim,
                   const int64_t* sizes, const int64_t* strides_or_null, const char* name) {
  if (ndim > TensorView::kMaxDims) {
    throw ValueError(fmt::format("{}: expected at most {} dimensions, got a tensor with {}", name,
                                 TensorView::kMaxDims, ndim));
  }
  std::array<int64_t, TensorView::kMaxDims> strides{};
  int64_t compact = 1;
  for (int d = ndim - 1; d >= 0; --d) {
    strides[d] = strides_or_null ? strides_or_null[d] : compact;
    compact *= sizes[d];
    if (strides[d] < 0 && sizes[d] > 1) {
      throw ValueError(
          fmt::format("{}: negative strides are not supported (stride[{}] is {}); pass a copy",
                      name, d, strides[d]));
    }
  }
  const Device device = device_of(device_type, device_id, name);
  const DType dtype = dtype_of(dt, name);
  return TensorView(data, dtype, device, ndim, sizes, strides.data());
}

template <typename Array>
TensorView view_of(const Array& a, const char* name) {
  return view_of(const_cast<void*>(static_cast<const void*>(a.data())), a.dtype(), a.device_type(),
                 a.device_id(), static_cast<int>(a.ndim()), a.shape_ptr(), a.stride_ptr(), name);
}

bool has_attr(nb::handle obj, const char* attr) { return PyObject_HasAttrString(obj.ptr(), attr); }

// torch's meta tensors (shape and dtype, no storage) fail every DLPack export; only the failure
// path asks, so that the message can say so instead of repeating torch's.
bool is_meta_tensor(nb::handle obj) {
  if (!has_attr(obj, "is_meta")) return false;
  nb::object meta = obj.attr("is_meta");
  return meta.ptr() == Py_True;
}

// Called once an import failed: says why, in terms of the argument.
[[noreturn]] void raise_import_failure(nb::handle obj, const char* name, bool writable) {
  if (obj.is_none()) throw TypeError(fmt::format("{}: expected a tensor, got None", name));
  if (!has_attr(obj, "__dlpack__") && !PyObject_CheckBuffer(obj.ptr())) {
    throw TypeError(fmt::format(
        "{}: expected a tensor (torch.Tensor, numpy.ndarray or any object with __dlpack__), "
        "got {}",
        name, py_type_name(obj)));
  }
  if (writable) {
    nb::ndarray<nb::ro> read_only;
    if (nb::try_cast(obj, read_only, false)) {
      throw ValueError(fmt::format("{}: the {} is read-only, but this argument is written", name,
                                   py_type_name(obj)));
    }
  }
  if (is_meta_tensor(obj)) {
    throw TypeError(fmt::format(
        "{}: meta tensors are not supported (they have no data); pass a CPU or CUDA tensor", name));
  }
  // Ask the producer directly to recover its reason (torch refuses sparse layouts, numpy
  // refuses byte strides that are not a multiple of the item size, ...). The exception's
  // message only: python_error::what() would append the Python traceback.
  std::string reason = "the producer refused the export";
  if (has_attr(obj, "__dlpack__")) {
    try {
      obj.attr("__dlpack__")();
    } catch (nb::python_error& e) {
      reason = nb::str(e.value()).c_str();
    }
  }
  throw TypeError(fmt::format("{}: could not import the {} through DLPack: {}", name,
                              py_type_name(obj), reason));
}

bool is_tensor_like(nb::handle obj) { return has_attr(obj, "__dlpack__"); }

// DLPack's C exchange API (dlpack.h 1.3, DLPackExchangeAPI), as torch >= 2.10 publishes it in
// the capsule torch.Tensor.__dlpack_c_exchange_api__. Only the fields read here are named; the
// layout is DLPack's stable ABI for major version 1.
struct DLPackExchangeApi {
  uint32_t major, minor;  // DLPackVersion
  const void* prev_api;
  const void* managed_tensor_allocator;
  const void* managed_tensor_from_py_object_no_sync;
  const void* managed_tensor_to_py_object_no_sync;
  // Fills a non-owning DLTensor (shape and strides owned by the tensor) without a Python call or
  // an allocation; 0 on success, -1 with a Python exception set. May be null.
  int (*dltensor_from_py_object_no_sync)(void* py_object, dl::dltensor* out);
  const void* current_work_stream;
};

// How torch tensors are imported. The exchange API costs about 0.03 us per tensor; without it
// (torch < 2.10) the C export torch._C._to_dlpack costs about 0.25 us plus nanobind's capsule
// import, and torch.Tensor.__dlpack__, a Python method whose argument checks cost about 5 us
// per tensor (all measured on the CPU of the development machine), is avoided either way. What
// the Python method's checks refuse, sparse_attn refuses too or does not meet: sparse layouts
// fail the C exports as well, conjugate views are complex-only, and a tensor that requires grad
// is only read (no backward exists). The negative bit passes every export unnoticed, the Python
// method included, so check_no_neg_bit looks at it. Found once torch is imported; other
// producers take the __dlpack__ path.
struct TorchExport {
  PyTypeObject* tensor_type = nullptr;          // torch.Tensor
  const DLPackExchangeApi* exchange = nullptr;  // null: this torch has no usable exchange API
  PyObject* to_dlpack = nullptr;                // torch._C._to_dlpack
  PyObject* is_neg = nullptr;                   // torch.Tensor.is_neg (a method descriptor)
};

const DLPackExchangeApi* exchange_api_of(nb::handle tensor_type) {
  if (!has_attr(tensor_type, "__dlpack_c_exchange_api__")) return nullptr;
  nb::object capsule = tensor_type.attr("__dlpack_c_exchange_api__");
  auto* api = static_cast<const DLPackExchangeApi*>(
      PyCapsule_GetPointer(capsule.ptr(), "dlpack_exchange_api"));
  if (api == nullptr) {
    PyErr_Clear();
    return nullptr;
  }
  // The capsule points at a table that lives as long as the process (DLPack's rule).
  return api->major == 1 && api->dltensor_from_py_object_no_sync != nullptr ? api : nullptr;
}

const TorchExport& torch_export() {
  static TorchExport e;
  if (e.tensor_type == nullptr) {
    PyObject* torch = PyDict_GetItemString(PyImport_GetModuleDict(), "torch");  // borrowed
    if (torch != nullptr) {
      nb::handle t(torch);
      if (has_attr(t, "Tensor") && has_attr(t, "_C") && has_attr(t.attr("_C"), "_to_dlpack")) {
        nb::object tensor_type = t.attr("Tensor");
        e.exchange = exchange_api_of(tensor_type);
        e.to_dlpack = nb::object(t.attr("_C").attr("_to_dlpack")).release().ptr();
        e.is_neg = nb::object(tensor_type.attr("is_neg")).release().ptr();
        e.tensor_type = reinterpret_cast<PyTypeObject*>(tensor_type.release().ptr());
      }
    }
  }
  return e;
}

bool is_torch_tensor(const TorchExport& te, nb::handle obj) {
  return te.tensor_type != nullptr && PyObject_TypeCheck(obj.ptr(), te.tensor_type);
}

// torch's negative bit (x._neg_view(), and the imaginary part of a conj() view) says that the
// values are the negated stored ones. No DLPack export carries it (the C exchange API, _to_dlpack
// and Tensor.__dlpack__ all hand out the stored values), so it is checked here, once per torch
// tensor (a call of the method descriptor: about 0.1 us more per _C.tensor_info). Refused, not
// resolved: resolve_neg() is a copy (an allocation and a kernel the caller did not ask for), and
// an output cannot be written through the bit at all.
void check_no_neg_bit(const TorchExport& te, nb::handle obj, const char* name, bool writable) {
  PyObject* self = obj.ptr();
  PyObject* result = PyObject_Vectorcall(te.is_neg, &self, 1, nullptr);
  if (result == nullptr) throw nb::python_error();
  const bool neg = result == Py_True;
  Py_DECREF(result);
  if (!neg) return;
  if (writable) {
    throw TypeError(fmt::format(
        "{}: the tensor has torch's negative bit set (a _neg_view(), or the imaginary part of a "
        "conj() view); an output cannot be written through it, pass a tensor without it",
        name));
  }
  throw TypeError(fmt::format(
      "{}: the tensor has torch's negative bit set (a _neg_view(), or the imaginary part of a "
      "conj() view), which DLPack does not carry; pass {}.resolve_neg()",
      name, name));
}

// What to hand nanobind's DLPack import: torch tensors as a capsule from the C export, anything
// else as it is (nanobind calls __dlpack__ or reads the buffer protocol).
nb::object dlpack_source(nb::handle obj) {
  const TorchExport& te = torch_export();
  if (is_torch_tensor(te, obj)) {
    PyObject* capsule = PyObject_CallOneArg(te.to_dlpack, obj.ptr());
    if (capsule != nullptr) return nb::steal(capsule);
    PyErr_Clear();  // the regular path below reports why
  }
  return nb::borrow(obj);
}

}  // namespace

const char* py_type_name(nb::handle obj) { return Py_TYPE(obj.ptr())->tp_name; }

namespace {
PyObject* g_missing_output = nullptr;
}  // namespace

nb::handle missing_output() {
  if (g_missing_output == nullptr) {
    g_missing_output = PyObject_CallNoArgs(reinterpret_cast<PyObject*>(&PyBaseObject_Type));
    if (g_missing_output == nullptr) throw nb::python_error();
  }
  return g_missing_output;
}

TensorView Borrowed::tensor(nb::handle obj, const char* name, bool writable) {
  const TorchExport& te = torch_export();
  if (is_torch_tensor(te, obj)) {
    check_no_neg_bit(te, obj, name, writable);
    if (te.exchange != nullptr) {
      // Borrowed without a capsule: the caller's reference keeps the tensor alive for the call,
      // and the shape and strides are copied into the view before anything else runs.
      dl::dltensor t;
      if (te.exchange->dltensor_from_py_object_no_sync(obj.ptr(), &t) == 0) {
        return view_of(static_cast<char*>(t.data) + t.byte_offset, t.dtype, t.device.device_type,
                       t.device.device_id, t.ndim, t.shape, t.strides, name);
      }
      PyErr_Clear();  // the regular path below reports why
    }
  }
  if (writable) {
    // (Not on the torch path above: a real output costs no extra comparison.)
    if (obj.ptr() == g_missing_output) return TensorView();
    if (num_outputs_ == kCapacity) throw Error("sparse_attn binding: too many output tensors");
    nb::ndarray<>& slot = outputs_[num_outputs_];
    if (!nb::try_cast(dlpack_source(obj), slot, false)) raise_import_failure(obj, name, true);
    ++num_outputs_;
    return view_of(slot, name);
  }
  if (num_inputs_ == kCapacity) throw Error("sparse_attn binding: too many input tensors");
  nb::ndarray<nb::ro>& slot = inputs_[num_inputs_];
  if (!nb::try_cast(dlpack_source(obj), slot, false)) raise_import_failure(obj, name, false);
  ++num_inputs_;
  return view_of(slot, name);
}

std::optional<TensorView> Borrowed::optional_tensor(nb::handle obj, const char* name,
                                                    bool writable) {
  if (obj.is_none()) return std::nullopt;
  return tensor(obj, name, writable);
}

std::optional<double> optional_float(nb::handle obj, const char* name) {
  if (obj.is_none()) return std::nullopt;
  return to_float(obj, name);
}

double to_float(nb::handle obj, const char* name) {
  PyObject* o = obj.ptr();
  if (PyFloat_Check(o)) return PyFloat_AS_DOUBLE(o);
  if (PyLong_Check(o) && !PyBool_Check(o)) {
    const double v = PyLong_AsDouble(o);
    if (v == -1.0 && PyErr_Occurred()) {
      if (!PyErr_ExceptionMatches(PyExc_OverflowError)) throw nb::python_error();
      PyErr_Clear();
      throw ValueError(fmt::format("{}: expected a float, got an int out of its range", name));
    }
    return v;
  }
  // numpy.float32 and friends; tensors are refused, a one-element device tensor would
  // silently synchronise.
  if (!PyBool_Check(o) && !is_tensor_like(obj) && has_attr(obj, "__float__")) {
    const double v = PyFloat_AsDouble(o);
    if (v == -1.0 && PyErr_Occurred()) throw nb::python_error();
    return v;
  }
  throw TypeError(fmt::format("{}: expected a float, got {}", name, py_type_name(obj)));
}

std::optional<int64_t> optional_int(nb::handle obj, const char* name) {
  if (obj.is_none()) return std::nullopt;
  return to_int(obj, name);
}

int64_t to_int(nb::handle obj, const char* name) {
  PyObject* o = obj.ptr();
  const bool integral =
      (PyLong_Check(o) || (!is_tensor_like(obj) && has_attr(obj, "__index__"))) && !PyBool_Check(o);
  if (!integral)
    throw TypeError(fmt::format("{}: expected an int, got {}", name, py_type_name(obj)));
  nb::object index = nb::steal(PyNumber_Index(o));
  if (!index.is_valid()) throw nb::python_error();
  int overflow = 0;
  const long long v = PyLong_AsLongLongAndOverflow(index.ptr(), &overflow);
  if (overflow != 0) {
    throw ValueError(fmt::format("{}: {} does not fit in 64 bits", name, nb::str(obj).c_str()));
  }
  return static_cast<int64_t>(v);
}

bool to_bool(nb::handle obj, const char* name) {
  if (obj.ptr() == Py_True) return true;
  if (obj.ptr() == Py_False) return false;
  // numpy.bool_ (numpy.bool in numpy 2)
  const std::string_view type = py_type_name(obj);
  if (type == "numpy.bool_" || type == "numpy.bool") return PyObject_IsTrue(obj.ptr()) == 1;
  throw TypeError(fmt::format("{}: expected a bool, got {}", name, py_type_name(obj)));
}

namespace {

// Calls fn(item, index) for each item of a list or tuple; None is empty.
template <typename Fn>
void for_each_item(nb::handle obj, const char* name, const char* what, Fn&& fn) {
  if (obj.is_none()) return;
  if (!PyList_Check(obj.ptr()) && !PyTuple_Check(obj.ptr())) {
    throw TypeError(fmt::format("{}: expected a list of {} (or a tensor), got {}", name, what,
                                py_type_name(obj)));
  }
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(obj.ptr());
  PyObject** items = PySequence_Fast_ITEMS(obj.ptr());
  for (Py_ssize_t i = 0; i < n; ++i) fn(nb::handle(items[i]), static_cast<int64_t>(i));
}

}  // namespace

std::vector<int32_t> to_int32_list(nb::handle obj, const char* name) {
  std::vector<int32_t> out;
  for_each_item(obj, name, "ints", [&](nb::handle item, int64_t i) {
    const std::string item_name = fmt::format("{}[{}]", name, i);
    const int64_t v = to_int(item, item_name.c_str());
    if (v < INT32_MIN || v > INT32_MAX) {
      throw ValueError(fmt::format("{}: {} does not fit in int32", item_name, v));
    }
    out.push_back(static_cast<int32_t>(v));
  });
  return out;
}

std::vector<double> to_float_list(nb::handle obj, const char* name) {
  std::vector<double> out;
  for_each_item(obj, name, "floats", [&](nb::handle item, int64_t i) {
    out.push_back(to_float(item, fmt::format("{}[{}]", name, i).c_str()));
  });
  return out;
}

std::string to_str(nb::handle obj, const char* name) {
  if (!PyUnicode_Check(obj.ptr())) {
    throw TypeError(fmt::format("{}: expected a str, got {}", name, py_type_name(obj)));
  }
  return nb::borrow<nb::str>(obj).c_str();
}

Backend to_backend(nb::handle obj) {
  if (!PyUnicode_Check(obj.ptr())) {
    throw TypeError(fmt::format("backend: expected a str, got {}", py_type_name(obj)));
  }
  Py_ssize_t size = 0;
  const char* s = PyUnicode_AsUTF8AndSize(obj.ptr(), &size);
  if (s == nullptr) throw nb::python_error();
  return parse_backend(std::string_view(s, static_cast<size_t>(size)));
}

namespace {

DType dtype_of_object(nb::handle obj, const char* name) {
  std::string s;
  if (PyUnicode_Check(obj.ptr())) {
    s = nb::borrow<nb::str>(obj).c_str();
  } else if (PyType_Check(obj.ptr()) && has_attr(obj, "__name__")) {
    s = nb::str(obj.attr("__name__")).c_str();  // numpy.float16 (the scalar type)
  } else if (has_attr(obj, "itemsize") || std::string_view(py_type_name(obj)) == "torch.dtype") {
    s = nb::str(obj)
            .c_str();  // numpy.dtype('float16') -> "float16", torch.bfloat16 -> "torch.bfloat16"
  } else {
    throw TypeError(fmt::format("{}: expected a dtype (torch.dtype, numpy dtype or name), got {}",
                                name, py_type_name(obj)));
  }
  if (s.rfind("torch.", 0) == 0) s.erase(0, 6);
  if (s == "bfloat16") return DType::kBF16;
  if (s == "float16" || s == "half") return DType::kF16;
  if (s == "float32" || s == "float") return DType::kF32;
  if (s == "int32") return DType::kI32;
  if (s == "int64") return DType::kI64;
  if (s == "bool") return DType::kBool;
  if (s == "uint8") return DType::kU8;
  if (s.find("float8") != std::string::npos) {
    throw NotSupportedError(
        fmt::format("{}: {} is not supported: FP8 compute is not enabled", name, s));
  }
  throw TypeError(fmt::format("{}: dtype {} is not supported", name, s));
}

}  // namespace

std::optional<DType> to_kv_cache_dtype(nb::handle obj, const char* name) {
  if (obj.is_none()) return std::nullopt;
  std::string s;
  if (PyUnicode_Check(obj.ptr())) {
    s = nb::borrow<nb::str>(obj).c_str();
  } else if (std::string_view(py_type_name(obj)) == "torch.dtype") {
    s = nb::str(obj).c_str();
    s.erase(0, 6);  // "torch."
  } else {
    return to_dtype(obj, name);
  }
  // vLLM's kv_cache_dtype names ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", ...) and torch's.
  if (s == "auto") return std::nullopt;
  if (s == "fp8" || s == "fp8_e4m3" || s == "float8_e4m3fn") return DType::kF8E4M3;
  if (s.rfind("fp8", 0) == 0 || s.find("float8") != std::string::npos) {
    throw NotSupportedError(fmt::format(
        "{}: {} caches are not supported; FP8 caches are read as e4m3 only ('fp8', 'fp8_e4m3' or "
        "torch.float8_e4m3fn)",
        name, s));
  }
  return to_dtype(obj, name);
}

DType to_dtype(nb::handle obj, const char* name) {
  // torch dtypes are singletons: those converted before are recognised by identity, which
  // skips building and parsing their repr (compute_dtype comes with every attention call).
  // Guarded by the GIL, like every conversion here.
  struct Known {
    PyObject* dtype_object;  // a strong reference, kept for the life of the process
    DType dtype;
  };
  static std::array<Known, 8> known;
  static size_t num_known = 0;
  for (size_t i = 0; i < num_known; ++i) {
    if (known[i].dtype_object == obj.ptr()) return known[i].dtype;
  }
  const DType dtype = dtype_of_object(obj, name);
  if (num_known < known.size() && std::string_view(py_type_name(obj)) == "torch.dtype") {
    known[num_known++] = {nb::borrow(obj).release().ptr(), dtype};
  }
  return dtype;
}

StreamHandle to_stream(nb::handle obj) {
  if (obj.is_none()) return nullptr;
  if (!PyLong_Check(obj.ptr())) {
    throw TypeError(
        fmt::format("stream: expected an int (a cudaStream_t), got {}", py_type_name(obj)));
  }
  const unsigned long long v = PyLong_AsUnsignedLongLong(obj.ptr());
  if (PyErr_Occurred()) throw nb::python_error();
  return reinterpret_cast<StreamHandle>(static_cast<uintptr_t>(v));
}

}  // namespace sparse_attn::python
