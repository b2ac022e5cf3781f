// qsa_expand_blocks' rule for what follows a row's kept blocks, shared by the expansion kernel
// and the top-k's fused expansion (docs/qsa.md, qsa_expand_blocks).
#pragma once

#include <cstdint>

namespace sparse_attn::cuda::select {

inline constexpr int64_t kBlockTokens = 4;  // block b covers tokens 4b .. 4b + 3

// Writes the tokens after a row's `filled` tokens of kept blocks: the tail of the incomplete
// block holding `pos` (none for pos < 0), then -1 up to `width`; thread `thread` of `threads`
// takes its share; a null `tokens` writes nothing. Returns the tail's length. Index is int where
// the row's width fits 32 bits (64-bit counters lengthen the top-k row's last phase).
template <typename Index>
__device__ __forceinline__ Index write_tail(int32_t* tokens, int64_t col_stride, int64_t pos,
                                            Index filled, Index width, int thread, int threads) {
  const int64_t tail_start = kBlockTokens * ((pos + 1) / kBlockTokens);
  const Index tail = pos >= 0 ? static_cast<Index>(pos - tail_start + 1) : 0;
  if (tokens) {
    if (thread < tail)
      tokens[(filled + thread) * col_stride] = static_cast<int32_t>(tail_start + thread);
    for (Index j = filled + tail + thread; j < width; j += threads) tokens[j * col_stride] = -1;
  }
  return tail;
}

}  // namespace sparse_attn::cuda::select
