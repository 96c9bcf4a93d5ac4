// The one conversion from absl::Status to c10::Error, at the boundary between the Google-style
// packages (comm, base, stores: absl::Status for every error) and the user-facing training APIs
// (fsdp, oss, amp, pipe, checkpoint, offload: LibTorch's idiom, errors raise c10::Error). Every
// user API reports a Status through here, so every message has one shape:
//
//   "<context>: <CODE>: <message>"
//   e.g. "oss::OSS::step rank 1/4: UNAVAILABLE: all_gather #12 rank 1/4 [tcp]: peer 3 closed ..."
//
// The code name (absl::Status::ToString()) stays in the message on purpose: c10::Error has no
// code, and the name is how a caller (or a test) tells a timeout from corrupt data.
//
//   base::ThrowIfError(work.Wait(), "oss::OSS::step rank 1/4");
//   comm::Buffer b = base::ValueOrThrow(comm::ToBuffer(t), context);
//
// The throw is out of line (torch_error.cc): call sites stay small and this header includes no
// LibTorch header. Include <c10/util/Exception.h> where you catch c10::Error.
#pragma once

#include <utility>

#include "absl/base/optimization.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace fairscale::base {
namespace internal {
// Raises c10::Error "<context>: <status.ToString()>" (just the status when context is empty).
[[noreturn]] void ThrowStatus(const absl::Status& status, absl::string_view context);
}  // namespace internal

// Raises c10::Error "<context>: <CODE>: <message>" unless `status` is OK.
inline void ThrowIfError(const absl::Status& status, absl::string_view context) {
  if (ABSL_PREDICT_FALSE(!status.ok())) internal::ThrowStatus(status, context);
}

// The value of `value`, or raises c10::Error "<context>: <CODE>: <message>".
template <typename T>
T ValueOrThrow(absl::StatusOr<T> value, absl::string_view context) {
  if (ABSL_PREDICT_FALSE(!value.ok())) internal::ThrowStatus(value.status(), context);
  return *std::move(value);
}

}  // namespace fairscale::base
