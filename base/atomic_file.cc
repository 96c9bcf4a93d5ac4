#include "base/atomic_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"

namespace fairscale::base {
namespace {

// "<what>: <OS error>": kResourceExhausted for a full disk or quota, else kDataLoss.
absl::Status IoError(int error, absl::string_view what) {
  const std::string message = absl::StrCat(what, ": ", std::strerror(error));
  if (error == ENOSPC || error == EDQUOT) return absl::ResourceExhaustedError(message);
  return absl::DataLossError(message);
}

std::string DirOf(const std::string& path) {
  const size_t slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

}  // namespace

absl::Status FsyncDirectory(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return IoError(errno, absl::StrCat("cannot open directory '", dir, "'"));
  const int rc = ::fsync(fd);
  const int error = errno;
  ::close(fd);
  if (rc != 0) return IoError(error, absl::StrCat("cannot fsync directory '", dir, "'"));
  return absl::OkStatus();
}

// ---- AtomicFileWriter ------------------------------------------------------------------------

AtomicFileWriter::AtomicFileWriter(std::string path, std::string tmp, int fd)
    : path_(std::move(path)), tmp_(std::move(tmp)), fd_(fd) {}

AtomicFileWriter::AtomicFileWriter(AtomicFileWriter&& other) noexcept
    : path_(std::move(other.path_)),
      tmp_(std::move(other.tmp_)),
      fd_(std::exchange(other.fd_, -1)),
      committed_(other.committed_),
      written_(other.written_),
      status_(std::move(other.status_)) {}

AtomicFileWriter& AtomicFileWriter::operator=(AtomicFileWriter&& other) noexcept {
  if (this != &other) {
    Abandon();
    path_ = std::move(other.path_);
    tmp_ = std::move(other.tmp_);
    fd_ = std::exchange(other.fd_, -1);
    committed_ = other.committed_;
    written_ = other.written_;
    status_ = std::move(other.status_);
  }
  return *this;
}

AtomicFileWriter::~AtomicFileWriter() { Abandon(); }

void AtomicFileWriter::Abandon() {
  if (fd_ < 0) return;
  ::close(fd_);
  fd_ = -1;
  ::unlink(tmp_.c_str());
}

absl::Status AtomicFileWriter::Fail(absl::Status error) {
  Abandon();
  status_ = std::move(error);
  return status_;
}

absl::StatusOr<AtomicFileWriter> AtomicFileWriter::Open(const std::string& path) {
  std::string tmp = absl::StrCat(path, ".tmp.", ::getpid());
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return IoError(errno, absl::StrCat("cannot create '", tmp, "'"));
  return AtomicFileWriter(path, std::move(tmp), fd);
}

absl::Status AtomicFileWriter::Append(absl::string_view data) {
  if (!status_.ok()) return status_;
  if (committed_) {
    return absl::FailedPreconditionError(absl::StrCat("'", path_, "' is already committed"));
  }
  size_t done = 0;
  while (done < data.size()) {
    const ssize_t n = ::write(fd_, data.data() + done, data.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {  // 0: no progress and no errno; report it as the I/O error it is
      return Fail(IoError(n < 0 ? errno : EIO, absl::StrCat("cannot write '", tmp_, "'")));
    }
    done += static_cast<size_t>(n);
  }
  written_ += static_cast<int64_t>(data.size());
  return absl::OkStatus();
}

absl::Status AtomicFileWriter::Commit() {
  if (!status_.ok()) return status_;
  if (committed_) {
    return absl::FailedPreconditionError(absl::StrCat("'", path_, "' is already committed"));
  }
  if (::fsync(fd_) != 0) return Fail(IoError(errno, absl::StrCat("cannot fsync '", tmp_, "'")));
  // close() can report a deferred write error (NFS, quotas): the file is not written then.
  const int rc = ::close(std::exchange(fd_, -1));
  if (rc != 0) {
    const int error = errno;
    ::unlink(tmp_.c_str());
    return Fail(IoError(error, absl::StrCat("cannot close '", tmp_, "'")));
  }
  if (::rename(tmp_.c_str(), path_.c_str()) != 0) {
    const int error = errno;
    ::unlink(tmp_.c_str());
    return Fail(IoError(error, absl::StrCat("cannot rename '", tmp_, "' to '", path_, "'")));
  }
  committed_ = true;
  absl::Status synced = FsyncDirectory(DirOf(path_));
  if (!synced.ok()) {
    // Not known to be durable: the caller reports a failed write, so no file may vouch for it.
    ::unlink(path_.c_str());
    return Fail(absl::Status(
        synced.code(),
        absl::StrCat("'", path_, "' removed, its rename is not durable: ", synced.message())));
  }
  return absl::OkStatus();
}

// ---- whole files -----------------------------------------------------------------------------

absl::Status WriteFileAtomic(const std::string& path, absl::string_view content) {
  absl::StatusOr<AtomicFileWriter> file = AtomicFileWriter::Open(path);
  if (!file.ok()) return file.status();
  absl::Status s = file->Append(content);
  if (!s.ok()) return s;
  return file->Commit();
}

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    const int error = errno;
    const std::string what = absl::StrCat("cannot open '", path, "'");
    if (error == ENOENT) return absl::NotFoundError(absl::StrCat(what, ": ", std::strerror(error)));
    return IoError(error, what);
  }
  std::string out;
  char buf[1 << 16];
  while (true) {
    const ssize_t n = ::read(fd, buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int error = errno;
      ::close(fd);
      return IoError(error, absl::StrCat("cannot read '", path, "'"));
    }
    if (n == 0) break;
    out.append(buf, static_cast<size_t>(n));
  }
  ::close(fd);
  return out;
}

}  // namespace fairscale::base
