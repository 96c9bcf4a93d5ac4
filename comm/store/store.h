// Store: the key-value rendezvous every backend uses to exchange addresses (//comm/store).
//
// Implementations: HashStore (in memory, one process), FileStore (a directory shared by the
// processes of one machine), TCPStore (a server in rank 0 or the launcher), PrefixStore (a
// namespace over another store). All methods are thread-safe and never block longer than the
// timeout they are given (or the store's configured timeout).
#pragma once

#include <cstdint>
#include <string>
#include "absl/strings/string_view.h"
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"

namespace fairscale::comm {

// Largest key and value a store accepts (kInvalidArgument beyond). The TCP wire format rejects
// larger frames before allocating.
inline constexpr size_t kMaxStoreKeyBytes = 4096;
inline constexpr size_t kMaxStoreValueBytes = 64 << 20;

class Store {
 public:
  virtual ~Store() = default;

  // Sets key to value (overwrites).
  virtual absl::Status Set(absl::string_view key, absl::string_view value) = 0;

  // Returns the value of key, waiting up to `timeout` for another client to set it.
  // kDeadlineExceeded names the key when it never appears.
  virtual absl::StatusOr<std::string> Get(absl::string_view key, absl::Duration timeout) = 0;

  // Atomically adds delta to the integer stored at key (missing = 0) and returns the new value.
  // kInvalidArgument when the key holds something that is not a decimal integer.
  virtual absl::StatusOr<int64_t> Add(absl::string_view key, int64_t delta) = 0;

  // Atomically: if the current value equals `expected` (a missing key equals ""), store
  // `desired`. Returns the value stored after the call (desired on success, else the current).
  virtual absl::StatusOr<std::string> CompareSet(absl::string_view key, absl::string_view expected,
                                                 absl::string_view desired) = 0;

  // Removes key; returns whether it existed.
  virtual absl::StatusOr<bool> Delete(absl::string_view key) = 0;

  // Waits up to `timeout` until every key exists.
  virtual absl::Status Wait(absl::Span<const std::string> keys, absl::Duration timeout) = 0;

  // Whether key exists now (no waiting).
  virtual absl::StatusOr<bool> Check(absl::string_view key) = 0;
};

}  // namespace fairscale::comm
