// HeartbeatMonitor against a HashStore: a rank that never beats is reported (once, naming it)
// about stall_timeout after an operation started waiting; a rank that beats is never reported,
// however long the operation; nothing is reported while no operation runs; a destroyed monitor
// calls nothing.
#include "comm/algorithms/heartbeat.h"

#include <atomic>
#include <memory>
#include <string>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "base/status_matchers.h"
#include "comm/store/hash_store.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace fairscale::comm {
namespace {

using ::fairscale::base::testing::StatusIs;
using ::testing::HasSubstr;

HeartbeatMonitor::Options Fast() {
  HeartbeatMonitor::Options o;
  o.interval = absl::Milliseconds(20);
  o.stall_timeout = absl::Milliseconds(400);
  return o;
}

struct Reports {
  absl::Mutex mu;
  int count = 0;
  absl::Status last;
  absl::Time at;
  void Add(const absl::Status& s) {
    absl::MutexLock lock(&mu);
    ++count;
    last = s;
    at = absl::Now();
  }
  int Count() {
    absl::MutexLock lock(&mu);
    return count;
  }
};

TEST(HeartbeatMonitor, ASilentRankIsReportedAboutTheStallTimeoutAfterTheOperationStarts) {
  auto store = std::make_shared<HashStore>();
  Reports reports;
  // Ranks 0 and 2 beat; rank 1 has no monitor (a stopped process).
  HeartbeatMonitor peer(store, 2, 3, Fast(), [](const absl::Status&) {});
  HeartbeatMonitor me(store, 0, 3, Fast(), [&](const absl::Status& s) { reports.Add(s); });
  absl::SleepFor(absl::Milliseconds(100));
  EXPECT_EQ(reports.Count(), 0);  // no operation: nobody waits
  const absl::Time start = absl::Now();
  me.OperationStarted();
  absl::SleepFor(absl::Milliseconds(1500));
  ASSERT_EQ(reports.Count(), 1);  // once
  EXPECT_THAT(reports.last, StatusIs(absl::StatusCode::kUnavailable,
                                     HasSubstr("rank 1 shows no sign of life: no heartbeat for ")));
  EXPECT_THAT(reports.last.message(), HasSubstr("algo.stall_timeout_ms=400"));
  // About stall_timeout after the start: half to start sampling, half without a beat.
  EXPECT_GE(reports.at - start, absl::Milliseconds(400));
  EXPECT_LT(reports.at - start, absl::Milliseconds(1200));
}

TEST(HeartbeatMonitor, LiveRanksAreNeverReportedHoweverLongTheOperation) {
  auto store = std::make_shared<HashStore>();
  Reports reports;
  HeartbeatMonitor a(store, 1, 3, Fast(), [](const absl::Status&) {});
  HeartbeatMonitor b(store, 2, 3, Fast(), [](const absl::Status&) {});
  HeartbeatMonitor me(store, 0, 3, Fast(), [&](const absl::Status& s) { reports.Add(s); });
  me.OperationStarted();
  absl::SleepFor(absl::Milliseconds(1500));  // almost 4 stall timeouts
  me.OperationFinished();
  EXPECT_EQ(reports.Count(), 0);
}

TEST(HeartbeatMonitor, ARankThatStopsBeatingMidOperationIsReported) {
  auto store = std::make_shared<HashStore>();
  Reports reports;
  auto peer = std::make_unique<HeartbeatMonitor>(store, 1, 2, Fast(), [](const absl::Status&) {});
  HeartbeatMonitor me(store, 0, 2, Fast(), [&](const absl::Status& s) { reports.Add(s); });
  me.OperationStarted();
  absl::SleepFor(absl::Milliseconds(600));
  EXPECT_EQ(reports.Count(), 0);
  peer.reset();  // its process "stops"
  absl::SleepFor(absl::Milliseconds(800));
  EXPECT_EQ(reports.Count(), 1);
  EXPECT_THAT(reports.last, StatusIs(absl::StatusCode::kUnavailable, HasSubstr("rank 1 shows")));
}

TEST(HeartbeatMonitor, ADestroyedMonitorCallsNothing) {
  auto store = std::make_shared<HashStore>();
  std::atomic<int> calls{0};
  {
    HeartbeatMonitor me(store, 0, 2, Fast(), [&](const absl::Status&) { ++calls; });
    me.OperationStarted();
    absl::SleepFor(absl::Milliseconds(250));
  }
  absl::SleepFor(absl::Milliseconds(600));
  EXPECT_EQ(calls.load(), 0);
}

}  // namespace
}  // namespace fairscale::comm
