// Device helpers shared by the sm90 sparse-attention kernels (the per-row kernel in
// sparse_attention_kernel.cuh and the qsa_* gather, union and step kernels): element
// conversions, how a query row resolves to its request / position / KV length, which index
// entries are valid and where their K/V rows live, and the gated output store. The math is
// docs/qsa.md's.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "api/qsa_attention_params.h"
#include "cuda/attention/sparse_attention_launch.h"
#include "cuda/common/fp8.cuh"

namespace sparse_attn::cuda {

template <typename T>
struct ElementTraits;

template <>
struct ElementTraits<__nv_bfloat16> {
  __device__ static uint32_t pack(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return reinterpret_cast<uint32_t&>(v);
  }
  __device__ static float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
  __device__ static __nv_bfloat16 from_float(float x) { return __float2bfloat16_rn(x); }
};

template <>
struct ElementTraits<__half> {
  __device__ static uint32_t pack(float lo, float hi) {
    __half2 v = __floats2half2_rn(lo, hi);
    return reinterpret_cast<uint32_t&>(v);
  }
  __device__ static float to_float(__half x) { return __half2float(x); }
  __device__ static __half from_float(float x) { return __float2half_rn(x); }
};

struct RowInfo {
  int b = 0;              // request
  int64_t pos = 0;        // causal position: tokens t > pos are masked
  int64_t seq_len_k = 0;  // tokens t >= seq_len_k are masked
  bool active = true;     // false for padding rows (request id -1, past seq_lens_q, position < 0)
};

__device__ inline int64_t clamp64(int64_t x, int64_t lo, int64_t hi) {
  return x < lo ? lo : (x > hi ? hi : x);
}

// The request of flattened row r: the last b with cu_seqlens_q[b] <= r (empty requests before
// it share its offset). A blockDim-ary search: each round every thread probes one offset and
// the count of probes <= r narrows the range blockDim-fold, so decode batches of up to 128
// requests take one round of loads instead of log2(B) dependent ones. Called by the whole CTA.
__device__ inline int find_request(const SparseAttentionParams& p, int64_t r) {
  int lo = 0, hi = static_cast<int>(p.batch) - 1;  // invariant: the answer is in [lo, hi]
  while (lo < hi) {
    const int step = (hi - lo + static_cast<int>(blockDim.x)) / static_cast<int>(blockDim.x);
    const int probe = lo + static_cast<int>(threadIdx.x) * step;
    const bool at_or_before = probe <= hi && p.cu_seqlens_q[probe * p.cu_seqlens_q_stride] <= r;
    // Offsets are nondecreasing, so the true probes are a prefix; at least the first one
    // (cu_seqlens_q[lo] <= r), unless the promised contents are broken.
    const int count = max(1, __syncthreads_count(at_or_before));
    lo += (count - 1) * step;
    hi = min(hi, lo + step - 1);
  }
  return lo;
}

// Where row r sits: its request b (-1: a padding row, whose token_to_req id is -1 or any other
// id outside [0, batch), a broken promise), its index i among the request's rows and the count
// rows_b of those rows in the layout. For kCuSeqlens, b_cu is the request the caller found for
// r (find_request) or for an earlier row of the same CTA; the row lies in that request iff
// i < rows_b. kNone has no requests (b = 0, i = 0, rows_b = 1).
struct RowPlace {
  int b = 0;
  int64_t i = 0, rows_b = 1;
};
__device__ inline RowPlace row_place(const SparseAttentionParams& p, int64_t r, int b_cu) {
  RowPlace at;
  switch (p.row_mapping) {
    case RowMapping::kPadded:
      at.b = static_cast<int>(r / p.q_len);
      at.i = r % p.q_len;
      at.rows_b = p.q_len;
      break;
    case RowMapping::kCuSeqlens: {
      at.b = b_cu;
      const int64_t first = p.cu_seqlens_q[b_cu * p.cu_seqlens_q_stride];
      at.i = r - first;
      at.rows_b = p.cu_seqlens_q[(b_cu + 1) * p.cu_seqlens_q_stride] - first;
      break;
    }
    case RowMapping::kTokenToReq: {
      const int64_t id = p.token_to_req[r * p.token_to_req_stride];
      // Validation made token_to_req come with query_positions and without seq_lens_q: the
      // row's index within its request decides nothing (i = 0 of a one-row request).
      at.b = id < 0 || id >= p.batch ? -1 : static_cast<int>(id);
      break;
    }
    case RowMapping::kSingleRequest:
      at.i = r;
      at.rows_b = p.rows;
      break;
    case RowMapping::kNone:
      break;
  }
  return at;
}

// Position, KV length and activity of row r at `at` (a request's row, at.b >= 0). Other contents
// the caller promised (monotonic offsets, lengths within capacity) are clamped so no access
// leaves its tensor; a row past seq_lens_q or at a negative position is inactive.
__device__ inline RowInfo row_info(const SparseAttentionParams& p, int64_t r, const RowPlace& at) {
  RowInfo ri;
  ri.b = at.b;
  const int64_t seq_len_q =
      p.seq_lens_q ? clamp64(p.seq_lens_q[at.b * p.seq_lens_q_stride], 0, at.rows_b) : at.rows_b;
  ri.active = at.i < seq_len_q;
  ri.seq_len_k = p.seq_lens_k ? clamp64(p.seq_lens_k[at.b * p.seq_lens_k_stride], 0, p.kv_capacity)
                              : p.kv_capacity;
  if (p.query_positions) {
    ri.pos = p.row_mapping == RowMapping::kPadded
                 ? p.query_positions[at.b * p.query_positions_batch_stride +
                                     at.i * p.query_positions_row_stride]
                 : p.query_positions[r * p.query_positions_row_stride];
  } else {
    ri.pos = ri.seq_len_k - seq_len_q + at.i;
  }
  ri.active = ri.active && ri.pos >= 0;
  return ri;
}

// Request, position and KV length of row r (called by the whole CTA). A padding row (row_place's
// b = -1, past seq_lens_q, or at a negative position) is inactive: nothing is read, the output
// is 0 and the LSE -inf.
__device__ inline RowInfo resolve_row(const SparseAttentionParams& p,
                                      const SparseAttentionLaunch& x, int64_t r) {
  RowInfo ri;
  if (p.row_mapping == RowMapping::kNone) {
    ri.pos = INT64_MAX;
    ri.seq_len_k = p.total_kv;
    return ri;
  }
  const int b_cu = p.row_mapping == RowMapping::kCuSeqlens ? find_request(p, r) : 0;
  const RowPlace at = row_place(p, r, b_cu);
  if (at.b < 0) {
    ri.active = false;
    return ri;
  }
  return row_info(p, r, at);
}

// The page-table entry behind an index entry whose first token is `first`: an entry's tokens
// share one page (one token, or a 4-aligned block with pages of a multiple of 4 tokens). The
// read is unconditional (entry 0 for a token out of range), so that a pass issues all its
// reads before it uses any; -1 for unpaged layouts.
__device__ inline int32_t entry_page(const SparseAttentionParams& p, const RowInfo& ri,
                                     int64_t first) {
  if (p.kv_layout != KVLayout::kPaged) return -1;
  const int page_idx = first >= 0 && first < ri.seq_len_k
                           ? static_cast<int>(first) / static_cast<int>(p.page_size)
                           : 0;
  return p.block_table
      .narrowed()[ri.b * p.block_table_batch_stride + page_idx * p.block_table_page_stride];
}

// Whether token t of a row is read: inside the KV length, not after the position, and (paged)
// on a page that exists.
__device__ inline bool token_valid(const SparseAttentionParams& p, const RowInfo& ri, int64_t t,
                                   int32_t page) {
  if (t < 0 || t >= ri.seq_len_k || t > ri.pos) return false;
  return p.kv_layout != KVLayout::kPaged || (page >= 0 && page < p.num_pages);
}

// K/V coordinates of a valid token: (page, slot), (request, token) or (0, physical row).
__device__ inline int2 token_coords(const SparseAttentionParams& p, const RowInfo& ri, int64_t t,
                                    int32_t page) {
  switch (p.kv_layout) {
    case KVLayout::kPaged:
      return make_int2(page, static_cast<int>(t) % static_cast<int>(p.page_size));
    case KVLayout::kPadded:
      return make_int2(ri.b, static_cast<int>(t));
    default:  // kPhysical: seq_len_k is total_kv and pos unbounded
      return make_int2(0, static_cast<int>(t));
  }
}

// The physical key of a valid token and its coordinates back: one int32 per K/V row (the
// launchers check the key range fits).
__device__ inline int32_t physical_key(const SparseAttentionParams& p, const RowInfo& ri, int64_t t,
                                       int32_t page) {
  switch (p.kv_layout) {
    case KVLayout::kPaged:
      return page * static_cast<int32_t>(p.page_size) + static_cast<int32_t>(t % p.page_size);
    case KVLayout::kPadded:
      return static_cast<int32_t>(ri.b * p.kv_capacity + t);
    default:  // kPhysical
      return static_cast<int32_t>(t);
  }
}

__device__ inline int2 key_coords(const SparseAttentionParams& p, int32_t key) {
  switch (p.kv_layout) {
    case KVLayout::kPaged:
      return make_int2(key / static_cast<int32_t>(p.page_size),
                       key % static_cast<int32_t>(p.page_size));
    case KVLayout::kPadded:
      return make_int2(key / static_cast<int32_t>(p.kv_capacity),
                       key % static_cast<int32_t>(p.kv_capacity));
    default:
      return make_int2(0, key);
  }
}

// The tokens behind index entry e of a row: [first, first + *count). Token path: the entry's
// id. Block hint: block b is 4b .. 4b+3; entry num_blocks is the tail of the row's current
// incomplete block, 4 * ((p + 1) / 4) .. p, derived from the position (0 to 3 tokens).
// The hint must give exactly the tokens the expansion put in token_indices, and the expansion
// keeps a block only when it is complete at the row's position (4b + 3 <= p): a hinted block
// that is not is dropped whole. Masking its tokens one by one would not do: the current
// incomplete block's tokens 4b .. p pass the causal test and would count twice, once here and
// once in the tail entry.
__device__ inline int64_t entry_tokens(const SparseAttentionParams& p,
                                       const SparseAttentionLaunch& x, const RowInfo& ri, int64_t e,
                                       int32_t id, int* count) {
  if (!x.block_hint) {
    *count = 1;
    return id;
  }
  if (e < p.num_blocks) {
    const int64_t first = 4 * static_cast<int64_t>(id);
    *count = id >= 0 && first + 3 <= ri.pos ? 4 : 0;
    return first;
  }
  const int64_t first = 4 * ((ri.pos + 1) / 4);
  *count = ri.pos < 0 ? 0 : static_cast<int>(ri.pos - first + 1);
  return first;
}

__device__ inline float sigmoid(float x) { return 1.f / (1.f + expf(-x)); }

// The gate rule: round(o * sigmoid(gate)) of the rounded output o (the unfused result).
template <typename T>
__device__ inline T apply_gate(T o, T gate) {
  using E = ElementTraits<T>;
  return E::from_float(E::to_float(o) * sigmoid(E::to_float(gate)));
}

// out[r, h, d]: round(attn), gated when a gate is given.
template <typename T>
__device__ inline T gated_output(const SparseAttentionParams& p, int64_t r, int64_t h, int d,
                                 float attn) {
  T o = ElementTraits<T>::from_float(attn);
  if (p.gate_kind != GateKind::kNone) {
    const T* g = static_cast<const T*>(p.gate) + r * p.gate_row_stride + h * p.gate_head_stride;
    if (p.gate_kind == GateKind::kElementwise) g += d * p.gate_dim_stride;
    o = apply_gate(o, *g);
  }
  return o;
}

// The gate of outputs out[r, h, d .. d + 7] (8 elements; zeros, which store_gated8 ignores,
// without a gate). The gate is read-only for the kernel's lifetime (ld.global.nc); a contiguous,
// 16-byte aligned element-wise gate is read in one load. A caller loads it before work whose
// latency the load can hide (the gather kernel's cluster merge).
template <typename T>
__device__ inline uint4 load_gate8(const SparseAttentionParams& p, int64_t r, int64_t h, int d) {
  uint4 gv{};
  if (p.gate_kind == GateKind::kNone) return gv;
  const T* g = static_cast<const T*>(p.gate) + r * p.gate_row_stride + h * p.gate_head_stride;
  auto* gate = reinterpret_cast<T*>(&gv);
  if (p.gate_kind == GateKind::kElementwise && p.gate_dim_stride == 1 &&
      reinterpret_cast<uintptr_t>(g + d) % 16 == 0) {
    gv = __ldg(reinterpret_cast<const uint4*>(g + d));
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const T* at = p.gate_kind == GateKind::kElementwise ? g + (d + i) * p.gate_dim_stride : g;
      gate[i] = __ldg(at);
    }
  }
  return gv;
}

