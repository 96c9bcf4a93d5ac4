// Bit-exact conversions between f32 and the 16-bit float formats f16 (IEEE binary16) and bf16
// (//comm/algorithms:reduce). The reduction kernels use them to compute f16/bf16 in f32, and
// tests and backends use them to build and check half-precision data.
//
// Narrowing rounds to nearest, ties to even; overflow gives +-inf; subnormals are handled
// exactly. NaNs keep their sign and the top bits of their payload; a payload that would
// truncate to zero gets the quiet bit instead, so a NaN never becomes inf and every 16-bit
// pattern survives a 16 -> 32 -> 16 round trip unchanged.
//
// The functions are branch-free (selects written as masks) so that loops over them vectorize
// at -O2 with the baseline x86-64 instruction set.
#pragma once

#include <cstdint>
#include <cstring>

namespace fairscale::comm {
namespace half_internal {

template <typename To, typename From>
inline To BitCast(From from) {
  static_assert(sizeof(To) == sizeof(From), "BitCast needs equal sizes");
  To to;
  std::memcpy(&to, &from, sizeof(to));
  return to;
}

// cond ? a : b, written with a mask: GCC if-converts and vectorizes this, not a ternary.
inline int32_t Select(bool cond, int32_t a, int32_t b) {
  const int32_t mask = -static_cast<int32_t>(cond);
  return (a & mask) | (b & ~mask);
}

}  // namespace half_internal

inline float F16ToF32(uint16_t h) {
  using half_internal::BitCast;
  using half_internal::Select;
  const int32_t magnitude = h & 0x7fff;  // exponent and mantissa
  const int32_t shifted = magnitude << 13;
  const int32_t normal = shifted + (112 << 23);  // rebias the exponent: 127 - 15
  const int32_t inf_nan = shifted | 0x7f800000;
  // Subnormal m * 2^-24: place m under the exponent of 2^-14 and subtract 2^-14 (exact in f32).
  const float subnormal =
      BitCast<float>(shifted + (113 << 23)) - BitCast<float>(static_cast<int32_t>(113 << 23));
  int32_t bits = Select(magnitude >= 0x7c00, inf_nan, normal);
  bits = Select(magnitude < 0x0400, BitCast<int32_t>(subnormal), bits);
  return BitCast<float>(bits | (static_cast<int32_t>(h & 0x8000) << 16));
}

inline uint16_t F32ToF16(float f) {
  using half_internal::BitCast;
  using half_internal::Select;
  const int32_t x = BitCast<int32_t>(f);
  const int32_t a = x & 0x7fffffff;
  // Normal result: rebias, then round to nearest even by adding half an ulp minus one plus the
  // lowest kept bit; a carry out of the mantissa correctly bumps the exponent.
  const int32_t normal = (a - (112 << 23) + 0xfff + ((a >> 13) & 1)) >> 13;
  // Subnormal result (|f| < 2^-14): adding 0.5 puts the f16 subnormal ulp (2^-24) at the f32
  // ulp, so the FPU's round-to-nearest-even does the rounding.
  const int32_t subnormal = BitCast<int32_t>(BitCast<float>(a) + 0.5f) - 0x3f000000;
  const int32_t payload = (a >> 13) & 0x3ff;
  const int32_t nan = 0x7c00 | Select(payload == 0, 0x200, payload);
  int32_t r = Select(a < 0x38800000, subnormal, normal);
  r = Select(a >= 0x477ff000, 0x7c00, r);  // rounds to 65520 or more: inf
  r = Select(a > 0x7f800000, nan, r);
  return static_cast<uint16_t>(r | ((x >> 16) & 0x8000));
}

inline float BF16ToF32(uint16_t h) {
  return half_internal::BitCast<float>(static_cast<uint32_t>(h) << 16);
}

inline uint16_t F32ToBF16(float f) {
  using half_internal::BitCast;
  using half_internal::Select;
  const int32_t x = BitCast<int32_t>(f);
  const int32_t a = x & 0x7fffffff;
  // Round to nearest even on the magnitude; overflow carries into the exponent (inf).
  const int32_t rounded = static_cast<int32_t>(
      (static_cast<uint32_t>(a) + 0x7fffu + static_cast<uint32_t>((a >> 16) & 1)) >> 16);
  const int32_t truncated = a >> 16;
  const int32_t nan = Select((truncated & 0x7f) == 0, truncated | 0x40, truncated);
  const int32_t r = Select(a > 0x7f800000, nan, rounded);
  return static_cast<uint16_t>(r | ((x >> 16) & 0x8000));
}

}  // namespace fairscale::comm
