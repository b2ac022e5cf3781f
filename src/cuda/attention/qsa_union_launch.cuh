// The launch of the union prefill kernel (qsa_union_problem.cuh on the SM90 core) for one element
// type: its tile configuration, the shared-memory opt-in and the grid. Instantiated once per .cu
// in instantiations/.
#pragma once

#include <cuda_runtime_api.h>

#include <type_traits>

#include "cuda/attention/qsa_union_problem.cuh"
#include "cuda/attention/sm90/kernel_fwd.cuh"
#include "cuda/common/check.h"
#include "cuda/common/kernel_attributes.h"

namespace sparse_attn::cuda {

// 128 producer threads gather with cp.async; their address arithmetic takes more registers than
// a TMA producer's 24 (128 * 40 + 256 * 232 fits one CTA per SM).
template <class Element>
using QsaUnionTraits = sm90::FwdTraits<Element, QsaUnionConfig::kHeadDim, QsaUnionConfig::kBlockN,
                                       QsaUnionConfig::kStages, 128, 40, 232>;

template <typename T>
void launch_qsa_union(const QsaUnionParams& params, cudaStream_t stream) {
  using Traits = QsaUnionTraits<sm90::CutlassElement<T>>;
  using Problem = QsaUnionProblem<Traits>;
  static_assert(Traits::kThreads == QsaUnionConfig::kThreads);
  constexpr auto kernel = sm90::attention_fwd_kernel<Traits, Problem>;
  constexpr int kSmem = sm90::fwd_smem_bytes<Traits, Problem>();
  opt_in_shared_memory<kernel>(kSmem);
  const int64_t ctas = static_cast<int64_t>(params.chunk_tiles) * params.p.num_kv_heads;
  kernel<<<static_cast<unsigned>(ctas), Traits::kThreads, kSmem, stream>>>(params);
  SPARSE_ATTN_CUDA_CHECK_LAUNCH();
}

}  // namespace sparse_attn::cuda
