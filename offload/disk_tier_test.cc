// DiskTier: round trip, and every kind of bad file gives its named error.
#include "offload/disk_tier.h"

#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <limits>
#include <numeric>
#include <sstream>
#include <string>
#include <vector>

#include "base/fnv1a.h"
#include "base/status_matchers.h"
#include "testing/tmp.h"

namespace fairscale::offload {
namespace {

using ::fairscale::base::testing::IsOk;
using ::fairscale::base::testing::StatusIs;
using ::fairscale::testing::TmpPath;
using ::testing::AllOf;
using ::testing::HasSubstr;

std::vector<TensorSpec> Specs() {
  return {{"a", c10::kFloat, {3, 5}}, {"b", c10::kFloat, {37}}, {"empty", c10::kFloat, {0}},
          {"c", c10::kLong, {2}}};
}

// Writes a file: a = 0..14, b = 100..136, c = {7, 8}; committed unless told otherwise.
std::unique_ptr<DiskTier> Write(const std::string& path, bool commit = true) {
  auto t = DiskTier::Create(path, Specs(), /*chunk_elems=*/8, /*sync=*/false);
  EXPECT_THAT(t.status(), IsOk());
  std::vector<float> a(15), b(37);
  std::iota(a.begin(), a.end(), 0.f);
  std::iota(b.begin(), b.end(), 100.f);
  std::vector<int64_t> c = {7, 8};
  EXPECT_OK((*t)->WriteTensor(0, a.data()));
  EXPECT_OK((*t)->WriteTensor(1, b.data()));
  EXPECT_OK((*t)->WriteTensor(3, c.data()));
  if (commit) {
    EXPECT_OK((*t)->Commit());
  }
  return *std::move(t);
}

void Poke(const std::string& path, off_t offset, const std::string& bytes) {
  int fd = ::open(path.c_str(), O_WRONLY);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::pwrite(fd, bytes.data(), bytes.size(), offset), static_cast<ssize_t>(bytes.size()));
  ::close(fd);
}

// A hostile (or buggy) writer: applies `edit` to the file's bytes, then recomputes the layout
// checksum (where the header's layout section lies inside the file) and the header checksum, so
// the reader gets past both and has to judge the fields themselves.
void Forge(const std::string& path, const std::function<void(std::string&)>& edit) {
  std::string bytes;
  {
    std::ifstream in(path, std::ios::binary);
    std::stringstream buffer;
    buffer << in.rdbuf();
    bytes = buffer.str();
  }
  ASSERT_GE(bytes.size(), 4096u);
  edit(bytes);
  int64_t layout_offset, layout_bytes;
  std::memcpy(&layout_offset, bytes.data() + 56, 8);
  std::memcpy(&layout_bytes, bytes.data() + 64, 8);
  if (layout_offset >= 0 && layout_bytes >= 0 &&
      layout_offset <= static_cast<int64_t>(bytes.size()) &&
      layout_bytes <= static_cast<int64_t>(bytes.size()) - layout_offset) {
    const uint64_t fnv = base::Fnv1a64(bytes.data() + layout_offset, layout_bytes);
    std::memcpy(&bytes[72], &fnv, 8);
  }
  const uint64_t fnv = base::Fnv1a64(bytes.data(), 112);
  std::memcpy(&bytes[112], &fnv, 8);
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

template <typename T>
void Set(std::string& bytes, size_t offset, T v) {
  ASSERT_LE(offset + sizeof(T), bytes.size());
  std::memcpy(&bytes[offset], &v, sizeof(T));
}

// Where Specs()' layout section puts tensor 'a' (the first): 4-byte name length, "a", 4-byte
// dtype, 4-byte rank, two 8-byte dims, 8-byte data offset.
constexpr size_t kLayoutA = 4096;
constexpr size_t kDtypeA = kLayoutA + 4 + 1;
constexpr size_t kDimsA = kDtypeA + 4 + 4;
constexpr size_t kOffsetA = kDimsA + 16;

TEST(DiskTierTest, RoundTripAcrossChunks) {
  const std::string path = TmpPath("round_trip.fso");
  uint64_t session;
  {
    auto t = Write(path);
    session = t->session();
    EXPECT_EQ(t->num_chunks(1), 5);  // 37 elements in chunks of 8
    EXPECT_EQ(t->chunk_count(1, 4), 5);
    EXPECT_EQ(t->num_chunks(2), 0);
    EXPECT_OK(t->CheckOwnership());
  }
  ASSERT_OK_AND_ASSIGN(auto t, DiskTier::Open(path, Specs(), {session, /*verify_all=*/true}));
  std::vector<float> b(37);
  ASSERT_OK(t->ReadTensor(1, b.data()));
  for (int i = 0; i < 37; ++i) EXPECT_EQ(b[i], 100.f + i);
  std::vector<int64_t> c(2);
  ASSERT_OK(t->ReadTensor(3, c.data()));
  EXPECT_EQ(c, (std::vector<int64_t>{7, 8}));
}

TEST(DiskTierTest, CopyTensorAcrossChunkSizes) {
  auto src = Write(TmpPath("copy_src.fso"));  // chunks of 8
  for (int64_t chunk : {3, 8, 11, 100}) {
    ASSERT_OK_AND_ASSIGN(auto dst, DiskTier::Create(TmpPath("copy_dst.fso"), Specs(), chunk, false));
    for (size_t i = 0; i < Specs().size(); ++i) ASSERT_OK(CopyTensor(*src, *dst, i));
    std::vector<float> b(37);
    ASSERT_OK(dst->ReadTensor(1, b.data()));
    for (int i = 0; i < 37; ++i) EXPECT_EQ(b[i], 100.f + i) << "chunk " << chunk;
    std::vector<int64_t> c(2);
    ASSERT_OK(dst->ReadTensor(3, c.data()));
    EXPECT_EQ(c, (std::vector<int64_t>{7, 8}));
  }
  EXPECT_THAT(CopyTensor(*src, *src, 0), IsOk());
  ASSERT_OK_AND_ASSIGN(auto other,
                       DiskTier::Create(TmpPath("copy_other.fso"),
                                        {{"a", c10::kFloat, {14}}, {"b", c10::kLong, {37}}}, 8, false));
  EXPECT_THAT(CopyTensor(*src, *other, 0), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(CopyTensor(*src, *other, 1), StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(DiskTierTest, FreshFileReadsZeros) {
  const std::string path = TmpPath("zeros.fso");
  ASSERT_OK_AND_ASSIGN(auto t, DiskTier::Create(path, Specs(), 8, false));
  std::vector<float> a(15, 1.f);
  ASSERT_OK(t->ReadTensor(0, a.data()));
  for (float x : a) EXPECT_EQ(x, 0.f);
}

TEST(DiskTierTest, MissingFile) {
  EXPECT_THAT(DiskTier::Open(TmpPath("nope.fso"), Specs(), {}).status(),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("nope.fso")));
}

TEST(DiskTierTest, TruncatedFile) {
  const std::string path = TmpPath("truncated.fso");
  Write(path);
  ASSERT_EQ(::truncate(path.c_str(), 4096 + 100), 0);
  EXPECT_THAT(DiskTier::Open(path, Specs(), {}).status(),
              StatusIs(absl::StatusCode::kDataLoss,
                       AllOf(HasSubstr(path), HasSubstr("truncated"))));
  ASSERT_EQ(::truncate(path.c_str(), 10), 0);
  EXPECT_THAT(DiskTier::Open(path, Specs(), {}).status(),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("truncated")));
}

TEST(DiskTierTest, WrongMagic) {
  const std::string path = TmpPath("magic.fso");
  Write(path);
  Poke(path, 0, "NOTMAGIC");
  EXPECT_THAT(DiskTier::Open(path, Specs(), {}).status(),
              StatusIs(absl::StatusCode::kDataLoss, AllOf(HasSubstr(path), HasSubstr("magic"))));
}

TEST(DiskTierTest, CorruptHeader) {
  const std::string path = TmpPath("header.fso");
  Write(path);
  Poke(path, 40, "\x09");  // chunk_elems
  EXPECT_THAT(DiskTier::Open(path, Specs(), {}).status(),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("header checksum")));
}

TEST(DiskTierTest, CorruptChunkNamesTensorAndChunk) {
  const std::string path = TmpPath("corrupt.fso");
  Write(path);
  // Corrupt tensor c: find its bytes {7, 8} in the file.
  std::string bytes;
  {
    FILE* f = std::fopen(path.c_str(), "rb");
    char buf[4096];
    size_t n;
    while ((n = std::fread(buf, 1, sizeof(buf), f)) > 0) bytes.append(buf, n);
    std::fclose(f);
  }
  const int64_t seven = 7, eight = 8;
  std::string needle(reinterpret_cast<const char*>(&seven), 8);
  needle.append(reinterpret_cast<const char*>(&eight), 8);
  const size_t at = bytes.rfind(needle);
  ASSERT_NE(at, std::string::npos);
  Poke(path, static_cast<off_t>(at), "\x09");
  EXPECT_THAT(DiskTier::Open(path, Specs(), {0, /*verify_all=*/true}).status(),
              StatusIs(absl::StatusCode::kDataLoss,
                       AllOf(HasSubstr(path), HasSubstr("'c'"), HasSubstr("chunk 0/1"),
                             HasSubstr("checksum mismatch"))));
  // Without verify_all the open succeeds and the read of that chunk fails.
  ASSERT_OK_AND_ASSIGN(auto t, DiskTier::Open(path, Specs(), {}));
  std::vector<int64_t> c(2);
  EXPECT_THAT(t->ReadTensor(3, c.data()),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("'c'")));
}

TEST(DiskTierTest, InterruptedWrite) {
  const std::string path = TmpPath("interrupted.fso");
  {
    auto t = Write(path, /*commit=*/false);
    ASSERT_OK(t->Close());  // no commit: as if the process died mid-step
  }
  EXPECT_THAT(DiskTier::Open(path, Specs(), {}).status(),
              StatusIs(absl::StatusCode::kDataLoss,
                       AllOf(HasSubstr(path), HasSubstr("interrupted write"))));
}

TEST(DiskTierTest, LayoutMismatchNamesTensor) {
  const std::string path = TmpPath("layout.fso");
  Write(path);
  auto shape = Specs();
  shape[1].shape = {36};
  EXPECT_THAT(DiskTier::Open(path, shape, {}).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr(path), HasSubstr("'b': Float[37]"),
                             HasSubstr("expected 'b': Float[36]"))));
  auto dtype = Specs();
  dtype[0].dtype = c10::kBFloat16;
  EXPECT_THAT(DiskTier::Open(path, dtype, {}).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("BFloat16")));
  auto fewer = Specs();
  fewer.pop_back();
  EXPECT_THAT(DiskTier::Open(path, fewer, {}).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("no more tensors")));
}

