// FP8 e4m3 (DType::kF8E4M3, torch.float8_e4m3fn): the decode of every code and the encoder's
// rounding, against the format's definition and torch's conversion rules.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "sparse_attn/dtype.h"

namespace sparse_attn {
namespace {

// The value of an e4m3fn code from its definition, in double: (-1)^s * 2^(e - 7) * (1 + m / 8),
// subnormals (e == 0) 2^-6 * m / 8, NaN for e == 15 and m == 7.
double e4m3fn_value(unsigned code) {
  const unsigned s = code >> 7, e = (code >> 3) & 15u, m = code & 7u;
  if (e == 15 && m == 7) return std::numeric_limits<double>::quiet_NaN();
  const double mag = e == 0 ? std::ldexp(m / 8.0, -6) : std::ldexp(1.0 + m / 8.0, int(e) - 7);
  return s ? -mag : mag;
}

TEST(DType, Fp8E4M3DecodesEveryCode) {
  EXPECT_EQ(dtype_size(DType::kF8E4M3), 1u);
  EXPECT_STREQ(dtype_name(DType::kF8E4M3), "float8_e4m3fn");
  for (unsigned code = 0; code < 256; ++code) {
    const float got = fp8_e4m3_to_float(static_cast<uint8_t>(code));
    const double want = e4m3fn_value(code);
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << code;
    } else {
      EXPECT_EQ(static_cast<double>(got), want) << code;
      EXPECT_EQ(std::signbit(got), code >= 128) << code;  // -0.0 for 0x80
    }
  }
  EXPECT_TRUE(std::isnan(fp8_e4m3_to_float(0x7f)));
  EXPECT_TRUE(std::isnan(fp8_e4m3_to_float(0xff)));
  EXPECT_EQ(fp8_e4m3_to_float(0x7e), 448.f);  // no infinity: S.1111.110 is the largest value
  EXPECT_EQ(fp8_e4m3_to_float(0x78), 256.f);  // exponent 15 holds finite values
  EXPECT_EQ(fp8_e4m3_to_float(0x38), 1.f);
  EXPECT_EQ(fp8_e4m3_to_float(0x01), 0x1p-9f);  // smallest subnormal
  EXPECT_EQ(fp8_e4m3_to_float(0x07), 7 * 0x1p-9f);
  EXPECT_EQ(fp8_e4m3_to_float(0x08), 0x1p-6f);  // smallest normal
  const uint8_t bytes[] = {0x38, 0xfe};
  EXPECT_EQ(load_as_float(bytes, DType::kF8E4M3, 1), -448.f);
}

TEST(DType, Fp8E4M3EncodeRoundsAsTorch) {
  for (unsigned code = 0; code < 256; ++code) {
    if ((code & 0x7f) == 0x7f) continue;
    EXPECT_EQ(float_to_fp8_e4m3(fp8_e4m3_to_float(static_cast<uint8_t>(code))), code) << code;
  }
  EXPECT_EQ(float_to_fp8_e4m3(1.f + 1.f / 16), 0x38);  // halfway 1 .. 1.125: to even (1)
  EXPECT_EQ(float_to_fp8_e4m3(1.f + 3.f / 16), 0x3a);  // halfway 1.125 .. 1.25: to even (1.25)
  EXPECT_EQ(float_to_fp8_e4m3(0x1p-10f), 0x00);        // half the smallest subnormal: to even 0
  EXPECT_EQ(float_to_fp8_e4m3(3 * 0x1p-10f), 0x02);    // 1.5 subnormal steps: to even (2)
  EXPECT_EQ(float_to_fp8_e4m3(-0x1p-7f), 0x84);        // subnormal -4 * 2^-9
  EXPECT_EQ(float_to_fp8_e4m3(460.f), 0x7e);           // rounds down to 448
  EXPECT_EQ(float_to_fp8_e4m3(464.f), 0x7e);           // the tie goes to even (448)
  EXPECT_EQ(float_to_fp8_e4m3(465.f), 0x7f);           // past it: NaN, torch does not saturate
  EXPECT_EQ(float_to_fp8_e4m3(-1e9f), 0xff);
  EXPECT_EQ(float_to_fp8_e4m3(std::numeric_limits<float>::infinity()), 0x7f);
  EXPECT_EQ(float_to_fp8_e4m3(std::nanf("")) & 0x7f, 0x7f);
  EXPECT_EQ(round_to(DType::kF8E4M3, 0.3f), 0.3125f);
}

}  // namespace
}  // namespace sparse_attn
