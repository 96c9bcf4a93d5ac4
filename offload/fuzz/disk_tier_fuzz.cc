// Fuzz target (libFuzzer's LLVMFuzzerTestOneInput) for the offload tier's file reader,
// DiskTier::Open (offload/disk_tier.h documents the format), and the chunk reads after it.
// Built two ways: //offload/fuzz:disk_tier_fuzz_test (gcc; the seeds in corpus/ plus
// deterministic mutations on every test run, //base:fuzz_replay_main) and run_libfuzzer.sh
// (clang, -fsanitize=fuzzer,address,undefined).
//
// Input: byte 0 is a control byte (fuzz_input.h): which expected tensor list Open() gets, which
// checksums the harness recomputes, and the session / verify_all options. The rest is the file.
// Random bytes die at the header checksum, so for most inputs the harness first recomputes, where
// the file's own header places them inside the input, the per-chunk checksums in the table (from
// the data, using its own reading of the layout section), the table's and the layout's FNV-1a,
// and last the header's; mutated fields then reach the header checks, DecodeLayout, the
// comparison with the expected tensors, the table and ReadChunk. It writes the result to one
// fixed file per process under $TEST_TMPDIR (else /tmp) and opens it.
//
// For every input it checks that
//   * no exception escapes (a c10::Error from a dtype without an element size, for one);
//   * an error is kDataLoss, kInvalidArgument (only the "expected ..." tensor mismatch) or
//     kFailedPrecondition (only a stale session, and only when a session was expected), and its
//     message names the file (kNotFound cannot happen: the file exists);
//   * a file of another session (mode kStale) never opens;
//   * after a successful Open: the file's header says committed; specs() equal the expected
//     list; session() is the file's (and the expected one, if any); the harness's own reading of
//     the layout agrees; every chunk of every tensor reads into a buffer with 64-byte canaries on
//     both sides that stay intact, returning OK (always, when Open verified every chunk) or
//     kDataLoss naming the file, and a chunk that reads OK holds exactly the file's bytes at that
//     tensor's data offset; out-of-range chunk numbers are kInvalidArgument.
// Crashes and sanitizer reports (ASan, UBSan: the integer overflows of hostile offsets and sizes)
// abort too. Allocations beyond what a file of this size warrants (the sections are bounded by
// the file) are caught by run_libfuzzer.sh's -malloc_limit_mb, not by the gcc replay test.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "base/fnv1a.h"
#include "base/fuzz_check.h"
#include "offload/disk_tier.h"
#include "offload/fuzz/fuzz_input.h"
#include "offload/tier.h"

