// The two kernels of the native estimate (estimate.h) and their launch; instantiated once per
// (element type, groups per block) in instantiations/estimate_*.cu.
//
// Scores kernel: persistent CTAs (one per SM) walk the (batch, query head, 128-group query tile,
// 256-group key tile) tiles of the causal triangle, tile blockIdx.x + i * gridDim.x; every tile
// is the same work (stride * head_dim / 64 K steps), so the static order balances. The strided
// product score(g, j) = sum_t q[S g + S-1-t] . k[S j + t] is a GEMM whose K dimension runs over
// (t, 64-feature chunk): step (t, c) multiplies the Q rows S g + S-1-t and the K rows S j + t,
// features [64 c, 64 c + 64). One producer thread loads both with TMA (StridedRowsMap: rows S
// apart, zeros past the sequence) into a four-stage pipeline, running ahead into the next tile
// while the consumers finish one; two consumer warpgroups run SS GEMMs on it (64 query groups
// each). The epilogue turns each row's 256 scores into one base-2 log-sum-exp per key block
// (kGroupsPerBlock consecutive key groups) relative to the tile's row maximum, and stores them:
// 1 / kGroupsPerBlock of the score matrix, never the matrix.
//
// Sums kernel: one CTA per (batch, query head, query block): each row's log-sum-exp over all its
// key blocks (the softmax denominator), then per key block the sum over the block's rows of
// exp2(block lse - row lse): exactly the softmax mass of the (query block, key block) pair.
#pragma once

#include <cuda_runtime_api.h>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>

#include <algorithm>
#include <cute/arch/copy_sm90_tma.hpp>
#include <cute/tensor.hpp>

#include "cuda/attention/sm90/mma.h"
#include "cuda/attention/sm90/pipeline.h"
#include "cuda/attention/sm90/softmax.h"
#include "cuda/attention/sm90/traits.h"
#include "cuda/common/check.h"
#include "cuda/common/kernel_attributes.h"
#include "cuda/xattn/estimate.h"

namespace sparse_attn::cuda {

template <class Element, int kGroupsPerBlock>
struct EstimateTraits {
  static constexpr int kBlockM = kEstimateBlockM;
  static constexpr int kBlockN = kEstimateBlockN;
  static constexpr int kChunk = 64;  // features per K step: one 128-byte swizzle row
  static constexpr int kStages = 4;
  static constexpr int kSegments = kBlockN / kGroupsPerBlock;  // key blocks per key tile
  static_assert(kBlockN % kGroupsPerBlock == 0 && kSegments % 4 == 0,
                "a key tile is whole key blocks, split over a quad of threads");
  static constexpr int kProducerThreads = 128;  // a warpgroup (setmaxnreg), one thread loads
  static constexpr int kThreads = kProducerThreads + 256;
  // The consumers hold a 64 x 256 FP32 accumulator each.
  static constexpr int kProducerRegisters = 24;
  static constexpr int kConsumerRegisters = 240;
  static_assert(128 * kProducerRegisters + 256 * kConsumerRegisters <=
                kThreads * sm90::launched_registers(kThreads));
  static constexpr uint32_t kStageBytes = (kBlockM + kBlockN) * kChunk * sizeof(Element);

  using LayoutQ = typename sm90::KVStageLayouts<Element, kChunk, kBlockM, kStages>::LayoutK;
  using LayoutK = typename sm90::KVStageLayouts<Element, kChunk, kBlockN, kStages>::LayoutK;
  using Tile = cute::Shape<cute::Int<kBlockM>, cute::Int<kBlockN>, cute::Int<kChunk>>;
  using Mma =
      decltype(cute::make_tiled_mma(cute::GMMA::ss_op_selector<Element, Element, float, Tile>(),
                                    cute::Layout<cute::Shape<cute::_2, cute::_1, cute::_1>>{}));
  using Pipeline = sm90::TmaPipeline<kStages, 2, 1>;

