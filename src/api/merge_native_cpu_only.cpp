// The native merge entry point of a build without CUDA: such a build holds no CUDA tensors, so
// the API never reaches it; it names what is missing should anything else call it.
#include "api/check.h"
#include "api/merge_params.h"

namespace sparse_attn::detail {

void native_merge_attention_states(const MergeParams&) {
  throw_not_supported("merge_attention_states: CUDA tensors need a CUDA build of sparse_attn");
}

}  // namespace sparse_attn::detail
