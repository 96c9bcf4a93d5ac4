// Atomic files (atomic_file.h): what is written reads back byte for byte, an overwrite replaces
// the whole file, and no "<path>.tmp.<pid>" is left behind after a write, whether it succeeded or
// failed; failures name the file and the OS error.
#include "base/atomic_file.h"

#include <dirent.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "base/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "testing/tmp.h"

namespace fairscale::base {
namespace {

using ::fairscale::base::testing::IsOkAndHolds;
using ::fairscale::base::testing::StatusIs;
using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

class AtomicFileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fairscale::testing::UniqueTmpPath("atomic_file");
    ASSERT_EQ(::mkdir(dir_.c_str(), 0755), 0) << dir_;
  }
  // The names in dir_, sorted.
  std::vector<std::string> Entries() const {
    std::vector<std::string> out;
    DIR* d = ::opendir(dir_.c_str());
    if (d == nullptr) return out;
    while (const dirent* e = ::readdir(d)) {
      const std::string name = e->d_name;
      if (name != "." && name != "..") out.push_back(name);
    }
    ::closedir(d);
    std::sort(out.begin(), out.end());
    return out;
  }
  std::string dir_;
};

TEST_F(AtomicFileTest, RoundTripsEmptyOneByteAndOneMebibyte) {
  std::string big(1 << 20, '\0');
  for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<char>((i * 131 + i / 7) & 0xff);
  const std::vector<std::string> contents = {"", std::string(1, '\0'), "x", big};
  for (size_t i = 0; i < contents.size(); ++i) {
    const std::string path = absl::StrCat(dir_, "/f", i);
    ASSERT_OK(WriteFileAtomic(path, contents[i]));
    ASSERT_OK_AND_ASSIGN(std::string back, ReadFile(path));
    EXPECT_EQ(back.size(), contents[i].size()) << i;
    EXPECT_TRUE(back == contents[i]) << i;
  }
  EXPECT_THAT(Entries(), ElementsAre("f0", "f1", "f2", "f3"));
}

TEST_F(AtomicFileTest, OverwriteReplacesTheWholeFile) {
  const std::string path = dir_ + "/f";
  ASSERT_OK(WriteFileAtomic(path, "a longer first version"));
  ASSERT_OK(WriteFileAtomic(path, "2nd"));
  EXPECT_THAT(ReadFile(path), IsOkAndHolds(std::string("2nd")));
  ASSERT_OK(WriteFileAtomic(path, ""));
  EXPECT_THAT(ReadFile(path), IsOkAndHolds(std::string()));
  EXPECT_THAT(Entries(), ElementsAre("f"));
}

TEST_F(AtomicFileTest, MissingDirectoryIsDataLossNamingThePath) {
  const std::string path = dir_ + "/no/such/dir/f";
  EXPECT_THAT(
      WriteFileAtomic(path, "x"),
      StatusIs(absl::StatusCode::kDataLoss, AllOf(HasSubstr("cannot create '" + path + ".tmp."),
                                                  HasSubstr("No such file or directory"))));
  EXPECT_THAT(AtomicFileWriter::Open(path).status(),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr(path)));
  EXPECT_THAT(Entries(), IsEmpty());
}

TEST_F(AtomicFileTest, ADirectoryAsThePathIsAnErrorAndLeavesNoTmp) {
  const std::string sub = dir_ + "/sub";
  ASSERT_EQ(::mkdir(sub.c_str(), 0755), 0);
  EXPECT_THAT(WriteFileAtomic(sub, "x"),
              StatusIs(absl::StatusCode::kDataLoss,
                       AllOf(HasSubstr("cannot rename '" + sub + ".tmp."),
                             HasSubstr("' to '" + sub + "': Is a directory"))));
  EXPECT_THAT(ReadFile(sub),
              StatusIs(absl::StatusCode::kDataLoss, "cannot read '" + sub + "': Is a directory"));
  EXPECT_THAT(Entries(), ElementsAre("sub"));
}

