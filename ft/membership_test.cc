// ft::Membership: the per-step quorum of replica groups with ranks as threads over a HashStore
// (steady state, a group dying and coming back, two groups dying at once, a clean Leave, below
// min_groups, a store that stops answering, a timeout) and as processes over a FileStore with the
// tcp backend (an all-reduce over each quorum's replicate communicator; one rank SIGKILLed).
// Detection times are printed ("detection: ...").
#include "ft/membership.h"

#include <signal.h>

#include <atomic>
#include <cstdio>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "base/status_macros.h"
#include "base/status_matchers.h"
#include "comm/communicator.h"
#include "comm/config.h"
#include "comm/store/hash_store.h"
#include "comm/testing/rank_runner.h"
#include "ft/test_options.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace fairscale::ft {
namespace {

using ::fairscale::base::testing::StatusIs;
using ::testing::HasSubstr;
using comm::testing::Check;
using comm::testing::CurrentRank;
using comm::testing::ExpectAllOk;

using testing::kDeadAfter;
using testing::kInterval;
// The bound of the contract is dead_after + interval + poll; the machine is shared and loaded.
constexpr absl::Duration kSlack = absl::Seconds(1);
const absl::Duration kDetectBound = kDeadAfter + kInterval + kSlack;

// Every rank's answer per round; a second answer for a round must equal the first.
class Answers {
 public:
  absl::Status Record(const Quorum& q) {
    const std::string a = absl::StrCat("epoch ", q.epoch, " groups ", absl::StrJoin(q.groups, ","),
                                       " joiners ", absl::StrJoin(q.joiners, ","), " sources ",
                                       absl::StrJoin(q.sources, ","), " max_step ", q.max_step);
    absl::MutexLock lock(&mu_);
    auto [it, inserted] = by_round_.emplace(q.round, a);
    return Check(inserted || it->second == a,
                 absl::StrCat("round ", q.round, ": '", a, "' != '", it->second, "'"));
  }

