// The lifetime rules of SharedHybridGroups (hybrid_groups.h): one pair of groups per world
// communicator and choice, shared by every unit built over it (also across models), owned by
// those units only: gone with the last of them, made anew afterwards, never handed to another
// communicator; the process-wide index behind it empties when the models go.
#include "fsdp/internal/hybrid_groups.h"

#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "comm/communicator.h"
#include "comm/testing/counting_communicator.h"
#include "comm/testing/inproc_ranks.h"
#include "comm/testing/rank_runner.h"
#include "fsdp/fully_sharded_data_parallel.h"
#include "gtest/gtest.h"
#include "testing/model.h"

namespace fairscale::fsdp::internal {
namespace {

using comm::OpType;
using comm::testing::Check;
using comm::testing::CountingCommunicator;
using comm::testing::ExpectAllOk;
using comm::testing::RunInprocRanks;

int64_t Splits(const CountingCommunicator& c) { return c.count(OpType::kSplit).ops; }

// A barrier on both groups: they work, and no rank destroys its end of a pair (inproc: the
// group's domain) before every peer has joined it (Split returns on a rank once its own
// communicator exists; the later world collectives of these tests order the other pairs).
absl::Status JoinedEverywhere(const HybridGroups& g) {
  FS_RETURN_IF_ERROR(g.shard->Barrier().Wait());
  return g.replicate->Barrier().Wait();
}

TEST(SharedHybridGroups, OnePairPerWorldAndGroupSizeOwnedByItsHolders) {
  ExpectAllOk(RunInprocRanks(
      4, [](int rank, int, std::shared_ptr<comm::Communicator> inner) -> absl::Status {
        auto world = std::make_shared<CountingCommunicator>(inner);
        FS_ASSIGN_OR_RETURN(HybridGroups a, SharedHybridGroups(world, 2));
        FS_RETURN_IF_ERROR(Check(Splits(*world) == 2, "the first call splits twice"));
        FS_RETURN_IF_ERROR(Check(a.shard->size() == 2 && a.shard->rank() == rank % 2 &&
                                     a.replicate->size() == 2 && a.replicate->rank() == rank / 2,
                                 "groups of 2 consecutive ranks"));
        FS_ASSIGN_OR_RETURN(HybridGroups b, SharedHybridGroups(world, 2));
        FS_RETURN_IF_ERROR(Check(Splits(*world) == 2 && b.shard.get() == a.shard.get() &&
                                     b.replicate.get() == a.replicate.get(),
                                 "the second call shares the first pair"));
        FS_ASSIGN_OR_RETURN(HybridGroups whole, SharedHybridGroups(world, 4));
        FS_RETURN_IF_ERROR(Check(
            Splits(*world) == 4 && whole.shard.get() != a.shard.get() && whole.shard->size() == 4,
            "another group size, another pair"));

        // Either pointer keeps the whole pair; the pair goes with its last holder.
        std::weak_ptr<comm::Communicator> shard = a.shard, replicate = a.replicate;
        a = {};
        b.shard.reset();
        FS_RETURN_IF_ERROR(Check(!shard.expired() && !replicate.expired(), "released too early"));
        b = {};
        FS_RETURN_IF_ERROR(Check(shard.expired() && replicate.expired(), "outlived its holders"));
        FS_ASSIGN_OR_RETURN(HybridGroups again, SharedHybridGroups(world, 2));
        FS_RETURN_IF_ERROR(Check(Splits(*world) == 6, "made anew after the last holder let go"));
        return JoinedEverywhere(again);
      }));
  EXPECT_EQ(LiveSharedHybridGroupsForTesting(), 0u) << "the index kept pairs nobody holds";
}

TEST(SharedHybridGroups, AnotherWorldCommunicatorGetsItsOwnPair) {
  ExpectAllOk(RunInprocRanks(
      2, [](int rank, int, std::shared_ptr<comm::Communicator> world) -> absl::Status {
        FS_ASSIGN_OR_RETURN(std::shared_ptr<comm::Communicator> other, world->Split(0, rank));
        FS_ASSIGN_OR_RETURN(HybridGroups a, SharedHybridGroups(world, 1));
        FS_ASSIGN_OR_RETURN(HybridGroups b, SharedHybridGroups(other, 1));
        FS_RETURN_IF_ERROR(
            Check(a.shard.get() != b.shard.get() && a.replicate.get() != b.replicate.get(),
                  "two world communicators share a pair"));
        return JoinedEverywhere(b);
      }));
  EXPECT_EQ(LiveSharedHybridGroupsForTesting(), 0u);
}

// Through FSDP: the nested units and the root of a model, and a second model built over the same
// world while the first lives, split once; when both models are gone, so are their groups.
TEST(SharedHybridGroups, TheUnitsOfModelsOverOneWorldShareOnePair) {
  ExpectAllOk(
      RunInprocRanks(4, [](int, int, std::shared_ptr<comm::Communicator> inner) -> absl::Status {
        auto world = std::make_shared<CountingCommunicator>(inner);
        const auto opts = FsdpOptions()
                              .sharding_strategy(ShardingStrategy::kHybridShard)
                              .hybrid_shard_group_size(2);
        auto nested = [&] {
          fairscale::testing::NetConfig config;
          config.wrap_block = [&](fairscale::testing::Block block) {
            FullyShardedDataParallel unit(block, world, opts);
            return fairscale::testing::WrappedBlock{
                unit.ptr(), [unit](torch::Tensor x) mutable { return unit(x); }};
          };
          return fairscale::testing::Net(config);
        };
        std::weak_ptr<comm::Communicator> shard;
        {
          FullyShardedDataParallel first(nested(), world, opts);
          FS_RETURN_IF_ERROR(Check(first->fsdp_units().size() == 3, "3 units"));
          FS_RETURN_IF_ERROR(
              Check(Splits(*world) == 2, absl::StrCat("3 units split ", Splits(*world), " times")));
          shard = first->fsdp_units()[0]->shard_communicator();
          FullyShardedDataParallel second(nested(), world, opts);
          FS_RETURN_IF_ERROR(Check(Splits(*world) == 2, "the second model split again"));
          for (FullyShardedDataParallelImpl* unit : second->fsdp_units()) {
            FS_RETURN_IF_ERROR(
                Check(unit->shard_communicator() == shard.lock(), "another shard group"));
          }
          FullyShardedDataParallelImpl* unit = first->fsdp_units()[0];
          FS_RETURN_IF_ERROR(
              JoinedEverywhere({unit->shard_communicator(), unit->replicate_communicator()}));
        }
        return Check(shard.expired(), "the groups outlived both models");
      }));
  EXPECT_EQ(LiveSharedHybridGroupsForTesting(), 0u);
}

}  // namespace
}  // namespace fairscale::fsdp::internal
