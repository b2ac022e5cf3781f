// The consumer warpgroup of the QSA gather kernels (qsa_gather_kernel.cuh: one query row a CTA;
// qsa_step_kernel.cuh: a request's decode step of up to four rows, a consumer warpgroup a KV
// head): decode-shaped attention on gathered K/V tiles, computed transposed, with the keys in M.
//
// S^T = K Q^T (M = 64 keys of a tile, N = kHeads query columns) and O^T += V^T P^T (M = 256
// features, N = kHeads, K = 64 keys), both on GMMA with P^T through a small buffer and K, V^T
// either in shared memory (16-bit K/V) or in registers (FP8 K/V: each thread widens its own A
// fragments out of the FP8 tile, sm90/gather.h, so that no 16-bit copy of it is ever written). A
// decode CTA has 12 to 16 query heads a row: packing them into M would leave most of its 64 rows
// empty, while N takes them in steps of 8. A column's softmax is a column of S^T spread over the
// warpgroup's four warps (ColumnSoftmax).
//
// The instantiations differ in what surrounds it, through its hooks: which slots of a tile a
// column may see (the mask), where a tile's A operand comes from (a ring stage, or registers
// widened from an FP8 slot), and where the outputs go.
#pragma once

#include <cutlass/arch/barrier.h>
#include <cutlass/numeric_conversion.h>

#include <cute/arch/copy_sm90.hpp>
#include <cute/tensor.hpp>
#include <cutlass/gemm/collective/builders/sm90_common.inl>

#include "cuda/attention/sm90/mma.h"
#include "cuda/attention/sm90/softmax.h"
#include "cuda/attention/sm90/traits.h"

