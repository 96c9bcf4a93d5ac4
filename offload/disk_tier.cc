#include "offload/disk_tier.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <map>
#include <random>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "base/fnv1a.h"

namespace fairscale::offload {
namespace {

constexpr char kMagic[8] = {'F', 'S', 'O', 'F', 'F', 'L', 'D', '\0'};
constexpr uint32_t kVersion = 1;
constexpr uint32_t kCommitted = 1;
constexpr uint32_t kWriting = 2;
constexpr int64_t kHeaderBytes = 4096;
constexpr int64_t kHeaderFnvOffset = 112;  // the header checksum covers [0, 112)

int64_t AlignUp(int64_t x, int64_t a) { return (x + a - 1) / a * a; }

// Whether [offset, offset + bytes) lies in the file's sections after the header, without
// computing a sum that a hostile header can overflow.
bool AfterHeader(int64_t offset, int64_t bytes, int64_t file_bytes) {
  return offset >= kHeaderBytes && bytes >= 0 && offset <= file_bytes &&
         bytes <= file_bytes - offset;
}

std::string Errno(int e) { return absl::StrCat(std::strerror(e), " (errno ", e, ")"); }

absl::Status PWriteAll(int fd, const void* buf, int64_t n, int64_t off, const std::string& what) {
  const char* p = static_cast<const char*>(buf);
  while (n > 0) {
    ssize_t w = ::pwrite(fd, p, static_cast<size_t>(n), off);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return absl::DataLossError(absl::StrCat("cannot write ", what, ": ", Errno(errno)));
    p += w;
    n -= w;
    off += w;
  }
  return absl::OkStatus();
}

// Reads up to n bytes; returns how many (fewer at end of file).
absl::StatusOr<int64_t> PReadAll(int fd, void* buf, int64_t n, int64_t off,
                                 const std::string& what) {
  char* p = static_cast<char*>(buf);
  int64_t got = 0;
  while (got < n) {
    ssize_t r = ::pread(fd, p + got, static_cast<size_t>(n - got), off + got);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return absl::DataLossError(absl::StrCat("cannot read ", what, ": ", Errno(errno)));
    if (r == 0) break;
    got += r;
  }
  return got;
}

template <typename T>
void Put(char* buf, int64_t off, T v) {
  std::memcpy(buf + off, &v, sizeof(T));
}
template <typename T>
T Get(const char* buf, int64_t off) {
  T v;
  std::memcpy(&v, buf + off, sizeof(T));
  return v;
}

struct Header {
  uint32_t version = 0, state = 0;
  uint64_t session = 0, pid = 0, generation = 0;
  int64_t chunk_elems = 0;
  uint64_t num_tensors = 0;
  int64_t layout_offset = 0, layout_bytes = 0;
  uint64_t layout_fnv = 0;
  int64_t table_offset = 0, table_bytes = 0;
  uint64_t table_fnv = 0;
  int64_t file_bytes = 0;
};

// Why a header that passed its checksum is still unusable ("" when it is fine). The sections must
// lie inside the file, so what Open() allocates for them is bounded by the file's size.
std::string MalformedHeader(const Header& h) {
  if (h.state != kCommitted && h.state != kWriting) return absl::StrCat("state ", h.state);
  if (h.chunk_elems <= 0) return absl::StrCat("chunk_elems ", h.chunk_elems);
  if (h.file_bytes < kHeaderBytes) return absl::StrCat("file size ", h.file_bytes);
  if (h.layout_bytes > (64 << 20) || !AfterHeader(h.layout_offset, h.layout_bytes, h.file_bytes)) {
    return absl::StrCat("layout section [", h.layout_offset, " + ", h.layout_bytes,
                        ") outside the file's ", h.file_bytes, " bytes");
  }
  if (h.table_bytes % 8 != 0 || !AfterHeader(h.table_offset, h.table_bytes, h.file_bytes)) {
    return absl::StrCat("checksum table [", h.table_offset, " + ", h.table_bytes,
                        ") outside the file's ", h.file_bytes, " bytes");
  }
  return "";
}

void Encode(const Header& h, char* buf) {
  std::memset(buf, 0, kHeaderBytes);
  std::memcpy(buf, kMagic, 8);
  Put(buf, 8, h.version);
  Put(buf, 12, h.state);
  Put(buf, 16, h.session);
  Put(buf, 24, h.pid);
  Put(buf, 32, h.generation);
  Put(buf, 40, h.chunk_elems);
  Put(buf, 48, h.num_tensors);
  Put(buf, 56, h.layout_offset);
  Put(buf, 64, h.layout_bytes);
  Put(buf, 72, h.layout_fnv);
  Put(buf, 80, h.table_offset);
  Put(buf, 88, h.table_bytes);
  Put(buf, 96, h.table_fnv);
  Put(buf, 104, h.file_bytes);
  Put(buf, kHeaderFnvOffset, base::Fnv1a64(buf, kHeaderFnvOffset));
}

// Reads and checks the header (magic, checksum, version).
absl::StatusOr<Header> ReadHeader(int fd, const std::string& path) {
  std::vector<char> buf(kHeaderBytes);
  absl::StatusOr<int64_t> got = PReadAll(fd, buf.data(), kHeaderBytes, 0, path);
  if (!got.ok()) return got.status();
  if (*got < kHeaderFnvOffset + 8) {
    return absl::DataLossError(absl::StrCat("offload file ", path, " is truncated: ", *got,
                                            " bytes, shorter than its header"));
  }
  if (std::memcmp(buf.data(), kMagic, 8) != 0) {
    return absl::DataLossError(
        absl::StrCat("offload file ", path, " has the wrong magic: not an offload tier file"));
  }
  if (Get<uint64_t>(buf.data(), kHeaderFnvOffset) !=
      base::Fnv1a64(buf.data(), kHeaderFnvOffset)) {
    return absl::DataLossError(absl::StrCat("offload file ", path, ": header checksum mismatch"));
  }
  Header h;
  h.version = Get<uint32_t>(buf.data(), 8);
  h.state = Get<uint32_t>(buf.data(), 12);
  h.session = Get<uint64_t>(buf.data(), 16);
  h.pid = Get<uint64_t>(buf.data(), 24);
  h.generation = Get<uint64_t>(buf.data(), 32);
  h.chunk_elems = Get<int64_t>(buf.data(), 40);
  h.num_tensors = Get<uint64_t>(buf.data(), 48);
  h.layout_offset = Get<int64_t>(buf.data(), 56);
  h.layout_bytes = Get<int64_t>(buf.data(), 64);
  h.layout_fnv = Get<uint64_t>(buf.data(), 72);
  h.table_offset = Get<int64_t>(buf.data(), 80);
  h.table_bytes = Get<int64_t>(buf.data(), 88);
  h.table_fnv = Get<uint64_t>(buf.data(), 96);
  h.file_bytes = Get<int64_t>(buf.data(), 104);
  if (h.version != kVersion) {
    return absl::DataLossError(absl::StrCat("offload file ", path, " has format version ",
                                            h.version, "; this build reads version ", kVersion));
  }
  return h;
}

std::string EncodeLayout(const std::vector<TensorSpec>& specs,
                         const std::vector<int64_t>& offsets) {
  std::string out;
  auto put = [&out](const auto& v) { out.append(reinterpret_cast<const char*>(&v), sizeof(v)); };
  for (size_t i = 0; i < specs.size(); ++i) {
    put(static_cast<uint32_t>(specs[i].name.size()));
    out += specs[i].name;
    put(static_cast<int32_t>(specs[i].dtype));
    put(static_cast<uint32_t>(specs[i].shape.size()));
    for (int64_t d : specs[i].shape) put(d);
    put(offsets[i]);
  }
  return out;
}

absl::Status DecodeLayout(const std::string& in, uint64_t n, const std::string& path,
                          std::vector<TensorSpec>* specs, std::vector<int64_t>* offsets) {
  size_t pos = 0;
  auto get = [&](auto* v) {
    if (pos + sizeof(*v) > in.size()) return false;
    std::memcpy(v, in.data() + pos, sizeof(*v));
    pos += sizeof(*v);
    return true;
  };
  const auto bad = [&](uint64_t i, absl::string_view what) {
    return absl::DataLossError(
        absl::StrCat("offload file ", path, ": malformed layout section: tensor ", i, " ", what));
  };
  for (uint64_t i = 0; i < n; ++i) {
    TensorSpec s;
    uint32_t len = 0, ndim = 0;
    int32_t dtype = 0;
    int64_t off = 0;
    if (!get(&len) || pos + len > in.size()) return bad(i, "is cut short");
    s.name.assign(in.data() + pos, len);
    pos += len;
    if (!get(&dtype) || !get(&ndim)) return bad(i, "is cut short");
    // Only the dtypes with an element size (c10::elementSize() throws for the others).
    if (dtype < 0 || dtype >= static_cast<int32_t>(c10::ScalarType::Undefined)) {
      return bad(i, absl::StrCat("has unknown dtype ", dtype));
    }
    s.dtype = static_cast<c10::ScalarType>(dtype);
    if (ndim > 64) return bad(i, absl::StrCat("has ", ndim, " dimensions"));
    s.shape.resize(ndim);
    // Every size computed from the shape later (numel, nbytes) must fit in int64.
    int64_t nbytes = static_cast<int64_t>(c10::elementSize(s.dtype));
    for (auto& d : s.shape) {
      if (!get(&d)) return bad(i, "is cut short");
      if (d < 0 || __builtin_mul_overflow(nbytes, d, &nbytes)) {
        return bad(i, absl::StrCat("has shape [", absl::StrJoin(s.shape, ", "), "]"));
      }
    }
    if (!get(&off)) return bad(i, "is cut short");
    specs->push_back(std::move(s));
    offsets->push_back(off);
  }
  if (pos != in.size()) {
    return absl::DataLossError(absl::StrCat("offload file ", path,
                                            ": malformed layout section: ", in.size() - pos,
                                            " bytes after the last of ", n, " tensors"));
  }
  return absl::OkStatus();
}

uint64_t NewSession() {
  std::random_device rd;
  uint64_t s = (static_cast<uint64_t>(rd()) << 32) ^ rd() ^ static_cast<uint64_t>(::getpid());
  return s == 0 ? 1 : s;
}

uint64_t ZeroChecksum(int64_t nbytes) {
  static absl::Mutex mu(absl::kConstInit);
  static auto* cache ABSL_PT_GUARDED_BY(mu) = new std::map<int64_t, uint64_t>();
  absl::MutexLock lock(&mu);
  auto it = cache->find(nbytes);
  if (it != cache->end()) return it->second;
  std::vector<char> zeros(static_cast<size_t>(nbytes), 0);
  return (*cache)[nbytes] = base::Fnv1a64(zeros.data(), zeros.size());
}

absl::Status LockError(const std::string& path, int fd) {
  absl::StatusOr<Header> h = ReadHeader(fd, path);
  return absl::FailedPreconditionError(absl::StrCat(
      "offload file ", path, " is in use by another offload tier",
      h.ok() ? absl::StrCat(" (pid ", h->pid, ", session ", h->session, ")") : std::string(),
      "; give every optimizer / model its own file"));
}

}  // namespace

absl::StatusOr<std::unique_ptr<DiskTier>> DiskTier::Create(const std::string& path,
                                                            std::vector<TensorSpec> specs,
                                                            int64_t chunk_elems, bool sync) {
  if (chunk_elems <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("offload file ", path, ": chunk_elems must be positive, got ", chunk_elems));
  }
  std::unique_ptr<DiskTier> t(new DiskTier());
  t->path_ = path;
  t->sync_ = sync;
  t->specs_ = std::move(specs);
  t->chunk_elems_ = chunk_elems;
  t->session_ = NewSession();
  t->fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (t->fd_ < 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot create offload file ", path, ": ", Errno(errno)));
  }
  if (::flock(t->fd_, LOCK_EX | LOCK_NB) != 0) return LockError(path, t->fd_);

