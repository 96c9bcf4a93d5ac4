// HYBRID_SHARD and _HYBRID_SHARD_ZERO2: sharded inside groups (Communicator::Split by group size,
// by host, or the user's communicators), replicated across them. Checked with real collectives
// (threads over //comm/inproc) against the single-process reference of test_util.h:
// * parity of gradients and parameters (1e-5 relative, Adam, several steps) at 4 ranks as 2x2,
//   4x1 (= FULL_SHARD) and 1x4 (= NO_SHARD), 2 ranks as 2x1 and 1x2, 3 ranks as 3x1 (padding),
//   flat and nested, frozen and unused parameters (odd flat sizes), bucketed reductions, bf16
//   mixed precision with f32 and bf16 reductions (kMixedRtol as in edge_case_test);
// * bytes on each communicator: all-gathers and reduce-scatters of the padded flat parameter in
//   the shard group, one all-reduce of the shard in the replicate group, nothing on the world;
// * clip_grad_norm_ equals the reference's global norm (each element counted once);
// * full / optimizer / local state dicts and sharded checkpoints: saved at 4 ranks as 2x2 and
//   loaded at 2 and 3 ranks (FULL_SHARD) and the other way round, continuing like the
//   uninterrupted run;
// * bad group sizes and groups are errors naming the value and the world size.
#include <ATen/ops/equal.h>

#include <cmath>
#include <tuple>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "base/status_matchers.h"
#include "comm/testing/counting_communicator.h"
#include "comm/testing/inproc_ranks.h"
#include "fsdp/fully_sharded_data_parallel.h"
#include "fsdp/internal/hybrid_groups.h"
#include "fsdp/local_checkpoint.h"
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
using testing::OptimizerKind;

constexpr int kSteps = 4;
// bf16 compute against the f32 reference (as edge_case_test's): measured at most 3.6e-2 on a
// gradient shard, 1.2e-3 on a parameter shard (2x2, nested, both strategies, f32 and bf16
// reduction, bucketed or not).
const testing::ParityRtol kMixedRtol(/*grad_rtol=*/6e-2, /*param_rtol=*/5e-3);
constexpr ShardingStrategy kHybrids[] = {ShardingStrategy::kHybridShard,
                                         ShardingStrategy::kHybridShardZero2};

FsdpOptions Hybrid(ShardingStrategy strategy, int group_size) {
  return FsdpOptions().sharding_strategy(strategy).hybrid_shard_group_size(group_size);
}

using testing::MseStep;

auto MakeNet(testing::NetConfig config = {}) {
  return [config](std::shared_ptr<comm::Communicator> comm, FsdpOptions opts) {
    return testing::NestedNet(comm, opts, config);
  };
}

struct Layout {
  int world;
  int group_size;
};
// (world, shard group size): 2x2, 4x1, 1x4, 2x1, 1x2, 3x1 (shard groups x groups).
constexpr Layout kLayouts[] = {{4, 2}, {4, 4}, {4, 1}, {2, 2}, {2, 1}, {3, 3}};

template <typename MakeFn, typename StepFn>
void ExpectHybridParity(const std::string& what, MakeFn make, StepFn step_fn, FsdpOptions base,
                        testing::ParityRtol rtol, std::vector<Layout> layouts,
                        std::vector<bool> nestings) {
  const auto ref = testing::RunReferenceWith(make, step_fn, OptimizerKind::kAdam, kSteps);
  for (ShardingStrategy strategy : kHybrids) {
    for (bool nested : nestings) {
      for (const Layout& l : layouts) {
        FsdpOptions opts = base;
        opts.sharding_strategy(strategy).hybrid_shard_group_size(l.group_size);
        ExpectAllOk(
            comm::testing::RunInprocRanks(
                l.world,
                [&](int rank, int w, std::shared_ptr<comm::Communicator> c) {
                  return testing::RunParityRank(make, step_fn, OptimizerKind::kAdam, ref, opts,
                                                nested, rank, w, c, rtol);
                }),
            absl::StrCat(what, " ", ShardingStrategyName(strategy), " ", l.world / l.group_size,
                         " groups of ", l.group_size, nested ? " nested" : " flat"));
      }
    }
  }
}

