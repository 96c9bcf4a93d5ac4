// Gradient reductions are completed during backward, not all at the end: when a unit's
// reduction is issued, the one issued before it is waited for and added to its shard's .grad(),
// which frees that unit's full gradient early (without this every unit's full gradient stays
// alive until the end of backward: about one more copy of the parameters at the peak, see
// fsdp/bench/README.md). Observed from a hook on the root's activation that feeds unit0, which
// backward reaches after unit1 and unit0 have issued their reductions: unit1's shard gradient is
// already there, unit0's (the newest, left in flight) is not yet. (Sharded strategies at world
// sizes > 1: unsharded units reduce in place into .grad, and world size 1 reduces nothing.)
//
// Also here: the low-memory setting (backward_prefetch(false), reductions_in_flight(0)) keeps
// parity; unsharded units accumulate straight into the shard's .grad through views, also across
// backward passes without zero_grad and after the gradients were reset to undefined.
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include <map>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "base/status_matchers.h"
#include "comm/testing/inproc_ranks.h"
#include "fsdp/fully_sharded_data_parallel.h"
#include "fsdp/test_util.h"
#include "gtest/gtest.h"
#include "testing/c10_error.h"

namespace fairscale::fsdp {
namespace {

using base::testing::IsOk;

bool HasShardGrad(FullyShardedDataParallel& unit) {
  return unit->parameters(/*recurse=*/false).at(0).grad().defined();
}

testing::Block InitBlock(const std::string& name) {
  testing::Block block(6, 8);
  testing::InitDeterministic(*block, name + ".");
  return block;
}

// fc_out(unit1(unit0(fc_in(x)))), unit0 and unit1 nested FSDP units of Blocks.
class ChainImpl : public torch::nn::Module {
 public:
  ChainImpl(std::shared_ptr<comm::Communicator> comm, FsdpOptions options)
      : unit0(InitBlock("unit0"), comm, options), unit1(InitBlock("unit1"), comm, options) {
    fc_in_ = register_module("fc_in", torch::nn::Linear(4, 6));
    register_module("unit0", unit0);
    register_module("unit1", unit1);
    fc_out_ = register_module("fc_out", torch::nn::Linear(6, 2));
    testing::InitDeterministic(*fc_in_, "fc_in.");
    testing::InitDeterministic(*fc_out_, "fc_out.");
  }
  torch::Tensor forward(torch::Tensor x) {
    x = fc_in_(x);
    x.register_hook([this](const at::Tensor&) {
      seen_unit0 = HasShardGrad(unit0);
      seen_unit1 = HasShardGrad(unit1);
    });
    return fc_out_(unit1(unit0(x)));
  }

  FullyShardedDataParallel unit0, unit1;
  bool seen_unit0 = false, seen_unit1 = false;

