// Sharded checkpoints (sharded_checkpoint.h): saved at 4 ranks and loaded at 1, 2 and 3 (with
// other wrappings too) the full parameters are bitwise the saved ones, and training continues with
// the losses and parameters of the uninterrupted reference run (SGD momentum, Adam, AdamW: the
// optimizer state is re-sharded); corrupt, truncated, missing and mismatched files are DATA_LOSS /
// INVALID_ARGUMENT naming the file and tensor and change nothing; the consolidation (library and
// //fsdp:consolidate_checkpoint) gives files plain LibTorch loads into the unwrapped model and
// optimizer.
#include <torch/optim/adam.h>
#include <torch/serialize.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <iterator>
#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "base/status_matchers.h"
#include "comm/testing/inproc_ranks.h"
#include "fsdp/sharded_checkpoint.h"
#include "fsdp/state_dict.h"
#include "fsdp/test_util.h"
#include "fsdp/testing/checkpoint_helpers.h"
#include "gtest/gtest.h"

namespace fairscale::fsdp {
namespace {

using testing::Check;
using testing::ExpectAllOk;
using testing::ExpectError;
using testing::ExpectReferenceLosses;
using testing::MakeModel;
using testing::OptimizerKind;
using testing::SameDict;
using testing::TmpPath;
using testing::TrainSteps;

constexpr int kSaveAt = 3;
constexpr int kSteps = 6;

// Trains kSaveAt steps at 4 ranks (nested FULL_SHARD) and saves to `dir`; returns the full
// state dict at that point.
StateDict SaveAt4(OptimizerKind kind, const std::string& dir, bool with_optimizer = true) {
  StateDict saved;
  ExpectAllOk(comm::testing::RunInprocRanks(4,
                                [&](int rank, int w, std::shared_ptr<comm::Communicator> comm) {
                                  auto model = MakeModel(comm, ShardingStrategy::kFullShard, true);
                                  auto opt = testing::MakeOptimizer(kind, model->parameters());
                                  TrainSteps(model, *opt, 0, kSaveAt, rank, w);
                                  save_sharded_checkpoint(model, with_optimizer ? opt.get() : nullptr,
                                                          dir);
                                  StateDict sd = full_state_dict(model, true);
                                  if (rank == 0) saved = sd;
                                  return absl::OkStatus();
                                }),
              "save at 4");
  return saved;
}

TEST(FsdpShardedCheckpoint, SaveAt4LoadAt1To3ContinuesLikeTheUninterruptedRun) {
  struct Case {
    OptimizerKind kind;
    ShardingStrategy strategy;  // of the loading run
  };
  for (const Case c : {Case{OptimizerKind::kAdam, ShardingStrategy::kFullShard},
                       Case{OptimizerKind::kSgdMomentum, ShardingStrategy::kShardGradOp},
                       Case{OptimizerKind::kAdamW, ShardingStrategy::kNoShard}}) {
    const auto ref = testing::RunReference(c.kind, kSteps);
    const std::string dir = TmpPath(absl::StrCat("reshard_", testing::OptimizerName(c.kind)));
    const StateDict saved = SaveAt4(c.kind, dir);
    for (int world : {1, 2, 3}) {
      ExpectAllOk(
          comm::testing::RunInprocRanks(
              world,
              [&](int rank, int w, std::shared_ptr<comm::Communicator> comm) -> absl::Status {
                // Another wrapping than the saving run's at world size 2.
                auto model = MakeModel(comm, c.strategy, /*nested=*/w != 2);
                auto opt = testing::MakeOptimizer(c.kind, model->parameters());
                load_sharded_checkpoint(model, opt.get(), dir);
                const StateDict loaded = full_state_dict(model, true);
                if (rank == 0) FS_RETURN_IF_ERROR(SameDict(loaded, saved, "loaded vs saved"));
                const auto losses = TrainSteps(model, *opt, kSaveAt, kSteps, rank, w);
                FS_RETURN_IF_ERROR(ExpectReferenceLosses(ref, losses, kSaveAt, rank, w));
                return testing::CheckShards(model, ref[kSteps - 1].params, false,
                                            absl::StrCat("resumed at world ", w), 1e-5);
              }),
          absl::StrCat(testing::OptimizerName(c.kind), " at ", world));
    }
  }
}

// Adam with two param groups: the root unit's flat parameter, and the nested units' (or the
// other way round with `swapped`).
std::unique_ptr<torch::optim::Adam> GroupedAdam(FullyShardedDataParallel& model, double lr0,
                                                double lr1, bool swapped = false) {
  std::vector<at::Tensor> root, nested;
  for (FullyShardedDataParallelImpl* u : model->fsdp_units()) {
    (u == model.get() ? root : nested).push_back(u->named_parameters(false)["flat_param"]);
  }
  if (swapped) std::swap(root, nested);
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(root, std::make_unique<torch::optim::AdamOptions>(lr0));
  groups.emplace_back(nested, std::make_unique<torch::optim::AdamOptions>(lr1));
  return std::make_unique<torch::optim::Adam>(groups, torch::optim::AdamOptions(lr0));
}

TEST(FsdpShardedCheckpoint, ParamGroupsAreKept) {
  const std::string dir = TmpPath("groups");
  ExpectAllOk(comm::testing::RunInprocRanks(4,
                                [&](int rank, int w, std::shared_ptr<comm::Communicator> comm) {
                                  auto model = MakeModel(comm, ShardingStrategy::kFullShard, true);
                                  auto opt = GroupedAdam(model, 0.01, 0.02);
                                  TrainSteps(model, *opt, 0, 2, rank, w);
                                  save_sharded_checkpoint(model, opt.get(), dir);
                                  return absl::OkStatus();
                                }),
              "save");
  ExpectAllOk(
      comm::testing::RunInprocRanks(
          2,
          [&](int, int, std::shared_ptr<comm::Communicator> comm) -> absl::Status {
            auto model = MakeModel(comm, ShardingStrategy::kFullShard, true);
            auto swapped = GroupedAdam(model, 0.5, 0.5, /*swapped=*/true);
            FS_RETURN_IF_ERROR(ExpectError(
                [&] { load_sharded_checkpoint(model, swapped.get(), dir); },
                {"INVALID_ARGUMENT", "param group 0 of this optimizer but not in group 0"}));
            auto opt = GroupedAdam(model, 0.5, 0.5);
            load_sharded_checkpoint(model, opt.get(), dir);
            const auto lr = [&](int g) {
              return static_cast<torch::optim::AdamOptions&>(opt->param_groups()[g].options()).lr();
            };
            FS_RETURN_IF_ERROR(Check(lr(0) == 0.01 && lr(1) == 0.02, "group options restored"));
            const FullOptimState osd = full_optim_state_dict(model, *opt);
            FS_RETURN_IF_ERROR(Check(
                osd.param_groups.size() == 2 &&
                    osd.param_groups[0].params ==
                        std::vector<std::string>{"fc_in.weight", "fc_in.bias", "fc_out.weight",
                                                 "fc_out.bias"} &&
                    osd.param_groups[1].params.size() == 8 &&
                    osd.param_groups[1].params.front() == "block0.fc1.weight" &&
                    osd.state.at("block1.fc2.bias").step == 2,
                "groups in the unwrapped layout"));
            return absl::OkStatus();
          }),
      "load");
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}
void WriteFile(const std::string& path, const std::string& data) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << data;
}
void CopyDir(const std::string& from, const std::string& to) {
  ASSERT_EQ(std::system(absl::StrCat("rm -rf '", to, "' && cp -r '", from, "' '", to, "'").c_str()),
            0);
}
// Rewrites `dir`'s manifest through `edit`.
void EditManifest(const std::string& dir, const std::function<void(nlohmann::json&)>& edit) {
  nlohmann::json j = nlohmann::json::parse(ReadFile(dir + "/manifest.json"));
  edit(j);
  WriteFile(dir + "/manifest.json", j.dump(1));
}

// Loads `dir` at world size 1 and expects an error containing `needles`, the model unchanged.
void ExpectLoadError(const std::string& dir, OptimizerKind kind,
                     const std::vector<std::string>& needles) {
  ExpectAllOk(comm::testing::RunInprocRanks(
                  1,
                  [&](int, int, std::shared_ptr<comm::Communicator> comm) -> absl::Status {
                    auto model = MakeModel(comm, ShardingStrategy::kFullShard, true);
                    auto opt = testing::MakeOptimizer(kind, model->parameters());
                    const StateDict before = full_state_dict(model);
                    FS_RETURN_IF_ERROR(
                        ExpectError([&] { load_sharded_checkpoint(model, opt.get(), dir); },
                                    needles));
                    FS_RETURN_IF_ERROR(Check(opt->state().empty(), "optimizer state changed"));
                    return SameDict(full_state_dict(model), before, "model after a failed load");
                  }),
              dir);
}

TEST(FsdpShardedCheckpoint, BadFilesAreNamedErrorsAndChangeNothing) {
  const std::string good = TmpPath("good");
  SaveAt4(OptimizerKind::kAdam, good);
  const std::string bad = TmpPath("bad");
  const std::string rank1 = bad + "/rank00001.shard";

  CopyDir(good, bad);
  std::string bytes = ReadFile(rank1);
  bytes[20] ^= 0x5a;  // inside the first record
  WriteFile(rank1, bytes);
  ExpectLoadError(bad, OptimizerKind::kAdam,
                  {"DATA_LOSS", rank1, "tensor 'p/", "checksum", "rank 0/1"});

  CopyDir(good, bad);
  bytes = ReadFile(rank1);
  WriteFile(rank1, bytes.substr(0, bytes.size() - 100));
  ExpectLoadError(bad, OptimizerKind::kAdam, {"DATA_LOSS", rank1, "truncated"});

  CopyDir(good, bad);
  std::remove((bad + "/rank00003.shard").c_str());
  ExpectLoadError(bad, OptimizerKind::kAdam, {"DATA_LOSS", bad + "/rank00003.shard"});

  CopyDir(good, bad);
  std::remove((bad + "/manifest.json").c_str());
  ExpectLoadError(bad, OptimizerKind::kAdam, {"DATA_LOSS", "no manifest"});

  // A file of another checkpoint under this one's manifest.
  const std::string other = TmpPath("other");
  SaveAt4(OptimizerKind::kSgdMomentum, other);
  CopyDir(good, bad);
  WriteFile(rank1, ReadFile(other + "/rank00001.shard"));
  ExpectLoadError(bad, OptimizerKind::kAdam, {"DATA_LOSS", rank1});

  const std::string manifest = ReadFile(good + "/manifest.json");
  CopyDir(good, bad);
  EditManifest(bad, [](nlohmann::json& j) { j["world_size"] = 3; });
  ExpectLoadError(bad, OptimizerKind::kAdam, {"DATA_LOSS", "4 files for world size 3"});

  CopyDir(good, bad);
  WriteFile(bad + "/manifest.json", manifest.substr(0, manifest.size() / 2));
  ExpectLoadError(bad, OptimizerKind::kAdam, {"DATA_LOSS", "manifest.json", "not valid JSON"});

  CopyDir(good, bad);
  EditManifest(bad, [](nlohmann::json& j) {
    for (auto& p : j["params"]) {
      if (p["name"] == "block1.fc2.bias") p["name"] = "block1.fc3.bias";
    }
  });
  ExpectLoadError(bad, OptimizerKind::kAdam,
                  {"INVALID_ARGUMENT", "parameter 'block1.fc2.bias' is not in the checkpoint"});

  // Optimizer mismatches.
  ExpectLoadError(good, OptimizerKind::kSgdMomentum,
                  {"INVALID_ARGUMENT", "'adam' optimizer", "'sgd'"});
  const std::string no_opt = TmpPath("no_opt");
  SaveAt4(OptimizerKind::kAdam, no_opt, /*with_optimizer=*/false);
  ExpectLoadError(no_opt, OptimizerKind::kAdam, {"INVALID_ARGUMENT", "without optimizer state"});
}

TEST(FsdpShardedCheckpoint, EachRankReadsOnlyWhatItNeedsAndAllAgreeBeforeLoading) {
  const std::string dir = TmpPath("agree");
  SaveAt4(OptimizerKind::kAdam, dir);
  // Rank 3 of 4 saved the end of the root's flat parameter ([51, 66) of 66: fc_out); at world
  // size 2 only rank 1 ([33, 66)) reads that record.
  const std::string rank3 = dir + "/rank00003.shard";
  std::string bytes = ReadFile(rank3);
  bytes[10] ^= 0x5a;
  WriteFile(rank3, bytes);
  ExpectAllOk(
      comm::testing::RunInprocRanks(
          2,
          [&](int rank, int, std::shared_ptr<comm::Communicator> comm) -> absl::Status {
            auto model = MakeModel(comm, ShardingStrategy::kFullShard, true);
            auto opt = testing::MakeOptimizer(OptimizerKind::kAdam, model->parameters());
            const StateDict before = full_state_dict(model);
            const std::vector<std::string> needles =
                rank == 1 ? std::vector<std::string>{"DATA_LOSS", rank3, "tensor 'p/fc_out.weight'",
                                                     "rank 1/2"}
                          : std::vector<std::string>{"rank 0/2", "rank(s) 1 failed",
                                                     "nothing was changed"};
            FS_RETURN_IF_ERROR(
                ExpectError([&] { load_sharded_checkpoint(model, opt.get(), dir); }, needles));
            FS_RETURN_IF_ERROR(Check(opt->state().empty(), "optimizer state changed"));
            return SameDict(full_state_dict(model), before, "model after a failed load");
          }),
      "agreement");
}

TEST(FsdpShardedCheckpoint, ShapeMismatchNamesTheTensor) {
  const std::string dir = TmpPath("shape");
  SaveAt4(OptimizerKind::kAdam, dir);
  // fc_out.bias is [3]; claim [4].
  EditManifest(dir, [](nlohmann::json& j) {
    for (auto& p : j["params"]) {
      if (p["name"] == "fc_out.bias") p["shape"] = {4};
    }
  });
  ExpectLoadError(dir, OptimizerKind::kAdam,
                  {"INVALID_ARGUMENT", "parameter 'fc_out.bias' is Float [4]", "Float [3]"});
}

TEST(FsdpShardedCheckpoint, ConsolidatedFilesLoadIntoPlainLibTorch) {
  const auto ref = testing::RunReference(OptimizerKind::kAdam, kSaveAt + 1);
  const std::string dir = TmpPath("consolidate");
  const StateDict saved = SaveAt4(OptimizerKind::kAdam, dir);
  auto ckpt = consolidate_sharded_checkpoint(dir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  EXPECT_THAT(SameDict(ckpt->state_dict, saved, "consolidated"), base::testing::IsOk());

  // The tool, as a user runs it.
  const std::string model_pt = TmpPath("consolidated.pt");
  const std::string optim_pt = TmpPath("consolidated_optim.pt");
  ASSERT_EQ(std::system(absl::StrCat("fsdp/consolidate_checkpoint --checkpoint_dir=", dir,
                                     " --output=", model_pt, " --optimizer_output=", optim_pt)
                            .c_str()),
            0);
  testing::Net net;
  torch::load(net, model_pt);
  for (const auto& item : net->named_parameters()) {
    EXPECT_TRUE(at::equal(item.value(), saved[item.key()])) << item.key();
  }
  auto opt = testing::MakeOptimizer(OptimizerKind::kAdam, testing::DistinctParameters(*net));
  torch::load(*opt, optim_pt);
  opt->zero_grad();
  testing::Batch b = testing::GlobalBatch(kSaveAt);
  testing::Mse(net(b.x), b.y).backward();
  opt->step();
  for (const auto& item : net->named_parameters()) {
    EXPECT_THAT(testing::ExpectClose(item.key(), item.value(), ref[kSaveAt].params.at(item.key()),
                                     1e-5),
                base::testing::IsOk());
  }

  // A corrupt file anywhere fails the whole-file checksum.
  const std::string rank2 = dir + "/rank00002.shard";
  std::string bytes = ReadFile(rank2);
  bytes[bytes.size() / 2] ^= 1;
  WriteFile(rank2, bytes);
  auto bad = consolidate_sharded_checkpoint(dir);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(bad.status().message().find(rank2), std::string::npos) << bad.status();
  EXPECT_NE(std::system(absl::StrCat("fsdp/consolidate_checkpoint --checkpoint_dir=", dir,
                                     " --output=", model_pt, " 2>/dev/null")
                            .c_str()),
            0);
}

}  // namespace
}  // namespace fairscale::fsdp