TEST(DiskTierTest, StaleFileOfAnotherSession) {
  const std::string path = TmpPath("stale.fso");
  const uint64_t session = Write(path)->session();
  EXPECT_THAT(DiskTier::Open(path, Specs(), {session + 1}).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       AllOf(HasSubstr(path), HasSubstr("stale"))));
}

TEST(DiskTierTest, SecondWriterIsRefused) {
  const std::string path = TmpPath("locked.fso");
  auto first = Write(path);
  EXPECT_THAT(DiskTier::Create(path, Specs(), 8, false).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       AllOf(HasSubstr(path), HasSubstr("in use"))));
  EXPECT_THAT(DiskTier::Open(path, Specs(), {}).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("in use")));
  EXPECT_OK(first->CheckOwnership());
}

TEST(DiskTierTest, ReplacedFileIsDetected) {
  const std::string path = TmpPath("replaced.fso");
  auto t = Write(path);
  const std::string other = TmpPath("replaced_other.fso");
  Write(other);
  ASSERT_EQ(std::rename(other.c_str(), path.c_str()), 0);
  EXPECT_THAT(t->CheckOwnership(),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("replaced")));
}

TEST(DiskTierTest, HeaderRewrittenUnderneathIsDetected) {
  const std::string path = TmpPath("rewritten.fso");
  auto t = Write(path);
  Poke(path, 16, "\x01\x02");  // session bytes (header checksum now wrong too)
  EXPECT_FALSE(t->CheckOwnership().ok());
}

