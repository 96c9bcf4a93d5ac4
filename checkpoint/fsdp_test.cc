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
#include <torch/nn/modules/linear.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status_matchers.h"
#include "checkpoint/checkpoint.h"
#include "fsdp/fsdp_options.h"
#include "fsdp/fully_sharded_data_parallel.h"
#include "fsdp/test_util.h"

namespace fairscale::checkpoint {
namespace {

using ::fairscale::base::testing::IsOk;
using fsdp::FsdpOptions;
using fsdp::FullyShardedDataParallel;
using fsdp::ShardingStrategy;
namespace testing = ::fairscale::fsdp::testing;

enum class Order { kPlain, kCheckpointInsideFsdp, kFsdpInsideCheckpoint };

// fc_out(block1(block0(tanh(fc_in(x))))) as fsdp::testing::Net, blocks checkpointed per `order`.
class CkNetImpl : public torch::nn::Module {
 public:
  CkNetImpl(std::shared_ptr<comm::Communicator> nested_comm, FsdpOptions nested_options,
            Order order) {
    fc_in_ = register_module("fc_in", torch::nn::Linear(5, 7));
    testing::InitDeterministic(*fc_in_, "fc_in.");
    for (int i = 0; i < 2; ++i) {
      const std::string name = absl::StrCat("block", i);
      testing::Block block(7, 9);
      testing::InitDeterministic(*block, name + ".");
      switch (order) {
        case Order::kPlain:
          register_module(name, block);
          blocks_.push_back([block](at::Tensor x) mutable { return block(x); });
          break;
        case Order::kCheckpointInsideFsdp: {
          CheckpointWrapper wrapper(block);
          if (nested_comm) {
            FullyShardedDataParallel unit(wrapper, nested_comm, nested_options);
            register_module(name, unit);
            blocks_.push_back([unit](at::Tensor x) mutable { return unit(x); });
          } else {
            register_module(name, wrapper);
            blocks_.push_back([wrapper](at::Tensor x) mutable { return wrapper(x); });
          }
          break;
        }
        case Order::kFsdpInsideCheckpoint: {
          std::function<at::Tensor(const at::Tensor&)> call;
          if (nested_comm) {
            FullyShardedDataParallel unit(block, nested_comm, nested_options);
            register_module(name, unit);
            call = [unit](const at::Tensor& x) mutable { return unit(x); };
          } else {
            register_module(name, block);
            call = [block](const at::Tensor& x) mutable { return block(x); };
          }
          blocks_.push_back([call](at::Tensor x) { return checkpoint(call, x); });
          break;
        }
      }
    }
    fc_out_ = register_module("fc_out", torch::nn::Linear(7, 3));
    testing::InitDeterministic(*fc_out_, "fc_out.");
  }
  at::Tensor forward(at::Tensor x) {
    x = at::tanh(fc_in_(x));
    for (auto& b : blocks_) x = b(x);
    return fc_out_(x);
  }

 private:
  torch::nn::Linear fc_in_{nullptr}, fc_out_{nullptr};
  std::vector<std::function<at::Tensor(at::Tensor)>> blocks_;
};
TORCH_MODULE(CkNet);

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
        const std::vector<absl::Status> statuses = testing::RunRanks(
            world, [&](int rank, int w, std::shared_ptr<comm::Communicator> comm) {
              return testing::RunParityRank(MakeFor(order), MseStep(),
                                            testing::OptimizerKind::kAdam, ref,
                                            FsdpOptions().sharding_strategy(strategy), nested,
                                            rank, w, comm);
            });
        for (size_t r = 0; r < statuses.size(); ++r) {
          EXPECT_THAT(statuses[r], IsOk())
              << what << " " << fsdp::ShardingStrategyName(strategy)
              << (nested ? " nested" : " root only") << " world " << world << " rank " << r;
        }
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