  // Layout: header, layout section, checksum table, data.
  int64_t total_chunks = 0;
  for (size_t i = 0; i < t->specs_.size(); ++i) {
    t->first_chunk_.push_back(total_chunks);
    total_chunks += t->num_chunks(i);
  }
  t->data_offset_.assign(t->specs_.size(), 0);
  t->layout_offset_ = kHeaderBytes;
  t->layout_bytes_ =
      static_cast<int64_t>(EncodeLayout(t->specs_, t->data_offset_).size());  // size only
  t->table_offset_ = AlignUp(t->layout_offset_ + t->layout_bytes_, 64);
  int64_t cursor = AlignUp(t->table_offset_ + 8 * total_chunks, 4096);
  for (size_t i = 0; i < t->specs_.size(); ++i) {
    t->data_offset_[i] = cursor;
    cursor = AlignUp(cursor + t->specs_[i].nbytes(), 64);
  }
  t->file_bytes_ = cursor;
  const std::string layout = EncodeLayout(t->specs_, t->data_offset_);
  t->layout_fnv_ = base::Fnv1a64(layout.data(), layout.size());
  {
    absl::MutexLock lock(&t->mu_);  // not shared yet; for the thread-safety analysis
    t->table_.resize(static_cast<size_t>(total_chunks));
    for (size_t i = 0; i < t->specs_.size(); ++i) {
      const int64_t elem = static_cast<int64_t>(c10::elementSize(t->specs_[i].dtype));
      for (int64_t c = 0; c < t->num_chunks(i); ++c) {
        t->table_[t->first_chunk_[i] + c] = ZeroChecksum(t->chunk_count(i, c) * elem);
      }
    }
  }
  if (::ftruncate(t->fd_, 0) != 0 || ::ftruncate(t->fd_, t->file_bytes_) != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot size offload file ", path, " to ", t->file_bytes_, " bytes: ",
                     Errno(errno)));
  }
  absl::Status s = PWriteAll(t->fd_, layout.data(), static_cast<int64_t>(layout.size()),
                             t->layout_offset_, path);
  if (!s.ok()) return s;
  t->writing_ = true;
  s = t->Commit();
  if (!s.ok()) return s;
  return t;
}

