// Tile shapes, shared-memory layouts, MMAs and the shared storage of the SM90 attention forward
// kernel. A CTA is one producer warpgroup and two consumer warpgroups; the consumers own 64 of
// the CTA's 128 query rows each and share every K/V tile (FlashAttention-3's arrangement).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cutlass/arch/barrier.h>

#include <cute/tensor.hpp>
#include <cutlass/gemm/collective/builders/sm90_common.inl>
#include <type_traits>

#include "cuda/attention/sm90/pipeline.h"
#include "cuda/attention/sm90/scheduler.h"

namespace sparse_attn::cuda::sm90 {

// The CUTLASS element type of a kernel's CUDA element type (__nv_bfloat16 or __half): the
// launchers are instantiated on the CUDA type, the SM90 pieces on CUTLASS's.
template <typename T>
using CutlassElement =
    std::conditional_t<std::is_same_v<T, __half>, cutlass::half_t, cutlass::bfloat16_t>;

// The K/V stages of a pipeline: each stage [kBlockN, D] with the head dim contiguous, 128-byte
// swizzled column blocks of 128 / sizeof(Element) features, each column block's rows contiguous
// (so a TMA box of whole rows of one column block lands in contiguous smem, and a gathering
// producer writes 16-byte chunk c of row r at column block c / 8, row r, slot (c % 8) ^ (r % 8):
// sm90/gather.h). A V stage holds the same bytes, seen transposed as Vt [D, kBlockN] (MN-major)
// for the P V product, whichever operand Vt is.
template <class Element, int kHeadDim, int kBlockN, int kStages>
struct KVStageLayouts {
  using AtomK = decltype(cutlass::gemm::collective::detail::ss_smem_selector<
                         cute::GMMA::Major::K, Element, cute::Int<kBlockN>, cute::Int<kHeadDim>>());
  using LayoutK = decltype(cute::tile_to_shape(
      AtomK{}, cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDim>, cute::Int<kStages>>{}));
  using AtomVt =
      decltype(cutlass::gemm::collective::detail::ss_smem_selector<
               cute::GMMA::Major::MN, Element, cute::Int<kHeadDim>, cute::Int<kBlockN>>());
  using LayoutVt = decltype(cute::tile_to_shape(
      AtomVt{}, cute::Shape<cute::Int<kHeadDim>, cute::Int<kBlockN>, cute::Int<kStages>>{},
      cute::Step<cute::_2, cute::_1, cute::_3>{}));
};

// The registers a thread keeps for a CTA of `threads` threads at one CTA per SM: 64K / threads in
// steps of 8 (168 at 384). setmaxnreg moves registers between a CTA's warpgroups within this
// pool: a warpgroup's increase waits for registers another's decrease frees, forever where the
// split asks for more.
constexpr int launched_registers(int threads) { return 65536 / threads / 8 * 8; }

// kProducerArrivals: 1 for a TMA producer (one arrival and the transaction bytes per stage), or
// the producer threads of a cp.async producer (one arrival each). The register split is the
// producer's and each consumer thread's setmaxnreg target.
template <class Element_, int kHeadDim_, int kBlockN_, int kStages_, int kProducerArrivals_ = 1,
          int kProducerRegisters_ = 24, int kConsumerRegisters_ = 240>
struct FwdTraits {
  using Element = Element_;  // cutlass::bfloat16_t or cutlass::half_t
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = 128;       // query rows per CTA
  static constexpr int kBlockN = kBlockN_;  // keys per K/V tile
  static constexpr int kStages = kStages_;  // K/V tiles in flight
  static constexpr int kConsumerWarpgroups = 2;
  static constexpr int kConsumerThreads = 128 * kConsumerWarpgroups;
  static constexpr int kThreads = kConsumerThreads + 128;
  // setmaxnreg targets: the producer only computes addresses and issues copies; the consumers
  // hold O, S and P. 128 * 24 + 256 * 240 = 384 * 168, the registers the CTA is launched with.
  static constexpr int kProducerRegisters = kProducerRegisters_;
  static constexpr int kConsumerRegisters = kConsumerRegisters_;
  static_assert(128 * kProducerRegisters + kConsumerThreads * kConsumerRegisters <=
                    kThreads * launched_registers(kThreads),
                "the register split fits the registers the CTA was launched with");
  static constexpr int kProducerArrivals = kProducerArrivals_;
  // Copies through the generic proxy (cp.async) must be fenced before GMMA reads them.
  static constexpr bool kGenericProxyLoads = kProducerArrivals > 1;
  // Elements per 128-byte swizzle row: TMA boxes and smem column blocks are this wide.
  static constexpr int kSwizzleCols = 128 / sizeof(Element);

