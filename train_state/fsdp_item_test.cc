// fsdp_item through the CheckpointManager: an FSDP model with Adam saved at 4 ranks (sync and
// async; after an async save returns, training goes on and must not leak into the checkpoint)
// restores at 1, 2 and 3 ranks to the saved full state dict and then trains like the
// uninterrupted single-process reference.
#include "train_state/fsdp_item.h"

#include <c10/core/GradMode.h>

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

}  // namespace
}  // namespace fairscale::train_state
