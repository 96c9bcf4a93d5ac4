// The per-parameter layout (FsdpOptions::flatten_parameters(false)) against
// single-process references computed in the same test: the wrapper lists the
// wrapped module's own parameter tensors under their own names, each holding
// this rank's rows of dim 0 (ceil(rows / world) per rank, derived here by hand)
// with a gradient of the same shape; AdamW with two param groups (weight decay
// on matrices only), frozen parameters next to trainable ones in a unit,
// parameters of 0, 1, odd and fewer-than-world rows, a 0-dim parameter, tied
// parameters, nested units, every strategy at world sizes 1-4, bf16 mixed
// precision and clip_grad_norm_.
#include <ATen/ops/tanh.h>
#include <torch/optim/adamw.h>

#include <cmath>
#include <map>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "base/status_matchers.h"
#include "comm/testing/inproc_ranks.h"
#include "fsdp/fully_sharded_data_parallel.h"
#include "fsdp/state_dict.h"
#include "fsdp/test_util.h"
#include "fsdp/testing/per_param_helpers.h"
#include "gtest/gtest.h"
#include "testing/c10_error.h"

namespace fairscale::fsdp {
namespace {

using base::testing::IsOk;
using comm::testing::RunInprocRanks;
using testing::ExpectClose;
using testing::GroupedAdamW;
using testing::kSteps;
using testing::MakeNet;
using testing::MakePlain;
using testing::Matrices;
using testing::NetLoss;
using testing::NetLossFn;
using testing::Rows;
using testing::Sharded;
using testing::Step;
using testing::Tied;
using testing::TiedLossFn;

template <typename Make, typename Loss>
absl::Status RunRank(Make make, Loss loss_fn, const std::vector<Step>& ref, FsdpOptions options,
                     bool nested, int rank, int world, std::shared_ptr<comm::Communicator> comm,
                     double rtol = 1e-5, double max_norm = 0) {
  options.flatten_parameters(false);
  auto plain = make(nullptr, FsdpOptions());
  FullyShardedDataParallel model(make(nested ? comm : nullptr, options), comm, options);
  // HYBRID_SHARD shards over groups of hybrid_shard_group_size consecutive ranks.
  const int group =
      options.hybrid_shard_group_size() > 0 ? options.hybrid_shard_group_size() : world;
  const int srank = rank % group;
  const bool sharded = Sharded(options.sharding_strategy(), group);
  const std::string where = absl::StrCat("rank ", rank, "/", world);
  // The wrapper lists the unwrapped module's names, in its order, each the
  // module's own tensor.
  const auto named = model->named_parameters();
  const auto plain_named = plain->named_parameters();
  if (named.keys() != plain_named.keys()) {
    return absl::InternalError(where +
                               ": named_parameters() names differ from the unwrapped "
                               "module's");
  }
  auto opt = GroupedAdamW(named, Matrices(*plain));
  std::vector<const c10::TensorImpl*> stepped;
  for (const auto& g : opt->param_groups()) {
    for (const at::Tensor& p : g.params()) stepped.push_back(p.unsafeGetTensorImpl());
  }
  for (int step = 0; step < static_cast<int>(ref.size()); ++step) {
    const std::string at_step = absl::StrCat("step ", step, " ", where);
    opt->zero_grad();
    at::Tensor loss = loss_fn(model, step, rank, world);
    loss.backward();
    if (max_norm > 0) {
      at::Tensor norm = model->clip_grad_norm_(max_norm);
      (void)norm;
    }
    for (const auto& item : model->named_parameters()) {
      const at::Tensor& p = item.value();
      const at::Tensor& want = ref[step].grads.at(item.key());
      if (!want.defined()) {
        if (p.grad().defined()) {
          return absl::InternalError(
              absl::StrCat(at_step, ": '", item.key(), "' is frozen but has a gradient"));
        }
        continue;
      }
      FS_RETURN_IF_ERROR(ExpectClose(absl::StrCat(at_step, " grad '", item.key(), "'"), p.grad(),
                                     Rows(want, srank, group, sharded), rtol));
    }
    opt->step();
    for (const auto& item : model->named_parameters()) {
      FS_RETURN_IF_ERROR(
          ExpectClose(absl::StrCat(at_step, " param '", item.key(), "'"), item.value(),
                      Rows(ref[step].params.at(item.key()), srank, group, sharded), rtol));
    }
  }
  // The tensors the optimizer stepped are still the ones the module computes
  // with.
  const auto after = model->named_parameters();
  for (size_t i = 0; i < after.size(); ++i) {
    if (!after[i].value().is_same(named[i].value())) {
      return absl::InternalError(where + ": parameter '" + after[i].key() + "' changed identity");
    }
  }
  size_t k = 0;
  for (const auto& g : opt->param_groups()) {
    for (const at::Tensor& p : g.params()) {
      if (p.unsafeGetTensorImpl() != stepped[k++]) {
        return absl::InternalError(where + ": the optimizer's parameters changed");
      }
    }
  }
  return absl::OkStatus();
}

template <typename Make, typename Loss>
void ExpectParity(Make make, Loss loss_fn, FsdpOptions options, bool nested, double rtol = 1e-5,
                  double max_norm = 0) {
  const std::vector<Step> ref = testing::Reference(make, loss_fn, max_norm);
  for (int world = 1; world <= 4; ++world) {
    auto statuses = RunInprocRanks(world, [&](int rank, int w, auto comm) {
      return RunRank(make, loss_fn, ref, options, nested, rank, w, comm, rtol, max_norm);
    });
    for (int r = 0; r < world; ++r) {
      EXPECT_THAT(statuses[r], IsOk()) << "world " << world << " rank " << r;
    }
  }
}

class EdgeImpl : public torch::nn::Module {
 public:
  EdgeImpl() {
    w3 = register_parameter("w3", at::zeros({3, 4}));
    empty = register_parameter("empty", at::zeros({0, 4}));
    s = register_parameter("s", at::zeros({}));
    b1 = register_parameter("b1", at::zeros({1}));
    v2 = register_parameter("v2", at::zeros({2}));
    w5 = register_parameter("w5", at::zeros({5, 3}));
    row = register_parameter("row", at::zeros({1, 4}));
    testing::InitDeterministic(*this, "edge.");
  }
  at::Tensor forward(at::Tensor x) {
    at::Tensor h = at::tanh(x.matmul(w3.t()) * s + b1);  // [n, 3]
    at::Tensor y = h.matmul(w5.t());                     // [n, 5]
    return y.sum(1, true) * v2.sum() + (x * row).sum(1, true) + empty.sum();
  }
  at::Tensor w3, empty, s, b1, v2, w5, row;
};
TORCH_MODULE(Edge);

struct EdgeLossFn {
  template <typename M>
  at::Tensor operator()(M& model, int step, int rank, int world) const {
    at::Tensor x = testing::RankRows(testing::GlobalBatch(step).x.narrow(1, 0, 4), rank, world);
    at::Tensor out = testing::Call<at::Tensor>(model, x);
    return (out - 0.3).pow(2).mean();
  }
};

// Tied: "head.weight" is the same tensor as "emb" (registered twice, two
// ---- tests
// ---------------------------------------------------------------------------------

using ParityParam = std::tuple<ShardingStrategy, bool>;
class PerParamParityTest : public ::testing::TestWithParam<ParityParam> {};

TEST_P(PerParamParityTest, GroupedAdamWMatchesReference) {
  const auto [strategy, nested] = GetParam();
  ExpectParity(MakeNet(), NetLossFn(), FsdpOptions().sharding_strategy(strategy), nested);
}

TEST_P(PerParamParityTest, FrozenParametersInsideUnits) {
  const auto [strategy, nested] = GetParam();
  testing::NetConfig config;
  config.frozen = {"fc_in.bias", "block0.fc1.weight", "block1.fc2.bias", "fc_out.weight"};
  ExpectParity(MakeNet(config), NetLossFn(), FsdpOptions().sharding_strategy(strategy), nested);
}

TEST_P(PerParamParityTest, ClipGradNorm) {
  const auto [strategy, nested] = GetParam();
  ExpectParity(MakeNet(), NetLossFn(), FsdpOptions().sharding_strategy(strategy), nested,
               /*rtol=*/1e-5, /*max_norm=*/0.05);
}

TEST_P(PerParamParityTest, EdgeSizes) {
  const auto [strategy, bucket] = GetParam();
  // `nested` stands for gradient bucketing here: Edge has no submodule to wrap.
  ExpectParity(MakePlain<Edge>(), EdgeLossFn(),
               FsdpOptions().sharding_strategy(strategy).bucket_cap_mb(bucket ? 1.0 : 0.0),
               /*nested=*/false);
}

TEST_P(PerParamParityTest, TiedParameters) {
  const auto [strategy, prefetch] = GetParam();
  ExpectParity(MakePlain<Tied>(), TiedLossFn(),
               FsdpOptions().sharding_strategy(strategy).backward_prefetch(prefetch),
               /*nested=*/false);
}

INSTANTIATE_TEST_SUITE_P(All, PerParamParityTest,
                         ::testing::Combine(::testing::Values(ShardingStrategy::kFullShard,
                                                              ShardingStrategy::kShardGradOp,
                                                              ShardingStrategy::kNoShard),
                                            ::testing::Bool()),
                         [](const ::testing::TestParamInfo<ParityParam>& info) {
                           return absl::StrCat(ShardingStrategyName(std::get<0>(info.param)),
                                               std::get<1>(info.param) ? "_On" : "_Off");
                         });

// HYBRID_SHARD / _HYBRID_SHARD_ZERO2: rows over the shard group, replicated across groups.
TEST(PerParamHybridTest, GroupedAdamWMatchesReference) {
  const std::vector<Step> ref = testing::Reference(MakeNet(), NetLossFn());
  for (ShardingStrategy strategy :
       {ShardingStrategy::kHybridShard, ShardingStrategy::kHybridShardZero2}) {
    for (const auto& [world, group] :
         {std::pair{2, 1}, std::pair{2, 2}, std::pair{4, 2}, std::pair{3, 3}}) {
      const auto opts = FsdpOptions().sharding_strategy(strategy).hybrid_shard_group_size(group);
      auto statuses = RunInprocRanks(world, [&](int rank, int w, auto comm) {
        return RunRank(MakeNet(), NetLossFn(), ref, opts, /*nested=*/true, rank, w, comm);
      });
      for (int r = 0; r < world; ++r) {
        EXPECT_THAT(statuses[r], IsOk()) << ShardingStrategyName(strategy) << " world " << world
                                         << " group " << group << " rank " << r;
      }
    }
  }
}

// bf16 compute with f32 shards: the per-parameter model takes the same steps as
// the flat one (the same gathers, reductions and AdamW updates element by
// element; the flat layout's bf16 training is checked against references in the
// other tests), losses in bf16, shards in f32.
class PerParamMixedTest : public ::testing::TestWithParam<ShardingStrategy> {};

TEST_P(PerParamMixedTest, MatchesFlatLayout) {
  const ShardingStrategy strategy = GetParam();
  for (int world = 1; world <= 4; ++world) {
    auto statuses = RunInprocRanks(world, [&](int rank, int w, auto comm) -> absl::Status {
      const auto opts = FsdpOptions().sharding_strategy(strategy).mixed_precision(
          MixedPrecision().param_dtype(at::kBFloat16));
      const auto per_opts = FsdpOptions(opts).flatten_parameters(false);
      FullyShardedDataParallel flat(testing::NestedNet(comm, opts), comm, opts);
      FullyShardedDataParallel per(testing::NestedNet(comm, per_opts), comm, per_opts);
      auto flat_opt = std::make_unique<torch::optim::AdamW>(
          flat->parameters(), torch::optim::AdamWOptions(0.02).weight_decay(0.1));
      auto per_opt = std::make_unique<torch::optim::AdamW>(
          per->parameters(), torch::optim::AdamWOptions(0.02).weight_decay(0.1));
      const bool sharded = Sharded(strategy, w);
      for (int step = 0; step < kSteps; ++step) {
        const std::string at_step = absl::StrCat("step ", step, " rank ", rank, "/", w);
        flat_opt->zero_grad();
        per_opt->zero_grad();
        testing::Batch b = testing::GlobalBatch(step);
        const at::Tensor x = testing::RankRows(b.x, rank, w);
        const at::Tensor y = testing::RankRows(b.y, rank, w);
        const at::Tensor out = per(x);
        if (out.scalar_type() != at::kBFloat16) {
          return absl::InternalError(at_step + ": the output is not computed in bf16");
        }
        at::Tensor lf = testing::Mse(flat(x), y);
        at::Tensor lp = testing::Mse(out, y);
        FS_RETURN_IF_ERROR(ExpectClose(at_step + " loss", lp, lf, 0));
        lf.backward();
        lp.backward();
        flat_opt->step();
        per_opt->step();
      }
      const StateDict sd = full_state_dict(flat);
      for (const auto& item : per->named_parameters()) {
        if (item.value().scalar_type() != at::kFloat) {
          return absl::InternalError("per-parameter shard '" + item.key() + "' is not f32");
        }
        FS_RETURN_IF_ERROR(ExpectClose(absl::StrCat("rank ", rank, "/", w, " '", item.key(), "'"),
                                       item.value(), Rows(sd[item.key()], rank, w, sharded), 1e-6));
      }
      return absl::OkStatus();
    });
    for (int r = 0; r < world; ++r) {
      EXPECT_THAT(statuses[r], IsOk()) << "world " << world << " rank " << r;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(All, PerParamMixedTest,
                         ::testing::Values(ShardingStrategy::kFullShard,
                                           ShardingStrategy::kShardGradOp,
                                           ShardingStrategy::kNoShard),
                         [](const ::testing::TestParamInfo<ShardingStrategy>& info) {
                           return std::string(ShardingStrategyName(info.param));
                         });

TEST(PerParamTest, SummonFullParamsShowsAndWritesBackFullValues) {
  auto statuses = RunInprocRanks(2, [](int rank, int world, auto comm) -> absl::Status {
    const auto opts = FsdpOptions().flatten_parameters(false);
    FullyShardedDataParallel model(testing::NestedNet(comm, opts), comm, opts);
    testing::Net plain;
    const auto want = plain->named_parameters();
    {
      auto guard = model->summon_full_params(/*writeback=*/true);
      for (const auto& item : model->named_parameters()) {
        FS_RETURN_IF_ERROR(
            ExpectClose("summoned '" + item.key() + "'", item.value(), want[item.key()], 0));
      }
      c10::NoGradGuard no_grad;
      model->named_parameters()["block1.fc1.weight"].add_(1.0);
    }
    for (const auto& item : model->named_parameters()) {
      at::Tensor full = want[item.key()].detach().clone();
      if (item.key() == "block1.fc1.weight") full += 1.0;
      FS_RETURN_IF_ERROR(ExpectClose("after summon '" + item.key() + "'", item.value(),
                                     Rows(full, rank, world, true), 0));
    }
    return absl::OkStatus();
  });
  for (const auto& s : statuses) EXPECT_THAT(s, IsOk());
}

// no_sync(): the first half of each rank's rows accumulates unreduced, the second half's
// backward reduces both; gradients and the step equal the reference's full-batch step.
TEST(PerParamTest, NoSyncAccumulatesThenReduces) {
  const std::vector<Step> ref = testing::Reference(MakeNet(), NetLossFn());
  for (int world = 1; world <= 4; ++world) {
    auto statuses = RunInprocRanks(world, [&](int rank, int w, auto comm) -> absl::Status {
      const auto opts = FsdpOptions().flatten_parameters(false);
      FullyShardedDataParallel model(testing::NestedNet(comm, opts), comm, opts);
      testing::Net plain;
      auto opt = GroupedAdamW(model->named_parameters(), Matrices(*plain));
      const testing::Batch b = testing::GlobalBatch(0);
      const at::Tensor x = testing::RankRows(b.x, rank, w);
      const at::Tensor y = testing::RankRows(b.y, rank, w);
      const int64_t n = x.size(0), k = n / 2;
      // This rank's Mse over all its rows, split into the parts of rows [from, from + len).
      auto part = [&](int64_t from, int64_t len) {
        at::Tensor out = model(x.narrow(0, from, len));
        return (out - y.narrow(0, from, len)).pow(2).sum() / static_cast<double>(n * y.size(1));
      };
      opt->zero_grad();
      {
        auto guard = model->no_sync();
        part(0, k).backward();
      }
      part(k, n - k).backward();
      const bool sharded = Sharded(ShardingStrategy::kFullShard, w);
      const std::string where = absl::StrCat("rank ", rank, "/", w);
      for (const auto& item : model->named_parameters()) {
        FS_RETURN_IF_ERROR(ExpectClose(where + " grad '" + item.key() + "'", item.value().grad(),
                                       Rows(ref[0].grads.at(item.key()), rank, w, sharded), 1e-5));
      }
      opt->step();
      for (const auto& item : model->named_parameters()) {
        FS_RETURN_IF_ERROR(ExpectClose(where + " param '" + item.key() + "'", item.value(),
                                       Rows(ref[0].params.at(item.key()), rank, w, sharded), 1e-5));
      }
      return absl::OkStatus();
    });
    for (int r = 0; r < world; ++r) {
      EXPECT_THAT(statuses[r], IsOk()) << "world " << world << " rank " << r;
    }
  }
}

TEST(PerParamTest, MixingLayoutsInOneModelIsRejected) {
  auto statuses = RunInprocRanks(1, [](int, int, auto comm) -> absl::Status {
    FullyShardedDataParallel model(testing::NestedNet(comm, FsdpOptions()), comm,
                                   FsdpOptions().flatten_parameters(false));
    return fairscale::testing::ExpectError([&] { NetLoss(model, 0, 0, 1); },
                                           {"every unit of a model must use the same layout"});
  });
  EXPECT_THAT(statuses[0], IsOk());
}

}  // namespace
}  // namespace fairscale::fsdp