TEST_F(AtomicFileTest, ReadingAMissingFileIsNotFound) {
  const std::string path = dir_ + "/missing";
  EXPECT_THAT(ReadFile(path), StatusIs(absl::StatusCode::kNotFound,
                                       "cannot open '" + path + "': No such file or directory"));
}

TEST_F(AtomicFileTest, WriterStreamsPiecesUnderAPerProcessTmpName) {
  const std::string path = dir_ + "/f";
  ASSERT_OK_AND_ASSIGN(AtomicFileWriter file, AtomicFileWriter::Open(path));
  EXPECT_EQ(file.path(), path);
  EXPECT_EQ(file.tmp_path(), absl::StrCat(path, ".tmp.", ::getpid()));
  ASSERT_OK(file.Append("ab"));
  ASSERT_OK(file.Append(""));
  ASSERT_OK(file.Append("cde"));
  EXPECT_EQ(file.bytes_written(), 5);
  EXPECT_THAT(Entries(), ElementsAre(absl::StrCat("f.tmp.", ::getpid())));
  ASSERT_OK(file.Commit());
  EXPECT_THAT(ReadFile(path), IsOkAndHolds(std::string("abcde")));
  EXPECT_THAT(Entries(), ElementsAre("f"));
  EXPECT_THAT(file.Append("x"), StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_THAT(file.Commit(), StatusIs(absl::StatusCode::kFailedPrecondition));
}

TEST_F(AtomicFileTest, AnAbandonedWriterLeavesTheOldFileAndNoTmp) {
  const std::string path = dir_ + "/f";
  ASSERT_OK(WriteFileAtomic(path, "old"));
  {
    ASSERT_OK_AND_ASSIGN(AtomicFileWriter file, AtomicFileWriter::Open(path));
    ASSERT_OK(file.Append("new, never committed"));
    AtomicFileWriter moved = std::move(file);  // the moved-from writer owns nothing
    ASSERT_OK(moved.Append("!"));
  }
  EXPECT_THAT(ReadFile(path), IsOkAndHolds(std::string("old")));
  EXPECT_THAT(Entries(), ElementsAre("f"));
}

// A write failing midway (as a full disk would, with its own errno): a file size limit.
TEST_F(AtomicFileTest, AFailedWriteIsKeptRemovesTheTmpAndLeavesTheOldFile) {
  const std::string path = dir_ + "/f";
  ASSERT_OK(WriteFileAtomic(path, "old"));
  struct rlimit old;
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &old), 0);
  struct rlimit small = old;
  small.rlim_cur = 512;
  ::signal(SIGXFSZ, SIG_IGN);
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &small), 0);
  const absl::Status whole = WriteFileAtomic(path, std::string(4096, 'x'));
  absl::StatusOr<AtomicFileWriter> file = AtomicFileWriter::Open(path);
  absl::Status first, second, commit;
  if (file.ok()) {
    first = file->Append(std::string(4096, 'y'));
    second = file->Append("z");
    commit = file->Commit();
  }
  ::setrlimit(RLIMIT_FSIZE, &old);
  const auto too_large =
      StatusIs(absl::StatusCode::kDataLoss,
               AllOf(HasSubstr("cannot write '" + path + ".tmp."), HasSubstr("File too large")));
  EXPECT_THAT(whole, too_large);
  ASSERT_OK(file.status());
  EXPECT_THAT(first, too_large);
  EXPECT_EQ(second, first);  // the first error, again
  EXPECT_EQ(commit, first);
  EXPECT_EQ(file->status(), first);
  EXPECT_THAT(ReadFile(path), IsOkAndHolds(std::string("old")));
  EXPECT_THAT(Entries(), ElementsAre("f"));
}

TEST(FsyncDirectoryTest, SyncsADirectoryAndNamesAMissingOne) {
  EXPECT_OK(FsyncDirectory(fairscale::testing::TmpDir()));
  const std::string missing = fairscale::testing::TmpPath("atomic_file_no_such_dir");
  EXPECT_THAT(FsyncDirectory(missing),
              StatusIs(absl::StatusCode::kDataLoss,
                       "cannot open directory '" + missing + "': No such file or directory"));
}

}  // namespace
}  // namespace fairscale::base
