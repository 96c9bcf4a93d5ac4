// SlowMo / LocalSGD against a single-process simulation of the same N workers (ranks as threads
// over inproc; slowmo/test_util.h has the model, the batches and the simulation). Every worker's
// data comes from a private at::Generator seeded by (worker, step): thread ranks share torch's
// global RNG.
#include "slowmo/slowmo.h"

#include <ATen/ATen.h>
#include <torch/optim/sgd.h>

#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "comm/testing/counting_communicator.h"
#include "comm/testing/inproc_ranks.h"
#include "comm/testing/rank_runner.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "slowmo/test_util.h"
#include "testing/c10_error.h"

namespace fairscale::slowmo {
namespace {

using comm::Communicator;
using comm::testing::ExpectAllOk;
using comm::testing::RunInprocRanks;
using ::testing::HasSubstr;
using fairscale::testing::CatchErrors;
using fairscale::testing::ErrorOf;
using testing::Backward;
using testing::Close;
using testing::Config;
using testing::kLr;
using testing::kSteps;
using testing::Opt;
using testing::Simulate;
using testing::TakeMaxError;
using testing::Worker;

TEST(SlowMoTest, MatchesSingleProcessSimulation) {
  for (int world = 1; world <= 4; ++world) {
    for (Opt opt : {Opt::kSgd, Opt::kAdam}) {
      for (int64_t h : {1, 3}) {
        for (auto [alpha, beta] : std::vector<std::pair<double, double>>{
                 {1.0, 0.0}, {1.0, 0.5}, {0.7, 0.3}}) {
          const Config c{world, opt, h, alpha, beta};
          const auto want = Simulate(c);
          ExpectAllOk(
              RunInprocRanks(world,
                             [&](int rank, int, std::shared_ptr<Communicator> comm) {
                               return CatchErrors([&]() -> absl::Status {
                                 Worker m(c.opt);
                                 SlowMo slowmo(m.params(), comm,
                                               SlowMoOptions()
                                                   .frequency(c.h)
                                                   .slowmo_lr(c.alpha)
                                                   .slowmo_momentum(c.beta)
                                                   .base_lr(kLr));
                                 for (int step = 0; step < kSteps; ++step) {
                                   Backward(m, rank, step);
                                   m.opt->step();
                                   slowmo.step_completed();
                                 }
                                 return Close(m.params(), want[rank], 1e-6, c.Name());
                               });
                             }),
              c.Name());
        }
      }
    }
  }
  std::cout << "simulation: max |error| over 48 configurations " << TakeMaxError() << "\n";
}

// H = 1, LocalSGD, plain SGD: averaging the parameters after every step is DDP's gradient
// averaging (same start, x - lr * mean(g) = mean(x - lr * g)).
TEST(SlowMoTest, EveryStepLocalSgdEqualsGradientAveraging) {
  for (int world = 1; world <= 4; ++world) {
    // DDP reference: one model, the mean of the N workers' gradients.
    Worker ref(Opt::kSgd);
    ref.opt = std::make_unique<torch::optim::SGD>(ref.params(), torch::optim::SGDOptions(kLr));
    for (int step = 0; step < kSteps; ++step) {
      std::vector<at::Tensor> sum;
      for (int r = 0; r < world; ++r) {
        Backward(ref, r, step);
        for (size_t i = 0; i < 2; ++i) {
          at::Tensor g = ref.params()[i].grad().clone();
          if (r == 0) sum.push_back(g); else sum[i] += g;
        }
      }
      for (size_t i = 0; i < 2; ++i) ref.params()[i].mutable_grad().copy_(sum[i] / world);
      ref.opt->step();
    }
    const std::vector<at::Tensor> want = {ref.w.detach().to(at::kDouble), ref.b.detach().clone()};
    ExpectAllOk(RunInprocRanks(world,
                               [&](int rank, int, std::shared_ptr<Communicator> comm) {
                                 return CatchErrors([&]() -> absl::Status {
                                   Worker m(Opt::kSgd);
                                   m.opt = std::make_unique<torch::optim::SGD>(
                                       m.params(), torch::optim::SGDOptions(kLr));
                                   SlowMo slowmo(m.params(), comm,
                                                 SlowMoOptions().frequency(1).base_lr(kLr));
                                   for (int step = 0; step < kSteps; ++step) {
                                     Backward(m, rank, step);
                                     m.opt->step();
                                     slowmo.step_completed();
                                   }
                                   return Close(m.params(), want, 1e-6, "ddp");
                                 });
                               }),
                absl::StrCat("ddp world ", world));
  }
  std::cout << "gradient averaging: max |error| " << TakeMaxError() << "\n";
}

// One all-reduce of the parameter bytes every H steps, nothing in between.
TEST(SlowMoTest, BytesOneAllReduceEveryHSteps) {
  using comm::OpType;
  constexpr int64_t kParamBytes = 4 * 3 * 4 + 3 * 8;  // f32 weight + f64 bias
  for (double beta : {0.0, 0.5}) {
    ExpectAllOk(RunInprocRanks(3, [&](int rank, int, std::shared_ptr<Communicator> inner) {
      return CatchErrors([&]() -> absl::Status {
        auto counting = std::make_shared<comm::testing::CountingCommunicator>(inner);
        Worker m(Opt::kAdam);
        constexpr int64_t kH = 4;
        SlowMo slowmo(m.params(), counting,
                      SlowMoOptions().frequency(kH).slowmo_momentum(beta).base_lr(kLr));
        for (int step = 0; step < 12; ++step) {
          Backward(m, rank, step);
          m.opt->step();
          const bool averaged = slowmo.step_completed();
          const int64_t rounds = (step + 1) / kH;
          if (averaged != ((step + 1) % kH == 0)) return absl::InternalError("averaged flag");
          const auto ar = counting->count(OpType::kAllReduce);
          // one all-reduce per dtype bucket (2 here), the parameter bytes in all
          if (ar.ops != 2 * rounds || ar.bytes != kParamBytes * rounds) {
            return absl::InternalError(absl::StrCat("step ", step, ": ", ar.ops, " all-reduces, ",
                                                    ar.bytes, " bytes"));
          }
          for (OpType t : {OpType::kReduceScatter, OpType::kAllGather, OpType::kBroadcast,
                           OpType::kReduce, OpType::kAllToAll, OpType::kSend, OpType::kRecv,
                           OpType::kBarrier}) {
            if (counting->count(t).ops != 0) return absl::InternalError("unexpected op");
          }
        }
        return absl::OkStatus();
      });
    }), absl::StrCat("bytes beta ", beta));
  }
}

TEST(SlowMoTest, StateDictRoundTripResumesTheSameTrajectory) {
  const Config c{2, Opt::kSgd, 3, 0.7, 0.3};
  const auto want = Simulate(c);
  ExpectAllOk(RunInprocRanks(2, [&](int rank, int, std::shared_ptr<Communicator> comm) {
    return CatchErrors([&]() -> absl::Status {
      Worker m(c.opt);
      const auto opts =
          SlowMoOptions().frequency(c.h).slowmo_lr(c.alpha).slowmo_momentum(c.beta).base_lr(kLr);
      auto slowmo = std::make_unique<SlowMo>(m.params(), comm, opts);
      for (int step = 0; step < 4; ++step) {
        Backward(m, rank, step);
        m.opt->step();
        slowmo->step_completed();
      }
      SlowMoState state = slowmo->state_dict();
      if (state.steps != 4 || state.prev_params.size() != 2) return absl::InternalError("state");
      // A fresh SlowMo (its x_prev taken from the current, unaveraged parameters) resumes exactly
      // once the state is loaded.
      slowmo = std::make_unique<SlowMo>(m.params(), comm, opts);
      slowmo->load_state_dict(state);
      for (int step = 4; step < kSteps; ++step) {
        Backward(m, rank, step);
        m.opt->step();
        slowmo->step_completed();
      }
      return Close(m.params(), want[rank], 1e-6, "resume");
    });
  }), "resume");
}

TEST(SlowMoTest, BadOptionsRaise) {
  ExpectAllOk(RunInprocRanks(1, [](int, int, std::shared_ptr<Communicator> comm) {
    at::Tensor p = at::zeros({3});
    EXPECT_THAT(ErrorOf([&] { SlowMo(std::vector<at::Tensor>{p}, comm,
                                     SlowMoOptions().frequency(0)); }),
                HasSubstr("INVALID_ARGUMENT: frequency must be >= 1, got 0"));
    EXPECT_THAT(ErrorOf([&] { SlowMo({p}, comm, SlowMoOptions().base_lr(0)); }),
                HasSubstr("base_lr must be > 0"));
    EXPECT_THAT(ErrorOf([&] { SlowMo({p}, comm, SlowMoOptions().base_lr(-1)); }),
                HasSubstr("base_lr must be > 0"));
    EXPECT_THAT(ErrorOf([&] { SlowMo({p}, comm, SlowMoOptions().slowmo_lr(0)); }),
                HasSubstr("slowmo_lr must be > 0"));
    EXPECT_THAT(ErrorOf([&] { SlowMo({p}, comm, SlowMoOptions().slowmo_momentum(1)); }),
                HasSubstr("slowmo_momentum must be in [0, 1), got 1"));
    EXPECT_THAT(ErrorOf([&] { SlowMo({p}, comm, SlowMoOptions().slowmo_momentum(-0.1)); }),
                HasSubstr("slowmo::SlowMo::SlowMo rank 0/1"));
    EXPECT_THAT(ErrorOf([&] { SlowMo({at::zeros({2}, at::kLong)}, comm); }),
                HasSubstr("parameter 0 must be a defined floating-point tensor"));
    SlowMo ok({p}, comm, SlowMoOptions().slowmo_momentum(0.5));
    EXPECT_THAT(ErrorOf([&] { ok.set_base_lr(0); }), HasSubstr("set_base_lr"));
    EXPECT_THAT(ErrorOf([&] { ok.load_state_dict(SlowMoState{}); }),
                HasSubstr("expected 1 buckets"));
    return absl::OkStatus();
  }), "errors");
}

}  // namespace
}  // namespace fairscale::slowmo
