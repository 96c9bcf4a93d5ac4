// OSS + ShardedDataParallel over the real network stack: ranks are separate processes
// (comm::testing::RunProcesses) talking over the "tcp" backend on 127.0.0.1. The inproc tests
// cover the algorithm; this one catches what only a real transport and separate address spaces
// show (buffer lifetimes across asynchronous reduces issued from backward hooks, the order of
// collectives between processes, the point-to-point consolidation). Adam, both partition modes,
// 2 and 3 ranks, 5 steps against the single-process reference, then a consolidated checkpoint
// that a plain optimizer continues from.
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "comm/registry.h"
#include "comm/testing/connect.h"
#include "comm/testing/rank_runner.h"
#include "gtest/gtest.h"
#include "oss/oss.h"
#include "oss/sharded_data_parallel.h"
#include "oss/test_util.h"
#include "testing/model.h"

namespace fairscale::oss {
namespace {

using testing::Kind;

constexpr int kSteps = 5;

absl::Status RunRank(int rank, int world, PartitionMode mode, const testing::Trajectory& ref) {
  FS_ASSIGN_OR_RETURN(std::shared_ptr<comm::Communicator> comm,
                      comm::testing::ConnectRank("tcp", rank, world, absl::Seconds(20)));
  testing::Net net;
  auto opt = std::make_shared<OSS>(testing::TwoGroups(net, Kind::kAdam),
                                   testing::Factory(Kind::kAdam), comm,
                                   OssOptions().partition(mode).bucket_numel(64));
  ShardedDataParallel model(torch::nn::AnyModule(net), opt,
                            ShardedDataParallelOptions().reduce_bucket_numel(64));
  for (int step = 0; step < kSteps; ++step) {
    opt->zero_grad();
    fairscale::testing::Batch b = fairscale::testing::GlobalBatch(step);
    fairscale::testing::Mse(model->forward(fairscale::testing::RankRows(b.x, rank, world)),
                            fairscale::testing::RankRows(b.y, rank, world))
        .backward();
    opt->clip_grad_norm(1e3);  // a collective in the loop too (never clips here)
    opt->step();
    FS_RETURN_IF_ERROR(testing::ExpectParams(absl::StrCat("step ", step, " rank ", rank), net,
                                             ref.params[step], 1e-6));
  }
  opt->consolidate_state_dict(world - 1);
  if (rank == world - 1) {
    const std::string bytes = testing::SaveToBytes(*opt);
    const std::map<std::string, at::Tensor> params = testing::Snapshot(net);
    // A plain Adam continues from the checkpoint exactly as the reference does.
    const testing::Trajectory more =
        testing::RunReference(Kind::kAdam, kSteps, kSteps + 2, false, &params, &bytes);
    testing::Net check;
    for (int s = 0; s < 2; ++s) {
      testing::Restore(check, more.params[s]);
      FS_RETURN_IF_ERROR(testing::ExpectParams(absl::StrCat("continued step ", kSteps + s), check,
                                               ref.params[kSteps + s], 1e-6));
    }
  }
  // No rank tears down its sockets while a peer may still be finishing its last operation.
  return comm->Barrier().Wait();
}

TEST(TcpProcessTest, ShardedDataParallelAdamMatchesReference) {
  // Runs again in every child process (see rank_runner.h): cheap and without side effects.
  const testing::Trajectory ref = testing::RunReference(Kind::kAdam, 0, kSteps + 2, false);
  for (PartitionMode mode : {PartitionMode::kGreedy, PartitionMode::kFlat}) {
    for (int world : {2, 3}) {
      // RunProcesses turns an exception into the rank's kInternal status.
      comm::testing::ExpectAllOk(
          comm::testing::RunProcesses(
              world, [&](int rank) { return RunRank(rank, world, mode, ref); }, absl::Seconds(40)),
          absl::StrCat("world ", world));
    }
  }
}

}  // namespace
}  // namespace fairscale::oss
