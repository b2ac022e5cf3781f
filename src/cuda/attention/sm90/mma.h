// Warpgroup GEMMs on CuTe's SM90 GMMA atoms, and the register-layout views the softmax and the
// register-A product need.
#pragma once

#include <cutlass/numeric_conversion.h>

#include <cute/tensor.hpp>

namespace sparse_attn::cuda::sm90 {

// C (+)= A B for one warpgroup. kZeroInit overwrites C. kWait >= 0 waits until at most kWait
// GEMM batches of this warpgroup are still in flight; -1 returns with the batch in flight (the
// caller waits later with cute::warpgroup_wait). The operand fences keep the compiler from
// moving register reads or writes of A (register operand) and C across the asynchronous MMA.
template <bool kZeroInit, int kWait, class TiledMma, class TA, class TB, class TC>
__device__ __forceinline__ void warpgroup_gemm(TiledMma& mma, TA const& a, TB const& b, TC& c) {
  // A from registers holds numbers; A from smem holds GMMA descriptors (also an rmem tensor).
  constexpr bool kRegisterA =
      !cute::is_same_v<typename TA::value_type, cute::GMMA::DescriptorIterator::value_type>;
  if constexpr (kRegisterA) cute::warpgroup_fence_operand(const_cast<TA&>(a));
  cute::warpgroup_fence_operand(c);
  cute::warpgroup_arrive();
  if constexpr (kZeroInit) mma.accumulate_ = cute::GMMA::ScaleOut::Zero;
  CUTE_UNROLL
  for (int k = 0; k < cute::size<2>(a); ++k) {
    cute::gemm(mma, a(cute::_, cute::_, k), b(cute::_, cute::_, k), c);
    mma.accumulate_ = cute::GMMA::ScaleOut::One;
  }
  cute::warpgroup_commit_batch();
  if constexpr (kWait >= 0) cute::warpgroup_wait<kWait>();
  cute::warpgroup_fence_operand(c);
  if constexpr (kRegisterA) cute::warpgroup_fence_operand(const_cast<TA&>(a));
}

// An SM90 accumulator fragment ((2, 2, N / 8), MMA_M, MMA_N) -- per thread: column pairs, the
// two rows 8 apart, column groups of 8 -- seen as (rows, columns): ((2, MMA_M), (2, N / 8, MMA_N)).
template <class Layout>
__device__ __forceinline__ auto accumulator_rows_cols(Layout l) {
  static_assert(decltype(cute::rank<0>(l))::value == 3, "an SM90 GMMA accumulator");
  return cute::make_layout(
      cute::make_layout(cute::get<0, 1>(l), cute::get<1>(l)),
      cute::make_layout(cute::get<0, 0>(l), cute::get<0, 2>(l), cute::get<2>(l)));
}

// The accumulator of S = Q K^T reused as the 16-bit register A operand of O += P V: a k16 A
// fragment is ((2, 2, 2), MMA_M, MMA_K) -- the accumulator's column groups of 8 taken in pairs.
template <class Layout>
__device__ __forceinline__ auto accumulator_as_a_operand(Layout l) {
  using namespace cute;
  using cute::Shape;  // not sparse_attn's (sparse_attn/tensor.h), where both are visible
  using cute::Tensor;
  static_assert(decltype(size<0, 2>(l))::value % 2 == 0, "N a multiple of 16");
  auto groups = logical_divide(get<0, 2>(l), Shape<_2>{});  // ((2, N / 16))
  return make_layout(make_layout(get<0, 0>(l), get<0, 1>(l), get<0, 0>(groups)), get<1>(l),
                     coalesce(make_layout(get<0, 1>(groups), get<2>(l))));
}

// dst = src converted element by element (round to nearest even), two at a time.
template <class TS, class TD>
__device__ __forceinline__ void convert_fragment(TS const& src, TD& dst) {
  using From = typename TS::value_type;
  using To = typename TD::value_type;
  static_assert(decltype(cute::size(src))::value % 2 == 0);
  cutlass::NumericArrayConverter<To, From, 2> convert;
  auto s = cute::recast<cutlass::Array<From, 2>>(src);
  auto d = cute::recast<cutlass::Array<To, 2>>(dst);
  CUTE_UNROLL
  for (int i = 0; i < cute::size(s); ++i) d(i) = convert(s(i));
}

}  // namespace sparse_attn::cuda::sm90
