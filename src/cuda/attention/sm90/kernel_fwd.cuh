// The SM90 attention forward kernel shell: warp specialisation, the K/V pipelines, the consumer
// main loop (S = Q K^T and O += P V on GMMA, the softmax of tile n overlapped with the P V of
// tile n - 1, the two consumer warpgroups taking turns to issue GEMMs), the epilogue, and the
// persistent launch (sm90/scheduler.h), whose producer runs up to one work item ahead of the
// consumers.
//
// What varies between attention ops is the Problem (a CTA's rows and keys, the tiles it visits
// and how they are loaded, the score mask, where O and the LSE go); everything here is shared.
// A Problem provides, for one work item (a CTA's rows, or one of a persistent CTA's items):
//   kSharedBytes                       shared memory of its own, after the core's
//   kPersistent                        false: one CTA per work item, Problem(params, blockIdx.x,
//                                      shared) built by every thread of the CTA (it may run
//                                      CTA-wide collectives and use `shared`). true: one CTA per
//                                      SM walks the items (sm90/scheduler.h); the producer warp
//                                      and every consumer thread build Problem(params, item)
//                                      on their own, each at its own item, and the Problem
//                                      provides static work_items(params) and
//                                      work_counter(params) (an int32 zero at launch)
//   bool has_rows()                    the item owns query rows (uniform over the builders)
//   kGatherProducer                    false: warp 0 runs the TMA producer below with load_q,
//                                      load_k and load_v; true: the whole producer warpgroup
//                                      runs prob.produce<Traits>(ss, pipe_k, pipe_v) instead
//   TileIterator tiles()               warp-collective iterator over K/V tile indices (the
//                                      Problem's order: block-sparse descending)
//   void load_q(smem, mbar)            issue the Q tile's copies (one thread)
//   void load_k / load_v(n, smem, mbar, leader)
//                                      tile n's copies (warp-collective: lanes look pages up,
//                                      the leader issues)
//   int keys()                         keys of the row's sequence: tile rows past it are masked
//                                      and their V rows zeroed (only the first tile may reach
//                                      past it); INT_MAX where the producer zero-fills them
//   void mask_scores(n, s, coords, first_row)
//                                      mask (or bias) tile n's scores s of the warpgroup whose
//                                      first CTA row is first_row; s and coords are the
//                                      accumulator seen as (rows, columns) and each score's
//                                      (CTA row, key in tile)
//   float scale_log2()                 softmax scale in log2 units
//   bool row_in_range(row)             CTA row `row` is a real query row (written)
//   void store_o(row, col, uint4)      8 output elements of a real row; persistent Problems
//                                      take 2 at a time (uint32_t) instead, from registers,
//                                      since Q's smem already holds the next item's Q
//   void store_lse(row, float)
//   bool split_output()                the CTA is one key split of its rows (CTA-uniform):
//                                      the epilogue writes FP32 partials instead, through
//   void store_o_partial(row, col, float) / store_lse_partial(row, float)
#pragma once

#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>

#include <cute/tensor.hpp>

#include "cuda/attention/sm90/mma.h"
#include "cuda/attention/sm90/scheduler.h"
#include "cuda/attention/sm90/softmax.h"
#include "cuda/attention/sm90/traits.h"

