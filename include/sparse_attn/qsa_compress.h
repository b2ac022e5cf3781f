// QSA compressed indexer keys: qsa_compress_block_keys turns the raw index keys of a request
// (one per token) into the keys the indexer scores (one per complete 4-token block), as the
// model defines them (transformers' Qwen4-Exp): block b of a request covers tokens
// 4b .. 4b + 3 and exists once all four are in; its key is
//
//   m   = mean of the 4 raw keys (FP32)
//   y   = m * rsqrt(mean(m^2) + eps) * (1 + w)      (RMSNorm with the (1 + w) weight)
//   key = RoPE(y, position 4b) on dims [0, rope_dim), the rest as is
//
// computed in FP32 and rounded once to the output dtype. docs/qsa.md ("Compressed keys")
// states the layouts, the RoPE pairing and the edge cases; the reference backend
// (src/reference/qsa_compress_ref.cpp) is the executable form.
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>

#include "sparse_attn/common.h"
#include "sparse_attn/tensor.h"

namespace sparse_attn {

// How the rope_dim rotated dims pair up. kRotateHalf (GPT-NeoX style, what transformers'
// Qwen models use): dim i pairs with i + rope_dim / 2, frequency i. kInterleaved (GPT-J
// style): dims 2j and 2j + 1, frequency j.
enum class RopeStyle : uint8_t { kRotateHalf, kInterleaved };
// "rotate_half" or "interleaved"; ValueError naming rope_style otherwise.
RopeStyle parse_rope_style(std::string_view name);

struct CompressBlockKeysOptions {
  // Request layout of keys [total_tokens, D] (several requests): int [B + 1] row offsets.
  // Without it, keys [T, D] is one request and keys [B, L, D] is B requests of L tokens.
  std::optional<TensorView> cu_seqlens;
  // int [B]: request-local position of each request's first key row (default 0). Tokens at
  // negative positions belong to no block. A block is written only when all four of its
  // tokens are rows of this call, so a decode step passes the newest tokens from the first
  // one of the current block and only the block they complete is written.
  std::optional<TensorView> start_positions;
  // int [B, max_pages]: out is a paged cache [pages, page_size, D] (or [pages, page_size, 1, D]);
  // block b of request r goes to slot b % page_size of page block_table[r, b / page_size].
  // Without it, out is [B, N_B, D] ([N_B, D] for keys [T, D]) and block b goes to row b.
  std::optional<TensorView> block_table;
  std::optional<int64_t> page_size;  // must equal out.shape[1] when given; only with block_table
  double eps = 1e-6;                 // RMSNorm epsilon: finite and >= 0
  // RoPE: either the FP32 tables cos and sin [positions, rope_dim / 2] (one column per
  // frequency) or [positions, rope_dim] (one per rotated dim, transformers' layout), read at
  // row 4b; or rope_theta (> 1), with which frequency j is theta^(-2j / rope_dim) and the
  // angle 4b * frequency in FP32, as transformers computes them. Exactly one of the two.
  std::optional<TensorView> cos;
  std::optional<TensorView> sin;
  std::optional<double> rope_theta;
  int64_t rope_dim = 64;  // rotated leading dims: even, 0 to D
  RopeStyle rope_style = RopeStyle::kRotateHalf;
  Backend backend = Backend::kNative;
  StreamHandle stream = nullptr;
};

// The contiguous destination that every block of keys fills, for keys without cu_seqlens
// and start_positions: [T / 4, D] for keys [T, D], [B, L / 4, D] for keys [B, L, D].
Shape qsa_compress_block_keys_shape(const TensorView& keys);

// keys: raw index keys, bf16/fp16, [T, D], [B, L, D] or [total_tokens, D] with cu_seqlens, any
// strides. weight: w of the (1 + w) RMSNorm weight, [D], bf16, fp16 or fp32. out: the keys'
// dtype, the destination above (positive strides, no overlap with any input). Only complete
// blocks are written; every other element of out keeps its value. A block whose destination
// is missing (b >= N_B, b / page_size >= max_pages, or a page id that is negative or
// >= pages) is not written.
// Native: CUDA tensors, D == 128, rope_dim == 64; host tensors run the reference.
void qsa_compress_block_keys(const TensorView& keys, const TensorView& weight,
                             const TensorView& out, const CompressBlockKeysOptions& options = {});

}  // namespace sparse_attn
