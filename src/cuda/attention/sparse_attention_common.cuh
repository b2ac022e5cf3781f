// Device helpers shared by the sm90 sparse-attention kernels (the per-row gather kernel in
// sparse_attention_kernel.cuh and the row-tile prefill kernel): element conversions, how a
// query row resolves to its request / position / KV length, which index entries are valid
// and where their K/V rows live, and the gated output store. The math is docs/qsa.md's.
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

// Request, position and KV length of row r (called by the whole CTA). A token_to_req id of -1
// marks a padding row (inactive: nothing is read, the output is 0 and the LSE -inf), and so
// does any other id outside [0, batch), a broken promise, and so does a negative position.
// Other contents the caller promised (monotonic offsets, lengths within capacity) are clamped
// so no access leaves its tensor.
__device__ inline RowInfo resolve_row(const SparseAttentionParams& p,
                                      const SparseAttentionLaunch& x, int64_t r) {
  RowInfo ri;
  if (p.row_mapping == RowMapping::kNone) {
    ri.pos = INT64_MAX;
    ri.seq_len_k = p.total_kv;
    return ri;
  }
  int64_t i = 0, rows_b = 0;  // request-local row index, rows of the request in the layout
  switch (p.row_mapping) {
    case RowMapping::kPadded:
      ri.b = static_cast<int>(r / p.q_len);
      i = r % p.q_len;
      rows_b = p.q_len;
      break;
    case RowMapping::kCuSeqlens: {
      ri.b = find_request(p, r);
      const int64_t first = p.cu_seqlens_q[ri.b * p.cu_seqlens_q_stride];
      i = r - first;
      rows_b = p.cu_seqlens_q[(ri.b + 1) * p.cu_seqlens_q_stride] - first;
      break;
    }
    case RowMapping::kTokenToReq: {
      const int64_t id = p.token_to_req[r * p.token_to_req_stride];
      if (id < 0 || id >= p.batch) {
        ri.active = false;
        return ri;
      }
      ri.b = static_cast<int>(id);
      // Validation made token_to_req come with query_positions and without seq_lens_q: the
      // row's index within its request decides nothing (i = 0 of a one-row request).
      rows_b = 1;
      break;
    }
    case RowMapping::kSingleRequest:
      i = r;
      rows_b = p.rows;
      break;
    case RowMapping::kNone:
      break;
  }
  const int64_t seq_len_q =
      p.seq_lens_q ? clamp64(p.seq_lens_q[ri.b * p.seq_lens_q_stride], 0, rows_b) : rows_b;
  ri.active = i < seq_len_q;
  ri.seq_len_k = p.seq_lens_k ? clamp64(p.seq_lens_k[ri.b * p.seq_lens_k_stride], 0, p.kv_capacity)
                              : p.kv_capacity;
  if (p.query_positions) {
    ri.pos = p.row_mapping == RowMapping::kPadded
                 ? p.query_positions[ri.b * p.query_positions_batch_stride +
                                     i * p.query_positions_row_stride]
                 : p.query_positions[r * p.query_positions_row_stride];
  } else {
    ri.pos = ri.seq_len_k - seq_len_q + i;
  }
  ri.active = ri.active && ri.pos >= 0;
  return ri;
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

// Gates the 8 rounded outputs out[r, h, d .. d + 7] held in o. The gate is read-only for the
// kernel's lifetime (ld.global.nc); a contiguous, 16-byte aligned element-wise gate is read in
// one load, as the outputs are stored.
template <typename T>
__device__ inline void gate_outputs8(const SparseAttentionParams& p, int64_t r, int64_t h, int d,
                                     uint4& o) {
  if (p.gate_kind == GateKind::kNone) return;
  const T* g = static_cast<const T*>(p.gate) + r * p.gate_row_stride + h * p.gate_head_stride;
  uint4 gv;
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
  auto* e = reinterpret_cast<T*>(&o);
#pragma unroll
  for (int i = 0; i < 8; ++i) e[i] = apply_gate(e[i], gate[i]);
}

// out[r, h, col .. col + 7] = the 8 rounded outputs in o, gated (gate_outputs8): one 16-byte
// store where out's features are contiguous and 16-byte aligned there, else element by element.
// Any out layout then takes the same kernels, so the schedule (and the workspace size, which
// is decided without out) does not depend on it.
template <typename T>
__device__ inline void store_gated8(const SparseAttentionParams& p, int64_t r, int64_t h, int col,
                                    uint4 o) {
  gate_outputs8<T>(p, r, h, col, o);
  T* dst = static_cast<T*>(p.out) + r * p.out_row_stride + h * p.out_head_stride;
  if (p.out_dim_stride == 1 && reinterpret_cast<uintptr_t>(dst + col) % 16 == 0) {
    *reinterpret_cast<uint4*>(dst + col) = o;
    return;
  }
  const auto* e = reinterpret_cast<const T*>(&o);
#pragma unroll
  for (int i = 0; i < 8; ++i) dst[(col + i) * p.out_dim_stride] = e[i];
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

// A decode-shaped call (one row per request) knows row r's request before its lookup: the
// kernel's `threads` threads pull that request's page-table row (one 128-byte line a thread,
// all inside the row) and its KV length into L2, so the reads after the lookup hit L2 instead
// of HBM. Only a hint: a flattened layout whose requests do not hold one row each prefetches
// another's row.
__device__ inline void prefetch_decode_table_row(const SparseAttentionParams& p, int64_t r, int tid,
                                                 int threads) {
  if (p.kv_layout != KVLayout::kPaged || p.block_table_page_stride != 1 || p.rows != p.batch ||
      (p.row_mapping != RowMapping::kCuSeqlens && p.row_mapping != RowMapping::kPadded)) {
    return;
  }
  // The request's KV length as well, which resolve_row reads after its own lookup.
  if (tid == 0 && p.seq_lens_k) prefetch_l2(p.seq_lens_k.address(r * p.seq_lens_k_stride));
  const MetaPtr table_row = p.block_table + r * p.block_table_batch_stride;
  const int64_t per_line = 128 / table_row.element_size();  // entries per 128-byte line
  for (int64_t i = static_cast<int64_t>(tid) * per_line; i < p.max_pages;
       i += static_cast<int64_t>(threads) * per_line) {
    prefetch_l2(table_row.address(i));
  }
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
