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

// FP8 rows (kHeadDim one-byte features, kHeadDim / 16 chunks of 16 bytes) stay FP8 in shared
// memory: gather_rows16_fp8 copies them into a staging slot [kBlockN rows][kHeadDim / 16 chunks]
// (cp.async, zero-filled like gather_rows16; lane l copies chunks 8 j + l % 8, j < kHeadDim / 128,
// of rows 4 g + l / 8 of its warp's 16). Then either convert_rows_fp8 widens whole rows into a
// 16-bit stage (the indexer), or a consumer widens its own GMMA A fragments out of the slot
// (fp8_k_fragment, fp8_vt_fragment: the gather kernel), so that no 16-bit copy is written.
// Chunk c of row r sits at slot position c ^ fp8_swizzle(r): the fragment loads of both
// fragments then hit eight different 16-byte bank groups in each phase (see each loader).
__device__ __forceinline__ int fp8_swizzle(int row) { return ((row & 1) << 2) ^ (row & 6); }

template <int kBlockN, int kHeadDim = 256>
__device__ __forceinline__ void gather_rows16_fp8(cute::uint128_t (*staging)[kHeadDim / 16],
                                                  const uint8_t* base, int64_t off, int warp,
                                                  int lane) {
  static_assert(kHeadDim % 128 == 0, "rows of whole 128-byte lines");
  using Copy = cute::SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<cute::uint128_t>;
  const int q = lane / 8, c = lane % 8;
  CUTE_UNROLL
  for (int g = 0; g < 4; ++g) {
    const int i = 4 * g + q, row = 16 * warp + i;
    const int64_t o = __shfl_sync(0xffffffffu, off, i);
    const uint8_t* src = base + (o >= 0 ? o + c * 16 : 0);
    CUTE_UNROLL
    for (int j = 0; j < kHeadDim / 128; ++j) {
      Copy::copy(*reinterpret_cast<const cute::uint128_t*>(src + j * 128),
                 staging[row][(8 * j + c) ^ fp8_swizzle(row)], o >= 0);
    }
  }
}

// Widens rows first_row .. first_row + kRows - 1 (a multiple of 4) of a staging slot into a
// 16-bit stage at gather_rows16's addresses (the indexer's FP8 keys): lane l takes chunks
// 8 j + l % 8 of rows first_row + 4 g + l / 8. Element is the stage's 16-bit
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
      const uint4 w =
          *reinterpret_cast<const uint4*>(&staging[row][(8 * j + c) ^ fp8_swizzle(row)]);
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

// The A fragment of S^T = K Q^T (M = 64 keys, K = 256 features, sixteen k16 steps) of a
// consumer thread (warp w, lane l of its warpgroup), widened from a staging slot of K. The
// features are permuted (the same permutation must order Q's columns, fp8_k_feature): in k16
// step 4 j + q the thread's fragment columns 2 t, 2 t + 1, 2 t + 8, 2 t + 9 (t = l % 4) are bytes
// 4 q .. 4 q + 3 of the key's chunk 4 j + t, so a thread reads whole 16-byte chunks, four a key
// row. a[k][v] is register v of step k: v = 0 / 1 rows 16 w + l / 4 and + 8, columns 2 t, 2 t + 1;
// v = 2 / 3 the same rows, columns 2 t + 8, 2 t + 9 (GMMA's register A layout). A phase of 8
// lanes reads rows r and r + 1, chunks 4 j .. 4 j + 3: the swizzle puts them in both halves of
// the 128 bytes.
template <int kHeadDim = 256, class ToNatural>
__device__ __forceinline__ void fp8_k_fragment(const cute::uint128_t (*slot)[kHeadDim / 16],
                                               int warp, int lane, uint32_t (&a)[kHeadDim / 16][4],
                                               ToNatural to_natural) {
  const int t = lane % 4;
  CUTE_UNROLL
  for (int h = 0; h < 2; ++h) {
    const int row = 16 * warp + lane / 4 + 8 * h;
    CUTE_UNROLL
    for (int j = 0; j < kHeadDim / 64; ++j) {
      const uint4 w = *reinterpret_cast<const uint4*>(&slot[row][(4 * j + t) ^ fp8_swizzle(row)]);
      const uint32_t in[4] = {w.x, w.y, w.z, w.w};
      CUTE_UNROLL
      for (int q = 0; q < 4; ++q) to_natural(in[q], a[4 * j + q][h], a[4 * j + q][2 + h]);
    }
  }
}