  static_assert(kHeadDim % kSwizzleCols == 0, "head dims are whole 128-byte swizzle rows");
  static_assert(kBlockN % 8 == 0 && kBlockN <= 256, "a K/V tile is whole 8-row swizzle atoms");

  using TileQK = cute::Shape<cute::Int<kBlockM>, cute::Int<kBlockN>, cute::Int<kHeadDim>>;
  using TilePV = cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim>, cute::Int<kBlockN>>;
  using WarpgroupsAlongM =
      cute::Layout<cute::Shape<cute::Int<kConsumerWarpgroups>, cute::_1, cute::_1>>;
  // S = Q K^T with both operands in smem; O += P V with P from registers and V's head dim
  // contiguous (MN-major B).
  using MmaQK = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<Element, Element, float, TileQK>(), WarpgroupsAlongM{}));
  using MmaPV = decltype(cute::make_tiled_mma(
      cute::GMMA::rs_op_selector<Element, Element, float, TilePV, cute::GMMA::Major::K,
                                 cute::GMMA::Major::MN>(),
      WarpgroupsAlongM{}));

  // Q [kBlockM, D] like a K stage (KVStageLayouts).
  using AtomQ = decltype(cutlass::gemm::collective::detail::ss_smem_selector<
                         cute::GMMA::Major::K, Element, cute::Int<kBlockM>, cute::Int<kHeadDim>>());
  using LayoutQ = decltype(cute::tile_to_shape(
      AtomQ{}, cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim>>{}));
  using LayoutK = typename KVStageLayouts<Element, kHeadDim, kBlockN, kStages>::LayoutK;
  using LayoutVt = typename KVStageLayouts<Element, kHeadDim, kBlockN, kStages>::LayoutVt;

  static constexpr uint32_t kTileBytes = kBlockN * kHeadDim * sizeof(Element);
  static constexpr uint32_t kQBytes = kBlockM * kHeadDim * sizeof(Element);

  using Pipeline = TmaPipeline<kStages, kConsumerWarpgroups, kProducerArrivals>;
  using PipelineState = typename Pipeline::State;
  using WorkRing = sm90::WorkRing<kConsumerThreads>;

  struct SharedStorage {
    // 1024-byte alignment: the 128-byte swizzle repeats every 8 rows of 128 bytes, and TMA
    // and GMMA address the pattern from the smem address.
    alignas(
        1024) cute::array_aligned<Element, cute::cosize_v<LayoutQ>> q;  // then O in the epilogue
    alignas(1024) cute::array_aligned<Element, cute::cosize_v<LayoutK>> k;
    alignas(1024) cute::array_aligned<Element, cute::cosize_v<LayoutVt>> v;
    typename Pipeline::SharedStorage pipeline_k;
    typename Pipeline::SharedStorage pipeline_v;
    cutlass::arch::ClusterTransactionBarrier barrier_q;
    // Persistent launches: Q's smem is free for the next item once both consumer warpgroups
    // arrived (their last S GEMM of the item completed); the item ids in flight.
    cutlass::arch::ClusterBarrier barrier_q_free;
    typename WorkRing::SharedStorage work;
  };
  static constexpr int kSmemBytes = static_cast<int>(sizeof(SharedStorage));
  static_assert(kSmemBytes <= 227 * 1024, "exceeds the SM90 opt-in shared memory");
};

// Named barriers of the kernel (after CUTLASS's reserved ones).
enum class FwdBarrier : uint32_t {
  kSchedulerWG1 = 0,  // + warpgroup index: the consumers take turns issuing GEMMs
  kZeroV = 2,         // both consumers zeroed the V rows past the keys' end
  kEpilogueWG1 = 3,   // + warpgroup index: a consumer's O tile is in smem
  kItemStart = 5,     // persistent launches: both consumers are past their previous item
};

}  // namespace sparse_attn::cuda::sm90