TEST(HybridShard, MatchesTheSingleProcessReference) {
  ExpectHybridParity("f32", MakeNet(), MseStep(), FsdpOptions(), 1e-5,
                     {std::begin(kLayouts), std::end(kLayouts)}, {false, true});
}

// Frozen parameters (a second, odd-sized flat parameter per unit), a block unused on odd steps,
// gradients bucketed (each bucket reduce-scattered in the shard group, then all-reduced).
TEST(HybridShard, FrozenUnusedAndBucketedKeepParity) {
  testing::NetConfig config;
  config.frozen = {"fc_in.weight", "block0.fc1.bias"};
  config.with_unused = true;
  testing::MseStepSkippingBlockOnOddSteps step_fn;
  for (double cap : {0.0, 1.0}) {
    ExpectHybridParity(absl::StrCat("frozen+unused bucket_cap_mb=", cap), MakeNet(config), step_fn,
                       FsdpOptions().bucket_cap_mb(cap), 1e-5, {{4, 2}, {3, 3}}, {true});
  }
}

TEST(HybridShard, Bf16MixedPrecisionTracksTheReference) {
  for (at::ScalarType reduce : {at::kFloat, at::kBFloat16}) {
    for (double cap : {0.0, 1.0}) {
      ExpectHybridParity(
          absl::StrCat("bf16 reduce=", c10::toString(reduce), " bucket_cap_mb=", cap), MakeNet(),
          MseStep(),
          FsdpOptions().bucket_cap_mb(cap).mixed_precision(
              MixedPrecision().param_dtype(at::kBFloat16).reduce_dtype(reduce)),
          kMixedRtol, {{4, 2}}, {true});
    }
  }
}

// bf16 against bf16: HYBRID_SHARD (2 groups of 2) and FULL_SHARD over the same 4 ranks, same
// mixed precision, trained side by side. Every rank computes the same bf16 forward and backward
// on its rows in both; only the reduction differs (a reduce-scatter in the group, then an
// all-reduce across, against one reduce-scatter over 4). Reduced in f32 the two runs are
// bitwise equal, losses and the parameters after kSteps (the per-rank gradients are bf16 values,
// which f32 sums here without rounding in either order, and the divide factors are powers of 2);
// reduced in bf16 the partial sums are rounded at other points: measured at most 4.0e-3 on a
// loss (one bf16 ulp) and 2.2e-4 on a parameter, far below the bf16-vs-f32 differences above.
TEST(HybridShard, Bf16MatchesBf16FullShard) {
  struct Case {
    at::ScalarType reduce;
    double loss_rtol;
    double param_rtol;
  };
  for (const Case& c : {Case{at::kFloat, 0, 0}, Case{at::kBFloat16, 1e-2, 1e-3}}) {
    const auto mp = MixedPrecision().param_dtype(at::kBFloat16).reduce_dtype(c.reduce);
    ExpectAllOk(
        comm::testing::RunInprocRanks(
            4,
            [&](int rank, int world, std::shared_ptr<comm::Communicator> comm) -> absl::Status {
              const auto full_opts =
                  FsdpOptions().sharding_strategy(ShardingStrategy::kFullShard).mixed_precision(mp);
              const auto hybrid_opts =
                  Hybrid(ShardingStrategy::kHybridShard, 2).mixed_precision(mp);
              FullyShardedDataParallel full(testing::NestedNet(comm, full_opts), comm, full_opts);
              FullyShardedDataParallel hybrid(testing::NestedNet(comm, hybrid_opts), comm,
                                              hybrid_opts);
              auto full_opt = testing::MakeOptimizer(OptimizerKind::kAdam, full->parameters());
              auto hybrid_opt = testing::MakeOptimizer(OptimizerKind::kAdam, hybrid->parameters());
              for (int step = 0; step < kSteps; ++step) {
                const auto want = testing::TrainSteps(full, *full_opt, step, step + 1, rank, world);
                const auto got =
                    testing::TrainSteps(hybrid, *hybrid_opt, step, step + 1, rank, world);
                FS_RETURN_IF_ERROR(testing::ExpectClose(
                    absl::StrCat("loss of step ", step, " rank ", rank), got[0].to(at::kFloat),
                    want[0].to(at::kFloat), c.loss_rtol));
              }
              const StateDict want = full_state_dict(full, /*rank0_only=*/true);
              const StateDict got = full_state_dict(hybrid, /*rank0_only=*/true);
              if (rank != 0) return absl::OkStatus();
              FS_RETURN_IF_ERROR(Check(got.keys() == want.keys(), "the names differ"));
              for (const auto& item : want) {
                FS_RETURN_IF_ERROR(testing::ExpectClose(
                    absl::StrCat("parameter ", item.key(), " after ", kSteps, " steps"),
                    got[item.key()], item.value(), c.param_rtol));
              }
              return absl::OkStatus();
            }),
        absl::StrCat("bf16 reduce=", c10::toString(c.reduce)));
  }
}

