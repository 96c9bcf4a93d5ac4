// AdaScale tests: the gain on hand-constructed gradients (closed form), a single-process
// simulation of N workers (1-4, with and without accumulation, SGD and Adam; test_util.h) against
// plain data parallel, oss::OSS, oss::ShardedDataParallel and hand-made sharded gradients, the
// state round trip, and bad input (FSDP: fsdp_adapter_test.cc). Ranks are threads over inproc; they share torch's global RNG, so all data
// comes from private generators.
#include "adascale/adascale.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <functional>
#include <iostream>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "comm/testing/inproc_ranks.h"
#include "comm/testing/rank_runner.h"
#include "comm/torch/tensor_buffer.h"
#include "adascale/test_util.h"
#include "oss/oss.h"
#include "oss/sharded_data_parallel.h"
#include "testing/c10_error.h"

namespace fairscale::adascale {
namespace {

using comm::testing::Check;
using comm::testing::ExpectAllOk;
using comm::testing::RunInprocRanks;
using fairscale::testing::CatchErrors;
using fairscale::testing::ExpectError;
using testing::CompareStep;
using testing::Kind;
using testing::MakeOptimizer;
using testing::Model;
using testing::Simulate;
using testing::StepRecord;

// ---- (1) the gain on a hand-constructed case ---------------------------------------------------

// Two ranks, one parameter of 2 elements whose local gradients are set by hand; SGD lr 1,
// smoothing 0 (the averages are the step's values).
struct HandResult {
  double gain = 0, gain0 = 0, var = 0, sqr = 0, progress = 0;
  std::vector<float> param;
};

HandResult RunHand(const std::vector<float>& g0, const std::vector<float>& g1) {
  std::vector<HandResult> results(2);
  ExpectAllOk(RunInprocRanks(
      2, [&](int rank, int, std::shared_ptr<comm::Communicator> comm) -> absl::Status {
        return CatchErrors([&] {
          at::Tensor p = torch::zeros({2}, torch::requires_grad());
          torch::optim::SGD sgd({p}, torch::optim::SGDOptions(1.0));
          AdaScale ada(sgd, comm, AdaScaleOptions().smoothing(0.0));
          ada.zero_grad();
          p.mutable_grad() = torch::tensor(rank == 0 ? g0 : g1);
          ada.accumulate_local_gradients();
          ada.average_gradients();
          ada.step();
          HandResult& r = results[rank];
          r.gain = ada.gain();
          r.gain0 = ada.gain(0);
          r.var = ada.grad_var_avg(0);
          r.sqr = ada.grad_sqr_avg(0);
          r.progress = ada.progress();
          r.param = {p[0].item<float>(), p[1].item<float>()};
          return absl::OkStatus();
        });
      }));
  EXPECT_EQ(results[0].gain, results[1].gain);
  return results[0];
}

TEST(AdaScaleGainTest, HandConstructed) {
  // g1 = (3, 0), g2 = (1, 2): local = 9 + 5 = 14, mean = (2, 1), total = 5, S = n = 2:
  // var = 14 / 1 - 5 * 2 = 4 (= |g1 - g2|^2 / 2), sqr = 5 - 4 / 2 = 3, gain = 7 / 5.
  HandResult r = RunHand({3, 0}, {1, 2});
  EXPECT_NEAR(r.var, 4.0, 1e-12);
  EXPECT_NEAR(r.sqr, 3.0, 1e-12);
  EXPECT_NEAR(r.gain, 1.4, 1e-12);
  EXPECT_NEAR(r.gain0, 1.4, 1e-12);
  EXPECT_NEAR(r.progress, 1.4, 1e-12);
  // The step: p = 0 - lr * gain * mean.
  EXPECT_NEAR(r.param[0], -2.8, 1e-6);
  EXPECT_NEAR(r.param[1], -1.4, 1e-6);
}

TEST(AdaScaleGainTest, IdenticalGradientsGiveOne) {
  // var = 18 - 2 * 9 = 0, clamped to FairScale's floor 1e-6; sqr = 9.
  HandResult r = RunHand({3, 0}, {3, 0});
  EXPECT_NEAR(r.var, 1e-6, 1e-18);
  EXPECT_NEAR(r.sqr, 9.0, 1e-12);
  EXPECT_NEAR(r.gain, (1e-6 + 9.0) / (1e-6 / 2 + 9.0), 1e-15);
  EXPECT_NEAR(r.gain, 1.0, 1e-7);
}

TEST(AdaScaleGainTest, PureNoiseGivesScale) {
  // mean 0: total = 0, var = 18, sqr = -9 clamped to 0: gain = var / (var / S) = S = 2.
  HandResult r = RunHand({3, 0}, {-3, 0});
  EXPECT_NEAR(r.var, 18.0, 1e-12);
  EXPECT_EQ(r.sqr, 0.0);
  EXPECT_NEAR(r.gain, 2.0, 1e-12);
}

// ---- (2) a single-process simulation of N workers ----------------------------------------------

// One rank's training: each of its micro-batches' backward, accumulate, average, step.
void TrainSteps(Model& m, AdaScale& ada, int rank, int first, int last) {
  for (int step = first; step < last; ++step) {
    ada.zero_grad();
    for (int micro = 0; micro < ada.num_gradients_to_accumulate(); ++micro) {
      m.loss(step, rank, micro).backward();
      ada.accumulate_local_gradients();
    }
    ada.average_gradients();
    ada.step();
  }
}

struct SimCase {
  Kind kind;
  int workers;
  int accum;
  bool debias = true;
};

class AdaScaleSimulationTest : public ::testing::TestWithParam<SimCase> {};

TEST_P(AdaScaleSimulationTest, MatchesSingleProcessSimulation) {
  const SimCase c = GetParam();
  // SGD: the default smoothing (1 - n/1000); Adam: 0.5, so that the average moves visibly.
  // Without debiasing: 0.7, so that steps 1-3 take the plain mean and steps 4-5 the EWMA.
  const double smoothing = !c.debias              ? 0.7
                           : c.kind == Kind::kSgd ? 1.0 - c.workers * c.accum / 1000.0
                                                  : 0.5;
  const bool explicit_smoothing = c.kind == Kind::kAdam || !c.debias;
  constexpr int kSteps = 5;
  const std::vector<StepRecord> ref =
      Simulate(c.kind, c.workers, c.accum, smoothing, kSteps, c.debias);
  std::vector<double> max_err(c.workers, 0.0);
  ExpectAllOk(RunInprocRanks(
      c.workers, [&](int rank, int, std::shared_ptr<comm::Communicator> comm) -> absl::Status {
        return CatchErrors([&]() -> absl::Status {
          Model m;
          auto opt = MakeOptimizer(c.kind, m);
          AdaScaleOptions options =
              AdaScaleOptions().num_gradients_to_accumulate(c.accum).debias_ewma(c.debias);
          if (explicit_smoothing) options.smoothing(smoothing);
          AdaScale ada(*opt, comm, options);
          if (std::abs(ada.smoothing() - smoothing) > 1e-15) {
            return absl::InternalError(absl::StrCat("smoothing ", ada.smoothing()));
          }
          for (int step = 0; step < kSteps; ++step) {
            TrainSteps(m, ada, rank, step, step + 1);
            FS_RETURN_IF_ERROR(CompareStep(absl::StrCat("rank ", rank, " step ", step), m.w, m.b, ada,
                                           ref[step], 1e-6, &max_err[rank]));
          }
          return absl::OkStatus();
        });
      }));
  double worst = 0;
  for (double e : max_err) worst = std::max(worst, e);
  std::cout << "[measured] workers " << c.workers << " accum " << c.accum << " "
            << (c.kind == Kind::kSgd ? "SGD" : "Adam") << (c.debias ? "" : " (B.3 mean)")
            << ": max |error| " << worst << " (params, gains, progress); final gain "
            << ref.back().gain << "\n";
  // The gain must have moved off 1 (the test would be vacuous otherwise).
  EXPECT_GT(ref.back().gain, 1.0 + 1e-3);
}

INSTANTIATE_TEST_SUITE_P(Workers, AdaScaleSimulationTest,
                         ::testing::Values(SimCase{Kind::kSgd, 1, 2}, SimCase{Kind::kSgd, 2, 1},
                                           SimCase{Kind::kSgd, 3, 1}, SimCase{Kind::kSgd, 4, 1},
                                           SimCase{Kind::kSgd, 2, 2}, SimCase{Kind::kSgd, 3, 2},
                                           SimCase{Kind::kSgd, 4, 2}, SimCase{Kind::kAdam, 1, 2},
                                           SimCase{Kind::kAdam, 2, 1}, SimCase{Kind::kAdam, 3, 2},
                                           SimCase{Kind::kAdam, 4, 1}, SimCase{Kind::kAdam, 4, 2},
                                           SimCase{Kind::kSgd, 3, 2, false},
                                           SimCase{Kind::kAdam, 2, 1, false}),
                         [](const ::testing::TestParamInfo<SimCase>& info) {
                           return absl::StrCat(info.param.kind == Kind::kSgd ? "Sgd" : "Adam", "N",
                                               info.param.workers, "Accum", info.param.accum,
                                               info.param.debias ? "" : "NoDebias");
                         });

// ---- (2b) over OSS, and with sharded gradients --------------------------------------------------

// AdaScale over oss::OSS (its param_groups() are what AdaScale scales; OSS copies them into its
// wrapped optimizer at every step): the same trajectory as the simulation.
TEST(AdaScaleOssTest, MatchesSimulation) {
  constexpr int kWorkers = 3, kAccum = 2, kSteps = 4;
  const double smoothing = 0.5;
  const std::vector<StepRecord> ref = Simulate(Kind::kSgd, kWorkers, kAccum, smoothing, kSteps);
  double worst = 0;
  std::vector<double> max_err(kWorkers, 0.0);
  ExpectAllOk(RunInprocRanks(
      kWorkers, [&](int rank, int, std::shared_ptr<comm::Communicator> comm) -> absl::Status {
        return CatchErrors([&]() -> absl::Status {
          Model m;
          oss::OSS opt(
              testing::MakeGroups(Kind::kSgd, {{m.w}, {m.b}}),
              [](std::vector<torch::optim::OptimizerParamGroup> g) {
                return testing::MakeInner(Kind::kSgd, std::move(g));
              },
              comm, oss::OssOptions().partition(oss::PartitionMode::kFlat));
          AdaScale ada(opt, comm,
                       AdaScaleOptions().num_gradients_to_accumulate(kAccum).smoothing(smoothing));
          for (int step = 0; step < kSteps; ++step) {
            TrainSteps(m, ada, rank, step, step + 1);
            FS_RETURN_IF_ERROR(CompareStep(absl::StrCat("oss rank ", rank, " step ", step), m.w, m.b, ada,
                                           ref[step], 1e-6, &max_err[rank]));
          }
          return absl::OkStatus();
        });
      }));
  for (double e : max_err) worst = std::max(worst, e);
  std::cout << "[measured] OSS kFlat, 3 workers accum 2 SGD: max |error| " << worst << "\n";
}

// oss::ShardedDataParallel reduces each gradient to its owner only. The exact route: every
// backward under no_sync() (local gradients accumulate in .grad), accumulate_local_gradients()
// after each, then sdp->reduce() (owners get the mean, the rest no gradient or zeros in a kFlat
// parameter's other ranges), then step() with sharded_gradients(true). The usual loop with a
// synchronised last backward goes through AdaScaleSdp (sdp_adapter_test.cc).

struct SdpCase {
  Kind kind;
  int workers;
  int accum;
  oss::PartitionMode mode;
};

class AdaScaleSdpTest : public ::testing::TestWithParam<SdpCase> {};

TEST_P(AdaScaleSdpTest, MatchesSimulation) {
  const SdpCase c = GetParam();
  constexpr int kSteps = 4;
  const double smoothing = c.kind == Kind::kSgd ? 1.0 - c.workers * c.accum / 1000.0 : 0.5;
  const std::vector<StepRecord> ref = Simulate(c.kind, c.workers, c.accum, smoothing, kSteps);
  std::vector<double> max_err(c.workers, 0.0);
  ExpectAllOk(RunInprocRanks(
      c.workers, [&](int rank, int, std::shared_ptr<comm::Communicator> comm) -> absl::Status {
        return CatchErrors([&]() -> absl::Status {
          testing::PlainLinear net;
          const Kind kind = c.kind;
          auto opt = std::make_shared<oss::OSS>(
              testing::MakeGroups(kind, {{net->w}, {net->b}}),
              [kind](std::vector<torch::optim::OptimizerParamGroup> g) {
                return testing::MakeInner(kind, std::move(g));
              },
              comm, oss::OssOptions().partition(c.mode));
          oss::ShardedDataParallel sdp(torch::nn::AnyModule(net), opt,
                                       oss::ShardedDataParallelOptions().reduce_bucket_numel(8));
          AdaScaleOptions options =
              AdaScaleOptions().num_gradients_to_accumulate(c.accum).sharded_gradients(true);
          if (kind == Kind::kAdam) options.smoothing(smoothing);
          AdaScale ada(*opt, comm, options);
          for (int step = 0; step < kSteps; ++step) {
            ada.zero_grad();
            for (int micro = 0; micro < c.accum; ++micro) {
              auto no_sync = sdp->no_sync();
              const testing::Batch d = testing::Data(step, rank, micro);
              torch::mse_loss(sdp->forward(d.x), d.y).backward();
              ada.accumulate_local_gradients();
            }
            sdp->reduce();
            ada.step();
            FS_RETURN_IF_ERROR(CompareStep(absl::StrCat("sdp rank ", rank, " step ", step),
                                           net->w, net->b, ada, ref[step], 1e-6,
                                           &max_err[rank]));
          }
          return absl::OkStatus();
        });
      }));
  double worst = 0;
  for (double e : max_err) worst = std::max(worst, e);
  std::cout << "[measured] ShardedDataParallel "
            << (c.mode == oss::PartitionMode::kFlat ? "kFlat" : "kGreedy") << ", " << c.workers
            << " workers accum " << c.accum << " " << testing::KindName(c.kind)
            << ": max |error| " << worst << "; final gain " << ref.back().gain << "\n";
  EXPECT_GT(ref.back().gain, 1.0 + 1e-3);
}

INSTANTIATE_TEST_SUITE_P(
    Sdp, AdaScaleSdpTest,
    ::testing::Values(SdpCase{Kind::kSgd, 2, 1, oss::PartitionMode::kGreedy},
                      SdpCase{Kind::kAdam, 2, 2, oss::PartitionMode::kFlat},
                      SdpCase{Kind::kSgd, 3, 1, oss::PartitionMode::kGreedy},
                      SdpCase{Kind::kSgd, 3, 2, oss::PartitionMode::kFlat},
                      SdpCase{Kind::kAdam, 4, 1, oss::PartitionMode::kGreedy},
                      SdpCase{Kind::kSgd, 4, 2, oss::PartitionMode::kFlat}),
    [](const ::testing::TestParamInfo<SdpCase>& info) {
      return absl::StrCat(testing::KindName(info.param.kind), "N", info.param.workers, "Accum",
                          info.param.accum,
                          info.param.mode == oss::PartitionMode::kFlat ? "Flat" : "Greedy");
    });

// sharded_gradients: each rank keeps only its part of the averaged gradient (elements i with
// i % N == rank, zero elsewhere: what a reduce-scatter leaves), so the total squared norm must be
// summed over the ranks. The local squares are handed in by accumulate_local_grad_sqr (an
// adapter's path). Elementwise SGD then updates only owned elements; the ranks re-assemble the
// parameters with a sum of their updates, and the trajectory matches the simulation.
TEST(AdaScaleShardedTest, MatchesSimulation) {
  constexpr int kWorkers = 2, kAccum = 2, kSteps = 4;
  const double smoothing = 0.5;
  const std::vector<StepRecord> ref = Simulate(Kind::kSgd, kWorkers, kAccum, smoothing, kSteps);
  std::vector<double> max_err(kWorkers, 0.0);
  ExpectAllOk(RunInprocRanks(
      kWorkers, [&](int rank, int world, std::shared_ptr<comm::Communicator> comm) -> absl::Status {
        return CatchErrors([&]() -> absl::Status {
          Model m;
          auto opt = MakeOptimizer(Kind::kSgd, m);
          AdaScale ada(*opt, comm,
                       AdaScaleOptions()
                           .num_gradients_to_accumulate(kAccum)
                           .smoothing(smoothing)
                           .sharded_gradients(true));
          FS_RETURN_IF_ERROR(ExpectError([&] { ada.average_gradients(); }, {"sharded_gradients"}));
          auto all_reduce = [&](at::Tensor t, comm::ReduceOp op) {
            comm::Buffer b = comm::ToBuffer(t).value();
            absl::Status s = comm->AllReduce(b, b, op).Wait();
            if (!s.ok()) throw std::runtime_error(s.ToString());
          };
          for (int step = 0; step < kSteps; ++step) {
            ada.zero_grad();
            for (int micro = 0; micro < kAccum; ++micro) {
              auto grads = torch::autograd::grad({m.loss(step, rank, micro)}, {m.w, m.b});
              ada.accumulate_local_grad_sqr(
                  {grads[0].to(torch::kFloat64).pow(2).sum().item<double>(),
                   grads[1].to(torch::kFloat64).pow(2).sum().item<double>()});
              m.w.mutable_grad() = m.w.grad().defined() ? m.w.grad() + grads[0] : grads[0];
              m.b.mutable_grad() = m.b.grad().defined() ? m.b.grad() + grads[1] : grads[1];
            }
            std::vector<at::Tensor> before;
            for (at::Tensor* p : {&m.w, &m.b}) {
              at::Tensor g = p->grad().contiguous();
              all_reduce(g, comm::ReduceOp::kAvg);
              at::Tensor owned = torch::arange(g.numel()).remainder(world).eq(rank).view(g.sizes());
              p->mutable_grad() = g * owned.to(g.scalar_type());
              before.push_back(p->detach().clone());
            }
            ada.step();
            torch::NoGradGuard no_grad;
            int i = 0;
            for (at::Tensor* p : {&m.w, &m.b}) {
              at::Tensor update = (*p - before[i]).contiguous();
              all_reduce(update, comm::ReduceOp::kSum);
              p->copy_(before[i] + update);
              ++i;
            }
            FS_RETURN_IF_ERROR(CompareStep(absl::StrCat("sharded rank ", rank, " step ", step), m.w,
                                           m.b, ada, ref[step], 1e-6, &max_err[rank]));
          }
          return absl::OkStatus();
        });
      }));
  double worst = 0;
  for (double e : max_err) worst = std::max(worst, e);
  std::cout << "[measured] sharded gradients, 2 workers accum 2 SGD: max |error| " << worst << "\n";
}

// ---- (3) state round trip -----------------------------------------------------------------------

std::string ToBytes(const std::function<void(torch::serialize::OutputArchive&)>& save) {
  torch::serialize::OutputArchive archive;
  save(archive);
  std::ostringstream os;
  archive.save_to(os);
  return os.str();
}

void FromBytes(const std::string& bytes,
               const std::function<void(torch::serialize::InputArchive&)>& load) {
  torch::serialize::InputArchive archive;
  std::istringstream is(bytes);
  archive.load_from(is);
  load(archive);
}

TEST(AdaScaleStateTest, SaveLoadContinuesIdentically) {
  ExpectAllOk(RunInprocRanks(
      2, [&](int rank, int, std::shared_ptr<comm::Communicator> comm) -> absl::Status {
        return CatchErrors([&]() -> absl::Status {
          const AdaScaleOptions options =
              AdaScaleOptions().num_gradients_to_accumulate(2).smoothing(0.7);
          Model m;
          auto opt = MakeOptimizer(Kind::kSgd, m);
          AdaScale ada(*opt, comm, options);
          TrainSteps(m, ada, rank, 0, 3);
          const std::string ada_bytes = ToBytes([&](auto& a) { a << ada; });
          const std::string opt_bytes = ToBytes([&](auto& a) { opt->save(a); });
          const at::Tensor w3 = m.w.detach().clone(), b3 = m.b.detach().clone();
          TrainSteps(m, ada, rank, 3, 6);

          Model m2;
          {
            torch::NoGradGuard no_grad;
            m2.w.copy_(w3);
            m2.b.copy_(b3);
          }
          auto opt2 = MakeOptimizer(Kind::kSgd, m2);
          // A different scale and smoothing before the load: the load must restore them.
          AdaScale ada2(*opt2, comm, AdaScaleOptions().num_gradients_to_accumulate(2).scale(3.0));
          FromBytes(opt_bytes, [&](auto& a) { opt2->load(a); });
          FromBytes(ada_bytes, [&](auto& a) { a >> ada2; });
          TrainSteps(m2, ada2, rank, 3, 6);
          FS_RETURN_IF_ERROR(Check(torch::equal(m.w, m2.w) && torch::equal(m.b, m2.b),
                                   "parameters differ after the round trip"));
          FS_RETURN_IF_ERROR(
              Check(ada.gain() == ada2.gain() && ada.gain(1) == ada2.gain(1) &&
                        ada.progress() == ada2.progress() && ada.scale() == ada2.scale() &&
                        ada.smoothing() == ada2.smoothing(),
                    absl::StrCat("state differs: gain ", ada.gain(), " vs ", ada2.gain(),
                                 ", progress ", ada.progress(), " vs ", ada2.progress())));
          return absl::OkStatus();
        });
      }));
}

// ---- (4) bad input ---------------------------------------------------------------------------

TEST(AdaScaleStateTest, LoadRejectsAnotherGroupCount) {
  ExpectAllOk(
      RunInprocRanks(2, [&](int, int, std::shared_ptr<comm::Communicator> comm) -> absl::Status {
        Model m;
        auto opt = MakeOptimizer(Kind::kSgd, m);
        AdaScale ada(*opt, comm);
        const std::string bytes = ToBytes([&](auto& a) { a << ada; });
        torch::optim::SGD one({m.w}, torch::optim::SGDOptions(0.1));
        AdaScale ada1(one, comm);
        FS_RETURN_IF_ERROR(ExpectError([&] { FromBytes(bytes, [&](auto& a) { a >> ada1; }); },
                                       {"adascale::AdaScale::load", "INVALID_ARGUMENT",
                                        "statistics for 2 param groups, the optimizer has 1"}));
        torch::serialize::OutputArchive other;
        other.write("something", torch::zeros({1}));
        std::ostringstream os;
        other.save_to(os);
        return ExpectError([&] { FromBytes(os.str(), [&](auto& a) { a >> ada1; }); },
                           {"DATA_LOSS", "not an AdaScale archive"});
      }));
}

TEST(AdaScaleErrorTest, BadInput) {
  ExpectAllOk(RunInprocRanks(
      2, [&](int rank, int, std::shared_ptr<comm::Communicator> comm) -> absl::Status {
        Model m;
        auto opt = MakeOptimizer(Kind::kSgd, m);
        FS_RETURN_IF_ERROR(ExpectError([&] { AdaScale(*opt, comm, AdaScaleOptions().scale(0.5)); },
                                       {"rank " + std::to_string(rank) + "/2", "INVALID_ARGUMENT",
                                        "scale must be >= 1, got 0.5"}));
        FS_RETURN_IF_ERROR(
            ExpectError([&] { AdaScale(*opt, comm, AdaScaleOptions().smoothing(1.0)); },
                        {"smoothing must be in [0, 1), got 1"}));
        FS_RETURN_IF_ERROR(
            ExpectError([&] { AdaScale(*opt, comm, AdaScaleOptions().smoothing(-0.1)); },
                        {"smoothing must be in [0, 1), got -0.1"}));
        FS_RETURN_IF_ERROR(ExpectError(
            [&] { AdaScale(*opt, comm, AdaScaleOptions().num_gradients_to_accumulate(0)); },
            {"num_gradients_to_accumulate must be >= 1, got 0"}));
        FS_RETURN_IF_ERROR(
            ExpectError([&] { AdaScale(*opt, comm, AdaScaleOptions().gradient_replicas(2)); },
                        {"gradient_replicas must be >= 1, divide the world size 2",
                         "got 2 without sharded_gradients"}));
        FS_RETURN_IF_ERROR(ExpectError(
            [&] {
              AdaScale(*opt, comm, AdaScaleOptions().sharded_gradients(true).gradient_replicas(3));
            },
            {"INVALID_ARGUMENT", "gradient_replicas must be", "got 3"}));
        AdaScale ada(*opt, comm, AdaScaleOptions().num_gradients_to_accumulate(2));
        FS_RETURN_IF_ERROR(
            ExpectError([&] { ada.step(); }, {"adascale::AdaScale::step", "FAILED_PRECONDITION",
                                              "0 of 2 accumulate_local_gradients() calls"}));
        m.loss(0, rank, 0).backward();
        ada.accumulate_local_gradients();
        FS_RETURN_IF_ERROR(Check(ada.is_accumulation_step() == false, "is_accumulation_step"));
        FS_RETURN_IF_ERROR(ExpectError([&] { ada.step(); }, {"1 of 2 accumulate_local_gradients"}));
        FS_RETURN_IF_ERROR(
            ExpectError([&] { ada.zero_grad(); }, {"middle of a gradient accumulation"}));
        FS_RETURN_IF_ERROR(
            ExpectError([&] { ada.set_scale(4.0); }, {"middle of a gradient accumulation"}));
        FS_RETURN_IF_ERROR(ExpectError([&] { ada.accumulate_local_grad_sqr({1.0}); },
                                       {"got 1 squared norms for 2"}));
        // Squares from an adapter mixed into a step fed by accumulate_local_gradients().
        FS_RETURN_IF_ERROR(ExpectError(
            [&] { ada.accumulate_local_grad_sqr({1.0, 1.0}); },
            {"accumulate_local_grad_sqr rank", "FAILED_PRECONDITION", "one source"}));
        return absl::OkStatus();
      }));
  // One worker without accumulation has no variance.
  ExpectAllOk(
      RunInprocRanks(1, [&](int, int, std::shared_ptr<comm::Communicator> comm) -> absl::Status {
        Model m;
        auto opt = MakeOptimizer(Kind::kSgd, m);
        return ExpectError([&] { AdaScale ada(*opt, comm); },
                           {"single worker without gradient accumulation"});
      }));
}

}  // namespace
}  // namespace fairscale::adascale
