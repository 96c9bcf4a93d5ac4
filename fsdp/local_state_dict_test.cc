// local_state_dict / load_local_state_dict and the per-rank checkpoint files: training 5 steps,
// saving, building a fresh model and optimizer, loading and training 5 more must give bitwise the
// shards of 10 uninterrupted steps (and match the single-process reference), for 1-4 thread ranks
// and every strategy; loading at another world size or into a differently wrapped model is a
// c10::Error that says what differs.
#include <torch/optim/optimizer.h>

#include <fstream>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "base/status_matchers.h"
#include "comm/testing/inproc_ranks.h"
#include "fsdp/fully_sharded_data_parallel.h"
#include "fsdp/local_checkpoint.h"
#include "fsdp/test_util.h"
#include "fsdp/testing/checkpoint_helpers.h"
#include "gtest/gtest.h"

namespace fairscale::fsdp {
namespace {

using testing::OptimizerKind;

using testing::Check;
using testing::ExpectAllOk;
using testing::ExpectError;
using testing::MakeModel;
using testing::TmpPath;
using testing::TrainSteps;

struct Case {
  ShardingStrategy strategy;
  bool nested;
  OptimizerKind kind;
};

TEST(FsdpLocalStateDict, ResumeFromCheckpointIsBitwiseIdentical) {
  const Case cases[] = {{ShardingStrategy::kFullShard, true, OptimizerKind::kAdam},
                        {ShardingStrategy::kShardGradOp, false, OptimizerKind::kSgdMomentum},
                        {ShardingStrategy::kNoShard, true, OptimizerKind::kAdamW}};
  for (const Case &c : cases) {
    const auto ref = testing::RunReference(c.kind, 10);
    for (int world = 1; world <= 4; ++world) {
      ExpectAllOk(
          comm::testing::RunInprocRanks(
              world,
              [&](int rank, int w, std::shared_ptr<comm::Communicator> comm) -> absl::Status {
                const std::string path = TmpPath(absl::StrCat(
                    "resume_", ShardingStrategyName(c.strategy), "_w", w, "_r", rank, ".pt"));
                // Uninterrupted.
                FullyShardedDataParallel straight = MakeModel(comm, c.strategy, c.nested);
                auto straight_opt = testing::MakeOptimizer(c.kind, straight->parameters());
                TrainSteps(straight, *straight_opt, 0, 10, rank, w);
                // Interrupted after 5 steps.
                {
                  FullyShardedDataParallel first = MakeModel(comm, c.strategy, c.nested);
                  auto opt = testing::MakeOptimizer(c.kind, first->parameters());
                  TrainSteps(first, *opt, 0, 5, rank, w);
                  save_local_checkpoint(first, opt.get(), path);
                }
                FullyShardedDataParallel resumed = MakeModel(comm, c.strategy, c.nested);
                auto opt = testing::MakeOptimizer(c.kind, resumed->parameters());
                load_local_checkpoint(resumed, opt.get(), path);
                TrainSteps(resumed, *opt, 5, 10, rank, w);

                const auto a = straight->local_state_dict();
                const auto b = resumed->local_state_dict();
                FS_RETURN_IF_ERROR(Check(a.shards.size() == b.shards.size(), "shard count"));
                for (size_t i = 0; i < a.shards.size(); ++i) {
                  FS_RETURN_IF_ERROR(Check(
                      at::equal(a.shards[i].tensor, b.shards[i].tensor),
                      absl::StrCat(ShardingStrategyName(c.strategy), " unit '", a.shards[i].unit,
                                   "' ", a.shards[i].info.name, ": resumed != uninterrupted")));
                }
                return testing::CheckShards(resumed, ref[9].params,
                                            /*grads=*/false, "resumed vs reference", 1e-5);
              }),
          ShardingStrategyName(c.strategy));
    }
  }
}

TEST(FsdpLocalStateDict, MetadataDescribesTheShards) {
  ExpectAllOk(
      comm::testing::RunInprocRanks(
          3,
          [](int rank, int world, std::shared_ptr<comm::Communicator> comm) {
            auto model = MakeModel(comm, ShardingStrategy::kFullShard, true);
            const LocalStateDict sd = model->local_state_dict();
            FS_RETURN_IF_ERROR(Check(sd.rank == rank && sd.world_size == world, "ids"));
            FS_RETURN_IF_ERROR(Check(sd.shards.size() == 3, "3 units"));
            FS_RETURN_IF_ERROR(Check(sd.shards[0].unit == "" && sd.shards[1].unit == "block0." &&
                                         sd.shards[2].unit == "block1.",
                                     "unit prefixes"));
            for (const auto &s : sd.shards) {
              FS_RETURN_IF_ERROR(Check(s.tensor.numel() == s.info.shard_numel &&
                                           s.info.padded_numel == world * s.info.shard_numel &&
                                           s.info.shard_offset == rank * s.info.shard_numel &&
                                           s.info.params.front().name.rfind(s.unit, 0) == 0,
                                       "layout of " + s.unit));
            }
            return absl::OkStatus();
          }),
      "metadata");
}

TEST(FsdpLocalStateDict, OtherWorldSizeIsAClearError) {
  ExpectAllOk(comm::testing::RunInprocRanks(2,
                                [](int rank, int, std::shared_ptr<comm::Communicator> comm) {
                                  auto model = MakeModel(comm, ShardingStrategy::kFullShard, true);
                                  save_local_checkpoint(model, nullptr,
                                                        TmpPath(absl::StrCat("ws2_r", rank)));
                                  return absl::OkStatus();
                                }),
              "save");
  for (int world : {1, 4}) {
    ExpectAllOk(
        comm::testing::RunInprocRanks(world,
                          [](int rank, int w, std::shared_ptr<comm::Communicator> comm) {
                            auto model = MakeModel(comm, ShardingStrategy::kFullShard, true);
                            return ExpectError(
                                [&] {
                                  load_local_checkpoint(model, nullptr,
                                                        TmpPath(absl::StrCat("ws2_r", rank % 2)));
                                },
                                {"saved at world size 2", absl::StrCat("runs at world size ", w),
                                 absl::StrCat("rank ", rank, "/", w)});
                          }),
        "load at another world size");
  }
}

TEST(FsdpLocalStateDict, DifferentWrappingIsAClearError) {
  ExpectAllOk(comm::testing::RunInprocRanks(
                  2,
                  [](int rank, int, std::shared_ptr<comm::Communicator> comm) -> absl::Status {
                    auto nested = MakeModel(comm, ShardingStrategy::kFullShard, true);
                    const LocalStateDict sd = nested->local_state_dict();
                    auto flat = MakeModel(comm, ShardingStrategy::kFullShard, false);
                    FS_RETURN_IF_ERROR(ExpectError([&] { flat->load_local_state_dict(sd); },
                                                   {"wrapped differently", "'block0.'", "rank "}));
                    auto other = MakeModel(comm, ShardingStrategy::kShardGradOp, true);
                    FS_RETURN_IF_ERROR(ExpectError([&] { other->load_local_state_dict(sd); },
                                                   {"FULL_SHARD", "SHARD_GRAD_OP", "unit ''"}));
                    // A checkpoint without optimizer state cannot restore one.
                    const std::string path = TmpPath(absl::StrCat("noopt_r", rank));
                    save_local_checkpoint(nested, nullptr, path);
                    auto opt = testing::MakeOptimizer(OptimizerKind::kAdam, nested->parameters());
                    return ExpectError([&] { load_local_checkpoint(nested, opt.get(), path); },
                                       {"without optimizer state", path});
                  }),
              "wrapping");
}

}  // namespace
}  // namespace fairscale::fsdp