 private:
  absl::Mutex mu_;
  std::map<int64_t, std::string> by_round_ ABSL_GUARDED_BY(mu_);
};

std::shared_ptr<comm::Store> SharedStore() { return CurrentRank()->store; }

TEST(Membership, SteadyStateSameQuorumEveryStep) {
  Answers answers;
  ExpectAllOk(comm::testing::RunThreads(4, [&](int rank) -> absl::Status {
    FS_ASSIGN_OR_RETURN(auto m, Membership::Create(SharedStore(), testing::FastOptions(2, 2, rank)));
    for (int64_t step = 0; step < 10; ++step) {
      FS_ASSIGN_OR_RETURN(Quorum q, m->quorum(step, absl::Seconds(20)));
      FS_RETURN_IF_ERROR(answers.Record(q));
      FS_RETURN_IF_ERROR(Check(q.round == step && q.epoch == 0 && q.groups == std::vector<int>{0, 1} &&
                                   q.changed == (step == 0) && q.joiners.empty() && q.max_step == step,
                               absl::StrCat("step ", step, ": round ", q.round, " epoch ", q.epoch)));
      FS_RETURN_IF_ERROR(Check(q.replicate_rank == rank / 2 && q.replicate_size == 2, "replicate rank"));
    }
    FS_RETURN_IF_ERROR(Check(m->history().size() == 10, "history"));
    m->Leave();
    return absl::OkStatus();
  }, absl::Seconds(60)));
}

// 2 groups x 2 ranks: group 1 stops (its Memberships destroyed: a dead process), the survivors
// drop it within the bound at epoch 1; group 1 comes back and is admitted as a joiner at epoch 2.
TEST(Membership, GroupDiesAndComesBack) {
  Answers answers;
  std::atomic<int64_t> death_us{0};
  std::atomic<int> dropped{0};  // group 0's ranks that saw the drop (and checked live_groups)
  ExpectAllOk(comm::testing::RunThreads(4, [&](int rank) -> absl::Status {
    const int g = rank / 2;
    auto m = Membership::Create(SharedStore(), testing::FastOptions(2, 2, rank));
    FS_RETURN_IF_ERROR(m.status());
    if (g == 1) {
      for (int64_t step = 0; step < 3; ++step) {
        FS_ASSIGN_OR_RETURN(Quorum q, (*m)->quorum(step, absl::Seconds(20)));
        FS_RETURN_IF_ERROR(answers.Record(q));
      }
      m->reset();  // dies: no more heartbeats, never arrives at step 3
      death_us = absl::ToUnixMicros(absl::Now());
      const absl::Time until = absl::Now() + absl::Seconds(20);
      while (dropped < 2 && absl::Now() < until) absl::SleepFor(absl::Milliseconds(10));
      // Restarted: a new incarnation, at its own step (it has lost its state).
      FS_ASSIGN_OR_RETURN(auto again, Membership::Create(SharedStore(), testing::FastOptions(2, 2, rank)));
      FS_ASSIGN_OR_RETURN(Quorum q, again->quorum(0, absl::Seconds(20)));
      FS_RETURN_IF_ERROR(answers.Record(q));
      FS_RETURN_IF_ERROR(Check(q.joining && q.source_group == 0 && q.epoch == 2 && q.changed &&
                                   q.groups == std::vector<int>{0, 1} && q.max_step > 3,
                               absl::StrCat("rejoin: epoch ", q.epoch, " joining ", q.joining,
                                            " source ", q.source_group, " max_step ", q.max_step)));
      for (int64_t step = q.max_step + 1; step < q.max_step + 3; ++step) {
        FS_ASSIGN_OR_RETURN(Quorum next, again->quorum(step, absl::Seconds(20)));
        FS_RETURN_IF_ERROR(answers.Record(next));
        FS_RETURN_IF_ERROR(Check(!next.changed && next.epoch == 2 && !next.joining, "after rejoin"));
      }
      again->Leave();
      return absl::OkStatus();
    }
    int phase = 0;  // 0: both groups, 1: group 0 alone, 2: both again
    int after_rejoin = 0;
    for (int64_t step = 0; step < 200 && after_rejoin < 2; ++step) {
      FS_ASSIGN_OR_RETURN(Quorum q, (*m)->quorum(step, absl::Seconds(20)));
      FS_RETURN_IF_ERROR(answers.Record(q));
      if (phase == 0 && q.groups == std::vector<int>{0}) {
        const absl::Duration detect = absl::Now() - absl::FromUnixMicros(death_us);
        std::printf("detection: group 1 (2 ranks, stopped) dropped %s after it stopped (bound %s)\n",
                    absl::FormatDuration(detect).c_str(), absl::FormatDuration(kDetectBound).c_str());
        FS_RETURN_IF_ERROR(Check(q.epoch == 1 && q.changed && q.dropped == std::vector<int>{1} &&
                                     absl::StrContains(q.dropped_reasons[0], "missed heartbeats"),
                                 absl::StrCat("drop: epoch ", q.epoch, " ", absl::StrJoin(q.dropped_reasons, ";"))));
        FS_RETURN_IF_ERROR(Check(detect <= kDetectBound, absl::StrCat("detection took ", absl::FormatDuration(detect))));
        FS_RETURN_IF_ERROR(Check(q.replicate_rank == 0 && q.replicate_size == 1, "replicate size 1"));
        // This rank's heartbeat view may be up to an interval older than the deciding sample.
        for (absl::Time until = absl::Now() + 3 * kInterval;
             (*m)->live_groups() != std::vector<int>{0} && absl::Now() < until;) {
          absl::SleepFor(absl::Milliseconds(10));
        }
        FS_RETURN_IF_ERROR(Check((*m)->live_groups() == std::vector<int>{0},
                                 absl::StrCat("live groups after the drop: ",
                                              absl::StrJoin((*m)->live_groups(), ","))));
        phase = 1;
        ++dropped;
      } else if (phase == 1 && q.groups.size() == 2) {
        FS_RETURN_IF_ERROR(Check(q.epoch == 2 && q.changed && q.joiners == std::vector<int>{1} &&
                                     q.sources == std::vector<int>{0} && !q.joining,
                                 absl::StrCat("rejoin seen by group 0: epoch ", q.epoch)));
        // The heartbeat view catches up within an interval of the new incarnation's first beat.
        const absl::Time until = absl::Now() + absl::Seconds(2);
        while ((*m)->live_groups().size() != 2 && absl::Now() < until) {
          absl::SleepFor(absl::Milliseconds(10));
        }
        FS_RETURN_IF_ERROR(Check((*m)->live_groups() == std::vector<int>{0, 1},
                                 absl::StrCat("live groups after the rejoin: ",
                                              absl::StrJoin((*m)->live_groups(), ","))));
        phase = 2;
      } else if (phase == 2) {
        ++after_rejoin;
        FS_RETURN_IF_ERROR(Check(q.epoch == 2 && !q.changed, "steady after rejoin"));
      } else {
        FS_RETURN_IF_ERROR(Check(q.epoch == phase && (phase == 0 || !q.changed || q.round == 0),
                                 absl::StrCat("phase ", phase, " epoch ", q.epoch)));
      }
      absl::SleepFor(absl::Milliseconds(20));
    }
    FS_RETURN_IF_ERROR(Check(phase == 2 && after_rejoin == 2, absl::StrCat("ended in phase ", phase)));
    (*m)->Leave();
    return absl::OkStatus();
  }, absl::Seconds(90)));
}

// 3 groups x 1 rank: groups 1 and 2 die at once; group 0 goes on alone at epoch 1.
TEST(Membership, TwoGroupsDieAtOnce) {
  Answers answers;
  std::atomic<int64_t> death_us{0};
  ExpectAllOk(comm::testing::RunThreads(3, [&](int rank) -> absl::Status {
    FS_ASSIGN_OR_RETURN(auto m, Membership::Create(SharedStore(), testing::FastOptions(3, 1, rank)));
    for (int64_t step = 0; step < 2; ++step) {
      FS_ASSIGN_OR_RETURN(Quorum q, m->quorum(step, absl::Seconds(20)));
      FS_RETURN_IF_ERROR(answers.Record(q));
    }
    if (rank != 0) {
      m.reset();
      death_us = absl::ToUnixMicros(absl::Now());
      return absl::OkStatus();
    }
    FS_ASSIGN_OR_RETURN(Quorum q, m->quorum(2, absl::Seconds(20)));
    const absl::Duration detect = absl::Now() - absl::FromUnixMicros(death_us);
    std::printf("detection: groups 1 and 2 (1 rank each) dropped %s after they stopped\n",
                absl::FormatDuration(detect).c_str());
    FS_RETURN_IF_ERROR(Check(q.groups == std::vector<int>{0} && q.epoch == 1 &&
                                 q.dropped == std::vector<int>{1, 2} && detect <= kDetectBound,
                             absl::StrCat("epoch ", q.epoch, " after ", absl::FormatDuration(detect))));
    return absl::OkStatus();
  }, absl::Seconds(60)));
}

// The store keeps a bounded number of rounds: after 40 rounds (with votes) the keys of the
// first ones are gone, the recent ones there; a group that comes back afterwards still joins.
TEST(Membership, OldRoundsArePrunedAndAJoinerStillFindsItsRound) {
  ExpectAllOk(comm::testing::RunThreads(2, [&](int rank) -> absl::Status {
    std::shared_ptr<comm::Store> store = SharedStore();
    FS_ASSIGN_OR_RETURN(auto m, Membership::Create(store, testing::FastOptions(2, 1, rank)));
    constexpr int64_t kRounds = 40;
    for (int64_t step = 0; step < kRounds; ++step) {
      FS_ASSIGN_OR_RETURN(Quorum q, m->quorum(step, absl::Seconds(20)));
      FS_ASSIGN_OR_RETURN(bool commit, m->should_commit(q, true, absl::Seconds(20)));
      FS_RETURN_IF_ERROR(Check(commit, "commit"));
    }
    if (rank == 0) {
      for (const std::string key : {"ft/round/0", "ft/commit/0", "ft/arrive/0/g1/s0", "ft/vote/0/g0/s0",
                                    "ft/round/20", "ft/arrive/20/g0/s0"}) {
        FS_ASSIGN_OR_RETURN(bool present, store->Check(key));
        FS_RETURN_IF_ERROR(Check(!present, absl::StrCat(key, " was not pruned")));
      }
      for (const std::string key : {"ft/round/39", "ft/round/30", "ft/vote/38/g1/s0"}) {
        FS_ASSIGN_OR_RETURN(bool present, store->Check(key));
        FS_RETURN_IF_ERROR(Check(present, absl::StrCat(key, " is missing")));
      }
      FS_ASSIGN_OR_RETURN(Quorum q, m->quorum(kRounds, absl::Seconds(20)));
      FS_RETURN_IF_ERROR(Check(q.joiners == std::vector<int>{1} && q.round == kRounds,
                               absl::StrCat("round ", q.round, " joiners ",
                                            absl::StrJoin(q.joiners, ","))));
    } else {
      m.reset();  // restarted at once
      FS_ASSIGN_OR_RETURN(m, Membership::Create(store, testing::FastOptions(2, 1, rank)));
      FS_ASSIGN_OR_RETURN(Quorum q, m->quorum(0, absl::Seconds(20)));
      FS_RETURN_IF_ERROR(Check(q.joining && q.source_group == 0 && q.round == kRounds,
                               absl::StrCat("rejoin at round ", q.round)));
    }
    m->Leave();
    return absl::OkStatus();
  }, absl::Seconds(60)));
}

// A group whose processes restart faster than dead_after is still listed in the round before,
// but its new incarnation lost the state: it must come back as a joiner with a source, at a new
// epoch, without waiting for anyone to be judged dead.
TEST(Membership, GroupRestartedBeforeJudgedDeadIsAJoiner) {
  Answers answers;
  ExpectAllOk(comm::testing::RunThreads(2, [&](int rank) -> absl::Status {
    FS_ASSIGN_OR_RETURN(auto m, Membership::Create(SharedStore(), testing::FastOptions(2, 1, rank)));
    for (int64_t step = 0; step < 2; ++step) {
      FS_ASSIGN_OR_RETURN(Quorum q, m->quorum(step, absl::Seconds(20)));
      FS_RETURN_IF_ERROR(answers.Record(q));
    }
    const absl::Time start = absl::Now();
    Quorum q;
    if (rank == 1) {
      m.reset();  // dies and is restarted at once (a new incarnation at step 0)
      FS_ASSIGN_OR_RETURN(m, Membership::Create(SharedStore(), testing::FastOptions(2, 1, rank)));
      FS_ASSIGN_OR_RETURN(q, m->quorum(0, absl::Seconds(20)));
      FS_RETURN_IF_ERROR(Check(q.joining && q.source_group == 0 && q.changed,
                               absl::StrCat("restarted group: joining ", q.joining, " source ",
                                            q.source_group)));
    } else {
      FS_ASSIGN_OR_RETURN(q, m->quorum(2, absl::Seconds(20)));
      FS_RETURN_IF_ERROR(Check(!q.joining && q.changed, "group 0 keeps its state"));
    }
    FS_RETURN_IF_ERROR(answers.Record(q));
    FS_RETURN_IF_ERROR(Check(q.round == 2 && q.epoch == 1 && q.groups == std::vector<int>{0, 1} &&
                                 q.joiners == std::vector<int>{1} &&
                                 q.sources == std::vector<int>{0} && q.max_step == 2,
                             absl::StrCat("round ", q.round, " epoch ", q.epoch, " joiners ",
                                          absl::StrJoin(q.joiners, ","))));
    // Decided as soon as the new incarnation arrived: nobody waited to be judged dead.
    FS_RETURN_IF_ERROR(Check(absl::Now() - start < kDeadAfter,
                             absl::StrCat("took ", absl::FormatDuration(absl::Now() - start))));
    m->Leave();
    return absl::OkStatus();
  }, absl::Seconds(60)));
}

// Processes start unevenly: a group that has not beaten yet is waited for up to start_timeout
// (not dead_after), and one that never starts is dropped after it.
TEST(Membership, SlowStartIsWaitedForUpToStartTimeout) {
  ExpectAllOk(comm::testing::RunThreads(2, [&](int rank) -> absl::Status {
    Membership::Options o = testing::FastOptions(2, 1, rank);
    o.start_timeout = absl::Seconds(3);
    if (rank == 1) absl::SleepFor(kDeadAfter + absl::Milliseconds(700));  // slower than dead_after
    FS_ASSIGN_OR_RETURN(auto m, Membership::Create(SharedStore(), o));
    FS_ASSIGN_OR_RETURN(Quorum q, m->quorum(0, absl::Seconds(20)));
    FS_RETURN_IF_ERROR(Check(q.groups == std::vector<int>{0, 1} && q.dropped.empty(),
                             absl::StrCat("round 0: ", absl::StrJoin(q.groups, ","), " dropped ",
                                          absl::StrJoin(q.dropped_reasons, ";"))));
    m->Leave();
    return absl::OkStatus();
  }, absl::Seconds(60)));
  ExpectAllOk(comm::testing::RunThreads(1, [&](int rank) -> absl::Status {
    Membership::Options o = testing::FastOptions(2, 1, rank);
    o.name = "never";
    o.start_timeout = absl::Seconds(2);
    FS_ASSIGN_OR_RETURN(auto m, Membership::Create(SharedStore(), o));
    const absl::Time start = absl::Now();
    FS_ASSIGN_OR_RETURN(Quorum q, m->quorum(0, absl::Seconds(20)));
    const absl::Duration took = absl::Now() - start;
    FS_RETURN_IF_ERROR(Check(q.groups == std::vector<int>{0} && q.dropped == std::vector<int>{1} &&
                                 absl::StrContains(q.dropped_reasons[0], "never sent a heartbeat") &&
                                 took >= o.start_timeout && took <= o.start_timeout + kSlack,
                             absl::StrCat("round 0 without group 1 after ",
                                          absl::FormatDuration(took), ": ",
                                          absl::StrJoin(q.dropped_reasons, ";"))));
    m->Leave();
    return absl::OkStatus();
  }, absl::Seconds(60)));
}

// Every group restarted: all are joiners and none has a source (the live state is lost).
TEST(Membership, EveryGroupRestartedHasNoSource) {
  Answers answers;
  ExpectAllOk(comm::testing::RunThreads(2, [&](int rank) -> absl::Status {
    FS_ASSIGN_OR_RETURN(auto m, Membership::Create(SharedStore(), testing::FastOptions(2, 1, rank)));
    for (int64_t step = 0; step < 2; ++step) {
      FS_ASSIGN_OR_RETURN(Quorum q, m->quorum(step, absl::Seconds(20)));
      FS_RETURN_IF_ERROR(answers.Record(q));
    }
    m.reset();
    FS_ASSIGN_OR_RETURN(m, Membership::Create(SharedStore(), testing::FastOptions(2, 1, rank)));
    FS_ASSIGN_OR_RETURN(Quorum q, m->quorum(0, absl::Seconds(20)));
    FS_RETURN_IF_ERROR(answers.Record(q));
    FS_RETURN_IF_ERROR(Check(q.joining && q.source_group == -1 &&
                                 q.joiners == std::vector<int>{0, 1} &&
                                 q.sources == std::vector<int>{-1, -1},
                             absl::StrCat("joining ", q.joining, " source ", q.source_group,
                                          " joiners ", absl::StrJoin(q.joiners, ","))));
    m->Leave();
    return absl::OkStatus();
  }, absl::Seconds(60)));
}

// One rank voting to discard discards the step on every rank; the next round has a new epoch.
TEST(Membership, ShouldCommitIsTheSameEverywhere) {
  ExpectAllOk(comm::testing::RunThreads(4, [&](int rank) -> absl::Status {
    FS_ASSIGN_OR_RETURN(auto m, Membership::Create(SharedStore(), testing::FastOptions(2, 2, rank)));
    FS_ASSIGN_OR_RETURN(Quorum q, m->quorum(0, absl::Seconds(20)));
    FS_ASSIGN_OR_RETURN(bool commit, m->should_commit(q, true, absl::Seconds(20)));
    FS_RETURN_IF_ERROR(Check(commit, "all voted true"));
    FS_ASSIGN_OR_RETURN(q, m->quorum(1, absl::Seconds(20)));
    FS_RETURN_IF_ERROR(Check(q.epoch == 0 && !q.changed, "committed: same epoch"));
    FS_ASSIGN_OR_RETURN(commit, m->should_commit(q, rank != 3, absl::Seconds(20)));
    FS_RETURN_IF_ERROR(Check(!commit, "rank 3 voted false"));
    FS_ASSIGN_OR_RETURN(q, m->quorum(1, absl::Seconds(20)));
    FS_RETURN_IF_ERROR(Check(q.epoch == 1 && q.changed && q.groups == std::vector<int>{0, 1},
                             absl::StrCat("after a discarded step: epoch ", q.epoch)));
    m->Leave();
    return absl::OkStatus();
  }, absl::Seconds(60)));
}

// A rank that dies between the quorum and its vote: the step is discarded within the bound.
TEST(Membership, ShouldCommitFalseWhenARankDiesBeforeVoting) {
  std::atomic<int64_t> death_us{0};
  ExpectAllOk(comm::testing::RunThreads(2, [&](int rank) -> absl::Status {
    FS_ASSIGN_OR_RETURN(auto m, Membership::Create(SharedStore(), testing::FastOptions(2, 1, rank)));
    FS_ASSIGN_OR_RETURN(Quorum q, m->quorum(0, absl::Seconds(20)));
    if (rank == 1) {
      m.reset();
      death_us = absl::ToUnixMicros(absl::Now());
      return absl::OkStatus();
    }
    FS_ASSIGN_OR_RETURN(bool commit, m->should_commit(q, true, absl::Seconds(20)));
    const absl::Duration detect = absl::Now() - absl::FromUnixMicros(death_us);
    std::printf("detection: group 1 died before voting, step discarded %s later\n",
                absl::FormatDuration(detect).c_str());
    FS_RETURN_IF_ERROR(Check(!commit && detect <= kDetectBound, absl::StrCat("after ", absl::FormatDuration(detect))));
    FS_ASSIGN_OR_RETURN(q, m->quorum(0, absl::Seconds(20)));
    return Check(q.groups == std::vector<int>{0} && q.epoch == 1, absl::StrCat("epoch ", q.epoch));
  }, absl::Seconds(30)));
}

// A clean exit is noticed at the next sample, without waiting for dead_after.
TEST(Membership, LeaveIsNoticedWithinAnInterval) {
  std::atomic<int64_t> left_us{0};
  ExpectAllOk(comm::testing::RunThreads(2, [&](int rank) -> absl::Status {
    FS_ASSIGN_OR_RETURN(auto m, Membership::Create(SharedStore(), testing::FastOptions(2, 1, rank)));
    FS_ASSIGN_OR_RETURN(Quorum q, m->quorum(0, absl::Seconds(20)));
    if (rank == 1) {
      left_us = absl::ToUnixMicros(absl::Now());
      m->Leave();
      return absl::OkStatus();
    }
    FS_ASSIGN_OR_RETURN(q, m->quorum(1, absl::Seconds(20)));
    const absl::Duration detect = absl::Now() - absl::FromUnixMicros(left_us);
    std::printf("detection: group 1 left, dropped %s later\n", absl::FormatDuration(detect).c_str());
    return Check(q.groups == std::vector<int>{0} && absl::StrContains(q.dropped_reasons[0], "left") &&
                     detect < kDeadAfter,
                 absl::StrCat("after ", absl::FormatDuration(detect)));
  }, absl::Seconds(30)));
}

// min_groups 2 and one of 2 groups dies: a clear error within the bound, not a hang.
TEST(Membership, BelowMinGroupsIsAnError) {
  ExpectAllOk(comm::testing::RunThreads(2, [&](int rank) -> absl::Status {
    Membership::Options o = testing::FastOptions(2, 1, rank);
    o.min_groups = 2;
    FS_ASSIGN_OR_RETURN(auto m, Membership::Create(SharedStore(), o));
    FS_ASSIGN_OR_RETURN(Quorum q, m->quorum(0, absl::Seconds(20)));
    if (rank == 1) {
      m->ReportFailure(absl::InternalError("out of memory"));
      return absl::OkStatus();
    }
    const absl::Time t0 = absl::Now();
    absl::StatusOr<Quorum> next = m->quorum(1, absl::Seconds(20));
    const absl::Duration took = absl::Now() - t0;
    std::printf("below min_groups: %s after %s\n", next.status().ToString().c_str(),
                absl::FormatDuration(took).c_str());
    return Check(next.status().code() == absl::StatusCode::kUnavailable &&
                     absl::StrContains(next.status().message(), "fewer than min_groups 2") &&
                     absl::StrContains(next.status().message(), "reported a failure (INTERNAL: out of memory)") &&
                     took <= o.below_min_wait + kInterval + kSlack,
                 next.status().ToString());
  }, absl::Seconds(30)));
}

// A live group that never arrives: kDeadlineExceeded naming it, at the caller's timeout.
TEST(Membership, TimeoutNamesTheGroupWaitedFor) {
  auto store = std::make_shared<comm::HashStore>();
  auto m0 = Membership::Create(store, testing::FastOptions(2, 1, 0));
  auto m1 = Membership::Create(store, testing::FastOptions(2, 1, 1));
  ASSERT_TRUE(m0.ok() && m1.ok());
  EXPECT_THAT((*m0)->quorum(0, absl::Milliseconds(500)),
              StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("waiting for group(s) 1")));
}

