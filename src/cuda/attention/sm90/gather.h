// The copy a gathering producer warp makes of 16 K or V rows of 256 16-bit features into a K/V
// stage (KVStageLayouts, sm90/traits.h): cp.async of 16-byte chunks, one row per warp
// instruction (lane l copies chunk l), zero-filled where a row has no source. Rows come from
// anywhere (pages, requests, a union of blocks), so TMA's boxes do not apply; the chunks land
// in the 128-byte swizzle GMMA reads by address.
#pragma once

#include <cute/arch/copy_sm80.hpp>
#include <cute/tensor.hpp>
#include <cstdint>

namespace sparse_attn::cuda::sm90 {

// Rows 16 warp .. 16 warp + 15 of a kBlockN-row stage at `stage`: row 16 warp + i is read from
// base + (the `off` of lane i), an element offset, or zero-filled where that offset is < 0
// (lanes 16-31's offsets are not read). In the stage, chunk c of row `row` sits at column block
// c / 8, row `row`, slot (c % 8) ^ (row % 8); the rows of a warp's 16 share row % 8 with i.
template <class Element, int kBlockN>
__device__ __forceinline__ void gather_rows16(Element* stage, const Element* base, int64_t off,
                                              int warp, int lane) {
  static_assert(sizeof(Element) == 2, "a 256-feature row is 32 chunks of 16 bytes");
  using Copy = cute::SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<cute::uint128_t>;
  Element* dst = stage + (lane / 8) * (kBlockN * 64) + 16 * warp * 64;
  CUTE_UNROLL
  for (int r = 0; r < 16; ++r) {
    const int64_t o = __shfl_sync(0xffffffffu, off, r);
    Copy::copy(*reinterpret_cast<const cute::uint128_t*>(base + (o >= 0 ? o + lane * 8 : 0)),
               *reinterpret_cast<cute::uint128_t*>(dst + r * 64 + ((lane % 8) ^ (r % 8)) * 8),
               o >= 0);
  }
}

}  // namespace sparse_attn::cuda::sm90