namespace sparse_attn::cuda::sm90 {

__device__ __forceinline__ void named_sync(FwdBarrier b, int offset = 0, int threads = 128) {
  cutlass::arch::NamedBarrier::sync(threads, static_cast<uint32_t>(b) + offset);
}

// Where a CTA's producer and consumers are in the K/V pipelines and in the Q loads: carried
// from one work item to the next by a persistent CTA.
template <class Traits>
struct ProducerPosition {
  typename Traits::PipelineState k = Traits::Pipeline::producer_start();
  typename Traits::PipelineState v = Traits::Pipeline::producer_start();
  int q_loads = 0;
};
template <class Traits>
struct ConsumerPosition {
  typename Traits::PipelineState k, v;
  int q_loads = 0;
};

// ----- producer: one warp loads an item's Q once and K, V per tile, V one tile behind K (the
// consumer needs K of tile n and V of tile n - 1 at the same step) ----------------------------
template <class Traits, class Problem>
__device__ void produce(Problem& prob, typename Traits::SharedStorage& ss,
                        typename Traits::Pipeline& pipe_k, typename Traits::Pipeline& pipe_v,
                        ProducerPosition<Traits>& pos) {
  using Pipeline = typename Traits::Pipeline;
  const bool leader = threadIdx.x == 0;
  auto it = prob.tiles();
  int n;
  if (!it.next(n)) return;  // nothing visible: the consumers write zeros without waiting
  if (leader) {
    // The previous item's Q stays until both consumers' last S GEMM of it completed.
    if (pos.q_loads > 0) ss.barrier_q_free.wait((pos.q_loads - 1) & 1);
    ss.barrier_q.arrive_and_expect_tx(Traits::kQBytes);
    prob.load_q(ss.q.data(), reinterpret_cast<uint64_t*>(&ss.barrier_q));
  }
  ++pos.q_loads;
  constexpr int kStageElems = Traits::kBlockN * Traits::kHeadDim;
  auto load = [&](Pipeline& pipe, auto& state, int tile, bool is_v) {
    if (leader) pipe.producer_acquire(state);
    uint64_t* bar = pipe.full_barrier(state);
    auto* base = (is_v ? ss.v.data() : ss.k.data()) + state.index() * kStageElems;
    if (is_v) {
      prob.load_v(tile, base, bar, leader);
    } else {
      prob.load_k(tile, base, bar, leader);
    }
    ++state;
  };
  load(pipe_k, pos.k, n, false);
  int prev = n;
  while (it.next(n)) {
    load(pipe_k, pos.k, n, false);
    load(pipe_v, pos.v, prev, true);
    prev = n;
  }
  load(pipe_v, pos.v, prev, true);
}

// ----- epilogues: O (normalised) and the LSE of a warpgroup's rows -------------------------
// From the registers, each thread's column pairs, 4 bytes a store (a quad of threads writes 16
// contiguous bytes of a row): a persistent CTA's Q smem already holds the next item's Q.
template <class Traits, class Problem, class ThrMma, class Accumulator>
__device__ void store_o_from_registers(Problem& prob, ThrMma& thr_pv, Accumulator& tOrO,
                                       const float (&lse)[2]) {
  using namespace cute;
  using cute::Tensor;  // not sparse_attn's (sparse_attn/tensor.h), where both are visible
  using Element = typename Traits::Element;
  Tensor tOcO = thr_pv.partition_C(make_identity_tensor(select<0, 1>(typename Traits::TilePV{})));
  Tensor tOcO_rc = make_tensor(tOcO.data(), accumulator_rows_cols(tOcO.layout()));
  Tensor tOrO_rc = make_tensor(tOrO.data(), accumulator_rows_cols(tOrO.layout()));
  cutlass::NumericArrayConverter<Element, float, 2> convert;
  CUTE_UNROLL
  for (int i = 0; i < size<0>(tOrO_rc); ++i) {
    const int row = get<0>(tOcO_rc(i, 0));
    if (!prob.row_in_range(row)) continue;
    CUTE_UNROLL
    for (int j = 0; j < size<1>(tOrO_rc); j += 2) {
      cutlass::Array<float, 2> pair;
      pair[0] = tOrO_rc(i, j);
      pair[1] = tOrO_rc(i, j + 1);
      const cutlass::Array<Element, 2> out = convert(pair);
      prob.store_o(row, get<1>(tOcO_rc(i, j)), reinterpret_cast<const uint32_t&>(out));
    }
    if (get<1>(tOcO_rc(i, 0)) == 0) prob.store_lse(row, lse[i]);
  }
}

// Through Q's smem (this warpgroup's rows), 16 bytes a store: a CTA of one work item.
template <class Traits, class Problem, class TiledMma, class Accumulator, class Coords>
__device__ void store_o_through_smem(Problem& prob, typename Traits::SharedStorage& ss,
                                     TiledMma& mma_pv, Accumulator& tOrO, Coords& tScS_rc,
                                     const float (&lse)[2], int ct) {
  using namespace cute;
  using cute::Tensor;
  using Element = typename Traits::Element;
  constexpr int kHeadDim = Traits::kHeadDim;
  const int wg = ct / 128;
  const int first_row = 64 * wg;
  Tensor rO = make_tensor_like<Element>(tOrO);
  convert_fragment(tOrO, rO);
  auto store_o = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, mma_pv);
  auto thr_store = store_o.get_thread_slice(ct);
  Tensor sO = make_tensor(make_smem_ptr(ss.q.data()), typename Traits::LayoutQ{});
  copy(store_o, thr_store.retile_S(rO), thr_store.partition_D(sO));
  named_sync(FwdBarrier::kEpilogueWG1, wg);
  constexpr int kChunks = kHeadDim / 8;  // 16-byte pieces of a row
  for (int c = ct % 128; c < 64 * kChunks; c += 128) {
    const int row = first_row + c / kChunks, col = (c % kChunks) * 8;
    if (prob.row_in_range(row)) {
      prob.store_o(row, col, *reinterpret_cast<const uint4*>(&sO(row, col)));
    }
  }
  CUTE_UNROLL
  for (int i = 0; i < 2; ++i) {
    const int row = get<0>(tScS_rc(i, 0));
    if (get<1>(tScS_rc(i, 0)) == 0 && prob.row_in_range(row)) prob.store_lse(row, lse[i]);
  }
}

