// at::Tensor <-> comm Buffer adapters (//comm/torch): the one place where the comm layer meets
// LibTorch. Feature libraries (fsdp, oss, pipe, ...) turn tensors into Buffers here and hand them
// to a Communicator; the tensor must outlive the Work.
#pragma once

#include <ATen/core/Tensor.h>

#include "absl/status/statusor.h"
#include "comm/types.h"

namespace fairscale::comm {

// The comm DataType of a scalar type; kInvalidArgument for types the comm layer does not carry
// (bool, complex, quantized, ...).
absl::StatusOr<DataType> ToDataType(c10::ScalarType type);
c10::ScalarType ToScalarType(DataType dtype);

// A view of the whole tensor. kInvalidArgument (naming the tensor's dtype, device or strides)
// unless it is contiguous, dense, and of a supported dtype. Zero-element tensors are fine.
absl::StatusOr<Buffer> ToBuffer(const at::Tensor& tensor);
absl::StatusOr<ConstBuffer> ToConstBuffer(const at::Tensor& tensor);

}  // namespace fairscale::comm