// A store wrapper that stops answering on request.
class SwitchableStore : public comm::Store {
 public:
  explicit SwitchableStore(std::shared_ptr<comm::Store> base) : base_(std::move(base)) {}
  std::atomic<bool> down{false};
  absl::Status Down() const { return absl::UnavailableError("store host unreachable"); }
  absl::Status Set(absl::string_view k, absl::string_view v) override { return down ? Down() : base_->Set(k, v); }
  absl::StatusOr<std::string> Get(absl::string_view k, absl::Duration t) override {
    if (down) return Down();
    return base_->Get(k, t);
  }
  absl::StatusOr<int64_t> Add(absl::string_view k, int64_t d) override {
    if (down) return Down();
    return base_->Add(k, d);
  }
  absl::StatusOr<std::string> CompareSet(absl::string_view k, absl::string_view e, absl::string_view d) override {
    if (down) return Down();
    return base_->CompareSet(k, e, d);
  }
  absl::StatusOr<bool> Delete(absl::string_view k) override {
    if (down) return Down();
    return base_->Delete(k);
  }
  absl::Status Wait(absl::Span<const std::string> k, absl::Duration t) override { return down ? Down() : base_->Wait(k, t); }
  absl::StatusOr<bool> Check(absl::string_view k) override {
    if (down) return Down();
    return base_->Check(k);
  }

