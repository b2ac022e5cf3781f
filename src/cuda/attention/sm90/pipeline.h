// The K/V pipeline between the producer and the consumer warpgroups: per stage a "full" mbarrier
// and an "empty" mbarrier (one arrival per consumer warpgroup, or per consumer warp with
// kConsumerThreads = 32). A TMA producer makes one arrival on "full" with the stage's transaction
// bytes (producer_acquire); a cp.async producer of kProducerArrivals threads waits for the stage
// (producer_wait) and each thread's copies arrive on "full" when they land (arrive_on_copies).
// Every arrival is CTA-local: CUTLASS's PipelineTmaAsync releases through cluster addressing (mapa
// to CTA rank 0), which reaches another CTA's barriers when the kernel is not launched as a cluster
// (measured: the releases never arrived and the producer waited forever). Built on CUTLASS's
// barrier primitives and PipelineState.
#pragma once

#include <cutlass/arch/barrier.h>

#include <cutlass/pipeline/sm90_pipeline.hpp>

namespace sparse_attn::cuda::sm90 {

// kThreads threads at named barrier kId (an enum value, numbered after CUTLASS's reserved ids as
// NamedBarrier numbers them), in the non-aligned form (barrier.sync): a producer's warps come
// from their spin waits, whose lanes leave one by one, and an aligned bar.sync needs a converged
// warp (synccheck found a divergent one at it even after a __syncwarp). The memory clobber keeps
// the compiler from moving shared-memory accesses across it (NamedBarrier's asm has none): what a
// barrier orders is shared memory that one side reads and the other then overwrites.
template <auto kId, int kThreads>
__device__ __forceinline__ void cta_sync() {
  constexpr uint32_t kHardwareId =
      static_cast<uint32_t>(kId) + cutlass::arch::NamedBarrier::ReservedNamedBarrierCount;
  static_assert(kHardwareId < 16, "the hardware has 16 named barriers");
  asm volatile("barrier.sync %0, %1;" : : "n"(kHardwareId), "n"(kThreads) : "memory");
}

// Stores 16 bytes at the offset of dst in the shared memory of cluster CTA `rank` (st.async),
// completing as transaction bytes on that CTA's mbarrier at the offset of `bar`: the receiver
// sees them once its barrier's phase completes, and the sender waits for nothing.
// (CuTe's store_shared_remote is this for 4 bytes, without the memory clobber.)
__device__ __forceinline__ void push_to_cluster_cta(void* dst, float4 v, uint64_t* bar,
                                                    uint32_t rank) {
  const auto remote = [rank](const void* at) {
    return cute::set_block_rank(cute::cast_smem_ptr_to_uint(at), rank);
  };
  asm volatile(
      "st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32 [%0], {%1, %2, %3, %4}, [%5];"
      :
      : "r"(remote(dst)), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w), "r"(remote(bar))
      : "memory");
}

template <int kStages, int kConsumers, int kProducerArrivals = 1, int kConsumerThreads = 128>
struct TmaPipeline {
  using State = cutlass::PipelineState<kStages>;
  using FullBarrier = cutlass::arch::ClusterTransactionBarrier;
  using EmptyBarrier = cutlass::arch::ClusterBarrier;

  struct SharedStorage {
    uint64_t full[kStages];
    uint64_t empty[kStages];
  };

  SharedStorage& s;
  uint32_t transaction_bytes;

  // One thread of the CTA, before the CTA-wide barrier that publishes the initialisation.
  __device__ static void init(SharedStorage& s) {
    for (int i = 0; i < kStages; ++i) {
      FullBarrier::init(&s.full[i], kProducerArrivals);
      EmptyBarrier::init(&s.empty[i], kConsumers);
    }
  }

  // The producer starts one phase ahead: every stage is free.
  __device__ static State producer_start() { return State{0, 1, 0}; }

  // TMA producer thread: wait until the stage is free, then announce its bytes.
  __device__ void producer_acquire(const State& st) const {
    producer_wait(st);
    FullBarrier::arrive_and_expect_tx(&s.full[st.index()], transaction_bytes);
  }
  __device__ void producer_wait(const State& st) const {
    EmptyBarrier::wait(&s.empty[st.index()], st.phase());
  }
  // cp.async producer thread, after issuing its copies of the stage: its arrival on "full"
  // fires when they have landed (noinc: the arrival is one of the kProducerArrivals).
  __device__ void arrive_on_copies(const State& st) const {
    cutlass::arch::cpasync_barrier_arrive_noinc(&s.full[st.index()]);
  }
  // Producer thread that wrote the stage itself (st.shared): its arrival on "full" releases
  // its stores (one of the kProducerArrivals).
  __device__ void arrive(const State& st) const { FullBarrier::arrive(&s.full[st.index()]); }
  __device__ uint64_t* full_barrier(const State& st) const { return &s.full[st.index()]; }

  // Consumers (whole warpgroups, or warps): wait for the stage's bytes; release it once the
  // consumer has read it (its first thread arrives, after the consumer's GEMMs on the stage
  // completed). The lanes leave the spin wait one by one: the warp reconverges before the
  // aligned instructions that follow (wgmma, bar.sync; synccheck reports a divergent warp at a
  // bar.sync otherwise).
  __device__ void consumer_wait(const State& st) const {
    FullBarrier::wait(&s.full[st.index()], st.phase());
    __syncwarp();
  }
  __device__ void consumer_release(const State& st) const {
    if (threadIdx.x % kConsumerThreads == 0) EmptyBarrier::arrive(&s.empty[st.index()]);
  }
};

}  // namespace sparse_attn::cuda::sm90
