// The copy a gathering producer warp makes of 16 K or V rows of 256 16-bit features into a K/V
// stage (KVStageLayouts, sm90/traits.h): cp.async of 16-byte chunks, zero-filled where a row
// has no source. Rows come from anywhere (pages, requests, a union of blocks), so TMA's boxes
// do not apply; the chunks land in the 128-byte swizzle GMMA reads by address.
#pragma once

#include <cstdint>
#include <cute/arch/copy_sm80.hpp>
#include <cute/tensor.hpp>

namespace sparse_attn::cuda::sm90 {

// Rows 16 warp .. 16 warp + 15 of a kBlockN-row stage at `stage`: row 16 warp + i is read from
// base + (the `off` of lane i), an element offset, or zero-filled where that offset is < 0
// (lanes 16-31's offsets are not read). In the stage, chunk c of row `row` sits at column block
// c / 8, row `row`, slot (c % 8) ^ (row % 8).
//
// Lane l copies chunks 8 j + l % 8 (j = 0 .. 3) of rows 4 g + l / 8 (g = 0 .. 3): the 8 lanes of
// a row take 128 contiguous bytes, so a warp instruction reads four rows' 128-byte lines (as
// many lines as one 512-byte row), and a lane fetches each of its four rows' offsets once and
// then issues its four copies of the row with constant offsets on both sides. (One row per
// instruction took a 64-bit shuffle, compare, select and add per copy: the producer's issue
// slots, not the memory, bounded the L2-resident gather; docs/perf-notes.md, session 10.)
template <class Element, int kBlockN>
__device__ __forceinline__ void gather_rows16(Element* stage, const Element* base, int64_t off,
                                              int warp, int lane) {
  static_assert(sizeof(Element) == 2, "a 256-feature row is 32 chunks of 16 bytes");
  using Copy = cute::SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<cute::uint128_t>;
  const int q = lane / 8, c = lane % 8;
  CUTE_UNROLL
  for (int g = 0; g < 4; ++g) {
    const int i = 4 * g + q;  // the row within the warp's 16; i % 8 == q + 4 (g % 2)
    const int64_t o = __shfl_sync(0xffffffffu, off, i);
    const Element* src = base + (o >= 0 ? o + c * 8 : 0);
    Element* dst = stage + (16 * warp + i) * 64 + ((c ^ (q + 4 * (g % 2))) * 8);
    CUTE_UNROLL
    for (int j = 0; j < 4; ++j) {
      Copy::copy(*reinterpret_cast<const cute::uint128_t*>(src + j * 64),
                 *reinterpret_cast<cute::uint128_t*>(dst + j * (kBlockN * 64)), o >= 0);
    }
  }
}

}  // namespace sparse_attn::cuda::sm90