  struct SharedStorage {
    alignas(1024) cute::array_aligned<Element, cute::cosize_v<LayoutQ>> q;
    alignas(1024) cute::array_aligned<Element, cute::cosize_v<LayoutK>> k;
    typename Pipeline::SharedStorage pipeline;
  };
  static constexpr int kSmemBytes = static_cast<int>(sizeof(SharedStorage));
  static_assert(kSmemBytes <= 227 * 1024, "exceeds the SM90 opt-in shared memory");
};

// Key groups visible to query group g (all of them without causal): those whose first key is not
// after the position of the group's last real row.
__device__ __forceinline__ int estimate_visible_groups(const XAttnEstimateKernelParams& p, int g) {
  if (!p.causal) return p.k_groups;
  const int last = p.offset + min(g * p.stride + p.stride - 1, p.q_len - 1);
  return min(last / p.stride + 1, p.k_groups);
}

// Tile `tile` of the launch: its (batch, query head) and its first query and key groups.
struct EstimateTile {
  int bh, b, h, g0, j0;
};
__device__ __forceinline__ EstimateTile estimate_tile(const XAttnEstimateKernelParams& p,
                                                      int tile) {
  const int per_head = p.tile_prefix[p.m_tiles];
  const int bh = tile / per_head, t = tile % per_head;
  int lo = 0, hi = p.m_tiles - 1;  // the query tile: the last mt with tile_prefix[mt] <= t
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (p.tile_prefix[mid] <= t) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return {bh, bh / p.num_q_heads, bh % p.num_q_heads, p.group0 + lo * kEstimateBlockM,
          (t - p.tile_prefix[lo]) * kEstimateBlockN};
}

// Features [col, col + 64) of the rows S g + t, g = g0 .., of one head into a 128-byte-swizzled
// tile: from the map whose groups hold row t (StridedRowsMap).
template <class Element>
__device__ __forceinline__ void load_strided_rows(const StridedRowsMap& m, uint64_t* bar,
                                                  Element* smem, int col, int t, int g0, int head,
                                                  int batch) {
  const bool full = t < m.full_rows;
  cute::SM90_TMA_LOAD_5D::copy(full ? &m.full : &m.partial, bar,
                               static_cast<uint64_t>(cute::TMA::CacheHintSm90::EVICT_NORMAL), smem,
                               col, t, g0 + (full ? 0 : m.partial_shift), head, batch);
}

// The producer thread: step (t, c) of every tile of this CTA into stage `step % kStages`.
template <class Traits>
__device__ void estimate_produce(const XAttnEstimateKernelParams& p,
                                 typename Traits::SharedStorage& ss,
                                 typename Traits::Pipeline& pipe) {
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kChunk = Traits::kChunk;
  const int chunks = p.head_dim / kChunk, steps = p.stride * chunks;
  const int tiles = p.batch_heads * p.tile_prefix[p.m_tiles];
  auto state = Traits::Pipeline::producer_start();
  for (int tile = static_cast<int>(blockIdx.x); tile < tiles; tile += gridDim.x) {
    const EstimateTile w = estimate_tile(p, tile);
    for (int step = 0; step < steps; ++step) {
      const int t = step / chunks, col = (step % chunks) * kChunk;
      pipe.producer_acquire(state);
      uint64_t* bar = pipe.full_barrier(state);
      load_strided_rows(p.tma_q, bar, ss.q.data() + state.index() * (kBlockM * kChunk), col,
                        p.stride - 1 - t, w.g0, w.h, w.b);  // inverse order within the group
      load_strided_rows(p.tma_k, bar, ss.k.data() + state.index() * (kBlockN * kChunk), col, t,
                        w.j0, w.h / p.group, w.b);
      ++state;
    }
  }
}

// n floats to a 4 n-byte aligned address, in 16-byte (or 8-byte) stores.
template <int kN>
__device__ __forceinline__ void store_floats(float* dst, const float (&v)[kN]) {
  if constexpr (kN % 4 == 0) {
    CUTE_UNROLL
    for (int i = 0; i < kN; i += 4) {
      *reinterpret_cast<float4*>(dst + i) = make_float4(v[i], v[i + 1], v[i + 2], v[i + 3]);
    }
  } else {
    static_assert(kN % 2 == 0);
    CUTE_UNROLL
    for (int i = 0; i < kN; i += 2)
      *reinterpret_cast<float2*>(dst + i) = make_float2(v[i], v[i + 1]);
  }
}

// A consumer warpgroup, per tile of its CTA: the GEMM over every step (one batch in flight while
// the next stage is awaited), then the per-key-block log-sum-exp of its 64 rows.
template <class Traits, int kGroupsPerBlock>
__device__ void estimate_consume(const XAttnEstimateKernelParams& p,
                                 typename Traits::SharedStorage& ss,
                                 typename Traits::Pipeline& pipe, int ct) {
  using namespace cute;
  using cute::Shape;  // not sparse_attn's (sparse_attn/tensor.h), where both are visible
  using cute::Tensor;
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN;
  typename Traits::Mma mma;
  Tensor sQ = make_tensor(make_smem_ptr(ss.q.data()), typename Traits::LayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(ss.k.data()), typename Traits::LayoutK{});
  auto thr = mma.get_thread_slice(ct);
  Tensor tSrQ = thr.partition_fragment_A(sQ);  // (MMA, MMA_M, MMA_K, stage)
  Tensor tSrK = thr.partition_fragment_B(sK);  // (MMA, MMA_N, MMA_K, stage)
  Tensor acc = partition_fragment_C(mma, Shape<Int<kBlockM>, Int<kBlockN>>{});
  const int steps = p.stride * (p.head_dim / Traits::kChunk);
  const int tiles = p.batch_heads * p.tile_prefix[p.m_tiles];

  typename Traits::Pipeline::State read;
  for (int tile = static_cast<int>(blockIdx.x); tile < tiles; tile += gridDim.x) {
    const EstimateTile w = estimate_tile(p, tile);
    const int g0 = w.g0, j0 = w.j0;
    pipe.consumer_wait(read);
    sm90::warpgroup_gemm<true, -1>(mma, tSrQ(_, _, _, read.index()), tSrK(_, _, _, read.index()),
                                   acc);
    auto prev = read;
    ++read;
    for (int step = 1; step < steps; ++step) {
      pipe.consumer_wait(read);
      sm90::warpgroup_gemm<false, -1>(mma, tSrQ(_, _, _, read.index()), tSrK(_, _, _, read.index()),
                                      acc);
      warpgroup_wait<1>();  // the previous step's GEMMs have read their stage
      pipe.consumer_release(prev);
      prev = read;
      ++read;
    }
    warpgroup_wait<0>();
    pipe.consumer_release(prev);
    float* lse = p.lse + static_cast<int64_t>(w.bh) * (p.group_end - p.group0) * p.lse_pitch;

    // ----- epilogue: per row, one base-2 log-sum-exp per key block of the tile ----------------
    // A thread holds two rows (8 apart) and, of each, columns 8 i + 2 (lane % 4) + {0, 1}: the
    // kGroupsPerBlock / 4 consecutive values s(r, e * kPer ..) are its part of key block e, and
    // the quad of threads sharing the row holds the rest.
    Tensor cS = thr.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
    Tensor s = make_tensor(acc.data(), sm90::accumulator_rows_cols(acc.layout()));
    Tensor c = make_tensor(cS.data(), sm90::accumulator_rows_cols(cS.layout()));
    constexpr int kCols = decltype(size<1>(s))::value;
    constexpr int kSeg = Traits::kSegments;
    constexpr int kPer = kCols / kSeg;
    static_assert(decltype(size<0>(s))::value == 2 && kCols == kBlockN / 4 &&
                  kPer == kGroupsPerBlock / 4);
    const int lane = ct % 32, b0 = lane & 1, b1 = (lane >> 1) & 1;
    CUTE_UNROLL
    for (int r = 0; r < 2; ++r) {
      const int g = g0 + get<0>(c(r, 0));
      const int limit = estimate_visible_groups(p, g) - j0;  // columns < limit are visible
      float mx = -INFINITY;
      CUTE_UNROLL
      for (int j = 0; j < kCols; ++j) {
        if (get<1>(c(r, j)) >= limit) s(r, j) = -INFINITY;
        mx = fmaxf(mx, s(r, j));
      }
      mx = sm90::OnlineSoftmax<2>::quad_max(mx);
      // A row that sees none of the tile: every weight is exp2(-inf) = 0 (its lse -inf).
      const float m = mx == -INFINITY ? 0.f : mx * p.scale_log2;
      float seg[kSeg];
      CUTE_UNROLL
      for (int e = 0; e < kSeg; ++e) {
        seg[e] = 0.f;
        CUTE_UNROLL
        for (int i = 0; i < kPer; ++i) {
          seg[e] += sm90::exp2_ftz(fmaf(s(r, e * kPer + i), p.scale_log2, -m));
        }
      }
      // Reduce-scatter over the quad: after two exchanges lane (b1 b0) holds the whole sums of
      // blocks b0 * kSeg / 2 + b1 * kSeg / 4 + [0, kSeg / 4), 3/4 of the shuffles of an
      // all-reduce saved.
      float half[kSeg / 2];
      CUTE_UNROLL
      for (int e = 0; e < kSeg / 2; ++e) {
        const float keep = b0 ? seg[e + kSeg / 2] : seg[e];
        const float give = b0 ? seg[e] : seg[e + kSeg / 2];
        half[e] = keep + __shfl_xor_sync(0xffffffffu, give, 1);
      }
      float quarter[kSeg / 4];
      CUTE_UNROLL
      for (int e = 0; e < kSeg / 4; ++e) {
        const float keep = b1 ? half[e + kSeg / 4] : half[e];
        const float give = b1 ? half[e] : half[e + kSeg / 4];
        quarter[e] = keep + __shfl_xor_sync(0xffffffffu, give, 2);
        quarter[e] = m + log2f(quarter[e]);  // log2(0) = -inf: a block the row does not see
      }
      if (g < p.group_end) {
        float* dst = lse + static_cast<int64_t>(g - p.group0) * p.lse_pitch + j0 / kGroupsPerBlock +
                     b0 * (kSeg / 2) + b1 * (kSeg / 4);
        store_floats(dst, quarter);
      }
    }
  }
}

template <class Element, int kGroupsPerBlock>
__global__ void __launch_bounds__(EstimateTraits<Element, kGroupsPerBlock>::kThreads, 1)
    xattn_estimate_scores_kernel(const __grid_constant__ XAttnEstimateKernelParams p) {
  using Traits = EstimateTraits<Element, kGroupsPerBlock>;
  extern __shared__ __align__(1024) char smem[];
  auto& ss = *reinterpret_cast<typename Traits::SharedStorage*>(smem);
  if (threadIdx.x == 0) {
    Traits::Pipeline::init(ss.pipeline);
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();
  typename Traits::Pipeline pipe{ss.pipeline, Traits::kStageBytes};

  if (threadIdx.x < Traits::kProducerThreads) {
    cutlass::arch::warpgroup_reg_dealloc<Traits::kProducerRegisters>();
    if (threadIdx.x == 0) estimate_produce<Traits>(p, ss, pipe);
  } else {
    cutlass::arch::warpgroup_reg_alloc<Traits::kConsumerRegisters>();
    estimate_consume<Traits, kGroupsPerBlock>(
        p, ss, pipe, static_cast<int>(threadIdx.x) - Traits::kProducerThreads);
  }
}

// One CTA per (batch, query head, query block of the chunk).
template <int kGroupsPerBlock>
__global__ void __launch_bounds__(256)
    xattn_estimate_sums_kernel(const __grid_constant__ XAttnEstimateKernelParams p) {
  __shared__ float row_lse[kGroupsPerBlock];
  __shared__ int row_blocks[kGroupsPerBlock];
  const int bh = static_cast<int>(blockIdx.x) / p.chunk_q_blocks;
  const int qb = p.q_block0 + static_cast<int>(blockIdx.x) % p.chunk_q_blocks;
  const int g_first = qb * kGroupsPerBlock;
  const int rows = min(kGroupsPerBlock, p.q_groups - g_first);
  const float* lse =
      p.lse +
      (static_cast<int64_t>(bh) * (p.group_end - p.group0) + (g_first - p.group0)) * p.lse_pitch;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int r = warp; r < rows; r += 8) {
    const int blocks =
        (estimate_visible_groups(p, g_first + r) + kGroupsPerBlock - 1) / kGroupsPerBlock;
    const float* x = lse + static_cast<int64_t>(r) * p.lse_pitch;
    float mx = -INFINITY;
    for (int kb = lane; kb < blocks; kb += 32) mx = fmaxf(mx, x[kb]);
    for (int o = 16; o > 0; o /= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    const float m = mx == -INFINITY ? 0.f : mx;
    float sum = 0.f;
    for (int kb = lane; kb < blocks; kb += 32) sum += exp2f(x[kb] - m);
    for (int o = 16; o > 0; o /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    if (lane == 0) {
      row_lse[r] = m + log2f(sum);
      row_blocks[r] = blocks;
    }
  }
  __syncthreads();
  const int b = bh / p.num_q_heads, h = bh % p.num_q_heads;
  float* out = p.attn_sums + b * p.sums_stride[0] + h * p.sums_stride[1] + qb * p.sums_stride[2];
  for (int kb = threadIdx.x; kb < p.k_blocks; kb += blockDim.x) {
    float sum = 0.f;
    for (int r = 0; r < rows; ++r) {
      if (kb < row_blocks[r])
        sum += exp2f(lse[static_cast<int64_t>(r) * p.lse_pitch + kb] - row_lse[r]);
    }
    out[kb * p.sums_stride[3]] = sum;
  }
}

template <class Element, int kGroupsPerBlock>
void launch_xattn_estimate(const XAttnEstimateKernelParams& p, int64_t batch_heads, int sms,
                           cudaStream_t stream) {
  using Traits = EstimateTraits<Element, kGroupsPerBlock>;
  constexpr auto scores = xattn_estimate_scores_kernel<Element, kGroupsPerBlock>;
  opt_in_shared_memory<scores>(Traits::kSmemBytes);
  const int64_t tiles = batch_heads * p.tile_prefix[p.m_tiles];
  scores<<<static_cast<unsigned>(std::min<int64_t>(tiles, sms)), Traits::kThreads,
           Traits::kSmemBytes, stream>>>(p);
  SPARSE_ATTN_CUDA_CHECK_LAUNCH();
  xattn_estimate_sums_kernel<kGroupsPerBlock>
      <<<static_cast<unsigned>(batch_heads * p.chunk_q_blocks), 256, 0, stream>>>(p);
  SPARSE_ATTN_CUDA_CHECK_LAUNCH();
}

}  // namespace sparse_attn::cuda
