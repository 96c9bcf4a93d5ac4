// Reference values for multi-rank tests (//comm/testing:reference): element encoding for every
// comm DataType (including f16 and bf16, which have no C++ type here), deterministic inputs that
// keep every reduction exact, and the single-process reference reduction. The conformance suite
// computes its expected results with these; feature tests may use them the same way.
//
// Values travel as long double: on x86-64 it has a 64-bit significand, so every i64 and every
// sum of a few i64 test inputs is exact.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "comm/types.h"

namespace fairscale::comm::testing {

// IEEE binary16 and bfloat16 conversions, rounding to nearest even (NaN stays NaN).
uint16_t FloatToHalf(float value);
float HalfToFloat(uint16_t bits);
uint16_t FloatToBFloat16(float value);
float BFloat16ToFloat(uint16_t bits);

// Writes `value` as one element of `dtype` at `dst` (SizeOf(dtype) bytes). Floating types round
// to nearest; integer types truncate (test values are exact integers in range).
void EncodeValue(DataType dtype, long double value, void* dst);
// Reads one element of `dtype` at `src`.
long double DecodeValue(DataType dtype, const void* src);

// Input of `rank` at element `index` for a reduction with `op`, chosen so that the reduction of
// up to kMaxExactRanks ranks is exact in `dtype` (and, for every op but kAvg, bit-exact whatever
// the order of the reduction): small integers for sum/min/max/avg, scaled up for i32/i64 so that
// high bits are exercised; values in {-1, 1, 2} ({1, 2} for u8) for product.
// Every DataType and ReduceOp of comm/types.h, for the tests that sweep them (the conformance
// suite, reference_test, nccl_test).
inline constexpr DataType kAllDataTypes[] = {DataType::kF32, DataType::kF64, DataType::kF16,
                                             DataType::kBF16, DataType::kI8,  DataType::kU8,
                                             DataType::kI32, DataType::kI64};
inline constexpr ReduceOp kAllReduceOps[] = {ReduceOp::kSum, ReduceOp::kProduct, ReduceOp::kMin,
                                             ReduceOp::kMax, ReduceOp::kAvg};

inline constexpr int kMaxExactRanks = 4;
long double ReductionInput(DataType dtype, ReduceOp op, int rank, size_t index);

// A value of `dtype` derived from `key` (e.g. a hash of rank, block, index), exact in `dtype`,
// for checking data movement (gather, broadcast, all_to_all, send/recv).
long double MovementValue(DataType dtype, uint64_t key);
// A key that identifies (a, b, c); use with MovementValue.
uint64_t MovementKey(uint64_t a, uint64_t b, uint64_t c);

// The reference reduction of ReductionInput(dtype, op, r, index) over ranks 0..size-1.
long double ReferenceReduction(DataType dtype, ReduceOp op, int size, size_t index);

// Tolerance of a kAvg result relative to max(1, |expected|): f16 and bf16 are reduced in f32 and
// rounded back per step, and the division rounds once more.
double AvgTolerance(DataType dtype);

}  // namespace fairscale::comm::testing