absl::StatusOr<std::unique_ptr<DiskTier>> DiskTier::Open(const std::string& path,
                                                          const std::vector<TensorSpec>& expected,
                                                          OpenOptions options) {
  std::unique_ptr<DiskTier> t(new DiskTier());
  t->path_ = path;
  t->fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (t->fd_ < 0) {
    if (errno == ENOENT) return absl::NotFoundError(absl::StrCat("no offload file ", path));
    return absl::FailedPreconditionError(
        absl::StrCat("cannot open offload file ", path, ": ", Errno(errno)));
  }
  if (::flock(t->fd_, LOCK_SH | LOCK_NB) != 0) return LockError(path, t->fd_);
  absl::StatusOr<Header> h = ReadHeader(t->fd_, path);
  if (!h.ok()) return h.status();
  std::string malformed = MalformedHeader(*h);
  if (malformed.empty() && h->state != kCommitted) {
    return absl::DataLossError(absl::StrCat(
        "offload file ", path, " has an interrupted write: generation ", h->generation + 1,
        " by pid ", h->pid, " was never committed"));
  }
  if (options.expected_session != 0 && h->session != options.expected_session) {
    return absl::FailedPreconditionError(absl::StrCat(
        "offload file ", path, " is a stale file of another run: session ", h->session,
        " (pid ", h->pid, ", generation ", h->generation, "), expected session ",
        options.expected_session));
  }
  struct stat st;
  if (::fstat(t->fd_, &st) != 0) {
    return absl::DataLossError(absl::StrCat("cannot stat offload file ", path, ": ",
                                            Errno(errno)));
  }
  if (st.st_size < h->file_bytes) {
    return absl::DataLossError(absl::StrCat("offload file ", path, " is truncated: ", st.st_size,
                                            " bytes, its header says ", h->file_bytes));
  }
  if (!malformed.empty()) {
    return absl::DataLossError(
        absl::StrCat("offload file ", path, ": malformed header: ", malformed));
  }
  std::string layout(static_cast<size_t>(h->layout_bytes), '\0');
  absl::StatusOr<int64_t> got =
      PReadAll(t->fd_, layout.data(), h->layout_bytes, h->layout_offset, path);
  if (!got.ok()) return got.status();
  if (*got != h->layout_bytes || base::Fnv1a64(layout.data(), layout.size()) != h->layout_fnv) {
    return absl::DataLossError(absl::StrCat("offload file ", path, ": layout checksum mismatch"));
  }
  absl::Status s = DecodeLayout(layout, h->num_tensors, path, &t->specs_, &t->data_offset_);
  if (!s.ok()) return s;
  for (size_t i = 0; i < std::max(expected.size(), t->specs_.size()); ++i) {
    if (i >= expected.size() || i >= t->specs_.size() || !(expected[i] == t->specs_[i])) {
      return absl::InvalidArgumentError(absl::StrCat(
          "offload file ", path, ": tensor ", i, " is ",
          i < t->specs_.size() ? DescribeSpec(t->specs_[i]) : "missing", ", expected ",
          i < expected.size() ? DescribeSpec(expected[i]) : "no more tensors"));
    }
  }
  t->chunk_elems_ = h->chunk_elems;
  int64_t total_chunks = 0;
  for (size_t i = 0; i < t->specs_.size(); ++i) {
    t->first_chunk_.push_back(total_chunks);
    total_chunks += t->num_chunks(i);
    // specs_ equal `expected` now, and DecodeLayout() checked that their sizes fit in int64;
    // the offset is the file's.
    if (!AfterHeader(t->data_offset_[i], t->specs_[i].nbytes(), h->file_bytes)) {
      return absl::DataLossError(absl::StrCat("offload file ", path, ": tensor ",
                                              DescribeSpec(t->specs_[i]),
                                              " lies outside the file"));
    }
  }
  if (h->table_bytes / 8 != total_chunks) {
    return absl::DataLossError(absl::StrCat("offload file ", path, ": checksum table has ",
                                            h->table_bytes / 8, " entries, layout needs ",
                                            total_chunks));
  }
  {
    absl::MutexLock lock(&t->mu_);  // not shared yet; for the thread-safety analysis
    t->table_.resize(static_cast<size_t>(total_chunks));
    got = PReadAll(t->fd_, t->table_.data(), h->table_bytes, h->table_offset, path);
    if (!got.ok()) return got.status();
    if (*got != h->table_bytes ||
        base::Fnv1a64(t->table_.data(), static_cast<size_t>(h->table_bytes)) != h->table_fnv) {
      return absl::DataLossError(absl::StrCat("offload file ", path, ": checksum table mismatch"));
    }
  }
  t->session_ = h->session;
  t->generation_ = h->generation;
  t->layout_offset_ = h->layout_offset;
  t->layout_bytes_ = h->layout_bytes;
  t->layout_fnv_ = h->layout_fnv;
  t->table_offset_ = h->table_offset;
  t->file_bytes_ = h->file_bytes;
  if (options.verify_all) {
    std::vector<char> buf;
    for (size_t i = 0; i < t->specs_.size(); ++i) {
      buf.resize(static_cast<size_t>(
          std::min(t->chunk_elems_, t->specs_[i].numel()) *
          static_cast<int64_t>(c10::elementSize(t->specs_[i].dtype))));
      for (int64_t c = 0; c < t->num_chunks(i); ++c) {
        s = t->ReadChunk(i, c, buf.data());
        if (!s.ok()) return s;
      }
    }
  }
  return t;
}

