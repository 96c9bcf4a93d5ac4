#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "base/logging.h"
#include "base/status_macros.h"
#include "base/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace fairscale::base {
namespace {

using ::fairscale::base::testing::IsOk;
using ::fairscale::base::testing::StatusIs;
using ::testing::HasSubstr;
using ::testing::Not;

absl::StatusOr<int> Half(int x) {
  if (x % 2) return absl::InvalidArgumentError(absl::StrCat(x, " is odd"));
  return x / 2;
}

absl::StatusOr<int> Quarter(int x) {
  FS_ASSIGN_OR_RETURN(int h, Half(x));
  FS_ASSIGN_OR_RETURN(int q, Half(h));
  return q;
}

absl::Status CheckEven(int x) {
  FS_RETURN_IF_ERROR(Half(x));
  FS_RETURN_IF_ERROR(absl::OkStatus());
  return absl::OkStatus();
}

TEST(StatusMacros, AssignOrReturnPropagates) {
  EXPECT_THAT(Quarter(8), IsOk());
  EXPECT_EQ(*Quarter(8), 2);
  EXPECT_THAT(Quarter(6), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("3 is odd")));
  EXPECT_THAT(Quarter(7), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("7 is odd")));
}

TEST(StatusMacros, ReturnIfError) {
  EXPECT_OK(CheckEven(4));
  EXPECT_THAT(CheckEven(5), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(CheckEven(5), Not(IsOk()));
}

TEST(StatusMatchers, AssertOkAndAssign) {
  ASSERT_OK_AND_ASSIGN(int v, Half(10));
  EXPECT_EQ(v, 5);
}

TEST(Logging, PrefixFollowsRank) {
  EXPECT_EQ(LogPrefix(), "");
  SetLogRank(1, 4);
  EXPECT_EQ(LogPrefix(), "[rank 1/4] ");
  {
    ScopedLogRank scoped(3, 4);
    EXPECT_EQ(LogPrefix(), "[rank 3/4] ");
    FS_LOG(INFO) << "hello from a thread rank";
  }
  EXPECT_EQ(LogPrefix(), "[rank 1/4] ");
  SetLogRank(-1, -1);
  EXPECT_EQ(LogPrefix(), "");
}

}  // namespace
}  // namespace fairscale::base
