// QSA sparse attention for multi-token decode steps (speculative decoding, MTP): a request's
// R <= 4 query rows, each with its own selection (the block hint) and position,
// attended by one CTA against the union of their selections, so that the tokens the rows share
// are read once. Where the batch fills the GPU with one CTA per request (B * Hkv >= the SM
// count), this is what makes a step of R rows cost little more than one row: the union of rows
// that share 90% of their blocks is ~1.3x one row's bytes, where the rows one by one read R
// times them.
//
// The consumer is the gather kernel's (qsa_gather_consumer.cuh) with N = 64 columns: column
// 16 j + m is row j's query head m of the KV head (m < group; the rest are zeros). A union token
// that a row does not see is masked in that row's 16 columns only.
//
// The union is built in the prologue, in the ring's shared memory before any tile lands there.
// Its entries are blocks:
// - every row's entries set their bits in a bitmap of the request's blocks, one bitmap a row: its
//   hinted blocks complete at its position and its tail entry, the current incomplete block.
//   Entries past the KV length are dropped. An
//   entry whose bit is already set is a duplicate. docs/qsa.md counts a duplicate as often as
//   it is listed, which the union cannot express, so the CTA leaves the request to the gather
//   kernel;
// - a prefix count over the OR of the rows' bitmaps gives each union entry its place, in
//   ascending order;
// - each union entry keeps the physical key of its first token and, per token k of it, which
//   rows j see it (bit 4 k + j: the row lists the entry, and the token is neither after the
//   row's position nor past the sequence, on a page that exists).
// Any union of four rows' entries fits (kMaxUnion), so only a duplicate or a step whose rows
// are not one request's sends rows to the gather kernel.
//
// A CTA takes two KV heads, a consumer warpgroup each (FlashAttention-3's arrangement of
// warpgroups, with the heads instead of query rows split between the consumers): the union and
// the rows' metadata are resolved once for both, the producer reads tile n's K/V rows of both
// heads back to back (the two 512-byte halves of a token's 1 KB row), and one consumer's
// softmax overlaps the other's GEMMs. Each head has its own pipeline of two stages (K_n, V_n).
//
// One CTA an SM: Q of both heads (64 KB), four 32 KB stages, P^T (2 x 8 KB), the union (12 KB);
// the O^T fragment alone is 128 registers a consumer thread.
#pragma once

#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>

#include <cstdint>
#include <cute/arch/copy_sm80.hpp>
#include <cute/tensor.hpp>

#include "api/qsa_attention_params.h"
#include "cuda/attention/qsa_gather_consumer.cuh"
#include "cuda/attention/qsa_step_params.h"
#include "cuda/attention/sm90/gather.h"
#include "cuda/attention/sm90/pipeline.h"
#include "cuda/attention/sm90/traits.h"
#include "cuda/attention/sparse_attention_common.cuh"
#include "cuda/common/check.h"
#include "cuda/common/kernel_attributes.h"
#include "sparse_attn/errors.h"

