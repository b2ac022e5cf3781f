// The native entry point of a build without CUDA: such a build holds no CUDA tensors, so the
// API never reaches it; it names what is missing should anything else call it.
#include "api/check.h"
#include "api/qsa_compress_params.h"

namespace sparse_attn::detail {

void native_compress_block_keys(const CompressBlockKeysParams&) {
  throw_not_supported("qsa_compress_block_keys: CUDA tensors need a CUDA build of sparse_attn");
}

}  // namespace sparse_attn::detail
