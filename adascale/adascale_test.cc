// AdaScale tests: the gain on hand-constructed gradients (closed form), a single-process
// simulation of N workers (1-4, with and without accumulation, SGD and Adam), the state round
// trip, and bad input. Ranks are threads over inproc; they share torch's global RNG, so all data
// comes from private generators.
#include "adascale/adascale.h"

#include <ATen/CPUGeneratorImpl.h>
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
#include "oss/oss.h"
#include "testing/c10_error.h"

namespace fairscale::adascale {
namespace {

using comm::testing::Check;
using comm::testing::ExpectAllOk;
using comm::testing::RunInprocRanks;
using fairscale::testing::CatchErrors;
using fairscale::testing::ExpectError;

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

enum class Kind { kSgd, kAdam };

at::Tensor Randn(std::vector<int64_t> shape, uint64_t seed) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randn(shape, gen, torch::kFloat32);
}

// A linear model y = x W^T + b (two param groups: W and b, different lrs).
struct Model {
  at::Tensor w, b;
  Model() {
    w = Randn({3, 4}, 7).requires_grad_();
    b = Randn({3}, 8).requires_grad_();
  }
  at::Tensor loss(int step, int worker, int micro) const {
    const uint64_t seed = 1000 + 100 * step + 10 * worker + micro;
    at::Tensor x = Randn({5, 4}, seed);
    at::Tensor y = Randn({5, 3}, seed + 50000) + 0.5;
    return torch::mse_loss(torch::matmul(x, w.t()) + b, y);
  }
};

std::unique_ptr<torch::optim::Optimizer> MakeOptimizer(Kind kind, Model& m) {
  std::vector<torch::optim::OptimizerParamGroup> groups;
  if (kind == Kind::kSgd) {
    // A group's options replace the defaults entirely: momentum is set on each.
    groups.emplace_back(
        std::vector<at::Tensor>{m.w},
        std::make_unique<torch::optim::SGDOptions>(torch::optim::SGDOptions(0.05).momentum(0.9)));
    groups.emplace_back(
        std::vector<at::Tensor>{m.b},
        std::make_unique<torch::optim::SGDOptions>(torch::optim::SGDOptions(0.1).momentum(0.9)));
    return std::make_unique<torch::optim::SGD>(groups,
                                               torch::optim::SGDOptions(0.05).momentum(0.9));
  }
  groups.emplace_back(std::vector<at::Tensor>{m.w},
                      std::make_unique<torch::optim::AdamOptions>(0.01));
  groups.emplace_back(std::vector<at::Tensor>{m.b},
                      std::make_unique<torch::optim::AdamOptions>(0.02));
  return std::make_unique<torch::optim::Adam>(groups, torch::optim::AdamOptions(0.01));
}

struct StepRecord {
  at::Tensor w, b;
  double gain0 = 0, gain1 = 0, gain = 0, progress = 0;
};

// The formulas, written out for the reference (f64 on the per-worker gradients).
std::vector<StepRecord> Simulate(Kind kind, int workers, int accum, double smoothing, int steps,
                                 bool debias = true) {
  Model m;
  auto opt = MakeOptimizer(kind, m);
  const double n = workers * accum;
  const double scale = n;
  double sqr_b[2] = {0, 0}, var_b[2] = {0, 0}, unbias[2] = {0, 0};
  double sqr_avg[2] = {1, 1}, var_avg[2] = {0, 0}, sqr_tot[2] = {0, 0}, var_tot[2] = {0, 0};
  double progress = 0;
  std::vector<StepRecord> out;
  for (int step = 0; step < steps; ++step) {
    double local[2] = {0, 0};
    at::Tensor sum_w = torch::zeros_like(m.w), sum_b = torch::zeros_like(m.b);
    for (int worker = 0; worker < workers; ++worker) {
      at::Tensor acc_w, acc_b;
      for (int micro = 0; micro < accum; ++micro) {
        auto grads = torch::autograd::grad({m.loss(step, worker, micro)}, {m.w, m.b});
        local[0] += grads[0].to(torch::kFloat64).pow(2).sum().item<double>();
        local[1] += grads[1].to(torch::kFloat64).pow(2).sum().item<double>();
        acc_w = micro == 0 ? grads[0] : acc_w + grads[0];
        acc_b = micro == 0 ? grads[1] : acc_b + grads[1];
      }
      sum_w += acc_w;
      sum_b += acc_b;
    }
    at::Tensor avg[2] = {sum_w / workers, sum_b / workers};
    double gains[2];
    double var_sum = 0, sqr_sum = 0;
    for (int g = 0; g < 2; ++g) {
      const double total =
          avg[g].to(torch::kFloat64).pow(2).sum().item<double>() / (double(accum) * accum);
      double var = local[g] * (scale / n) / (n - 1) - total * scale / (n - 1);
      double sqr = total - var / scale;
      var = std::max(var, 1e-6);
      sqr = std::max(sqr, 0.0);
      if (debias) {
        sqr_b[g] = smoothing * sqr_b[g] + (1 - smoothing) * sqr;
        var_b[g] = smoothing * var_b[g] + (1 - smoothing) * var;
        unbias[g] = smoothing * unbias[g] + (1 - smoothing);
        sqr_avg[g] = sqr_b[g] / unbias[g];
        var_avg[g] = var_b[g] / unbias[g];
      } else if (step + 1 < 1 / (1 - smoothing)) {  // appendix B.3: the mean of the first steps
        sqr_tot[g] += sqr;
        var_tot[g] += var;
        sqr_avg[g] = sqr_tot[g] / (step + 1);
        var_avg[g] = var_tot[g] / (step + 1);
      } else {
        sqr_avg[g] = smoothing * sqr_avg[g] + (1 - smoothing) * sqr;
        var_avg[g] = smoothing * var_avg[g] + (1 - smoothing) * var;
      }
      const double s = sqr_avg[g], v = var_avg[g];
      gains[g] = (v + s) / (v / scale + s);
      var_sum += v;
      sqr_sum += s;
    }
    const double gain = (var_sum + sqr_sum) / (var_sum / scale + sqr_sum);
    m.w.mutable_grad() = avg[0];
    m.b.mutable_grad() = avg[1];
    double lrs[2];
    for (int g = 0; g < 2; ++g) {
      auto& o = opt->param_groups()[g].options();
      lrs[g] = o.get_lr();
      o.set_lr(lrs[g] * gains[g]);
    }
    opt->step();
    for (int g = 0; g < 2; ++g) opt->param_groups()[g].options().set_lr(lrs[g]);
    progress += gain;
    out.push_back({m.w.detach().clone(), m.b.detach().clone(), gains[0], gains[1], gain, progress});
  }
  return out;
}

absl::Status CompareStep(const std::string& what, const Model& m, const AdaScale& ada,
                         const StepRecord& want, double tol, double* max_err) {
  const double ew = (m.w.detach() - want.w).abs().max().item<double>();
  const double eb = (m.b.detach() - want.b).abs().max().item<double>();
  const double eg =
      std::max({std::abs(ada.gain(0) - want.gain0), std::abs(ada.gain(1) - want.gain1),
                std::abs(ada.gain() - want.gain)});
  const double ep = std::abs(ada.progress() - want.progress);
  *max_err = std::max({*max_err, ew, eb, eg, ep});
  return Check(ew <= tol && eb <= tol && eg <= tol && ep <= tol,
               absl::StrCat(what, ": |dW| ", ew, " |db| ", eb, " |dgain| ", eg, " |dprogress| ", ep,
                            " (gain ", ada.gain(), " want ", want.gain, ")"));
}

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
            FS_RETURN_IF_ERROR(CompareStep(absl::StrCat("rank ", rank, " step ", step), m, ada,
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
          std::vector<torch::optim::OptimizerParamGroup> groups;
          groups.emplace_back(std::vector<at::Tensor>{m.w},
                              std::make_unique<torch::optim::SGDOptions>(
                                  torch::optim::SGDOptions(0.05).momentum(0.9)));
          groups.emplace_back(std::vector<at::Tensor>{m.b},
                              std::make_unique<torch::optim::SGDOptions>(
                                  torch::optim::SGDOptions(0.1).momentum(0.9)));
          oss::OSS opt(
              std::move(groups),
              [](std::vector<torch::optim::OptimizerParamGroup> g) {
                return std::unique_ptr<torch::optim::Optimizer>(std::make_unique<torch::optim::SGD>(
                    std::move(g), torch::optim::SGDOptions(0.05).momentum(0.9)));
              },
              comm, oss::OssOptions().partition(oss::PartitionMode::kFlat));
          AdaScale ada(opt, comm,
                       AdaScaleOptions().num_gradients_to_accumulate(kAccum).smoothing(smoothing));
          for (int step = 0; step < kSteps; ++step) {
            TrainSteps(m, ada, rank, step, step + 1);
            FS_RETURN_IF_ERROR(CompareStep(absl::StrCat("oss rank ", rank, " step ", step), m, ada,
                                           ref[step], 1e-6, &max_err[rank]));
          }
          return absl::OkStatus();
        });
      }));
  for (double e : max_err) worst = std::max(worst, e);
  std::cout << "[measured] OSS kFlat, 3 workers accum 2 SGD: max |error| " << worst << "\n";
}

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
            FS_RETURN_IF_ERROR(CompareStep(absl::StrCat("sharded rank ", rank, " step ", step), m,
                                           ada, ref[step], 1e-6, &max_err[rank]));
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
