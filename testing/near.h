// Tensor comparisons for tests that return absl::Status (the rank-runner style): Shape(t) for
// messages, MaxAbsDiff in f64, and Near(got, want, tol, what), which fails naming `what` when
// either tensor is undefined, the shapes differ, or max |got - want| > tol.
#pragma once

#include <ATen/core/Tensor.h>

#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace fairscale::testing {

inline std::string Shape(const at::Tensor& t) {
  return t.defined() ? absl::StrCat("[", absl::StrJoin(t.sizes(), ", "), "]") : "(undefined)";
}

// max |got - want| computed in f64; 0 for empty tensors.
inline double MaxAbsDiff(const at::Tensor& got, const at::Tensor& want) {
  if (got.numel() == 0) return 0;
  return (got.to(at::kDouble) - want.to(at::kDouble)).abs().max().item<double>();
}

// Defined, same shape, and max |got - want| <= tol (dtypes may differ: compared in f64). With
// `max_diff`, the difference is also reported there (0 when the check failed before it).
inline absl::Status Near(const at::Tensor& got, const at::Tensor& want, double tol,
                         const std::string& what, double* max_diff = nullptr) {
  if (max_diff != nullptr) *max_diff = 0;
  if (!got.defined() || !want.defined()) {
    return absl::InternalError(
        absl::StrCat(what, ": undefined (got ", got.defined(), ", want ", want.defined(), ")"));
  }
  if (got.sizes() != want.sizes()) {
    return absl::InternalError(absl::StrCat(what, ": got ", Shape(got), ", want ", Shape(want)));
  }
  const double diff = MaxAbsDiff(got, want);
  if (max_diff != nullptr) *max_diff = diff;
  if (diff <= tol) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, ": max |got - want| = ", diff, " > ", tol));
}

}  // namespace fairscale::testing
