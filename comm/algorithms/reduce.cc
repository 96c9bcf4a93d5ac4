#include "comm/algorithms/reduce.h"

#include <cstdint>
#include <type_traits>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace fairscale::comm {
namespace {

// How an element is stored and how it is computed on. Native types compute as themselves;
// f16/bf16 are stored as uint16_t and computed in f32.
template <typename T>
struct NativeType {
  using Storage = T;
  using Compute = T;
  static T Load(T v) { return v; }
  static T Store(T v) { return v; }
};
struct F16Type {
  using Storage = uint16_t;
  using Compute = float;
  static float Load(uint16_t v) { return F16ToF32(v); }
  static uint16_t Store(float v) { return F32ToF16(v); }
};
struct BF16Type {
  using Storage = uint16_t;
  using Compute = float;
  static float Load(uint16_t v) { return BF16ToF32(v); }
  static uint16_t Store(float v) { return F32ToBF16(v); }
};

// Integer sum and product wrap around: compute in the unsigned type (signed overflow is UB).
template <typename C>
struct SumFn {
  C operator()(C a, C b) const {
    if constexpr (std::is_integral_v<C>) {
      using U = std::make_unsigned_t<C>;
      return static_cast<C>(static_cast<U>(static_cast<U>(a) + static_cast<U>(b)));
    } else {
      return a + b;
    }
  }
};
template <typename C>
struct ProductFn {
  C operator()(C a, C b) const {
    if constexpr (std::is_integral_v<C>) {
      // uint8/uint16 would promote to int and could overflow it; unsigned int does not promote.
      using U =
          std::conditional_t<(sizeof(C) < sizeof(unsigned)), unsigned, std::make_unsigned_t<C>>;
      return static_cast<C>(static_cast<U>(a) * static_cast<U>(b));
    } else {
      return a * b;
    }
  }
};
// NaN-propagating min/max: a NaN b is taken explicitly; a NaN a is kept because every
// comparison with it is false.
template <typename C>
bool IsNan(C v) {
  if constexpr (std::is_floating_point_v<C>) {
    return v != v;
  } else {
    return false;
  }
}
template <typename C>
struct MinFn {
  C operator()(C a, C b) const { return (b < a || IsNan(b)) ? b : a; }
};
template <typename C>
struct MaxFn {
  C operator()(C a, C b) const { return (b > a || IsNan(b)) ? b : a; }
};

// Blocks of a fixed element count give the vectorizer a known trip count, which GCC's -O2 cost
// model requires; the tail runs scalar.
constexpr size_t kBlock = 16;

// out = a (op) b over disjoint buffers.
template <typename Ty, typename Fn>
void Disjoint(typename Ty::Storage* __restrict out, const typename Ty::Storage* __restrict a,
              const typename Ty::Storage* __restrict b, size_t n, Fn fn) {
  size_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    for (size_t k = 0; k < kBlock; ++k) {
      out[i + k] = Ty::Store(fn(Ty::Load(a[i + k]), Ty::Load(b[i + k])));
    }
  }
  for (; i < n; ++i) out[i] = Ty::Store(fn(Ty::Load(a[i]), Ty::Load(b[i])));
}

// io = io (op) other, or io = other (op) io when kIoIsRight (the operand order matters for NaN
// payloads and for f16 rounding only in theory, but keeping it makes results order-exact).
template <typename Ty, bool kIoIsRight, typename Fn>
void InPlace(typename Ty::Storage* __restrict io, const typename Ty::Storage* __restrict other,
             size_t n, Fn fn) {
  auto apply = [&fn](typename Ty::Storage x, typename Ty::Storage y) {
    return kIoIsRight ? Ty::Store(fn(Ty::Load(y), Ty::Load(x)))
                      : Ty::Store(fn(Ty::Load(x), Ty::Load(y)));
  };
  size_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    for (size_t k = 0; k < kBlock; ++k) io[i + k] = apply(io[i + k], other[i + k]);
  }
  for (; i < n; ++i) io[i] = apply(io[i], other[i]);
}

// Any aliasing (out == a == b): plain scalar loop without restrict promises.
template <typename Ty, typename Fn>
void Aliased(typename Ty::Storage* out, const typename Ty::Storage* a,
             const typename Ty::Storage* b, size_t n, Fn fn) {
  for (size_t i = 0; i < n; ++i) out[i] = Ty::Store(fn(Ty::Load(a[i]), Ty::Load(b[i])));
}

template <typename Ty, typename Fn>
void Apply(void* out_v, const void* a_v, const void* b_v, size_t n, Fn fn) {
  using S = typename Ty::Storage;
  auto* out = static_cast<S*>(out_v);
  const auto* a = static_cast<const S*>(a_v);
  const auto* b = static_cast<const S*>(b_v);
  if (a == b) {
    Aliased<Ty>(out, a, b, n, fn);
  } else if (out == a) {
    InPlace<Ty, false>(out, b, n, fn);
  } else if (out == b) {
    InPlace<Ty, true>(out, a, n, fn);
  } else {
    Disjoint<Ty>(out, a, b, n, fn);
  }
}

template <typename Ty>
void ReduceTyped(ReduceOp op, void* out, const void* a, const void* b, size_t n) {
  using C = typename Ty::Compute;
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg: return Apply<Ty>(out, a, b, n, SumFn<C>());
    case ReduceOp::kProduct: return Apply<Ty>(out, a, b, n, ProductFn<C>());
    case ReduceOp::kMin: return Apply<Ty>(out, a, b, n, MinFn<C>());
    case ReduceOp::kMax: return Apply<Ty>(out, a, b, n, MaxFn<C>());
  }
}

