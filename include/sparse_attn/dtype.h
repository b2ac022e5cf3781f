// Host-side conversions between float and the 16-bit storage formats (raw bits in uint16_t)
// and FP8 e4m3fn (raw bits in uint8_t). Round-to-nearest-even, NaN kept NaN, as torch and the
// CUDA intrinsics do.
#pragma once

#include <cstdint>
#include <cstring>

#include "sparse_attn/tensor.h"

namespace sparse_attn {

inline float bf16_to_float(uint16_t bits) {
  uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline uint16_t float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline float fp16_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t u;
  if (exp == 0x1fu) {
    u = sign | 0x7f800000u | (mant << 13);  // inf / NaN
  } else if (exp == 0) {
    if (mant == 0) {
      u = sign;
    } else {  // subnormal: normalise
      int e = -1;
      do {
        ++e;
        mant <<= 1;
      } while ((mant & 0x400u) == 0);
      u = sign | (static_cast<uint32_t>(127 - 15 - e) << 23) | ((mant & 0x3ffu) << 13);
    }
  } else {
    u = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline uint16_t float_to_fp16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);   // NaN
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to inf
  if (abs < 0x38800000u) {
    // Result is subnormal or zero: scale into units of 2^-24 and round to nearest even.
    if (abs < 0x33000000u) return sign;  // below half the smallest subnormal
    const uint32_t mant = (abs & 0x7fffffu) | 0x800000u;
    const int shift = 126 - static_cast<int>(abs >> 23);  // 14..24
    const uint32_t q = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1u);
    const uint32_t half = 1u << (shift - 1);
    const uint32_t r = q + ((rem > half || (rem == half && (q & 1u))) ? 1u : 0u);
    return static_cast<uint16_t>(sign | r);
  }
  uint32_t r = abs - 0x38000000u;  // rebias exponent 127 -> 15
  r += 0xfffu + ((r >> 13) & 1u);
  return static_cast<uint16_t>(sign | (r >> 13));
}

// FP8 e4m3fn (torch.float8_e4m3fn): 1 sign, 4 exponent (bias 7), 3 mantissa bits. No
// infinities: S.1111.111 (0x7f, 0xff) is NaN and S.1111.110 is +-448, the largest finite value;
// exponent 0 holds the subnormals m * 2^-9. Every code decodes exactly to float.
inline float fp8_e4m3_to_float(uint8_t bits) {
  const uint32_t sign = static_cast<uint32_t>(bits & 0x80u) << 24;
  const uint32_t exp = (bits >> 3) & 0xfu;
  const uint32_t mant = bits & 0x7u;
  uint32_t u;
  if (exp == 0xfu && mant == 0x7u) {
    u = sign | 0x7fc00000u;  // NaN
  } else if (exp == 0) {
    const float sub = static_cast<float>(mant) * 0x1p-9f;  // exact: 3 significant bits
    std::memcpy(&u, &sub, sizeof u);
    u |= sign;
  } else {
    u = sign | ((exp + 127 - 7) << 23) | (mant << 20);
  }
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// Float to FP8 e4m3fn as torch converts (c10's fp8e4m3fn_from_fp32_value): round to nearest
// even; magnitudes from 480 up (those that would round past 448), infinities and NaN become
// NaN, since the format has no infinity and torch does not saturate.
inline uint8_t float_to_fp8_e4m3(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs >= 0x43f00000u) return static_cast<uint8_t>(sign | 0x7fu);  // >= 480, inf, NaN
  if (abs < 0x3c800000u) {
    // Below the smallest normal 2^-6: adding 2^14 makes the float's unit in the last place
    // 2^-9, the subnormal step, so the FP32 addition does the rounding to nearest even.
    constexpr uint32_t kDenormBias = 0x46800000u;  // 2^14
    float a, bias;
    std::memcpy(&a, &abs, sizeof a);
    std::memcpy(&bias, &kDenormBias, sizeof bias);
    const float sum = a + bias;
    uint32_t s;
    std::memcpy(&s, &sum, sizeof s);
    return static_cast<uint8_t>(sign | (s - kDenormBias));
  }
  uint32_t r = abs - ((127u - 7u) << 23);  // rebias exponent 127 -> 7
  r += 0x7ffffu + ((r >> 20) & 1u);
  return static_cast<uint8_t>(sign | (r >> 20));
}

// Reads element `i` (a flat element offset from `p`) of a floating dtype as float.
inline float load_as_float(const void* p, DType dtype, int64_t i) {
  switch (dtype) {
    case DType::kBF16:
      return bf16_to_float(static_cast<const uint16_t*>(p)[i]);
    case DType::kF16:
      return fp16_to_float(static_cast<const uint16_t*>(p)[i]);
    case DType::kF8E4M3:
      return fp8_e4m3_to_float(static_cast<const uint8_t*>(p)[i]);
    default:
      return static_cast<const float*>(p)[i];
  }
}

// Writes `v`, rounded to a floating dtype, to element `i` of `p`.
inline void store_from_float(void* p, DType dtype, int64_t i, float v) {
  switch (dtype) {
    case DType::kBF16:
      static_cast<uint16_t*>(p)[i] = float_to_bf16(v);
      break;
    case DType::kF16:
      static_cast<uint16_t*>(p)[i] = float_to_fp16(v);
      break;
    case DType::kF8E4M3:
      static_cast<uint8_t*>(p)[i] = float_to_fp8_e4m3(v);
      break;
    default:
      static_cast<float*>(p)[i] = v;
  }
}

// Rounds a float through a storage dtype (identity for float32).
inline float round_to(DType dtype, float v) {
  switch (dtype) {
    case DType::kBF16:
      return bf16_to_float(float_to_bf16(v));
    case DType::kF16:
      return fp16_to_float(float_to_fp16(v));
    case DType::kF8E4M3:
      return fp8_e4m3_to_float(float_to_fp8_e4m3(v));
    default:
      return v;
  }
}

}  // namespace sparse_attn
