#include "comm/store/hash_store.h"

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status_macros.h"
#include "comm/store/store_util.h"

namespace fairscale::comm {

using store_internal::CheckKey;
using store_internal::CheckValue;

absl::Status HashStore::Set(absl::string_view key, absl::string_view value) {
  FS_RETURN_IF_ERROR(CheckKey(key));
  FS_RETURN_IF_ERROR(CheckValue(value));
  absl::MutexLock lock(&mu_);
  map_[std::string(key)] = std::string(value);
  return absl::OkStatus();
}

absl::StatusOr<std::string> HashStore::Get(absl::string_view key, absl::Duration timeout) {
  FS_RETURN_IF_ERROR(CheckKey(key));
  std::string k(key);
  absl::MutexLock lock(&mu_);
  auto present = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return map_.contains(k); };
  if (!mu_.AwaitWithTimeout(absl::Condition(&present), timeout)) {
    return absl::DeadlineExceededError(absl::StrCat("HashStore: key '", key, "' not set within ",
                                                    absl::FormatDuration(timeout)));
  }
  return map_[k];
}

absl::StatusOr<int64_t> HashStore::Add(absl::string_view key, int64_t delta) {
  FS_RETURN_IF_ERROR(CheckKey(key));
  absl::MutexLock lock(&mu_);
  std::string& v = map_[std::string(key)];
  FS_ASSIGN_OR_RETURN(std::string next, store_internal::AddToValue(key, v, delta));
  v = next;
  int64_t out = 0;
  (void)absl::SimpleAtoi(v, &out);
  return out;
}

absl::StatusOr<std::string> HashStore::CompareSet(absl::string_view key, absl::string_view expected,
                                                  absl::string_view desired) {
  FS_RETURN_IF_ERROR(CheckKey(key));
  FS_RETURN_IF_ERROR(CheckValue(desired));
  absl::MutexLock lock(&mu_);
  auto it = map_.find(key);
  absl::string_view current = it == map_.end() ? absl::string_view() : absl::string_view(it->second);
  if (current == expected) {
    map_[std::string(key)] = std::string(desired);
    return std::string(desired);
  }
  return std::string(current);
}

absl::StatusOr<bool> HashStore::Delete(absl::string_view key) {
  FS_RETURN_IF_ERROR(CheckKey(key));
  absl::MutexLock lock(&mu_);
  return map_.erase(key) > 0;
}

absl::Status HashStore::Wait(absl::Span<const std::string> keys, absl::Duration timeout) {
  for (const std::string& k : keys) FS_RETURN_IF_ERROR(CheckKey(k));
  absl::MutexLock lock(&mu_);
  auto all = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    for (const std::string& k : keys) {
      if (!map_.contains(k)) return false;
    }
    return true;
  };
  if (!mu_.AwaitWithTimeout(absl::Condition(&all), timeout)) {
    std::vector<std::string> missing;
    for (const std::string& k : keys) {
      if (!map_.contains(k)) missing.push_back(k);
    }
    return absl::DeadlineExceededError(absl::StrCat("HashStore: keys [",
                                                    absl::StrJoin(missing, ", "),
                                                    "] not set within ",
                                                    absl::FormatDuration(timeout)));
  }
  return absl::OkStatus();
}

absl::StatusOr<bool> HashStore::Check(absl::string_view key) {
  FS_RETURN_IF_ERROR(CheckKey(key));
  absl::MutexLock lock(&mu_);
  return map_.contains(key);
}

}  // namespace fairscale::comm
