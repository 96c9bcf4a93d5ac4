// Helpers shared by the Store implementations (//comm/store:store_util): argument checks and the
// integer encoding of Add().
#pragma once

#include <cstdint>
#include <string>
#include "absl/strings/string_view.h"

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace fairscale::comm::store_internal {

// kInvalidArgument for an empty or oversized key / oversized value.
absl::Status CheckKey(absl::string_view key);
absl::Status CheckValue(absl::string_view value);

// The new value of Add(): `current` ("" when missing) parsed as a decimal int64 plus delta.
absl::StatusOr<std::string> AddToValue(absl::string_view key, absl::string_view current,
                                       int64_t delta);

}  // namespace fairscale::comm::store_internal
