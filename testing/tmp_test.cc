#include "testing/tmp.h"

#include <cstdlib>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace fairscale::testing {
namespace {

using ::testing::StartsWith;

TEST(Tmp, PathsLieUnderTestTmpdir) {
  const char* dir = std::getenv("TEST_TMPDIR");
  ASSERT_NE(dir, nullptr);  // Bazel sets it
  EXPECT_EQ(TmpDir(), dir);
  EXPECT_EQ(TmpPath("a.pt"), std::string(dir) + "/a.pt");
  EXPECT_EQ(TmpPath("a.pt"), TmpPath("a.pt"));
  EXPECT_THAT(UniqueTmpPath("x"), StartsWith(std::string(dir) + "/x_"));
}

TEST(Tmp, UniquePathsDiffer) { EXPECT_NE(UniqueTmpPath("x"), UniqueTmpPath("x")); }

TEST(Tmp, WithoutTestTmpdirItIsSlashTmp) {
  const std::string saved = std::getenv("TEST_TMPDIR");
  unsetenv("TEST_TMPDIR");
  EXPECT_EQ(TmpPath("b"), "/tmp/b");
  setenv("TEST_TMPDIR", saved.c_str(), 1);
}

}  // namespace
}  // namespace fairscale::testing
