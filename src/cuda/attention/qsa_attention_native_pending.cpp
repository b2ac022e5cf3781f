// native_sparse_attention in a CUDA build, until the SM90 kernels land: the API validates and
// fills the params, and this says plainly that no kernel exists yet (no silent reference
// fallback). The kernels' launch file replaces this one (delete it when defining the entry).
#include "api/qsa_attention_params.h"
#include "sparse_attn/errors.h"

namespace sparse_attn {

void native_sparse_attention(const SparseAttentionParams&) {
  throw NotSupportedError(
      "qsa_sparse_attention: backend 'native' has no CUDA kernel in this build yet; pass "
      "backend='reference' to run the reference (CUDA tensors are staged through the host)");
}

}  // namespace sparse_attn
