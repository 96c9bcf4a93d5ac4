#include "base/tensor_close.h"

#include <ATen/TensorOperators.h>

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace fairscale::base {

absl::Status ExpectTensorClose(const std::string& what, const at::Tensor& actual,
                               const at::Tensor& expected, double rtol) {
  if (!actual.defined()) return absl::InternalError(absl::StrCat(what, ": undefined tensor"));
  if (actual.sizes() != expected.sizes()) {
    return absl::InternalError(absl::StrCat(what, ": shape mismatch"));
  }
  const double diff =
      (actual.detach().to(at::kDouble) - expected.to(at::kDouble)).norm().item<double>();
  const double ref = expected.to(at::kDouble).norm().item<double>();
  if (diff <= rtol * ref || (ref < 1e-12 && diff < 1e-9)) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, ": relative error ", diff / std::max(ref, 1e-30),
                                          " > ", rtol, " (|expected| = ", ref, ")"));
}

}  // namespace fairscale::base