namespace sparse_attn::cuda {

template <class Element>
struct QsaStepTraits
    : GatherMmaTraits<Element, QsaStepConfig::kCols, QsaStepConfig::kStagesPerHead> {
  using C = QsaStepConfig;
  using Base = GatherMmaTraits<Element, C::kCols, C::kStagesPerHead>;
  using typename Base::LayoutK;
  using typename Base::LayoutP;
  using typename Base::LayoutQ;
  using Pipeline = sm90::TmaPipeline<C::kStagesPerHead, 1, 128>;
  // Which rows see each token of a union entry: a nibble a token.
  using RowBits = uint16_t;

  struct SharedStorage {
    // 1024-byte alignment: the 128-byte swizzle repeats every 8 rows of 128 bytes and GMMA
    // reads it by address. Head h's stages are [h, h + 1) x kHeadRingElems; the
    // ring holds the rows' block bitmaps until the union is built.
    static constexpr int kHeadRingElems = cute::cosize_v<LayoutK>;  // a head's two stages
    alignas(1024) cute::array_aligned<Element, C::kHeadsPerCta * kHeadRingElems> kv;
    // Q of head h [64 columns, 256] at h * kQElems, then that head's O tile (o_index).
    static constexpr int kQElems = cute::cosize_v<LayoutQ>;
    alignas(1024) cute::array_aligned<Element, C::kHeadsPerCta * kQElems> q;
    static constexpr int kPElems = cute::cosize_v<LayoutP>;
    alignas(1024) cute::array_aligned<Element, C::kHeadsPerCta * kPElems> p;
    int32_t union_key[C::kMaxUnion];   // union entry u: the physical key of its first token
    RowBits union_rows[C::kMaxUnion];  // and bit 4 k + j: row j sees its token k
    int64_t pos[C::kRows];             // the rows' causal positions
    int32_t warp_count[C::kThreads / 32];
    float red[C::kHeadsPerCta][2][4][C::kCols];  // the consumers' ColumnSoftmax exchanges
    typename Pipeline::SharedStorage pipeline[C::kHeadsPerCta];
  };
  static constexpr int kSmemBytes = static_cast<int>(sizeof(SharedStorage));
  static_assert(kSmemBytes <= 227 * 1024, "one CTA an SM");
  static_assert(128 * C::kProducerRegisters + 128 * C::kHeadsPerCta * C::kConsumerRegisters <=
                    C::kThreads * sm90::launched_registers(C::kThreads),
                "the register split fits the registers the CTA was launched with");
  static_assert(C::kRows * C::kBitmapWords * sizeof(uint32_t) <= sizeof(SharedStorage::kv),
                "the rows' bitmaps fit the ring");
  static_assert(C::kRows * C::kHeadsPerRow == C::kCols && C::kRows <= 4,
                "a token's rows are one nibble of union_rows");
};

// Named barriers of consumer warpgroup h: kCount h + these (after CUTLASS's reserved ones).
enum class StepBarrier : uint32_t {
  kColumns = 0,    // ColumnSoftmax's exchange
  kP = 1,          // P^T of the tile is in shared memory
  kGemmsDone = 2,  // every consumer warp's GEMMs are done (the epilogue); also: Q is in, and
                   // the O tile is in shared memory
  kCount = 3,
};

// Element index of (column, feature) in a head's O tile: rows of 256 features, the 16-byte chunks
// of row c permuted by c % 8 so that the consumer's stores (a warp instruction writes one chunk,
// 8 features, of 4 columns 2 apart) and the 16-byte reads spread over the banks.
__device__ __forceinline__ int o_index(int col, int feature) {
  return col * 256 + (((feature / 8) ^ (col % 8)) * 8) + feature % 8;
}

template <typename T>
__global__ void __launch_bounds__(QsaStepConfig::kThreads, 1)
    qsa_step_kernel(const __grid_constant__ QsaStepParams sp) {
  using namespace cute;
  using cute::Tensor;
  using C = QsaStepConfig;
  using Element = sm90::CutlassElement<T>;
  using Tr = QsaStepTraits<Element>;
  using Pipeline = typename Tr::Pipeline;
  extern __shared__ __align__(1024) char smem[];
  auto& ss = *reinterpret_cast<typename Tr::SharedStorage*>(smem);
  const SparseAttentionParams& p = sp.p;

  const int tid = static_cast<int>(threadIdx.x), warp = tid / 32, lane = tid % 32;
  const int group = static_cast<int>(p.group), rows = sp.rows_per_step;
  constexpr int heads = C::kHeadsPerCta;
  const int head_groups = static_cast<int>(p.num_kv_heads) / heads;
  const int64_t step = blockIdx.x / head_groups;
  const int kvh0 = static_cast<int>(blockIdx.x % head_groups) * heads;
  const int64_t r0 = step * rows;
  // The gather kernel that takes the rows left here (its programmatic dependent) may launch once
  // every CTA of this grid is running; its CTAs wait for this grid's completion.
  cudaTriggerProgrammaticLaunchCompletion();
  // Requests hold rows_per_step rows each where the schedule sends a call here: the step's
  // request is `step`, whose page-table row and gate go to L2 while the rows resolve.
  prefetch_table_row(p, step, tid, C::kThreads);
  for (int j = 0; j < rows; ++j) {
    prefetch_gate_rows<T>(p, r0 + j, static_cast<int64_t>(kvh0) * group, heads * group, tid,
                          C::kThreads);
  }
  if (tid == 0) {
    for (int h = 0; h < heads; ++h) Pipeline::init(ss.pipeline[h]);
    cutlass::arch::fence_barrier_init();
  }

  // ----- the rows' entries, their first round of ids -----------------------------------------
  const int n_listed = static_cast<int>(p.num_blocks);
  const int per_row = n_listed + 1;  // the tail entry last
  const int n_entries = rows * per_row;
  const int32_t* const ids = p.block_indices.narrowed();
  const int64_t id_row_stride = p.block_indices_row_stride;
  const int64_t id_col_stride = p.block_indices_col_stride;
  // Entry f is row f / per_row, column f % per_row. A thread takes kBatch entries a round, their
  // ids loaded together: one round (2052 entries at most). The
  // ids depend on nothing the rows' metadata says: the first round's loads go out before the
  // request lookup, so the two latencies overlap.
  constexpr int kBatch = 9;
  int32_t id[kBatch];
  auto load = [&](int base) {
    CUTE_UNROLL
    for (int i = 0; i < kBatch; ++i) {
      const int f = base + i * C::kThreads + tid;
      id[i] = -1;
      if (f < n_entries && f % per_row < n_listed) {
        id[i] = ids[(r0 + f / per_row) * id_row_stride + (f % per_row) * id_col_stride];
      }
    }
  };
  load(0);

  // ----- the step's rows: one request's, else the gather kernel takes them --------------------
  // (The schedule sends no call without requests, RowMapping::kNone, here.)
  const int b_cu = p.row_mapping == RowMapping::kCuSeqlens ? find_request(p, r0) : 0;  // collective
  // Thread j < rows resolves row j: its request (-1 inactive, -2 another request than row 0's
  // search found) and its position.
  int request = -1;
  RowInfo ri;
  if (tid < rows) {
    const RowPlace at = row_place(p, r0 + tid, b_cu);
    if (at.b >= 0 && at.i < at.rows_b) {
      ri = row_info(p, r0 + tid, at);
      request = ri.active ? ri.b : -1;
      ss.pos[tid] = ri.active ? ri.pos : -1;
    } else {
      request = at.b < 0 ? -1 : -2;
      ss.pos[tid] = -1;
    }
  }
  // The step's request and KV length from its first active row (lanes of warp 0), and whether
  // every active row is that request's.
  const uint32_t active = __ballot_sync(0xffffffffu, request >= 0) & ((1u << rows) - 1u);
  const int first = active != 0 ? __ffs(active) - 1 : 0;
  const int b = __shfl_sync(0xffffffffu, request, first);
  const int64_t seq_len_k = __shfl_sync(0xffffffffu, ri.seq_len_k, first);
  const bool mine = tid >= rows || request == -1 || request == b;
  if (warp == 0) {
    const bool one_request = __all_sync(0xffffffffu, mine);
    if (lane == 0) ss.warp_count[0] = one_request ? (active != 0 ? b : -1) : -2;
    // (K/V keys fit int32, so a KV length does too.)
    if (lane == 1) ss.warp_count[1] = static_cast<int32_t>(seq_len_k);
  }
  __syncthreads();                   // the barriers' initialisation, the rows' facts
  const int req = ss.warp_count[0];  // -2: rows of two requests; -1: every row is padding
  const int len_k = ss.warp_count[1];
  if (req == -2) {
    if (tid == 0) sp.handled[step] = 0;
    return;
  }

  // ----- the union of the rows' entries ---------------------------------------------------------
  // Blocks that hold a token before the KV length: the bitmaps' words a row.
  const int words = req < 0 ? 0 : ((len_k + C::kPerEntry - 1) / C::kPerEntry + 31) / 32;
  uint32_t* const bitmap = reinterpret_cast<uint32_t*>(ss.kv.data());  // [rows][words]
  // The bitmap index of entry f with id v, or -1 where it holds no token the row sees.
  auto entry_index = [&](int f, int32_t v) -> int64_t {
    if (f >= n_entries) return -1;
    const int64_t pos = ss.pos[f / per_row];
    int64_t x = -1;
    if (pos < 0) return -1;
    if (f % per_row < n_listed) {
      x = v >= 0 && 4 * static_cast<int64_t>(v) + 3 <= pos ? v : -1;
    } else if ((pos + 1) % 4 != 0) {
      x = (pos + 1) / 4;
    }
    return C::kPerEntry * x >= len_k ? -1 : x;  // no token before the KV length
  };
  for (int w = tid; w < rows * words; w += C::kThreads) bitmap[w] = 0u;
  __syncthreads();
  bool duplicate = false;
  for (int base = 0; req >= 0 && base < n_entries; base += kBatch * C::kThreads) {
    if (base > 0) load(base);
    CUTE_UNROLL
    for (int i = 0; i < kBatch; ++i) {
      const int f = base + i * C::kThreads + tid;
      const int64_t x = entry_index(f, id[i]);
      if (x >= 0) {
        const uint32_t bit = 1u << (x % 32);
        duplicate |= (atomicOr(&bitmap[(f / per_row) * words + x / 32], bit) & bit) != 0;
      }
    }
  }
  if (__syncthreads_or(duplicate)) {  // also: the bitmaps are complete
    if (tid == 0) sp.handled[step] = 0;
    return;
  }
  if (tid == 0) sp.handled[step] = 1;
  // Warp w takes words [w * per, (w + 1) * per) of the OR of the rows' bitmaps, 32 consecutive
  // words a round, a word a lane: an entry's place in the union is its warp's offset (the warps
  // before it) plus a prefix count over the warp's rounds and lanes. A dense stretch of the
  // union (a recent window of tokens) then spreads over the lanes of a round instead of
  // lengthening one thread's walk.
  constexpr int kWarps = C::kThreads / 32;
  const int per = (words + 32 * kWarps - 1) / (32 * kWarps) * 32;
  const int w_begin = min(words, warp * per), w_end = min(words, w_begin + per);
  auto union_word = [&](int w) {
    uint32_t any = 0;
    for (int j = 0; j < rows; ++j) any |= bitmap[j * words + w];
    return any;
  };
  int count = 0;
  for (int w = w_begin + lane; w < w_end; w += 32) count += __popc(union_word(w));
  CUTE_UNROLL
  for (int d = 16; d > 0; d /= 2) count += __shfl_xor_sync(0xffffffffu, count, d);
  if (lane == 0) ss.warp_count[warp] = count;
  __syncthreads();
  int u = 0, n_union = 0;  // u: the next union place of this warp's round
  CUTE_UNROLL
  for (int w = 0; w < kWarps; ++w) {
    const int c = ss.warp_count[w];
    if (w < warp) u += c;
    n_union += c;
  }
  int64_t pos[C::kRows];
  CUTE_UNROLL
  for (int j = 0; j < C::kRows; ++j) pos[j] = j < rows ? ss.pos[j] : -1;
  for (int w0 = w_begin; w0 < w_end; w0 += 32) {  // rounds: uniform over the warp
    const int w = w0 + lane;
    uint32_t row_word[C::kRows];  // the rows' words of this lane's union word
    uint32_t bits = 0;
    CUTE_UNROLL
    for (int j = 0; j < C::kRows; ++j) {
      row_word[j] = j < rows && w < w_end ? bitmap[j * words + w] : 0u;
      bits |= row_word[j];
    }
    const int c = __popc(bits);
    int inclusive = c;
    CUTE_UNROLL
    for (int d = 1; d < 32; d *= 2) {
      const int up = __shfl_up_sync(0xffffffffu, inclusive, d);
      if (lane >= d) inclusive += up;
    }
    int v = u + inclusive - c;
    u += __shfl_sync(0xffffffffu, inclusive, 31);
    while (bits != 0) {
      const int bit = __ffs(bits) - 1;
      bits &= bits - 1;
      const int entry = 32 * w + bit;
      uint32_t seen = 0;
      CUTE_UNROLL
      for (int j = 0; j < C::kRows; ++j) {
        if (((row_word[j] >> bit) & 1u) == 0) continue;
        CUTE_UNROLL
        for (int k = 0; k < C::kPerEntry; ++k) {
          const int64_t t = C::kPerEntry * static_cast<int64_t>(entry) + k;
          if (t <= pos[j] && t < len_k) seen |= 1u << (4 * k + j);
        }
      }
      ss.union_key[v] = entry;  // the entry, until its page is looked up below
      ss.union_rows[v] = static_cast<typename Tr::RowBits>(seen);
      ++v;
    }
  }
  __syncthreads();
  // Each union entry's physical key (a block's pages hold it whole: page_size % 4 == 0 with the
  // hint); an entry on a page that does not exist is seen by no row. A thread's lookups of a
  // round go out together.
  RowInfo req_info;
  req_info.b = max(req, 0);
  req_info.seq_len_k = len_k;
  for (int base = 0; base < n_union; base += kBatch * C::kThreads) {
    int32_t page[kBatch];
    CUTE_UNROLL
    for (int i = 0; i < kBatch; ++i) {
      const int v = base + i * C::kThreads + tid;
      page[i] = v < n_union
                    ? entry_page(p, req_info, C::kPerEntry * static_cast<int64_t>(ss.union_key[v]))
                    : -1;
    }
    CUTE_UNROLL
    for (int i = 0; i < kBatch; ++i) {
      const int v = base + i * C::kThreads + tid;
      if (v >= n_union) continue;
      const int64_t first_token = C::kPerEntry * static_cast<int64_t>(ss.union_key[v]);
      if (p.kv_layout == KVLayout::kPaged && (page[i] < 0 || page[i] >= p.num_pages)) {
        ss.union_rows[v] = 0;
        ss.union_key[v] = 0;
      } else {
        ss.union_key[v] = physical_key(p, req_info, first_token, page[i]);
      }
    }
  }
  __syncthreads();  // the union is complete
  const int n_tiles = (C::kPerEntry * n_union + C::kBlockN - 1) / C::kBlockN;
  // The rows that see the token in K/V slot `slot` (token k of union entry v, bit j: row j; 0
  // past the union).
  auto slot_rows = [&](int slot) -> uint32_t {
    const int v = slot / C::kPerEntry, k = slot % C::kPerEntry;
    return v < n_union ? (static_cast<uint32_t>(ss.union_rows[v]) >> (4 * k)) & 0xfu : 0u;
  };
  // ----- producer: K_n and V_n of both heads, tile by tile ------------------------------------
  auto produce = [&] {
    if (n_tiles == 0) return;  // nothing visible: the consumers write zeros without waiting
    const Pipeline pipe[heads] = {{ss.pipeline[0], 0}, {ss.pipeline[1], 0}};
    const bool rows_of_keys = kv_keys_are_rows(p);
    // Lanes 0-15: row 16 warp + lane % 16 of tile n, its K or V element offset (or -1); the
    // heads' rows are the same tokens, a head stride apart.
    auto row_offset = [&](int n, bool v) -> int64_t {
      const int slot = n * C::kBlockN + 16 * warp + lane % 16;
      if (slot_rows(slot) == 0) return -1;
      return kv_row_offset(p, ss.union_key[slot / C::kPerEntry] + slot % C::kPerEntry, v,
                           rows_of_keys);
    };
    typename Pipeline::State state[heads] = {Pipeline::producer_start(),
                                             Pipeline::producer_start()};
    auto copy_tile = [&](int h, const Element* base, int64_t off) {
      pipe[h].producer_wait(state[h]);
      sm90::gather_rows16<Element, C::kBlockN>(
          ss.kv.data() + (h * C::kStagesPerHead + state[h].index()) * (C::kBlockN * C::kHeadDim),
          base, off, warp, lane);
      pipe[h].arrive_on_copies(state[h]);
      ++state[h];
    };
    const auto* kp = static_cast<const Element*>(p.k) + kvh0 * p.k_head_stride;
    const auto* vp = static_cast<const Element*>(p.v) + kvh0 * p.v_head_stride;
    for (int n = 0; n < n_tiles; ++n) {
      const int64_t k_off = row_offset(n, false), v_off = row_offset(n, true);
      CUTE_UNROLL
      for (int h = 0; h < heads; ++h) copy_tile(h, kp + h * p.k_head_stride, k_off);
      CUTE_UNROLL
      for (int h = 0; h < heads; ++h) copy_tile(h, vp + h * p.v_head_stride, v_off);
    }
  };

  // ----- consumer warpgroup h: head kvh0 + h's tiles, then its outputs --------------------------
  // Both warpgroups run one copy of the code (h is a register): two copies would double the
  // instruction footprint the SM's caches hold.
  auto consume = [&](int h) {
    const uint32_t bar = h * static_cast<uint32_t>(StepBarrier::kCount);
    // The warpgroup's barrier kGemmsDone, with a memory clobber: it orders shared memory that
    // one thread writes and another then reads (Q, the O tile).
    auto sync_done = [&] {
      asm volatile("bar.sync %0, 128;"
                   :
                   : "r"(bar + static_cast<uint32_t>(StepBarrier::kGemmsDone) +
                         cutlass::arch::NamedBarrier::ReservedNamedBarrierCount)
                   : "memory");
    };
    const int ct = tid - 128 * (1 + h);
    const Pipeline pipe{ss.pipeline[h], 0};
    typename Pipeline::State read;
    Element* const q_h = ss.q.data() + h * Tr::SharedStorage::kQElems;
    auto tile_stage = [&]() -> int {
      cutlass::arch::fence_view_async_shared();  // cp.async lands through the generic proxy
      return read.index();
    };
    // A union token is masked in the columns of the rows that do not see it.
    auto mask = [&](auto& s_rc, const auto& cs_rc, int n) {
      CUTE_UNROLL
      for (int i = 0; i < size<0>(s_rc); ++i) {
        const uint32_t seen = slot_rows(n * C::kBlockN + get<0>(cs_rc(i, 0)));
        CUTE_UNROLL
        for (int j = 0; j < size<1>(s_rc); ++j) {
          if (((seen >> (get<1>(cs_rc(i, j)) / C::kHeadsPerRow)) & 1u) == 0) s_rc(i, j) = -INFINITY;
        }
      }
    };
    // The head's Q; the barrier makes every thread's copies, fenced for GMMA's proxy, the
    // warpgroup's.
    auto load_q = [&] {
      using Copy = cute::SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<cute::uint128_t>;
      constexpr int kChunks = C::kHeadDim / 8;  // 16-byte pieces of a row
      const auto* q = static_cast<const Element*>(p.q);
      Tensor sQ = make_tensor(make_smem_ptr(q_h), typename Tr::LayoutQ{});
      for (int c = ct; c < C::kCols * kChunks; c += 128) {
        const int col = c / kChunks, d = (c % kChunks) * 8;
        // Padding columns (heads past the group, rows past the step, inactive rows) are zeros.
        const int j = col / C::kHeadsPerRow, m = col % C::kHeadsPerRow;
        const bool live = j < rows && m < group && ss.pos[j] >= 0;
        const Element* src =
            q +
            (live ? (r0 + j) * p.q_row_stride + ((kvh0 + h) * group + m) * p.q_head_stride + d : 0);
        Copy::copy(*reinterpret_cast<const cute::uint128_t*>(src),
                   *reinterpret_cast<cute::uint128_t*>(&sQ(col, d)), live);
      }
      cute::cp_async_wait<0>();
      cutlass::arch::fence_view_async_shared();
      sync_done();
    };
    if (n_tiles > 0) load_q();  // (without tiles the consumer writes zeros, reading no Q)
    // The head's outputs through its Q buffer: every consumer warp's GEMMs, its last S GEMM
    // among them, are done before gather_consume calls this.
    auto epilogue = [&](auto& o_rc, const auto& co_rc, const auto& cs_rc, const auto& inv_sum,
                        const auto& lse) {
      constexpr int kCols = decltype(size<1>(o_rc))::value;
      CUTE_UNROLL
      for (int i = 0; i < size<0>(o_rc); ++i) {
        CUTE_UNROLL
        for (int j = 0; j < kCols; ++j) {
          q_h[o_index(get<1>(co_rc(i, j)), get<0>(co_rc(i, j)))] =
              Element(o_rc(i, j) * (inv_sum[j] * p.v_scale));
        }
      }
      sync_done();
      constexpr int kChunks = C::kHeadDim / 8;
      for (int c = ct; c < C::kCols * kChunks; c += 128) {
        const int col = c / kChunks, d = (c % kChunks) * 8;
        const int j = col / C::kHeadsPerRow, m = col % C::kHeadsPerRow;
        if (j < rows && m < group) {
          const int64_t hq = static_cast<int64_t>(kvh0 + h) * group + m;
          store_gated8<T>(p, r0 + j, hq, d, *reinterpret_cast<const uint4*>(q_h + o_index(col, d)));
        }
      }
      if (p.lse != nullptr && ct < 4) {  // every thread holds every column's LSE; four write
        CUTE_UNROLL
        for (int j = 0; j < kCols; ++j) {
          const int col = get<1>(cs_rc(0, j));
          const int jr = col / C::kHeadsPerRow, m = col % C::kHeadsPerRow;
          if (jr < rows && m < group) {
            p.lse[(r0 + jr) * p.lse_row_stride +
                  (static_cast<int64_t>(kvh0 + h) * group + m) * p.lse_head_stride] = lse[j];
          }
        }
      }
    };
    gather_consume<Tr>(
        pipe, read, n_tiles, q_h, ss.kv.data() + h * C::kStagesPerHead * (C::kBlockN * C::kHeadDim),
        ss.p.data() + h * Tr::SharedStorage::kPElems, &ss.red[h][0][0][0], p.scale_log2, ct,
        {bar + static_cast<uint32_t>(StepBarrier::kColumns),
         bar + static_cast<uint32_t>(StepBarrier::kP),
         bar + static_cast<uint32_t>(StepBarrier::kGemmsDone)},
        [] {}, tile_stage, mask, epilogue);
  };

  if (warp < 4) {
    cutlass::arch::warpgroup_reg_dealloc<C::kProducerRegisters>();
    produce();
  } else {
    cutlass::arch::warpgroup_reg_alloc<C::kConsumerRegisters>();
    consume(warp / 4 - 1);
  }
}

template <typename T>
void launch_qsa_step(const QsaStepParams& params, cudaStream_t stream) {
  // The kernel reads every step's rows' ids unchecked: schedule() sends only calls whose rows
  // are whole steps.
  if (params.steps * params.rows_per_step > params.p.rows) {
    throw Error("qsa_sparse_attention: internal: the step kernel reached with " +
                std::to_string(params.steps) + " steps of " + std::to_string(params.rows_per_step) +
                " rows over " + std::to_string(params.p.rows) + " rows");
  }
  constexpr int kSmem = QsaStepTraits<sm90::CutlassElement<T>>::kSmemBytes;
  constexpr auto kernel = qsa_step_kernel<T>;
  opt_in_shared_memory<kernel>(kSmem);
  const int64_t ctas = params.steps * (params.p.num_kv_heads / QsaStepConfig::kHeadsPerCta);
  kernel<<<static_cast<unsigned>(ctas), QsaStepConfig::kThreads, kSmem, stream>>>(params);
  SPARSE_ATTN_CUDA_CHECK_LAUNCH();
}

}  // namespace sparse_attn::cuda
