// HeartbeatMonitor against a HashStore: a rank that never beats is reported (once, naming it)
// about stall_timeout after an operation started waiting; a rank that beats is never reported,
// however long the operation; nothing is reported while no operation runs; a destroyed monitor
// calls nothing; a failing store is logged at once, then rate-limited with a count, and its
// recovery is logged.
#include "comm/algorithms/heartbeat.h"

#include "comm/algorithms/algorithms.h"

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_split.h"

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

TEST(EffectiveStallTimeout, HalfAShortOperationTimeoutUnlessGiven) {
  algo::Options o;  // heartbeat 1 s, stall 10 s
  EXPECT_EQ(algo::EffectiveStallTimeout(o, absl::Minutes(30)), absl::Seconds(10));
  EXPECT_EQ(algo::EffectiveStallTimeout(o, absl::Seconds(12)), absl::Seconds(6));
  EXPECT_EQ(algo::EffectiveStallTimeout(o, absl::Seconds(2)), absl::Seconds(4));  // 4 beats
  o.heartbeat_ms = 250;
  EXPECT_EQ(algo::EffectiveStallTimeout(o, absl::Seconds(6)), absl::Seconds(3));
  absl::StatusOr<algo::Options> given =
      algo::ParseOptions({{"algo.stall_timeout_ms", "20000"}});
  ASSERT_TRUE(given.ok()) << given.status();
  EXPECT_EQ(algo::EffectiveStallTimeout(*given, absl::Seconds(6)), absl::Seconds(20));
  absl::StatusOr<algo::Options> unset = algo::ParseOptions({{"algo.heartbeat_ms", "500"}});
  ASSERT_TRUE(unset.ok()) << unset.status();
  EXPECT_EQ(algo::EffectiveStallTimeout(*unset, absl::Seconds(6)), absl::Seconds(3));
}

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

