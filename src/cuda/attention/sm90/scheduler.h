// The persistent tile scheduler of the SM90 attention kernel. A persistent launch has one CTA
// per SM (at most one per work item); CTA c starts with work item c, and each further item is
// claimed from a global counter (zero at launch), so the items go out in the Problem's order
// (heaviest first) to whichever CTA frees up first, as the hardware's own dispatch of one CTA
// per item would, without a CTA's start and end between two items.
//
// The producer warp claims items and passes their ids to the consumer warps through a ring of
// two slots in shared memory: it runs up to one item ahead, so the next item's Q and first K/V
// tiles load while the consumers finish this one. An id >= the item count ends the CTA.
#pragma once

#include <cstdint>

#include "cuda/attention/sm90/pipeline.h"

namespace sparse_attn::cuda::sm90 {

template <int kConsumerThreads>
struct WorkRing {
  // A slot is "full" after the producer's one arrival and "empty" after every consumer thread's
  // (each after its own read of the slot: one arrival a warp after a __syncwarp would order the
  // other lanes' reads before the producer's next write only transitively, which racecheck
  // does not follow).
  using Pipeline = TmaPipeline<2, kConsumerThreads, 1, 1>;
  using State = typename Pipeline::State;

  struct SharedStorage {
    typename Pipeline::SharedStorage barriers;
    int32_t item[2];
  };

  Pipeline pipe;
  int32_t* item;

  __device__ explicit WorkRing(SharedStorage& s) : pipe{s.barriers, 0}, item(s.item) {}
  __device__ static void init(SharedStorage& s) { Pipeline::init(s.barriers); }
  __device__ static State producer_start() { return Pipeline::producer_start(); }

  // One producer thread: the slot's store is released to the consumers by the arrival.
  __device__ void push(State& st, int32_t id) const {
    pipe.producer_wait(st);
    item[st.index()] = id;
    pipe.arrive(st);
    ++st;
  }
  // Every consumer thread (st starts default-constructed). The id comes back through a shuffle
  // from lane 0, which the compiler knows to be warp-uniform: what the Problem derives from it
  // then lives in uniform registers, as blockIdx.x's derivatives do.
  __device__ int32_t pop(State& st) const {
    pipe.consumer_wait(st);
    const int32_t id = item[st.index()];
    pipe.consumer_release(st);
    ++st;
    return __shfl_sync(0xffffffff, id, 0);
  }
};

// The next item for a CTA of a persistent launch: items below gridDim.x are the CTAs' first.
__device__ __forceinline__ int32_t claim_work_item(int32_t* counter) {
  return static_cast<int32_t>(gridDim.x) + atomicAdd(counter, 1);
}

}  // namespace sparse_attn::cuda::sm90
