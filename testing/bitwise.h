// Bitwise: whether two tensors are the same to the bit (defined, same dtype and shape, equal
// bytes), for the tests of deterministic mode (//deterministic and its users), where "within
// rounding" is not enough. Unlike at::equal, NaNs with equal payloads are equal and 0.0 differs
// from -0.0. Test-only.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/equal.h>

namespace fairscale::testing {

inline bool Bitwise(const at::Tensor& a, const at::Tensor& b) {
  // reshape({-1}) first: a 0-dim tensor cannot be viewed as bytes.
  return a.defined() && b.defined() && a.sizes() == b.sizes() &&
         a.scalar_type() == b.scalar_type() &&
         at::equal(a.contiguous().reshape({-1}).view(at::kByte),
                   b.contiguous().reshape({-1}).view(at::kByte));
}

}  // namespace fairscale::testing