// The user's communicators, wrapped to count: per step, the shard group moves FULL_SHARD's bytes
// for a world of its size, the replicate group one all-reduce of the shard, the world nothing.
TEST(HybridShard, CommunicatesInsideTheGroupAndReducesTheShardAcross) {
  for (ShardingStrategy strategy : kHybrids) {
    ExpectAllOk(
        comm::testing::RunInprocRanks(
            4,
            [&](int rank, int world, std::shared_ptr<comm::Communicator> inner) -> absl::Status {
              auto counting_world = std::make_shared<comm::testing::CountingCommunicator>(inner);
              FS_ASSIGN_OR_RETURN(auto shard, inner->Split(rank / 2, rank));
              FS_ASSIGN_OR_RETURN(auto replicate, inner->Split(rank % 2, rank));
              auto counting_shard = std::make_shared<comm::testing::CountingCommunicator>(shard);
              auto counting_replicate =
                  std::make_shared<comm::testing::CountingCommunicator>(replicate);
              const auto opts = FsdpOptions()
                                    .sharding_strategy(strategy)
                                    .disable_reshard_on_root(false)
                                    .hybrid_shard_groups(counting_shard, counting_replicate);
              FullyShardedDataParallel model(testing::NestedNet(nullptr, opts), counting_world,
                                             opts);
              FS_RETURN_IF_ERROR(Check(model->shard_world_size() == 2 &&
                                           model->shard_rank() == rank % 2 &&
                                           model->replicate_rank() == rank / 2,
                                       "group ranks"));
              auto opt = testing::MakeOptimizer(OptimizerKind::kAdam, model->parameters());
              for (int step = 0; step < 2; ++step) {
                counting_world->Reset();
                counting_shard->Reset();
                counting_replicate->Reset();
                opt->zero_grad();
                MseStep()(model, step, rank, world);
                opt->step();
                // 350 parameters in one flat parameter: shards of 175 f32 in a group of 2.
                const int64_t full = 350 * 4;
                const int64_t gathers = strategy == ShardingStrategy::kHybridShard ? 2 : 1;
                using comm::OpType;
                const auto ag = counting_shard->count(OpType::kAllGather);
                const auto rs = counting_shard->count(OpType::kReduceScatter);
                const auto ar = counting_replicate->count(OpType::kAllReduce);
                const std::string at = absl::StrCat("step ", step, " rank ", rank);
                FS_RETURN_IF_ERROR(Check(ag.ops == gathers && ag.bytes == gathers * full,
                                         absl::StrCat(at, ": all_gather ", ag.ops, " ops ",
                                                      ag.bytes, " bytes")));
                FS_RETURN_IF_ERROR(Check(rs.ops == 1 && rs.bytes == full,
                                         absl::StrCat(at, ": reduce_scatter ", rs.ops, " ops ",
                                                      rs.bytes, " bytes")));
                FS_RETURN_IF_ERROR(Check(ar.ops == 1 && ar.bytes == full / 2,
                                         absl::StrCat(at, ": replicate all_reduce ", ar.ops,
                                                      " ops ", ar.bytes, " bytes")));
                for (OpType t : {OpType::kAllGather, OpType::kReduceScatter, OpType::kAllReduce,
                                 OpType::kBroadcast}) {
                  FS_RETURN_IF_ERROR(Check(counting_world->count(t).ops == 0,
                                           at + ": the world communicator was used"));
                }
                FS_RETURN_IF_ERROR(Check(counting_shard->count(OpType::kAllReduce).ops == 0 &&
                                             counting_replicate->count(OpType::kAllGather).ops == 0,
                                         at + ": an operation on the wrong group"));
              }
              return absl::OkStatus();
            }),
        ShardingStrategyName(strategy));
  }
}

