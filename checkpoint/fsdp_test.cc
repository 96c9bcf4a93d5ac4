// Checkpointing composed with FSDP, both orders, against the plain single-process model (fsdp's
// parity harness: ranks as threads over //comm/inproc, 1-4 ranks, every sharding strategy,
// gradients and parameters after each of 4 steps within 1e-5):
//   - checkpoint inside FSDP: each block is FullyShardedDataParallel(CheckpointWrapper(block));
//     the unit's pre-backward hook (on its outputs) gathers the parameters before the recompute,
//     whose inner backward fires the AccumulateGrad post hooks that reduce-scatter.
//   - FSDP inside checkpoint: each block is checkpoint(FullyShardedDataParallel(block)); the
//     recompute runs the unit's forward again (gathering again), its inner backward runs the
//     unit's backward hooks.
// Both also with the root alone (nested = false: the checkpointed blocks are plain modules inside
// the root unit).
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/nn/module.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "checkpoint/checkpoint.h"
#include "comm/testing/inproc_ranks.h"
#include "comm/testing/rank_runner.h"
#include "fsdp/fsdp_options.h"
#include "fsdp/fully_sharded_data_parallel.h"
#include "fsdp/test_util.h"

namespace fairscale::checkpoint {
namespace {

using fsdp::FsdpOptions;
using fsdp::FullyShardedDataParallel;
using fsdp::ShardingStrategy;
namespace testing = ::fairscale::fsdp::testing;

enum class Order { kPlain, kCheckpointInsideFsdp, kFsdpInsideCheckpoint };

// The shared test Net with its blocks checkpointed per `order`, each inside or around its own
// FSDP unit when nested_comm is set (kPlain: the plain Net, the reference).
testing::Net CkNet(std::shared_ptr<comm::Communicator> nested_comm, FsdpOptions nested_options,
                   Order order) {
  testing::NetConfig config;
  switch (order) {
    case Order::kPlain:
      break;
    case Order::kCheckpointInsideFsdp:
      config.wrap_block = [=](testing::Block block) -> fairscale::testing::WrappedBlock {
        CheckpointWrapper wrapper(block);
        if (!nested_comm) {
          return {wrapper.ptr(), [wrapper](at::Tensor x) mutable { return wrapper(x); }};
        }
        FullyShardedDataParallel unit(wrapper, nested_comm, nested_options);
        return {unit.ptr(), [unit](at::Tensor x) mutable { return unit(x); }};
      };
      break;
    case Order::kFsdpInsideCheckpoint:
      config.wrap_block = [=](testing::Block block) -> fairscale::testing::WrappedBlock {
        std::shared_ptr<torch::nn::Module> module = block.ptr();
        std::function<at::Tensor(const at::Tensor&)> call = [block](const at::Tensor& x) mutable {
          return block(x);
        };
        if (nested_comm) {
          FullyShardedDataParallel unit(block, nested_comm, nested_options);
          module = unit.ptr();
          call = [unit](const at::Tensor& x) mutable { return unit(x); };
        }
        return {module, [call](at::Tensor x) { return checkpoint(call, x); }};
      };
      break;
  }
  return testing::Net(config);
}

auto MakeFor(Order order) {
  return [order](std::shared_ptr<comm::Communicator> comm, FsdpOptions opts) {
    return CkNet(std::move(comm), opts, order);
  };
}

struct MseStep {
  template <typename M>
  void operator()(M& model, int step, int rank, int world) const {
    testing::Batch b = testing::GlobalBatch(step);
    testing::Mse(testing::Call<at::Tensor>(model, testing::RankRows(b.x, rank, world)),
                 testing::RankRows(b.y, rank, world))
        .backward();
  }
};

void ExpectParity(Order order, const std::string& what) {
  const auto ref = testing::RunReferenceWith(MakeFor(Order::kPlain), MseStep(),
                                             testing::OptimizerKind::kAdam, /*steps=*/4);
  for (ShardingStrategy strategy : {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp,
                                    ShardingStrategy::kNoShard}) {
    for (bool nested : {false, true}) {
      for (int world = 1; world <= 4; ++world) {
        comm::testing::ExpectAllOk(
            comm::testing::RunInprocRanks(
                world,
                [&](int rank, int w, std::shared_ptr<comm::Communicator> comm) {
                  return testing::RunParityRank(
                      MakeFor(order), MseStep(), testing::OptimizerKind::kAdam, ref,
                      FsdpOptions().sharding_strategy(strategy), nested, rank, w, comm);
                }),
            absl::StrCat(what, " ", fsdp::ShardingStrategyName(strategy),
                         nested ? " nested" : " root only"));
      }
    }
  }
}

TEST(CheckpointFsdpTest, CheckpointInsideFsdpMatchesThePlainModel) {
  ExpectParity(Order::kCheckpointInsideFsdp, "checkpoint inside FSDP");
}

TEST(CheckpointFsdpTest, FsdpInsideCheckpointMatchesThePlainModel) {
  ExpectParity(Order::kFsdpInsideCheckpoint, "FSDP inside checkpoint");
}

}  // namespace
}  // namespace fairscale::checkpoint
