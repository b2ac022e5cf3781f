// The native sparse-attention entry of a build without CUDA: validation has passed, but there
// is no kernel to run, and the reference is never substituted silently.
#include "api/qsa_attention_params.h"
#include "sparse_attn/errors.h"

namespace sparse_attn {

void native_sparse_attention(const SparseAttentionParams&) {
  throw NotSupportedError(
      "qsa_sparse_attention: backend 'native' needs the CUDA kernels, and this sparse_attn build "
      "has no CUDA support; pass backend='reference' to run the CPU reference");
}

// No native call runs in this build (it raises above), so none needs scratch.
size_t native_sparse_attention_workspace_size(const SparseAttentionParams&) { return 0; }

}  // namespace sparse_attn
