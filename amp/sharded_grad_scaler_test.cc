// ShardedGradScaler over 1-4 ranks (threads over //comm/inproc; 2-3 processes over //comm/tcp):
// an inf or NaN in one rank's gradients only makes every rank skip that step and back the scale
// off identically, with plain per-rank optimizers and with FSDP shards (checked against a
// single-process reference that skipped the same step); a rank without gradients still joins the
// agreement; a broken communicator raises on every rank instead of hanging.
#include "amp/sharded_grad_scaler.h"

#include <ATen/ops/equal.h>
#include <ATen/ops/tensor.h>
#include <c10/util/Exception.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/optim/sgd.h>

#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "amp/autocast.h"
#include "base/status_macros.h"
#include "base/status_matchers.h"
#include "comm/communicator.h"
#include "comm/registry.h"
#include "comm/testing/inproc_ranks.h"
#include "comm/testing/rank_runner.h"
#include "fsdp/fully_sharded_data_parallel.h"
#include "fsdp/test_util.h"
#include "testing/c10_error.h"

namespace fairscale::amp {
namespace {

using base::testing::IsOk;
using comm::testing::Check;
using fairscale::testing::ErrorOf;
namespace ft = fsdp::testing;

constexpr int kSteps = 6;
constexpr int kBadStep = 2;
// init 1024, interval 2, hand-derived: 1024 (tracker 1), 2048 (grown), 1024 (backed off at
// kBadStep), 1024 (tracker 1), 2048, 2048 (tracker 1).
const std::vector<double> kScales = {1024, 2048, 1024, 1024, 2048, 2048};
GradScalerOptions Options() { return GradScalerOptions().init_scale(1024).growth_interval(2); }

// The rank whose gradients get the bad value.
int BadRank(int world) { return world > 1 ? 1 : 0; }

struct BadValueParam {
  const char* name;
  float value;
};
class ShardedGradScalerTest : public ::testing::TestWithParam<BadValueParam> {};

// Every rank trains its own w (no communication but the scaler's): loss = (rank + 1) * sum(w^2),
// so the true gradient is 2 (rank + 1) w and SGD(lr) gives w - lr * 2 (rank + 1) w.
absl::Status PlainRank(int rank, int world, std::shared_ptr<comm::Communicator> comm,
                       float bad) {
  at::Tensor w = at::tensor({1.0f, -2.0f, 0.5f}).set_requires_grad(true);
  torch::optim::SGD opt({w}, torch::optim::SGDOptions(0.125));
  ShardedGradScaler scaler(comm, Options());
  for (int step = 0; step < kSteps; ++step) {
    const std::string at = absl::StrCat("step ", step, " rank ", rank, "/", world);
    const at::Tensor before = w.detach().clone();
    opt.zero_grad();
    scaler.scale((w * w).sum() * (rank + 1)).backward();
    if (step == kBadStep && rank == BadRank(world)) w.mutable_grad()[2] = bad;
    const bool stepped = scaler.step(opt);
    FS_RETURN_IF_ERROR(Check(stepped == (step != kBadStep), at + ": stepped " +
                                                                 std::to_string(stepped)));
    const at::Tensor expected =
        step == kBadStep ? before : before - 0.125 * (2.0f * (rank + 1) * before);
    FS_RETURN_IF_ERROR(Check(at::equal(w.detach(), expected), at + ": parameters differ"));
    scaler.update();
    FS_RETURN_IF_ERROR(Check(scaler.get_scale() == kScales[step],
                             absl::StrCat(at, ": scale ", scaler.get_scale(), " expected ",
                                          kScales[step])));
  }
  return absl::OkStatus();
}

TEST_P(ShardedGradScalerTest, BadGradientOnOneRankSkipsTheStepEverywhere) {
  for (int world = 1; world <= 4; ++world) {
    std::vector<absl::Status> statuses = comm::testing::RunInprocRanks(
        world, [&](int rank, int world, std::shared_ptr<comm::Communicator> comm) {
          return PlainRank(rank, world, comm, GetParam().value);
        });
    for (int r = 0; r < world; ++r) EXPECT_THAT(statuses[r], IsOk()) << "world " << world;
  }
}

// FSDP: the optimizer steps the shards (model->parameters()). The reference is a plain Net with a
// GradScaler on the whole batch that skips the same step.
struct FsdpReference {
  std::vector<std::map<std::string, at::Tensor>> params;  // after each step
  std::vector<double> scales;                             // after each update
};

FsdpReference RunFsdpReference(float bad) {
  ft::Net net;
  auto opt = ft::MakeOptimizer(ft::OptimizerKind::kSgdMomentum, ft::DistinctParameters(*net));
  GradScaler scaler(Options());
  FsdpReference ref;
  for (int step = 0; step < kSteps; ++step) {
    opt->zero_grad();
    ft::Batch b = ft::GlobalBatch(step);
    scaler.scale(ft::Mse(net(b.x), b.y)).backward();
    if (step == kBadStep) net->parameters()[1].mutable_grad().view({-1})[0] = bad;
    EXPECT_EQ(scaler.step(*opt), step != kBadStep) << "reference step " << step;
    scaler.update();
    std::map<std::string, at::Tensor> params;
    for (const auto& item : net->named_parameters()) {
      params[item.key()] = item.value().detach().clone();
    }
    ref.params.push_back(std::move(params));
    ref.scales.push_back(scaler.get_scale());
  }
  return ref;
}

absl::Status FsdpRank(int rank, int world, std::shared_ptr<comm::Communicator> comm, float bad,
                      bool nested, const FsdpReference& ref) {
  // Nested: the blocks are FSDP units of their own, so the optimizer steps several shards.
  fsdp::FullyShardedDataParallel model(ft::NestedNet(nested ? comm : nullptr, fsdp::FsdpOptions()),
                                       comm, fsdp::FsdpOptions());
  auto opt = ft::MakeOptimizer(ft::OptimizerKind::kSgdMomentum, model->parameters());
  ShardedGradScaler scaler(comm, Options());
  for (int step = 0; step < kSteps; ++step) {
    const std::string at = absl::StrCat("step ", step, " rank ", rank, "/", world);
    std::vector<at::Tensor> before;
    for (const auto& p : model->parameters()) before.push_back(p.detach().clone());
    opt->zero_grad();
    ft::Batch b = ft::GlobalBatch(step);
    at::Tensor loss =
        ft::Mse(model(ft::RankRows(b.x, rank, world)), ft::RankRows(b.y, rank, world));
    scaler.scale(loss).backward();
    if (step == kBadStep && rank == BadRank(world)) {
      bool injected = false;
      for (auto& p : model->parameters()) {
        if (p.grad().defined() && p.grad().numel() > 0) {
          p.mutable_grad().view({-1})[0] = bad;
          injected = true;
          break;
        }
      }
      FS_RETURN_IF_ERROR(Check(injected, at + ": no shard gradient to corrupt"));
    }
    const bool stepped = scaler.step(*opt);
    FS_RETURN_IF_ERROR(Check(stepped == (step != kBadStep), at + ": stepped " +
                                                                 std::to_string(stepped)));
    if (step == kBadStep) {
      const auto params = model->parameters();
      for (size_t i = 0; i < params.size(); ++i) {
        FS_RETURN_IF_ERROR(Check(at::equal(params[i].detach(), before[i]),
                                 at + ": a shard changed in a skipped step"));
      }
    }
    FS_RETURN_IF_ERROR(ft::CheckShards(model, ref.params[step], /*grads=*/false,
                                       at + " param", 1e-5));
    scaler.update();
    FS_RETURN_IF_ERROR(Check(scaler.get_scale() == ref.scales[step],
                             absl::StrCat(at, ": scale ", scaler.get_scale(), " expected ",
                                          ref.scales[step])));
  }
  return absl::OkStatus();
}

TEST_P(ShardedGradScalerTest, FsdpShardsSkipTheSameStepAsTheReference) {
  const FsdpReference ref = RunFsdpReference(GetParam().value);
  ASSERT_EQ(ref.scales, kScales);
  for (bool nested : {false, true}) {
    for (int world = 1; world <= 4; ++world) {
      std::vector<absl::Status> statuses = comm::testing::RunInprocRanks(
          world, [&](int rank, int world, std::shared_ptr<comm::Communicator> comm) {
            return FsdpRank(rank, world, comm, GetParam().value, nested, ref);
          });
      for (int r = 0; r < world; ++r) {
        EXPECT_THAT(statuses[r], IsOk()) << "world " << world << " nested " << nested;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    BadValues, ShardedGradScalerTest,
    ::testing::Values(BadValueParam{"inf", std::numeric_limits<float>::infinity()},
                      BadValueParam{"nan", std::numeric_limits<float>::quiet_NaN()}),
    [](const ::testing::TestParamInfo<BadValueParam>& info) { return info.param.name; });

// The same over the real network stack: ranks are processes talking over the "tcp" backend on
// 127.0.0.1, nested FSDP units, inf in rank 1's shard gradient only.
TEST(ShardedGradScalerTcpTest, FsdpProcessesSkipTheSameStep) {
  constexpr float kInf = std::numeric_limits<float>::infinity();
  // Runs again in every child process (see rank_runner.h): cheap and without side effects.
  const FsdpReference ref = RunFsdpReference(kInf);
  for (int world : {2, 3}) {
    std::vector<absl::Status> statuses = comm::testing::RunProcesses(
        world,
        [&](int rank) -> absl::Status {
          try {
            FS_ASSIGN_OR_RETURN(
                std::shared_ptr<comm::Communicator> comm,
                comm::CreateCommunicator("tcp", comm::testing::RankConfig(absl::Seconds(20))));
            FS_RETURN_IF_ERROR(FsdpRank(rank, world, comm, kInf, /*nested=*/true, ref));
            // No rank closes its sockets while a peer may still finish its last collective.
            return comm->Barrier().Wait();
          } catch (const std::exception& e) {
            return absl::InternalError(e.what());
          }
        },
        absl::Seconds(40));
    for (int r = 0; r < world; ++r) EXPECT_THAT(statuses[r], IsOk()) << "world " << world;
  }
}

// The three pieces together: FSDP forward under a CPU bf16 Autocast guard (bf16 activations,
// f32 shards and shard gradients), the ShardedGradScaler stepping the shards, and close to the
// f32 single-process reference: the parameters within 6e-3 relative after each of 3 steps (bf16
// matmuls; measured at most 2.4e-3, growing by ~8e-4 a step).
TEST(ShardedGradScalerEdgeTest, FsdpUnderAutocastTrains) {
  constexpr int kWorld = 2;
  constexpr int kAutocastSteps = 3;
  const std::vector<ft::ReferenceStep> ref =
      ft::RunReference(ft::OptimizerKind::kSgdMomentum, kAutocastSteps);
  std::vector<absl::Status> statuses = comm::testing::RunInprocRanks(
      kWorld, [&](int rank, int world, std::shared_ptr<comm::Communicator> comm) {
        fsdp::FullyShardedDataParallel model(ft::NestedNet(comm, fsdp::FsdpOptions()), comm,
                                             fsdp::FsdpOptions());
        auto opt = ft::MakeOptimizer(ft::OptimizerKind::kSgdMomentum, model->parameters());
        ShardedGradScaler scaler(comm, Options());
        for (int step = 0; step < kAutocastSteps; ++step) {
          const std::string at = absl::StrCat("step ", step, " rank ", rank, "/", world);
          opt->zero_grad();
          ft::Batch b = ft::GlobalBatch(step);
          at::Tensor loss;
          {
            Autocast guard(at::kCPU, at::kBFloat16);
            at::Tensor out = model(ft::RankRows(b.x, rank, world));
            FS_RETURN_IF_ERROR(Check(out.scalar_type() == at::kBFloat16, at + ": output not bf16"));
            loss = ft::Mse(out.to(at::kFloat), ft::RankRows(b.y, rank, world));
          }
          scaler.scale(loss).backward();
          for (const auto& p : model->parameters()) {
            const bool f32_grad = !p.grad().defined() || p.grad().scalar_type() == at::kFloat;
            FS_RETURN_IF_ERROR(Check(p.scalar_type() == at::kFloat && f32_grad,
                                     at + ": shard or gradient not f32"));
          }
          FS_RETURN_IF_ERROR(Check(scaler.step(*opt), at + ": skipped"));
          scaler.update();
          FS_RETURN_IF_ERROR(ft::CheckShards(model, ref[step].params, /*grads=*/false,
                                             at + " param (bf16 forward)", 6e-3));
        }
        return absl::OkStatus();
      });
  for (const auto& s : statuses) EXPECT_THAT(s, IsOk());
}

// The control for the tests above: with a plain GradScaler per rank the ranks disagree (rank 0
// steps, rank 1 skips, and their scales part), which is FairScale #180's starting point.
TEST(ShardedGradScalerEdgeTest, PlainGradScalerDecidesPerRank) {
  std::vector<absl::Status> statuses = comm::testing::RunInprocRanks(
      2, [](int rank, int world, std::shared_ptr<comm::Communicator>) {
        at::Tensor w = at::tensor({1.0f, 2.0f}).set_requires_grad(true);
        torch::optim::SGD opt({w}, torch::optim::SGDOptions(0.5));
        GradScaler scaler(Options());
        scaler.scale((w * w).sum()).backward();
        if (rank == 1) w.mutable_grad()[0] = std::numeric_limits<float>::infinity();
        const bool stepped = scaler.step(opt);
        scaler.update();
        const std::string at = absl::StrCat("rank ", rank, "/", world);
        FS_RETURN_IF_ERROR(Check(stepped == (rank == 0), at + ": unexpected step decision"));
        return Check(scaler.get_scale() == (rank == 0 ? 1024.0 : 512.0), at + ": scale");
      });
  for (const auto& s : statuses) EXPECT_THAT(s, IsOk());
}

// Rank 0's parameter gets no gradient (it is not in its loss), as with an empty shard: it still
// joins the agreement, and the other ranks step. When no rank has gradients, every rank raises.
TEST(ShardedGradScalerEdgeTest, RankWithoutGradientsJoinsTheAgreement) {
  std::vector<absl::Status> statuses = comm::testing::RunInprocRanks(
      3, [](int rank, int world, std::shared_ptr<comm::Communicator> comm) {
        at::Tensor w = at::tensor({1.0f, 2.0f}).set_requires_grad(true);
        torch::optim::SGD opt({w}, torch::optim::SGDOptions(0.5));
        ShardedGradScaler scaler(comm, Options());
        // Rank 0's loss depends on another tensor only.
        at::Tensor other = at::tensor({3.0f}).set_requires_grad(true);
        at::Tensor loss = rank == 0 ? (other * other).sum() : (w * w).sum();
        scaler.scale(loss).backward();
        const bool stepped = scaler.step(opt);
        const std::string at = absl::StrCat("rank ", rank, "/", world);
        FS_RETURN_IF_ERROR(Check(stepped, at + ": did not step"));
        const at::Tensor expected =
            rank == 0 ? at::tensor({1.0f, 2.0f}) : at::tensor({0.0f, 0.0f});
        FS_RETURN_IF_ERROR(Check(at::equal(w.detach(), expected), at + ": parameters differ"));
        scaler.update();

        // No rank has gradients now.
        w.mutable_grad().reset();  // LibTorch 1.13's zero_grad() keeps zero gradients
        scaler.scale(at::tensor(1.0f));
        const std::string error = ErrorOf([&] { scaler.step(opt); });
        return Check(absl::StrContains(error, "none of the optimizer's parameters has a "
                                              "gradient") &&
                         absl::StrContains(error, at),
                     at + ": expected the no-gradient error, got '" + error + "'");
      });
  for (const auto& s : statuses) EXPECT_THAT(s, IsOk());
}

// A communicator that fails (here: aborted as if a peer died) makes step raise a c10::Error that
// names the rank and the failed all_reduce, on every rank, and steps nothing, also when the
// caller catches the error and calls step again.
TEST(ShardedGradScalerEdgeTest, BrokenCommunicatorRaisesNamingTheRank) {
  constexpr int kWorld = 2;
  std::vector<absl::Status> statuses = comm::testing::RunThreads(
      kWorld,
      [](int rank) -> absl::Status {
        try {
          FS_ASSIGN_OR_RETURN(std::shared_ptr<comm::Communicator> comm,
                              comm::CreateCommunicator(
                                  "inproc", comm::testing::RankConfig(absl::Seconds(30))));
          FS_RETURN_IF_ERROR(comm->Barrier().Wait());
          at::Tensor w = at::tensor({1.0f, 2.0f}).set_requires_grad(true);
          torch::optim::SGD opt({w}, torch::optim::SGDOptions(0.5));
          ShardedGradScaler scaler(comm, Options());
          scaler.scale((w * w).sum()).backward();
          comm->Abort(absl::UnavailableError("simulated: peer lost"));
          const std::string error = ErrorOf([&] { scaler.step(opt); });
          const std::string who = absl::StrCat("ShardedGradScaler rank ", rank, "/", kWorld);
          FS_RETURN_IF_ERROR(Check(absl::StrContains(error, who) &&
                                       absl::StrContains(error, "all_reduce"),
                                   "expected an error naming '" + who + "', got '" + error +
                                       "'"));
          FS_RETURN_IF_ERROR(Check(at::equal(w.detach(), at::tensor({1.0f, 2.0f})),
                                   "the parameters changed"));
          // Caught and retried: the gradients are not unscaled twice and nothing steps.
          FS_RETURN_IF_ERROR(Check(!scaler.step(opt), "the retried step stepped"));
          FS_RETURN_IF_ERROR(Check(at::equal(w.grad(), at::tensor({2.0f, 4.0f})),
                                   "the gradients were unscaled twice"));
          return Check(at::equal(w.detach(), at::tensor({1.0f, 2.0f})),
                       "the parameters changed after the retry");
        } catch (const std::exception& e) {
          return absl::InternalError(e.what());
        }
      },
      absl::Seconds(50));
  for (const auto& s : statuses) EXPECT_THAT(s, IsOk());
}

TEST(ShardedGradScalerEdgeTest, NullCommunicatorIsRejected) {
  EXPECT_THAT(ErrorOf([] { ShardedGradScaler s(nullptr); }),
              ::testing::HasSubstr("communicator is null"));
}

}  // namespace
}  // namespace fairscale::amp
