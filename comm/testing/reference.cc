#include "comm/testing/reference.h"

#include <algorithm>
#include <cmath>
#include <cstring>

namespace fairscale::comm::testing {
namespace {

uint32_t FloatBits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, sizeof(b));
  return b;
}

float BitsFloat(uint32_t b) {
  float f;
  std::memcpy(&f, &b, sizeof(f));
  return f;
}

template <typename T>
void Put(T v, void* dst) {
  std::memcpy(dst, &v, sizeof(T));
}

template <typename T>
T Get(const void* src) {
  T v;
  std::memcpy(&v, src, sizeof(T));
  return v;
}

// x in [0, span), from the high bits of a 64x64-bit product: a multiply instead of the division
// of x % span (the 64 MiB cases evaluate this hundreds of millions of times).
uint64_t Range(uint64_t x, uint64_t span) {
  return static_cast<uint64_t>((static_cast<unsigned __int128>(x) * span) >> 64);
}

// A small integer in [lo, lo + span) derived from (rank, index).
int64_t SmallInt(int rank, size_t index, int64_t lo, int64_t span) {
  const uint64_t h = (static_cast<uint64_t>(index) * 0x9e3779b97f4a7c15ull) ^
                     (static_cast<uint64_t>(rank + 1) * 0xc2b2ae3d27d4eb4full);
  return lo + static_cast<int64_t>(Range(h, static_cast<uint64_t>(span)));
}

}  // namespace

uint16_t FloatToHalf(float value) {
  const uint32_t x = FloatBits(value);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  const uint32_t abs = x & 0x7fffffffu;
  if (abs >= 0x7f800000u) {  // inf or NaN
    return static_cast<uint16_t>(sign | 0x7c00u | (abs > 0x7f800000u ? 0x0200u : 0u));
  }
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to inf
  if (abs < 0x38800000u) {  // below the smallest normal half (2^-14): subnormal or zero
    // value * 2^24 is the subnormal mantissa; nearbyint rounds to nearest even.
    const float scaled = BitsFloat(abs) * 16777216.0f;
    return static_cast<uint16_t>(sign | static_cast<uint16_t>(std::nearbyint(scaled)));
  }
  const uint32_t exp = (abs >> 23) - 127 + 15;
  const uint32_t mant = abs & 0x7fffffu;
  uint32_t h = (exp << 10) | (mant >> 13);
  const uint32_t rest = mant & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;  // a carry bumps the exponent
  return static_cast<uint16_t>(sign | h);
}

float HalfToFloat(uint16_t bits) {
  const uint32_t sign = static_cast<uint32_t>(bits & 0x8000u) << 16;
  const uint32_t exp = (bits >> 10) & 0x1fu;
  const uint32_t mant = bits & 0x3ffu;
  if (exp == 0) {
    const float v = std::ldexp(static_cast<float>(mant), -24);
    return sign ? -v : v;
  }
  if (exp == 31) return BitsFloat(sign | 0x7f800000u | (mant << 13));
  return BitsFloat(sign | ((exp - 15 + 127) << 23) | (mant << 13));
}

uint16_t FloatToBFloat16(float value) {
  const uint32_t x = FloatBits(value);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x0040u);
  const uint32_t rounded = x + 0x7fffu + ((x >> 16) & 1u);
  return static_cast<uint16_t>(rounded >> 16);
}

float BFloat16ToFloat(uint16_t bits) { return BitsFloat(static_cast<uint32_t>(bits) << 16); }

void EncodeValue(DataType dtype, long double value, void* dst) {
  switch (dtype) {
    case DataType::kF32: Put(static_cast<float>(value), dst); return;
    case DataType::kF64: Put(static_cast<double>(value), dst); return;
    case DataType::kF16: Put(FloatToHalf(static_cast<float>(value)), dst); return;
    case DataType::kBF16: Put(FloatToBFloat16(static_cast<float>(value)), dst); return;
    case DataType::kI8: Put(static_cast<int8_t>(value), dst); return;
    case DataType::kU8: Put(static_cast<uint8_t>(value), dst); return;
    case DataType::kI32: Put(static_cast<int32_t>(value), dst); return;
    case DataType::kI64: Put(static_cast<int64_t>(value), dst); return;
  }
}

