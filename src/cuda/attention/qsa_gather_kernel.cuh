// QSA sparse attention one row at a time: decode rows, the prefill row tiles the union kernel
// leaves (independent selections, qsa_union_problem.cuh), and token-id prefill rows, whose
// shared blocks it reads again from L2 (that beat sharing them among a CTA's rows:
// docs/perf-notes.md, sessions 39 and 40). A CTA attends one query row for one KV head,
// gathering the row's own selected tokens.
//
// Such a row's cost is its bytes (2051 tokens x 1 KB of K and V per KV head at the seed's
// shape), so the kernel is built to keep the gather going: a producer warpgroup copies each
// 64-token K or V tile with cp.async into a ring of stages that K and V tiles share (K_0, V_0,
// K_1, ...) while the consumer warpgroup computes, two CTAs per SM.
//
// The consumer works transposed, with the keys in M (qsa_gather_consumer.cuh): S^T = K Q^T
// (M = 64 keys, N = 16 query heads of the KV head, 12 of them real at 24/2) and O^T += V^T P^T.
// Packing the heads into M instead would leave 52 of its 64 rows empty; here a quarter of N is.
//
// The row's index entries (the block hint's blocks plus the tail entry, or token ids) are
// resolved once per CTA into the valid entries in their order; valid entry v fills token slots
// per_entry * v .. (4 a block, 1 a token), a prefix of them valid (the causal limit, the KV
// length and the page all cut a block from its end). Duplicates stay separate entries, so each
// counts as often as it is listed (docs/qsa.md). K/V tile n holds slots 64 n .. 64 n + 63,
// zero-filled where a slot holds no token, whose scores are masked (a bitmask of the slots).
// The slots' physical keys are staged in the idle K/V ring and each producer thread takes the
// keys of the rows it copies into registers, one a tile, before the first copy: 2112 slots'
// keys would not fit beside the ring in the two-CTAs-an-SM budget.
//
// SplitKV (x.num_splits = S > 1, for decode batches too small to fill the GPU with one CTA per
// row and KV head): the S CTAs of a (row, KV head) form a thread-block cluster; CTA s takes
// blocks s * x.split_cols .. (s + 1) * x.split_cols - 1 (the last one also the tail entry),
// leaves its normalised FP32 partial and its LSE in its own shared memory, and after a cluster
// barrier each CTA merges a share of the (head, feature) outputs from all S CTAs' shared memory
// (merge_lse_thread): one launch, no workspace, no partials through global memory. (Splits take
// x.split_cols token ids each on the token path.)
//
// FP8 K/V (KV = __nv_fp8_e4m3): the producer copies each FP8 K or V tile into a ring of six
// 16 KB slots (the bytes of the 16-bit kernel's three stages), and each consumer thread widens
// its own GMMA A fragments out of a slot into registers (sm90/gather.h; exact for every finite
// code), on permuted features: Q's columns are loaded in K's permuted order, and the output's
// rows come out in V's (fp8_k_feature, fp8_vt_feature). A slot is free again as soon as the
// consumer's warps have read it, before the GEMM that uses it, and no CTA-wide barrier stands
// between a tile and the next. k_scale comes folded into scale_log2, v_scale multiplies the
// output.
#pragma once

#include <cooperative_groups.h>
#include <cuda_fp8.h>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>

#include <cstdint>
#include <cute/arch/cluster_sm90.hpp>
#include <cute/arch/copy_sm80.hpp>
#include <cute/tensor.hpp>
#include <string>
#include <type_traits>

#include "api/qsa_attention_params.h"
#include "cuda/attention/merge.cuh"
#include "cuda/attention/qsa_gather_consumer.cuh"
#include "cuda/attention/sm90/gather.h"
#include "cuda/attention/sm90/pipeline.h"
#include "cuda/attention/sm90/traits.h"
#include "cuda/attention/sparse_attention_common.cuh"
#include "cuda/attention/sparse_attention_launch.h"
#include "cuda/common/check.h"
#include "cuda/common/kernel_attributes.h"
#include "sparse_attn/errors.h"