// ----- consumers ----------------------------------------------------------------------------
template <class Traits, class Problem>
__device__ void consume(Problem& prob, typename Traits::SharedStorage& ss,
                        typename Traits::Pipeline& pipe_k, typename Traits::Pipeline& pipe_v,
                        ConsumerPosition<Traits>& pos, int ct) {
  using namespace cute;
  using cute::Shape;  // not sparse_attn's (sparse_attn/tensor.h), where both are visible
  using cute::Tensor;
  using Element = typename Traits::Element;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kHeadDim = Traits::kHeadDim;
  const int wg = ct / 128;  // consumer warpgroup: CTA rows [64 wg, 64 wg + 64)

  typename Traits::MmaQK mma_qk;
  typename Traits::MmaPV mma_pv;
  Tensor sQ = make_tensor(make_smem_ptr(ss.q.data()), typename Traits::LayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(ss.k.data()), typename Traits::LayoutK{});
  Tensor sVt = make_tensor(make_smem_ptr(ss.v.data()), typename Traits::LayoutVt{});
  auto thr_qk = mma_qk.get_thread_slice(ct);
  auto thr_pv = mma_pv.get_thread_slice(ct);
  Tensor tSrQ = thr_qk.partition_fragment_A(sQ);    // smem descriptors, this warpgroup's rows
  Tensor tSrK = thr_qk.partition_fragment_B(sK);    // (MMA, MMA_N, MMA_K, stage)
  Tensor tOrVt = thr_pv.partition_fragment_B(sVt);  // (MMA, MMA_N, MMA_K, stage)
  Tensor tSrS = partition_fragment_C(mma_qk, select<0, 1>(typename Traits::TileQK{}));
  Tensor tOrO = partition_fragment_C(mma_pv, select<0, 1>(typename Traits::TilePV{}));
  // (CTA row, key in tile) of each score this thread holds.
  Tensor tScS = thr_qk.partition_C(make_identity_tensor(select<0, 1>(typename Traits::TileQK{})));
  Tensor tOrP = make_tensor<Element>(accumulator_as_a_operand(tSrS.layout()));
  Tensor tSrS_as_a = make_tensor(tSrS.data(), accumulator_as_a_operand(tSrS.layout()));

  OnlineSoftmax<2> softmax(prob.scale_log2());
  float rescale[2];
  clear(tOrO);
  const int first_row = 64 * wg;

  Tensor tScS_rc = make_tensor(tScS.data(), accumulator_rows_cols(tScS.layout()));
  Tensor tSrS_rc = make_tensor(tSrS.data(), accumulator_rows_cols(tSrS.layout()));
  auto mask_scores = [&](int n) { prob.mask_scores(n, tSrS_rc, tScS_rc, first_row); };
  // A gathering producer's copies land through the generic proxy: after a stage's wait, and
  // before GMMA reads it through the async proxy.
  auto fence_loads = [] {
    if constexpr (Traits::kGenericProxyLoads) cutlass::arch::fence_view_async_shared();
  };

  // A persistent CTA's producer loads the next item's Q as soon as this item's S GEMMs are done
  // (the epilogue then stores O from registers, not through Q's smem).
  auto release_q = [&] {
    if constexpr (Problem::kPersistent) {
      if (ct % 128 == 0) ss.barrier_q_free.arrive();
    }
  };

  auto it = prob.tiles();
  int n;
  if (it.next(n)) {
    auto& read_k = pos.k;
    auto& read_v = pos.v;
    ss.barrier_q.wait(pos.q_loads++ & 1);
    // ----- tile 0: S = Q K^T, softmax -------------------------------------------------------
    pipe_k.consumer_wait(read_k);
    fence_loads();
    warpgroup_gemm<true, 0>(mma_qk, tSrQ, tSrK(_, _, _, read_k.index()), tSrS);
    pipe_k.consumer_release(read_k);
    ++read_k;
    mask_scores(n);
    softmax.update(tSrS, rescale, [](float) {});
    convert_fragment(tSrS_as_a, tOrP);
    // Only the first tile (the highest) can reach past the sequence's keys. Its V rows there
    // may hold anything (another sequence, an unused page slot, NaN): their weights are 0, but
    // 0 * NaN is not, so both consumers zero them before the first P V.
    const int keys = prob.keys();
    if ((n + 1) * kBlockN > keys) {
      pipe_v.consumer_wait(read_v);
      Element* v = ss.v.data() + read_v.index() * kBlockN * kHeadDim;
      Tensor sV = make_tensor(make_smem_ptr(v), take<0, 2>(typename Traits::LayoutVt{}));
      const int first_zero = max(0, keys - n * kBlockN);
      for (int i = ct; i < (kBlockN - first_zero) * kHeadDim; i += Traits::kConsumerThreads) {
        sV(i % kHeadDim, first_zero + i / kHeadDim) = Element(0.f);
      }
      cutlass::arch::fence_view_async_shared();  // generic stores, then GMMA reads
      named_sync(FwdBarrier::kZeroV, 0, Traits::kConsumerThreads);
    }

    int n_next;
    bool more = it.next(n_next);
    if (!more) release_q();  // tile 0's S GEMM was waited for
    // The turn-taking barriers: warpgroup 0 issues first (its own barrier starts one arrival
    // ahead); each warpgroup hands the turn to the other after issuing its GEMMs, except
    // warpgroup 1 at the last step, so that every arrival is consumed. In a persistent CTA,
    // warpgroup 0 must not make that first arrival before warpgroup 1's last wait of its
    // previous item: both meet here, after tile 0, by when warpgroup 1 is past it.
    if constexpr (Problem::kPersistent) {
      if (more) named_sync(FwdBarrier::kItemStart, 0, Traits::kConsumerThreads);
    }
    if (more && wg == 0) {
      cutlass::arch::NamedBarrier::arrive(Traits::kConsumerThreads,
                                          static_cast<uint32_t>(FwdBarrier::kSchedulerWG1));
    }
    while (more) {
      n = n_next;
      // ----- S = Q K_n^T and O += P_{n-1} V_{n-1}, both in flight ---------------------------
      pipe_k.consumer_wait(read_k);
      fence_loads();
      named_sync(FwdBarrier::kSchedulerWG1, wg, Traits::kConsumerThreads);
      warpgroup_gemm<true, -1>(mma_qk, tSrQ, tSrK(_, _, _, read_k.index()), tSrS);
      // The next tile index (a serial chain, and on a new chunk of blocks a load) while the
      // tensor pipe works on S, not between the softmax and the next GEMMs.
      more = it.next(n_next);
      // O to the row maxima the previous softmax moved to (P_{n-1} is relative to them) before
      // P V adds to it: in the shadow of the S GEMM just issued, not after the P V wait.
      if (OnlineSoftmax<2>::any_moved(rescale)) OnlineSoftmax<2>::scale_rows(tOrO, rescale);
      pipe_v.consumer_wait(read_v);
      fence_loads();
      warpgroup_gemm<false, -1>(mma_pv, tOrP, tOrVt(_, _, _, read_v.index()), tOrO);
      if (wg == 0 || more) {
        cutlass::arch::NamedBarrier::arrive(
            Traits::kConsumerThreads, static_cast<uint32_t>(FwdBarrier::kSchedulerWG1) + 1 - wg);
      }
      // ----- softmax of tile n while P V runs -----------------------------------------------
      // ptxas places the wait for this warpgroup's P V at the top of the softmax's block
      // unless an mbarrier arrive stands in its way; it moves an arrive that depends on
      // nothing up to that top as well. So K is released from inside the softmax, predicated
      // on row 0's weight sum (never all-ones bits: FADD's NaN is 0x7fffffff), which pins the
      // arrive, and the wait behind it, after row 0's exponentials.
      warpgroup_wait<1>();
      if (!more) release_q();
      mask_scores(n);
      softmax.update(tSrS, rescale, [&](float row0_sum) {
        if (__float_as_uint(row0_sum) != 0xffffffffu) pipe_k.consumer_release(read_k);
      });
      ++read_k;
      warpgroup_wait<0>();
      pipe_v.consumer_release(read_v);
      ++read_v;
      convert_fragment(tSrS_as_a, tOrP);
    }
    // ----- the last P V --------------------------------------------------------------------
    if (OnlineSoftmax<2>::any_moved(rescale)) OnlineSoftmax<2>::scale_rows(tOrO, rescale);
    pipe_v.consumer_wait(read_v);
    fence_loads();
    warpgroup_gemm<false, 0>(mma_pv, tOrP, tOrVt(_, _, _, read_v.index()), tOrO);
    pipe_v.consumer_release(read_v);
    ++read_v;
  }

  // ----- epilogue: normalise; FP32 partials (SplitKV), or O and the LSE -------------------
  float inv_sum[2], lse[2];
  softmax.finalize(inv_sum, lse);
  OnlineSoftmax<2>::scale_rows(tOrO, inv_sum);
  if (prob.split_output()) {
    // FP32 partials for the merge, straight from the accumulators: a thread's columns come in
    // adjacent pairs, so a quad of threads writes 32 contiguous bytes of a row.
    Tensor tOcO = thr_pv.partition_C(make_identity_tensor(select<0, 1>(typename Traits::TilePV{})));
    Tensor tOcO_rc = make_tensor(tOcO.data(), accumulator_rows_cols(tOcO.layout()));
    Tensor tOrO_rc = make_tensor(tOrO.data(), accumulator_rows_cols(tOrO.layout()));
    CUTE_UNROLL
    for (int i = 0; i < size<0>(tOrO_rc); ++i) {
      const int row = get<0>(tOcO_rc(i, 0));
      if (!prob.row_in_range(row)) continue;
      CUTE_UNROLL
      for (int j = 0; j < size<1>(tOrO_rc); ++j) {
        prob.store_o_partial(row, get<1>(tOcO_rc(i, j)), tOrO_rc(i, j));
      }
      if (get<1>(tOcO_rc(i, 0)) == 0) prob.store_lse_partial(row, lse[i]);
    }
    return;
  }
  if constexpr (Problem::kPersistent) {
    store_o_from_registers<Traits>(prob, thr_pv, tOrO, lse);
  } else {
    store_o_through_smem<Traits>(prob, ss, mma_pv, tOrO, tScS_rc, lse, ct);
  }
}

