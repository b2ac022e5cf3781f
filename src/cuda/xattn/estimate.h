// Native xattn_estimate: the kernel parameters and the launcher of one (element type, groups per
// block) instantiation (instantiations/estimate_*.cu). The design is in docs/xattention.md
// ("Native estimate"): a GEMM over the strided Q and K whose epilogue reduces each row's scores
// to one log-sum-exp per key block (a scratch 1/groups_per_block of the score matrix), then a
// pass that normalises each row by its whole log-sum-exp and sums the rows of each query block.
#pragma once

#include <cuda.h>  // CUtensorMap (a plain struct; no driver call is made through this header)
#include <cuda_runtime_api.h>

#include <cstdint>

namespace sparse_attn::cuda {

// Query-group tiles (of kEstimateBlockM groups) of one chunk: the prefix table below bounds it.
inline constexpr int kEstimateMaxMTiles = 256;
inline constexpr int kEstimateBlockM = 128;  // query groups per CTA
inline constexpr int kEstimateBlockN = 256;  // key groups per CTA

// TMA view of the rows of one tensor [batch, heads, len, head_dim] in groups of S: axes (head
// dim, t, g, head, batch), row t of group g being sequence row S g + t. One map cannot stop a
// partial last group inside the sequence (its bounds are per axis), so rows t < full_rows take
// `full` (ceil(len / S) groups) and the others `partial` (one group fewer): a partial last group's
// missing rows read as zeros, as the estimate defines them. When len < S, `partial` would span no
// group: it keeps one and its group coordinates are shifted by partial_shift = 1 past it.
struct StridedRowsMap {
  CUtensorMap full;
  CUtensorMap partial;
  int32_t full_rows = 0;  // len % S, or S when S divides len
  int32_t partial_shift = 0;
};

struct XAttnEstimateKernelParams {
  // query [batch, Hq, q_len, head_dim] and key [batch, Hkv, k_len, head_dim]; boxes of 64
  // features by 128 (query) or 256 (key) groups.
  StridedRowsMap tma_q;
  StridedRowsMap tma_k;

  int32_t batch_heads = 0;  // batch * Hq
  int32_t num_q_heads = 0;
  int32_t group = 0;     // Hq / Hkv
  int32_t head_dim = 0;  // 64, 128 or 256
  int32_t q_len = 0;
  int32_t k_len = 0;
  int32_t stride = 0;    // S: rows per group
  int32_t q_groups = 0;  // ceil(q_len / S)
  int32_t k_groups = 0;  // ceil(k_len / S)
  int32_t offset = 0;    // k_len - q_len: the position of query row 0
  bool causal = true;
  float scale_log2 = 0.f;  // 1 / (sqrt(D) * S * norm) * log2(e)

  // The chunk of query blocks this launch covers: blocks [q_block0, q_block0 + chunk_q_blocks),
  // groups [group0, group_end).
  int32_t q_block0 = 0;
  int32_t chunk_q_blocks = 0;
  int32_t group0 = 0;
  int32_t group_end = 0;
  // CTAs of one (batch, query head): query tile mt (groups group0 + 128 mt ..) owns the
  // tile_prefix[mt + 1] - tile_prefix[mt] key tiles 0, 1, .. (the causal triangle).
  int32_t m_tiles = 0;
  int32_t tile_prefix[kEstimateMaxMTiles + 1] = {};

  // Scratch FP32 [batch * Hq, group_end - group0, lse_pitch]: element (row g, key block kb) is
  // log2 of the sum of exp2 of the row's scaled scores over the key groups of block kb it sees
  // (-inf when it sees none). Written for the key tiles a row's query tile visits; read only
  // for blocks the row sees.
  float* lse = nullptr;
  int64_t lse_pitch = 0;  // a multiple of the key blocks of a key tile

  // attn_sums FP32 [batch, Hq, q_blocks, k_blocks], strides in elements.
  float* attn_sums = nullptr;
  int64_t sums_stride[4] = {};
  int32_t k_blocks = 0;
};

// The GEMM pass over every (batch, head, tile) of the chunk (at most one CTA per SM of the
// `sms`), then the normalising pass over every (batch, head, query block) of it.
template <class Element, int kGroupsPerBlock>
void launch_xattn_estimate(const XAttnEstimateKernelParams& p, int64_t batch_heads, int sms,
                           cudaStream_t stream);

}  // namespace sparse_attn::cuda