template <typename Ty>
void DivideTyped(void* data_v, size_t n, int divisor) {
  using C = typename Ty::Compute;
  auto* data = static_cast<typename Ty::Storage*>(data_v);
  const C d = static_cast<C>(divisor);
  size_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    for (size_t k = 0; k < kBlock; ++k) data[i + k] = Ty::Store(Ty::Load(data[i + k]) / d);
  }
  for (; i < n; ++i) data[i] = Ty::Store(Ty::Load(data[i]) / d);
}

// Calls fn.template operator()<Traits>() for the dtype's traits.
template <typename Fn>
void Dispatch(DataType dtype, Fn&& fn) {
  switch (dtype) {
    case DataType::kF32: return fn(NativeType<float>());
    case DataType::kF64: return fn(NativeType<double>());
    case DataType::kF16: return fn(F16Type());
    case DataType::kBF16: return fn(BF16Type());
    case DataType::kI8: return fn(NativeType<int8_t>());
    case DataType::kU8: return fn(NativeType<uint8_t>());
    case DataType::kI32: return fn(NativeType<int32_t>());
    case DataType::kI64: return fn(NativeType<int64_t>());
  }
}

#if defined(__x86_64__)
// Half-precision sums with AVX2 + F16C, chosen at run time. The generic loops above convert
// f16/bf16 one element at a time (GCC does not vectorize them), which caps half-precision
// reductions at 1-2 GB/s, below loopback TCP. These compute exactly what the generic path does:
// widen to f32 (exact), add in f32, round to nearest even once; a NaN stays a quiet NaN.
// Elements are processed 8 at a time, loads before stores, so out may be a or b.
__attribute__((target("avx2,f16c"))) void SumF16Avx2(uint16_t* out, const uint16_t* a,
                                                     const uint16_t* b, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a + i)));
    const __m256 y = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + i)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i),
                     _mm256_cvtps_ph(_mm256_add_ps(x, y), _MM_FROUND_TO_NEAREST_INT));
  }
  for (; i < n; ++i) out[i] = F32ToF16(F16ToF32(a[i]) + F16ToF32(b[i]));
}

__attribute__((target("avx2"))) void SumBF16Avx2(uint16_t* out, const uint16_t* a,
                                                 const uint16_t* b, size_t n) {
  const __m256i round_bias = _mm256_set1_epi32(0x7fff);
  const __m256i one = _mm256_set1_epi32(1);
  const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff);
  const __m256i inf = _mm256_set1_epi32(0x7f800000);
  const __m256i quiet = _mm256_set1_epi32(0x00400000);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256i xa = _mm256_slli_epi32(
        _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a + i))), 16);
    const __m256i xb = _mm256_slli_epi32(
        _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + i))), 16);
    const __m256i sum = _mm256_castps_si256(
        _mm256_add_ps(_mm256_castsi256_ps(xa), _mm256_castsi256_ps(xb)));
    // Round to nearest even on the bits; a NaN is truncated with its quiet bit set instead
    // (the rounding carry could otherwise turn it into an infinity).
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(sum, 16), one);
    const __m256i rounded = _mm256_add_epi32(_mm256_add_epi32(sum, round_bias), lsb);
    const __m256i is_nan = _mm256_cmpgt_epi32(_mm256_and_si256(sum, abs_mask), inf);
    const __m256i bits = _mm256_srli_epi32(
        _mm256_blendv_epi8(rounded, _mm256_or_si256(sum, quiet), is_nan), 16);
    // 8 x 32-bit -> 8 x 16-bit: pack within lanes, then gather the two lanes' halves.
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(bits, bits), 0x08);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm256_castsi256_si128(packed));
  }
  for (; i < n; ++i) out[i] = F32ToBF16(BF16ToF32(a[i]) + BF16ToF32(b[i]));
}

bool HasAvx2F16c() {
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
  return has;
}

// True when the sum was done here.
bool FastHalfSum(ReduceOp op, DataType dtype, void* out, const void* a, const void* b, size_t n) {
  if ((op != ReduceOp::kSum && op != ReduceOp::kAvg) || !HasAvx2F16c()) return false;
  auto* o = static_cast<uint16_t*>(out);
  const auto* x = static_cast<const uint16_t*>(a);
  const auto* y = static_cast<const uint16_t*>(b);
  if (dtype == DataType::kF16) {
    SumF16Avx2(o, x, y, n);
    return true;
  }
  if (dtype == DataType::kBF16) {
    SumBF16Avx2(o, x, y, n);
    return true;
  }
  return false;
}
#else
bool FastHalfSum(ReduceOp, DataType, void*, const void*, const void*, size_t) { return false; }
#endif

}  // namespace

void ReduceTo(ReduceOp op, DataType dtype, void* out, const void* a, const void* b, size_t count) {
  if (count == 0) return;
  if (FastHalfSum(op, dtype, out, a, b, count)) return;
  Dispatch(dtype, [&](auto traits) { ReduceTyped<decltype(traits)>(op, out, a, b, count); });
}

void ReduceInto(ReduceOp op, DataType dtype, void* inout, const void* in, size_t count) {
  ReduceTo(op, dtype, inout, inout, in, count);
}

void DivideBy(DataType dtype, void* data, size_t count, int n) {
  if (count == 0 || n == 1) return;
  Dispatch(dtype, [&](auto traits) { DivideTyped<decltype(traits)>(data, count, n); });
}

}  // namespace fairscale::comm