TEST(HybridShard, ClipGradNormCountsEachElementOnce) {
  const auto ref = testing::RunReference(OptimizerKind::kAdam, 1);
  double sum = 0;
  for (const auto& [name, g] : ref[0].grads) sum += g.to(at::kDouble).pow(2).sum().item<double>();
  const double expected = std::sqrt(sum);
  for (const Layout& l : {Layout{4, 2}, Layout{4, 1}, Layout{2, 1}}) {
    ExpectAllOk(comm::testing::RunInprocRanks(
                    l.world,
                    [&](int rank, int world,
                        std::shared_ptr<comm::Communicator> c) -> absl::Status {
                      const auto opts = Hybrid(ShardingStrategy::kHybridShard, l.group_size);
                      FullyShardedDataParallel model(testing::NestedNet(c, opts), c, opts);
                      MseStep()(model, 0, rank, world);
                      const double norm = model->clip_grad_norm_(1e9).item<double>();
                      return Check(std::abs(norm - expected) <= 1e-5 * expected,
                                   absl::StrCat("norm ", norm, ", reference ", expected));
                    }),
                absl::StrCat("groups of ", l.group_size));
  }
}

constexpr int kSaveAt = 2;

// Trains a 2x2 HYBRID_SHARD model for kSaveAt steps at 4 ranks and saves it every way; returns
// rank 0's full state dict and optimizer state.
std::pair<StateDict, FullOptimState> SaveHybrid(const std::string& dir) {
  StateDict sd;
  FullOptimState osd;
  ExpectAllOk(comm::testing::RunInprocRanks(
                  4,
                  [&](int rank, int world, std::shared_ptr<comm::Communicator> c) -> absl::Status {
                    const auto opts = Hybrid(ShardingStrategy::kHybridShard, 2);
                    FullyShardedDataParallel model(testing::NestedNet(c, opts), c, opts);
                    auto opt = testing::MakeOptimizer(OptimizerKind::kAdam, model->parameters());
                    testing::TrainSteps(model, *opt, 0, kSaveAt, rank, world);
                    save_sharded_checkpoint(model, opt.get(), dir);
                    StateDict full = full_state_dict(model, true);
                    FullOptimState full_osd = full_optim_state_dict(model, *opt, true);
                    // A local state dict loads into an identically wrapped model.
                    const LocalStateDict local = model->local_state_dict();
                    FullyShardedDataParallel copy(testing::NestedNet(c, opts), c, opts);
                    copy->load_local_state_dict(local);
                    StateDict copied = full_state_dict(copy, true);
                    if (rank == 0) {
                      FS_RETURN_IF_ERROR(testing::SameDict(copied, full, "local state dict"));
                      sd = full;
                      osd = full_osd;
                    }
                    return absl::OkStatus();
                  }),
              "save hybrid");
  return {sd, osd};
}