namespace sparse_attn::cuda {

struct QsaGatherConfig {
  static constexpr int kHeadDim = 256;
  static constexpr int kHeads = 16;     // N of both GEMMs: a KV head's query heads (group <= 16)
  static constexpr int kBlockN = 64;    // keys per K/V tile: M of S^T
  static constexpr int kThreads = 256;  // the producer warpgroup, then the consumer's
  static constexpr int kCtasPerSm = 2;  // one CTA's prologue and epilogue in another's shadow
  // A thread's registers as launched: two CTAs' threads share the SM's pool.
  static constexpr int kRegisters = sm90::launched_registers(kThreads * kCtasPerSm);
  // FP8's setmaxnreg split: the producer keeps its key queue, the consumer an A fragment more.
  static constexpr int kFp8ProducerRegisters = 72;
  static constexpr int kFp8ConsumerRegisters = 2 * kRegisters - kFp8ProducerRegisters;
  // Token slots a split may fill: 4 a block entry (the hint's 512 blocks and the tail), 1 a token.
  static constexpr int kMaxTiles = 33;
  static constexpr int kMaxSlots = kMaxTiles * kBlockN;
  // Rounds of kThreads entries a split's resolution takes at most: blocks (3), tokens (9).
  static constexpr int kBlockRounds = (kQsaGatherMaxEntries + kThreads - 1) / kThreads;
  static constexpr int kTokenRounds = (kMaxSlots + kThreads - 1) / kThreads;
  static constexpr int kOutPitch = kHeadDim + 8;  // epilogue rows: 16-byte aligned, skewed banks
  static constexpr int kMaxSplits = 16;  // CTAs of a SplitKV cluster (the non-portable maximum)
  static_assert(kMaxSlots >= 4 * kQsaGatherMaxEntries && kMaxSlots >= kQsaGatherMaxTokens,
                "a split's slots fit the producer's key queue");
};

// The pipeline's stages: three 16-bit K/V tiles (two in flight while one is read), or in the same
// bytes six FP8 tiles, which the consumer's warps release one by one as they have read them.
template <class Element, bool kFp8>
struct QsaGatherTraits : GatherMmaTraits<Element, QsaGatherConfig::kHeads, 3, kFp8> {
  using C = QsaGatherConfig;
  using Base = GatherMmaTraits<Element, C::kHeads, 3, kFp8>;
  using typename Base::LayoutK;
  using typename Base::LayoutP;
  using typename Base::LayoutQ;
  static constexpr int kPipeStages = kFp8 ? 2 * Base::kStages : Base::kStages;
  using Pipeline = std::conditional_t<kFp8, sm90::TmaPipeline<kPipeStages, 4, 128, 32>,
                                      sm90::TmaPipeline<kPipeStages, 1, 128>>;
  // An FP8 slot, [row][16-byte chunk] (sm90/gather.h's staging layout).
  using Fp8Slot = cute::uint128_t[C::kBlockN][C::kHeadDim / 16];
  static_assert(Base::kBlockN == C::kBlockN && Base::kHeadDim == C::kHeadDim,
                "the consumer's tiles are the config's");

