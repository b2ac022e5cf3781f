// Native indexer entry points of a build without CUDA: every call names what is missing.
#include "api/check.h"
#include "api/qsa_indexer_params.h"

namespace sparse_attn::detail {
namespace {

[[noreturn]] void no_cuda(const char* op) {
  throw_not_supported(
      "{}: backend 'native' needs a CUDA build of sparse_attn (this build has no CUDA support); "
      "pass backend='reference'",
      op);
}

}  // namespace

void native_mqa_score(const MqaScoreParams&) { no_cuda("qsa_indexer_mqa_score"); }
void native_mqa_prefill(const MqaPrefillParams&) { no_cuda("qsa_mqa_prefill"); }
void native_mqa_decode(const MqaDecodeParams&) { no_cuda("qsa_mqa_decode"); }

}  // namespace sparse_attn::detail