 private:
  std::shared_ptr<comm::Store> base_;
};

TEST(Membership, StoreThatStopsAnsweringIsAClearError) {
  auto store = std::make_shared<SwitchableStore>(std::make_shared<comm::HashStore>());
  auto m = Membership::Create(store, testing::FastOptions(1, 1, 0));
  ASSERT_TRUE(m.ok());
  ASSERT_TRUE((*m)->quorum(0, absl::Seconds(5)).ok());
  store->down = true;
  EXPECT_THAT((*m)->quorum(1, absl::Seconds(5)), StatusIs(absl::StatusCode::kUnavailable));
  absl::SleepFor(kDeadAfter + 2 * kInterval);
  store->down = false;  // answers again, but the heartbeat thread's view is too old for a moment
  // The quorum itself works again as soon as a sample succeeds.
  absl::SleepFor(2 * kInterval);
  EXPECT_TRUE((*m)->quorum(1, absl::Seconds(5)).ok());
}

TEST(Membership, RejectsBadOptions) {
  auto store = std::make_shared<comm::HashStore>();
  Membership::Options o = testing::FastOptions(2, 2, 0);
  o.group = 2;
  EXPECT_THAT(Membership::Create(store, o), StatusIs(absl::StatusCode::kInvalidArgument));
  o = testing::FastOptions(2, 2, 0);
  o.min_groups = 3;
  EXPECT_THAT(Membership::Create(store, o), StatusIs(absl::StatusCode::kInvalidArgument));
  o = testing::FastOptions(2, 2, 0);
  o.dead_after = o.heartbeat_interval;
  EXPECT_THAT(Membership::Create(store, o), StatusIs(absl::StatusCode::kInvalidArgument));
}

