// The schedules: properties of MakeSchedule for many shapes, the exact 1F1B order of a 4-stage
// pipeline, and the order the stages of a running Pipe actually followed (its trace).
#include <memory>
#include <set>
#include <string>
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

// What the stages of a running 4-stage pipe did, from their traces.
TEST(ScheduleTest, TraceFollowsTheSchedule) {
  constexpr int kStages = 4;
  constexpr int64_t kChunks = 8;
  for (Schedule schedule : {Schedule::kGPipe, Schedule::k1F1B}) {
    std::vector<std::vector<Action>> traces(kStages);
    std::vector<absl::Status> statuses = testing::RunInproc(
        kStages, [&](int rank, std::shared_ptr<comm::Communicator> comm) -> absl::Status {
          absl::StatusOr<std::unique_ptr<Pipe>> pipe = Pipe::Create(
              testing::MakeMlp(), comm, PipeOptions().chunks(kChunks).schedule(schedule));
          if (!pipe.ok()) return pipe.status();
          absl::StatusOr<at::Tensor> loss = (*pipe)->train_step(
              testing::Inputs(16, 1), testing::Targets(16, 2), testing::Mse);
          if (!loss.ok()) return loss.status();
          for (const PipeEvent& e : (*pipe)->trace()) {
            if (e.stage != rank || e.end < e.start) return absl::InternalError("bad event");
            traces[rank].push_back({e.phase, e.micro_batch});
          }
          return absl::OkStatus();
        });
    for (int r = 0; r < kStages; ++r) ASSERT_THAT(statuses[r], IsOk()) << "rank " << r;
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

}  // namespace
}  // namespace fairscale::pipe
