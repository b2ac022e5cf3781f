// One registration function per op family; module.cpp calls each.
#pragma once

#include <nanobind/nanobind.h>

namespace sparse_attn::python {

void bind_qsa(nanobind::module_& m);

}  // namespace sparse_attn::python