// out[r, h, col .. col + 7] = the 8 rounded outputs in o, gated by gv (load_gate8's): one
// 16-byte store where out's features are contiguous and 16-byte aligned there, else element by
// element. Any out layout then takes the same kernels, so the schedule (and the workspace size,
// which is decided without out) does not depend on it.
template <typename T>
__device__ inline void store_gated8(const SparseAttentionParams& p, int64_t r, int64_t h, int col,
                                    uint4 o, uint4 gv) {
  if (p.gate_kind != GateKind::kNone) {
    auto* e = reinterpret_cast<T*>(&o);
    const auto* gate = reinterpret_cast<const T*>(&gv);
#pragma unroll
    for (int i = 0; i < 8; ++i) e[i] = apply_gate(e[i], gate[i]);
  }
  T* dst = static_cast<T*>(p.out) + r * p.out_row_stride + h * p.out_head_stride;
  if (p.out_dim_stride == 1 && reinterpret_cast<uintptr_t>(dst + col) % 16 == 0) {
    *reinterpret_cast<uint4*>(dst + col) = o;
    return;
  }
  const auto* e = reinterpret_cast<const T*>(&o);
#pragma unroll
  for (int i = 0; i < 8; ++i) dst[(col + i) * p.out_dim_stride] = e[i];
}

