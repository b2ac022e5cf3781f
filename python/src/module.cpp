// The extension module sparse_attn._C: the C++ API for Python, one function per C++ entry
// point, taking every argument positionally. It is private; python/sparse_attn/ gives it the
// seed's signatures, allocates outputs and finds the caller's stream.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "bind.h"
#include "convert.h"
#include "sparse_attn/errors.h"

namespace nb = nanobind;

namespace sparse_attn::python {
namespace {

// C++ errors become the seed's Python exceptions with the message kept: ValueError (and its
// NotSupportedError subclass) -> ValueError, TypeError -> TypeError, anything else the library
// reports (a CUDA failure) -> RuntimeError.
void translate_errors(const std::exception_ptr& p, void* not_supported_type) {
  try {
    std::rethrow_exception(p);
  } catch (const NotSupportedError& e) {
    PyErr_SetString(static_cast<PyObject*>(not_supported_type), e.what());
  } catch (const ValueError& e) {
    PyErr_SetString(PyExc_ValueError, e.what());
  } catch (const TypeError& e) {
    PyErr_SetString(PyExc_TypeError, e.what());
  } catch (const Error& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  }
}

// What the binding sees of a tensor: lets tests check that offsets and strides survive the
// DLPack import exactly.
nb::tuple tensor_info(nb::handle obj) {
  Borrowed borrowed;
  const TensorView v = borrowed.tensor(obj, "tensor");
  return nb::make_tuple(dtype_name(v.dtype()), v.device().str(), v.shape(),
                        Shape(v.strides(), v.strides() + v.dim()),
                        reinterpret_cast<uintptr_t>(v.data()));
}

}  // namespace
}  // namespace sparse_attn::python

NB_MODULE(_C, m) {
  using namespace sparse_attn::python;
  m.doc() = "sparse_attn C++ binding (private; use the sparse_attn package)";

  PyObject* not_supported = PyErr_NewExceptionWithDoc(
      "sparse_attn.NotSupportedError",
      "The call is valid, but the chosen backend does not implement this combination.",
      PyExc_ValueError, nullptr);
  m.attr("NotSupportedError") = nb::steal(not_supported);
  nb::register_exception_translator(translate_errors, not_supported);

  m.def("tensor_info", &tensor_info, nb::arg("tensor").none(),
        "(dtype, device, shape, strides, data pointer) of the view the binding makes of `tensor`");
  // The placeholder of an output that could not be allocated (convert.h, missing_output).
  m.attr("MISSING_OUTPUT") = missing_output();
  // Set by python/CMakeLists.txt from the library's configuration.
  m.attr("built_with_cuda") = nb::bool_(SPARSE_ATTN_PY_WITH_CUDA != 0);
  bind_qsa(m);
  bind_select(m);
  bind_compress(m);
  bind_merge(m);
  bind_xattn(m);
}
