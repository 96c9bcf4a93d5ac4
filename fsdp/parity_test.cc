// Parity of FullyShardedDataParallel with a single-process reference: the same initial weights,
// the global batch split across 1-4 ranks (threads over //comm/inproc), 10 steps; losses,
// gradient shards and parameter shards must match within 1e-5 relative (L2 norm of the error
// over the norm of the reference) in f32, for every strategy, nested or not, with SGD+momentum,
// Adam and AdamW stepping the shards.
#include <map>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "comm/testing/inproc_ranks.h"
#include "comm/testing/rank_runner.h"
#include "fsdp/fully_sharded_data_parallel.h"
#include "fsdp/test_util.h"
#include "gtest/gtest.h"

namespace fairscale::fsdp {
namespace {

using testing::OptimizerKind;

constexpr int kSteps = 10;
constexpr double kRtol = 1e-5;

const std::vector<testing::ReferenceStep>& Reference(OptimizerKind kind) {
  static auto* cache = new std::map<OptimizerKind, std::vector<testing::ReferenceStep>>();
  auto it = cache->find(kind);
  if (it == cache->end()) it = cache->emplace(kind, testing::RunReference(kind, kSteps)).first;
  return it->second;
}

absl::Status RunRank(int rank, int world, std::shared_ptr<comm::Communicator> comm,
                     OptimizerKind kind, ShardingStrategy strategy, bool nested) {
  const auto opts = FsdpOptions().sharding_strategy(strategy);
  FullyShardedDataParallel model(testing::NestedNet(nested ? comm : nullptr, opts), comm, opts);
  auto opt = testing::MakeOptimizer(kind, model->parameters());
  return testing::TrainMatchesReference(model, *opt, Reference(kind), rank, world, kRtol);
}

using ParityParam = std::tuple<OptimizerKind, ShardingStrategy, bool>;
class ParityTest : public ::testing::TestWithParam<ParityParam> {};

TEST_P(ParityTest, MatchesSingleProcessReference) {
  const auto [kind, strategy, nested] = GetParam();
  Reference(kind);  // computed once, before the rank threads read it
  for (int world = 1; world <= 4; ++world) {
    comm::testing::ExpectAllOk(comm::testing::RunInprocRanks(
                                   world,
                                   [&, kind = kind, strategy = strategy, nested = nested](
                                       int rank, int w, std::shared_ptr<comm::Communicator> comm) {
                                     return RunRank(rank, w, std::move(comm), kind, strategy,
                                                    nested);
                                   }),
                               absl::StrCat("world ", world));
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
