// Native selection entry points of a build without CUDA: such a build holds no CUDA tensors, so
// the API never reaches these; they name what is missing should anything else call them.
#include "api/check.h"
#include "api/qsa_select_params.h"

namespace sparse_attn::detail {

void native_topk_blocks(const TopkBlocksParams&) {
  throw_not_supported("qsa_topk_blocks: CUDA tensors need a CUDA build of sparse_attn");
}
void native_expand_blocks(const ExpandBlocksParams&) {
  throw_not_supported("qsa_expand_blocks: CUDA tensors need a CUDA build of sparse_attn");
}

}  // namespace sparse_attn::detail