// ----- persistent CTAs: the producer warp and the consumers walk the items the scheduler hands
// out (sm90/scheduler.h), each building its own Problem for an item --------------------------
template <class Traits, class Problem>
__device__ void produce_items(const typename Problem::Params& params,
                              typename Traits::SharedStorage& ss, typename Traits::Pipeline& pipe_k,
                              typename Traits::Pipeline& pipe_v,
                              const typename Traits::WorkRing& ring) {
  ProducerPosition<Traits> pos;
  auto slot = Traits::WorkRing::producer_start();
  const int items = Problem::work_items(params);
  int item = static_cast<int>(blockIdx.x);
  for (;;) {
    if (threadIdx.x == 0) ring.push(slot, item);
    if (item >= items) return;
    Problem prob(params, item);
    if (prob.has_rows()) produce<Traits>(prob, ss, pipe_k, pipe_v, pos);
    // Claimed once this item's copies are issued: the producer is then a few tiles ahead of the
    // consumers, and the atomic's round trip does not delay the item's first loads.
    int next = 0;
    if (threadIdx.x == 0) next = claim_work_item(Problem::work_counter(params));
    item = __shfl_sync(0xffffffff, next, 0);
  }
}

template <class Traits, class Problem>
__device__ void consume_items(const typename Problem::Params& params,
                              typename Traits::SharedStorage& ss, typename Traits::Pipeline& pipe_k,
                              typename Traits::Pipeline& pipe_v,
                              const typename Traits::WorkRing& ring, int ct) {
  ConsumerPosition<Traits> pos;
  typename Traits::WorkRing::State slot;
  const int items = Problem::work_items(params);
  for (;;) {
    const int item = ring.pop(slot);
    if (item >= items) return;
    Problem prob(params, item);
    if (prob.has_rows()) consume<Traits>(prob, ss, pipe_k, pipe_v, pos, ct);
  }
}