namespace {

namespace fo = fairscale::offload;
namespace fz = fairscale::offload::fuzz;

constexpr size_t kHeaderBytes = 4096;
constexpr size_t kHeaderFnv = 112;
constexpr size_t kCanary = 64;
constexpr char kCanaryByte = '\xa5';

const std::string& Path() {
  static const std::string path = [] {
    const char* tmp = std::getenv("TEST_TMPDIR");
    return absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/fs_offload_fuzz_", getpid(), ".fso");
  }();
  return path;
}

template <typename T>
T Get(const std::string& b, size_t off) {
  T v{};
  if (off + sizeof(T) <= b.size()) std::memcpy(&v, b.data() + off, sizeof(T));
  return v;
}
template <typename T>
void Put(std::string& b, size_t off, T v) {
  if (off + sizeof(T) <= b.size()) std::memcpy(&b[off], &v, sizeof(T));
}

// Whether [off, off + n) lies inside a buffer of `size` bytes (no sums that overflow).
bool Inside(int64_t off, int64_t n, size_t size) {
  return off >= 0 && n >= 0 && static_cast<uint64_t>(off) <= size &&
         static_cast<uint64_t>(n) <= size - static_cast<uint64_t>(off);
}

struct Tensor {
  fo::TensorSpec spec;
  int64_t offset = 0;
  int64_t nbytes = 0;
};

// The harness's own, independent reading of the layout section at [off, off + n) of `file`:
// false where it is not a list of `count` well-formed tensors with exactly n bytes.
bool ParseLayout(const std::string& file, int64_t off, int64_t n, uint64_t count,
                 std::vector<Tensor>* out) {
  if (!Inside(off, n, file.size())) return false;
  const std::string in = file.substr(static_cast<size_t>(off), static_cast<size_t>(n));
  size_t pos = 0;
  const auto take = [&](size_t k) {
    if (k > in.size() - pos) return false;
    pos += k;
    return true;
  };
  for (uint64_t i = 0; i < count; ++i) {
    Tensor t;
    const size_t at_len = pos;
    if (!take(4)) return false;
    const uint32_t len = Get<uint32_t>(in, at_len);
    const size_t at_name = pos;
    if (!take(len)) return false;
    t.spec.name = in.substr(at_name, len);
    const size_t at_dtype = pos;
    if (!take(8)) return false;
    const int32_t dtype = Get<int32_t>(in, at_dtype);
    const uint32_t ndim = Get<uint32_t>(in, at_dtype + 4);
    if (dtype < 0 || dtype >= static_cast<int32_t>(c10::ScalarType::Undefined) || ndim > 64) {
      return false;
    }
    t.spec.dtype = static_cast<c10::ScalarType>(dtype);
    t.nbytes = static_cast<int64_t>(c10::elementSize(t.spec.dtype));
    for (uint32_t d = 0; d < ndim; ++d) {
      const size_t at_dim = pos;
      if (!take(8)) return false;
      const int64_t dim = Get<int64_t>(in, at_dim);
      if (dim < 0 || __builtin_mul_overflow(t.nbytes, dim, &t.nbytes)) return false;
      t.spec.shape.push_back(dim);
    }
    const size_t at_offset = pos;
    if (!take(8)) return false;
    t.offset = Get<int64_t>(in, at_offset);
    out->push_back(std::move(t));
  }
  return pos == in.size();
}

// Recomputes the checksums that `fix` names, in dependency order (chunks, table, layout, header).
void FixChecksums(uint8_t fix, std::string& file) {
  if (file.size() < kHeaderFnv + 8) return;
  const int64_t chunk_elems = Get<int64_t>(file, 40);
  const uint64_t num_tensors = Get<uint64_t>(file, 48);
  const int64_t layout_offset = Get<int64_t>(file, 56), layout_bytes = Get<int64_t>(file, 64);
  const int64_t table_offset = Get<int64_t>(file, 80), table_bytes = Get<int64_t>(file, 88);
  const bool table_inside = Inside(table_offset, table_bytes, file.size());
  std::vector<Tensor> tensors;
  if ((fix & fz::kFixChunks) && table_inside && chunk_elems > 0 &&
      ParseLayout(file, layout_offset, layout_bytes, num_tensors, &tensors)) {
    int64_t first = 0;  // the tensor's first chunk in the table
    for (const Tensor& t : tensors) {
      const int64_t elem = static_cast<int64_t>(c10::elementSize(t.spec.dtype));
      const int64_t numel = t.nbytes / elem;
      const int64_t chunks = numel == 0 ? 0 : (numel - 1) / chunk_elems + 1;
      // Only data inside the input: numel is then at most the input's size.
      for (int64_t c = 0; Inside(t.offset, t.nbytes, file.size()) && c < chunks; ++c) {
        if (first + c >= table_bytes / 8) break;
        const int64_t begin = c * chunk_elems;  // < numel: no overflow
        const int64_t count = std::min(chunk_elems, numel - begin);
        const uint64_t h =
            fairscale::base::Fnv1a64(file.data() + t.offset + begin * elem, count * elem);
        Put(file, static_cast<size_t>(table_offset + 8 * (first + c)), h);
      }
      if (chunks > table_bytes / 8 - first) break;  // the rest of the table is beyond the layout
      first += chunks;
    }
  }
  if ((fix & fz::kFixTable) && table_inside) {
    Put(file, 96, fairscale::base::Fnv1a64(file.data() + table_offset, table_bytes));
  }
  if ((fix & fz::kFixLayout) && Inside(layout_offset, layout_bytes, file.size())) {
    Put(file, 72, fairscale::base::Fnv1a64(file.data() + layout_offset, layout_bytes));
  }
  if (fix & fz::kFixHeader) Put(file, kHeaderFnv, fairscale::base::Fnv1a64(file.data(), kHeaderFnv));
}

// Overwrites the file in place and then cuts it to size. Not O_TRUNC: on ext4, truncating a file
// to 0 and rewriting it makes close() flush it to disk (auto_da_alloc), which made the replay
// test 10x slower on a disk $TEST_TMPDIR.
void WriteFile(const std::string& path, const std::string& bytes) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0644);
  FS_FUZZ_CHECK(fd >= 0);
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t w = ::pwrite(fd, bytes.data() + done, bytes.size() - done, done);
    FS_FUZZ_CHECK(w > 0);
    done += static_cast<size_t>(w);
  }
  FS_FUZZ_CHECK(::ftruncate(fd, static_cast<off_t>(bytes.size())) == 0);
  FS_FUZZ_CHECK(::close(fd) == 0);
}

void CheckError(const absl::Status& s, const std::string& path, uint64_t expected_session) {
  const absl::StatusCode code = s.code();
  FS_FUZZ_CHECK(absl::StrContains(s.message(), path));
  if (code == absl::StatusCode::kInvalidArgument) {
    FS_FUZZ_CHECK(absl::StrContains(s.message(), ", expected "));
  } else if (code == absl::StatusCode::kFailedPrecondition) {
    FS_FUZZ_CHECK(expected_session != 0);
    FS_FUZZ_CHECK(absl::StrContains(s.message(), "stale file of another run"));
  } else {
    FS_FUZZ_CHECK(code == absl::StatusCode::kDataLoss);
  }
}