DiskTier::~DiskTier() {
  if (fd_ >= 0) ::close(fd_);
}

absl::Status DiskTier::Close() {
  if (fd_ < 0) return absl::OkStatus();
  const int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0) {
    return absl::DataLossError(absl::StrCat("cannot close offload file ", path_, ": ",
                                            Errno(errno)));
  }
  return absl::OkStatus();
}

int64_t DiskTier::ChunkOffset(size_t tensor, int64_t chunk) const {
  return data_offset_[tensor] +
         chunk_begin(chunk) * static_cast<int64_t>(c10::elementSize(specs_[tensor].dtype));
}

std::string DiskTier::Where(size_t tensor, int64_t chunk) const {
  return absl::StrCat("offload file ", path_, ": tensor ", DescribeSpec(specs_[tensor]),
                      " chunk ", chunk, "/", num_chunks(tensor));
}

absl::Status DiskTier::ReadChunk(size_t tensor, int64_t chunk, void* dst) {
  if (tensor >= specs_.size() || chunk < 0 || chunk >= num_chunks(tensor)) {
    return absl::InvalidArgumentError(absl::StrCat("offload file ", path_, ": no chunk ", chunk,
                                                   " of tensor ", tensor));
  }
  const int64_t n = chunk_count(tensor, chunk) *
                    static_cast<int64_t>(c10::elementSize(specs_[tensor].dtype));
  absl::StatusOr<int64_t> got = PReadAll(fd_, dst, n, ChunkOffset(tensor, chunk), path_);
  if (!got.ok()) return got.status();
  if (*got != n) {
    return absl::DataLossError(absl::StrCat(Where(tensor, chunk), ": file truncated (read ", *got,
                                            " of ", n, " bytes)"));
  }
  const uint64_t h = base::Fnv1a64(dst, static_cast<size_t>(n));
  uint64_t want;
  {
    absl::MutexLock lock(&mu_);
    want = table_[first_chunk_[tensor] + chunk];
  }
  if (h != want) {
    return absl::DataLossError(absl::StrCat(Where(tensor, chunk),
                                            ": checksum mismatch (the data was corrupted or "
                                            "written by someone else)"));
  }
  return absl::OkStatus();
}

