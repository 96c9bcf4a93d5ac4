// fsdp_item through the CheckpointManager: an FSDP model with Adam saved at 4 ranks (sync and
// async; after an async save returns, training goes on and must not leak into the checkpoint)
// restores at 1, 2 and 3 ranks to the saved full state dict and then trains like the
// uninterrupted single-process reference.
#include "train_state/fsdp_item.h"

#include <ATen/ops/arange.h>
#include <ATen/ops/full.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "comm/testing/inproc_ranks.h"
#include "comm/testing/rank_runner.h"
#include "fsdp/state_dict.h"
#include "fsdp/testing/checkpoint_helpers.h"
#include "fsdp/test_util.h"
#include "gtest/gtest.h"
#include "testing/tmp.h"
#include "train_state/checkpoint_manager.h"
#include "train_state/items.h"

namespace fairscale::train_state {
namespace {

namespace ft = fairscale::fsdp::testing;
using comm::testing::Check;
using comm::testing::ExpectAllOk;
using comm::testing::RunInprocRanks;

constexpr int kSaveAt = 3;
constexpr int kSteps = 6;

TEST(FsdpItemTest, SavedAt4RestoresAt1To3AndContinuesLikeTheReference) {
  const auto ref = ft::RunReference(ft::OptimizerKind::kAdam, kSteps);
  for (bool async : {false, true}) {
    const std::string root = fairscale::testing::UniqueTmpPath(async ? "fsdp_item_async" : "fsdp_item");
    fsdp::StateDict saved;
    ExpectAllOk(RunInprocRanks(4, [&](int rank, int w, std::shared_ptr<comm::Communicator> comm)
                                      -> absl::Status {
      auto model = ft::MakeModel(comm, fsdp::ShardingStrategy::kFullShard, true);
      auto opt = ft::MakeOptimizer(ft::OptimizerKind::kAdam, model->parameters());
      int64_t step = 0;
      TrainState state;
      state.add("model", fsdp_item(model, opt.get()))
          .add("step", json_item([&] { return nlohmann::json(step); },
                                 [&](const nlohmann::json& j) { step = j.get<int64_t>(); }));
      CheckpointManager m(comm, CheckpointManagerOptions(root).async(async));
      ft::TrainSteps(model, *opt, 0, kSaveAt, rank, w);
      step = kSaveAt;
      fsdp::StateDict sd = fsdp::full_state_dict(model, true);
      if (rank == 0) saved = sd;
      m.save(step, state);
      ft::TrainSteps(model, *opt, kSaveAt, kSaveAt + 1, rank, w);  // while it writes
      m.wait();
      return absl::OkStatus();
    }), "save at 4");
    for (int world : {1, 2, 3}) {
      ExpectAllOk(RunInprocRanks(world, [&](int rank, int w, std::shared_ptr<comm::Communicator> comm)
                                            -> absl::Status {
        // Another wrapping at world 2.
        auto model = ft::MakeModel(comm, fsdp::ShardingStrategy::kFullShard, w != 2);
        auto opt = ft::MakeOptimizer(ft::OptimizerKind::kAdam, model->parameters());
        int64_t step = 0;
        TrainState state;
        state.add("model", fsdp_item(model, opt.get()))
            .add("step", json_item([&] { return nlohmann::json(step); },
                                   [&](const nlohmann::json& j) { step = j.get<int64_t>(); }));
        CheckpointManager m(comm, CheckpointManagerOptions(root));
        FS_RETURN_IF_ERROR(Check(m.restore(state) == kSaveAt && step == kSaveAt, "restored step"));
        const fsdp::StateDict loaded = fsdp::full_state_dict(model, true);
        if (rank == 0) FS_RETURN_IF_ERROR(ft::SameDict(loaded, saved, "restored vs saved"));
        const auto losses = ft::TrainSteps(model, *opt, kSaveAt, kSteps, rank, w);
        return ft::ExpectReferenceLosses(ref, losses, kSaveAt, rank, w);
      }), absl::StrCat(async ? "async" : "sync", " restore at ", world));
    }
  }
}

// Either layout: a model whose units keep their parameters unflattened (FsdpOptions::
// flatten_parameters(false), FSDP2-style per-parameter shards) saved at 2 ranks (async) restores
// into the flat layout at 3 ranks and into the per-parameter one at 1, to the saved full state
// dict, and both continue like the reference.
TEST(FsdpItemTest, PerParameterLayoutRestoresIntoEitherLayout) {
  const auto ref = ft::RunReference(ft::OptimizerKind::kAdam, kSteps);
  const std::string root = fairscale::testing::UniqueTmpPath("fsdp_item_per_param");
  auto make = [](std::shared_ptr<comm::Communicator> comm, bool flat) {
    const auto opts = fsdp::FsdpOptions().flatten_parameters(flat);
    return fsdp::FullyShardedDataParallel(ft::NestedNet(comm, opts), comm, opts);
  };
  fsdp::StateDict saved;
  ExpectAllOk(RunInprocRanks(2, [&](int rank, int w, std::shared_ptr<comm::Communicator> comm)
                                    -> absl::Status {
    auto model = make(comm, /*flat=*/false);
    auto opt = ft::MakeOptimizer(ft::OptimizerKind::kAdam, model->parameters());
    TrainState state;
    state.add("model", fsdp_item(model, opt.get()));
    CheckpointManager m(comm, CheckpointManagerOptions(root).async(true));
    ft::TrainSteps(model, *opt, 0, kSaveAt, rank, w);
    fsdp::StateDict sd = fsdp::full_state_dict(model, true);
    if (rank == 0) saved = sd;
    m.save(kSaveAt, state);
    m.wait();
    return absl::OkStatus();
  }), "save per-parameter at 2");
  for (const auto& [world, flat] : std::vector<std::pair<int, bool>>{{3, true}, {1, false}}) {
    ExpectAllOk(RunInprocRanks(world, [&, flat = flat](int rank, int w,
                                                      std::shared_ptr<comm::Communicator> comm)
                                          -> absl::Status {
      auto model = make(comm, flat);
      auto opt = ft::MakeOptimizer(ft::OptimizerKind::kAdam, model->parameters());
      TrainState state;
      state.add("model", fsdp_item(model, opt.get()));
      CheckpointManager m(comm, CheckpointManagerOptions(root));
      FS_RETURN_IF_ERROR(Check(m.restore(state) == kSaveAt, "restored step"));
      const fsdp::StateDict loaded = fsdp::full_state_dict(model, true);
      if (rank == 0) FS_RETURN_IF_ERROR(ft::SameDict(loaded, saved, "restored vs saved"));
      const auto losses = ft::TrainSteps(model, *opt, kSaveAt, kSteps, rank, w);
      return ft::ExpectReferenceLosses(ref, losses, kSaveAt, rank, w);
    }), absl::StrCat("restore at ", world, flat ? " flat" : " per-parameter"));
  }
}

// A stage's model: fixed weights per stage (the global generator is shared by thread ranks).
struct StageNetImpl : torch::nn::Module {
  torch::nn::Linear fc = register_module("fc", torch::nn::Linear(4, 3));
  explicit StageNetImpl(int stage) {
    c10::NoGradGuard g;
    fc->weight.copy_(at::arange(12, at::kFloat).reshape({3, 4}).mul(0.1 * (stage + 1)).sin());
    fc->bias.fill_(0.5 * stage);
  }
  at::Tensor forward(at::Tensor x) { return fc(x); }
};
TORCH_MODULE(StageNet);

// Two pipeline stages, each an FSDP model over the communicator of its replicas (rank = replica *
// stages + stage, like pipe::MakePipeGrid), saved at 2 replicas through stage_item(fsdp_item):
// each stage restores its own state at 1 and 3 replicas; another number of stages is refused.
TEST(FsdpItemTest, PipelineStagesRestoreAtOtherReplicaCounts) {
  constexpr int kStages = 2;
  const std::string root = fairscale::testing::UniqueTmpPath("stage_item");
  std::vector<fsdp::StateDict> saved(kStages);
  auto run = [&](int replicas, bool save) {
    ExpectAllOk(RunInprocRanks(kStages * replicas, [&](int rank, int, std::shared_ptr<comm::Communicator> comm)
                                                       -> absl::Status {
      const int stage = rank % kStages, replica = rank / kStages;
      auto stage_comm = comm->Split(stage, replica);
      FS_RETURN_IF_ERROR(stage_comm.status());
      fsdp::FullyShardedDataParallel model(StageNet(stage), *stage_comm);
      torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(0.1));
      TrainState state;
      state.add("pipe", stage_item(stage, kStages, replica, replicas, fsdp_item(model, &opt)));
      CheckpointManager m(comm, CheckpointManagerOptions(root));
      if (save) {
        for (int step = 0; step < 2; ++step) {
          opt.zero_grad();
          model(at::full({2, 4}, 0.25 * (replica + step + 1))).pow(2).sum().backward();
          opt.step();
        }
        m.save(2, state);
        fsdp::StateDict sd = fsdp::full_state_dict(model, true);
        if (replica == 0) saved[stage] = sd;
        return absl::OkStatus();
      }
      FS_RETURN_IF_ERROR(Check(m.restore(state) == 2, "restored"));
      const fsdp::StateDict loaded = fsdp::full_state_dict(model, true);
      if (replica == 0) FS_RETURN_IF_ERROR(ft::SameDict(loaded, saved[stage], "stage state"));
      return absl::OkStatus();
    }), absl::StrCat(save ? "save" : "restore", " at ", replicas, " replicas"));
  };
  run(2, true);
  run(1, false);
  run(3, false);
  // Three stages cannot load a two-stage checkpoint.
  ExpectAllOk(RunInprocRanks(3, [&](int rank, int, std::shared_ptr<comm::Communicator> comm)
                                    -> absl::Status {
    auto stage_comm = comm->Split(rank, 0);
    FS_RETURN_IF_ERROR(stage_comm.status());
    fsdp::FullyShardedDataParallel model(StageNet(rank), *stage_comm);
    TrainState state;
    state.add("pipe", stage_item(rank, 3, 0, 1, fsdp_item(model, nullptr)));
    CheckpointManager m(comm, CheckpointManagerOptions(root));
    try {
      m.restore(state);
      return absl::InternalError("restored a 2-stage checkpoint into 3 stages");
    } catch (const c10::Error& e) {
      return Check(absl::StrContains(e.what(), "holds 2 pipeline stages, this run has 3"), e.what());
    }
  }), "3 stages");
}

}  // namespace
}  // namespace fairscale::train_state
