// FullyShardedDataParallel's edge cases and methods, each checked against a single-process
// reference (same initial weights, the global batch split over 1-4 thread ranks, 1e-5 relative):
// frozen parameters, parameters unused in an iteration, two forwards before one backward, tied
// weights in one unit (and the error when they span units), fewer elements than ranks, buffers
// broadcast from rank 0, several inputs and a tuple output, no_sync, clip_grad_norm_,
// summon_full_params, and gradient buckets under those edge cases and mixed precision.
#include <torch/types.h>

#include <vector>

// Not self-contained: needs torch/types.h and <vector> first.
#include <ATen/ops/tanh.h>
#include <torch/nn/utils/clip_grad.h>

#include <cmath>
#include <limits>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "base/status_matchers.h"
#include "comm/testing/counting_communicator.h"
#include "comm/testing/inproc_ranks.h"
#include "comm/testing/rank_runner.h"
#include "fsdp/fully_sharded_data_parallel.h"
#include "fsdp/test_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "testing/c10_error.h"

namespace fairscale::fsdp {
namespace {

using testing::OptimizerKind;

constexpr ShardingStrategy kStrategies[] = {
    ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp, ShardingStrategy::kNoShard};
constexpr int kSteps = 4;

using comm::testing::Check;
using comm::testing::ExpectAllOk;

// The standard step: MSE of this rank's rows of the global batch.
using testing::MseStep;

// Runs the parity harness for every world size, strategy and (if `nest`) nesting.
template <typename MakeFn, typename StepFn>
void ExpectParity(const std::string& what, MakeFn make, StepFn step_fn, OptimizerKind kind,
                  bool nest, FsdpOptions base = {}, testing::ParityRtol rtol = {}) {
  const std::vector<int> worlds = {1, 2, 3, 4};
  const auto ref = testing::RunReferenceWith(make, step_fn, kind, kSteps);
  for (ShardingStrategy strategy : kStrategies) {
    for (bool nested : nest ? std::vector<bool>{false, true} : std::vector<bool>{false}) {
      for (int world : worlds) {
        ExpectAllOk(
            comm::testing::RunInprocRanks(
                world,
                [&](int rank, int w, std::shared_ptr<comm::Communicator> comm) {
                  FsdpOptions opts = base;
                  opts.sharding_strategy(strategy);
                  return testing::RunParityRank(make, step_fn, kind, ref, opts, nested, rank, w,
                                                comm, rtol);
                }),
            absl::StrCat(what, " ", ShardingStrategyName(strategy), nested ? " nested" : " flat"));
      }
    }
  }
}

auto MakeNet(testing::NetConfig config = {}) {
  return [config](std::shared_ptr<comm::Communicator> comm, FsdpOptions opts) {
    return testing::NestedNet(comm, opts, config);
  };
}

TEST(FsdpEdgeCases, FrozenParameters) {
  testing::NetConfig config;
  config.frozen = {"fc_in.weight", "fc_in.bias", "block0.fc1.weight", "block0.fc1.bias"};
  ExpectParity("frozen", MakeNet(config), MseStep(), OptimizerKind::kAdam, /*nest=*/true);
}

// block1 is skipped on odd steps (a whole unit unused) and "unused" is never called (unused
// parameters inside a used unit: they get zero gradients, which SGD and Adam turn into no
// update, as the reference's missing gradients do; AdamW's decoupled weight decay would not).
TEST(FsdpEdgeCases, ParametersUnusedInAnIteration) {
  testing::NetConfig config;
  config.with_unused = true;
  testing::MseStepSkippingBlockOnOddSteps step_fn;
  for (OptimizerKind kind : {OptimizerKind::kSgdMomentum, OptimizerKind::kAdam}) {
    ExpectParity("unused", MakeNet(config), step_fn, kind, /*nest=*/true);
  }
}

TEST(FsdpEdgeCases, TwoForwardsBeforeOneBackward) {
  auto step_fn = [](auto& model, int step, int rank, int world) {
    testing::Batch b = testing::GlobalBatch(step);
    at::Tensor x = testing::RankRows(b.x, rank, world);
    at::Tensor y = testing::RankRows(b.y, rank, world);
    at::Tensor a = testing::Call<torch::Tensor>(model, x);
    at::Tensor c = testing::Call<torch::Tensor>(model, x * 0.5);
    (testing::Mse(a, y) + testing::Mse(c, y)).backward();
  };
  ExpectParity("two forwards", MakeNet(), step_fn, OptimizerKind::kSgdMomentum, true);
}

// One [4, 4] weight registered twice: as "w" and as "sub.w".
class SubImpl : public torch::nn::Module {
 public:
  explicit SubImpl(at::Tensor w) { register_parameter("w", w); }
  torch::Tensor forward(torch::Tensor x) { return x.matmul(named_parameters()["w"].t()); }
};
TORCH_MODULE(Sub);

class TiedImpl : public torch::nn::Module {
 public:
  TiedImpl(std::shared_ptr<comm::Communicator> nested_comm, FsdpOptions opts) {
    w_ = register_parameter("w", at::empty({4, 4}));
    testing::InitDeterministic(*this, "");
    Sub sub(w_);
    if (nested_comm) {
      register_module("sub", FullyShardedDataParallel(sub, nested_comm, opts));
    } else {
      sub_ = register_module("sub", sub);
    }
  }
  torch::Tensor forward(torch::Tensor x) { return sub_(at::tanh(x.narrow(1, 0, 4).matmul(w_))); }

