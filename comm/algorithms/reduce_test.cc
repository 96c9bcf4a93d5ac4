// The reduction kernels against a scalar double reference, for every dtype x op, plus exhaustive
// and randomized checks of the f16/bf16 converters.
#include "comm/algorithms/reduce.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace fairscale::comm {
namespace {

// ---- Reference rounding, written independently of half.h: scale, round with nearbyint (the
// default rounding mode is nearest-even), reassemble the bits.

// Nearest-even rounding of the finite, non-NaN value `v` to a binary format with `mant_bits`
// fraction bits, exponent bias `bias` and max biased exponent `max_exp` (all-ones = inf).
uint16_t RefRound(double v, int mant_bits, int bias, int max_exp) {
  const uint16_t sign = std::signbit(v) ? static_cast<uint16_t>(1u << 15) : 0;
  const double a = std::fabs(v);
  const int min_exp = 1 - bias;  // exponent of the smallest normal
  uint32_t bits;
  if (a < std::ldexp(1.0, min_exp)) {
    // Subnormal range: units of 2^(min_exp - mant_bits). A round up to 2^mant_bits is exactly the
    // smallest normal's encoding.
    bits = static_cast<uint32_t>(std::nearbyint(std::ldexp(a, mant_bits - min_exp)));
  } else {
    int e = std::ilogb(a);
    double q = std::nearbyint(std::ldexp(a, mant_bits - e));  // in [2^m, 2^(m+1)]
    if (q == std::ldexp(1.0, mant_bits + 1)) {
      ++e;
      q /= 2;
    }
    if (e + bias >= max_exp) return sign | static_cast<uint16_t>(max_exp << mant_bits);
    bits = (static_cast<uint32_t>(e + bias) << mant_bits) |
           (static_cast<uint32_t>(q) - (1u << mant_bits));
  }
  return sign | static_cast<uint16_t>(bits);
}
uint16_t RefF16(double v) { return RefRound(v, 10, 15, 31); }
uint16_t RefBF16(double v) { return RefRound(v, 7, 127, 255); }

double RefF16Value(uint16_t h) {
  const int e = (h >> 10) & 0x1f;
  const int m = h & 0x3ff;
  const double s = (h & 0x8000) ? -1.0 : 1.0;
  if (e == 31) return m ? std::numeric_limits<double>::quiet_NaN() : s * INFINITY;
  if (e == 0) return s * std::ldexp(m, -24);
  return s * std::ldexp(1024 + m, e - 25);
}

uint32_t Bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}
float FromBits(uint32_t b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

TEST(Half, F16ToF32IsExactForAllPatterns) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float f = F16ToF32(static_cast<uint16_t>(h));
    const double ref = RefF16Value(static_cast<uint16_t>(h));
    if (std::isnan(ref)) {
      ASSERT_TRUE(std::isnan(f)) << h;
      // Sign and payload move up unchanged.
      ASSERT_EQ(Bits(f), ((h & 0x8000u) << 16) | 0x7f800000u | ((h & 0x3ffu) << 13)) << h;
    } else {
      ASSERT_EQ(static_cast<double>(f), ref) << h;
      ASSERT_EQ(std::signbit(f), (h & 0x8000) != 0) << h;
    }
  }
}

TEST(Half, F16RoundTripsEveryPattern) {
  for (uint32_t h = 0; h < 65536; ++h) {
    ASSERT_EQ(F32ToF16(F16ToF32(static_cast<uint16_t>(h))), h) << std::hex << h;
  }
}

TEST(Half, BF16RoundTripsEveryPattern) {
  for (uint32_t h = 0; h < 65536; ++h) {
    ASSERT_EQ(F32ToBF16(BF16ToF32(static_cast<uint16_t>(h))), h) << std::hex << h;
  }
}

