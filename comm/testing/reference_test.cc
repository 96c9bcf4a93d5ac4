// Tests of the reference values: f16/bf16 conversions round to nearest even, every test input
// and every reference reduction is exactly representable in its dtype.
#include "comm/testing/reference.h"

#include <cmath>
#include <cstdint>
#include <limits>

#include "gtest/gtest.h"

namespace fairscale::comm::testing {
namespace {

constexpr const auto& kDataTypes = ::fairscale::comm::testing::kAllDataTypes;
constexpr ReduceOp kExactOps[] = {ReduceOp::kSum, ReduceOp::kProduct, ReduceOp::kMin,
                                  ReduceOp::kMax};

TEST(Half, KnownValues) {
  EXPECT_EQ(FloatToHalf(0.0f), 0x0000);
  EXPECT_EQ(FloatToHalf(-0.0f), 0x8000);
  EXPECT_EQ(FloatToHalf(1.0f), 0x3c00);
  EXPECT_EQ(FloatToHalf(-2.0f), 0xc000);
  EXPECT_EQ(FloatToHalf(65504.0f), 0x7bff);
  EXPECT_EQ(FloatToHalf(65520.0f), 0x7c00);  // ties to even: rounds up to inf
  EXPECT_EQ(FloatToHalf(65519.0f), 0x7bff);
  EXPECT_EQ(FloatToHalf(std::ldexp(1.0f, -24)), 0x0001);  // smallest subnormal
  EXPECT_EQ(FloatToHalf(std::ldexp(1.0f, -25)), 0x0000);  // tie to even (0)
  EXPECT_EQ(FloatToHalf(std::ldexp(3.0f, -25)), 0x0002);  // 1.5 ulp ties to even (2)
  EXPECT_EQ(FloatToHalf(std::ldexp(1.0f, -14)), 0x0400);  // smallest normal
  EXPECT_EQ(FloatToHalf(1.0f + std::ldexp(1.0f, -11)), 0x3c00);  // tie, even stays
  EXPECT_EQ(FloatToHalf(1.0f + std::ldexp(3.0f, -11)), 0x3c02);  // tie, odd rounds up
  EXPECT_EQ(FloatToHalf(std::numeric_limits<float>::infinity()), 0x7c00);
  EXPECT_TRUE(std::isnan(HalfToFloat(FloatToHalf(std::nanf("")))));
}

TEST(Half, RoundTripsEveryFiniteHalf) {
  for (uint32_t bits = 0; bits < 0x10000; ++bits) {
    const uint16_t h = static_cast<uint16_t>(bits);
    if ((h & 0x7c00) == 0x7c00) continue;  // inf / NaN
    ASSERT_EQ(FloatToHalf(HalfToFloat(h)), h) << std::hex << bits;
  }
}

TEST(BFloat16, KnownValuesAndRoundTrip) {
  EXPECT_EQ(FloatToBFloat16(1.0f), 0x3f80);
  EXPECT_EQ(FloatToBFloat16(-256.0f), 0xc380);
  EXPECT_EQ(FloatToBFloat16(257.0f), 0x4380);  // tie to even: 256
  EXPECT_EQ(FloatToBFloat16(259.0f), 0x4382);  // tie to even: 260
  EXPECT_TRUE(std::isnan(BFloat16ToFloat(FloatToBFloat16(std::nanf("")))));
  for (uint32_t bits = 0; bits < 0x10000; ++bits) {
    const uint16_t b = static_cast<uint16_t>(bits);
    if ((b & 0x7f80) == 0x7f80) continue;
    ASSERT_EQ(FloatToBFloat16(BFloat16ToFloat(b)), b) << std::hex << bits;
  }
}

// Encoding a value and decoding it gives it back exactly.
bool Exact(DataType dtype, long double v) {
  uint8_t buf[8];
  EncodeValue(dtype, v, buf);
  return DecodeValue(dtype, buf) == v;
}

TEST(Reference, InputsAndReductionsAreExactForUpToFourRanks) {
  for (DataType dtype : kDataTypes) {
    for (ReduceOp op : kExactOps) {
      for (int n = 1; n <= kMaxExactRanks; ++n) {
        for (size_t i = 0; i < 200; ++i) {
          for (int r = 0; r < n; ++r) {
            ASSERT_TRUE(Exact(dtype, ReductionInput(dtype, op, r, i)))
                << DataTypeName(dtype) << " " << ReduceOpName(op);
          }
          // Every prefix of the reduction (any order of a ring/tree) is exact too.
          for (int m = 1; m <= n; ++m) {
            ASSERT_TRUE(Exact(dtype, ReferenceReduction(dtype, op, m, i)))
                << DataTypeName(dtype) << " " << ReduceOpName(op) << " n=" << m << " i=" << i;
          }
        }
      }
    }
  }
}

TEST(Reference, InputsDifferAcrossRanksAndIndices) {
  for (DataType dtype : kDataTypes) {
    EXPECT_NE(ReductionInput(dtype, ReduceOp::kSum, 0, 0),
              ReductionInput(dtype, ReduceOp::kSum, 1, 0));
    EXPECT_NE(ReductionInput(dtype, ReduceOp::kSum, 0, 0),
              ReductionInput(dtype, ReduceOp::kSum, 0, 1));
  }
}

TEST(Reference, I64SumsExceedDoublePrecision) {
  bool beyond = false;
  for (size_t i = 0; i < 20; ++i) {
    const long double v = ReferenceReduction(DataType::kI64, ReduceOp::kSum, 4, i);
    if (static_cast<long double>(static_cast<double>(v)) != v) beyond = true;
  }
  EXPECT_TRUE(beyond);
}

TEST(Reference, MovementValuesAreExact) {
  for (DataType dtype : kDataTypes) {
    for (uint64_t k = 0; k < 2000; ++k) {
      ASSERT_TRUE(Exact(dtype, MovementValue(dtype, MovementKey(k, k * 3, 7))))
          << DataTypeName(dtype);
    }
  }
}

TEST(Reference, AvgIsTheMean) {
  EXPECT_EQ(ReferenceReduction(DataType::kF32, ReduceOp::kAvg, 3, 5),
            ReferenceReduction(DataType::kF32, ReduceOp::kSum, 3, 5) / 3);
  EXPECT_GT(AvgTolerance(DataType::kBF16), AvgTolerance(DataType::kF16));
  EXPECT_GT(AvgTolerance(DataType::kF16), AvgTolerance(DataType::kF32));
}

}  // namespace
}  // namespace fairscale::comm::testing