// Regression: a data offset near 2^63 made `offset + nbytes` overflow (undefined; in practice it
// wrapped negative and passed the "inside the file" check, so Open succeeded).
TEST(DiskTierTest, HostileDataOffsetIsRejected) {
  const std::string path = TmpPath("hostile_offset.fso");
  Write(path);
  for (int64_t offset : {std::numeric_limits<int64_t>::max() - 8, int64_t{-64}, int64_t{0}}) {
    Forge(path, [&](std::string& b) { Set(b, kOffsetA, offset); });
    EXPECT_THAT(DiskTier::Open(path, Specs(), {}).status(),
                StatusIs(absl::StatusCode::kDataLoss,
                         AllOf(HasSubstr(path), HasSubstr("'a': Float[3, 5] lies outside the file"))))
        << offset;
  }
}

// Regression: num_chunks computed (numel + chunk_elems - 1) / chunk_elems, which overflows for a
// chunk_elems near 2^63 (undefined; in practice 0 chunks, so writes and reads silently did
// nothing). A chunk larger than every tensor must mean one chunk per tensor.
TEST(DiskTierTest, ChunkElemsLargerThanAnyTensor) {
  const std::string path = TmpPath("huge_chunk.fso");
  const int64_t huge = std::numeric_limits<int64_t>::max();
  uint64_t session;
  {
    ASSERT_OK_AND_ASSIGN(auto t, DiskTier::Create(path, Specs(), huge, false));
    EXPECT_EQ(t->num_chunks(0), 1);
    EXPECT_EQ(t->num_chunks(2), 0);
    EXPECT_EQ(t->chunk_count(1, 0), 37);
    std::vector<float> b(37);
    std::iota(b.begin(), b.end(), 100.f);
    ASSERT_OK(t->WriteTensor(1, b.data()));
    ASSERT_OK(t->Commit());
    session = t->session();
  }
  ASSERT_OK_AND_ASSIGN(auto t, DiskTier::Open(path, Specs(), {session, /*verify_all=*/true}));
  std::vector<float> b(37);
  ASSERT_OK(t->ReadTensor(1, b.data()));
  for (int i = 0; i < 37; ++i) EXPECT_EQ(b[i], 100.f + i);
  // The same chunk size forged into a file written with chunks of 8: its table no longer fits.
  const std::string forged = TmpPath("huge_chunk_forged.fso");
  Write(forged);
  Forge(forged, [&](std::string& bytes) { Set(bytes, 40, huge); });
  EXPECT_THAT(DiskTier::Open(forged, Specs(), {}).status(),
              StatusIs(absl::StatusCode::kDataLoss,
                       AllOf(HasSubstr(forged), HasSubstr("checksum table has 8 entries, "
                                                          "layout needs 3"))));
}