// Dynamic shared memory of a launch: the core's storage, then the Problem's.
template <class Traits, class Problem>
constexpr int fwd_smem_bytes() {
  constexpr int kBytes = Traits::kSmemBytes + Problem::kSharedBytes;
  static_assert(kBytes <= 227 * 1024, "exceeds the SM90 opt-in shared memory");
  return kBytes;
}

template <class Traits, class Problem>
__global__ void __launch_bounds__(Traits::kThreads, 1)
    attention_fwd_kernel(const __grid_constant__ typename Problem::Params params) {
  using Pipeline = typename Traits::Pipeline;
  // 1024-byte aligned: a gathering producer writes the 128-byte swizzle by offset, GMMA reads it
  // by address.
  extern __shared__ __align__(1024) char smem[];
  auto& ss = *reinterpret_cast<typename Traits::SharedStorage*>(smem);
  const int warp = cutlass::canonical_warp_idx_sync();
  const int warpgroup = warp / 4;
  auto init = [&] {
    if (threadIdx.x == 0) {
      ss.barrier_q.init(Traits::kProducerArrivals);
      ss.barrier_q_free.init(Traits::kConsumerWarpgroups);
      Pipeline::init(ss.pipeline_k);
      Pipeline::init(ss.pipeline_v);
      Traits::WorkRing::init(ss.work);
      cutlass::arch::fence_barrier_init();
    }
    __syncthreads();
  };

  if constexpr (Problem::kPersistent) {
    init();
    Pipeline pipe_k{ss.pipeline_k, Traits::kTileBytes}, pipe_v{ss.pipeline_v, Traits::kTileBytes};
    const typename Traits::WorkRing ring(ss.work);
    if (warpgroup == 0) {
      cutlass::arch::warpgroup_reg_dealloc<Traits::kProducerRegisters>();
      if (warp == 0) produce_items<Traits, Problem>(params, ss, pipe_k, pipe_v, ring);
    } else {
      cutlass::arch::warpgroup_reg_alloc<Traits::kConsumerRegisters>();
      consume_items<Traits, Problem>(params, ss, pipe_k, pipe_v, ring,
                                     static_cast<int>(threadIdx.x) - 128);
    }
  } else {
    Problem prob(params, blockIdx.x, smem + Traits::kSmemBytes);
    if (!prob.has_rows()) return;
    init();
    Pipeline pipe_k{ss.pipeline_k, Traits::kTileBytes}, pipe_v{ss.pipeline_v, Traits::kTileBytes};
    if (warpgroup == 0) {
      cutlass::arch::warpgroup_reg_dealloc<Traits::kProducerRegisters>();
      if constexpr (Problem::kGatherProducer) {
        prob.template produce<Traits>(ss, pipe_k, pipe_v);
      } else if (warp == 0) {
        ProducerPosition<Traits> pos;
        produce<Traits>(prob, ss, pipe_k, pipe_v, pos);
      }
    } else {
      cutlass::arch::warpgroup_reg_alloc<Traits::kConsumerRegisters>();
      ConsumerPosition<Traits> pos;
      consume<Traits>(prob, ss, pipe_k, pipe_v, pos, static_cast<int>(threadIdx.x) - 128);
    }
  }
}

}  // namespace sparse_attn::cuda::sm90
