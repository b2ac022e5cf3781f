#include "api/check.h"
#include "sparse_attn/common.h"

namespace sparse_attn {

Backend parse_backend(std::string_view name) {
  if (name == "native" || name == "tilelang") return Backend::kNative;
  if (name == "reference") return Backend::kReference;
  detail::throw_value_error(
      "backend: expected 'native', 'tilelang' (alias of native) or 'reference', got '{}'", name);
}

const char* backend_name(Backend backend) {
  return backend == Backend::kNative ? "native" : "reference";
}

}  // namespace sparse_attn
