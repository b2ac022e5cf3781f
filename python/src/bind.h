// One registration function per op family; module.cpp calls each.
#pragma once

#include <nanobind/nanobind.h>

#include <initializer_list>
#include <string>
#include <string_view>
#include <utility>

#include "sparse_attn/errors.h"

namespace sparse_attn::python {

// Defines `name` with every argument named and accepting None (the binding decides what None
// means, and says so in its errors).
template <typename Func, typename... Names>
void def(nanobind::module_& m, const char* name, Func&& f, Names... arg_names) {
  m.def(name, std::forward<Func>(f), nanobind::arg(arg_names).none()...);
}

// The C++ API names some arguments differently from the Python functions (XAttention's
// query, attn_sums, head_thresholds, ... keep the upstream names query_states, input_tensor,
// threshold, ...; the fused selections' k and block_ids are topk and out). An error of the C++
// call starts with the argument it is about ("key: expected ...", "head_thresholds[1]: ...");
// it is rethrown, same type, with that name replaced by the caller's, so that every message
// names a parameter of the function the caller called.
using Rename = std::pair<std::string_view, std::string_view>;  // (C++ name, Python name)

inline std::string with_python_name(std::string_view message, std::initializer_list<Rename> names) {
  for (const auto& [cpp, py] : names) {
    if (message.size() > cpp.size() && message.substr(0, cpp.size()) == cpp &&
        (message[cpp.size()] == ':' || message[cpp.size()] == '[')) {
      return std::string(py) + std::string(message.substr(cpp.size()));
    }
  }
  return std::string(message);
}

// Runs fn without the GIL, translating the argument names of its ValueError, NotSupportedError
// and TypeError; other errors (CUDA failures) pass unchanged.
template <typename Fn>
void call_with_python_names(std::initializer_list<Rename> names, Fn&& fn) {
  try {
    nanobind::gil_scoped_release release;
    fn();
  } catch (const NotSupportedError& e) {
    throw NotSupportedError(with_python_name(e.what(), names));
  } catch (const ValueError& e) {
    throw ValueError(with_python_name(e.what(), names));
  } catch (const TypeError& e) {
    throw TypeError(with_python_name(e.what(), names));
  }
}

void bind_qsa(nanobind::module_& m);
void bind_compress(nanobind::module_& m);
void bind_select(nanobind::module_& m);
void bind_merge(nanobind::module_& m);
void bind_xattn(nanobind::module_& m);

}  // namespace sparse_attn::python
