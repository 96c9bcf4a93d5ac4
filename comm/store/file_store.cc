#include "comm/store/file_store.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <filesystem>
#include <optional>
#include <system_error>
#include <utility>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "base/status_macros.h"
#include "comm/store/store_util.h"

namespace fairscale::comm {
namespace {

using store_internal::CheckKey;
using store_internal::CheckValue;

// Every file starts with this, so a foreign or torn file reads as kDataLoss, not as a value.
constexpr char kFileMagic[4] = {'F', 'S', 'F', '1'};

using Entries = std::vector<std::pair<std::string, std::string>>;

std::string Quote(absl::string_view key) { return absl::StrCat("'", absl::CHexEscape(key), "'"); }

absl::Status ErrnoError(int err, absl::string_view what) {
  const std::string message = absl::StrCat(what, ": ", std::strerror(err));
  if (err == ENOENT) return absl::NotFoundError(message);
  if (err == EACCES || err == EPERM) return absl::PermissionDeniedError(message);
  return absl::InternalError(message);
}

// FNV-1a: stable across processes and builds, unlike absl::Hash (seeded per process). Collisions
// are harmless (a bucket holds several keys); it only has to spread keys.
uint64_t StableHash(absl::string_view s) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (char c : s) {
    h ^= static_cast<uint8_t>(c);
    h *= 0x100000001b3ull;
  }
  return h;
}

void PutU64(uint64_t v, std::string* out) {
  for (int i = 0; i < 8; ++i) out->push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

uint64_t GetU64(const char* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | static_cast<uint8_t>(p[i]);
  return v;
}

std::string SerializeEntries(const Entries& entries) {
  std::string out(kFileMagic, sizeof(kFileMagic));
  for (const auto& [k, v] : entries) {
    PutU64(k.size(), &out);
    PutU64(v.size(), &out);
    out += k;
    out += v;
  }
  return out;
}

absl::StatusOr<Entries> ParseEntries(absl::string_view data, absl::string_view path) {
  auto corrupt = [&](absl::string_view why) {
    return absl::DataLossError(absl::StrCat("FileStore: ", path, " is corrupt: ", why));
  };
  if (data.size() < sizeof(kFileMagic) ||
      std::memcmp(data.data(), kFileMagic, sizeof(kFileMagic)) != 0) {
    return corrupt("bad magic");
  }
  data.remove_prefix(sizeof(kFileMagic));
  Entries entries;
  while (!data.empty()) {
    if (data.size() < 16) return corrupt("truncated entry header");
    const uint64_t klen = GetU64(data.data());
    const uint64_t vlen = GetU64(data.data() + 8);
    data.remove_prefix(16);
    if (klen > kMaxStoreKeyBytes || vlen > kMaxStoreValueBytes || klen + vlen > data.size()) {
      return corrupt(absl::StrCat("entry of ", klen, "+", vlen, " bytes in ", data.size()));
    }
    entries.emplace_back(std::string(data.substr(0, klen)), std::string(data.substr(klen, vlen)));
    data.remove_prefix(klen + vlen);
  }
  return entries;
}

// The whole file, or nullopt when it does not exist.
absl::StatusOr<std::optional<std::string>> ReadWholeFile(const std::string& path) {
  int fd;
  do {
    fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  } while (fd < 0 && errno == EINTR);
  if (fd < 0) {
    if (errno == ENOENT) return std::optional<std::string>();
    return ErrnoError(errno, absl::StrCat("FileStore: open ", path));
  }
  std::string data;
  char chunk[64 << 10];
  while (true) {
    ssize_t n = read(fd, chunk, sizeof(chunk));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int err = errno;
      close(fd);
      return ErrnoError(err, absl::StrCat("FileStore: read ", path));
    }
    if (n == 0) break;
    data.append(chunk, static_cast<size_t>(n));
    // Entries are bounded, so a file far larger than one full entry is not ours.
    if (data.size() > 4 * (kMaxStoreValueBytes + kMaxStoreKeyBytes)) {
      close(fd);
      return absl::DataLossError(absl::StrCat("FileStore: ", path, " is implausibly large"));
    }
  }
  close(fd);
  return std::optional<std::string>(std::move(data));
}

absl::Status WriteAll(int fd, absl::string_view data, const std::string& path) {
  while (!data.empty()) {
    ssize_t n = write(fd, data.data(), data.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return ErrnoError(errno, absl::StrCat("FileStore: write ", path));
    data.remove_prefix(static_cast<size_t>(n));
  }
  return absl::OkStatus();
}

// Replaces `path` atomically: readers see the old file or the new one, never a mix. No fsync:
// the store only has to survive process deaths, not machine crashes.
absl::Status ReplaceFile(const std::string& directory, const std::string& path,
                         absl::string_view data) {
  static std::atomic<uint64_t> counter{0};
  const std::string tmp =
      absl::StrCat(directory, "/.tmp-", getpid(), "-", counter.fetch_add(1), "-",
                   absl::ToUnixNanos(absl::Now()));
  int fd;
  do {
    fd = open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  } while (fd < 0 && errno == EINTR);
  if (fd < 0) return ErrnoError(errno, absl::StrCat("FileStore: create ", tmp));
  absl::Status s = WriteAll(fd, data, tmp);
  if (close(fd) != 0 && s.ok()) s = ErrnoError(errno, absl::StrCat("FileStore: close ", tmp));
  if (s.ok() && rename(tmp.c_str(), path.c_str()) != 0) {
    s = ErrnoError(errno, absl::StrCat("FileStore: rename ", tmp, " to ", path));
  }
  if (!s.ok()) unlink(tmp.c_str());
  return s;
}

// Opens "<directory>/lock" and flock()s it. A fresh open file description per lock, so it
// excludes other FileStore objects of this process as well as other processes.
absl::StatusOr<int> AcquireFileLock(const std::string& directory, absl::Duration timeout) {
  const std::string path = absl::StrCat(directory, "/lock");
  int fd;
  do {
    fd = open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  } while (fd < 0 && errno == EINTR);
  if (fd < 0) return ErrnoError(errno, absl::StrCat("FileStore: open ", path));
  // flock() itself cannot time out, so poll the non-blocking form with short sleeps.
  const absl::Time deadline = absl::Now() + timeout;
  absl::Duration backoff = absl::Microseconds(20);
  while (flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    if (err == EINTR) continue;
    if (err != EWOULDBLOCK) {
      close(fd);
      return ErrnoError(err, absl::StrCat("FileStore: flock ", path));
    }
    const absl::Time now = absl::Now();
    if (now >= deadline) {
      close(fd);
      return absl::DeadlineExceededError(absl::StrCat(
          "FileStore: lock ", path, " not acquired within ", absl::FormatDuration(timeout)));
    }
    absl::SleepFor(std::min(backoff, deadline - now));
    backoff = std::min(backoff * 2, absl::Milliseconds(2));
  }
  return fd;
}

// Polls `ready` (which returns true when done) until it is or `timeout` passes. Sleeps start
// short so a fast rendezvous stays fast, and grow so a long wait does not spin.
template <typename Ready>
absl::StatusOr<bool> PollUntil(absl::Duration timeout, Ready ready) {
  const absl::Time deadline = absl::Now() + timeout;
  absl::Duration backoff = absl::Microseconds(200);
  while (true) {
    FS_ASSIGN_OR_RETURN(bool done, ready());
    if (done) return true;
    const absl::Time now = absl::Now();
    if (now >= deadline) return false;
    absl::SleepFor(std::min(backoff, deadline - now));
    backoff = std::min(backoff * 2, absl::Milliseconds(5));
  }
}

}  // namespace

absl::StatusOr<std::unique_ptr<FileStore>> FileStore::Create(std::string directory,
                                                             FileStoreOptions options) {
  if (directory.empty()) return absl::InvalidArgumentError("FileStore: empty directory path");
  std::error_code ec;
  std::filesystem::create_directories(directory, ec);
  if (ec) {
    return absl::InternalError(
        absl::StrCat("FileStore: cannot create directory ", directory, ": ", ec.message()));
  }
  struct stat st;
  if (stat(directory.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    return absl::InvalidArgumentError(
        absl::StrCat("FileStore: ", directory, " is not a directory"));
  }
  return std::unique_ptr<FileStore>(new FileStore(std::move(directory), options));
}

FileStore::FileStore(std::string directory, FileStoreOptions options)
    : directory_(std::move(directory)), options_(options) {}

FileStore::Locked::Locked(Locked&& other)
    : store_(std::exchange(other.store_, nullptr)), fd_(std::exchange(other.fd_, -1)) {}

FileStore::Locked::~Locked() {
  if (store_ == nullptr) return;
  close(fd_);  // Closing the only descriptor of the lock file releases the flock.
  absl::MutexLock l(&store_->mu_);
  store_->locked_ = false;
}

absl::StatusOr<FileStore::Locked> FileStore::Lock() {
  const absl::Time deadline = absl::Now() + options_.timeout;
  // Threads of this object queue here first (a mutex acquisition cannot time out, a condition
  // wait can), so only one of them at a time polls the flock.
  {
    absl::MutexLock l(&mu_);
    auto unlocked = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !locked_; };
    if (!mu_.AwaitWithDeadline(absl::Condition(&unlocked), deadline)) {
      return absl::DeadlineExceededError(absl::StrCat("FileStore ", directory_,
                                                      ": lock not acquired within ",
                                                      absl::FormatDuration(options_.timeout)));
    }
    locked_ = true;
  }
  absl::StatusOr<int> fd = AcquireFileLock(directory_, deadline - absl::Now());
  if (!fd.ok()) {
    absl::MutexLock l(&mu_);
    locked_ = false;
    return fd.status();
  }
  return Locked(this, *fd);
}

std::string FileStore::PathOf(absl::string_view key) const {
  if (key.size() <= kMaxInlineKeyBytes) {
    return absl::StrCat(directory_, "/k", absl::BytesToHexString(key));
  }
  return absl::StrCat(directory_, "/h", absl::Hex(StableHash(key), absl::kZeroPad16));
}

namespace {

// Reads the entries of `path` (none when the file does not exist).
absl::StatusOr<Entries> ReadEntries(const std::string& path) {
  FS_ASSIGN_OR_RETURN(std::optional<std::string> data, ReadWholeFile(path));
  if (!data.has_value()) return Entries();
  return ParseEntries(*data, path);
}

absl::StatusOr<std::optional<std::string>> Lookup(const std::string& path,
                                                  absl::string_view key) {
  FS_ASSIGN_OR_RETURN(Entries entries, ReadEntries(path));
  for (auto& [k, v] : entries) {
    if (k == key) return std::optional<std::string>(std::move(v));
  }
  return std::optional<std::string>();
}

absl::Status WriteEntries(const std::string& directory, const std::string& path,
                          const Entries& entries) {
  if (entries.empty()) {
    if (unlink(path.c_str()) != 0 && errno != ENOENT) {
      return ErrnoError(errno, absl::StrCat("FileStore: unlink ", path));
    }
    return absl::OkStatus();
  }
  return ReplaceFile(directory, path, SerializeEntries(entries));
}

// Sets key's value in `entries`, appending it when absent.
void Upsert(Entries* entries, absl::string_view key, absl::string_view value) {
  for (auto& [k, v] : *entries) {
    if (k == key) {
      v = std::string(value);
      return;
    }
  }
  entries->emplace_back(std::string(key), std::string(value));
}

const std::string* Find(const Entries& entries, absl::string_view key) {
  for (const auto& [k, v] : entries) {
    if (k == key) return &v;
  }
  return nullptr;
}

}  // namespace

absl::Status FileStore::Set(absl::string_view key, absl::string_view value) {
  FS_RETURN_IF_ERROR(CheckKey(key));
  FS_RETURN_IF_ERROR(CheckValue(value));
  const std::string path = PathOf(key);
  FS_ASSIGN_OR_RETURN(Locked lock, Lock());
  Entries entries;
  // A hashed bucket may hold other keys; an inline file holds only this one.
  if (key.size() > kMaxInlineKeyBytes) {
    FS_ASSIGN_OR_RETURN(entries, ReadEntries(path));
  }
  Upsert(&entries, key, value);
  return WriteEntries(directory_, path, entries);
}

absl::StatusOr<std::string> FileStore::Get(absl::string_view key, absl::Duration timeout) {
  FS_RETURN_IF_ERROR(CheckKey(key));
  const std::string path = PathOf(key);
  std::optional<std::string> value;
  FS_ASSIGN_OR_RETURN(bool found, PollUntil(timeout, [&]() -> absl::StatusOr<bool> {
                        FS_ASSIGN_OR_RETURN(value, Lookup(path, key));
                        return value.has_value();
                      }));
  if (!found) {
    return absl::DeadlineExceededError(absl::StrCat("FileStore ", directory_, ": key ",
                                                    Quote(key), " not set within ",
                                                    absl::FormatDuration(timeout)));
  }
  return std::move(*value);
}

absl::StatusOr<int64_t> FileStore::Add(absl::string_view key, int64_t delta) {
  FS_RETURN_IF_ERROR(CheckKey(key));
  const std::string path = PathOf(key);
  FS_ASSIGN_OR_RETURN(Locked lock, Lock());
  FS_ASSIGN_OR_RETURN(Entries entries, ReadEntries(path));
  const std::string* current = Find(entries, key);
  FS_ASSIGN_OR_RETURN(std::string next, store_internal::AddToValue(
                                            key, current ? *current : std::string(), delta));
  Upsert(&entries, key, next);
  FS_RETURN_IF_ERROR(WriteEntries(directory_, path, entries));
  int64_t out = 0;
  (void)absl::SimpleAtoi(next, &out);
  return out;
}

absl::StatusOr<std::string> FileStore::CompareSet(absl::string_view key,
                                                  absl::string_view expected,
                                                  absl::string_view desired) {
  FS_RETURN_IF_ERROR(CheckKey(key));
  FS_RETURN_IF_ERROR(CheckValue(desired));
  const std::string path = PathOf(key);
  FS_ASSIGN_OR_RETURN(Locked lock, Lock());
  FS_ASSIGN_OR_RETURN(Entries entries, ReadEntries(path));
  const std::string* current = Find(entries, key);
  absl::string_view now = current ? absl::string_view(*current) : absl::string_view();
  if (now != expected) return std::string(now);
  Upsert(&entries, key, desired);
  FS_RETURN_IF_ERROR(WriteEntries(directory_, path, entries));
  return std::string(desired);
}

absl::StatusOr<bool> FileStore::Delete(absl::string_view key) {
  FS_RETURN_IF_ERROR(CheckKey(key));
  const std::string path = PathOf(key);
  FS_ASSIGN_OR_RETURN(Locked lock, Lock());
  FS_ASSIGN_OR_RETURN(Entries entries, ReadEntries(path));
  auto it = std::find_if(entries.begin(), entries.end(),
                         [&](const auto& e) { return e.first == key; });
  if (it == entries.end()) return false;
  entries.erase(it);
  FS_RETURN_IF_ERROR(WriteEntries(directory_, path, entries));
  return true;
}

absl::Status FileStore::Wait(absl::Span<const std::string> keys, absl::Duration timeout) {
  for (const std::string& k : keys) FS_RETURN_IF_ERROR(CheckKey(k));
  std::vector<std::string> missing;
  FS_ASSIGN_OR_RETURN(bool all, PollUntil(timeout, [&]() -> absl::StatusOr<bool> {
                        missing.clear();
                        for (const std::string& k : keys) {
                          FS_ASSIGN_OR_RETURN(bool present, Check(k));
                          if (!present) missing.push_back(absl::CHexEscape(k));
                        }
                        return missing.empty();
                      }));
  if (!all) {
    return absl::DeadlineExceededError(absl::StrCat(
        "FileStore ", directory_, ": keys [", absl::StrJoin(missing, ", "), "] not set within ",
        absl::FormatDuration(timeout)));
  }
  return absl::OkStatus();
}

absl::StatusOr<bool> FileStore::Check(absl::string_view key) {
  FS_RETURN_IF_ERROR(CheckKey(key));
  if (key.size() <= kMaxInlineKeyBytes) {
    // The file is this key's alone: its existence is the answer (no need to read the value).
    const std::string path = PathOf(key);
    if (access(path.c_str(), F_OK) == 0) return true;
    if (errno == ENOENT) return false;
    return ErrnoError(errno, absl::StrCat("FileStore: access ", path));
  }
  FS_ASSIGN_OR_RETURN(std::optional<std::string> value, Lookup(PathOf(key), key));
  return value.has_value();
}

}  // namespace fairscale::comm
