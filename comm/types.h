// Element types, reduction operators and buffers of the comm interface (//comm:interface).
//
// A Buffer is a view (pointer, element count, dtype, device) over memory the caller owns; the comm
// layer never allocates or frees it. Every feature library talks to backends in these terms, so
// this header has no LibTorch dependency (//comm/torch adapts at::Tensor to Buffer).
#pragma once

// Every fairscale-cpp header includes this one (through //comm:interface).
#if __cplusplus < 201703L
#error "fairscale-cpp needs C++17: compile with -std=c++17 (Bazel: `build --cxxopt=-std=c++17` in your .bazelrc, or copts = [\"-std=c++17\"] on your targets)"
#endif

#include <cstddef>
#include <cstdint>
#include <string>
#include "absl/strings/string_view.h"

namespace fairscale::comm {

enum class DataType : uint8_t { kF32, kF64, kF16, kBF16, kI8, kU8, kI32, kI64 };
inline constexpr int kNumDataTypes = 8;

// Bytes per element.
size_t SizeOf(DataType dtype);
// "f32", "f64", "f16", "bf16", "i8", "u8", "i32", "i64".
absl::string_view DataTypeName(DataType dtype);
bool IsFloatingPoint(DataType dtype);

// kAvg divides the sum by the group size; it is defined for floating-point types only (an
// integer kAvg is kInvalidArgument: truncating silently is the wrong default).
// f16 and bf16 are reduced in f32 and rounded back once per reduction step.
enum class ReduceOp : uint8_t { kSum, kProduct, kMin, kMax, kAvg };
inline constexpr int kNumReduceOps = 5;
absl::string_view ReduceOpName(ReduceOp op);  // "sum", "product", "min", "max", "avg"

enum class DeviceType : uint8_t { kCpu, kCuda };

struct Device {
  DeviceType type = DeviceType::kCpu;
  int index = -1;  // CUDA ordinal; -1 for CPU

  static Device Cpu() { return {}; }
  static Device Cuda(int index) { return {DeviceType::kCuda, index}; }
  bool operator==(const Device& o) const { return type == o.type && index == o.index; }
  bool operator!=(const Device& o) const { return !(*this == o); }
};
std::string DeviceName(Device device);  // "cpu", "cuda:0"

// Writable view of `count` elements of `dtype` at `data`. data may be null only when count == 0.
struct Buffer {
  void* data = nullptr;
  size_t count = 0;
  DataType dtype = DataType::kF32;
  Device device = {};

  size_t bytes() const { return count * SizeOf(dtype); }
  // Elements [offset, offset + n) of this buffer. The caller keeps offset + n <= count.
  Buffer Slice(size_t offset, size_t n) const {
    return {static_cast<char*>(data) + offset * SizeOf(dtype), n, dtype, device};
  }
};

// Read-only view; every Buffer converts to one.
struct ConstBuffer {
  const void* data = nullptr;
  size_t count = 0;
  DataType dtype = DataType::kF32;
  Device device = {};

  ConstBuffer() = default;
  ConstBuffer(const void* d, size_t n, DataType t, Device dev = {})
      : data(d), count(n), dtype(t), device(dev) {}
  ConstBuffer(const Buffer& b)  // NOLINT: implicit by design, like span<const T>
      : data(b.data), count(b.count), dtype(b.dtype), device(b.device) {}

  size_t bytes() const { return count * SizeOf(dtype); }
  ConstBuffer Slice(size_t offset, size_t n) const {
    return {static_cast<const char*>(data) + offset * SizeOf(dtype), n, dtype, device};
  }
};

// Typed helpers for host memory: MakeBuffer(vec.data(), vec.size()).
template <typename T>
struct DataTypeOf;
template <> struct DataTypeOf<float> { static constexpr DataType value = DataType::kF32; };
template <> struct DataTypeOf<double> { static constexpr DataType value = DataType::kF64; };
template <> struct DataTypeOf<int8_t> { static constexpr DataType value = DataType::kI8; };
template <> struct DataTypeOf<uint8_t> { static constexpr DataType value = DataType::kU8; };
template <> struct DataTypeOf<int32_t> { static constexpr DataType value = DataType::kI32; };
template <> struct DataTypeOf<int64_t> { static constexpr DataType value = DataType::kI64; };

template <typename T>
Buffer MakeBuffer(T* data, size_t count) {
  return {data, count, DataTypeOf<T>::value, Device::Cpu()};
}
template <typename T>
ConstBuffer MakeConstBuffer(const T* data, size_t count) {
  return {data, count, DataTypeOf<T>::value, Device::Cpu()};
}

}  // namespace fairscale::comm
