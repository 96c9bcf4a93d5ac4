// The one place where oss turns an absl::Status (what //comm returns) into the c10::Error that
// LibTorch users catch; the context names the operation and the rank.
#pragma once

#include <c10/util/Exception.h>

#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace fairscale::oss::internal {

// Raises c10::Error "<context>: <status>" unless `status` is OK.
inline void ThrowIfError(const absl::Status& status, const std::string& context) {
  TORCH_CHECK(status.ok(), context, ": ", status.ToString());
}

template <typename T>
T ValueOrThrow(absl::StatusOr<T> value, const std::string& context) {
  ThrowIfError(value.status(), context);
  return *std::move(value);
}

}  // namespace fairscale::oss::internal