TEST(HybridShard, CheckpointsMoveBetweenHybridAndFullShard) {
  const auto ref = testing::RunReference(OptimizerKind::kAdam, kSteps);
  const std::string dir = testing::TmpPath("hybrid_ckpt");
  const auto [saved, saved_osd] = SaveHybrid(dir);
  ASSERT_FALSE(saved.is_empty());
  // The consolidated checkpoint (every element written by exactly one rank) is the full dict.
  absl::StatusOr<ConsolidatedCheckpoint> consolidated = consolidate_sharded_checkpoint(dir);
  ASSERT_TRUE(consolidated.ok()) << consolidated.status();
  EXPECT_THAT(testing::SameDict(consolidated->state_dict, saved, "consolidated"),
              base::testing::IsOk());
  for (int world : {2, 3}) {
    for (bool sharded_ckpt : {true, false}) {
      ExpectAllOk(
          comm::testing::RunInprocRanks(
              world,
              [&](int rank, int w, std::shared_ptr<comm::Communicator> c) -> absl::Status {
                auto model = testing::MakeModel(c, ShardingStrategy::kFullShard, /*nested=*/true);
                auto opt = testing::MakeOptimizer(OptimizerKind::kAdam, model->parameters());
                if (sharded_ckpt) {
                  load_sharded_checkpoint(model, opt.get(), dir);
                } else {
                  load_full_state_dict(model, saved, /*from_rank0=*/true);
                  load_full_optim_state_dict(model, *opt, saved_osd, /*from_rank0=*/true);
                }
                const StateDict loaded = full_state_dict(model, true);
                if (rank == 0) FS_RETURN_IF_ERROR(testing::SameDict(loaded, saved, "loaded"));
                const auto losses = testing::TrainSteps(model, *opt, kSaveAt, kSteps, rank, w);
                return testing::ExpectReferenceLosses(ref, losses, kSaveAt, rank, w);
              }),
          absl::StrCat("hybrid 2x2 -> FULL_SHARD at ", world,
                       sharded_ckpt ? " (sharded checkpoint)" : " (full state dicts)"));
    }
  }
  // And back: FULL_SHARD at 2 ranks -> 2x2 HYBRID_SHARD and 1x4 _HYBRID_SHARD_ZERO2 at 4.
  const std::string dir2 = testing::TmpPath("full_shard_ckpt");
  ExpectAllOk(comm::testing::RunInprocRanks(
                  2,
                  [&](int rank, int w, std::shared_ptr<comm::Communicator> c) -> absl::Status {
                    auto model = testing::MakeModel(c, ShardingStrategy::kFullShard, false);
                    auto opt = testing::MakeOptimizer(OptimizerKind::kAdam, model->parameters());
                    testing::TrainSteps(model, *opt, 0, kSaveAt, rank, w);
                    save_sharded_checkpoint(model, opt.get(), dir2);
                    return absl::OkStatus();
                  }),
              "save FULL_SHARD at 2");
  for (const auto& [strategy, group] :
       {std::make_pair(ShardingStrategy::kHybridShard, 2),
        std::make_pair(ShardingStrategy::kHybridShardZero2, 1)}) {
    ExpectAllOk(
        comm::testing::RunInprocRanks(
            4,
            [&, strategy = strategy, group = group](
                int rank, int w, std::shared_ptr<comm::Communicator> c) -> absl::Status {
              const auto opts = Hybrid(strategy, group);
              FullyShardedDataParallel model(testing::NestedNet(c, opts), c, opts);
              auto opt = testing::MakeOptimizer(OptimizerKind::kAdam, model->parameters());
              load_sharded_checkpoint(model, opt.get(), dir2);
              const auto losses = testing::TrainSteps(model, *opt, kSaveAt, kSteps, rank, w);
              FS_RETURN_IF_ERROR(testing::ExpectReferenceLosses(ref, losses, kSaveAt, rank, w));
              return testing::CheckShards(model, ref[kSteps - 1].params, false, "resumed", 1e-5);
            }),
        absl::StrCat("FULL_SHARD at 2 -> ", ShardingStrategyName(strategy), " groups of ", group));
  }
}