namespace sparse_attn::cuda {

// Shapes, GMMAs and shared-memory layouts of the consumer: kHeads query columns, kStages 16-bit
// K/V stages of 64 keys x 256 features (with kRegisterA, as many again FP8 tiles in the same
// bytes), K and V^T read from shared memory or (kRegisterA) from registers.
template <class Element, int kHeads_, int kStages_, bool kRegisterA_ = false>
struct GatherMmaTraits {
  static constexpr int kHeadDim = 256;
  static constexpr int kBlockN = 64;  // keys per K/V tile: M of S^T
  static constexpr int kHeads = kHeads_;
  static constexpr int kStages = kStages_;
  static constexpr bool kRegisterA = kRegisterA_;
  static_assert(kHeads % 16 == 0 && kHeads <= 64, "N of whole k16 P^T steps, O^T in registers");
  using Element_ = Element;
  using TileS = cute::Shape<cute::Int<kBlockN>, cute::Int<kHeads>, cute::Int<kHeadDim>>;
  using TileO = cute::Shape<cute::Int<kHeadDim>, cute::Int<kHeads>, cute::Int<kBlockN>>;
  // S^T = K Q^T: K stages and Q with the head dim contiguous. O^T += V^T P^T: V stages seen
  // transposed (MN-major A), P^T [heads, keys] with the keys contiguous.
  // With kRegisterA, both A operands come from registers in GMMA's K-major fragment order.
  static auto mma_s() {
    if constexpr (kRegisterA) {
      return cute::GMMA::rs_op_selector<Element, Element, float, TileS>();
    } else {
      return cute::GMMA::ss_op_selector<Element, Element, float, TileS>();
    }
  }
  static auto mma_o() {
    if constexpr (kRegisterA) {
      return cute::GMMA::rs_op_selector<Element, Element, float, TileO>();
    } else {
      return cute::GMMA::ss_op_selector<Element, Element, float, TileO, cute::GMMA::Major::MN,
                                        cute::GMMA::Major::K>();
    }
  }
  using MmaS = decltype(cute::make_tiled_mma(mma_s()));
  using MmaO = decltype(cute::make_tiled_mma(mma_o()));
  using Stages = sm90::KVStageLayouts<Element, kHeadDim, kBlockN, kStages>;
  using LayoutK = typename Stages::LayoutK;
  using LayoutVt = typename Stages::LayoutVt;
  using AtomQ = decltype(cutlass::gemm::collective::detail::ss_smem_selector<
                         cute::GMMA::Major::K, Element, cute::Int<kHeads>, cute::Int<kHeadDim>>());
  using LayoutQ =
      decltype(cute::tile_to_shape(AtomQ{}, cute::Shape<cute::Int<kHeads>, cute::Int<kHeadDim>>{}));
  // One P^T buffer: a warp writes tile n + 1's P only after ColumnSoftmax's exchange of that
  // tile, which every warp reaches after waiting for its part of tile n's P V GEMM.
  using AtomP = decltype(cutlass::gemm::collective::detail::ss_smem_selector<
                         cute::GMMA::Major::K, Element, cute::Int<kHeads>, cute::Int<kBlockN>>());
  using LayoutP =
      decltype(cute::tile_to_shape(AtomP{}, cute::Shape<cute::Int<kHeads>, cute::Int<kBlockN>>{}));
};

// Named barriers of a consumer warpgroup (128 threads each), numbered as
// cutlass::arch::NamedBarrier numbers them (after its reserved ones).
struct GatherConsumerBarriers {
  uint32_t columns;     // ColumnSoftmax's exchange
  uint32_t p;           // a tile's P^T is in shared memory
  uint32_t gemms_done;  // every warp's GEMMs on the tiles are done (before the epilogue reuses
                        // shared memory they read)
};

// One consumer warpgroup over n_tiles K/V tiles of the pipeline (K_n, then V_n, from `read` on),
// thread `ct` (0 .. 127) of it. Q [kHeads, 256] is at q, the ring at kv (LayoutK / LayoutVt),
// P^T's buffer at p, ColumnSoftmax's exchange ([2][4][kHeads] floats) at red. Hooks:
// - wait_q(): returns once Q is in shared memory (called before the first GEMM, if any);
// - tile_stage(): the stage the next GEMM reads, once its tile is there (shared-memory A), or
//   (Tr::kRegisterA) tile_stage(a, stage): fills the thread's A fragment of K (a: uint32_t[16][4])
//   or V^T (a: uint32_t[4][4][4]) from a stage whose tile is there; the stage is released once
//   every warp has read it, before its GEMM;
// - mask(s, cs, n): sets to -inf the scores of tile n a column may not see (s and cs are the
//   thread's scores and their (key in tile, column) coordinates as (rows, columns) views);
// - epilogue(o, co, cs, inv_sum, lse): once every warp's GEMMs are done, the unnormalised O^T
//   fragment and its (feature, column) coordinates, and per column j of the thread (column
//   get<1>(cs(0, j))) the normaliser and the natural-log LSE (0 and -inf for a column that saw
//   nothing).
template <class Tr, class Pipe, class WaitQ, class TileStage, class Mask, class Epilogue>
__device__ __forceinline__ void gather_consume(const Pipe& pipe, typename Pipe::State& read,
                                               int n_tiles, typename Tr::Element_* q,
                                               typename Tr::Element_* kv, typename Tr::Element_* p,
                                               float* red, float scale_log2, int ct,
                                               GatherConsumerBarriers bar, WaitQ wait_q,
                                               TileStage tile_stage, Mask mask, Epilogue epilogue) {
  using namespace cute;
  using cute::Tensor;
  using Element = typename Tr::Element_;
  typename Tr::MmaS mma_s;
  typename Tr::MmaO mma_o;
  Tensor sQ = make_tensor(make_smem_ptr(q), typename Tr::LayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(kv), typename Tr::LayoutK{});
  Tensor sVt = make_tensor(make_smem_ptr(kv), typename Tr::LayoutVt{});
  Tensor sP = make_tensor(make_smem_ptr(p), typename Tr::LayoutP{});
  auto thr_s = mma_s.get_thread_slice(ct);
  auto thr_o = mma_o.get_thread_slice(ct);
  Tensor tSrK = thr_s.partition_fragment_A(sK);    // (MMA, 1, MMA_K, stage)
  Tensor tSrQ = thr_s.partition_fragment_B(sQ);    // (MMA, 1, MMA_K)
  Tensor tOrVt = thr_o.partition_fragment_A(sVt);  // (MMA, MMA_M, MMA_K, stage)
  Tensor tOrP = thr_o.partition_fragment_B(sP);    // (MMA, 1, MMA_K)
  // Register A (Tr::kRegisterA): K's and V^T's fragments, ((2, 2, 2), MMA_M, MMA_K) each, as
  // the 32-bit pairs tile_stage fills (GMMA's register A layout, sm90/gather.h).
  constexpr int kStepsS = Tr::kHeadDim / 16, kTilesO = Tr::kHeadDim / 64,
                kStepsO = Tr::kBlockN / 16;
  uint32_t a_k[Tr::kRegisterA ? kStepsS : 1][4];
  uint32_t a_v[Tr::kRegisterA ? kStepsO : 1][kTilesO][4];
  Tensor rK = make_tensor(make_rmem_ptr(reinterpret_cast<Element*>(&a_k[0][0])),
                          Layout<cute::Shape<cute::Shape<_2, _2, _2>, _1, Int<kStepsS>>>{});
  Tensor rVt =
      make_tensor(make_rmem_ptr(reinterpret_cast<Element*>(&a_v[0][0][0])),
                  Layout<cute::Shape<cute::Shape<_2, _2, _2>, Int<kTilesO>, Int<kStepsO>>>{});
  Tensor tSrS = partition_fragment_C(mma_s, select<0, 1>(typename Tr::TileS{}));
  Tensor tOrO = partition_fragment_C(mma_o, select<0, 1>(typename Tr::TileO{}));
  // (key in tile, column) of each score and (feature, column) of each output this thread holds;
  // a column j of either fragment is the same query column (one m64nN atom layout).
  Tensor tScS = thr_s.partition_C(make_identity_tensor(select<0, 1>(typename Tr::TileS{})));
  Tensor tOcO = thr_o.partition_C(make_identity_tensor(select<0, 1>(typename Tr::TileO{})));
  Tensor s_rc = make_tensor(tSrS.data(), sm90::accumulator_rows_cols(tSrS.layout()));
  Tensor cs_rc = make_tensor(tScS.data(), sm90::accumulator_rows_cols(tScS.layout()));
  Tensor o_rc = make_tensor(tOrO.data(), sm90::accumulator_rows_cols(tOrO.layout()));
  Tensor co_rc = make_tensor(tOcO.data(), sm90::accumulator_rows_cols(tOcO.layout()));
  constexpr int kCols = decltype(size<1>(s_rc))::value;

  // P^T goes to shared memory by stmatrix .trans, 16 columns a store. The scores of warp w are
  // 8 x 8 blocks (keys 16 w + 8 i .. + 7, columns 8 k .. + 7) in stmatrix's fragment layout:
  // s(i, 2 k + e) is the thread's (key 16 w + 8 i + lane / 4, column 8 k + 2 (lane % 4) + e).
  // A block lands transposed as 8 rows of P^T, one a column, its 8 keys 16 contiguous bytes of
  // the swizzled layout. Lane 8 m + c gives row c of block m of store q, where block m is
  // (i, k) = (m % 2, 2 q + m / 2); store q's rows lie 16 q rows (whole 8-row swizzle atoms,
  // 16 x 64 elements) past store 0's.
  static_assert(Tr::kHeads % 16 == 0 && kCols == Tr::kHeads / 4, "whole 4-block stores");
  constexpr int kStores = Tr::kHeads / 16;
  Element* const p_row = [&] {
    const int w = ct / 32, m = ct % 32 / 8, c = ct % 8;
    return &sP(8 * (m / 2) + c, 16 * w + 8 * (m % 2));
  }();
  cutlass::NumericArrayConverter<Element, float, 2> to_pair;
  auto pair = [&](float lo, float hi) {
    const cutlass::Array<Element, 2> v = to_pair(cutlass::Array<float, 2>{lo, hi});
    return reinterpret_cast<const uint32_t&>(v);
  };

  sm90::ColumnSoftmax<Tr::kHeads> softmax(scale_log2, red, bar.columns);
  clear(tOrO);
  if (n_tiles > 0) wait_q();
  for (int n = 0; n < n_tiles; ++n) {
    // ----- S^T = K_n Q^T ----------------------------------------------------------------------
    pipe.consumer_wait(read);
    if constexpr (Tr::kRegisterA) {
      tile_stage(a_k, read.index());
      __syncwarp();  // the warp's reads of the stage are done before its release
      pipe.consumer_release(read);
      ++read;
      sm90::warpgroup_gemm<true, 0>(mma_s, rK, tSrQ, tSrS);
      // V_n's fragment now, so that its shared-memory reads overlap the softmax.
      pipe.consumer_wait(read);
      tile_stage(a_v, read.index());
      __syncwarp();
      pipe.consumer_release(read);
      ++read;
    } else {
      sm90::warpgroup_gemm<true, 0>(mma_s, tSrK(_, _, _, tile_stage()), tSrQ, tSrS);
      pipe.consumer_release(read);
      ++read;
    }
    mask(s_rc, cs_rc, n);
    float rescale[kCols];
    softmax.update(s_rc, cs_rc, rescale);
    bool moved = false;
    CUTE_UNROLL
    for (int j = 0; j < kCols; ++j) moved = moved || rescale[j] != 1.f;
    if (moved) {
      CUTE_UNROLL
      for (int i = 0; i < size<0>(o_rc); ++i) {
        CUTE_UNROLL
        for (int j = 0; j < kCols; ++j) o_rc(i, j) *= rescale[j];
      }
    }
    // ----- P^T to shared memory, then O^T += V_n^T P^T --------------------------------------
    CUTE_UNROLL
    for (int q = 0; q < kStores; ++q) {
      cute::SM90_U16x8_STSM_T::copy(pair(s_rc(0, 4 * q), s_rc(0, 4 * q + 1)),
                                    pair(s_rc(1, 4 * q), s_rc(1, 4 * q + 1)),
                                    pair(s_rc(0, 4 * q + 2), s_rc(0, 4 * q + 3)),
                                    pair(s_rc(1, 4 * q + 2), s_rc(1, 4 * q + 3)),
                                    *reinterpret_cast<cute::uint128_t*>(p_row + 16 * 64 * q));
    }
    cutlass::arch::fence_view_async_shared();  // generic-proxy stores, then GMMA reads
    cutlass::arch::NamedBarrier::sync(128, bar.p);
    // Waited for (kWait 0) before the next tile: the single P^T buffer relies on it (LayoutP).
    if constexpr (Tr::kRegisterA) {
      sm90::warpgroup_gemm<false, 0>(mma_o, rVt, tOrP, tOrO);
    } else {
      pipe.consumer_wait(read);
      sm90::warpgroup_gemm<false, 0>(mma_o, tOrVt(_, _, _, tile_stage()), tOrP, tOrO);
      pipe.consumer_release(read);
      ++read;
    }
  }

  float inv_sum[kCols], lse[kCols];
  softmax.finalize(cs_rc, inv_sum, lse);
  cutlass::arch::NamedBarrier::sync(128, bar.gemms_done);
  epilogue(o_rc, co_rc, cs_rc, inv_sum, lse);
}

}  // namespace sparse_attn::cuda
