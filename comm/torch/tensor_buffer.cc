#include "comm/torch/tensor_buffer.h"

#include <sstream>

#include "absl/strings/str_cat.h"

namespace fairscale::comm {

absl::StatusOr<DataType> ToDataType(c10::ScalarType type) {
  switch (type) {
    case c10::ScalarType::Float: return DataType::kF32;
    case c10::ScalarType::Double: return DataType::kF64;
    case c10::ScalarType::Half: return DataType::kF16;
    case c10::ScalarType::BFloat16: return DataType::kBF16;
    case c10::ScalarType::Char: return DataType::kI8;
    case c10::ScalarType::Byte: return DataType::kU8;
    case c10::ScalarType::Int: return DataType::kI32;
    case c10::ScalarType::Long: return DataType::kI64;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("tensor dtype ", c10::toString(type), " has no comm DataType"));
  }
}

c10::ScalarType ToScalarType(DataType dtype) {
  switch (dtype) {
    case DataType::kF32: return c10::ScalarType::Float;
    case DataType::kF64: return c10::ScalarType::Double;
    case DataType::kF16: return c10::ScalarType::Half;
    case DataType::kBF16: return c10::ScalarType::BFloat16;
    case DataType::kI8: return c10::ScalarType::Char;
    case DataType::kU8: return c10::ScalarType::Byte;
    case DataType::kI32: return c10::ScalarType::Int;
    case DataType::kI64: return c10::ScalarType::Long;
  }
  return c10::ScalarType::Undefined;
}

absl::StatusOr<Buffer> ToBuffer(const at::Tensor& tensor) {
  if (!tensor.defined()) return absl::InvalidArgumentError("undefined tensor");
  auto dtype = ToDataType(tensor.scalar_type());
  if (!dtype.ok()) return dtype.status();
  if (tensor.layout() != c10::kStrided) {
    return absl::InvalidArgumentError("only dense (strided) tensors can be communicated");
  }
  if (!tensor.is_contiguous()) {
    std::ostringstream sizes;
    sizes << tensor.sizes() << " with strides " << tensor.strides();
    return absl::InvalidArgumentError(
        absl::StrCat("tensor of shape ", sizes.str(), " is not contiguous; call .contiguous()"));
  }
  Device device;
  if (tensor.is_cuda()) {
    device = Device::Cuda(tensor.device().index());
  } else if (!tensor.is_cpu()) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor on unsupported device ", tensor.device().str()));
  }
  return Buffer{tensor.numel() ? tensor.data_ptr() : nullptr, static_cast<size_t>(tensor.numel()),
                *dtype, device};
}

absl::StatusOr<ConstBuffer> ToConstBuffer(const at::Tensor& tensor) {
  auto b = ToBuffer(tensor);
  if (!b.ok()) return b.status();
  return ConstBuffer(*b);
}

}  // namespace fairscale::comm
