// ShardedDataParallel + OSS against the unsharded optimizer on a single-process reference:
// parity over 10 steps at 1-4 ranks for every elementwise optimizer, both partition modes, two
// param groups and an LR schedule; gradients reach their owners only; bucket sizes; no_sync
// gradient accumulation; buffer broadcast; refresh after requires_grad changes.
#include "oss/sharded_data_parallel.h"

#include <ATen/ops/full.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>
#include <torch/optim/schedulers/step_lr.h>
#include <torch/optim/sgd.h>

#include <map>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status_macros.h"
#include "base/status_matchers.h"
#include "comm/testing/counting_communicator.h"
#include "comm/testing/inproc_ranks.h"
#include "comm/testing/rank_runner.h"
#include "oss/test_util.h"
#include "testing/c10_error.h"
#include "testing/model.h"

namespace fairscale::oss {
namespace {

using comm::Communicator;
using comm::testing::ExpectAllOk;
using comm::testing::RunInprocRanks;
using fairscale::testing::GlobalBatch;
using fairscale::testing::Mse;
using fairscale::testing::RankRows;
using testing::ExpectParams;
using testing::Factory;
using testing::Kind;
using testing::ModeName;
using testing::Net;
using testing::TwoGroups;

constexpr double kTol = 1e-6;

void Backward(ShardedDataParallel& model, int batch, int rank, int world) {
  fairscale::testing::Batch b = GlobalBatch(batch);
  Mse(model->forward(RankRows(b.x, rank, world)), RankRows(b.y, rank, world)).backward();
}

std::string NameOf(Net& net, const at::Tensor& p) {
  for (const auto& item : net->named_parameters()) {
    if (item.value().is_same(p)) return item.key();
  }
  return "?";
}

using ParityParam = std::tuple<Kind, PartitionMode, int>;
class SdpParityTest : public ::testing::TestWithParam<ParityParam> {};

TEST_P(SdpParityTest, MatchesUnshardedOptimizerWithGroupsAndSchedule) {
  const auto [kind, mode, world] = GetParam();
  const testing::Trajectory ref = testing::RunReference(kind, 0, 10, /*schedule=*/true);
  ExpectAllOk(RunInprocRanks(world, [&, kind = kind, mode = mode](
                                  int rank, int world, std::shared_ptr<comm::Communicator> comm)
                                  -> absl::Status {
    Net net;
    auto opt = std::make_shared<OSS>(TwoGroups(net, kind), Factory(kind), comm,
                                     OssOptions().partition(mode));
    ShardedDataParallel model(torch::nn::AnyModule(net), opt,
                              ShardedDataParallelOptions().reduce_bucket_numel(64));
    torch::optim::StepLR sched(*opt, 3, 0.5);
    for (int step = 0; step < 10; ++step) {
      opt->zero_grad();
      Backward(model, step, rank, world);
      opt->step();
      sched.step();
      absl::Status s =
          ExpectParams(absl::StrCat("step ", step, " rank ", rank), net, ref.params[step], kTol);
      if (!s.ok()) return s;
    }
    return absl::OkStatus();
  }));
}

INSTANTIATE_TEST_SUITE_P(
    All, SdpParityTest,
    ::testing::Combine(::testing::ValuesIn(testing::kAllKinds),
                       ::testing::Values(PartitionMode::kGreedy, PartitionMode::kFlat),
                       ::testing::Values(1, 2, 3, 4)),
    [](const ::testing::TestParamInfo<ParityParam>& info) {
      return absl::StrCat(testing::KindName(std::get<0>(info.param)),
                          ModeName(std::get<1>(info.param)), std::get<2>(info.param));
    });

// After backward the owner holds the mean gradient of its range; a rank holds no gradient for a
// parameter it owns nothing of, and zeros outside its ranges of a split one.
TEST(SdpTest, GradientsReachOnlyTheirOwners) {
  Net ref_net;
  fairscale::testing::Batch b = GlobalBatch(0);
  Mse(ref_net(b.x), b.y).backward();
  for (PartitionMode mode : {PartitionMode::kGreedy, PartitionMode::kFlat}) {
    for (int64_t bucket : {int64_t{0}, int64_t{1}, int64_t{50}, int64_t{1} << 20}) {
      ExpectAllOk(RunInprocRanks(3, [&](int rank, int world, std::shared_ptr<Communicator> comm)
                                  -> absl::Status {
        Net net;
        auto opt = std::make_shared<OSS>(TwoGroups(net, Kind::kAdam), Factory(Kind::kAdam), comm,
                                         OssOptions().partition(mode));
        ShardedDataParallel model(torch::nn::AnyModule(net), opt,
                                  ShardedDataParallelOptions().reduce_bucket_numel(bucket));
        Backward(model, 0, rank, world);
        const std::string where =
            absl::StrCat(ModeName(mode), " bucket ", bucket, " rank ", rank, ": ");
        for (const auto& item : net->named_parameters()) {
          bool mine = false;
          for (const ParamShard& s : opt->shards()) {
            mine |= s.param.is_same(item.value()) && s.rank == rank;
          }
          if (!mine && item.value().grad().defined()) {
            return absl::InternalError(where + item.key() + " has a gradient on a non-owner");
          }
        }
        for (const ParamShard& s : opt->shards()) {
          const std::string name = NameOf(net, s.param);
          if (s.rank != rank) {
            if (!s.param.grad().defined()) continue;
            at::Tensor rest = s.param.grad().reshape({-1}).narrow(0, s.offset, s.numel);
            if (rest.abs().max().item<double>() != 0) {
              return absl::InternalError(where + name + ": non-owned range not zero");
            }
            continue;
          }
          at::Tensor got = s.param.grad().reshape({-1}).narrow(0, s.offset, s.numel);
          at::Tensor want =
              ref_net->named_parameters()[name].grad().reshape({-1}).narrow(0, s.offset, s.numel);
          const double diff = (got - want).abs().max().item<double>();
          if (diff > 1e-6) {
            return absl::InternalError(absl::StrCat(where, name, ": gradient differs by ", diff));
          }
        }
        return absl::OkStatus();
      }));
    }
  }
}

// Two micro-batches per step, the first under no_sync: equals the reference's accumulated
// gradients of both batches.
TEST(SdpTest, NoSyncAccumulatesLocallyThenReducesTheSum) {
  Net ref_net;
  auto ref_opt = Factory(Kind::kAdam)(TwoGroups(ref_net, Kind::kAdam));
  std::vector<std::map<std::string, at::Tensor>> ref;
  for (int step = 0; step < 4; ++step) {
    ref_opt->zero_grad();
    for (int micro = 0; micro < 2; ++micro) {
      fairscale::testing::Batch b = GlobalBatch(2 * step + micro);
      Mse(ref_net(b.x), b.y).backward();
    }
    ref_opt->step();
    ref.push_back(testing::Snapshot(ref_net));
  }
  for (PartitionMode mode : {PartitionMode::kGreedy, PartitionMode::kFlat}) {
    ExpectAllOk(RunInprocRanks(2, [&](int rank, int world, std::shared_ptr<comm::Communicator> comm)
                                -> absl::Status {
      Net net;
      auto opt = std::make_shared<OSS>(TwoGroups(net, Kind::kAdam), Factory(Kind::kAdam), comm,
                                       OssOptions().partition(mode));
      ShardedDataParallel model(torch::nn::AnyModule(net), opt);
      for (int step = 0; step < 4; ++step) {
        opt->zero_grad();
        {
          auto guard = model->no_sync();
          Backward(model, 2 * step, rank, world);
        }
        Backward(model, 2 * step + 1, rank, world);
        opt->step();
        absl::Status s = ExpectParams(absl::StrCat(ModeName(mode), " step ", step), net,
                                      ref[step], kTol);
        if (!s.ok()) return s;
      }
      return absl::OkStatus();
    }));
  }
}

// A Linear(5, 3) used by forward and one that is not.
class WithUnusedImpl : public torch::nn::Module {
 public:
  WithUnusedImpl() {
    used = register_module("used", torch::nn::Linear(5, 3));
    unused = register_module("unused", torch::nn::Linear(5, 3));
  }
  at::Tensor forward(at::Tensor x) { return used(x); }
  torch::nn::Linear used{nullptr}, unused{nullptr};
};
TORCH_MODULE(WithUnused);

// At every world size (1 included, where nothing is reduced or copied): the owner's gradient of
// a used parameter is the global batch's (a single-process backward), an unused parameter's is
// zero (so Adam steps it as it would any rank's), and a non-owner holds none.
TEST(SdpTest, UsedGradientsAreTheGlobalOnesAndUnusedOnesZeroAtEveryWorldSize) {
  torch::manual_seed(3);
  WithUnused ref;
  fairscale::testing::Batch b = GlobalBatch(0);
  Mse(ref(b.x), b.y).backward();
  std::map<std::string, at::Tensor> want;
  for (const auto& item : ref->named_parameters()) {
    want[item.key()] =
        item.value().grad().defined() ? item.value().grad().clone() : at::zeros_like(item.value());
  }
  for (int world : {1, 2, 3}) {
    ExpectAllOk(RunInprocRanks(
        world, [&](int rank, int world, std::shared_ptr<comm::Communicator> comm) -> absl::Status {
          // The reference's weights, copied (ranks are threads sharing torch's global
          // generator: seeding it in every rank would not give every rank the same draws).
          WithUnused m;
          {
            torch::NoGradGuard no_grad;
            for (const auto& item : m->named_parameters()) {
              item.value().copy_(ref->named_parameters()[item.key()]);
            }
          }
          std::shared_ptr<OSS> opt =
              OSS::make<torch::optim::Adam>(m->parameters(), torch::optim::AdamOptions(0.1), comm);
          ShardedDataParallel model(torch::nn::AnyModule(m), opt);
          // The second backward runs with the buckets and hooks of the first.
          for (int step = 0; step < 2; ++step) {
            opt->zero_grad();
            Backward(model, 0, rank, world);
            for (const auto& item : m->named_parameters()) {
              const at::Tensor& g = item.value().grad();
              bool mine = false;  // greedy partition: one shard per parameter
              for (const ParamShard& sh : opt->shards()) {
                if (sh.param.is_same(item.value())) mine = sh.rank == rank;
              }
              if (!mine) {
                if (g.defined())
                  return absl::InternalError(
                      absl::StrCat(item.key(), ": a non-owner holds a gradient"));
                continue;
              }
              if (!g.defined())
                return absl::InternalError(
                    absl::StrCat(item.key(), ": no gradient at world ", world));
              const double err = (g - want[item.key()]).abs().max().item<double>();
              if (err > kTol) {
                return absl::InternalError(
                    absl::StrCat(item.key(), " at world ", world, ": off by ", err));
              }
            }
          }
          return absl::OkStatus();
        }));
  }
}

class WithBufferImpl : public torch::nn::Module {
 public:
  explicit WithBufferImpl(float init) {
    w = register_parameter("w", at::full({3}, init));
    b = register_buffer("b", at::full({3}, init));
  }
  at::Tensor forward(at::Tensor x) { return x * w + b; }
  at::Tensor w, b;
};
TORCH_MODULE(WithBuffer);

TEST(SdpTest, ParametersAndBuffersComeFromRankZero) {
  ExpectAllOk(RunInprocRanks(3, [](int rank, int world, std::shared_ptr<comm::Communicator> comm)
                              -> absl::Status {
    WithBuffer m(static_cast<float>(rank + 1));
    auto opt = OSS::make<torch::optim::SGD>(m->parameters(), torch::optim::SGDOptions(0.1), comm);
    std::shared_ptr<OSS> shared(std::move(opt));
    ShardedDataParallel model(torch::nn::AnyModule(m), shared);
    if (!at::equal(m->w, at::full({3}, 1.f)) || !at::equal(m->b, at::full({3}, 1.f))) {
      return absl::InternalError("not synchronised at construction");
    }
    m->b.fill_(10.f * (rank + 1));  // drift, as running statistics would
    model->forward(at::ones({3}));
    if (!at::equal(m->b, at::full({3}, 10.f))) {
      return absl::InternalError("buffers not broadcast before forward");
    }
    return absl::OkStatus();
  }));
}

// Freezing fc_in mid-training: forward re-hooks, and training still matches the reference that
// freezes it at the same step.
TEST(SdpTest, RefreshAfterRequiresGradChanges) {
  auto freeze = [](Net& net) {
    for (const auto& item : net->named_parameters()) {
      if (item.key().rfind("fc_in.", 0) == 0) item.value().set_requires_grad(false);
    }
  };
  Net ref_net;
  auto ref_opt = Factory(Kind::kSgd)(TwoGroups(ref_net, Kind::kSgd));
  std::vector<std::map<std::string, at::Tensor>> ref;
  for (int step = 0; step < 6; ++step) {
    if (step == 3) freeze(ref_net);
    ref_opt->zero_grad();
    fairscale::testing::Batch b = GlobalBatch(step);
    Mse(ref_net(b.x), b.y).backward();
    ref_opt->step();
    ref.push_back(testing::Snapshot(ref_net));
  }
  for (PartitionMode mode : {PartitionMode::kGreedy, PartitionMode::kFlat}) {
    ExpectAllOk(RunInprocRanks(3, [&](int rank, int world, std::shared_ptr<comm::Communicator> comm)
                                -> absl::Status {
      Net net;
      auto opt = std::make_shared<OSS>(TwoGroups(net, Kind::kSgd), Factory(Kind::kSgd), comm,
                                       OssOptions().partition(mode));
      ShardedDataParallel model(torch::nn::AnyModule(net), opt);
      const int64_t before = model->bucket_count();
      for (int step = 0; step < 6; ++step) {
        if (step == 3) freeze(net);
        opt->zero_grad();
        Backward(model, step, rank, world);
        opt->step();
        absl::Status s = ExpectParams(absl::StrCat(ModeName(mode), " step ", step), net,
                                      ref[step], kTol);
        if (!s.ok()) return s;
      }
      for (const auto& item : net->named_parameters()) {
        if (item.key().rfind("fc_in.", 0) == 0 && item.value().grad().defined() &&
            item.value().grad().abs().max().item<double>() != 0) {
          return absl::InternalError("a frozen parameter got a reduced gradient");
        }
      }
      if (model->bucket_count() > before) return absl::InternalError("more buckets after freeze");
      return absl::OkStatus();
    }));
  }
}

// The bytes of one step, counted on the wire: every gradient is reduced once (never all-reduced)
// in bucket_count() reduces, then kGreedy broadcasts every parameter once (half with bf16) and
// kFlat all-gathers N padded ranges per group.
TEST(SdpTest, OneStepMovesTheExpectedBytes) {
  using comm::testing::CountingCommunicator;
  for (PartitionMode mode : {PartitionMode::kGreedy, PartitionMode::kFlat}) {
    for (bool bf16 : {false, true}) {
      ExpectAllOk(RunInprocRanks(3, [&](int rank, int world, std::shared_ptr<Communicator> inner)
                                  -> absl::Status {
        auto counting = std::make_shared<CountingCommunicator>(inner);
        Net net;
        OssOptions options = OssOptions().partition(mode);
        if (bf16) options.broadcast_dtype(at::kBFloat16);
        auto opt = std::make_shared<OSS>(TwoGroups(net, Kind::kAdam), Factory(Kind::kAdam),
                                         counting, options);
        ShardedDataParallel model(torch::nn::AnyModule(net), opt,
                                  ShardedDataParallelOptions().reduce_bucket_numel(40));
        counting->Reset();
        Backward(model, 0, rank, world);
        opt->step();
        int64_t params = 0, padded = 0;
        for (const auto& group : opt->param_groups()) {
          int64_t t = 0;
          for (const auto& p : group.params()) t += p.numel();
          params += t;
          padded += world * ((t + world - 1) / world);
        }
        const auto reduce = counting->count(comm::OpType::kReduce);
        const int64_t wire = bf16 ? 2 : 4;
        std::vector<std::string> errors;
        if (counting->count(comm::OpType::kAllReduce).ops != 0) errors.push_back("all_reduce");
        if (reduce.bytes != 4 * params) errors.push_back(absl::StrCat("reduce bytes ", reduce.bytes));
        if (reduce.ops != model->bucket_count() || reduce.ops < 2) {
          errors.push_back(absl::StrCat("reduce ops ", reduce.ops));
        }
        if (mode == PartitionMode::kGreedy) {
          if (counting->count(comm::OpType::kBroadcast).bytes != wire * params) {
            errors.push_back(absl::StrCat("broadcast bytes ",
                                          counting->count(comm::OpType::kBroadcast).bytes));
          }
        } else if (counting->count(comm::OpType::kAllGather).bytes != wire * padded) {
          errors.push_back(
              absl::StrCat("all_gather bytes ", counting->count(comm::OpType::kAllGather).bytes));
        }
        if (!errors.empty()) {
          return absl::InternalError(absl::StrCat(ModeName(mode), bf16 ? " bf16" : "", ": ",
                                                  absl::StrJoin(errors, ", ")));
        }
        return absl::OkStatus();
      }));
    }
  }
}

TEST(SdpTest, RejectsTrainableParametersTheOptimizerDoesNotHold) {
  ExpectAllOk(RunInprocRanks(1, [](int rank, int world, std::shared_ptr<comm::Communicator> comm)
                              -> absl::Status {
    Net net;
    std::vector<at::Tensor> some = net->parameters();
    some.pop_back();
    auto opt = std::make_shared<OSS>(some, Factory(Kind::kSgd), comm);
    return fairscale::testing::ExpectError(
        [&] { ShardedDataParallel model(torch::nn::AnyModule(net), opt); },
        {"is not in the OSS optimizer"});
  }));
}

}  // namespace
}  // namespace fairscale::oss
