// Summarize / FormatProfileTable on hand-built timelines whose numbers are derived by hand.
#include "trace/profile.h"

#include <string>
#include <vector>

#include "absl/strings/str_split.h"
#include "base/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "testing/tmp.h"
#include "trace/chrome_trace.h"

namespace fairscale::trace {
namespace {

using ::testing::HasSubstr;

Event Span(int pid, int tid, const std::string& name, const std::string& cat, int64_t begin,
           int64_t end, int64_t bytes = -1) {
  Event e;
  e.phase = Phase::kComplete;
  e.pid = pid;
  e.tid = tid;
  e.name = name;
  e.category = cat;
  e.ts_ns = begin;
  e.dur_ns = end - begin;
  if (bytes >= 0) e.args.emplace_back("bytes", bytes);
  return e;
}

// Rank 0 (ns):   0      50    100   150   200   250   300   350 380 400   450
//   compute      [forward-------)           [backward----)            [opt)
//     (a nested "layer" span [10,50) adds nothing)
//   wait                 [w)                             [wait-------)
//                        60-90 (blocked inside forward)
//   comm               [all_gather--)             [reduce_scatter-------)
//                                                             [ar]
//   C = [0,100) u [200,300) u [400,450); W = [60,90) u [300,400), |W| = 130
//   compute = |C \ W| = 60 + 10 + 100 + 50 = 220
//   comm = |[50,150) u [250,400)| = 250
//   overlapped = |M n (C \ W)| = [50,60) + [90,100) + [250,300) = 70; exposed = 180
//   wall = 450; idle = 450 - 220 - 180 = 50 (the gap [150,200))
// Rank 1: one broadcast [1000, 1100): wall 100, all of it exposed comm.
std::vector<Event> Timeline() {
  std::vector<Event> events = {
      Span(0, 1, "forward", "compute", 0, 100),
      Span(0, 1, "layer", "compute", 10, 50),
      Span(0, 1000, "all_gather", "comm", 50, 150, 1000),
      Span(0, 1, "backward", "compute", 200, 300),
      Span(0, 1000, "reduce_scatter", "comm", 250, 400, 500),
      Span(0, 1001, "all_reduce", "comm", 350, 380, 8),
      Span(0, 1, "wait all_gather", "wait", 60, 90),
      Span(0, 1, "wait reduce_scatter", "wait", 300, 400),
      Span(0, 1, "data", "data", 440, 445),  // other categories count only towards wall
      Span(0, 1, "optimizer", "compute", 400, 450),
      Span(1, 7, "broadcast", "comm", 1000, 1100, 4),
  };
  Event counter;
  counter.phase = Phase::kCounter;
  counter.name = "memory_mb";
  counter.ts_ns = 5000;  // not a span: does not stretch rank 0's wall time
  events.push_back(counter);
  return events;
}

TEST(Profile, ComputeCommOverlapAndIdleMatchTheHandDerivedNumbers) {
  const std::vector<ProfileSummary> s = Summarize(Timeline());
  ASSERT_EQ(s.size(), 2u);
  EXPECT_EQ(s[0].rank, 0);
  EXPECT_EQ(s[0].wall_ns, 450);
  EXPECT_EQ(s[0].compute_ns, 220);
  EXPECT_EQ(s[0].wait_ns, 130);
  EXPECT_EQ(s[0].comm_ns, 250);
  EXPECT_EQ(s[0].comm_overlapped_ns, 70);
  EXPECT_EQ(s[0].comm_exposed_ns, 180);
  EXPECT_EQ(s[0].idle_ns, 50);
  EXPECT_EQ(s[0].bytes, 1508);
  EXPECT_EQ(s[0].collectives, 3);
  ASSERT_EQ(s[0].by_op.size(), 3u);
  EXPECT_EQ(s[0].by_op[0].name, "reduce_scatter");
  EXPECT_EQ(s[0].by_op[0].total_ns, 150);
  EXPECT_EQ(s[0].by_op[0].bytes, 500);
  EXPECT_EQ(s[0].by_op[1].name, "all_gather");
  EXPECT_EQ(s[0].by_op[2].name, "all_reduce");
  EXPECT_EQ(s[0].by_op[2].count, 1);

  EXPECT_EQ(s[1].rank, 1);
  EXPECT_EQ(s[1].wall_ns, 100);
  EXPECT_EQ(s[1].compute_ns, 0);
  EXPECT_EQ(s[1].comm_exposed_ns, 100);
  EXPECT_EQ(s[1].comm_overlapped_ns, 0);
  EXPECT_EQ(s[1].idle_ns, 0);
}

TEST(Profile, WaitsAreCutOutOfComputeWhereverTheyFall) {
  // compute [0,100) and [200,300); waits [50,250) (straddling both) and [290,300) (at the end):
  // C \ W = [0,50) u [250,290) = 90. No comm traced: the waits are idle time.
  const std::vector<ProfileSummary> s = Summarize({
      Span(0, 1, "forward", "compute", 0, 100), Span(0, 1, "backward", "compute", 200, 300),
      Span(0, 1, "wait a", "wait", 50, 250), Span(0, 1, "wait b", "wait", 290, 300)});
  ASSERT_EQ(s.size(), 1u);
  EXPECT_EQ(s[0].wall_ns, 300);
  EXPECT_EQ(s[0].compute_ns, 90);
  EXPECT_EQ(s[0].wait_ns, 210);
  EXPECT_EQ(s[0].comm_exposed_ns, 0);
  EXPECT_EQ(s[0].idle_ns, 210);
}

TEST(Profile, EmptyAndCommFreeTimelines) {
  EXPECT_TRUE(Summarize({}).empty());
  const std::vector<ProfileSummary> s =
      Summarize({Span(4, 1, "forward", "compute", 10, 30), Span(4, 1, "load", "data", 30, 40)});
  ASSERT_EQ(s.size(), 1u);
  EXPECT_EQ(s[0].rank, 4);
  EXPECT_EQ(s[0].wall_ns, 30);
  EXPECT_EQ(s[0].compute_ns, 20);
  EXPECT_EQ(s[0].comm_ns, 0);
  EXPECT_EQ(s[0].idle_ns, 10);
  EXPECT_EQ(s[0].collectives, 0);
}

TEST(Profile, TableHasOneAlignedRowPerRankAndTheTopCollectives) {
  const std::string table = FormatProfileTable(Summarize(Timeline()));
  std::vector<std::string> lines = absl::StrSplit(table, '\n');
  ASSERT_GE(lines.size(), 3u);
  EXPECT_THAT(lines[0], HasSubstr("compute %"));
  EXPECT_THAT(lines[0], HasSubstr("overlap %"));
  EXPECT_THAT(lines[0], HasSubstr("idle %"));
  // Columns line up: every row as long as the header.
  EXPECT_EQ(lines[1].size(), lines[0].size());
  EXPECT_EQ(lines[2].size(), lines[0].size());
  // rank 0: compute 220/450 = 48.9 %, exposed comm 180/450 = 40.0 %, overlap 70/450 = 15.6 %,
  // idle 50/450 = 11.1 %, 3 collectives.
  std::vector<std::string> row0 = absl::StrSplit(lines[1], ' ', absl::SkipEmpty());
  ASSERT_EQ(row0.size(), 8u) << lines[1];
  EXPECT_EQ(row0[0], "0");
  EXPECT_EQ(row0[1], "0.000");  // 450 ns in ms
  EXPECT_EQ(row0[2], "48.9");
  EXPECT_EQ(row0[3], "40.0");
  EXPECT_EQ(row0[4], "15.6");
  EXPECT_EQ(row0[5], "11.1");
  EXPECT_EQ(row0[6], "3");
  std::vector<std::string> row1 = absl::StrSplit(lines[2], ' ', absl::SkipEmpty());
  ASSERT_EQ(row1.size(), 8u) << lines[2];
  EXPECT_EQ(row1[3], "100.0");
  EXPECT_THAT(table, HasSubstr("top collectives"));
  // Over all ranks by total time: reduce_scatter 150, broadcast 100 = all_gather 100 (more bytes
  // first: all_gather 1000 B), all_reduce 30.
  const size_t rs = table.find("reduce_scatter"), ag = table.find("all_gather"),
               bc = table.find("broadcast"), ar = table.find("all_reduce");
  EXPECT_LT(rs, ag);
  EXPECT_LT(ag, bc);
  EXPECT_LT(bc, ar);
  EXPECT_THAT(FormatProfileTable(Summarize(Timeline()), /*top=*/1), ::testing::Not(HasSubstr("all_reduce")));
}

TEST(Profile, SummarizeTraceFileReadsAMergedFile) {
  const std::string path = fairscale::testing::TmpPath("profile.json");
  ASSERT_OK(WriteChromeTrace(path, Timeline()));
  ASSERT_OK_AND_ASSIGN(std::vector<ProfileSummary> s, SummarizeTraceFile(path));
  ASSERT_EQ(s.size(), 2u);
  EXPECT_EQ(s[0].idle_ns, 50);
  EXPECT_EQ(s[0].comm_overlapped_ns, 70);
  EXPECT_EQ(s[0].wait_ns, 130);
  EXPECT_EQ(s[1].comm_exposed_ns, 100);
}

}  // namespace
}  // namespace fairscale::trace