// Every f32 pattern would take a while; sweep the interesting exponents densely and the rest
// randomly, including ties (low bits exactly half an ulp).
TEST(Half, F32NarrowingRoundsToNearestEven) {
  std::mt19937 rng(7);
  std::vector<uint32_t> patterns;
  for (uint32_t e = 0; e < 256; ++e) {
    for (uint32_t k = 0; k < 2000; ++k) {
      uint32_t m = rng() & 0x7fffff;
      if (k % 4 == 0) m = (m & ~0x1fffu) | 0x1000u;  // f16 tie
      if (k % 4 == 1) m = (m & ~0xffffu) | 0x8000u;  // bf16 tie
      patterns.push_back((e << 23) | m | ((k & 8) ? 0x80000000u : 0));
    }
  }
  for (uint32_t p : {0x477fefffu, 0x477ff000u, 0x38800000u, 0x387fffffu, 0x33000000u, 0x33000001u,
                     0x7f7fffffu, 0x7f7f8000u, 0x7f7f7fffu, 0x00000001u, 0x80000000u}) {
    patterns.push_back(p);
  }
  for (uint32_t p : patterns) {
    const float f = FromBits(p);
    if (std::isnan(f)) {
      EXPECT_EQ(F32ToF16(f) & 0x7c00, 0x7c00);
      EXPECT_NE(F32ToF16(f) & 0x3ff, 0);
      EXPECT_EQ(F32ToBF16(f) & 0x7f80, 0x7f80);
      EXPECT_NE(F32ToBF16(f) & 0x7f, 0);
      continue;
    }
    ASSERT_EQ(F32ToF16(f), RefF16(f)) << std::hex << p;
    ASSERT_EQ(F32ToBF16(f), RefBF16(f)) << std::hex << p;
  }
}

// ---- Kernels against a double reference.

// Converts a double reference result to the storage bits of `dtype` (exactly, for values the
// type can hold; rounded like the kernels for f16/bf16; wrapped for integers).
void StoreRef(DataType dtype, double v, void* out) {
  switch (dtype) {
    case DataType::kF32: *static_cast<float*>(out) = static_cast<float>(v); return;
    case DataType::kF64: *static_cast<double*>(out) = v; return;
    case DataType::kF16: *static_cast<uint16_t*>(out) = std::isnan(v) ? 0x7e00 : RefF16(v); return;
    case DataType::kBF16:
      *static_cast<uint16_t*>(out) = std::isnan(v) ? 0x7fc0 : RefBF16(v);
      return;
    // Through int64 so that out-of-range products wrap like the kernels' integer math.
    case DataType::kI8:
      *static_cast<int8_t*>(out) = static_cast<int8_t>(static_cast<int64_t>(v));
      return;
    case DataType::kU8:
      *static_cast<uint8_t*>(out) = static_cast<uint8_t>(static_cast<int64_t>(v));
      return;
    case DataType::kI32:
      *static_cast<int32_t*>(out) = static_cast<int32_t>(static_cast<int64_t>(v));
      return;
    case DataType::kI64: *static_cast<int64_t*>(out) = static_cast<int64_t>(v); return;
  }
}

double LoadRef(DataType dtype, const void* p) {
  switch (dtype) {
    case DataType::kF32: return *static_cast<const float*>(p);
    case DataType::kF64: return *static_cast<const double*>(p);
    case DataType::kF16: return RefF16Value(*static_cast<const uint16_t*>(p));
    case DataType::kBF16: return BF16ToF32(*static_cast<const uint16_t*>(p));
    case DataType::kI8: return *static_cast<const int8_t*>(p);
    case DataType::kU8: return *static_cast<const uint8_t*>(p);
    case DataType::kI32: return *static_cast<const int32_t*>(p);
    case DataType::kI64: return static_cast<double>(*static_cast<const int64_t*>(p));
  }
  return 0;
}

double RefOp(ReduceOp op, double a, double b) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg: return a + b;
    case ReduceOp::kProduct: return a * b;
    case ReduceOp::kMin: return (b < a || std::isnan(b)) ? b : a;
    case ReduceOp::kMax: return (b > a || std::isnan(b)) ? b : a;
  }
  return 0;
}

