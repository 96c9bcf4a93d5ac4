// AdaScaleFsdp: AdaScale over fsdp::FullyShardedDataParallel against the single-process
// simulation of N workers (test_util.h): world sizes 1-4, with gradient accumulation (the
// step's earlier backward passes under no_sync()) and without, the flat and the per-parameter
// layout, W and b in one unit (one param group, flat layout) or b in a nested unit, kFullShard,
// kShardGradOp and kNoShard, SGD with momentum and Adam. Parameters, per-group and overall gains
// and progress within 1e-6 at every step. Then the inputs the adapter refuses.
#include "adascale/fsdp_adapter.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "adascale/test_util.h"
#include "base/status_macros.h"
#include "comm/testing/inproc_ranks.h"
#include "comm/testing/rank_runner.h"
#include "testing/c10_error.h"

namespace fairscale::adascale {
namespace {

using comm::testing::Check;
using comm::testing::ExpectAllOk;
using comm::testing::RunInprocRanks;
using fairscale::testing::CatchErrors;
using fairscale::testing::ExpectError;
using testing::Kind;

// y + b.
class BiasImpl : public torch::nn::Module {
 public:
  BiasImpl() { b = register_parameter("b", testing::InitialB()); }
  at::Tensor forward(at::Tensor y) { return y + b; }
  at::Tensor b;
};
TORCH_MODULE(Bias);

// x W^T + b (test_util.h's model), b in a child that is a nested FSDP unit when nested_comm.
class LinearImpl : public torch::nn::Module {
 public:
  LinearImpl(std::shared_ptr<comm::Communicator> nested_comm, fsdp::FsdpOptions options) {
    w = register_parameter("w", testing::InitialW());
    if (nested_comm) {
      nested = register_module("bias", fsdp::FullyShardedDataParallel(bias, nested_comm, options));
    } else {
      register_module("bias", bias);
    }
  }
  at::Tensor forward(at::Tensor x) {
    at::Tensor y = torch::matmul(x, w.t());
    return nested ? nested(y) : bias(y);
  }
  at::Tensor w;
  Bias bias;
  fsdp::FullyShardedDataParallel nested{nullptr};
};
TORCH_MODULE(Linear);

struct FsdpCase {
  Kind kind;
  int world;
  int accum;
  bool flatten = true;
  bool nested = true;
  fsdp::ShardingStrategy strategy = fsdp::ShardingStrategy::kFullShard;
};

// The model, wrapped, and the param groups AdaScale scales: {W}, {b} (one each per unit, or
// the parameters themselves per-parameter), or {W, b} when both are in one flat unit.
struct Wrapped {
  Linear inner{nullptr};
  fsdp::FullyShardedDataParallel model{nullptr};
  std::vector<std::vector<at::Tensor>> groups;
};

Wrapped Wrap(const std::shared_ptr<comm::Communicator>& comm, const fsdp::FsdpOptions& opts,
             bool nested) {
  Wrapped out;
  out.inner = Linear(nested ? comm : nullptr, opts);
  out.model = fsdp::FullyShardedDataParallel(out.inner, comm, opts);
  if (!opts.flatten_parameters()) {
    out.groups = {{out.inner->w}, {out.inner->bias->b}};
  } else if (nested) {
    out.groups = {{out.model->flat_shards().at(0).shard},
                  {out.model->fsdp_units().at(1)->flat_shards().at(0).shard}};
  } else {
    out.groups = {{out.model->flat_shards().at(0).shard}};
  }
  return out;
}

bool OneGroup(const FsdpCase& c) { return c.flatten && !c.nested; }

class AdaScaleFsdpTest : public ::testing::TestWithParam<FsdpCase> {};

TEST_P(AdaScaleFsdpTest, MatchesSingleProcessSimulation) {
  const FsdpCase c = GetParam();
  // SGD: the default smoothing (1 - n/1000); Adam: 0.5, so that the average moves visibly.
  const double smoothing = c.kind == Kind::kSgd ? 1.0 - c.world * c.accum / 1000.0 : 0.5;
  constexpr int kSteps = 5;
  const std::vector<testing::StepRecord> ref =
      testing::Simulate(c.kind, c.world, c.accum, smoothing, kSteps, true, OneGroup(c));
  std::vector<double> max_err(c.world, 0.0);
  ExpectAllOk(RunInprocRanks(
      c.world, [&](int rank, int, std::shared_ptr<comm::Communicator> comm) -> absl::Status {
        return CatchErrors([&]() -> absl::Status {
          auto opts =
              fsdp::FsdpOptions().sharding_strategy(c.strategy).flatten_parameters(c.flatten);
          if (fsdp::IsHybrid(c.strategy)) opts.hybrid_shard_group_size(2);
          Wrapped w = Wrap(comm, opts, c.nested);
          auto opt = testing::MakeInner(c.kind, testing::MakeGroups(c.kind, w.groups));
          AdaScaleOptions options = AdaScaleFsdp::options_for(
              w.model, AdaScaleOptions().num_gradients_to_accumulate(c.accum));
          if (c.kind == Kind::kAdam) options.smoothing(smoothing);
          AdaScale ada(*opt, comm, options);
          AdaScaleFsdp adapter(w.model, ada);
          for (int step = 0; step < kSteps; ++step) {
            ada.zero_grad();
            for (int micro = 0; micro < c.accum; ++micro) {
              const testing::Batch d = testing::Data(step, rank, micro);
              auto backward = [&] { torch::mse_loss(w.model(d.x), d.y).backward(); };
              if (ada.is_accumulation_step()) {
                auto no_sync = w.model->no_sync();
                backward();
              } else {
                backward();
              }
            }
            ada.step();
            at::Tensor weight, bias;
            {
              auto full = w.model->summon_full_params(/*writeback=*/false);
              weight = w.inner->w.detach().clone();
              bias = w.inner->bias->b.detach().clone();
            }
            FS_RETURN_IF_ERROR(testing::CompareStep(absl::StrCat("rank ", rank, " step ", step),
                                                    weight, bias, ada, ref[step], 1e-6,
                                                    &max_err[rank]));
          }
          return absl::OkStatus();
        });
      }));
  double worst = 0;
  for (double e : max_err) worst = std::max(worst, e);
  std::cout << "[measured] FSDP " << fsdp::ShardingStrategyName(c.strategy) << " world "
            << c.world << " accum " << c.accum << " " << testing::KindName(c.kind)
            << (c.flatten ? " flat" : " per-parameter") << (c.nested ? " nested" : "")
            << ": max |error| " << worst << " (params, gains, progress); final gain "
            << ref.back().gain << "\n";
  EXPECT_GT(ref.back().gain, 1.0 + 1e-3);  // the scaling is exercised
}

using fsdp::ShardingStrategy;
INSTANTIATE_TEST_SUITE_P(
    Fsdp, AdaScaleFsdpTest,
    ::testing::Values(FsdpCase{Kind::kSgd, 1, 2, true, true},
                      FsdpCase{Kind::kSgd, 2, 1, true, false},
                      FsdpCase{Kind::kSgd, 2, 2, false, true},
                      FsdpCase{Kind::kSgd, 3, 1, true, true},
                      FsdpCase{Kind::kSgd, 3, 2, false, false, ShardingStrategy::kShardGradOp},
                      FsdpCase{Kind::kSgd, 4, 2, true, true},
                      FsdpCase{Kind::kSgd, 4, 1, false, true},
                      FsdpCase{Kind::kSgd, 2, 2, true, true, ShardingStrategy::kNoShard},
                      FsdpCase{Kind::kAdam, 1, 2, false, false},
                      FsdpCase{Kind::kAdam, 2, 2, true, true},
                      FsdpCase{Kind::kAdam, 3, 2, false, true},
                      FsdpCase{Kind::kAdam, 4, 1, true, false},
                      FsdpCase{Kind::kAdam, 4, 2, false, true, ShardingStrategy::kNoShard},
                      FsdpCase{Kind::kAdam, 3, 2, true, true, ShardingStrategy::kShardGradOp},
                      FsdpCase{Kind::kSgd, 4, 1, true, true, ShardingStrategy::kHybridShard},
                      FsdpCase{Kind::kSgd, 4, 2, false, true, ShardingStrategy::kHybridShard},
                      FsdpCase{Kind::kAdam, 4, 2, true, false,
                               ShardingStrategy::kHybridShardZero2}),
    [](const ::testing::TestParamInfo<FsdpCase>& info) {
      const FsdpCase& c = info.param;
      std::string strategy = fsdp::ShardingStrategyName(c.strategy);
      strategy.erase(std::remove(strategy.begin(), strategy.end(), '_'), strategy.end());
      return absl::StrCat(testing::KindName(c.kind), "World", c.world, "Accum", c.accum,
                          c.flatten ? "Flat" : "PerParam", c.nested ? "Nested" : "", strategy);
    });

// ---- bad input ----------------------------------------------------------------------------

TEST(AdaScaleFsdpErrorTest, RefusesWhatItCannotMeasureExactly) {
  ExpectAllOk(RunInprocRanks(
      2, [&](int rank, int, std::shared_ptr<comm::Communicator> comm) -> absl::Status {
        const std::string who = absl::StrCat("adascale::AdaScaleFsdp rank ", rank, "/2");
        Wrapped w = Wrap(comm, fsdp::FsdpOptions(), /*nested=*/true);
        auto opt = testing::MakeInner(Kind::kSgd, testing::MakeGroups(Kind::kSgd, w.groups));
        // Sharded model, AdaScale expecting whole gradients.
        AdaScale plain(*opt, comm);
        FS_RETURN_IF_ERROR(ExpectError([&] { AdaScaleFsdp(w.model, plain); },
                                       {who, "INVALID_ARGUMENT", "sharded_gradients(true)"}));
        AdaScale ada(*opt, comm, AdaScaleOptions().sharded_gradients(true));
        {
          AdaScaleFsdp adapter(w.model, ada);
          FS_RETURN_IF_ERROR(ExpectError([&] { AdaScaleFsdp(w.model, ada); },
                                         {who, "INVALID_ARGUMENT", "local gradient hook already",
                                          "one adapter per model"}));
          // One backward too many for num_gradients_to_accumulate 1: raised out of backward.
          const testing::Batch d = testing::Data(0, rank, 0);
          torch::mse_loss(w.model(d.x), d.y).backward();
          FS_RETURN_IF_ERROR(
              ExpectError([&] { torch::mse_loss(w.model(d.x), d.y).backward(); },
                          {"adascale::AdaScale::accumulate_local_grad_sqr", "call step()"}));
        }
        // The adapter is gone with its hook: a new one attaches.
        FS_RETURN_IF_ERROR(Check(!w.model->has_local_grad_hook(), "the hook stayed"));

        // A param group holding a tensor the model does not shard.
        at::Tensor stranger = torch::zeros({2}, torch::requires_grad());
        auto groups = w.groups;
        groups[1].push_back(stranger);
        auto opt2 = testing::MakeInner(Kind::kSgd, testing::MakeGroups(Kind::kSgd, groups));
        AdaScale ada2(*opt2, comm, AdaScaleOptions().sharded_gradients(true));
        FS_RETURN_IF_ERROR(ExpectError(
            [&] { AdaScaleFsdp(w.model, ada2); },
            {who, "INVALID_ARGUMENT", "param group 1 tensor 1 (shape [2])",
             "not a trainable tensor of the FSDP model"}));

        // Divide factors that do not make the mean.
        Wrapped sum = Wrap(comm, fsdp::FsdpOptions().gradient_postdivide_factor(1.0), false);
        auto opt3 = testing::MakeInner(Kind::kSgd, testing::MakeGroups(Kind::kSgd, sum.groups));
        AdaScale ada3(*opt3, comm, AdaScaleOptions().sharded_gradients(true));
        return ExpectError([&] { AdaScaleFsdp(sum.model, ada3); },
                           {who, "gradient_predivide_factor * gradient_postdivide_factor = 1",
                            "not the world size 2"});
      }));
  // HYBRID_SHARD, 2 shard groups of 2 ranks, without gradient_replicas(2): each shard's square
  // would be counted twice.
  ExpectAllOk(RunInprocRanks(
      4, [&](int, int, std::shared_ptr<comm::Communicator> comm) -> absl::Status {
        const auto opts = fsdp::FsdpOptions()
                              .sharding_strategy(fsdp::ShardingStrategy::kHybridShard)
                              .hybrid_shard_group_size(2);
        Wrapped w = Wrap(comm, opts, /*nested=*/false);
        auto opt = testing::MakeInner(Kind::kSgd, testing::MakeGroups(Kind::kSgd, w.groups));
        AdaScale ada(*opt, comm, AdaScaleOptions().sharded_gradients(true));
        FS_RETURN_IF_ERROR(ExpectError([&] { AdaScaleFsdp(w.model, ada); },
                                       {"INVALID_ARGUMENT", "held by 2 rank(s) (HYBRID_SHARD",
                                        "gradient_replicas(2)"}));
        AdaScale bad(*opt, comm, AdaScaleOptions().sharded_gradients(true).gradient_replicas(2));
        return Check(bad.gradient_replicas() == 2, "gradient_replicas");
      }));
}

}  // namespace
}  // namespace fairscale::adascale
