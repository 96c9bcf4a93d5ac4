// State dicts and checkpoints of the per-parameter layout (FsdpOptions::flatten_parameters(false)),
// and tied parameters in the optimizer state and the sharded checkpoint of both layouts. Each
// test trains 2 steps, saves, loads into a fresh model (another world size, and for the sharded
// checkpoint another layout), trains 2 more steps, and compares with a single-process reference
// trained 4 steps without interruption (1e-5 relative): a wrong value anywhere in the model or
// optimizer state shows up there.
#include <torch/optim/adamw.h>

#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "base/status_matchers.h"
#include "comm/testing/inproc_ranks.h"
#include "fsdp/fully_sharded_data_parallel.h"
#include "fsdp/sharded_checkpoint.h"
#include "fsdp/state_dict.h"
#include "fsdp/test_util.h"
#include "fsdp/testing/checkpoint_helpers.h"
#include "fsdp/testing/per_param_helpers.h"
#include "gtest/gtest.h"
#include "testing/c10_error.h"

namespace fairscale::fsdp {
namespace {

using testing::ExpectClose;
using testing::Step;

constexpr int kSaveWorld = 4;
constexpr int kSaveAfter = 2;  // steps before the save; kSteps in all

struct RunSetup {
  bool per_param = true;
  ShardingStrategy strategy = ShardingStrategy::kFullShard;
  bool nested = true;
  bool grouped = true;  // two AdamW param groups (per-parameter layout only)
};

template <typename Make>
FullyShardedDataParallel MakeFsdp(Make make, const RunSetup& s,
                                  std::shared_ptr<comm::Communicator> comm) {
  const auto opts = FsdpOptions().sharding_strategy(s.strategy).flatten_parameters(!s.per_param);
  return FullyShardedDataParallel(make(s.nested ? comm : nullptr, opts), comm, opts);
}

template <typename Make>
std::unique_ptr<torch::optim::AdamW> MakeOpt(Make make, FullyShardedDataParallel& model,
                                             const RunSetup& s) {
  if (s.per_param) {
    auto plain = make(nullptr, FsdpOptions());
    return testing::GroupedAdamW(model->named_parameters(), testing::Matrices(*plain), s.grouped);
  }
  std::vector<at::Tensor> params;
  for (const at::Tensor& p : model->parameters()) {
    if (p.requires_grad()) params.push_back(p);
  }
  return std::make_unique<torch::optim::AdamW>(params,
                                               torch::optim::AdamWOptions(0.02).weight_decay(0.1));
}

template <typename Loss>
void Train(FullyShardedDataParallel& model, torch::optim::Optimizer& opt, Loss loss_fn, int from,
           int to, int rank, int world) {
  for (int step = from; step < to; ++step) {
    opt.zero_grad();
    loss_fn(model, step, rank, world).backward();
    opt.step();
  }
}

// The model's parameters against the reference's full values: this rank's rows (per-parameter
// layout), or the full state dict (flat layout).
absl::Status CheckParams(FullyShardedDataParallel& model,
                         const std::map<std::string, at::Tensor>& want, const RunSetup& s, int rank,
                         int world, const std::string& what) {
  if (s.per_param) {
    const bool sharded = testing::Sharded(s.strategy, world);
    for (const auto& item : model->named_parameters()) {
      FS_RETURN_IF_ERROR(ExpectClose(absl::StrCat(what, " '", item.key(), "'"), item.value(),
                                     testing::Rows(want.at(item.key()), rank, world, sharded),
                                     1e-5));
    }
    return absl::OkStatus();
  }
  const StateDict sd = full_state_dict(model);
  for (const auto& [name, t] : want) {
    FS_RETURN_IF_ERROR(ExpectClose(absl::StrCat(what, " '", name, "'"), sd[name], t, 1e-5));
  }
  return absl::OkStatus();
}

// How the trained state travels from the saving model to the loading one.
enum class Via { kFullStateDicts, kFullStateDictsFromRank0, kShardedCheckpoint };

template <typename Make, typename Loss>
void ExpectResumes(Make make, Loss loss_fn, const RunSetup& save, const RunSetup& load, Via via,
                   const std::string& dir) {
  const std::vector<Step> ref =
      testing::Reference(make, loss_fn, 0, testing::kSteps, save.grouped && load.grouped);
  StateDict sd;
  FullOptimState osd;
  const bool rank0 = via == Via::kFullStateDictsFromRank0;
  testing::ExpectAllOk(
      comm::testing::RunInprocRanks(kSaveWorld,
                        [&](int rank, int world, auto comm) -> absl::Status {
                          FullyShardedDataParallel model = MakeFsdp(make, save, comm);
                          auto opt = MakeOpt(make, model, save);
                          Train(model, *opt, loss_fn, 0, kSaveAfter, rank, world);
                          FS_RETURN_IF_ERROR(CheckParams(model, ref[kSaveAfter - 1].params, save,
                                                         rank, world, "before the save"));
                          if (via == Via::kShardedCheckpoint) {
                            save_sharded_checkpoint(model, opt.get(), dir);
                            return absl::OkStatus();
                          }
                          StateDict s = full_state_dict(model, rank0);
                          FullOptimState o = full_optim_state_dict(model, *opt, rank0);
                          if (rank == 0) {
                            sd = std::move(s);
                            osd = std::move(o);
                          }
                          return absl::OkStatus();
                        }),
      "save");
  for (int world = 1; world < kSaveWorld; ++world) {
    testing::ExpectAllOk(
        comm::testing::RunInprocRanks(
            world,
            [&](int rank, int w, auto comm) -> absl::Status {
              FullyShardedDataParallel model = MakeFsdp(make, load, comm);
              auto opt = MakeOpt(make, model, load);
              if (via == Via::kShardedCheckpoint) {
                load_sharded_checkpoint(model, opt.get(), dir);
              } else {
                const bool from_rank0 = rank0 || w == 3;
                const StateDict none;
                const FullOptimState no_osd;
                load_full_state_dict(model, !from_rank0 || rank == 0 ? sd : none, from_rank0);
                load_full_optim_state_dict(model, *opt, !from_rank0 || rank == 0 ? osd : no_osd,
                                           from_rank0);
              }
              Train(model, *opt, loss_fn, kSaveAfter, testing::kSteps, rank, w);
              return CheckParams(model, ref.back().params, load, rank, w, "after resuming");
            }),
        absl::StrCat("load at world ", world));
  }
}

auto FrozenNet() {
  testing::NetConfig config;
  config.frozen = {"fc_in.bias", "block0.fc1.weight", "fc_out.weight"};
  return testing::MakeNet(config);
}

class PerParamStateTest : public ::testing::TestWithParam<ShardingStrategy> {};

TEST_P(PerParamStateTest, FullStateDictsResumeAtOtherWorldSizes) {
  RunSetup s;
  s.strategy = GetParam();
  ExpectResumes(FrozenNet(), testing::NetLossFn(), s, s, Via::kFullStateDicts, "");
  ExpectResumes(FrozenNet(), testing::NetLossFn(), s, s, Via::kFullStateDictsFromRank0, "");
}

TEST_P(PerParamStateTest, ShardedCheckpointResumesAcrossWorldSizesAndLayouts) {
  for (bool save_per_param : {true, false}) {
    for (bool load_per_param : {true, false}) {
      RunSetup save;
      save.strategy = GetParam();
      save.grouped = false;  // the flat layout steps one group per flat parameter
      save.per_param = save_per_param;
      RunSetup load = save;
      load.per_param = load_per_param;
      SCOPED_TRACE(
          absl::StrCat("save per_param ", save_per_param, " load per_param ", load_per_param));
      ExpectResumes(FrozenNet(), testing::NetLossFn(), save, load, Via::kShardedCheckpoint,
                    testing::TmpPath(absl::StrCat("pp_ckpt_", static_cast<int>(GetParam()), "_",
                                                  save_per_param, load_per_param)));
    }
  }
}

TEST_P(PerParamStateTest, GroupedShardedCheckpointResumes) {
  RunSetup s;
  s.strategy = GetParam();
  ExpectResumes(FrozenNet(), testing::NetLossFn(), s, s, Via::kShardedCheckpoint,
                testing::TmpPath(absl::StrCat("pp_grouped_", static_cast<int>(GetParam()))));
}

INSTANTIATE_TEST_SUITE_P(All, PerParamStateTest,
                         ::testing::Values(ShardingStrategy::kFullShard,
                                           ShardingStrategy::kShardGradOp,
                                           ShardingStrategy::kNoShard),
                         [](const ::testing::TestParamInfo<ShardingStrategy>& info) {
                           return std::string(ShardingStrategyName(info.param));
                         });

// Tied parameters ("head.weight" is "emb"): the optimizer state is kept once, under the primary
// name, and resumes through full state dicts and the sharded checkpoint, in both layouts.
class TiedStateTest : public ::testing::TestWithParam<bool> {};

TEST_P(TiedStateTest, OptimizerStateAndCheckpointResume) {
  RunSetup s;
  s.per_param = GetParam();
  s.nested = false;
  s.grouped = false;
  const auto make = testing::MakePlain<testing::Tied>();
  ExpectResumes(make, testing::TiedLossFn(), s, s, Via::kFullStateDicts, "");
  ExpectResumes(make, testing::TiedLossFn(), s, s, Via::kShardedCheckpoint,
                testing::TmpPath(absl::StrCat("tied_ckpt_", GetParam())));
  testing::ExpectAllOk(
      comm::testing::RunInprocRanks(2,
                        [&](int rank, int world, auto comm) -> absl::Status {
                          FullyShardedDataParallel model = MakeFsdp(make, s, comm);
                          auto opt = MakeOpt(make, model, s);
                          Train(model, *opt, testing::TiedLossFn(), 0, 1, rank, world);
                          const FullOptimState osd = full_optim_state_dict(model, *opt);
                          const std::vector<std::string> want = {"emb", "bias"};
                          if (osd.param_groups.size() != 1 || osd.param_groups[0].params != want) {
                            return absl::InternalError(
                                "the optimizer state does not list emb, "
                                "bias once each");
                          }
                          if (osd.state.count("head.weight") || !osd.state.count("emb")) {
                            return absl::InternalError("tied state not under the primary name");
                          }
                          return absl::OkStatus();
                        }),
      "tied optimizer state");
}

INSTANTIATE_TEST_SUITE_P(Layouts, TiedStateTest, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return std::string(info.param ? "PerParam" : "Flat");
                         });

TEST(PerParamLocalStateTest, RoundTripsAndRejectsTheOtherLayout) {
  testing::ExpectAllOk(
      comm::testing::RunInprocRanks(
          3,
          [](int rank, int world, auto comm) -> absl::Status {
            RunSetup s;
            FullyShardedDataParallel a = MakeFsdp(testing::MakeNet(), s, comm);
            auto opt = MakeOpt(testing::MakeNet(), a, s);
            Train(a, *opt, testing::NetLossFn(), 0, 1, rank, world);
            const LocalStateDict local = a->local_state_dict();
            FullyShardedDataParallel b = MakeFsdp(testing::MakeNet(), s, comm);
            b->load_local_state_dict(local);
            const auto pa = a->named_parameters();
            for (const auto& item : b->named_parameters()) {
              FS_RETURN_IF_ERROR(ExpectClose("local round trip '" + item.key() + "'", item.value(),
                                             pa[item.key()], 0));
            }
            RunSetup flat = s;
            flat.per_param = false;
            FullyShardedDataParallel c = MakeFsdp(testing::MakeNet(), flat, comm);
            // A per-parameter local state dict does not load into a flat model.
            return fairscale::testing::ExpectError([&] { c->load_local_state_dict(local); },
                                                   {"flatten_parameters(false)"});
          }),
      "local state dict");
}

}  // namespace
}  // namespace fairscale::fsdp
