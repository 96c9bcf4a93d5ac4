// Exact accounting of what FullyShardedDataParallel communicates and keeps per rank.
// * Communication per training step, counted by a CountingCommunicator around inproc, equals the
//   theory: FULL_SHARD 3x the (padded) parameter bytes (all-gather in forward, again in backward,
//   reduce-scatter of the gradient), 2x for the root that keeps its parameters
//   (disable_reshard_on_root), SHARD_GRAD_OP 2x, NO_SHARD one all-reduce of the gradient.
// * Memory after a step: parameters + gradients + optimizer state held by each rank are exactly
//   1/N of the padded unsharded sizes, and the full parameters and their gradients are freed.
// * Bucketed gradient reduction (bucket_cap_mb) keeps parity and the bytes, and issues as many
//   reduce-scatters per step as the cap allows.
#include <torch/optim/adam.h>
#include <torch/optim/sgd.h>

#include <tuple>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "comm/testing/counting_communicator.h"
#include "comm/testing/inproc_ranks.h"
#include "comm/testing/rank_runner.h"
#include "fsdp/fully_sharded_data_parallel.h"
#include "fsdp/test_util.h"
#include "gtest/gtest.h"

namespace fairscale::fsdp {
namespace {

using comm::testing::Check;
using comm::testing::CountingCommunicator;

template <typename Body>
void RunAllWorlds(Body body) {
  for (int world = 1; world <= 4; ++world) {
    comm::testing::ExpectAllOk(
        comm::testing::RunInprocRanks(
            world,
            [&](int rank, int w, std::shared_ptr<comm::Communicator> inner) -> absl::Status {
              return body(rank, w, std::make_shared<CountingCommunicator>(inner));
            }),
        absl::StrCat("world ", world));
  }
}

// One forward/backward of the test model on this rank's rows of the global batch.
void TrainStep(FullyShardedDataParallel& model, torch::optim::Optimizer& opt, int step, int rank,
               int world) {
  opt.zero_grad();
  testing::Batch b = testing::GlobalBatch(step);
  testing::Mse(model(testing::RankRows(b.x, rank, world)), testing::RankRows(b.y, rank, world))
      .backward();
  opt.step();
}

using VolumeParam = std::tuple<ShardingStrategy, bool /*nested*/, bool /*reshard root*/>;
class CommVolumeTest : public ::testing::TestWithParam<VolumeParam> {};

TEST_P(CommVolumeTest, StepMovesTheTheoreticalBytes) {
  const auto [strategy, nested, reshard_root] = GetParam();
  RunAllWorlds([&, strategy = strategy, nested = nested, reshard_root = reshard_root](
                   int rank, int world,
                   std::shared_ptr<CountingCommunicator> counting) -> absl::Status {
    const auto opts =
        FsdpOptions().sharding_strategy(strategy).disable_reshard_on_root(!reshard_root);
    FullyShardedDataParallel model(testing::NestedNet(nested ? counting : nullptr, opts), counting,
                                   opts);
    torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    TrainStep(model, opt, 0, rank, world);  // first step: records the order, prefetches nothing

    // Theory, from the layout: every flat parameter is gathered before forward, again before
    // backward unless it is kept, and its gradient reduced once.
    int64_t gather_bytes = 0, gather_ops = 0, rs_bytes = 0, rs_ops = 0, ar_bytes = 0, ar_ops = 0;
    for (FullyShardedDataParallelImpl* unit : model->fsdp_units()) {
      const bool root = unit == model.get();
      for (const FlatParamInfo& info : unit->flat_param_info()) {
        const int64_t bytes = info.padded_numel * 4;
        if (world == 1) continue;  // nothing to shard or reduce: no communication at all
        if (strategy == ShardingStrategy::kNoShard) {
          ar_bytes += bytes;
          ++ar_ops;
          continue;
        }
        const int gathers =
            strategy == ShardingStrategy::kFullShard && (!root || reshard_root) ? 2 : 1;
        gather_bytes += gathers * bytes;
        gather_ops += gathers;
        rs_bytes += bytes;
        ++rs_ops;
      }
    }
    for (int step = 1; step <= 3; ++step) {
      counting->Reset();
      TrainStep(model, opt, step, rank, world);
      const auto ag = counting->count(comm::OpType::kAllGather);
      const auto rs = counting->count(comm::OpType::kReduceScatter);
      const auto ar = counting->count(comm::OpType::kAllReduce);
      const std::string at = absl::StrCat("step ", step, " rank ", rank, "/", world, ": ");
      FS_RETURN_IF_ERROR(
          Check(ag.bytes == gather_bytes && ag.ops == gather_ops,
                absl::StrCat(at, "all_gather ", ag.ops, " ops ", ag.bytes, " bytes, expected ",
                             gather_ops, " ops ", gather_bytes, " bytes")));
      FS_RETURN_IF_ERROR(Check(rs.bytes == rs_bytes && rs.ops == rs_ops,
                               absl::StrCat(at, "reduce_scatter ", rs.ops, " ops ", rs.bytes,
                                            " bytes, expected ", rs_ops, " ops ", rs_bytes)));
      FS_RETURN_IF_ERROR(Check(ar.bytes == ar_bytes && ar.ops == ar_ops,
                               absl::StrCat(at, "all_reduce ", ar.ops, " ops ", ar.bytes,
                                            " bytes, expected ", ar_ops, " ops ", ar_bytes)));
    }
    // The theory in terms of the parameter bytes P (padded): 3P, 2P or one all-reduce of P.
    if (!nested && strategy != ShardingStrategy::kNoShard && world > 1) {
      const int64_t p = model->flat_param_info()[0].padded_numel * 4;
      const int64_t factor = strategy == ShardingStrategy::kFullShard && reshard_root ? 3 : 2;
      FS_RETURN_IF_ERROR(Check(gather_bytes + rs_bytes == factor * p, "theory"));
    }
    return absl::OkStatus();
  });
}

INSTANTIATE_TEST_SUITE_P(All, CommVolumeTest,
                         ::testing::Combine(::testing::Values(ShardingStrategy::kFullShard,
                                                              ShardingStrategy::kShardGradOp,
                                                              ShardingStrategy::kNoShard),
                                            ::testing::Bool(), ::testing::Bool()),
                         [](const ::testing::TestParamInfo<VolumeParam>& info) {
                           return absl::StrCat(
                               ShardingStrategyName(std::get<0>(info.param)),
                               std::get<1>(info.param) ? "_Nested" : "_Flat",
                               std::get<2>(info.param) ? "_ReshardRoot" : "_KeepRoot");
                         });

class MemoryTest : public ::testing::TestWithParam<std::tuple<ShardingStrategy, bool>> {};

TEST_P(MemoryTest, EachRankHoldsOneNthOfParamsGradsAndAdamState) {
  const auto [strategy, nested] = GetParam();
  RunAllWorlds([&, strategy = strategy, nested = nested](
                   int rank, int world,
                   std::shared_ptr<CountingCommunicator> counting) -> absl::Status {
    const auto opts = FsdpOptions().sharding_strategy(strategy);
    FullyShardedDataParallel model(testing::NestedNet(nested ? counting : nullptr, opts), counting,
                                   opts);
    torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(0.01));
    // 350 parameters in 1 unit, or 66 + 142 + 142 in 3 units; padded to a multiple of N each.
    int64_t padded = 0;
    int64_t unsharded = 0;
    for (FullyShardedDataParallelImpl* unit : model->fsdp_units()) {
      for (const FlatParamInfo& info : unit->flat_param_info()) {
        padded += info.padded_numel;
        unsharded += info.numel;
        const int64_t n = strategy == ShardingStrategy::kNoShard ? 1 : world;
        FS_RETURN_IF_ERROR(Check(info.padded_numel % n == 0 && info.padded_numel - info.numel < n &&
                                     info.shard_numel * n == info.padded_numel,
                                 "padding of " + info.name));
      }
    }
    FS_RETURN_IF_ERROR(Check(unsharded == 350, absl::StrCat("unsharded numel ", unsharded)));
    const int64_t per_rank = strategy == ShardingStrategy::kNoShard ? padded : padded / world;

    for (int step = 0; step < 3; ++step) {
      TrainStep(model, opt, step, rank, world);
      int64_t param_bytes = 0, grad_bytes = 0, state_bytes = 0;
      for (const at::Tensor& p : model->parameters()) {
        param_bytes += p.numel() * p.element_size();
        if (p.grad().defined()) grad_bytes += p.grad().numel() * p.grad().element_size();
      }
      for (const auto& [key, state] : opt.state()) {
        const auto& s = static_cast<const torch::optim::AdamParamState&>(*state);
        state_bytes += s.exp_avg().numel() * 4 + s.exp_avg_sq().numel() * 4;
      }
      const std::string at = absl::StrCat("step ", step, " rank ", rank, "/", world, ": ");
      FS_RETURN_IF_ERROR(
          Check(param_bytes == per_rank * 4 && grad_bytes == per_rank * 4 &&
                    state_bytes == 2 * per_rank * 4,
                absl::StrCat(at, "params ", param_bytes, " grads ", grad_bytes, " adam state ",
                             state_bytes, " bytes; expected ", per_rank * 4, ", ", per_rank * 4,
                             ", ", 2 * per_rank * 4)));
      // Nothing else: the original parameters hold no memory of their own between steps: they
      // view the freed full flat parameter, or (NO_SHARD, and every strategy at world size 1)
      // the shard itself, and then their gradients view the shard's gradient.
      const bool unsharded_run = strategy == ShardingStrategy::kNoShard || world == 1;
      for (FullyShardedDataParallelImpl* unit : model->fsdp_units()) {
        const auto shards = unit->parameters(/*recurse=*/false);
        for (const auto& item : unit->module()->named_parameters()) {
          bool is_shard = false;
          for (FullyShardedDataParallelImpl* u : model->fsdp_units()) {
            for (const at::Tensor& s : u->parameters(false)) is_shard |= s.is_same(item.value());
          }
          if (is_shard) continue;
          const at::Tensor& p = item.value();
          const size_t held = p.storage().nbytes();
          auto aliases_a_shard = [&](const at::Tensor& t, bool grad) {
            for (const at::Tensor& s : shards) {
              const at::Tensor& of = grad ? s.grad() : s;
              if (of.defined() && t.storage().is_alias_of(of.storage())) return true;
            }
            return false;
          };
          const bool ok = unsharded_run ? aliases_a_shard(p, false) : held == 0;
          const bool grad_ok = !p.grad().defined() || (unsharded_run && aliases_a_shard(p.grad(), true));
          FS_RETURN_IF_ERROR(
              Check(ok && grad_ok,
                    absl::StrCat(at, "parameter '", unit->prefix(), item.key(), "' holds ", held,
                                 " bytes", p.grad().defined() ? " and a gradient" : "")));
        }
      }
    }
    return absl::OkStatus();
  });
}

INSTANTIATE_TEST_SUITE_P(
    All, MemoryTest,
    ::testing::Combine(::testing::Values(ShardingStrategy::kFullShard,
                                         ShardingStrategy::kShardGradOp,
                                         ShardingStrategy::kNoShard),
                       ::testing::Bool()),
    [](const ::testing::TestParamInfo<std::tuple<ShardingStrategy, bool>>& info) {
      return absl::StrCat(ShardingStrategyName(std::get<0>(info.param)),
                          std::get<1>(info.param) ? "_Nested" : "_Flat");
    });

// The nested test model reduces, in backward order, block1 (142 elements, padded to <= 144),
// block0 (the same) and the root (fc_in + fc_out, 66, padded to <= 68): f32, at most 576, 576
// and 272 bytes.
TEST(GradientBucketing, FewerReduceScattersSameBytesAndParity) {
  constexpr int kSteps = 4;
  const auto ref = testing::RunReference(testing::OptimizerKind::kAdam, kSteps);
  struct Case {
    double cap_bytes;
    int64_t ops_per_step;
  };
  // 0: off, one per flat parameter; 900 bytes: a block and the root fit together, two blocks do
  // not (2); 1 MiB: everything in one bucket (1); 400 bytes: the blocks bypass, the root is
  // bucketed alone (3).
  const Case cases[] = {{0, 3}, {900, 2}, {1 << 20, 1}, {400, 3}};
  for (ShardingStrategy strategy : {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp}) {
    for (const Case& c : cases) {
      RunAllWorlds(
          [&](int rank, int world, std::shared_ptr<CountingCommunicator> counting) -> absl::Status {
            const auto opts = FsdpOptions().sharding_strategy(strategy).bucket_cap_mb(
                c.cap_bytes / (1024.0 * 1024.0));
            FS_RETURN_IF_ERROR(testing::RunParityRank(
                [](std::shared_ptr<comm::Communicator> comm, FsdpOptions o) {
                  return testing::NestedNet(comm, o);
                },
                [](FullyShardedDataParallel& model, int step, int r, int w) {
                  testing::Batch b = testing::GlobalBatch(step);
                  testing::Mse(model(testing::RankRows(b.x, r, w)), testing::RankRows(b.y, r, w))
                      .backward();
                },
                testing::OptimizerKind::kAdam, ref, opts, /*nested=*/true, rank, world, counting));
            int64_t padded_bytes = 0;
            {
              FullyShardedDataParallel probe(testing::NestedNet(counting, opts), counting, opts);
              for (FullyShardedDataParallelImpl* u : probe->fsdp_units()) {
                for (const FlatParamInfo& info : u->flat_param_info())
                  padded_bytes += info.padded_numel * 4;
              }
            }
            const auto rs = counting->count(comm::OpType::kReduceScatter);
            // World size 1 communicates nothing.
            const int64_t ops = world == 1 ? 0 : kSteps * c.ops_per_step;
            const int64_t bytes = world == 1 ? 0 : kSteps * padded_bytes;
            return Check(
                rs.ops == ops && rs.bytes == bytes,
                absl::StrCat(ShardingStrategyName(strategy), " cap ", c.cap_bytes, " bytes rank ",
                             rank, "/", world, ": ", rs.ops, " reduce_scatters (", rs.bytes,
                             " bytes) in ", kSteps, " steps, expected ", ops, " (", bytes, ")"));
          });
    }
  }
}

}  // namespace
}  // namespace fairscale::fsdp
