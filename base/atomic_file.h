// Files written whole or not at all, and files read whole (//base:atomic_file; Abseil only). The
// one implementation behind every checkpoint file the repository writes: train_state's step
// directories (markers, JSON items) and fsdp's sharded checkpoints (rank files, manifests) and
// LibTorch archives.
//
// A file is written to "<path>.tmp.<pid>" (two processes writing one path never share a tmp
// file), fsync'ed, renamed over `path`, and then its directory is fsync'ed: a crash leaves the
// old file or the new one under `path`, never a torn one.
//
// Errors name the file and the OS error, e.g. "cannot write '<path>.tmp.<pid>': No space left on
// device": kResourceExhausted for a full disk or quota (ENOSPC, EDQUOT), kDataLoss for any other
// error. After an error nothing is left under the tmp name, and when only the final fsync of the
// directory failed `path` is removed as well: an error means no file vouches for the write (the
// caller reports a failed save; a file whose name may not survive a crash must not pass for a
// saved one).
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace fairscale::base {

// Writes `content` to `path` atomically (see above).
absl::Status WriteFileAtomic(const std::string& path, absl::string_view content);

// The whole file. kNotFound when `path` does not exist; kDataLoss naming the file when it cannot
// be opened or read (a directory, no permission, an I/O error).
absl::StatusOr<std::string> ReadFile(const std::string& path);

// fsync of a directory, so that the names created or renamed in it are durable. kDataLoss
// (kResourceExhausted for ENOSPC/EDQUOT) naming the directory.
absl::Status FsyncDirectory(const std::string& dir);

// The streaming form of WriteFileAtomic, for a file written in pieces (fsdp's rank files: records
// straight from tensor memory; LibTorch archives through OutputArchive::save_to(writer)):
//
//   FS_ASSIGN_OR_RETURN(base::AtomicFileWriter file, base::AtomicFileWriter::Open(path));
//   FS_RETURN_IF_ERROR(file.Append(header));
//   FS_RETURN_IF_ERROR(file.Append(records));
//   FS_RETURN_IF_ERROR(file.Commit());
//
// The first error is kept: it removes the tmp file, and every later Append or Commit returns it
// again (a caller feeding a writer callback may check once, at the end). A writer destroyed
// without a successful Commit removes its tmp file. Movable, not copyable; not thread-safe.
class AtomicFileWriter {
 public:
  // Creates "<path>.tmp.<pid>" (truncating a stale one of this process).
  static absl::StatusOr<AtomicFileWriter> Open(const std::string& path);

  AtomicFileWriter(AtomicFileWriter&& other) noexcept;
  AtomicFileWriter& operator=(AtomicFileWriter&& other) noexcept;
  AtomicFileWriter(const AtomicFileWriter&) = delete;
  AtomicFileWriter& operator=(const AtomicFileWriter&) = delete;
  ~AtomicFileWriter();

  // Writes all of `data` to the tmp file.
  absl::Status Append(absl::string_view data);
  // fsync, close, rename over path(), fsync of its directory. Once only: a second call (or an
  // Append after it) is kFailedPrecondition.
  absl::Status Commit();

  const std::string& path() const { return path_; }
  const std::string& tmp_path() const { return tmp_; }
  int64_t bytes_written() const { return written_; }
  // OK until the first error.
  const absl::Status& status() const { return status_; }

 private:
  AtomicFileWriter(std::string path, std::string tmp, int fd);
  // Records the first error, closes and removes the tmp file; returns the recorded error.
  absl::Status Fail(absl::Status error);
  void Abandon();  // closes and removes the tmp file if still open

  std::string path_;
  std::string tmp_;
  int fd_ = -1;
  bool committed_ = false;
  int64_t written_ = 0;
  absl::Status status_;
};

}  // namespace fairscale::base
