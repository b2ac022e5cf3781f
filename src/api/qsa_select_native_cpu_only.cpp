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

size_t native_indexer_select_workspace_size(const IndexerSelectParams&) { return 0; }
size_t native_decode_select_workspace_size(const DecodeSelectParams&) { return 0; }
void native_indexer_select(const IndexerSelectParams&) {
  throw_not_supported("qsa_indexer_select: CUDA tensors need a CUDA build of sparse_attn");
}
void native_decode_select(const DecodeSelectParams&) {
  throw_not_supported("qsa_mqa_decode_select: CUDA tensors need a CUDA build of sparse_attn");
}

}  // namespace sparse_attn::detail
