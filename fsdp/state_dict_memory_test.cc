// The full state dict's memory, counted exactly: ranks are processes over the tcp backend (so each
// has its own //base:tracking_allocator), FULL_SHARD with 3 units. Building the dict with
// rank0_only must raise a rank's peak tensor memory by exactly one flat parameter's gather buffer
// (padded) plus, on rank 0, the dict's own tensors built so far: never the whole model gathered.
// Also the sharded checkpoint over real processes: saved at 2, loaded at 3, the same parameters.
#include <torch/serialize.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "base/status_matchers.h"
#include "base/tracking_allocator.h"
#include "comm/registry.h"
#include "comm/testing/connect.h"
#include "comm/testing/rank_runner.h"
#include "fsdp/sharded_checkpoint.h"
#include "fsdp/state_dict.h"
#include "fsdp/test_util.h"
#include "fsdp/testing/checkpoint_helpers.h"
#include "gtest/gtest.h"

namespace fairscale::fsdp {
namespace {

using base::testing::IsOk;
using testing::Check;

absl::Status MemoryRank(int rank, int world) {
  base::TrackingCpuAllocator* tracker = base::TrackingCpuAllocator::Install();
  FS_ASSIGN_OR_RETURN(auto comm, comm::testing::ConnectRank("tcp", rank, world, absl::Seconds(20)));
  auto model = testing::MakeModel(comm, ShardingStrategy::kFullShard, /*nested=*/true);
  // Expected, from the layout: flat parameters are gathered one at a time, in unit order.
  int64_t expected_peak = 0, dict = 0, whole = 0;
  for (FullyShardedDataParallelImpl* u : model->fsdp_units()) {
    for (const FlatParamInfo& info : u->flat_param_info()) {
      const int64_t gather = info.padded_numel * 4;
      const int64_t copies = rank == 0 ? info.numel * 4 : 0;
      expected_peak = std::max(expected_peak, dict + gather + copies);
      dict += copies;
      whole += gather;
    }
  }
  const int64_t live = tracker->live_bytes();
  tracker->reset_peak();
  StateDict sd = full_state_dict(model, /*rank0_only=*/true);
  const int64_t peak = tracker->peak_bytes() - live;
  const int64_t kept = tracker->live_bytes() - live;
  FS_RETURN_IF_ERROR(Check(peak == expected_peak,
                           absl::StrCat("rank ", rank, ": peak +", peak, " bytes, expected +",
                                        expected_peak, " (the whole model gathered: ", whole,
                                        ")")));
  FS_RETURN_IF_ERROR(Check(kept == dict, absl::StrCat("rank ", rank, ": the dict holds ", kept,
                                                      " bytes, expected ", dict)));
  FS_RETURN_IF_ERROR(Check(rank != 0 || peak < dict + whole, "not one unit at a time"));
  return comm->Barrier().Wait();
}

TEST(FsdpStateDictProcesses, FullStateDictPeakIsOneFlatParameterAboveSteadyState) {
  const std::vector<absl::Status> statuses = comm::testing::RunProcesses(
      2,
      [](int rank) -> absl::Status {
        try {
          return MemoryRank(rank, 2);
        } catch (const std::exception& e) {
          return absl::InternalError(e.what());
        }
      },
      absl::Seconds(40));
  for (size_t r = 0; r < statuses.size(); ++r) EXPECT_THAT(statuses[r], IsOk()) << "rank " << r;
}

TEST(FsdpStateDictProcesses, ShardedCheckpointSavedAt2LoadsAt3) {
  const std::string dir = testing::TmpPath("processes_ckpt");
  const std::string expected = testing::TmpPath("processes_expected.pt");
  auto run = [&](int world, bool save) {
    return comm::testing::RunProcesses(
        world,
        [&](int rank) -> absl::Status {
          try {
            FS_ASSIGN_OR_RETURN(auto comm,
                                comm::testing::ConnectRank("tcp", rank, world, absl::Seconds(20)));
            auto model = testing::MakeModel(comm, ShardingStrategy::kFullShard, true);
            auto opt = testing::MakeOptimizer(testing::OptimizerKind::kAdam, model->parameters());
            if (save) {
              testing::TrainSteps(model, *opt, 0, 2, rank, world);
              save_sharded_checkpoint(model, opt.get(), dir);
              StateDict sd = full_state_dict(model, true);
              if (rank == 0) save_module_state_dict(sd, expected);
            } else {
              load_sharded_checkpoint(model, opt.get(), dir);
              StateDict sd = full_state_dict(model, true);
              if (rank == 0) {
                testing::Net net;
                torch::load(net, expected);
                for (const auto& item : net->named_parameters()) {
                  FS_RETURN_IF_ERROR(
                      Check(at::equal(item.value(), sd[item.key()]), "loaded " + item.key()));
                }
              }
            }
            return comm->Barrier().Wait();
          } catch (const std::exception& e) {
            return absl::InternalError(e.what());
          }
        },
        absl::Seconds(40));
  };
  for (const auto& s : run(2, true)) EXPECT_THAT(s, IsOk()) << "save";
  for (const auto& s : run(3, false)) EXPECT_THAT(s, IsOk()) << "load";
}

}  // namespace
}  // namespace fairscale::fsdp
