// Small helpers of FullyShardedDataParallelImpl shared by its source files
// (fully_sharded_data_parallel.cc, gradient_reduction.cc).
#pragma once

#include <ATen/core/Tensor.h>

#include <string>
#include <utility>

#include "comm/torch/tensor_buffer.h"
#include "fsdp/fsdp_options.h"
#include "fsdp/internal/errors.h"

namespace fairscale::fsdp::internal {

// The (pre, post) divide factors of a unit's gradients; see FsdpOptions.
inline std::pair<double, double> DivideFactors(const FsdpOptions& options, int world) {
  double pre = options.gradient_predivide_factor();
  double post = options.gradient_postdivide_factor();
  if (pre <= 0) pre = post > 0 ? 1.0 : default_gradient_predivide_factor(world);
  if (post <= 0) post = world / pre;
  return {pre, post};
}

// The communication buffer over `t`; raises naming `context` if it cannot be one.
inline comm::Buffer Buf(const at::Tensor& t, const std::string& context) {
  return ValueOrThrow(comm::ToBuffer(t), context);
}

}  // namespace fairscale::fsdp::internal
