#include "comm/store/store_util.h"

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "comm/store/store.h"

namespace fairscale::comm::store_internal {

absl::Status CheckKey(absl::string_view key) {
  if (key.empty()) return absl::InvalidArgumentError("store key is empty");
  if (key.size() > kMaxStoreKeyBytes) {
    return absl::InvalidArgumentError(absl::StrCat("store key of ", key.size(),
                                                   " bytes exceeds the limit of ",
                                                   kMaxStoreKeyBytes));
  }
  return absl::OkStatus();
}

absl::Status CheckValue(absl::string_view value) {
  if (value.size() > kMaxStoreValueBytes) {
    return absl::InvalidArgumentError(absl::StrCat("store value of ", value.size(),
                                                   " bytes exceeds the limit of ",
                                                   kMaxStoreValueBytes));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> AddToValue(absl::string_view key, absl::string_view current,
                                       int64_t delta) {
  int64_t v = 0;
  if (!current.empty() && !absl::SimpleAtoi(current, &v)) {
    return absl::InvalidArgumentError(
        absl::StrCat("store Add on key '", key, "' whose value is not an integer"));
  }
  int64_t out;
  if (__builtin_add_overflow(v, delta, &out)) {
    return absl::InvalidArgumentError(absl::StrCat("store Add on key '", key, "' overflows"));
  }
  return absl::StrCat(out);
}

}  // namespace fairscale::comm::store_internal