// store_gated8 with the gate loaded as the outputs are stored.
template <typename T>
__device__ inline void store_gated8(const SparseAttentionParams& p, int64_t r, int64_t h, int col,
                                    uint4 o) {
  store_gated8<T>(p, r, h, col, o, load_gate8<T>(p, r, h, col));
}

// Pulls the 128-byte line at `at` into L2 (a hint: no fault, no register).
__device__ inline void prefetch_l2(const void* at) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(at));
}

// Pulls the gate of row r's query heads first_head .. first_head + heads - 1 into L2 (`threads`
// threads, one 128-byte line a thread): a kernel that calls it at its start finds the gate in
// L2 when it stores its outputs, instead of adding an HBM round trip to its end. Only where the
// gate is element-wise with contiguous features (a head's gate is then whole lines).
template <typename T>
__device__ inline void prefetch_gate_rows(const SparseAttentionParams& p, int64_t r,
                                          int64_t first_head, int heads, int tid, int threads) {
  if (p.gate_kind != GateKind::kElementwise || p.gate_dim_stride != 1) return;
  const char* g = static_cast<const char*>(p.gate) +
                  (r * p.gate_row_stride + first_head * p.gate_head_stride) * sizeof(T);
  const int lines = static_cast<int>(p.head_dim * sizeof(T) / 128);  // a head's lines
  for (int i = tid; i < heads * lines; i += threads) {
    const char* at = g + (i / lines) * p.gate_head_stride * sizeof(T) + (i % lines) * 128;
    prefetch_l2(at);
  }
}

