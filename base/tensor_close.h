// Test helper: a relative-norm comparison of two tensors as an absl::Status, for the packages'
// parity tests (fsdp, pipe) that check many tensors per rank and report the first difference.
#pragma once

#include <ATen/core/Tensor.h>

#include <string>

#include "absl/status/status.h"

namespace fairscale::base {

// OK if ||actual - expected|| <= rtol * ||expected|| (in double; both ~0 counts as equal);
// kInternal naming `what` (undefined tensor, shape mismatch, or the relative error) otherwise.
absl::Status ExpectTensorClose(const std::string& what, const at::Tensor& actual,
                               const at::Tensor& expected, double rtol);

}  // namespace fairscale::base
