// FileStore: a Store kept in a directory that the processes of one machine share (the forked
// rank runner, single-node jobs without a TCP rendezvous, tests under $TEST_TMPDIR).
//
// Layout: each key lives in its own file, named from the key's bytes in hex ("k<hex>"), so any
// key ('/', "..", NUL, ...) maps to a safe name. Keys too long for a file name (over
// kMaxInlineKeyBytes) live in a bucket file named by a 64-bit hash of the key ("h<hash>"); a
// file holds a list of (key, value) entries, so two long keys with the same hash share a file
// and stay distinct.
//
// Concurrency: files are replaced atomically (write a temporary file, then rename), so readers
// never take a lock and never see a partial value. Every mutation (Set, Add, CompareSet, Delete)
// runs under an flock() on "<directory>/lock", which serializes read-modify-write across
// processes and threads. Get/Wait poll with short sleeps (the directory gives no notification
// that is portable and cheap), so a waiter sees a Set within a few milliseconds.
#pragma once

#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "comm/store/store.h"

namespace fairscale::comm {

struct FileStoreOptions {
  // Bounds the wait for the lock of a mutation (Get/Wait take their own timeout).
  absl::Duration timeout = absl::Minutes(5);
};

class FileStore : public Store {
 public:
  // Keys up to this size get a file of their own (the hex name stays below NAME_MAX).
  static constexpr size_t kMaxInlineKeyBytes = 100;

  // Uses `directory`, creating it (and missing parents) if needed. Processes that pass the same
  // directory share the store. kInvalidArgument for an empty path; the errno text otherwise.
  static absl::StatusOr<std::unique_ptr<FileStore>> Create(std::string directory,
                                                           FileStoreOptions options = {});

  absl::Status Set(absl::string_view key, absl::string_view value) override;
  absl::StatusOr<std::string> Get(absl::string_view key, absl::Duration timeout) override;
  absl::StatusOr<int64_t> Add(absl::string_view key, int64_t delta) override;
  absl::StatusOr<std::string> CompareSet(absl::string_view key, absl::string_view expected,
                                         absl::string_view desired) override;
  absl::StatusOr<bool> Delete(absl::string_view key) override;
  absl::Status Wait(absl::Span<const std::string> keys, absl::Duration timeout) override;
  absl::StatusOr<bool> Check(absl::string_view key) override;

  const std::string& directory() const { return directory_; }

  // The file that holds `key` (exposed for tests and debugging).
  std::string PathOf(absl::string_view key) const;

 private:
  // Holds mu_ and the flock of "<directory>/lock" while alive.
  class Locked {
   public:
    Locked(Locked&& other);
    Locked& operator=(Locked&&) = delete;
    ~Locked();

   private:
    friend class FileStore;
    Locked(FileStore* store, int fd) : store_(store), fd_(fd) {}
    FileStore* store_;
    int fd_;
  };

  FileStore(std::string directory, FileStoreOptions options);

  // Serializes the mutations of every thread and process that uses the directory, within the
  // configured timeout.
  absl::StatusOr<Locked> Lock();

  const std::string directory_;
  const FileStoreOptions options_;
  absl::Mutex mu_;
  // Whether a thread of this object holds (or is acquiring) the file lock.
  bool locked_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace fairscale::comm