  struct SharedStorage {
    // 1024-byte alignment: the 128-byte swizzle repeats every 8 rows of 128 bytes and GMMA
    // reads it by address.
    alignas(1024) cute::array_aligned<Element, cute::cosize_v<LayoutK>> kv;  // O at the end
    alignas(1024) cute::array_aligned<Element, cute::cosize_v<LayoutQ>> q;
    alignas(1024) cute::array_aligned<Element, cute::cosize_v<LayoutP>> p;
    uint32_t slot_valid[C::kMaxSlots / 32];  // bit u: slot u holds a token (else masked)
    int32_t round_counts[C::kTokenRounds][C::kThreads / 32];  // valid entries a warp a round
    float red[2][4][C::kHeads];                               // ColumnSoftmax's exchange
    // SplitKV: this split's LSE per head (log2 units), and every split's, pushed for the merge.
    alignas(16) float split_lse2[C::kHeads];
    alignas(16) float cluster_lse2[C::kMaxSplits][C::kHeads];
    typename Pipeline::SharedStorage pipeline;
    cutlass::arch::ClusterTransactionBarrier barrier_q;
    cutlass::arch::ClusterTransactionBarrier barrier_merge;  // SplitKV: this CTA's shares landed
  };
  static constexpr int kSmemBytes = static_cast<int>(sizeof(SharedStorage));
  static_assert(!kFp8 || kPipeStages * sizeof(Fp8Slot) <=
                             sizeof(cute::array_aligned<Element, cute::cosize_v<LayoutK>>),
                "the FP8 slots fill the 16-bit stages' bytes");
  static_assert(C::kCtasPerSm * (kSmemBytes + 1024) <= 228 * 1024,
                "two CTAs (and the 1 KB the system keeps for each) fit an SM's shared memory");
  static_assert(C::kHeads * C::kOutPitch * sizeof(Element) <= C::kBlockN * C::kHeadDim * 2,
                "the epilogue's O tile fits one idle stage");
  // The merge's bytes: the split's FP32 partial, then the shares its peers push (at most the
  // outputs' chunks plus one chunk a split, from rounding the shares up).
  static_assert((2 * C::kHeads * C::kHeadDim + C::kMaxSplits * 8) * sizeof(float) <=
                    sizeof(cute::array_aligned<Element, cute::cosize_v<LayoutK>>),
                "the partial and the pushed shares fit the idle ring");
  static_assert(C::kMaxSlots * sizeof(int32_t) <= C::kBlockN * C::kHeadDim * 2,
                "the slots' keys are staged in one idle stage");
};

// Named barriers (after CUTLASS's reserved ones): the consumer warpgroup's, then the producer's.
enum class GatherBarrier : uint32_t {
  kColumns = 0,    // ColumnSoftmax's exchange
  kP = 1,          // P^T of the tile is in shared memory
  kOut = 2,        // the O tile is in shared memory
  kGemmsDone = 3,  // every consumer warp's GEMMs on the first stage are done (the epilogue)
  kKeysTaken = 4,  // the producer warpgroup's: every thread holds its keys, the ring is free
};

// kTokens: the row's entries are token ids (else the block hint's blocks and the tail entry,
// x.block_hint). Two kernels, so that each carries only its own resolution's rounds (the code a
// CTA fetches: after the bench's L2 flush, instruction fetch is part of a small batch's latency).
template <typename T, typename KV, bool kTokens>
__global__ void __launch_bounds__(QsaGatherConfig::kThreads, QsaGatherConfig::kCtasPerSm)
    qsa_gather_kernel(const __grid_constant__ SparseAttentionParams p,
                      const __grid_constant__ SparseAttentionLaunch x) {
  using namespace cute;
  using cute::Tensor;
  using C = QsaGatherConfig;
  using Element = sm90::CutlassElement<T>;
  constexpr bool kFp8 = std::is_same_v<KV, __nv_fp8_e4m3>;
  static_assert(kFp8 || std::is_same_v<KV, T>, "K/V are the query's type or FP8 e4m3");
  using Tr = QsaGatherTraits<Element, kFp8>;
  using Pipeline = typename Tr::Pipeline;
  extern __shared__ __align__(1024) char smem[];
  auto& ss = *reinterpret_cast<typename Tr::SharedStorage*>(smem);

  const int tid = static_cast<int>(threadIdx.x), warp = tid / 32, lane = tid % 32;
  const int hkv = static_cast<int>(p.num_kv_heads), group = static_cast<int>(p.group);
  const int splits = x.num_splits;
  // CTA (pair * splits + split): with SplitKV the splits of a pair are one cluster, in rank order.
  const int split = static_cast<int>(blockIdx.x % splits);
  const int64_t pair = blockIdx.x / splits;
  const int kvh = static_cast<int>(pair % hkv);
  const int64_t r = pair / hkv;
  // Rows the union or step kernel wrote are not read nor written here. Behind the step kernel
  // (x.after_step) the marks are read once its grid has completed; after an ordinary launch the
  // wait returns at once.
  if (x.union_handled != nullptr) {
    cudaGridDependencySynchronize();
    if (x.union_handled[r / x.union_rows] != 0) return;
  }
  prefetch_decode_table_row(p, r, tid, C::kThreads);  // beside the ids' loads below
  // The outputs' gate, for the epilogue or (SplitKV) the merge: each split pulls a share.
  prefetch_gate_rows<T>(p, r, static_cast<int64_t>(kvh) * group, group, split * C::kThreads + tid,
                        splits * C::kThreads);
  if (tid == 0) {
    ss.barrier_q.init(128);
    ss.barrier_merge.init(1);
    Pipeline::init(ss.pipeline);
    cutlass::arch::fence_barrier_init();
  }

  // ----- this split's entries: [e_begin, e_end) of the row's blocks (the last split also the
  // tail entry) or token ids ---------------------------------------------------------------
  constexpr bool hint = !kTokens;
  constexpr int per_entry = hint ? 4 : 1;  // slots an entry takes
  constexpr int kRounds = kTokens ? C::kTokenRounds : C::kBlockRounds;
  const int n_listed = static_cast<int>(hint ? p.num_blocks : p.width);
  const int n_entries = n_listed + (hint ? 1 : 0);
  const int e_begin = split * static_cast<int>(x.split_cols);
  const int e_end =
      split == splits - 1 ? n_entries : min(n_listed, e_begin + static_cast<int>(x.split_cols));
  // Rounds of kThreads entries the split has (uniform over the CTA).
  const int rounds = (e_end - e_begin + C::kThreads - 1) / C::kThreads;
  // The ids depend on nothing the row's metadata says: their loads go out before the request
  // lookup, so the two latencies overlap.
  const int32_t* ids = hint ? p.block_indices.narrowed() + r * p.block_indices_row_stride
                            : p.token_indices.narrowed() + r * p.token_indices_row_stride;
  const int64_t id_stride = hint ? p.block_indices_col_stride : p.token_indices_col_stride;
  int32_t id[kRounds];
  CUTE_UNROLL
  for (int i = 0; i < kRounds; ++i) {
    if (i >= rounds) break;
    const int e = e_begin + i * C::kThreads + tid;
    id[i] = e < e_end && e < n_listed ? ids[e * id_stride] : -1;
  }
  for (int w = tid; w < C::kMaxSlots / 32; w += C::kThreads) ss.slot_valid[w] = 0;
  const RowInfo ri = resolve_row(p, x, r);  // collective
  // A padding row's output is zeros and its LSE -inf whatever the split; it is the same row in
  // every CTA of a cluster, so split 0 writes all of it and the others leave (no cluster barrier
  // is ever reached).
  if (!ri.active && split != 0) return;
  const bool merged = splits > 1 && ri.active;
  __syncthreads();  // the barriers' initialisation and the cleared bitmask are visible

  // ----- the split's valid entries, in order (every thread; the page-table loads of all of a
  // thread's entries go out together), their tokens' slots and physical keys -----------------
  int64_t first[kRounds];
  int32_t page[kRounds];
  int count[kRounds];
  CUTE_UNROLL
  for (int i = 0; i < kRounds; ++i) {
    if (i >= rounds) break;
    const int e = e_begin + i * C::kThreads + tid;
    first[i] = entry_tokens(p, x, ri, e, id[i], &count[i]);
    if (!ri.active || e >= e_end) count[i] = 0;
    page[i] = count[i] > 0 ? entry_page(p, ri, first[i]) : -1;
  }
  // Valid tokens of each entry (a prefix of it), and every round's count of valid entries a warp
  // in one table: one barrier for all rounds.
  uint32_t ballot[kRounds];
  CUTE_UNROLL
  for (int i = 0; i < kRounds; ++i) {
    if (i >= rounds) break;
    int c = 0;
    while (c < count[i] && token_valid(p, ri, first[i] + c, page[i])) ++c;
    count[i] = c;
    ballot[i] = __ballot_sync(0xffffffffu, c > 0);
    if (lane == 0) ss.round_counts[i][warp] = __popc(ballot[i]);
  }
  __syncthreads();
  // Valid entry v fills slots per_entry * v .. (its tokens' keys staged in the idle ring, a bit
  // each in slot_valid); the entries keep their order.
  int32_t* const staged_keys = reinterpret_cast<int32_t*>(ss.kv.data());
  int n_valid = 0;
  CUTE_UNROLL
  for (int i = 0; i < kRounds; ++i) {
    if (i >= rounds) break;
    int at = n_valid + __popc(ballot[i] & ((1u << lane) - 1u));
    CUTE_UNROLL
    for (int w = 0; w < C::kThreads / 32; ++w) {
      const int nw = ss.round_counts[i][w];
      if (w < warp) at += nw;
      n_valid += nw;
    }
    if (count[i] > 0) {
      const int u = per_entry * at;
      const int32_t key = physical_key(p, ri, first[i], page[i]);
      CUTE_UNROLL
      for (int j = 0; j < per_entry; ++j) staged_keys[u + j] = j < count[i] ? key + j : -1;
      // A block's 4 slots share a word (u is a multiple of 4).
      atomicOr(&ss.slot_valid[u / 32], ((1u << count[i]) - 1u) << (u % 32));
    }
  }
  const int n_slots = per_entry * n_valid;
  const int n_tiles = (n_slots + C::kBlockN - 1) / C::kBlockN;
  // The last tile's slots past the entries hold no token either.
  if (n_slots + tid < n_tiles * C::kBlockN) staged_keys[n_slots + tid] = -1;
  __syncthreads();  // keys staged, bitmask complete
  // Slot u holds a token: inside the split's slots, and not one its entry lost from its end.
  auto slot_valid = [&](int u) { return ((ss.slot_valid[u / 32] >> (u % 32)) & 1u) != 0; };
  Pipeline pipe{ss.pipeline, 0};
  // FP8: the ring's bytes as slots.
  auto* const fp8_slots = reinterpret_cast<typename Tr::Fp8Slot*>(ss.kv.data());
  // ----- producer: Q once, then K_n and V_n of every tile into the ring ----------------------
  auto produce = [&] {
    if (n_tiles == 0) return;  // nothing valid: the consumer writes zeros without waiting
    Tensor sQ = make_tensor(make_smem_ptr(ss.q.data()), typename Tr::LayoutQ{});
    const auto* q = static_cast<const Element*>(p.q);
    // FP8: Q's columns in K's permuted order (sm90::fp8_k_feature), whose pairs of adjacent
    // columns are pairs of adjacent features: 4-byte copies.
    constexpr int kPer = kFp8 ? 2 : 8;
    using Chunk = std::conditional_t<kFp8, uint32_t, cute::uint128_t>;
    using Copy = std::conditional_t<kFp8, cute::SM80_CP_ASYNC_CACHEALWAYS_ZFILL<Chunk>,
                                    cute::SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<Chunk>>;
    for (int c = tid; c < C::kHeads * (C::kHeadDim / kPer); c += 128) {
      const int m = c / (C::kHeadDim / kPer), col = (c % (C::kHeadDim / kPer)) * kPer;
      const int feature = kFp8 ? sm90::fp8_k_feature(col) : col;
      const bool live = m < group;  // the padding heads' rows are zeros
      const Element* src =
          q + (live ? r * p.q_row_stride + (kvh * group + m) * p.q_head_stride + feature : 0);
      Copy::copy(*reinterpret_cast<const Chunk*>(src), *reinterpret_cast<Chunk*>(&sQ(m, col)),
                 live);
    }
    cutlass::arch::cpasync_barrier_arrive_noinc(reinterpret_cast<uint64_t*>(&ss.barrier_q));
    // This thread's queue of keys, one a tile: those of row 16 warp + lane % 16 (-1 where the
    // slot holds no token), read while the ring still holds them; tile n's key is key[0] once
    // n tiles have been copied (shifting keeps every index static, so the queue is registers).
    // The staged keys say -1 themselves (no bitmask test between a load and the next): the 33
    // loads go out back to back instead of one round trip each.
    int32_t key[C::kMaxTiles];
    CUTE_UNROLL
    for (int n = 0; n < C::kMaxTiles; ++n) {
      key[n] = n < n_tiles ? staged_keys[n * C::kBlockN + 16 * warp + lane % 16] : -1;
    }
    sm90::cta_sync<GatherBarrier::kKeysTaken, 128>();
    auto next_tile = [&] {
      CUTE_UNROLL
      for (int n = 0; n + 1 < C::kMaxTiles; ++n) key[n] = key[n + 1];
    };
    using KVStored = std::conditional_t<kFp8, uint8_t, Element>;
    const auto* kp = static_cast<const KVStored*>(p.k) + kvh * p.k_head_stride;
    const auto* vp = static_cast<const KVStored*>(p.v) + kvh * p.v_head_stride;
    const bool rows_of_keys = kv_keys_are_rows(p);
    // Lanes 0-15: the next tile's row 16 warp + lane % 16, its K or V element offset (or -1).
    auto row_offset = [&](bool v) -> int64_t {
      return key[0] < 0 ? -1 : kv_row_offset(p, key[0], v, rows_of_keys);
    };
    auto state = Pipeline::producer_start();
    auto copy_tile = [&](const KVStored* base, int64_t off) {
      pipe.producer_wait(state);
      if constexpr (kFp8) {
        sm90::gather_rows16_fp8<C::kBlockN>(fp8_slots[state.index()], base, off, warp, lane);
      } else {
        sm90::gather_rows16<Element, C::kBlockN>(
            ss.kv.data() + state.index() * (C::kBlockN * C::kHeadDim), base, off, warp, lane);
      }
      pipe.arrive_on_copies(state);
      ++state;
    };
    for (int n = 0; n < n_tiles; ++n) {
      copy_tile(kp, row_offset(false));
      copy_tile(vp, row_offset(true));
      next_tile();
    }
  };

  // ----- consumer ----------------------------------------------------------------------------
  auto consume = [&] {
    const int ct = tid - 128;
    typename Pipeline::State read;
    // The stage a GEMM reads (16-bit K/V), or (FP8) the thread's A fragment of K or V^T widened
    // from a slot, by the fragment's shape (sm90/gather.h).
    auto tile_stage = [&](auto&&... a_and_slot) {
      if constexpr (sizeof...(a_and_slot) == 0) {
        cutlass::arch::fence_view_async_shared();  // cp.async lands through the generic proxy
        return read.index();
      } else {
        auto widen_fragment = [&](auto& a, int slot) {
          auto to_natural = [](uint32_t w, uint32_t& lo, uint32_t& hi) {
            fp8x4_to_natural<T>(w, lo, hi);
          };
          if constexpr (std::rank_v<std::remove_reference_t<decltype(a)>> == 2) {
            sm90::fp8_k_fragment(fp8_slots[slot], ct / 32, lane, a, to_natural);
          } else {
            sm90::fp8_vt_fragment(fp8_slots[slot], ct / 32, lane, a, to_natural);
          }
        };
        widen_fragment(a_and_slot...);
        return 0;
      }
    };
    // Slots without a token are masked.
    auto mask = [&](auto& s_rc, const auto& cs_rc, int n) {
      CUTE_UNROLL
      for (int i = 0; i < size<0>(s_rc); ++i) {
        if (!slot_valid(n * C::kBlockN + get<0>(cs_rc(i, 0)))) {
          CUTE_UNROLL
          for (int j = 0; j < size<1>(s_rc); ++j) s_rc(i, j) = -INFINITY;
        }
      }
    };
    // ----- epilogue: normalise; O [heads, features] through an idle stage ---------------------
    // (The first stage holds the O tile: every warp's reads of the ring and GEMMs are done
    // before gather_consume calls it.)
    auto epilogue = [&](auto& o_rc, const auto& co_rc, const auto& cs_rc, const auto& inv_sum,
                        const auto& lse) {
      constexpr int kCols = decltype(size<1>(o_rc))::value;
      // The feature an output row holds: FP8's V^T fragment permutes them.
      auto feature = [](int row) { return kFp8 ? sm90::fp8_vt_feature(row) : row; };
      if (merged) {
        // The split's partial, FP32 and normalised, [head][feature] with no skew (each merge
        // chunk is 32 contiguous bytes, pushed as two 16-byte stores), and its LSE (log2
        // units) stay here for the cluster's merge (every thread holds every head's LSE; four
        // write them).
        float* part = reinterpret_cast<float*>(ss.kv.data());
        CUTE_UNROLL
        for (int i = 0; i < size<0>(o_rc); ++i) {
          CUTE_UNROLL
          for (int j = 0; j < kCols; ++j) {
            part[get<1>(co_rc(i, j)) * C::kHeadDim + feature(get<0>(co_rc(i, j)))] =
                o_rc(i, j) * inv_sum[j];
          }
        }
        if (ct < 4) {
          CUTE_UNROLL
          for (int j = 0; j < kCols; ++j) {
            ss.split_lse2[get<1>(cs_rc(0, j))] = lse[j] * 1.4426950408889634f;
          }
        }
        return;
      }
      Element* so = ss.kv.data();
      CUTE_UNROLL
      for (int i = 0; i < size<0>(o_rc); ++i) {
        CUTE_UNROLL
        for (int j = 0; j < kCols; ++j) {
          so[get<1>(co_rc(i, j)) * C::kOutPitch + feature(get<0>(co_rc(i, j)))] =
              Element(o_rc(i, j) * (inv_sum[j] * p.v_scale));
        }
      }
      cutlass::arch::NamedBarrier::sync(128, static_cast<uint32_t>(GatherBarrier::kOut));
      constexpr int kChunks = C::kHeadDim / 8;  // 16-byte pieces of a row
      for (int c = ct; c < group * kChunks; c += 128) {
        const int h = c / kChunks, col = (c % kChunks) * 8;
        const int64_t hq = static_cast<int64_t>(kvh) * group + h;
        store_gated8<T>(p, r, hq, col,
                        *reinterpret_cast<const uint4*>(so + h * C::kOutPitch + col));
      }
      if (p.lse != nullptr && ct < 4) {  // every thread holds every head's LSE; four write them
        CUTE_UNROLL
        for (int j = 0; j < kCols; ++j) {
          const int h = get<1>(cs_rc(0, j));
          if (h < group) {
            p.lse[r * p.lse_row_stride +
                  (static_cast<int64_t>(kvh) * group + h) * p.lse_head_stride] = lse[j];
          }
        }
      }
    };
    gather_consume<Tr>(
        pipe, read, n_tiles, ss.q.data(), ss.kv.data(), ss.p.data(), &ss.red[0][0][0], p.scale_log2,
        ct,
        {static_cast<uint32_t>(GatherBarrier::kColumns), static_cast<uint32_t>(GatherBarrier::kP),
         static_cast<uint32_t>(GatherBarrier::kGemmsDone)},
        [&] { ss.barrier_q.wait(0); }, tile_stage, mask, epilogue);
  };

  // FP8: the consumer holds an A fragment (64 registers) beside O^T, so the producer lends it
  // registers (setmaxnreg) for the tile loop; both are back at the launch's count before the
  // merge, which every thread runs.
  if (warp < 4) {
    if constexpr (kFp8) cutlass::arch::warpgroup_reg_dealloc<C::kFp8ProducerRegisters>();
    produce();
    if constexpr (kFp8) cutlass::arch::warpgroup_reg_alloc<C::kRegisters>();
  } else {
    if constexpr (kFp8) cutlass::arch::warpgroup_reg_alloc<C::kFp8ConsumerRegisters>();
    consume();
    if constexpr (kFp8) cutlass::arch::warpgroup_reg_dealloc<C::kRegisters>();
  }
  if (!merged) return;

  // ----- SplitKV: the cluster's merge ---------------------------------------------------------
  // Every CTA's partial is written and every ring is idle (the cluster barrier); then CTA s
  // merges the s-th of `splits` contiguous shares of the (head, 8-feature chunk) outputs. Every
  // CTA pushes share s of its partial, and its LSEs, into CTA s's idle ring with st.async
  // stores that complete on CTA s's merge barrier; the merge then reads shared memory of its
  // own. (Remote loads move 6-8 bytes a cycle into an SM and wait a round trip: perf-notes,
  // session 36.) Nothing reads a peer's shared memory, so a CTA arrives on the final cluster
  // barrier once it has pushed, and waits on it only before it leaves.
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  cluster.sync();
  constexpr int kChunks = C::kHeadDim / 8;
  const int n_chunks = group * kChunks, share = (n_chunks + splits - 1) / splits;
  const auto share_bytes = [&](int s) {
    return static_cast<uint32_t>(max(0, min(n_chunks, (s + 1) * share) - s * share) * 32);
  };
  float* const part = reinterpret_cast<float*>(ss.kv.data());
  float* const pushed = part + C::kHeads * C::kHeadDim;  // [split][share chunks][8]
  auto* const merge_bar = reinterpret_cast<uint64_t*>(&ss.barrier_merge);
  if (tid == 0) {
    ss.barrier_merge.arrive_and_expect_tx(
        splits * (share_bytes(split) + static_cast<uint32_t>(sizeof(ss.split_lse2))));
  }
  for (int c = tid; c < n_chunks; c += C::kThreads) {
    const int s = c / share;
    const float4* src = reinterpret_cast<const float4*>(part + c * 8);
    float* const dst = pushed + (split * share + c % share) * 8;
    sm90::push_to_cluster_cta(dst, src[0], merge_bar, s);
    sm90::push_to_cluster_cta(dst + 4, src[1], merge_bar, s);
  }
  if (tid < splits * (C::kHeads / 4)) {
    const int s = tid / (C::kHeads / 4), q = tid % (C::kHeads / 4);
    sm90::push_to_cluster_cta(&ss.cluster_lse2[split][4 * q],
                              reinterpret_cast<const float4*>(ss.split_lse2)[q], merge_bar, s);
  }
  cute::cluster_arrive_relaxed();
  ss.barrier_merge.wait(0);
  const int mine = static_cast<int>(share_bytes(split) / 32);
  for (int c = tid; c < mine; c += C::kThreads) {
    const int h = (split * share + c) / kChunks, col = ((split * share + c) % kChunks) * 8;
    const int64_t hq = static_cast<int64_t>(kvh) * group + h;
    // The gate's load goes out before the merge's arithmetic, whose latency covers it.
    const uint4 gate = load_gate8<T>(p, r, hq, col);
    float o[8];
    const float lse2 = merge_lse_thread<C::kMaxSplits, 8, 4>(
        splits, [&](int s) { return ss.cluster_lse2[s][h]; },
        [&](int s, float(&v)[8]) {
          const float4* src = reinterpret_cast<const float4*>(pushed + (s * share + c) * 8);
          const float4 a = src[0], b = src[1];
          v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w;
          v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
        },
        o);
    uint4 out;
    auto* e = reinterpret_cast<T*>(&out);
    CUTE_UNROLL
    for (int i = 0; i < 8; ++i) e[i] = ElementTraits<T>::from_float(o[i] * p.v_scale);
    store_gated8<T>(p, r, hq, col, out, gate);
    if (col == 0 && p.lse != nullptr) {
      p.lse[r * p.lse_row_stride + hq * p.lse_head_stride] = lse2 * 0.69314718055994531f;
    }
  }
  // No CTA leaves while a peer may still be pushing into its shared memory.
  cute::cluster_wait();
}

template <typename T, typename KV, bool kTokens>
void launch_qsa_gather_entries(const SparseAttentionParams& p, const SparseAttentionLaunch& x,
                               cudaStream_t stream) {
  constexpr int kSmem =
      QsaGatherTraits<sm90::CutlassElement<T>, std::is_same_v<KV, __nv_fp8_e4m3>>::kSmemBytes;
  constexpr auto kernel = qsa_gather_kernel<T, KV, kTokens>;
  // schedule() keeps every split's entries within the key queue's slots (the largest split is
  // the last: split_cols entries and, with the hint, the tail); past them the kernel would
  // drop entries.
  const int64_t entries =
      x.num_splits == 1 ? (kTokens ? p.width : p.num_blocks + 1) : x.split_cols + (kTokens ? 0 : 1);
  if ((kTokens ? 1 : 4) * entries > QsaGatherConfig::kMaxSlots) {
    throw Error("qsa_sparse_attention: internal: gather kernel reached with " +
                std::to_string(entries) + " entries in a split");
  }
  // Two CTAs of ~112 KB per SM need the largest shared-memory carveout.
  opt_in_shared_memory<kernel>(kSmem, true);
  const int64_t ctas = p.rows * p.num_kv_heads * x.num_splits;
  if (x.num_splits == 1 && !x.after_step) {
    kernel<<<static_cast<unsigned>(ctas), QsaGatherConfig::kThreads, kSmem, stream>>>(p, x);
    SPARSE_ATTN_CUDA_CHECK_LAUNCH();
    return;
  }
  if (x.after_step) {
    // The rows the step kernel left: a programmatic dependent launch, whose CTAs fill the SMs
    // the steps leave idle or free while the last steps run, so that this launch and its first
    // wave (which mostly finds its rows handled) overlap the step kernel's tail.
    if (x.num_splits != 1) {
      throw Error("qsa_sparse_attention: internal: the gather kernel behind the step kernel at " +
                  std::to_string(x.num_splits) + " splits");
    }
    cudaLaunchAttribute attr;
    const cudaLaunchConfig_t cfg = programmatic_launch_config(
        dim3(static_cast<unsigned>(ctas)), QsaGatherConfig::kThreads, kSmem, stream, attr);
    SPARSE_ATTN_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, p, x));
    return;
  }
  allow_non_portable_clusters<kernel>();
  cudaLaunchAttribute attr;
  const cudaLaunchConfig_t cfg =
      cluster_launch_config(static_cast<unsigned>(ctas), QsaGatherConfig::kThreads,
                            static_cast<unsigned>(x.num_splits), kSmem, stream, attr);
  SPARSE_ATTN_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, p, x));
}

template <typename T, typename KV>
void launch_qsa_gather(const SparseAttentionParams& p, const SparseAttentionLaunch& x,
                       cudaStream_t stream) {
  if (x.block_hint) {
    launch_qsa_gather_entries<T, KV, false>(p, x, stream);
  } else {
    launch_qsa_gather_entries<T, KV, true>(p, x, stream);
  }
}

}  // namespace sparse_attn::cuda
