// FP8 e4m3 -> 16-bit widening shared by the attention and indexer kernels.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

namespace sparse_attn::cuda {

// FP8 e4m3 caches widened to the 16-bit type T of the MMAs, exact for every finite code (e4m3
// has 3 mantissa bits and exponents 2^-9 .. 2^8, inside both 16-bit formats).
// fp8x4_to_natural: a 32-bit word of four consecutive codes e0..e3 becomes the T pairs
// (e0, e1) and (e2, e3). The hardware converts two codes to FP16 in one instruction; BF16 takes
// the FP32 detour from there (no e4m3 -> bf16 conversion exists on sm_90): 8 instructions a
// word, where placing the bits and one exact HMUL2 by 2^120 took 10 with the byte permute.
template <typename T>
__device__ inline void fp8x4_to_natural(uint32_t w, uint32_t& lo, uint32_t& hi);

template <>
__device__ inline void fp8x4_to_natural<__half>(uint32_t w, uint32_t& lo, uint32_t& hi) {
  asm("{\n\t.reg .b16 l, h;\n\tmov.b32 {l, h}, %2;\n\t"
      "cvt.rn.f16x2.e4m3x2 %0, l;\n\tcvt.rn.f16x2.e4m3x2 %1, h;\n\t}"
      : "=r"(lo), "=r"(hi)
      : "r"(w));
}

template <>
__device__ inline void fp8x4_to_natural<__nv_bfloat16>(uint32_t w, uint32_t& lo, uint32_t& hi) {
  uint32_t h01, h23;
  fp8x4_to_natural<__half>(w, h01, h23);
  const float2 f01 = __half22float2(reinterpret_cast<const __half2&>(h01));
  const float2 f23 = __half22float2(reinterpret_cast<const __half2&>(h23));
  const __nv_bfloat162 b01 = __floats2bfloat162_rn(f01.x, f01.y);
  const __nv_bfloat162 b23 = __floats2bfloat162_rn(f23.x, f23.y);
  lo = reinterpret_cast<const uint32_t&>(b01);
  hi = reinterpret_cast<const uint32_t&>(b23);
}

// The pairs (e0, e2) and (e1, e3) instead: the pairing one ldmatrix of FP8 rows hands a thread,
// for the per-row kernel's permuted fragment order (sparse_attention_kernel.cuh).
template <typename T>
__device__ inline void fp8x4_to_pairs(uint32_t w, uint32_t& even, uint32_t& odd) {
  fp8x4_to_natural<T>(__byte_perm(w, 0, 0x3120), even, odd);  // e0 e2 e1 e3
}

// Sixteen consecutive codes (one 16-byte load) as two 16-byte fragments of eight T each, in
// order: `lo` holds codes 0..7, `hi` codes 8..15.
template <typename T>
__device__ inline void fp8x16_to_natural(const uint4& w, uint4& lo, uint4& hi) {
  fp8x4_to_natural<T>(w.x, lo.x, lo.y);
  fp8x4_to_natural<T>(w.y, lo.z, lo.w);
  fp8x4_to_natural<T>(w.z, hi.x, hi.y);
  fp8x4_to_natural<T>(w.w, hi.z, hi.w);
}

}  // namespace sparse_attn::cuda