absl::Status DiskTier::WriteChunk(size_t tensor, int64_t chunk, const void* src) {
  if (tensor >= specs_.size() || chunk < 0 || chunk >= num_chunks(tensor)) {
    return absl::InvalidArgumentError(absl::StrCat("offload file ", path_, ": no chunk ", chunk,
                                                   " of tensor ", tensor));
  }
  if (!writing_) {
    absl::Status s = WriteHeader(kWriting);
    if (!s.ok()) return s;
    writing_ = true;
  }
  const int64_t n = chunk_count(tensor, chunk) *
                    static_cast<int64_t>(c10::elementSize(specs_[tensor].dtype));
  const uint64_t h = base::Fnv1a64(src, static_cast<size_t>(n));
  absl::Status s = PWriteAll(fd_, src, n, ChunkOffset(tensor, chunk), Where(tensor, chunk));
  if (!s.ok()) return s;
  absl::MutexLock lock(&mu_);
  table_[first_chunk_[tensor] + chunk] = h;
  return absl::OkStatus();
}

absl::Status DiskTier::WriteHeader(uint32_t state) {
  Header h;
  h.version = kVersion;
  h.state = state;
  h.session = session_;
  h.pid = static_cast<uint64_t>(::getpid());
  h.generation = generation_;
  h.chunk_elems = chunk_elems_;
  h.num_tensors = specs_.size();
  h.layout_offset = layout_offset_;
  h.layout_bytes = layout_bytes_;
  h.layout_fnv = layout_fnv_;
  h.table_offset = table_offset_;
  {
    absl::MutexLock lock(&mu_);
    h.table_bytes = static_cast<int64_t>(8 * table_.size());
    h.table_fnv = base::Fnv1a64(table_.data(), 8 * table_.size());
  }
  h.file_bytes = file_bytes_;
  std::vector<char> buf(kHeaderBytes);
  Encode(h, buf.data());
  return PWriteAll(fd_, buf.data(), kHeaderBytes, 0, absl::StrCat("offload file ", path_));
}

