// FileStore beyond the Store contract (store_test.cc): several processes on one directory, the
// on-disk layout, and damaged files.
//
// Child processes are this binary re-executed (posix_spawn of /proc/self/exe); main() runs the
// child role named by argv[1] instead of the tests.
#include "comm/store/file_store.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/status_matchers.h"
#include "base/subprocess.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "testing/tmp.h"

namespace fairscale::comm {
namespace {

using ::fairscale::base::testing::IsOk;
using ::fairscale::base::testing::StatusIs;
using ::testing::HasSubstr;
using ::testing::Not;
using ::testing::StartsWith;

std::string NewDir() { return fairscale::testing::UniqueTmpPath("fs"); }

// "adder <dir> <n>": n Adds of 1 to "counter" and one CompareSet race on "leader".
int ChildAdder(const std::string& dir, int n) {
  auto store = FileStore::Create(dir);
  if (!store.ok()) return 2;
  for (int i = 0; i < n; ++i) {
    absl::StatusOr<int64_t> r = (*store)->Add("counter", 1);
    if (!r.ok()) {
      std::fprintf(stderr, "adder: %s\n", r.status().ToString().c_str());
      return 3;
    }
  }
  const std::string me = absl::StrCat(getpid());
  absl::StatusOr<std::string> leader = (*store)->CompareSet("leader", "", me);
  if (!leader.ok()) return 4;
  if (*leader == me && !(*store)->Add("leaders", 1).ok()) return 5;
  return 0;
}

TEST(FileStore, ConcurrentAddsFromSeveralProcesses) {
  const std::string dir = NewDir();
  ASSERT_OK_AND_ASSIGN(auto store, FileStore::Create(dir));
  constexpr int kChildren = 3;
  constexpr int kAdds = 150;
  std::vector<pid_t> pids;
  for (int i = 0; i < kChildren; ++i) {
    ASSERT_OK_AND_ASSIGN(pid_t pid,
                         base::SpawnSelf({"adder", dir, absl::StrCat(kAdds)}));
    pids.push_back(pid);
  }
  for (int i = 0; i < kAdds; ++i) ASSERT_OK(store->Add("counter", 1));
  for (pid_t pid : pids) {
    ASSERT_OK_AND_ASSIGN(int code, base::WaitChild(pid, absl::Seconds(20)));
    EXPECT_EQ(code, 0) << "child " << pid;
  }
  ASSERT_OK_AND_ASSIGN(std::string total, store->Get("counter", absl::Seconds(1)));
  EXPECT_EQ(total, absl::StrCat((kChildren + 1) * kAdds));
  ASSERT_OK_AND_ASSIGN(std::string leaders, store->Get("leaders", absl::Seconds(1)));
  EXPECT_EQ(leaders, "1");
}

TEST(FileStore, KeysMapToSafeNamesInsideTheDirectory) {
  ASSERT_OK_AND_ASSIGN(auto store, FileStore::Create(NewDir()));
  const std::string prefix = store->directory() + "/";
  EXPECT_EQ(store->PathOf("a/b"), prefix + "k612f62");
  EXPECT_EQ(store->PathOf("../x"), prefix + "k2e2e2f78");
  const std::string long_key(FileStore::kMaxInlineKeyBytes + 1, 'z');
  EXPECT_THAT(store->PathOf(long_key), StartsWith(prefix + "h"));
  EXPECT_EQ(store->PathOf(long_key).size(), prefix.size() + 17);
  ASSERT_OK(store->Set("a/b", "v"));
  EXPECT_EQ(access(store->PathOf("a/b").c_str(), F_OK), 0);
  ASSERT_OK_AND_ASSIGN(bool existed, store->Delete("a/b"));
  EXPECT_TRUE(existed);
  EXPECT_NE(access(store->PathOf("a/b").c_str(), F_OK), 0);  // Delete removes the file.
}

TEST(FileStore, CorruptFileIsDataLoss) {
  ASSERT_OK_AND_ASSIGN(auto store, FileStore::Create(NewDir()));
  { std::ofstream(store->PathOf("bad")) << "not a store file"; }
  EXPECT_THAT(store->Get("bad", absl::Milliseconds(10)),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr(store->PathOf("bad"))));
  EXPECT_THAT(store->Add("bad", 1), StatusIs(absl::StatusCode::kDataLoss));
}

TEST(FileStore, LockHeldElsewhereTimesOut) {
  const std::string dir = NewDir();
  FileStoreOptions options;
  options.timeout = absl::Milliseconds(100);
  ASSERT_OK_AND_ASSIGN(auto store, FileStore::Create(dir, options));
  const int fd = open((dir + "/lock").c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(flock(fd, LOCK_EX), 0);
  const absl::Time start = absl::Now();
  EXPECT_THAT(store->Set("k", "v"), StatusIs(absl::StatusCode::kDeadlineExceeded,
                                             HasSubstr("lock")));
  EXPECT_LT(absl::Now() - start, absl::Seconds(2));
  close(fd);
  EXPECT_OK(store->Set("k", "v"));
}

TEST(FileStore, CreateRejectsAFile) {
  const std::string dir = NewDir();
  ASSERT_OK_AND_ASSIGN(auto store, FileStore::Create(dir));
  ASSERT_OK(store->Set("k", "v"));
  EXPECT_THAT(FileStore::Create(store->PathOf("k")).status(), Not(IsOk()));
  EXPECT_THAT(FileStore::Create("").status(), StatusIs(absl::StatusCode::kInvalidArgument));
}

}  // namespace
}  // namespace fairscale::comm

int main(int argc, char** argv) {
  int n = 0;
  if (argc == 4 && std::string(argv[1]) == "adder" && absl::SimpleAtoi(argv[3], &n)) {
    return fairscale::comm::ChildAdder(argv[2], n);
  }
  ::testing::InitGoogleMock(&argc, argv);
  return RUN_ALL_TESTS();
}
