// PrefixStore: a namespace over another Store; every key is stored as "<prefix>/<key>".
// Communicators and their Split children use it so they can share one rendezvous store.
#pragma once

#include <memory>
#include <string>
#include "absl/strings/string_view.h"

#include "comm/store/store.h"

namespace fairscale::comm {

class PrefixStore : public Store {
 public:
  PrefixStore(std::string prefix, std::shared_ptr<Store> base);

  absl::Status Set(absl::string_view key, absl::string_view value) override;
  absl::StatusOr<std::string> Get(absl::string_view key, absl::Duration timeout) override;
  absl::StatusOr<int64_t> Add(absl::string_view key, int64_t delta) override;
  absl::StatusOr<std::string> CompareSet(absl::string_view key, absl::string_view expected,
                                         absl::string_view desired) override;
  absl::StatusOr<bool> Delete(absl::string_view key) override;
  absl::Status Wait(absl::Span<const std::string> keys, absl::Duration timeout) override;
  absl::StatusOr<bool> Check(absl::string_view key) override;

  const std::string& prefix() const { return prefix_; }
  const std::shared_ptr<Store>& base() const { return base_; }

 private:
  std::string Key(absl::string_view key) const;
  const std::string prefix_;
  const std::shared_ptr<Store> base_;
};

}  // namespace fairscale::comm