// Random inputs whose pairwise results are exact in double and in range for the type: small
// integers (|x| <= 11, so i8 products fit; u8 products wrap), f32/f64 values with mixed
// magnitudes (sums and products of two f32 are exact in double, so rounding happens once), and
// for f16/bf16 values up to 200 (products stay finite) with some f16 subnormals.
std::vector<char> RandomData(DataType dtype, size_t count, std::mt19937& rng) {
  std::vector<char> data(count * SizeOf(dtype));
  std::uniform_int_distribution<int> small(-11, 11);
  std::uniform_int_distribution<int> half_exp(-7, 1);
  std::uniform_real_distribution<double> real(-100, 100);
  const bool half = dtype == DataType::kF16 || dtype == DataType::kBF16;
  for (size_t i = 0; i < count; ++i) {
    double v;
    if (dtype == DataType::kU8) {
      v = small(rng) + 11;
    } else if (half) {
      const int e = half_exp(rng);
      v = real(rng) * std::ldexp(1.0, e == -7 ? -26 : e);
    } else if (IsFloatingPoint(dtype)) {
      v = real(rng) * std::ldexp(1.0, small(rng));
    } else {
      v = small(rng);
    }
    StoreRef(dtype, v, data.data() + i * SizeOf(dtype));
  }
  return data;
}

constexpr DataType kAllTypes[] = {DataType::kF32, DataType::kF64, DataType::kF16, DataType::kBF16,
                                  DataType::kI8,  DataType::kU8,  DataType::kI32, DataType::kI64};
constexpr ReduceOp kAllOps[] = {ReduceOp::kSum, ReduceOp::kProduct, ReduceOp::kMin, ReduceOp::kMax,
                                ReduceOp::kAvg};

TEST(Reduce, EveryDtypeAndOpMatchesTheDoubleReference) {
  std::mt19937 rng(1);
  for (DataType dtype : kAllTypes) {
    const size_t esize = SizeOf(dtype);
    for (ReduceOp op : kAllOps) {
      for (size_t count : {0, 1, 7, 4097}) {
        SCOPED_TRACE(testing::Message()
                     << DataTypeName(dtype) << " " << ReduceOpName(op) << " count " << count);
        std::vector<char> a = RandomData(dtype, count, rng);
        std::vector<char> b = RandomData(dtype, count, rng);
        std::vector<char> want(a.size());
        for (size_t i = 0; i < count; ++i) {
          StoreRef(dtype, RefOp(op, LoadRef(dtype, &a[i * esize]), LoadRef(dtype, &b[i * esize])),
                   &want[i * esize]);
        }
        // Disjoint output, output == first operand (ReduceInto), output == second operand.
        std::vector<char> out(a.size());
        ReduceTo(op, dtype, out.data(), a.data(), b.data(), count);
        EXPECT_EQ(out, want);
        std::vector<char> io = a;
        ReduceInto(op, dtype, io.data(), b.data(), count);
        EXPECT_EQ(io, want);
        io = b;
        ReduceTo(op, dtype, io.data(), a.data(), io.data(), count);
        EXPECT_EQ(io, want);
      }
    }
  }
}

TEST(Reduce, IntegersWrapAround) {
  std::vector<int8_t> a = {127, -128, 100}, b = {1, -1, 3};
  ReduceInto(ReduceOp::kSum, DataType::kI8, a.data(), b.data(), 3);
  EXPECT_EQ(a, (std::vector<int8_t>{-128, 127, 103}));
  std::vector<int32_t> c = {1 << 30}, d = {4};
  ReduceInto(ReduceOp::kProduct, DataType::kI32, c.data(), d.data(), 1);
  EXPECT_EQ(c[0], 0);
  std::vector<uint8_t> e = {200}, f = {200};
  ReduceInto(ReduceOp::kProduct, DataType::kU8, e.data(), f.data(), 1);
  EXPECT_EQ(e[0], static_cast<uint8_t>(40000 % 256));
}

TEST(Reduce, MinMaxPropagateNan) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> a = {nan, 1.0f, -INFINITY, 2.0f};
  std::vector<float> b = {1.0f, nan, 3.0f, INFINITY};
  std::vector<float> mn(4), mx(4);
  ReduceTo(ReduceOp::kMin, DataType::kF32, mn.data(), a.data(), b.data(), 4);
  ReduceTo(ReduceOp::kMax, DataType::kF32, mx.data(), a.data(), b.data(), 4);
  EXPECT_TRUE(std::isnan(mn[0]) && std::isnan(mn[1]) && std::isnan(mx[0]) && std::isnan(mx[1]));
  EXPECT_EQ(mn[2], -INFINITY);
  EXPECT_EQ(mx[3], INFINITY);
}