absl::Status DiskTier::Commit() {
  if (!writing_) return absl::OkStatus();
  std::vector<uint64_t> table;
  {
    absl::MutexLock lock(&mu_);
    table = table_;
  }
  absl::Status s = PWriteAll(fd_, table.data(), static_cast<int64_t>(8 * table.size()),
                             table_offset_, absl::StrCat("offload file ", path_));
  if (!s.ok()) return s;
  if (sync_ && ::fdatasync(fd_) != 0) {
    return absl::DataLossError(absl::StrCat("fdatasync ", path_, ": ", Errno(errno)));
  }
  ++generation_;
  s = WriteHeader(kCommitted);
  if (!s.ok()) return s;
  if (sync_ && ::fdatasync(fd_) != 0) {
    return absl::DataLossError(absl::StrCat("fdatasync ", path_, ": ", Errno(errno)));
  }
  writing_ = false;
  return absl::OkStatus();
}

absl::Status DiskTier::CheckOwnership() {
  absl::StatusOr<Header> h = ReadHeader(fd_, path_);
  if (!h.ok()) return h.status();
  if (h->session != session_ || h->generation != generation_) {
    return absl::FailedPreconditionError(absl::StrCat(
        "offload file ", path_, " was rewritten by another process: it holds session ",
        h->session, " generation ", h->generation, " (pid ", h->pid, "), this tier wrote session ",
        session_, " generation ", generation_));
  }
  struct stat by_fd, by_path;
  if (::fstat(fd_, &by_fd) != 0 || ::stat(path_.c_str(), &by_path) != 0 ||
      by_fd.st_ino != by_path.st_ino || by_fd.st_dev != by_path.st_dev) {
    return absl::FailedPreconditionError(absl::StrCat(
        "offload file ", path_, " was removed or replaced by another process"));
  }
  return absl::OkStatus();
}

}  // namespace fairscale::offload