 private:
  at::Tensor w_;
  Sub sub_{nullptr};
};
TORCH_MODULE(Tied);

TEST(FsdpEdgeCases, TiedWeightsInsideOneUnit) {
  auto make = [](std::shared_ptr<comm::Communicator>, FsdpOptions opts) {
    return Tied(nullptr, opts);
  };
  auto step_fn = [](auto& model, int step, int rank, int world) {
    testing::Batch b = testing::GlobalBatch(step);
    at::Tensor x = testing::RankRows(b.x, rank, world);
    testing::Mse(testing::Call<torch::Tensor>(model, x), x.narrow(1, 1, 4) * 0.3).backward();
  };
  ExpectParity("tied", make, step_fn, OptimizerKind::kAdamW, /*nest=*/false);
}

TEST(FsdpEdgeCases, TiedWeightsAcrossUnitsAreAClearError) {
  ExpectAllOk(
      comm::testing::RunInprocRanks(
          2,
          [](int rank, int world, std::shared_ptr<comm::Communicator> comm) -> absl::Status {
            return fairscale::testing::ExpectError(
                [&] { FullyShardedDataParallel model(Tied(comm, FsdpOptions()), comm); },
                {"parameter 'w' is the same tensor as 'sub.w'", absl::StrCat("rank ", rank, "/2"),
                 "Tied weights"});
          }),
      "tied across units");
}

// 3 elements (weight [3]) over up to 4 ranks: rank 3 holds padding only.
class TinyImpl : public torch::nn::Module {
 public:
  TinyImpl(std::shared_ptr<comm::Communicator> = nullptr, FsdpOptions = {}) {
    s_ = register_parameter("s", at::empty({3}));
    testing::InitDeterministic(*this, "tiny.");
  }
  torch::Tensor forward(torch::Tensor x) { return x.narrow(1, 0, 3) * s_; }