TEST(Reduce, HalfSumRoundsOnceToNearestEven) {
  // 2048 + 1 is a tie in f16 (ulp 2 at 2048): rounds to even 2048; 2050 + 1 rounds up to 2052.
  std::vector<uint16_t> a = {F32ToF16(2048), F32ToF16(2050), F32ToF16(65504)};
  std::vector<uint16_t> b = {F32ToF16(1), F32ToF16(1), F32ToF16(65504)};
  ReduceInto(ReduceOp::kSum, DataType::kF16, a.data(), b.data(), 3);
  EXPECT_EQ(F16ToF32(a[0]), 2048.0f);
  EXPECT_EQ(F16ToF32(a[1]), 2052.0f);
  EXPECT_EQ(F16ToF32(a[2]), INFINITY);
}

// Every 16-bit pattern as the left operand, against a scrambled pattern as the right one, in
// place and out of place: the sum (vectorized where the CPU allows) must match the scalar
// definition bit for bit (widen, add in f32, round once), with any NaN giving a NaN.
TEST(ReduceTo, HalfSumsMatchTheScalarDefinitionForEveryPattern) {
  struct Half {
    DataType dtype;
    float (*load)(uint16_t);
    uint16_t (*store)(float);
    bool (*is_nan)(uint16_t);
  };
  const Half halves[] = {
      {DataType::kF16, &F16ToF32, &F32ToF16,
       [](uint16_t h) { return (h & 0x7c00) == 0x7c00 && (h & 0x3ff) != 0; }},
      {DataType::kBF16, &BF16ToF32, &F32ToBF16,
       [](uint16_t h) { return (h & 0x7f80) == 0x7f80 && (h & 0x7f) != 0; }},
  };
  for (const Half& h : halves) {
    const size_t n = 65536 + 5;  // a tail past the 8-wide blocks
    std::vector<uint16_t> a(n), b(n), out(n), want(n);
    for (size_t i = 0; i < n; ++i) {
      a[i] = static_cast<uint16_t>(i);
      b[i] = static_cast<uint16_t>(i * 40503u + 977u);
      want[i] = h.store(h.load(a[i]) + h.load(b[i]));
    }
    for (bool in_place : {false, true}) {
      std::vector<uint16_t> io = a;
      uint16_t* dst = in_place ? io.data() : out.data();
      ReduceTo(ReduceOp::kSum, h.dtype, dst, in_place ? io.data() : a.data(), b.data(), n);
      for (size_t i = 0; i < n; ++i) {
        if (h.is_nan(want[i])) {
          ASSERT_TRUE(h.is_nan(dst[i])) << DataTypeName(h.dtype) << " i=" << i;
        } else {
          ASSERT_EQ(dst[i], want[i]) << DataTypeName(h.dtype) << " " << std::hex << a[i]
                                     << " + " << b[i];
        }
      }
    }
  }
}

TEST(DivideBy, FloatsDivideInTheirComputeType) {
  for (DataType dtype : {DataType::kF32, DataType::kF64, DataType::kF16, DataType::kBF16}) {
    std::mt19937 rng(3);
    for (size_t count : {0, 1, 7, 4097}) {
      std::vector<char> data = RandomData(dtype, count, rng);
      std::vector<char> want(data.size());
      const size_t es = SizeOf(dtype);
      for (size_t i = 0; i < count; ++i) {
        const double v = LoadRef(dtype, &data[i * es]);
        // The kernels divide in f32 for 16-bit types; division by 3 is inexact, so the
        // reference divides in the same type.
        const double q =
            dtype == DataType::kF64 ? v / 3 : static_cast<double>(static_cast<float>(v) / 3.0f);
        StoreRef(dtype, q, &want[i * es]);
      }
      DivideBy(dtype, data.data(), count, 3);
      EXPECT_EQ(data, want) << DataTypeName(dtype) << " " << count;
    }
  }
  std::vector<int32_t> ints = {7, -7};
  DivideBy(DataType::kI32, ints.data(), 2, 2);
  EXPECT_EQ(ints, (std::vector<int32_t>{3, -3}));
}

}  // namespace
}  // namespace fairscale::comm
