// Parity of FullyShardedDataParallel with a single-process reference: the same initial weights,
// the global batch split across 1-4 ranks (threads over //comm/inproc), 10 steps; losses,
// gradient shards and parameter shards must match within 1e-5 relative (L2 norm of the error
// over the norm of the reference) in f32, for every strategy, nested or not, with SGD+momentum,
// Adam and AdamW stepping the shards.
#include <map>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "base/status_matchers.h"
#include "comm/registry.h"
#include "comm/testing/rank_runner.h"
#include "fsdp/fully_sharded_data_parallel.h"
#include "fsdp/test_util.h"
#include "gtest/gtest.h"

namespace fairscale::fsdp {
namespace {

using base::testing::IsOk;
using testing::OptimizerKind;

constexpr int kSteps = 10;
constexpr double kRtol = 1e-5;

const std::vector<testing::ReferenceStep>& Reference(OptimizerKind kind) {
  static auto* cache = new std::map<OptimizerKind, std::vector<testing::ReferenceStep>>();
  auto it = cache->find(kind);
  if (it == cache->end()) it = cache->emplace(kind, testing::RunReference(kind, kSteps)).first;
  return it->second;
}

absl::Status RunRank(int rank, int world, OptimizerKind kind, ShardingStrategy strategy,
                     bool nested) {
  FS_ASSIGN_OR_RETURN(
      std::shared_ptr<comm::Communicator> comm,
      comm::CreateCommunicator("inproc", comm::testing::RankConfig(absl::Seconds(30))));
  const auto opts = FsdpOptions().sharding_strategy(strategy);
  FullyShardedDataParallel model(testing::Net(nested ? comm : nullptr, opts), comm, opts);
  auto opt = testing::MakeOptimizer(kind, model->parameters());
  const auto& ref = Reference(kind);
  for (int step = 0; step < kSteps; ++step) {
    const std::string at_step = absl::StrCat("step ", step, " rank ", rank, "/", world);
    opt->zero_grad();
    testing::Batch b = testing::GlobalBatch(step);
    at::Tensor y = testing::RankRows(b.y, rank, world);
    at::Tensor loss = testing::Mse(model(testing::RankRows(b.x, rank, world)), y);
    FS_RETURN_IF_ERROR(testing::ExpectClose(
        at_step + " loss", loss, testing::Mse(testing::RankRows(ref[step].output, rank, world), y),
        kRtol));
    loss.backward();
    FS_RETURN_IF_ERROR(
        testing::CheckShards(model, ref[step].grads, /*grads=*/true, at_step + " grad", kRtol));
    opt->step();
    FS_RETURN_IF_ERROR(testing::CheckShards(model, ref[step].params, /*grads=*/false,
                                            at_step + " param", kRtol));
  }
  return absl::OkStatus();
}

using ParityParam = std::tuple<OptimizerKind, ShardingStrategy, bool>;
class ParityTest : public ::testing::TestWithParam<ParityParam> {};

TEST_P(ParityTest, MatchesSingleProcessReference) {
  const auto [kind, strategy, nested] = GetParam();
  Reference(kind);  // computed once, before the rank threads read it
  for (int world = 1; world <= 4; ++world) {
    std::vector<absl::Status> statuses = comm::testing::RunThreads(
        world,
        [&, kind = kind, strategy = strategy, nested = nested](int rank) -> absl::Status {
          try {
            return RunRank(rank, world, kind, strategy, nested);
          } catch (const std::exception& e) {
            return absl::InternalError(e.what());
          }
        },
        absl::Seconds(50));
    for (int r = 0; r < world; ++r) {
      EXPECT_THAT(statuses[r], IsOk()) << "world " << world << " rank " << r;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(All, ParityTest,
                         ::testing::Combine(::testing::Values(OptimizerKind::kSgdMomentum,
                                                              OptimizerKind::kAdam,
                                                              OptimizerKind::kAdamW),
                                            ::testing::Values(ShardingStrategy::kFullShard,
                                                              ShardingStrategy::kShardGradOp,
                                                              ShardingStrategy::kNoShard),
                                            ::testing::Bool()),
                         [](const ::testing::TestParamInfo<ParityParam>& info) {
                           return absl::StrCat(testing::OptimizerName(std::get<0>(info.param)), "_",
                                               ShardingStrategyName(std::get<1>(info.param)),
                                               std::get<2>(info.param) ? "_Nested" : "_Flat");
                         });

}  // namespace
}  // namespace fairscale::fsdp
