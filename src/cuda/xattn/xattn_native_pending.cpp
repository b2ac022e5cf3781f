// The native XAttention estimate and selection in a CUDA build, until their kernels land: the API
// validates and fills the params, and these say plainly that no kernel exists yet (no silent
// reference fallback). Block-sparse attention is native (block_sparse_fwd.cu).
#include "api/check.h"
#include "api/xattn_params.h"

namespace sparse_attn {
namespace {

[[noreturn]] void pending(const char* op) {
  detail::throw_not_supported(
      "{}: backend 'native' has no CUDA kernel in this build yet; pass backend='reference' to "
      "run the reference (CUDA tensors are staged through the host)",
      op);
}

}  // namespace

void native_xattn_estimate(const XAttnEstimateParams&) { pending("xattn_estimate"); }
void native_find_blocks(const BlockSelectParams&) { pending("find_blocks_chunked"); }

}  // namespace sparse_attn
