// FullyShardedDataParallel over the real network stack: ranks are separate processes
// (comm::testing::RunProcesses) talking over the "tcp" backend on 127.0.0.1. The inproc parity
// tests cover the algorithm; this one catches what only a real transport and real address spaces
// show (buffer lifetimes across async work, ordering of collectives between processes). FULL_SHARD
// with nested units, Adam, 5 steps, 2 and 3 ranks; losses, gradient shards and parameter shards
// must match the single-process reference within 1e-5.
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "comm/registry.h"
#include "comm/testing/connect.h"
#include "comm/testing/rank_runner.h"
#include "fsdp/fully_sharded_data_parallel.h"
#include "fsdp/test_util.h"
#include "gtest/gtest.h"

namespace fairscale::fsdp {
namespace {

using testing::OptimizerKind;

constexpr int kSteps = 5;
constexpr double kRtol = 1e-5;

absl::Status RunRank(int rank, int world, const std::vector<testing::ReferenceStep>& ref) {
  FS_ASSIGN_OR_RETURN(std::shared_ptr<comm::Communicator> comm,
                      comm::testing::ConnectRank("tcp", rank, world, absl::Seconds(20)));
  const auto opts = FsdpOptions().sharding_strategy(ShardingStrategy::kFullShard);
  FullyShardedDataParallel model(testing::NestedNet(comm, opts), comm, opts);
  if (model->fsdp_units().size() != 3) {
    return absl::InternalError(
        absl::StrCat("expected 3 units (root + 2 nested), got ", model->fsdp_units().size()));
  }
  auto opt = testing::MakeOptimizer(OptimizerKind::kAdam, model->parameters());
  FS_RETURN_IF_ERROR(testing::TrainMatchesReference(model, *opt, ref, rank, world, kRtol));
  // No rank tears down its sockets while a peer may still be finishing its last collective.
  return comm->Barrier().Wait();
}

TEST(TcpProcessTest, FullShardNestedAdamMatchesReference) {
  // Runs again in every child process (see rank_runner.h): cheap and without side effects.
  const std::vector<testing::ReferenceStep> ref =
      testing::RunReference(OptimizerKind::kAdam, kSteps);
  for (int world : {2, 3}) {
    // RunProcesses turns an exception into the rank's kInternal status.
    comm::testing::ExpectAllOk(
        comm::testing::RunProcesses(
            world, [&](int rank) { return RunRank(rank, world, ref); }, absl::Seconds(40)),
        absl::StrCat("world ", world));
  }
}

}  // namespace
}  // namespace fairscale::fsdp
