// DiskTier: round trip, and every kind of bad file gives its named error.
#include "offload/disk_tier.h"

#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <numeric>
#include <string>
#include <vector>

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

}  // namespace
}  // namespace fairscale::offload