// Pulls request b's page-table row (one 128-byte line a thread of `threads`, all inside the row)
// and its KV length into L2, so that the reads after the kernel's row lookup hit L2 instead of
// HBM. Only a hint: paged layouts with contiguous table rows.
__device__ inline void prefetch_table_row(const SparseAttentionParams& p, int64_t b, int tid,
                                          int threads) {
  if (p.kv_layout != KVLayout::kPaged || p.block_table_page_stride != 1) return;
  // The request's KV length as well, which resolve_row reads after its own lookup.
  if (tid == 0 && p.seq_lens_k) prefetch_l2(p.seq_lens_k.address(b * p.seq_lens_k_stride));
  const MetaPtr table_row = p.block_table + b * p.block_table_batch_stride;
  const int64_t per_line = 128 / table_row.element_size();  // entries per 128-byte line
  for (int64_t i = static_cast<int64_t>(tid) * per_line; i < p.max_pages;
       i += static_cast<int64_t>(threads) * per_line) {
    prefetch_l2(table_row.address(i));
  }
}

// A decode-shaped call (one row per request) knows row r's request before its lookup: r.
// A flattened layout whose requests do not hold one row each would prefetch another's row.
__device__ inline void prefetch_decode_table_row(const SparseAttentionParams& p, int64_t r, int tid,
                                                 int threads) {
  if (p.rows != p.batch ||
      (p.row_mapping != RowMapping::kCuSeqlens && p.row_mapping != RowMapping::kPadded)) {
    return;
  }
  prefetch_table_row(p, r, tid, threads);
}

// Element offset of the K (v = false) or V row of a physical key (physical_key) from the head's
// base. With pages (or requests) back to back in K and V, as caches are allocated, a key is the
// row index itself (rows_of_keys, kv_keys_are_rows): no division by the page size per row.
__device__ inline bool kv_keys_are_rows(const SparseAttentionParams& p) {
  const int64_t outer_rows = p.kv_layout == KVLayout::kPaged ? p.page_size : p.kv_capacity;
  return p.k_batch_stride == outer_rows * p.k_token_stride &&
         p.v_batch_stride == outer_rows * p.v_token_stride;
}
__device__ inline int64_t kv_row_offset(const SparseAttentionParams& p, int32_t key, bool v,
                                        bool rows_of_keys) {
  const int64_t token_stride = v ? p.v_token_stride : p.k_token_stride;
  if (rows_of_keys) return key * token_stride;
  const int2 at = key_coords(p, key);
  return at.x * (v ? p.v_batch_stride : p.k_batch_stride) + at.y * token_stride;
}

template <typename T>
__device__ inline void store_output(const SparseAttentionParams& p, int64_t r, int64_t h, int d,
                                    float attn) {
  static_cast<T*>(p.out)[r * p.out_row_stride + h * p.out_head_stride + d * p.out_dim_stride] =
      gated_output<T>(p, r, h, d, attn);
}

// Swizzled 16-byte slot of (row, chunk) in a [rows][kChunks] tile.
__device__ inline int swz(int row, int chunk) { return chunk ^ (row & 7); }

}  // namespace sparse_attn::cuda
