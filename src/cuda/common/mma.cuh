// Tensor-core helpers shared by the indexer kernels.
//
// The MMA is CuTe's SM80 atom m16n8k16 (mma.sync, FP32 accumulate). Fragments use a
// *permuted* K order: a dot product does not care in which order the K elements are summed,
// as long as A and B use the same order, so each thread owns 8 consecutive features
// (one 16-byte load) of a row per pair of K steps instead of the PTX layout's scattered
// pairs. Thread (group g = lane / 4, quad lane c = lane % 4) holds, for feature pair p, the
// 16 bytes at features [32p + 8c, 32p + 8c + 8) of its row:
//   step 2p   : A regs {lo.x, hi.x, lo.y, hi.y}, B regs {b.x, b.y}
//   step 2p+1 : A regs {lo.z, hi.z, lo.w, hi.w}, B regs {b.z, b.w}
// where lo / hi are rows g / g + 8 of the A tile and b is row (column of B) g.
// This lets Q and K come straight from 16-byte global or shared loads with no ldmatrix.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cute/arch/mma_sm80.hpp>
#include <type_traits>

namespace sparse_attn::cuda {

template <typename T>
struct Sm80Mma;
template <>
struct Sm80Mma<__nv_bfloat16> {
  using Atom = cute::SM80_16x8x16_F32BF16BF16F32_TN;
};
template <>
struct Sm80Mma<__half> {
  using Atom = cute::SM80_16x8x16_F32F16F16F32_TN;
};

// acc += A(rows lo/hi, feature pair p) * B(b, feature pair p), two K steps of 16.
template <typename T>
__device__ __forceinline__ void mma_pair(float (&acc)[4], const uint4& lo, const uint4& hi,
                                         const uint4& b) {
  using Atom = typename Sm80Mma<T>::Atom;
  Atom::fma(acc[0], acc[1], acc[2], acc[3], lo.x, hi.x, lo.y, hi.y, b.x, b.y, acc[0], acc[1],
            acc[2], acc[3]);
  Atom::fma(acc[0], acc[1], acc[2], acc[3], lo.z, hi.z, lo.w, hi.w, b.z, b.w, acc[0], acc[1],
            acc[2], acc[3]);
}

__device__ __forceinline__ float relu(float x) { return fmaxf(x, 0.f); }

}  // namespace sparse_attn::cuda