void CheckOpened(fo::DiskTier& t, const std::string& file, const std::vector<fo::TensorSpec>& expected,
                 uint64_t expected_session, bool verify_all) {
  const std::string& path = Path();
  FS_FUZZ_CHECK(file.size() >= kHeaderBytes);
  FS_FUZZ_CHECK(Get<uint32_t>(file, 12) == 1);  // committed
  FS_FUZZ_CHECK(t.specs() == expected);
  FS_FUZZ_CHECK(t.chunk_elems() > 0 && t.chunk_elems() == Get<int64_t>(file, 40));
  FS_FUZZ_CHECK(t.session() == Get<uint64_t>(file, 16));
  FS_FUZZ_CHECK(expected_session == 0 || t.session() == expected_session);
  FS_FUZZ_CHECK(t.generation() == Get<uint64_t>(file, 32));
  std::vector<Tensor> tensors;
  FS_FUZZ_CHECK(ParseLayout(file, Get<int64_t>(file, 56), Get<int64_t>(file, 64),
                            Get<uint64_t>(file, 48), &tensors));
  FS_FUZZ_CHECK(tensors.size() == expected.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    FS_FUZZ_CHECK(tensors[i].spec == expected[i]);
    FS_FUZZ_CHECK(Inside(tensors[i].offset, tensors[i].nbytes, file.size()));
  }
  for (size_t i = 0; i < expected.size(); ++i) {
    const int64_t elem = static_cast<int64_t>(c10::elementSize(expected[i].dtype));
    const int64_t numel = expected[i].numel();
    int64_t covered = 0;
    for (int64_t c = 0; c < t.num_chunks(i); ++c) {
      const int64_t count = t.chunk_count(i, c);
      FS_FUZZ_CHECK(count > 0 && count <= t.chunk_elems() && t.chunk_begin(c) == covered);
      covered += count;
      const size_t n = static_cast<size_t>(count * elem);
      std::string buf(kCanary + n + kCanary, kCanaryByte);
      const absl::Status s = t.ReadChunk(i, c, &buf[kCanary]);
      for (size_t k = 0; k < kCanary; ++k) {
        FS_FUZZ_CHECK(buf[k] == kCanaryByte && buf[kCanary + n + k] == kCanaryByte);
      }
      if (s.ok()) {
        const size_t at = static_cast<size_t>(tensors[i].offset + t.chunk_begin(c) * elem);
        FS_FUZZ_CHECK(std::memcmp(&buf[kCanary], file.data() + at, n) == 0);
      } else {
        FS_FUZZ_CHECK(!verify_all);  // Open read every chunk already, and the file is unchanged
        FS_FUZZ_CHECK(s.code() == absl::StatusCode::kDataLoss);
        FS_FUZZ_CHECK(absl::StrContains(s.message(), path));
      }
    }
    FS_FUZZ_CHECK(covered == numel);
    char byte;
    FS_FUZZ_CHECK(t.ReadChunk(i, t.num_chunks(i), &byte).code() ==
                  absl::StatusCode::kInvalidArgument);
    FS_FUZZ_CHECK(t.ReadChunk(i, -1, &byte).code() == absl::StatusCode::kInvalidArgument);
  }
  char byte;
  FS_FUZZ_CHECK(t.ReadChunk(expected.size(), 0, &byte).code() ==
                absl::StatusCode::kInvalidArgument);
}

void Run(const uint8_t* data, size_t size) {
  if (size == 0) return;
  const uint8_t control = data[0];
  std::string file(reinterpret_cast<const char*>(data) + 1, size - 1);
  FixChecksums(control, file);
  const std::string& path = Path();
  WriteFile(path, file);

  const std::vector<fo::TensorSpec> expected = fz::ExpectedSpecs(control & fz::kSpecsMask);
  const auto mode = static_cast<fz::SessionMode>(control >> fz::kSessionShift);
  const uint64_t file_session = Get<uint64_t>(file, 16);
  fo::DiskTier::OpenOptions options;
  options.verify_all = mode != fz::SessionMode::kAnyLazy;
  if (mode == fz::SessionMode::kExact) options.expected_session = file_session;
  if (mode == fz::SessionMode::kStale) options.expected_session = file_session + 1;

  absl::StatusOr<std::unique_ptr<fo::DiskTier>> t = fo::DiskTier::Open(path, expected, options);
  if (!t.ok()) {
    CheckError(t.status(), path, options.expected_session);
    return;
  }
  FS_FUZZ_CHECK(mode != fz::SessionMode::kStale || options.expected_session == 0);
  CheckOpened(**t, file, expected, options.expected_session, options.verify_all);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    Run(data, size);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "exception escaped: %s\n", e.what());
    FS_FUZZ_CHECK(false);
  }
  return 0;
}
