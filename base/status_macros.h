// Status propagation macros that Abseil 20220623 does not ship.
//
//   FS_RETURN_IF_ERROR(DoThing());                 // returns the Status if not ok
//   FS_ASSIGN_OR_RETURN(auto x, MakeThing());      // unwraps a StatusOr or returns its Status
//
// Used by every Google-style package (comm, base, stores, launcher internals).
#pragma once

#include <utility>

#include "absl/base/optimization.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace fairscale::base::internal {
inline absl::Status AsStatus(absl::Status s) { return s; }
template <typename T>
absl::Status AsStatus(const absl::StatusOr<T>& s) {
  return s.status();
}
}  // namespace fairscale::base::internal

#define FS_RETURN_IF_ERROR(expr)                                               \
  do {                                                                         \
    ::absl::Status fs_status_ = ::fairscale::base::internal::AsStatus((expr)); \
    if (ABSL_PREDICT_FALSE(!fs_status_.ok())) return fs_status_;              \
  } while (0)

#define FS_STATUS_MACROS_CONCAT_INNER_(x, y) x##y
#define FS_STATUS_MACROS_CONCAT_(x, y) FS_STATUS_MACROS_CONCAT_INNER_(x, y)

#define FS_ASSIGN_OR_RETURN(lhs, rexpr) \
  FS_ASSIGN_OR_RETURN_IMPL_(FS_STATUS_MACROS_CONCAT_(fs_statusor_, __LINE__), lhs, rexpr)

#define FS_ASSIGN_OR_RETURN_IMPL_(statusor, lhs, rexpr)             \
  auto statusor = (rexpr);                                          \
  if (ABSL_PREDICT_FALSE(!statusor.ok())) return statusor.status(); \
  lhs = std::move(statusor).value()
