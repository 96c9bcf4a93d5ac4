#include "comm/types.h"

#include "absl/strings/str_cat.h"

namespace fairscale::comm {

size_t SizeOf(DataType dtype) {
  switch (dtype) {
    case DataType::kF32: return 4;
    case DataType::kF64: return 8;
    case DataType::kF16: return 2;
    case DataType::kBF16: return 2;
    case DataType::kI8: return 1;
    case DataType::kU8: return 1;
    case DataType::kI32: return 4;
    case DataType::kI64: return 8;
  }
  return 0;  // an out-of-range enum value; Communicator validation rejects it
}

absl::string_view DataTypeName(DataType dtype) {
  switch (dtype) {
    case DataType::kF32: return "f32";
    case DataType::kF64: return "f64";
    case DataType::kF16: return "f16";
    case DataType::kBF16: return "bf16";
    case DataType::kI8: return "i8";
    case DataType::kU8: return "u8";
    case DataType::kI32: return "i32";
    case DataType::kI64: return "i64";
  }
  return "invalid-dtype";
}

bool IsFloatingPoint(DataType dtype) {
  return dtype == DataType::kF32 || dtype == DataType::kF64 || dtype == DataType::kF16 ||
         dtype == DataType::kBF16;
}

absl::string_view ReduceOpName(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return "sum";
    case ReduceOp::kProduct: return "product";
    case ReduceOp::kMin: return "min";
    case ReduceOp::kMax: return "max";
    case ReduceOp::kAvg: return "avg";
  }
  return "invalid-op";
}

std::string DeviceName(Device device) {
  if (device.type == DeviceType::kCpu) return "cpu";
  return absl::StrCat("cuda:", device.index);
}

}  // namespace fairscale::comm