long double DecodeValue(DataType dtype, const void* src) {
  switch (dtype) {
    case DataType::kF32: return Get<float>(src);
    case DataType::kF64: return Get<double>(src);
    case DataType::kF16: return HalfToFloat(Get<uint16_t>(src));
    case DataType::kBF16: return BFloat16ToFloat(Get<uint16_t>(src));
    case DataType::kI8: return Get<int8_t>(src);
    case DataType::kU8: return Get<uint8_t>(src);
    case DataType::kI32: return Get<int32_t>(src);
    case DataType::kI64: return Get<int64_t>(src);
  }
  return 0;
}

long double ReductionInput(DataType dtype, ReduceOp op, int rank, size_t index) {
  if (op == ReduceOp::kProduct) {
    // At most 2^4 in magnitude over kMaxExactRanks ranks: exact everywhere.
    if (dtype == DataType::kU8) return ((index + static_cast<size_t>(rank)) & 1) ? 2 : 1;
    static constexpr int kValues[3] = {-1, 1, 2};
    return kValues[SmallInt(rank, index, 0, 3)];
  }
  // Ranges whose sum over kMaxExactRanks ranks (and every partial sum) is exact in the dtype.
  switch (dtype) {
    case DataType::kI8: return SmallInt(rank, index, -30, 61);     // |sum| <= 120
    case DataType::kU8: return SmallInt(rank, index, 0, 61);       // sum <= 240
    case DataType::kBF16: return SmallInt(rank, index, -60, 121);  // |sum| <= 240 < 2^8
    case DataType::kF16: return SmallInt(rank, index, -500, 1001);  // |sum| <= 2000 < 2^11
    case DataType::kF32: return SmallInt(rank, index, -1000000, 2000001);  // < 2^24
    case DataType::kF64: return SmallInt(rank, index, -1000000, 2000001) * 1000000007.0L;
    // Large odd multiples exercise every byte (|sum| <= 4 * 5 * 99999989 < 2^31).
    case DataType::kI32: return SmallInt(rank, index, -5, 11) * 99999989.0L;
    // Beyond 2^53, so a reduction through double would lose the low bits.
    case DataType::kI64: return SmallInt(rank, index, -5, 11) * 14411518807585587.0L;
  }
  return 0;
}

uint64_t MovementKey(uint64_t a, uint64_t b, uint64_t c) {
  uint64_t h = 0x9e3779b97f4a7c15ull;
  for (uint64_t v : {a, b, c}) {
    h ^= v + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
    h *= 0xff51afd7ed558ccdull;
    h ^= h >> 33;
  }
  return h;
}

long double MovementValue(DataType dtype, uint64_t key) {
  auto in = [key](int64_t lo, uint64_t span) {
    return static_cast<long double>(lo + static_cast<int64_t>(Range(key, span)));
  };
  switch (dtype) {
    case DataType::kI8: return in(-128, 256);
    case DataType::kU8: return in(0, 256);
    case DataType::kBF16: return in(-256, 513);
    case DataType::kF16: return in(-2048, 4097);
    case DataType::kF32: return in(-(1 << 24), (1u << 25) + 1);
    case DataType::kF64: return in(-(1ll << 53), (1ull << 54) + 1);
    case DataType::kI32: return in(INT32_MIN, 1ull << 32);
    case DataType::kI64: return static_cast<long double>(static_cast<int64_t>(key));
  }
  return 0;
}

long double ReferenceReduction(DataType dtype, ReduceOp op, int size, size_t index) {
  long double acc = ReductionInput(dtype, op, 0, index);
  for (int r = 1; r < size; ++r) {
    const long double v = ReductionInput(dtype, op, r, index);
    switch (op) {
      case ReduceOp::kSum:
      case ReduceOp::kAvg: acc += v; break;
      case ReduceOp::kProduct: acc *= v; break;
      case ReduceOp::kMin: acc = std::min(acc, v); break;
      case ReduceOp::kMax: acc = std::max(acc, v); break;
    }
  }
  if (op == ReduceOp::kAvg) acc /= size;
  return acc;
}

double AvgTolerance(DataType dtype) {
  switch (dtype) {
    case DataType::kF32: return 1e-6;
    case DataType::kF64: return 1e-13;
    case DataType::kF16: return 2e-3;    // 2 ulp at 2^-10
    case DataType::kBF16: return 1.6e-2;  // 2 ulp at 2^-7
    default: return 0;
  }
}

}  // namespace fairscale::comm::testing