// Ranks as processes, tcp: 2 groups x 2 ranks, each step an all-reduce over the quorum's
// replicate communicator, checked against the sum over the quorum's groups. Rank (group 1,
// shard 1) SIGKILLs itself at step 3 before its all-reduce: its replicate peer's all-reduce fails,
// group 0 drops group 1 within the bound and goes on alone; rank (1, 0) learns it was left out.
TEST(Membership, ProcessesWithTcpSurviveASigkill) {
  constexpr int kKillStep = 3;
  constexpr int kRounds = 8;
  std::vector<absl::Status> statuses = comm::testing::RunProcesses(4, [&](int rank) -> absl::Status {
    const int g = rank / 2, s = rank % 2;
    std::shared_ptr<comm::Store> store = SharedStore();
    Membership::Options o = testing::FastOptions(2, 2, rank);
    FS_ASSIGN_OR_RETURN(auto m, Membership::Create(store, o));
    comm::CommConfig base = comm::testing::RankConfig(absl::Seconds(20));
    base.timeout = absl::Seconds(10);
    base.options["algo.heartbeat_ms"] = "250";
    base.options["algo.stall_timeout_ms"] = "1000";
    std::shared_ptr<comm::Communicator> comm;
    Quorum first;
    // One step per round; a rank whose all-reduce failed retries its step in the next round
    // (its shard's replicate group), so ranks stop by round, not by step.
    int64_t round = -1;
    int step = 0;
    for (; round + 1 < kRounds; ++step) {
      absl::StatusOr<Quorum> got = m->quorum(step, absl::Seconds(30));
      if (g == 1 && got.status().code() == absl::StatusCode::kAborted) {
        std::printf("group 1 rank 0 at step %d: %s\n", step, got.status().ToString().c_str());
        return Check(step == kKillStep && absl::StrContains(got.status().message(), "left out"),
                     got.status().ToString());
      }
      FS_RETURN_IF_ERROR(got.status());
      const Quorum& q = *got;
      round = q.round;
      if (q.round == 0) first = q;
      if (q.changed) {
        FS_ASSIGN_OR_RETURN(comm, m->replicate_communicator(q, std::move(comm), "tcp", base));
      }
      if (q.round > 0 && q.changed && !q.dropped.empty()) {
        FS_ASSIGN_OR_RETURN(std::string killed, store->Get("killed_at_us", absl::Seconds(1)));
        int64_t us = 0;
        (void)absl::SimpleAtoi(killed, &us);
        const absl::Duration detect = absl::Now() - absl::FromUnixMicros(us);
        std::printf("detection: rank (1,1) SIGKILLed, group 1 dropped at rank (%d,%d) %s later, epoch %lld: %s\n",
                    g, s, absl::FormatDuration(detect).c_str(), static_cast<long long>(q.epoch),
                    absl::StrJoin(q.dropped_reasons, "; ").c_str());
        FS_RETURN_IF_ERROR(Check(q.groups == std::vector<int>{0} && q.epoch == 1 && detect <= kDetectBound,
                                 absl::StrCat("drop after ", absl::FormatDuration(detect))));
        // The quorum of epoch 0 is stale now.
        absl::StatusOr<std::shared_ptr<comm::Communicator>> stale =
            m->replicate_communicator(first, nullptr, "tcp", base);
        FS_RETURN_IF_ERROR(Check(stale.status().code() == absl::StatusCode::kFailedPrecondition &&
                                     absl::StrContains(stale.status().message(), "stale"),
                                 absl::StrCat("stale quorum: ", stale.status().ToString())));
      }
      if (rank == 3 && step == kKillStep) {
        FS_RETURN_IF_ERROR(store->Set("killed_at_us", absl::StrCat(absl::ToUnixMicros(absl::Now()))));
        raise(SIGKILL);
      }
      std::vector<float> v(1000, static_cast<float>((g + 1) * 1000 + s * 10 + step));
      comm::Buffer b = comm::MakeBuffer(v.data(), v.size());
      absl::Status ar = comm->AllReduce(b, b, comm::ReduceOp::kSum).Wait();
      if (ar.ok()) {
        float want = 0;
        for (int gg : q.groups) want += (gg + 1) * 1000 + s * 10 + step;
        FS_RETURN_IF_ERROR(Check(v[0] == want && v[999] == want,
                                 absl::StrCat("step ", step, ": ", v[0], " != ", want)));
      }
      FS_ASSIGN_OR_RETURN(bool commit, m->should_commit(q, ar.ok(), absl::Seconds(30)));
      if (!commit) {
        std::printf("rank (%d,%d) step %d round %lld: all-reduce %s, step discarded by the vote; retried in the next round\n",
                    g, s, step, static_cast<long long>(q.round), ar.ToString().c_str());
        FS_RETURN_IF_ERROR(Check(q.round == kKillStep, "only the kill's round is discarded"));
        --step;
        continue;
      }
      FS_RETURN_IF_ERROR(Check(q.round != kKillStep, "the kill's round committed"));
      if (q.round > kKillStep + 1) {
        FS_RETURN_IF_ERROR(Check(q.groups == std::vector<int>{0}, "group 0 alone after the kill"));
      }
    }
    m->Leave();
    // Rounds 0..kRounds-1, the kill's round discarded: both ranks of group 0 at the same step.
    return Check(step == kRounds - 1, absl::StrCat("ended at step ", step));
  }, absl::Seconds(120));
  ASSERT_EQ(statuses.size(), 4u);
  EXPECT_TRUE(statuses[0].ok()) << statuses[0];
  EXPECT_TRUE(statuses[1].ok()) << statuses[1];
  EXPECT_TRUE(statuses[2].ok()) << statuses[2];
  EXPECT_THAT(statuses[3], StatusIs(absl::StatusCode::kInternal, HasSubstr("signal 9")));
}

}  // namespace
}  // namespace fairscale::ft
