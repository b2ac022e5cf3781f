// Types every op family of sparse_attn shares: the backend choice and the stream handle.
#pragma once

#include <cstdint>
#include <string_view>

namespace sparse_attn {

// Which implementation runs a call. Parsing accepts "native" (the default), "tilelang" (the
// seed's name for its native backend, an alias of native) and "reference" (the CPU oracle;
// CUDA tensors are staged through the host). There is no automatic fallback.
enum class Backend : uint8_t { kNative, kReference };
Backend parse_backend(std::string_view name);
const char* backend_name(Backend backend);

// A cudaStream_t passed without CUDA types; nullptr is the legacy default stream.
using StreamHandle = void*;

}  // namespace sparse_attn
