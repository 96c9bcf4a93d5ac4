#include "comm/store/prefix_store.h"

#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "comm/store/store_util.h"

namespace fairscale::comm {

PrefixStore::PrefixStore(std::string prefix, std::shared_ptr<Store> base)
    : prefix_(std::move(prefix)), base_(std::move(base)) {}

std::string PrefixStore::Key(absl::string_view key) const { return absl::StrCat(prefix_, "/", key); }

// The caller's key is checked before the prefix is added: "<prefix>/" alone is a valid key of the
// base store, but an empty key is not a valid key of this one.
using store_internal::CheckKey;

absl::Status PrefixStore::Set(absl::string_view key, absl::string_view value) {
  FS_RETURN_IF_ERROR(CheckKey(key));
  return base_->Set(Key(key), value);
}
absl::StatusOr<std::string> PrefixStore::Get(absl::string_view key, absl::Duration timeout) {
  FS_RETURN_IF_ERROR(CheckKey(key));
  return base_->Get(Key(key), timeout);
}
absl::StatusOr<int64_t> PrefixStore::Add(absl::string_view key, int64_t delta) {
  FS_RETURN_IF_ERROR(CheckKey(key));
  return base_->Add(Key(key), delta);
}
absl::StatusOr<std::string> PrefixStore::CompareSet(absl::string_view key,
                                                    absl::string_view expected,
                                                    absl::string_view desired) {
  FS_RETURN_IF_ERROR(CheckKey(key));
  return base_->CompareSet(Key(key), expected, desired);
}
absl::StatusOr<bool> PrefixStore::Delete(absl::string_view key) {
  FS_RETURN_IF_ERROR(CheckKey(key));
  return base_->Delete(Key(key));
}
absl::Status PrefixStore::Wait(absl::Span<const std::string> keys, absl::Duration timeout) {
  std::vector<std::string> full;
  full.reserve(keys.size());
  for (const std::string& k : keys) {
    FS_RETURN_IF_ERROR(CheckKey(k));
    full.push_back(Key(k));
  }
  return base_->Wait(full, timeout);
}
absl::StatusOr<bool> PrefixStore::Check(absl::string_view key) {
  FS_RETURN_IF_ERROR(CheckKey(key));
  return base_->Check(Key(key));
}

}  // namespace fairscale::comm