// Where fp8_k_fragment's column `col` (0 .. kHeadDim - 1, of the GEMM's K) comes from: the
// feature that Q's column `col` must hold.
__host__ __device__ constexpr int fp8_k_feature(int col) {
  const int kk = col / 16, c = col % 16;
  const int t = (c % 8) / 2, half = c / 8, e = c % 2;
  return 16 * (4 * (kk / 4) + t) + 4 * (kk % 4) + 2 * half + e;
}

// The A fragment of O^T = V^T P^T (M = 256 features in four m64 tiles, K = 64 keys in four k16
// steps) of a consumer thread (warp w, lane l), widened from a staging slot of V. The features
// are permuted (fp8_vt_feature gives the output row's feature): the thread's 8 rows (2 in each
// m64 tile) are the 8 adjacent bytes 8 (8 w + l / 4) .. + 7 of a key, so it reads 8 bytes a key,
// its 16 keys 16 k + 2 t + {0, 1, 8, 9} (t = l % 4). a[k][m][v] is register v of step k, tile m
// (GMMA's register A layout, as fp8_k_fragment's); a byte permute pairs a feature's codes of
// two adjacent keys, which is how a register holds them. A phase of 16 lanes reads four keys
// 2 apart, 32 bytes each: the swizzle gives each key its own quarter of the 128 bytes.
template <int kBlockN = 64, int kHeadDim = 256, class ToNatural>
__device__ __forceinline__ void fp8_vt_fragment(const cute::uint128_t (*slot)[kHeadDim / 16],
                                                int warp, int lane,
                                                uint32_t (&a)[kBlockN / 16][kHeadDim / 64][4],
                                                ToNatural to_natural) {
  static_assert(kHeadDim == 256, "a thread's 8 rows are 8 adjacent features");
  const int t = lane % 4, byte = 64 * warp + 8 * (lane / 4);
  CUTE_UNROLL
  for (int k = 0; k < kBlockN / 16; ++k) {
    CUTE_UNROLL
    for (int half = 0; half < 2; ++half) {
      uint2 v[2];
      CUTE_UNROLL
      for (int e = 0; e < 2; ++e) {
        const int key = 16 * k + 2 * t + 8 * half + e;
        const auto* row = reinterpret_cast<const uint8_t*>(slot[key]);
        v[e] = *reinterpret_cast<const uint2*>(row + ((byte / 16) ^ fp8_swizzle(key)) * 16 +
                                               byte % 16);
      }
      // Features 2 m and 2 m + 1 of the 8 (rows of tile m): of key e0 and key e1 each.
      const uint32_t lo[2] = {v[0].x, v[1].x}, hi[2] = {v[0].y, v[1].y};
      CUTE_UNROLL
      for (int m = 0; m < 4; ++m) {
        const uint32_t k0 = m < 2 ? lo[0] : hi[0], k1 = m < 2 ? lo[1] : hi[1];
        const uint32_t pair = __byte_perm(k0, k1, m % 2 == 0 ? 0x5140 : 0x7362);
        to_natural(pair, a[k][m][2 * half], a[k][m][2 * half + 1]);
      }
    }
  }
}

// The feature of fp8_vt_fragment's output row `row` (0 .. 255): row 64 m + 16 w + 8 h + g of
// m64 tile m is byte 2 m + h of the 8 that thread (w, g) reads.
__host__ __device__ constexpr int fp8_vt_feature(int row) {
  const int m = row / 64, w = row % 64 / 16, h = row % 16 / 8, g = row % 8;
  return 8 * (8 * w + g) + 2 * m + h;
}

// Both orders are permutations of the 256 features, and K's keeps adjacent pairs together (Q is
// loaded in it 4 bytes at a time).
constexpr bool fp8_orders_hold() {
  bool k_seen[256] = {}, v_seen[256] = {};
  for (int i = 0; i < 256; ++i) {
    const int k = fp8_k_feature(i), v = fp8_vt_feature(i);
    if (k < 0 || k >= 256 || k_seen[k] || v < 0 || v >= 256 || v_seen[v]) return false;
    if (i % 2 == 1 && k != fp8_k_feature(i - 1) + 1) return false;
    k_seen[k] = v_seen[v] = true;
  }
  return true;
}
static_assert(fp8_orders_hold(), "the FP8 fragments' feature orders are permutations");

}  // namespace sparse_attn::cuda::sm90