TEST(HeartbeatMonitor, ARankThatStopsBeatingMidOperationIsReportedWithItsAddress) {
  auto store = std::make_shared<HashStore>();
  Reports reports;
  auto peer = std::make_unique<HeartbeatMonitor>(store, 1, 2, Fast(), [](const absl::Status&) {});
  HeartbeatMonitor::Options named = Fast();
  named.peer_addresses = {"10.0.0.1:4000", "10.0.0.2:4001"};
  HeartbeatMonitor me(store, 0, 2, named, [&](const absl::Status& s) { reports.Add(s); });
  me.OperationStarted();
  absl::SleepFor(absl::Milliseconds(600));
  EXPECT_EQ(reports.Count(), 0);
  peer.reset();  // its process "stops"
  absl::SleepFor(absl::Milliseconds(800));
  EXPECT_EQ(reports.Count(), 1);
  EXPECT_THAT(reports.last, StatusIs(absl::StatusCode::kUnavailable,
                                     HasSubstr("rank 1 (10.0.0.2:4001) shows no sign of life")));
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

// A store whose calls hang while `blocked` (its host unreachable, packets dropped) around a
// HashStore.
class HangingStore final : public Store {
 public:
  std::atomic<bool> blocked{false};
  absl::Status Set(absl::string_view k, absl::string_view v) override { Hang(); return inner_.Set(k, v); }
  absl::StatusOr<std::string> Get(absl::string_view k, absl::Duration t) override {
    Hang();
    return inner_.Get(k, t);
  }
  absl::StatusOr<int64_t> Add(absl::string_view k, int64_t d) override { Hang(); return inner_.Add(k, d); }
  absl::StatusOr<std::string> CompareSet(absl::string_view k, absl::string_view e,
                                         absl::string_view d) override {
    Hang();
    return inner_.CompareSet(k, e, d);
  }
  absl::StatusOr<bool> Delete(absl::string_view k) override { Hang(); return inner_.Delete(k); }
  absl::Status Wait(absl::Span<const std::string> keys, absl::Duration t) override {
    Hang();
    return inner_.Wait(keys, t);
  }
  absl::StatusOr<bool> Check(absl::string_view k) override { Hang(); return inner_.Check(k); }

 private:
  void Hang() {
    while (blocked.load()) absl::SleepFor(absl::Milliseconds(5));
  }
  HashStore inner_;
};

// The store stops answering (its calls hang, as over a link that drops packets) while an
// operation waits: reported about the stall timeout later, naming the store, not left to the
// operation's own timeout; with the store answering again nothing more is reported.
TEST(HeartbeatMonitor, AStoreThatStopsAnsweringDuringAnOperationIsReported) {
  auto store = std::make_shared<HangingStore>();
  Reports reports;
  HeartbeatMonitor peer(store, 1, 2, Fast(), [](const absl::Status&) {});
  HeartbeatMonitor me(store, 0, 2, Fast(), [&](const absl::Status& s) { reports.Add(s); });
  absl::SleepFor(absl::Milliseconds(100));
  store->blocked = true;
  absl::SleepFor(absl::Milliseconds(300));
  EXPECT_EQ(reports.Count(), 0);  // no operation: nobody waits
  const absl::Time start = absl::Now();
  me.OperationStarted();
  absl::SleepFor(absl::Milliseconds(1200));
  ASSERT_EQ(reports.Count(), 1);
  EXPECT_THAT(reports.last, StatusIs(absl::StatusCode::kUnavailable,
                                     HasSubstr("the store has not answered this rank's heartbeat")));
  EXPECT_GE(reports.at - start, absl::Milliseconds(400));  // the stall timeout
  EXPECT_LT(reports.at - start, absl::Milliseconds(1000));
  store->blocked = false;
}

// A HashStore whose Add fails (kUnavailable) while `failing`.
class FailingStore final : public Store {
 public:
  std::atomic<bool> failing{false};
  absl::Status Set(absl::string_view k, absl::string_view v) override { return inner_.Set(k, v); }
  absl::StatusOr<std::string> Get(absl::string_view k, absl::Duration t) override {
    return inner_.Get(k, t);
  }
  absl::StatusOr<int64_t> Add(absl::string_view k, int64_t d) override {
    if (failing.load()) return absl::UnavailableError("store host unreachable");
    return inner_.Add(k, d);
  }
  absl::StatusOr<std::string> CompareSet(absl::string_view k, absl::string_view e,
                                         absl::string_view d) override {
    return inner_.CompareSet(k, e, d);
  }
  absl::StatusOr<bool> Delete(absl::string_view k) override { return inner_.Delete(k); }
  absl::Status Wait(absl::Span<const std::string> keys, absl::Duration t) override {
    return inner_.Wait(keys, t);
  }
  absl::StatusOr<bool> Check(absl::string_view k) override { return inner_.Check(k); }

 private:
  HashStore inner_;
};

int CountLines(const std::string& log, absl::string_view needle) {
  int n = 0;
  for (absl::string_view line : absl::StrSplit(log, '\n')) n += absl::StrContains(line, needle);
  return n;
}

// A store that fails every beat for 1 s (50 beats) is logged once at once, then every
// store_warning_every (300 ms) with the count, not once a beat; its recovery gets one line.
TEST(HeartbeatMonitor, AFailingStoreIsLoggedRateLimitedWithACountAndItsRecovery) {
  auto store = std::make_shared<FailingStore>();
  HeartbeatMonitor::Options options = Fast();
  options.store_warning_every = absl::Milliseconds(300);
  ::testing::internal::CaptureStderr();
  {
    HeartbeatMonitor me(store, 0, 1, options, [](const absl::Status&) {});
    absl::SleepFor(absl::Milliseconds(100));
    store->failing = true;
    absl::SleepFor(absl::Seconds(1));
    store->failing = false;
    absl::SleepFor(absl::Milliseconds(200));
  }
  const std::string log = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(CountLines(log, "heartbeat of rank 0/1 through the store failed (retrying every 20ms)"
                            ": UNAVAILABLE: store host unreachable"),
            1)
      << log;
  const int again = CountLines(log, "through the store still failing after ");
  EXPECT_GE(again, 2) << log;
  EXPECT_LE(again, 4) << log;
  EXPECT_EQ(CountLines(log, "failed beats): UNAVAILABLE: store host unreachable"), again) << log;
  EXPECT_EQ(CountLines(log, "heartbeat of rank 0/1: the store answers again after "), 1) << log;
}

}  // namespace
}  // namespace fairscale::comm