 private:
  torch::nn::Linear fc_in_{nullptr}, fc_out_{nullptr};
};
TORCH_MODULE(Chain);

TEST(GradientReductionTest, EarlierUnitsReductionCompletesDuringBackward) {
  for (ShardingStrategy strategy :
       {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp}) {
    for (int world = 2; world <= 3; ++world) {
      std::vector<absl::Status> statuses = comm::testing::RunInprocRanks(
          world, [&](int rank, int w, std::shared_ptr<comm::Communicator> comm) -> absl::Status {
            const auto opts = FsdpOptions().sharding_strategy(strategy);
            Chain chain(comm, opts);
            FullyShardedDataParallel model(chain, comm, opts);
            at::Tensor x = at::sin(at::arange(8 * 4, at::kFloat).view({8, 4}) + rank);
            model(x).pow(2).mean().backward();
            const std::string at =
                absl::StrCat(ShardingStrategyName(strategy), " rank ", rank, "/", w, ": ");
            // The grads start undefined: a defined one is a reduction already completed.
            if (!chain->seen_unit1) {
              return absl::InternalError(at +
                                         "unit1's reduction was not completed when backward "
                                         "reached the input of unit0");
            }
            if (chain->seen_unit0) {
              return absl::InternalError(at +
                                         "unit0's reduction (the newest) was already "
                                         "completed; expected it in flight");
            }
            if (!HasShardGrad(chain->unit0) || !HasShardGrad(chain->unit1)) {
              return absl::InternalError(at + "a shard gradient is missing after backward");
            }
            return absl::OkStatus();
          });
      for (int r = 0; r < world; ++r) {
        EXPECT_THAT(statuses[r], IsOk()) << "world " << world << " rank " << r;
      }
    }
  }
}

void TrainBatch(FullyShardedDataParallel& model, int step, int rank, int world) {
  testing::Batch b = testing::GlobalBatch(step);
  testing::Mse(model(testing::RankRows(b.x, rank, world)), testing::RankRows(b.y, rank, world))
      .backward();
}

TEST(GradientReductionTest, LowMemorySettingMatchesReference) {
  constexpr int kSteps = 4;
  const auto ref = testing::RunReference(testing::OptimizerKind::kAdam, kSteps);
  for (ShardingStrategy strategy : {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp,
                                    ShardingStrategy::kNoShard}) {
    for (int world = 1; world <= 4; ++world) {
      std::vector<absl::Status> statuses = comm::testing::RunInprocRanks(
          world, [&](int rank, int w, std::shared_ptr<comm::Communicator> comm) -> absl::Status {
            const auto opts = FsdpOptions()
                                  .sharding_strategy(strategy)
                                  .backward_prefetch(false)
                                  .reductions_in_flight(0);
            return testing::RunParityRank([](std::shared_ptr<comm::Communicator> c,
                                             FsdpOptions o) { return testing::NestedNet(c, o); },
                                          TrainBatch, testing::OptimizerKind::kAdam, ref, opts,
                                          /*nested=*/true, rank, w, comm);
          });
      for (int r = 0; r < world; ++r) {
        EXPECT_THAT(statuses[r], IsOk())
            << ShardingStrategyName(strategy) << " world " << world << " rank " << r;
      }
    }
  }
}

TEST(GradientReductionTest, NegativeReductionsInFlightIsRejected) {
  std::vector<absl::Status> statuses = comm::testing::RunInprocRanks(
      1, [&](int, int, std::shared_ptr<comm::Communicator> comm) -> absl::Status {
        return fairscale::testing::ExpectError(
            [&] {
              FullyShardedDataParallel model(InitBlock("b"), comm,
                                             FsdpOptions().reductions_in_flight(-1));
            },
            {"reductions_in_flight must be >= 0"});
      });
  EXPECT_THAT(statuses[0], IsOk());
}

// Gradient accumulation without zero_grad (and without no_sync): the second backward adds to
// what the first one reduced, on every strategy and world size, so two backward passes of the
// same batch give twice the reference gradient. Then the gradients are reset to undefined (what
// set_to_none does) and a third pass gives the reference gradient again.
TEST(GradientReductionTest, AccumulatesAcrossBackwardAndSurvivesGradReset) {
  const auto ref = testing::RunReference(testing::OptimizerKind::kSgdMomentum, 1);
  std::map<std::string, at::Tensor> twice;
  for (const auto& [name, g] : ref[0].grads) twice[name] = g * 2;
  for (ShardingStrategy strategy : {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp,
                                    ShardingStrategy::kNoShard}) {
    for (int world = 1; world <= 4; ++world) {
      std::vector<absl::Status> statuses = comm::testing::RunInprocRanks(
          world, [&](int rank, int w, std::shared_ptr<comm::Communicator> comm) -> absl::Status {
            const auto opts = FsdpOptions().sharding_strategy(strategy);
            FullyShardedDataParallel model(testing::NestedNet(comm, opts), comm, opts);
            const std::string at =
                absl::StrCat(ShardingStrategyName(strategy), " rank ", rank, "/", w, ": ");
            TrainBatch(model, 0, rank, w);
            FS_RETURN_IF_ERROR(
                testing::CheckShards(model, ref[0].grads, true, at + "one pass", 1e-5));
            TrainBatch(model, 0, rank, w);
            FS_RETURN_IF_ERROR(testing::CheckShards(model, twice, true, at + "two passes", 1e-5));
            for (const at::Tensor& p : model->parameters()) {
              at::Tensor(p).mutable_grad() = at::Tensor();
            }
            TrainBatch(model, 0, rank, w);
            FS_RETURN_IF_ERROR(
                testing::CheckShards(model, ref[0].grads, true, at + "after reset", 1e-5));
            // Unsharded units: the original parameters' gradients are views of a flat one.
            if (strategy == ShardingStrategy::kNoShard || w == 1) {
              std::vector<at::Tensor> flat_grads;
              for (FullyShardedDataParallelImpl* u : model->fsdp_units()) {
                for (const at::Tensor& p : u->parameters(/*recurse=*/false)) {
                  flat_grads.push_back(p.grad());
                }
              }
              for (FullyShardedDataParallelImpl* u : model->fsdp_units()) {
                for (const auto& item : u->module()->named_parameters()) {
                  const at::Tensor& g = item.value().grad();
                  bool view = false;
                  for (const at::Tensor& f : flat_grads) {
                    view = view || (g.defined() && f.defined() && g.is_alias_of(f));
                  }
                  if (!view) {
                    return absl::InternalError(at + "gradient of '" + item.key() +
                                               "' is not a view of a flat gradient");
                  }
                }
              }
            }
            return absl::OkStatus();
          });
      for (int r = 0; r < world; ++r) {
        EXPECT_THAT(statuses[r], IsOk())
            << ShardingStrategyName(strategy) << " world " << world << " rank " << r;
      }
    }
  }
}

}  // namespace
}  // namespace fairscale::fsdp