// Regression: a layout naming a dtype that is no ScalarType, or a shape whose size overflows,
// was reported as the caller's mismatch (kInvalidArgument, "UNKNOWN_SCALAR"): it is a corrupt
// file.
TEST(DiskTierTest, CorruptLayoutIsDataLoss) {
  const std::string path = TmpPath("corrupt_layout.fso");
  Write(path);
  for (int32_t dtype : {99, -1, static_cast<int32_t>(c10::ScalarType::Undefined),
                        static_cast<int32_t>(c10::ScalarType::NumOptions)}) {
    Forge(path, [&](std::string& b) { Set(b, kDtypeA, dtype); });
    EXPECT_THAT(DiskTier::Open(path, Specs(), {}).status(),
                StatusIs(absl::StatusCode::kDataLoss,
                         AllOf(HasSubstr(path), HasSubstr("malformed layout section"),
                               HasSubstr("dtype"))))
        << dtype;
  }
  Write(path);
  Forge(path, [&](std::string& b) {
    Set(b, kDimsA, int64_t{1} << 40);
    Set(b, kDimsA + 8, int64_t{1} << 40);
  });
  EXPECT_THAT(DiskTier::Open(path, Specs(), {}).status(),
              StatusIs(absl::StatusCode::kDataLoss,
                       AllOf(HasSubstr(path), HasSubstr("malformed layout section"))));
  // Bytes after the last tensor: the header's layout size disagrees with the layout.
  Write(path);
  Forge(path, [&](std::string& b) {
    int64_t layout_bytes;
    std::memcpy(&layout_bytes, b.data() + 64, 8);
    Set(b, 64, layout_bytes + 8);
  });
  EXPECT_THAT(DiskTier::Open(path, Specs(), {}).status(),
              StatusIs(absl::StatusCode::kDataLoss,
                       AllOf(HasSubstr(path), HasSubstr("malformed layout section"))));
}

// Regression: the header's section offsets and sizes were trusted: a negative layout offset gave
// "cannot read" with EINVAL, a layout size up to 64 MiB was allocated whatever the file's size,
// a state other than committed / writing read as an interrupted write.
TEST(DiskTierTest, HeaderFieldsOutsideTheFile) {
  const std::string path = TmpPath("header_fields.fso");
  struct Case {
    size_t offset;
    int64_t value;
  };
  for (Case c : {Case{56, -4096}, Case{56, 0}, Case{64, int64_t{32} << 20}, Case{64, -1},
                 Case{80, -8}, Case{80, int64_t{1} << 62}, Case{88, int64_t{1} << 40},
                 Case{104, -1}, Case{104, 100}}) {
    Write(path);
    Forge(path, [&](std::string& b) { Set(b, c.offset, c.value); });
    EXPECT_THAT(DiskTier::Open(path, Specs(), {}).status(),
                StatusIs(absl::StatusCode::kDataLoss,
                         AllOf(HasSubstr(path), HasSubstr("malformed header"))))
        << "field at " << c.offset << " = " << c.value;
  }
  Write(path);
  Forge(path, [&](std::string& b) { Set(b, 12, uint32_t{7}); });
  EXPECT_THAT(DiskTier::Open(path, Specs(), {}).status(),
              StatusIs(absl::StatusCode::kDataLoss,
                       AllOf(HasSubstr(path), HasSubstr("malformed header: state 7"))));
}

}  // namespace
}  // namespace fairscale::offload
