// One registration function per op family; module.cpp calls each.
#pragma once

#include <nanobind/nanobind.h>

#include <utility>

namespace sparse_attn::python {

// Defines `name` with every argument named and accepting None (the binding decides what None
// means, and says so in its errors).
template <typename Func, typename... Names>
void def(nanobind::module_& m, const char* name, Func&& f, Names... arg_names) {
  m.def(name, std::forward<Func>(f), nanobind::arg(arg_names).none()...);
}

void bind_qsa(nanobind::module_& m);
void bind_compress(nanobind::module_& m);
void bind_select(nanobind::module_& m);
void bind_merge(nanobind::module_& m);
void bind_xattn(nanobind::module_& m);

}  // namespace sparse_attn::python