 private:
  at::Tensor s_;
};
TORCH_MODULE(Tiny);

TEST(FsdpEdgeCases, FewerElementsThanRanks) {
  auto make = [](std::shared_ptr<comm::Communicator> c, FsdpOptions o) { return Tiny(c, o); };
  ExpectParity("tiny", make, MseStep(), OptimizerKind::kAdam, /*nest=*/false);
}

class WithBufferImpl : public torch::nn::Module {
 public:
  WithBufferImpl() {
    fc_ = register_module("fc", torch::nn::Linear(2, 2));
    stat_ = register_buffer("stat", at::zeros({5}));
  }
  torch::Tensor forward(torch::Tensor x) { return fc_(x); }
  torch::nn::Linear fc_{nullptr};
  at::Tensor stat_;
};
TORCH_MODULE(WithBuffer);

TEST(FsdpEdgeCases, BuffersAreBroadcastFromRankZero) {
  for (int world = 1; world <= 4; ++world) {
    ExpectAllOk(comm::testing::RunInprocRanks(
                    world,
                    [](int rank, int, std::shared_ptr<comm::Communicator> comm) -> absl::Status {
                      WithBuffer m;
                      // The same parameters on every rank (FSDP checks that), other buffers.
                      {
                        c10::NoGradGuard no_grad;
                        for (auto& p : m->parameters()) p.fill_(0.5);
                      }
                      m->stat_.fill_(rank + 1.0);
                      FullyShardedDataParallel model(m, comm);
                      return Check(m->stat_.eq(1.0).all().item<bool>(),
                                   "buffer not broadcast from rank 0");
                    }),
                "buffers");
  }
}

// forward(a, b) -> (fa(a), fb(b) + fa(a))
class TwoInTwoOutImpl : public torch::nn::Module {
 public:
  TwoInTwoOutImpl(std::shared_ptr<comm::Communicator> = nullptr, FsdpOptions = {}) {
    fa_ = register_module("fa", torch::nn::Linear(5, 3));
    fb_ = register_module("fb", torch::nn::Linear(3, 3));
    testing::InitDeterministic(*this, "");
  }
  std::tuple<torch::Tensor, torch::Tensor> forward(torch::Tensor a, torch::Tensor b) {
    at::Tensor out = fa_(a);
    return {out, fb_(b) + out};
  }

