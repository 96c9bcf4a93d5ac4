#include "launch/replica_groups.h"

#include <vector>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "launch/launcher.h"

namespace fairscale::launch {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;

LaunchOptions TwoNodesOfFour(int node_rank) {
  LaunchOptions o;
  o.program = "x";
  o.nnodes = 2;
  o.node_rank = node_rank;
  o.nproc_per_node = 4;
  o.replica_group_size = 2;
  o.max_restarts = 1;
  return o;
}

TEST(ReplicaGroups, OffByDefault) {
  LaunchOptions o;
  o.program = "x";
  EXPECT_FALSE(ReplicaGroups(o).enabled());
}

TEST(ReplicaGroups, ConsecutiveGlobalRanksWithinANode) {
  const ReplicaGroups groups(TwoNodesOfFour(/*node_rank=*/1));
  ASSERT_TRUE(groups.enabled());
  EXPECT_EQ(groups.GroupOf(4), 2);
  EXPECT_EQ(groups.GroupOf(7), 3);
  EXPECT_EQ(groups.RanksOf(3), "ranks 6-7");
  // Node 1 holds global ranks 4-7: group 3 is its local ranks 2-3.
  EXPECT_THAT(groups.LocalRanksOf(3), ElementsAre(2, 3));
  EXPECT_THAT(groups.LocalRanksOf(2), ElementsAre(0, 1));

  LaunchOptions single = TwoNodesOfFour(0);
  single.replica_group_size = 1;
  EXPECT_EQ(ReplicaGroups(single).RanksOf(3), "rank 3");
}

TEST(ReplicaGroups, EachGroupCountsItsOwnRestarts) {
  ReplicaGroups groups(TwoNodesOfFour(/*node_rank=*/0));
  const absl::Time now = absl::Now();
  EXPECT_THAT(groups.Restarting(), IsEmpty());
  EXPECT_TRUE(groups.HasRestartsLeft(1));

  groups.BeginRestart(1, now + absl::Seconds(5));
  EXPECT_EQ(groups.restarts(1), 1);
  EXPECT_EQ(groups.restarts(0), 0);
  EXPECT_TRUE(groups.restarting(1));
  EXPECT_FALSE(groups.restarting(0));
  EXPECT_THAT(groups.Restarting(), ElementsAre(1));
  EXPECT_FALSE(groups.KillDue(1, now));
  EXPECT_TRUE(groups.KillDue(1, now + absl::Seconds(5)));
  groups.MarkKilled(1);
  EXPECT_FALSE(groups.KillDue(1, now + absl::Seconds(6)));

  groups.EndRestart(1);
  EXPECT_FALSE(groups.restarting(1));
  EXPECT_THAT(groups.Restarting(), IsEmpty());
  EXPECT_FALSE(groups.HasRestartsLeft(1));  // max_restarts = 1
  EXPECT_TRUE(groups.HasRestartsLeft(0));
}

}  // namespace
}  // namespace fairscale::launch
