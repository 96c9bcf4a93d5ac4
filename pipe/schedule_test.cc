// The schedules: properties of MakeSchedule for many shapes, the exact 1F1B order of a 4-stage
// pipeline, and the order the stages of a running Pipe actually followed (its trace).
// Interleaved 1F1B: every rank's list is complete, respects the in-flight bound, and the ranks'
// lists together run to the end when executed the way Pipe does (sends never block, a receive
// blocks until its message arrives, messages on each link in FIFO order): no deadlock, and
// every receive gets the message it expects.
#include <deque>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status_matchers.h"
#include "gtest/gtest.h"
#include "pipe/pipe.h"
#include "pipe/schedule.h"
#include "pipe/test_util.h"

namespace fairscale::pipe {
namespace {

using base::testing::IsOk;

// Every micro-batch runs forward once, then backward once; returns "" or what is wrong.
std::string CheckComplete(const std::vector<Action>& actions, int64_t m) {
  std::vector<int> forwards(m, 0), backwards(m, 0);
  for (const Action& a : actions) {
    if (a.micro_batch < 0 || a.micro_batch >= m) return "micro-batch out of range";
    if (a.phase == Phase::kForward) {
      if (++forwards[a.micro_batch] != 1) return "a second forward";
    } else {
      if (forwards[a.micro_batch] != 1) return "backward before forward";
      if (++backwards[a.micro_batch] != 1) return "a second backward";
    }
  }
  for (int64_t i = 0; i < m; ++i) {
    if (forwards[i] != 1 || backwards[i] != 1) return absl::StrCat("micro-batch ", i, " missing");
  }
  return "";
}

bool AllForwardsFirst(const std::vector<Action>& actions) {
  bool seen_backward = false;
  for (const Action& a : actions) {
    if (a.phase == Phase::kBackward) seen_backward = true;
    if (a.phase == Phase::kForward && seen_backward) return false;
  }
  return true;
}

// Every (chunk, micro-batch) runs forward once, then backward once.
std::string CheckCompleteChunks(const std::vector<Action>& actions, int64_t m, int64_t v) {
  std::map<std::pair<int64_t, int64_t>, int> forwards, backwards;
  for (const Action& a : actions) {
    if (a.micro_batch < 0 || a.micro_batch >= m || a.chunk < 0 || a.chunk >= v) {
      return "action out of range";
    }
    const auto key = std::make_pair(a.chunk, a.micro_batch);
    if (a.phase == Phase::kForward) {
      if (++forwards[key] != 1) return "a second forward";
    } else {
      if (forwards[key] != 1) return "backward before forward";
      if (++backwards[key] != 1) return "a second backward";
    }
  }
  if (static_cast<int64_t>(forwards.size()) != m * v ||
      static_cast<int64_t>(backwards.size()) != m * v) {
    return "a (chunk, micro-batch) is missing";
  }
  return "";
}

// Runs the ranks' lists like Pipe does (see the file comment); "" or what went wrong (a
// deadlock names what every rank waits for). Virtual stage c = chunk * p + rank; the forward of
// c > 0 receives from c - 1, the backward of c < p v - 1 from c + 1. Messages are tagged
// (receiving virtual stage, micro-batch); each (rank, next rank) link has one FIFO per
// direction, like Pipe's link communicators.
std::string Simulate(const std::vector<std::vector<Action>>& lists, int64_t p, int64_t v) {
  const int64_t last = p * v - 1;
  using Message = std::pair<int64_t, int64_t>;
  std::vector<std::deque<Message>> acts(p), grads(p);  // into rank r
  std::vector<size_t> next(p, 0);
  std::set<Message> forwarded;  // (virtual stage, micro-batch)
  for (bool progress = true; progress;) {
    progress = false;
    for (int64_t r = 0; r < p; ++r) {
      while (next[r] < lists[r].size()) {
        const Action& a = lists[r][next[r]];
        const int64_t c = a.chunk * p + r;
        const bool fwd = a.phase == Phase::kForward;
        const bool receives = fwd ? c > 0 : c < last;
        std::deque<Message>& in = fwd ? acts[r] : grads[r];
        if (!fwd && forwarded.count({c, a.micro_batch}) == 0) {
          return absl::StrCat("rank ", r, ": backward of (", c, ", ", a.micro_batch,
                              ") before its forward");
        }
        if (receives) {
          if (in.empty()) break;  // blocked
          if (in.front() != Message(c, a.micro_batch)) {
            return absl::StrCat("rank ", r, " expects (", c, ", ", a.micro_batch, ") but got (",
                                in.front().first, ", ", in.front().second, ")");
          }
          in.pop_front();
        }
        if (fwd) forwarded.insert({c, a.micro_batch});
        if (fwd && c < last) acts[(r + 1) % p].push_back({c + 1, a.micro_batch});
        if (!fwd && c > 0) grads[(r + p - 1) % p].push_back({c - 1, a.micro_batch});
        ++next[r];
        progress = true;
      }
    }
  }
  std::string stuck;
  for (int64_t r = 0; r < p; ++r) {
    if (next[r] < lists[r].size()) {
      absl::StrAppend(&stuck, " rank ", r, " at ", DescribeActions({lists[r][next[r]]}));
    }
    if (!acts[r].empty() || !grads[r].empty()) absl::StrAppend(&stuck, " rank ", r, " unread");
  }
  return stuck.empty() ? "" : absl::StrCat("deadlock:", stuck);
}

TEST(ScheduleTest, InterleavedRunsWithoutDeadlockForManyShapes) {
  for (int64_t p = 1; p <= 5; ++p) {
    for (int64_t v = 1; v <= 4; ++v) {
      for (int64_t m = p; m <= 4 * p; m += p) {
        std::vector<std::vector<Action>> lists, forwards;
        for (int64_t r = 0; r < p; ++r) {
          const std::string at = absl::StrCat("p ", p, " v ", v, " m ", m, " rank ", r);
          EXPECT_EQ(ValidateSchedule(Schedule::kInterleaved1F1B, p, m, v), "") << at;
          lists.push_back(MakeSchedule(Schedule::kInterleaved1F1B, p, r, m, v));
          EXPECT_EQ(CheckCompleteChunks(lists.back(), m, v), "") << at;
          const int64_t bound = InterleavedInFlightBound(p, r, m, v);
          EXPECT_EQ(MaxInFlight(lists.back()), bound) << at << ": "
                                                     << DescribeActions(lists.back());
          // Never more than a GPipe rank (all m v chunk forwards), and for m >= 2p below it.
          EXPECT_LE(bound, m * v) << at;
          if (m >= 2 * p && v > 1) {
            EXPECT_LT(bound, m * v) << at;
          }
          std::vector<Action> f;
          for (const Action& a : lists.back()) {
            if (a.phase == Phase::kForward) f.push_back(a);
          }
          forwards.push_back(std::move(f));
          if (v == 1) {
            EXPECT_TRUE(lists.back() == MakeSchedule(Schedule::k1F1B, p, r, m)) << at;
          }
        }
        EXPECT_EQ(Simulate(lists, p, v), "") << "p " << p << " v " << v << " m " << m;
        EXPECT_EQ(Simulate(forwards, p, v), "") << "eval p " << p << " v " << v;
      }
    }
  }
}

TEST(ScheduleTest, InterleavedOrderOfTwoRanks) {
  // Megatron's order at p = 2, v = 2, m = 4: rank 0 warms up with (v - 1) p + 2 = 4 forwards.
  EXPECT_EQ(DescribeActions(MakeSchedule(Schedule::kInterleaved1F1B, 2, 0, 4, 2)),
            "F0.0 F1.0 F0.1 F1.1 F2.0 B0.1 F3.0 B1.1 F2.1 B0.0 F3.1 B1.0 B2.1 B3.1 B2.0 B3.0");
  EXPECT_EQ(DescribeActions(MakeSchedule(Schedule::kInterleaved1F1B, 2, 1, 4, 2)),
            "F0.0 F1.0 F0.1 B0.1 F1.1 B1.1 F2.0 B0.0 F3.0 B1.0 F2.1 B2.1 F3.1 B3.1 B2.0 B3.0");
}

TEST(ScheduleTest, InterleavedValidation) {
  EXPECT_EQ(ValidateSchedule(Schedule::k1F1B, 4, 3, 1), "");
  EXPECT_EQ(ValidateSchedule(Schedule::kInterleaved1F1B, 4, 3, 1), "");
  EXPECT_NE(ValidateSchedule(Schedule::kInterleaved1F1B, 4, 6, 2).find("chunks = 6"),
            std::string::npos);
  EXPECT_NE(ValidateSchedule(Schedule::k1F1B, 4, 8, 2).find("needs the schedule"),
            std::string::npos);
  EXPECT_NE(ValidateSchedule(Schedule::kGPipe, 4, 8, 0).find(">= 1"), std::string::npos);
}

TEST(ScheduleTest, PropertiesForManyShapes) {
  for (int64_t p = 1; p <= 5; ++p) {
    for (int64_t s = 0; s < p; ++s) {
      for (int64_t m = 1; m <= 10; ++m) {
        const std::string at = absl::StrCat("p ", p, " s ", s, " m ", m);
        const std::vector<Action> gpipe = MakeSchedule(Schedule::kGPipe, p, s, m);
        EXPECT_EQ(CheckComplete(gpipe, m), "") << at;
        EXPECT_TRUE(AllForwardsFirst(gpipe)) << at;
        EXPECT_EQ(MaxInFlight(gpipe), m) << at;
        const std::vector<Action> ofob = MakeSchedule(Schedule::k1F1B, p, s, m);
        EXPECT_EQ(CheckComplete(ofob, m), "") << at;
        EXPECT_EQ(MaxInFlight(ofob), std::min(p - s, m)) << at << ": " << DescribeActions(ofob);
        // The last stage alternates from the start.
        if (s == p - 1) {
          EXPECT_EQ(MaxInFlight(ofob), 1) << at;
        }
      }
    }
  }
}

TEST(ScheduleTest, OneFOneBOrderOfFourStages) {
  EXPECT_EQ(DescribeActions(MakeSchedule(Schedule::k1F1B, 4, 0, 8)),
            "F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7");
  EXPECT_EQ(DescribeActions(MakeSchedule(Schedule::k1F1B, 4, 2, 8)),
            "F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6 B7");
  EXPECT_EQ(DescribeActions(MakeSchedule(Schedule::k1F1B, 4, 3, 3)), "F0 B0 F1 B1 F2 B2");
  EXPECT_EQ(DescribeActions(MakeSchedule(Schedule::k1F1B, 4, 0, 2)), "F0 F1 B0 B1");
  EXPECT_EQ(DescribeActions(MakeSchedule(Schedule::kGPipe, 2, 1, 3)), "F0 F1 F2 B0 B1 B2");
}

// One train_step of `make()` over `ranks` inproc ranks with `options`: each rank's trace as
// actions (a test failure if a rank failed or an event is malformed).
std::vector<std::vector<Action>> RunTraces(int ranks, torch::nn::Sequential (*make)(),
                                           const PipeOptions& options) {
  std::vector<std::vector<Action>> traces(ranks);
  std::vector<absl::Status> statuses = testing::RunInproc(
      ranks, [&](int rank, std::shared_ptr<comm::Communicator> comm) -> absl::Status {
        std::unique_ptr<Pipe> pipe = Pipe::Create(make(), comm, options);
        at::Tensor loss =
            pipe->train_step(testing::Inputs(16, 1), testing::Targets(16, 2), testing::Mse);
        for (const PipeEvent& e : pipe->trace()) {
          if (e.stage != rank || e.end < e.start) return absl::InternalError("bad event");
          traces[rank].push_back({e.phase, e.micro_batch, e.chunk});
        }
        return absl::OkStatus();
      });
  for (int r = 0; r < ranks; ++r) EXPECT_THAT(statuses[r], IsOk()) << "rank " << r;
  return traces;
}

// What the stages of a running 4-stage pipe did, from their traces.
TEST(ScheduleTest, TraceFollowsTheSchedule) {
  constexpr int kStages = 4;
  constexpr int64_t kChunks = 8;
  for (Schedule schedule : {Schedule::kGPipe, Schedule::k1F1B}) {
    const std::vector<std::vector<Action>> traces =
        RunTraces(kStages, testing::MakeMlp, PipeOptions().chunks(kChunks).schedule(schedule));
    if (HasFailure()) return;
    for (int s = 0; s < kStages; ++s) {
      const std::string at =
          absl::StrCat(ScheduleName(schedule), " stage ", s, ": ", DescribeActions(traces[s]));
      EXPECT_EQ(CheckComplete(traces[s], kChunks), "") << at;
      if (schedule == Schedule::kGPipe) {
        EXPECT_TRUE(AllForwardsFirst(traces[s])) << at;
      } else {
        EXPECT_LE(MaxInFlight(traces[s]), kStages - s) << at;
        EXPECT_EQ(MaxInFlight(traces[s]), kStages - s) << at;
      }
      EXPECT_TRUE(traces[s] == MakeSchedule(schedule, kStages, s, kChunks)) << at;
    }
  }
}

// What the ranks of running interleaved pipes did, from their traces: each rank followed
// MakeSchedule, kept within the in-flight bound, and the traces together satisfy every
// dependency (Simulate: a forward after the previous virtual stage's forward, a backward after
// the next one's backward, in FIFO order per link).
TEST(ScheduleTest, InterleavedTraceFollowsTheSchedule) {
  for (const auto& [ranks, v, m] : std::vector<std::tuple<int, int64_t, int64_t>>{
           {2, 2, 4}, {2, 3, 2}, {4, 2, 8}, {3, 2, 3}}) {
    const std::vector<std::vector<Action>> traces = RunTraces(
        ranks, testing::MakeDeepMlp,
        PipeOptions().chunks(m).virtual_stages(v).schedule(Schedule::kInterleaved1F1B));
    if (HasFailure()) return;
    for (int r = 0; r < ranks; ++r) {
      const std::string at = absl::StrCat(ranks, " ranks x ", v, " m ", m, " rank ", r, ": ",
                                          DescribeActions(traces[r]));
      EXPECT_EQ(CheckCompleteChunks(traces[r], m, v), "") << at;
      EXPECT_EQ(MaxInFlight(traces[r]), InterleavedInFlightBound(ranks, r, m, v)) << at;
      EXPECT_TRUE(traces[r] == MakeSchedule(Schedule::kInterleaved1F1B, ranks, r, m, v)) << at;
    }
    EXPECT_EQ(Simulate(traces, ranks, v), "") << ranks << " ranks x " << v << " m " << m;
  }
}

}  // namespace
}  // namespace fairscale::pipe