 private:
  torch::nn::Linear fa_{nullptr};
  torch::nn::Linear fb_{nullptr};
};
TORCH_MODULE(TwoInTwoOut);

TEST(FsdpEdgeCases, SeveralInputsAndATupleOutput) {
  auto make = [](std::shared_ptr<comm::Communicator> c, FsdpOptions o) {
    return TwoInTwoOut(c, o);
  };
  auto step_fn = [](auto& model, int step, int rank, int world) {
    testing::Batch b = testing::GlobalBatch(step);
    at::Tensor x = testing::RankRows(b.x, rank, world);
    at::Tensor y = testing::RankRows(b.y, rank, world);
    auto [p, q] = testing::Call<std::tuple<torch::Tensor, torch::Tensor>>(model, x, y * 2);
    (testing::Mse(p, y) + testing::Mse(q, y * 0.5)).backward();
  };
  ExpectParity("tuple", make, step_fn, OptimizerKind::kSgdMomentum, /*nest=*/false);
}

// Two micro-batches per step; the first under no_sync. The sum of the halves' gradients is the
// reference's gradient of the summed loss.
TEST(FsdpMethods, NoSyncAccumulatesLocallyThenReducesOnce) {
  auto step_fn = [](auto& model, int step, int rank, int world) {
    testing::Batch b = testing::GlobalBatch(step);
    at::Tensor x = testing::RankRows(b.x, rank, world);
    at::Tensor y = testing::RankRows(b.y, rank, world);
    if constexpr (testing::IsFsdp<decltype(model)>()) {
      auto* counting =
          dynamic_cast<comm::testing::CountingCommunicator*>(model->communicator().get());
      counting->Reset();
      {
        auto guard = model->no_sync();
        (testing::Mse(model(x), y) * 0.5).backward();
      }
      const auto rs = counting->count(comm::OpType::kReduceScatter).ops +
                      counting->count(comm::OpType::kAllReduce).ops;
      TORCH_CHECK(rs == 0, "no_sync backward reduced ", rs, " times");
      (testing::Mse(model(x * 0.5), y) * 0.5).backward();
    } else {
      (testing::Mse(model(x), y) * 0.5 + testing::Mse(model(x * 0.5), y) * 0.5).backward();
    }
  };
  auto make = MakeNet();
  const auto ref = testing::RunReferenceWith(make, step_fn, OptimizerKind::kSgdMomentum, kSteps);
  for (ShardingStrategy strategy : kStrategies) {
    for (bool nested : {false, true}) {
      for (int world = 1; world <= 4; ++world) {
        ExpectAllOk(comm::testing::RunInprocRanks(
                        world,
                        [&](int rank, int w, std::shared_ptr<comm::Communicator> inner) {
                          auto comm = std::make_shared<comm::testing::CountingCommunicator>(inner);
                          return testing::RunParityRank(
                              make, step_fn, OptimizerKind::kSgdMomentum, ref,
                              FsdpOptions().sharding_strategy(strategy), nested, rank, w, comm);
                        }),
                    absl::StrCat("no_sync ", ShardingStrategyName(strategy)));
      }
    }
  }
}

TEST(FsdpMethods, ClipGradNormMatchesTheGlobalNorm) {
  for (double p : {2.0, 1.0, 3.0, std::numeric_limits<double>::infinity()}) {
    auto step_fn = [p](auto& model, int step, int rank, int world) {
      MseStep()(model, step, rank, world);
      if constexpr (testing::IsFsdp<decltype(model)>()) {
        model->clip_grad_norm_(0.05, p);
      } else {
        const double norm = torch::nn::utils::clip_grad_norm_(model->parameters(), 0.05, p);
        TORCH_CHECK(norm > 0.05, "clipping inactive: norm ", norm);
      }
    };
    ExpectParity(absl::StrCat("clip p=", p), MakeNet(), step_fn, OptimizerKind::kSgdMomentum,
                 /*nest=*/true);
  }
}

// bf16 compute and all-gathers over an f32 master shard, gradients reduced in f32 or bf16,
// against the f32 reference, relative L2 error of each shard. bf16 keeps 8 bits of mantissa
// (0.4%); the small per-rank gradients of this model lose more to cancellation in the bf16
// matmuls (measured at most 4.6e-2, on a 0.03-norm shard), while the f32 master copy keeps the
// parameters much closer (measured at most 1.6e-3 after 4 AdamW steps; both maxima over worlds
// 1-4, every strategy, flat and nested, f32 and bf16 reduction, bucketed or not).
const testing::ParityRtol kMixedRtol(/*grad_rtol=*/6e-2, /*param_rtol=*/5e-3);

TEST(FsdpMixedPrecision, Bf16ComputeWithF32MasterTracksTheReference) {
  for (at::ScalarType reduce : {at::kFloat, at::kBFloat16}) {
    ExpectParity(absl::StrCat("mixed reduce=", c10::toString(reduce)), MakeNet(), MseStep(),
                 OptimizerKind::kAdamW, /*nest=*/true,
                 FsdpOptions().mixed_precision(MixedPrecision()
                                                   .param_dtype(at::kBFloat16)
                                                   .reduce_dtype(reduce)
                                                   .buffer_dtype(at::kBFloat16)),
                 kMixedRtol);
  }
}

// Gradient buckets (bucket_cap_mb) with frozen parameters, a unit skipped on odd steps (its
// reduction joins the bucket at the end of backward) and bf16 reductions (a bucket holds one
// dtype). 1 MiB holds every gradient of the test model.
TEST(FsdpBucketing, FrozenUnusedAndMixedPrecisionKeepParity) {
  testing::NetConfig config;
  config.frozen = {"fc_in.weight", "block0.fc1.bias"};
  config.with_unused = true;
  testing::MseStepSkippingBlockOnOddSteps step_fn;
  ExpectParity("bucketed", MakeNet(config), step_fn, OptimizerKind::kAdam, /*nest=*/true,
               FsdpOptions().bucket_cap_mb(1.0));
  ExpectParity("bucketed bf16", MakeNet(), MseStep(), OptimizerKind::kAdamW, /*nest=*/true,
               FsdpOptions().bucket_cap_mb(1.0).mixed_precision(
                   MixedPrecision().param_dtype(at::kBFloat16).reduce_dtype(at::kBFloat16)),
               kMixedRtol);
}

TEST(FsdpMixedPrecision, WritebackSummonIsAnError) {
  ExpectAllOk(comm::testing::RunInprocRanks(
                  2,
                  [](int rank, int, std::shared_ptr<comm::Communicator> comm) -> absl::Status {
                    FullyShardedDataParallel model(
                        testing::Net(), comm,
                        FsdpOptions().mixed_precision(MixedPrecision().param_dtype(at::kBFloat16)));
                    return fairscale::testing::ExpectError(
                        [&] { auto guard = model->summon_full_params(true); },
                        {"round the master"});
                  }),
              "mixed summon");
}

// Dividing by 2 before the sum and by N/2 after gives the same mean.
TEST(FsdpOptionsTest, GradientDivideFactors) {
  ExpectParity("divide", MakeNet(), MseStep(), OptimizerKind::kSgdMomentum, /*nest=*/true,
               FsdpOptions().gradient_predivide_factor(2.0), 1e-5);
}

// The automatic factors (FairScale's): pre about sqrt(N), a power of 2; post = N / pre. The
// parity tests above run with them (0 = auto is the default).
TEST(FsdpOptionsTest, DefaultPredivideFactor) {
  const std::pair<int, double> expected[] = {{1, 1}, {2, 2}, {3, 2}, {4, 2},  {5, 2},
                                             {6, 4}, {7, 2}, {8, 4}, {16, 4}, {32, 8}};
  for (const auto& [world, pre] : expected) {
    EXPECT_EQ(default_gradient_predivide_factor(world), pre) << "world " << world;
  }
}

TEST(FsdpMethods, SummonFullParamsReadsAndWritesBack) {
  for (ShardingStrategy strategy : kStrategies) {
    for (int world = 1; world <= 4; ++world) {
      ExpectAllOk(
          comm::testing::RunInprocRanks(
              world,
              [&](int rank, int w, std::shared_ptr<comm::Communicator> comm) -> absl::Status {
                const auto opts = FsdpOptions().sharding_strategy(strategy);
                FullyShardedDataParallel model(testing::NestedNet(comm, opts), comm, opts);
                testing::Net plain;
                // The full parameters of every unit, by name.
                auto full_params = [&] {
                  std::map<std::string, at::Tensor> out;
                  for (FullyShardedDataParallelImpl* u : model->fsdp_units()) {
                    for (const auto& item : u->module()->named_parameters()) {
                      if (item.key().find("flat_param") != std::string::npos) continue;
                      out[u->prefix() + item.key()] = item.value();
                    }
                  }
                  return out;
                };
                model(at::ones({2, 5}));  // the root's first forward names the units
                {
                  auto guard = model->summon_full_params(/*writeback=*/false);
                  auto full = full_params();
                  FS_RETURN_IF_ERROR(Check(full.size() == plain->named_parameters().size(),
                                           absl::StrCat(full.size(), " full parameters")));
                  for (const auto& item : plain->named_parameters()) {
                    FS_RETURN_IF_ERROR(
                        testing::ExpectClose(item.key(), full[item.key()], item.value(), 0));
                    full[item.key()].detach().fill_(7.0);  // discarded
                  }
                }
                {
                  auto guard = model->summon_full_params(/*writeback=*/true);
                  for (auto& [name, t] : full_params()) {
                    FS_RETURN_IF_ERROR(Check(t.ne(7.0).all().item<bool>(), name + " kept 7"));
                    t.detach().fill_(0.25);
                  }
                }
                for (const at::Tensor& shard : model->parameters()) {
                  // Padding stays zero; everything else was written back.
                  FS_RETURN_IF_ERROR(
                      Check((shard.eq(0.25) | shard.eq(0.0)).all().item<bool>(), "writeback"));
                }
                at::Tensor out = model(at::ones({2, 5}));
                FS_RETURN_IF_ERROR(Check(out.defined(), "forward after summon"));
                return absl::OkStatus();
              }),
          absl::StrCat("summon ", ShardingStrategyName(strategy)));
    }
  }
}

}  // namespace
}  // namespace fairscale::fsdp
