// The copy a gathering producer warp makes of 16 K or V rows of kHeadDim (128 or 256) 16-bit
// features into a K/V stage (KVStageLayouts, sm90/traits.h): cp.async of 16-byte chunks,
// zero-filled where a row has no source. Rows come from anywhere (pages, requests, a union of
// blocks), so TMA's boxes do not apply; the chunks land in the 128-byte swizzle GMMA reads by
// address.
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
// Lane l copies chunks 8 j + l % 8 (j < kHeadDim / 64) of rows 4 g + l / 8 (g = 0 .. 3): the 8
// lanes of a row take 128 contiguous bytes, so a warp instruction reads four rows' 128-byte
// lines, and a lane fetches each of its four rows' offsets once and then issues its copies of
// the row (kHeadDim / 64) with constant offsets on both sides. (One row per
// instruction took a 64-bit shuffle, compare, select and add per copy: the producer's issue
// slots, not the memory, bounded the L2-resident gather; docs/perf-notes.md, session 10.)
template <class Element, int kBlockN, int kHeadDim = 256>
__device__ __forceinline__ void gather_rows16(Element* stage, const Element* base, int64_t off,
                                              int warp, int lane) {
  static_assert(sizeof(Element) == 2 && kHeadDim % 64 == 0, "rows of whole 128-byte blocks");
  using Copy = cute::SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<cute::uint128_t>;
  const int q = lane / 8, c = lane % 8;
  CUTE_UNROLL
  for (int g = 0; g < 4; ++g) {
    const int i = 4 * g + q;  // the row within the warp's 16; i % 8 == q + 4 (g % 2)
    const int64_t o = __shfl_sync(0xffffffffu, off, i);
    const Element* src = base + (o >= 0 ? o + c * 8 : 0);
    Element* dst = stage + (16 * warp + i) * 64 + ((c ^ (q + 4 * (g % 2))) * 8);
    CUTE_UNROLL
    for (int j = 0; j < kHeadDim / 64; ++j) {
      Copy::copy(*reinterpret_cast<const cute::uint128_t*>(src + j * 64),
                 *reinterpret_cast<cute::uint128_t*>(dst + j * (kBlockN * 64)), o >= 0);
    }
  }
}

// FP8 rows (kHeadDim one-byte features, kHeadDim / 16 chunks) take two steps, because GMMA reads
// 16-bit operands: gather_rows16_fp8 copies them into a staging slot [kBlockN rows][kHeadDim /
// 16 chunks] (cp.async, zero-filled like gather_rows16; lane l copies chunks 8 j + l % 8,
// j < kHeadDim / 128, of rows 4 g + l / 8 of its warp's 16), and convert_rows_fp8, once the
// slot's copies have landed (the pipeline's barrier), widens rows of it into a 16-bit stage at
// gather_rows16's addresses.
template <int kBlockN, int kHeadDim = 256>
__device__ __forceinline__ void gather_rows16_fp8(cute::uint128_t (*staging)[kHeadDim / 16],
                                                  const uint8_t* base, int64_t off, int warp,
                                                  int lane) {
  static_assert(kHeadDim % 128 == 0, "rows of whole 128-byte lines");
  using Copy = cute::SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<cute::uint128_t>;
  const int q = lane / 8, c = lane % 8;
  CUTE_UNROLL
  for (int g = 0; g < 4; ++g) {
    const int i = 4 * g + q;
    const int64_t o = __shfl_sync(0xffffffffu, off, i);
    const uint8_t* src = base + (o >= 0 ? o + c * 16 : 0);
    CUTE_UNROLL
    for (int j = 0; j < kHeadDim / 128; ++j) {
      Copy::copy(*reinterpret_cast<const cute::uint128_t*>(src + j * 128),
                 staging[16 * warp + i][8 * j + c], o >= 0);
    }
  }
}

// Widens rows first_row .. first_row + kRows - 1 (a multiple of 4) of a staging slot: lane l
// takes chunks 8 j + l % 8 of rows first_row + 4 g + l / 8. Element is the stage's 16-bit
// type; to_natural(w, lo, hi) is fp8x4_to_natural<T> (sparse_attention_common.cuh).
template <class Element, int kBlockN, int kRows, int kHeadDim = 256, class ToNatural>
__device__ __forceinline__ void convert_rows_fp8(Element* stage,
                                                 const cute::uint128_t (*staging)[kHeadDim / 16],
                                                 int first_row, int lane, ToNatural to_natural) {
  static_assert(kRows % 4 == 0, "8 lanes a row, 4 rows a pass");
  const int q = lane / 8, c = lane % 8;
  CUTE_UNROLL
  for (int g = 0; g < kRows / 4; ++g) {
    const int row = first_row + 4 * g + q;
    CUTE_UNROLL
    for (int j = 0; j < kHeadDim / 128; ++j) {
      const uint4 w = *reinterpret_cast<const uint4*>(&staging[row][8 * j + c]);
      const uint32_t in[4] = {w.x, w.y, w.z, w.w};
      uint32_t out[8];
      CUTE_UNROLL
      for (int k = 0; k < 4; ++k) to_natural(in[k], out[2 * k], out[2 * k + 1]);
      // 16-bit chunks 2 f and 2 f + 1 of FP8 chunk f = 8 j + c: column block 2j + c / 4,
      // slots 2c % 8 and 2c % 8 + 1. Lanes c >= 4 store theirs in the other order, so the 8
      // lanes of a row hit 8 different slots (bank groups) with each store.
      const uint4 lo = make_uint4(out[0], out[1], out[2], out[3]);
      const uint4 hi = make_uint4(out[4], out[5], out[6], out[7]);
      CUTE_UNROLL
      for (int hh = 0; hh < 2; ++hh) {
        const int h = c < 4 ? hh : 1 - hh;
        const int slot = (2 * c + h) % 8, block = 2 * j + (2 * c + h) / 8;
        *reinterpret_cast<uint4*>(stage + block * (kBlockN * 64) + row * 64 +
                                  ((slot ^ (row % 8)) * 8)) = h == 0 ? lo : hi;
      }
    }
  }
}

}  // namespace sparse_attn::cuda::sm90
