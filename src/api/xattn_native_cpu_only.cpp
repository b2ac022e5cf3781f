// The native XAttention entries of a build without CUDA: validation has passed, but there is
// no kernel to run, and the reference is never substituted silently.
#include "api/check.h"
#include "api/xattn_params.h"

namespace sparse_attn {
namespace {

[[noreturn]] void no_cuda(const char* op) {
  detail::throw_not_supported(
      "{}: backend 'native' needs the CUDA kernels, and this sparse_attn build has no CUDA "
      "support; pass backend='reference' to run the CPU reference",
      op);
}

}  // namespace

void native_xattn_estimate(const XAttnEstimateParams&) { no_cuda("xattn_estimate"); }
void native_find_blocks(const BlockSelectParams&) { no_cuda("find_blocks_chunked"); }
void native_block_sparse_attention(const BlockSparseAttnParams&) {
  no_cuda("block_sparse_attention");
}
void native_gather_pages(const PagedGatherParams&,
                         const std::function<void(const void*, const void*)>&) {
  no_cuda("xattention_prefill_paged");
}

}  // namespace sparse_attn
