// Tests of the rank runners with fake rank bodies (no communicator involved): statuses per rank,
// the shared store, rank info and log prefix, timeouts, and how the process runner reports
// children that crash, hang or exit without a status.
#include "comm/testing/rank_runner.h"

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "base/logging.h"
#include "base/status_macros.h"
#include "base/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest-spi.h"
#include "gtest/gtest.h"

namespace fairscale::comm::testing {
namespace {

using ::fairscale::base::testing::IsOk;
using ::fairscale::base::testing::StatusIs;
using ::testing::HasSubstr;

// Every rank publishes its rank and reads every other rank's key back through the shared store.
absl::Status ExchangeThroughStore(int rank) {
  const RankInfo* info = CurrentRank();
  if (info == nullptr) return absl::InternalError("CurrentRank() is null inside a body");
  if (info->rank != rank) return absl::InternalError("CurrentRank()->rank differs from rank");
  FS_RETURN_IF_ERROR(info->store->Set(absl::StrCat("rank/", rank), absl::StrCat("hello ", rank)));
  for (int r = 0; r < info->size; ++r) {
    FS_ASSIGN_OR_RETURN(std::string v, info->store->Get(absl::StrCat("rank/", r),
                                                        absl::Seconds(20)));
    if (v != absl::StrCat("hello ", r)) return absl::InternalError(absl::StrCat("got ", v));
  }
  return absl::OkStatus();
}

class RunnerTest : public ::testing::TestWithParam<RunnerKind> {};

TEST_P(RunnerTest, ReturnsOneStatusPerRankAndSharesTheStore) {
  std::vector<absl::Status> statuses = RunRanks(
      GetParam(), 3,
      [](int rank) -> absl::Status {
        FS_RETURN_IF_ERROR(ExchangeThroughStore(rank));
        if (CurrentRank()->size != 3) return absl::InternalError("size != 3");
        if (CurrentRank()->runner != GetParam()) return absl::InternalError("wrong runner kind");
        if (base::LogPrefix() != absl::StrCat("[rank ", rank, "/3] ")) {
          return absl::InternalError(absl::StrCat("log prefix '", base::LogPrefix(), "'"));
        }
        if (IsRankProcess() != (GetParam() == RunnerKind::kProcesses)) {
          return absl::InternalError("IsRankProcess() is wrong");
        }
        if (rank == 2) return absl::UnavailableError("rank two says: peer 1 went away");
        return absl::OkStatus();
      },
      absl::Seconds(30));
  ASSERT_EQ(statuses.size(), 3u);
  EXPECT_OK(statuses[0]);
  EXPECT_OK(statuses[1]);
  EXPECT_THAT(statuses[2], StatusIs(absl::StatusCode::kUnavailable,
                                    "rank two says: peer 1 went away"));
  EXPECT_EQ(CurrentRank(), nullptr);
}

TEST_P(RunnerTest, RankConfigCarriesRankSizeStoreAndTimeout) {
  std::vector<absl::Status> statuses = RunRanks(
      GetParam(), 2,
      [](int rank) -> absl::Status {
        CommConfig config = RankConfig(absl::Seconds(7));
        if (config.rank != rank || config.size != 2 || config.store == nullptr ||
            config.timeout != absl::Seconds(7)) {
          return absl::InternalError("bad config");
        }
        if (config.store != CurrentRank()->store) return absl::InternalError("not the store");
        return absl::OkStatus();
      },
      absl::Seconds(30));
  for (const absl::Status& s : statuses) EXPECT_OK(s);
}

TEST_P(RunnerTest, SingleRank) {
  std::vector<absl::Status> statuses = RunRanks(
      GetParam(), 1, [](int rank) { return ExchangeThroughStore(rank); }, absl::Seconds(30));
  ASSERT_EQ(statuses.size(), 1u);
  EXPECT_OK(statuses[0]);
}

TEST_P(RunnerTest, EachRunGetsAFreshStore) {
  for (int run = 0; run < 2; ++run) {
    std::vector<absl::Status> statuses = RunRanks(
        GetParam(), 2,
        [](int rank) -> absl::Status {
          FS_ASSIGN_OR_RETURN(bool exists, CurrentRank()->store->Check("left-over"));
          if (exists) return absl::InternalError("the store holds a key of an earlier run");
          absl::Status barrier = ExchangeThroughStore(rank);
          if (!barrier.ok()) return barrier;
          return CurrentRank()->store->Set("left-over", "x");
        },
        absl::Seconds(30));
    for (const absl::Status& s : statuses) EXPECT_OK(s) << "run " << run;
  }
}

INSTANTIATE_TEST_SUITE_P(Runners, RunnerTest,
                         ::testing::Values(RunnerKind::kThreads, RunnerKind::kProcesses),
                         [](const ::testing::TestParamInfo<RunnerKind>& info) {
                           return std::string(RunnerKindName(info.param));
                         });

TEST(RunThreads, ReportsAStragglerAsDeadlineExceededWithoutWaitingForIt) {
  // The straggler holds its own reference to `release`, so it may outlive the test safely.
  auto release = std::make_shared<absl::Notification>();
  const absl::Time start = absl::Now();
  std::vector<absl::Status> statuses = RunThreads(
      2,
      [release](int rank) -> absl::Status {
        if (rank == 1) release->WaitForNotificationWithTimeout(absl::Seconds(20));
        return absl::OkStatus();
      },
      absl::Milliseconds(300));
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  release->Notify();
  EXPECT_OK(statuses[0]);
  EXPECT_THAT(statuses[1],
              StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("rank 1/2")));
}

TEST(RunThreads, AnExceptionBecomesInternal) {
  std::vector<absl::Status> statuses = RunThreads(
      2,
      [](int rank) -> absl::Status {
        if (rank == 0) throw std::runtime_error("boom");
        return absl::OkStatus();
      },
      absl::Seconds(10));
  EXPECT_THAT(statuses[0], StatusIs(absl::StatusCode::kInternal, HasSubstr("boom")));
  EXPECT_OK(statuses[1]);
}

TEST(RunProcesses, KilledChildIsReportedWithItsSignal) {
  std::vector<absl::Status> statuses = RunProcesses(
      3,
      [](int rank) -> absl::Status {
        if (rank == 1) raise(SIGKILL);
        return absl::OkStatus();
      },
      absl::Seconds(30));
  EXPECT_OK(statuses[0]);
  EXPECT_THAT(statuses[1], StatusIs(absl::StatusCode::kInternal, HasSubstr("signal 9")));
  EXPECT_OK(statuses[2]);
}

TEST(RunProcesses, HungChildIsKilledAtTheDeadline) {
  const absl::Time start = absl::Now();
  std::vector<absl::Status> statuses = RunProcesses(
      2,
      [](int rank) -> absl::Status {
        if (rank == 0) absl::SleepFor(absl::Seconds(30));
        return absl::OkStatus();
      },
      absl::Seconds(2));
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  EXPECT_THAT(statuses[0], StatusIs(absl::StatusCode::kDeadlineExceeded,
                                    HasSubstr("still running after 2s")));
  EXPECT_OK(statuses[1]);
}

TEST(RunProcesses, GtestFailureInAChildTurnsOkIntoInternal) {
  std::vector<absl::Status> statuses = RunProcesses(
      2,
      [](int rank) -> absl::Status {
        // Only ever evaluated in the children; the parent never runs the body.
        if (rank == 1) ADD_FAILURE() << "deliberate failure in the child of rank 1";
        return absl::OkStatus();
      },
      absl::Seconds(30));
  EXPECT_OK(statuses[0]);
  EXPECT_THAT(statuses[1], StatusIs(absl::StatusCode::kInternal, HasSubstr("gtest assertion")));
}

TEST(RunProcesses, ChildExitingWithoutAStatusIsInternal) {
  std::vector<absl::Status> statuses = RunProcesses(
      2,
      [](int rank) -> absl::Status {
        if (rank == 0) _exit(3);
        return absl::OkStatus();
      },
      absl::Seconds(30));
  EXPECT_THAT(statuses[0], StatusIs(absl::StatusCode::kInternal,
                                    HasSubstr("exited with code 3 without reporting")));
  EXPECT_OK(statuses[1]);
}

TEST(RunProcesses, TheSecondCallOfATestRunsItsOwnBody) {
  std::vector<absl::Status> first = RunProcesses(
      2, [](int rank) { return absl::NotFoundError(absl::StrCat("first ", rank)); },
      absl::Seconds(30));
  std::vector<absl::Status> second = RunProcesses(
      2, [](int rank) { return absl::AbortedError(absl::StrCat("second ", rank)); },
      absl::Seconds(30));
  if (IsRankProcess()) return;
  EXPECT_THAT(first[1], StatusIs(absl::StatusCode::kNotFound, "first 1"));
  EXPECT_THAT(second[0], StatusIs(absl::StatusCode::kAborted, "second 0"));
  EXPECT_THAT(second[1], StatusIs(absl::StatusCode::kAborted, "second 1"));
}

TEST(RankRunners, ZeroRanksRunNothing) {
  EXPECT_TRUE(RunProcesses(0, [](int) { return absl::OkStatus(); }, absl::Seconds(1)).empty());
  EXPECT_TRUE(RunThreads(0, [](int) { return absl::OkStatus(); }, absl::Seconds(1)).empty());
}

TEST(ExpectAllOk, FailsOncePerFailedRankNamingIt) {
  ExpectAllOk({absl::OkStatus(), absl::OkStatus()}, "all fine");
  ExpectAllOk({}, "no ranks");
  EXPECT_NONFATAL_FAILURE(
      ExpectAllOk({absl::OkStatus(), absl::NotFoundError("lost key")}, "exchange"),
      "exchange rank 1/2: NOT_FOUND: lost key");
  // Two failed ranks, two failures (gtest-spi checks for exactly one, so count them apart).
  ::testing::TestPartResultArray results;
  {
    ::testing::ScopedFakeTestPartResultReporter reporter(
        ::testing::ScopedFakeTestPartResultReporter::INTERCEPT_ONLY_CURRENT_THREAD, &results);
    ExpectAllOk({absl::InternalError("a"), absl::OkStatus(), absl::InternalError("c")});
  }
  ASSERT_EQ(results.size(), 2);
  EXPECT_THAT(results.GetTestPartResult(0).message(), HasSubstr("rank 0/3: INTERNAL: a"));
  EXPECT_THAT(results.GetTestPartResult(1).message(), HasSubstr("rank 2/3: INTERNAL: c"));
}

TEST(Check, IsOkOrInternalWithTheMessage) {
  EXPECT_THAT(Check(true, "unused"), IsOk());
  EXPECT_THAT(Check(false, "step 3: 1 != 2"),
              StatusIs(absl::StatusCode::kInternal, "step 3: 1 != 2"));
}

}  // namespace
}  // namespace fairscale::comm::testing
