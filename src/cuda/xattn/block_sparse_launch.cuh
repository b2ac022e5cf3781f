// The launch of native block-sparse attention for one (element type, head dim): the tile
// configuration, the kernel's shared-memory opt-in, the grid (persistent: at most one CTA per
// SM, after p.work_counter is zeroed on the stream; else one CTA per work item), and the
// SplitKV merge after it when p.splits > 1. Instantiated once per .cu in instantiations/.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>

#include "cuda/attention/sm90/kernel_fwd.cuh"
#include "cuda/common/check.h"
#include "cuda/common/kernel_attributes.h"
#include "cuda/xattn/block_sparse_fwd.h"
#include "cuda/xattn/block_sparse_merge.cuh"
#include "cuda/xattn/block_sparse_problem.cuh"

namespace sparse_attn::cuda {

template <class Element, int kHeadDim>
using BlockSparseTraits = sm90::FwdTraits<
    Element, kHeadDim, BlockSparseTile<kHeadDim>::kBlockN, BlockSparseTile<kHeadDim>::kStages, 1,
    BlockSparseTile<kHeadDim>::kProducerRegisters, BlockSparseTile<kHeadDim>::kConsumerRegisters>;

template <class Element, int kHeadDim>
void launch_block_sparse_fwd(const BlockSparseFwdParams& p, int64_t tiles, int sms,
                             cudaStream_t stream) {
  using Traits = BlockSparseTraits<Element, kHeadDim>;
  using Problem = BlockSparseProblem<Traits>;
  constexpr auto kernel = sm90::attention_fwd_kernel<Traits, Problem>;
  constexpr int kSmem = sm90::fwd_smem_bytes<Traits, Problem>();
  opt_in_shared_memory<kernel>(kSmem);
  int ctas = p.work_items;
  if constexpr (Problem::kPersistent) {
    SPARSE_ATTN_CUDA_CHECK(cudaMemsetAsync(p.work_counter, 0, sizeof(int32_t), stream));
    ctas = std::min(ctas, sms);
  }
  kernel<<<static_cast<unsigned>(ctas), Traits::kThreads, kSmem, stream>>>(p);
  SPARSE_ATTN_CUDA_CHECK_LAUNCH();
  if (p.splits > 1) {
    const dim3 grid(static_cast<unsigned>(tiles), 128 / kMergeRowsPerCta);
    block_sparse_merge_kernel<Traits><<<grid, 128, 0, stream>>>(p);
    SPARSE_ATTN_CUDA_CHECK_LAUNCH();
  }
}

}  // namespace sparse_attn::cuda