TEST(HybridShard, BadGroupsAreClearErrors) {
  ExpectAllOk(
      comm::testing::RunInprocRanks(
          4,
          [&](int rank, int, std::shared_ptr<comm::Communicator> c) -> absl::Status {
            auto make = [&](FsdpOptions opts) {
              return [c, opts] { FullyShardedDataParallel m(testing::Net(), c, opts); };
            };
            FS_RETURN_IF_ERROR(ExpectError(make(Hybrid(ShardingStrategy::kHybridShard, 3)),
                                           {"hybrid_shard_group_size 3", "world size 4"}));
            FS_RETURN_IF_ERROR(ExpectError(make(Hybrid(ShardingStrategy::kHybridShard, -2)),
                                           {"hybrid_shard_group_size must be >= 0", "-2"}));
            FS_RETURN_IF_ERROR(ExpectError(make(Hybrid(ShardingStrategy::kFullShard, 2)),
                                           {"are for HYBRID_SHARD", "FULL_SHARD"}));
            FS_ASSIGN_OR_RETURN(auto shard, c->Split(rank / 2, rank));
            FS_ASSIGN_OR_RETURN(auto replicate, c->Split(rank % 2, rank));
            FS_RETURN_IF_ERROR(ExpectError(
                make(Hybrid(ShardingStrategy::kHybridShard, 2).hybrid_shard_groups(shard, replicate)),
                {"not both"}));
            FS_RETURN_IF_ERROR(ExpectError(make(FsdpOptions()
                                                    .sharding_strategy(ShardingStrategy::kHybridShard)
                                                    .hybrid_shard_groups(c, replicate)),
                                           {"product must be the world size 4"}));
            FS_RETURN_IF_ERROR(ExpectError(make(FsdpOptions()
                                                    .sharding_strategy(ShardingStrategy::kHybridShard)
                                                    .hybrid_shard_groups(shard, nullptr)),
                                           {"both the shard and the replicate"}));
            // The shard group passed as the replicate group too: not the same shard.
            FS_RETURN_IF_ERROR(ExpectError(make(FsdpOptions()
                                                    .sharding_strategy(ShardingStrategy::kHybridShard)
                                                    .hybrid_shard_groups(shard, shard)),
                                           {"the same shard"}));
            // By host (the default): all four ranks on this host form one group (= FULL_SHARD).
            const auto opts = FsdpOptions().sharding_strategy(ShardingStrategy::kHybridShard);
            FullyShardedDataParallel m(testing::Net(), c, opts);
            FS_RETURN_IF_ERROR(Check(m->shard_world_size() == 4 &&
                                         m->replicate_communicator() == nullptr,
                                     "one host: one group of 4"));
            // Hosts a, b, a, b: groups {0, 2} and {1, 3}.
            FS_ASSIGN_OR_RETURN(internal::HybridGroups by_host,
                                internal::SplitByHost(c, rank % 2 == 0 ? "a" : "b"));
            FS_RETURN_IF_ERROR(Check(by_host.shard->size() == 2 &&
                                         by_host.shard->rank() == rank / 2 &&
                                         by_host.replicate->rank() == rank % 2,
                                     "by host a, b, a, b"));
            absl::StatusOr<internal::HybridGroups> uneven =
                internal::SplitByHost(c, rank < 3 ? "a" : "b");
            return Check(!uneven.ok() && absl::StrContains(uneven.status().message(),
                                                           "[a: 3, b: 1]"),
                         absl::StrCat("uneven hosts: ", uneven.status().ToString()));
          }),
      "bad groups");
}

}  // namespace
}  // namespace fairscale::fsdp
