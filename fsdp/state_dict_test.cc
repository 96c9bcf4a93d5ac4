// Full state dicts (state_dict.h): names, order and values against a plain single-process model
// trained the same way; loading into shards at other world sizes; errors that name the tensor and
// leave the model alone; the full optimizer state against a plain optimizer's, re-sharded at other
// world sizes, and loaded by plain LibTorch (torch::load) into an unwrapped model and optimizer.
#include <ATen/ops/zeros.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/sin.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/serialize.h>

#include <cstdlib>
#include <mutex>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "base/status_matchers.h"
#include "comm/testing/inproc_ranks.h"
#include "fsdp/internal/optim_state.h"
#include "fsdp/state_dict.h"
#include "fsdp/test_util.h"
#include "fsdp/testing/checkpoint_helpers.h"
#include "gtest/gtest.h"

namespace fairscale::fsdp {
namespace {

using testing::OptimizerKind;

using testing::Check;
using testing::ExpectAllOk;
using testing::ExpectError;
using testing::ExpectReferenceLosses;
using testing::MakeModel;
using testing::TmpPath;
using testing::TrainSteps;

TEST(FsdpFullStateDict, UnwrappedNamesAndValuesAtEveryWorldSize) {
  const auto ref = testing::RunReference(OptimizerKind::kAdam, 3);
  testing::Net plain;
  const std::vector<std::string> names = plain->named_parameters().keys();
  struct Case {
    ShardingStrategy strategy;
    bool nested;
  };
  for (const Case c : {Case{ShardingStrategy::kFullShard, true},
                       Case{ShardingStrategy::kShardGradOp, false},
                       Case{ShardingStrategy::kNoShard, true}}) {
    for (int world = 1; world <= 4; ++world) {
      const bool rank0_only = world % 2 == 0;
      ExpectAllOk(
          comm::testing::RunInprocRanks(
              world,
              [&](int rank, int w, std::shared_ptr<comm::Communicator> comm) -> absl::Status {
                auto model = MakeModel(comm, c.strategy, c.nested);
                auto opt = testing::MakeOptimizer(OptimizerKind::kAdam, model->parameters());
                TrainSteps(model, *opt, 0, 3, rank, w);
                const StateDict sd = full_state_dict(model, rank0_only);
                // Training continues normally after it (nothing left gathered or changed).
                TrainSteps(model, *opt, 3, 4, rank, w);
                if (rank0_only && rank != 0) return Check(sd.is_empty(), "rank0_only: not empty");
                FS_RETURN_IF_ERROR(Check(sd.keys() == names, "names or order differ"));
                for (const auto& item : sd) {
                  FS_RETURN_IF_ERROR(testing::ExpectClose(item.key(), item.value(),
                                                          ref[2].params.at(item.key()), 1e-5));
                  FS_RETURN_IF_ERROR(
                      Check(item.value().device().is_cpu() && !item.value().requires_grad(),
                            "a detached CPU tensor"));
                }
                if (rank != 0) return absl::OkStatus();
                // Plain LibTorch loads the file into the unwrapped module.
                const std::string path =
                    TmpPath(absl::StrCat("full_", ShardingStrategyName(c.strategy), w, ".pt"));
                save_module_state_dict(sd, path);
                testing::Net net;
                torch::load(net, path);
                for (const auto& item : net->named_parameters()) {
                  FS_RETURN_IF_ERROR(Check(at::equal(item.value(), sd[item.key()]),
                                           "torch::load: " + item.key()));
                }
                return absl::OkStatus();
              }),
          ShardingStrategyName(c.strategy));
    }
  }
}

TEST(FsdpFullStateDict, LoadsIntoShardsAtAnyWorldSize) {
  const auto ref = testing::RunReference(OptimizerKind::kSgdMomentum, 2);
  StateDict sd;
  for (const auto& [name, t] : ref[1].params) sd.insert(name, t);
  for (int world : {1, 2, 3}) {
    ExpectAllOk(comm::testing::RunInprocRanks(world,
                                  [&](int rank, int w, std::shared_ptr<comm::Communicator> comm) {
                                    auto model = MakeModel(comm, ShardingStrategy::kFullShard,
                                                           /*nested=*/w != 2);
                                    load_full_state_dict(model, sd);
                                    return testing::CheckShards(model, ref[1].params, false,
                                                                "loaded", 0.0);
                                  }),
                "load");
  }
}

TEST(FsdpFullStateDict, LoadsFromRank0Only) {
  const auto ref = testing::RunReference(OptimizerKind::kAdam, 2);
  StateDict sd;
  for (const auto& [name, t] : ref[1].params) sd.insert(name, t);
  ExpectAllOk(comm::testing::RunInprocRanks(3,
                                [&](int rank, int, std::shared_ptr<comm::Communicator> comm) {
                                  auto model = MakeModel(comm, ShardingStrategy::kFullShard, true);
                                  load_full_state_dict(model, rank == 0 ? sd : StateDict(),
                                                       /*from_rank0=*/true);
                                  return testing::CheckShards(model, ref[1].params, false,
                                                              "loaded from rank 0", 0.0);
                                }),
              "from rank 0");
  StateDict bad;
  for (const auto& item : sd) {
    if (item.key() != "block0.fc2.weight") bad.insert(item.key(), item.value());
  }
  ExpectAllOk(
      comm::testing::RunInprocRanks(
          3,
          [&](int rank, int, std::shared_ptr<comm::Communicator> comm) -> absl::Status {
            auto model = MakeModel(comm, ShardingStrategy::kFullShard, true);
            const LocalStateDict before = model->local_state_dict();
            FS_RETURN_IF_ERROR(ExpectError(
                [&] { load_full_state_dict(model, rank == 0 ? bad : StateDict(), true); },
                rank == 0 ? std::vector<std::string>{"INVALID_ARGUMENT",
                                                     "'block0.fc2.weight' is missing"}
                          : std::vector<std::string>{"rank(s) 0 failed"}));
            const LocalStateDict after = model->local_state_dict();
            for (size_t i = 0; i < before.shards.size(); ++i) {
              FS_RETURN_IF_ERROR(Check(at::equal(before.shards[i].tensor, after.shards[i].tensor),
                                       "the model changed after a failed load"));
            }
            return absl::OkStatus();
          }),
      "from rank 0, bad");
}

TEST(FsdpFullStateDict, FrozenParametersAndMixedPrecisionKeepMasterValues) {
  // block0.fc1.weight frozen (a second flat parameter in its unit), bf16 compute: the dict holds
  // the f32 masters, which are the plain model's initial values before any step.
  testing::NetConfig config;
  config.frozen = {"block0.fc1.weight", "fc_in.bias"};
  const auto opts = FsdpOptions().mixed_precision(MixedPrecision().param_dtype(at::kBFloat16));
  testing::Net plain(config);
  ExpectAllOk(
      comm::testing::RunInprocRanks(
          2,
          [&](int rank, int w, std::shared_ptr<comm::Communicator> comm) -> absl::Status {
            FullyShardedDataParallel model(testing::NestedNet(comm, opts, config), comm, opts);
            const StateDict sd = full_state_dict(model);
            FS_RETURN_IF_ERROR(Check(sd.keys() == plain->named_parameters().keys(), "names"));
            for (const auto& item : plain->named_parameters()) {
              FS_RETURN_IF_ERROR(Check(sd[item.key()].scalar_type() == at::kFloat &&
                                           at::equal(sd[item.key()], item.value()),
                                       "master value of " + item.key()));
            }
            // Round trip through the sharded checkpoint at another world size is covered in
            // sharded_checkpoint_test; here: load modified values and read them back.
            StateDict shifted;
            for (const auto& item : sd) shifted.insert(item.key(), item.value() * 2);
            load_full_state_dict(model, shifted);
            const StateDict back = full_state_dict(model);
            for (const auto& item : shifted) {
              FS_RETURN_IF_ERROR(
                  Check(at::equal(back[item.key()], item.value()), "reloaded " + item.key()));
            }
            // And the model trains on the loaded values (the bf16 copy is refreshed).
            auto opt = testing::MakeOptimizer(OptimizerKind::kSgdMomentum, model->parameters());
            TrainSteps(model, *opt, 0, 1, rank, w);
            return absl::OkStatus();
          }),
      "frozen + mixed precision");
}

TEST(FsdpFullStateDict, ModuleFileLoadsBuffersToo) {
  // save_module_state_dict writes Module::save's layout; buffers (here BatchNorm's running
  // statistics, one of them int64) load back through torch::load like parameters.
  torch::nn::Sequential source(torch::nn::Linear(3, 3), torch::nn::BatchNorm1d(3));
  source->train();
  source->forward(at::sin(at::arange(12, at::kFloat).view({4, 3})));
  StateDict sd;
  for (const auto& item : source->named_parameters()) sd.insert(item.key(), item.value().detach());
  for (const auto& item : source->named_buffers()) sd.insert(item.key(), item.value());
  const std::string path = TmpPath("sequential.pt");
  save_module_state_dict(sd, path);
  torch::nn::Sequential target(torch::nn::Linear(3, 3), torch::nn::BatchNorm1d(3));
  torch::load(target, path);
  for (const auto& item : target->named_parameters()) {
    EXPECT_TRUE(at::equal(item.value(), sd[item.key()])) << item.key();
  }
  for (const auto& item : target->named_buffers()) {
    EXPECT_TRUE(at::equal(item.value(), sd[item.key()])) << item.key();
  }
}

TEST(FsdpFullStateDict, BadDictIsInvalidArgumentNamingTheTensorAndChangesNothing) {
  ExpectAllOk(
      comm::testing::RunInprocRanks(
          2,
          [](int rank, int w, std::shared_ptr<comm::Communicator> comm) -> absl::Status {
            auto model = MakeModel(comm, ShardingStrategy::kFullShard, true);
            const StateDict good = full_state_dict(model);
            auto modified = [&](const std::string& name, at::Tensor t, bool drop) {
              StateDict out;
              for (const auto& item : good) {
                if (item.key() != name) out.insert(item.key(), item.value() + 1);
              }
              if (!drop) out.insert(name, t);
              return out;
            };
            const LocalStateDict before = model->local_state_dict();
            FS_RETURN_IF_ERROR(ExpectError(
                [&] {
                  load_full_state_dict(model, modified("block1.fc2.bias", at::Tensor(), true));
                },
                {"INVALID_ARGUMENT", "'block1.fc2.bias' is missing", "rank "}));
            FS_RETURN_IF_ERROR(ExpectError(
                [&] { load_full_state_dict(model, modified("fc_in.weight", at::zeros({7, 6}), false)); },
                {"INVALID_ARGUMENT", "'fc_in.weight' has shape [7, 6]", "[7, 5]"}));
            FS_RETURN_IF_ERROR(ExpectError(
                [&] {
                  load_full_state_dict(
                      model, modified("fc_out.bias", at::zeros({3}, at::kDouble), false));
                },
                {"INVALID_ARGUMENT", "'fc_out.bias' is Double"}));
            StateDict extra = modified("fc_out.bias", good["fc_out.bias"], false);
            extra.insert("head.weight", at::zeros({2}));
            FS_RETURN_IF_ERROR(ExpectError([&] { load_full_state_dict(model, extra); },
                                           {"INVALID_ARGUMENT", "'head.weight' is not a parameter"}));
            const LocalStateDict after = model->local_state_dict();
            for (size_t i = 0; i < before.shards.size(); ++i) {
              FS_RETURN_IF_ERROR(Check(at::equal(before.shards[i].tensor, after.shards[i].tensor),
                                       "the model changed after a failed load"));
            }
            return absl::OkStatus();
          }),
      "errors");
}

// The plain optimizer's state of the plain model's parameters, by name.
std::map<std::string, internal::ParamState> PlainState(torch::nn::Module& net,
                                                       const torch::optim::Optimizer& opt) {
  std::map<std::string, internal::ParamState> out;
  for (const auto& item : net.named_parameters()) {
    internal::ParamState ps;
    if (internal::GetParamState(opt, item.value(), &ps)) out[item.key()] = ps;
  }
  return out;
}

TEST(FsdpFullOptimState, MatchesPlainOptimizerAndLoadsIntoPlainLibTorch) {
  for (OptimizerKind kind :
       {OptimizerKind::kSgdMomentum, OptimizerKind::kAdam, OptimizerKind::kAdamW}) {
    const auto ref = testing::RunReference(kind, 4);
    // The plain optimizer's state after 3 steps.
    testing::Net net;
    auto plain_opt = testing::MakeOptimizer(kind, testing::DistinctParameters(*net));
    for (int step = 0; step < 3; ++step) {
      plain_opt->zero_grad();
      testing::Batch b = testing::GlobalBatch(step);
      testing::Mse(net(b.x), b.y).backward();
      plain_opt->step();
    }
    const auto expected = PlainState(*net, *plain_opt);
    ExpectAllOk(
        comm::testing::RunInprocRanks(
            3,
            [&](int rank, int w, std::shared_ptr<comm::Communicator> comm) -> absl::Status {
              auto model = MakeModel(comm, ShardingStrategy::kFullShard, true);
              auto opt = testing::MakeOptimizer(kind, model->parameters());
              TrainSteps(model, *opt, 0, 3, rank, w);
              const FullOptimState osd = full_optim_state_dict(model, *opt, /*rank0_only=*/true);
              const StateDict sd = full_state_dict(model, /*rank0_only=*/true);
              if (rank != 0) return Check(osd.state.empty(), "rank0_only");
              FS_RETURN_IF_ERROR(Check(osd.state.size() == expected.size(), "params with state"));
              for (const auto& [name, ps] : expected) {
                const auto& got = osd.state.at(name);
                FS_RETURN_IF_ERROR(Check(got.step == ps.step, name + ": step"));
                FS_RETURN_IF_ERROR(Check(got.tensors.size() == ps.tensors.size(), name));
                for (const auto& [tname, t] : ps.tensors) {
                  FS_RETURN_IF_ERROR(
                      testing::ExpectClose(name + "/" + tname, got.tensors.at(tname), t, 1e-5));
                }
              }
              FS_RETURN_IF_ERROR(Check(osd.param_groups.size() == 1 &&
                                           osd.param_groups[0].params ==
                                               testing::Net()->named_parameters().keys(),
                                       "one group, unwrapped order"));
              // Plain LibTorch continues where FSDP stopped.
              const std::string tag = internal::OptimizerKind(*opt).value();
              save_module_state_dict(sd, TmpPath("plain_" + tag + ".pt"));
              save_torch_optimizer(osd, TmpPath("plain_" + tag + "_optim.pt"));
              testing::Net fresh;
              torch::load(fresh, TmpPath("plain_" + tag + ".pt"));
              auto fresh_opt = testing::MakeOptimizer(kind, testing::DistinctParameters(*fresh));
              torch::load(*fresh_opt, TmpPath("plain_" + tag + "_optim.pt"));
              fresh_opt->zero_grad();
              testing::Batch b = testing::GlobalBatch(3);
              testing::Mse(fresh(b.x), b.y).backward();
              fresh_opt->step();
              for (const auto& item : fresh->named_parameters()) {
                FS_RETURN_IF_ERROR(testing::ExpectClose("plain step 4: " + item.key(),
                                                        item.value(),
                                                        ref[3].params.at(item.key()), 1e-5));
              }
              return absl::OkStatus();
            }),
        testing::OptimizerName(kind));
  }
}

TEST(FsdpFullOptimState, ReshardsToOtherWorldSizesAndContinues) {
  constexpr int kSaveAt = 3, kSteps = 6;
  for (OptimizerKind kind : {OptimizerKind::kAdam, OptimizerKind::kSgdMomentum}) {
    const auto ref = testing::RunReference(kind, kSteps);
    StateDict sd;
    FullOptimState osd;
    ExpectAllOk(comm::testing::RunInprocRanks(4,
                                  [&](int rank, int w, std::shared_ptr<comm::Communicator> comm) {
                                    auto model = MakeModel(comm, ShardingStrategy::kFullShard, true);
                                    auto opt = testing::MakeOptimizer(kind, model->parameters());
                                    TrainSteps(model, *opt, 0, kSaveAt, rank, w);
                                    StateDict s = full_state_dict(model, true);
                                    FullOptimState o = full_optim_state_dict(model, *opt, true);
                                    if (rank == 0) {
                                      sd = s;
                                      osd = o;
                                    }
                                    return absl::OkStatus();
                                  }),
                "save at 4");
    for (int world : {1, 2, 3}) {
      ExpectAllOk(
          comm::testing::RunInprocRanks(
              world,
              [&](int rank, int w, std::shared_ptr<comm::Communicator> comm) -> absl::Status {
                auto model = MakeModel(comm, ShardingStrategy::kFullShard, /*nested=*/w != 2);
                auto opt = testing::MakeOptimizer(kind, model->parameters());
                // At world size 3 only rank 0 holds the dicts (broadcast); elsewhere every rank.
                const bool from_rank0 = w == 3;
                const bool has = !from_rank0 || rank == 0;
                load_full_state_dict(model, has ? sd : StateDict(), from_rank0);
                load_full_optim_state_dict(model, *opt, has ? osd : FullOptimState(), from_rank0);
                const auto losses = TrainSteps(model, *opt, kSaveAt, kSteps, rank, w);
                FS_RETURN_IF_ERROR(ExpectReferenceLosses(ref, losses, kSaveAt, rank, w));
                return testing::CheckShards(model, ref[kSteps - 1].params, false,
                                            absl::StrCat("resumed at world ", w), 1e-5);
              }),
          testing::OptimizerName(kind));
    }
  }
}

}  // namespace
}  // namespace fairscale::fsdp
