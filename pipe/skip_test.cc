// Skip connections (skip.h) in and out of a Pipe: parity with the un-pipelined model (the
// Sequential's own forward on the thread's default tracker) for 1-4 ranks x GPipe / 1F1B /
// interleaved (2 virtual stages) x the three checkpoint modes x odd micro-batches, on a model
// with overlapping skips, a skip inside one stage, a name reused in another namespace and a
// parameter whose only path to the loss is a skip; the routes (what each stage receives and
// passes on); CreateForStage (declarations exchanged between ranks); eval_step; deterministic
// mode; wrap_stage and FSDP inside the stages (fsdp_stage); and every static
// (verify_skippables) and runtime error, with its message, on every rank.
#include <ATen/Parallel.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/scalar_tensor.h>
#include <ATen/ops/tanh.h>
#include <c10/util/Exception.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>
#include <torch/optim/sgd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "fsdp/fsdp_options.h"
#include "pipe/fsdp_stage.h"
#include "pipe/grid.h"
#include "pipe/internal/skip_layout.h"
#include "pipe/pipe.h"
#include "pipe/skip.h"
#include "pipe/test_util.h"
#include "testing/c10_error.h"

namespace fairscale::pipe {
namespace {

using base::testing::IsOk;
using ::testing::AllOf;
using ::testing::HasSubstr;
using fairscale::testing::ErrorOf;

// How a SkipLinear breaks the rules at run time (static declarations stay valid).
enum class Misbehave { kNone, kStashUndeclared, kPopUndeclared, kNoStash, kNoPop };

// y = linear(x). Returns y (or x itself when `side`: then the layer's parameters reach the loss
// only through what it stashes), plus every popped tensor; stashes tanh(y) * (k + 1) as its
// k-th declared name.
class SkipLinearImpl : public torch::nn::Module, public Skippable {
 public:
  SkipLinearImpl(int64_t in, int64_t out, std::vector<std::string> stash_names,
                 std::vector<std::string> pop_names, bool side = false,
                 Misbehave misbehave = Misbehave::kNone)
      : Skippable(SkippableOptions().stash(stash_names).pop(pop_names)),
        stash_names_(std::move(stash_names)),
        pop_names_(std::move(pop_names)),
        side_(side),
        misbehave_(misbehave) {
    linear = register_module("linear", torch::nn::Linear(in, out));
  }

  at::Tensor forward(at::Tensor x) {
    const at::Tensor y = linear(x);
    at::Tensor out = side_ ? x : y;
    if (misbehave_ == Misbehave::kPopUndeclared) out = out + pop("undeclared");
    if (misbehave_ != Misbehave::kNoPop) {
      for (const std::string& name : pop_names_) out = out + pop(name);
    }
    if (misbehave_ == Misbehave::kStashUndeclared) stash("undeclared", y);
    if (misbehave_ != Misbehave::kNoStash) {
      for (size_t k = 0; k < stash_names_.size(); ++k) {
        stash(stash_names_[k], at::tanh(y) * static_cast<double>(k + 1));
      }
    }
    return out;
  }

  torch::nn::Linear linear{nullptr};

 private:
  std::vector<std::string> stash_names_;
  std::vector<std::string> pop_names_;
  bool side_;
  Misbehave misbehave_;
};
TORCH_MODULE(SkipLinear);

// (ModuleHolder's forwarding constructor cannot take braced lists.)
SkipLinear Skip(int64_t in, int64_t out, std::vector<std::string> stash_names,
                std::vector<std::string> pop_names, bool side = false,
                Misbehave misbehave = Misbehave::kNone) {
  return SkipLinear(in, out, std::move(stash_names), std::move(pop_names), side, misbehave);
}

// 12 layers; skips (stash layer -> pop layer): 'a' 0 -> 3, 'b' 2 -> 7 (layer 2's only path to
// the loss), 'c' 4 -> 5 (one stage at every balance used here), and 'a' again in namespace
// "second" 7 -> 10. `misbehave` applies to layer `bad_layer`.
torch::nn::Sequential MakeSkipModel(Misbehave misbehave = Misbehave::kNone, int bad_layer = -1) {
  auto m = [&](int layer) { return layer == bad_layer ? misbehave : Misbehave::kNone; };
  const Namespace second("second");
  SkipLinear l7 = Skip(6, 6, {"a"}, {"b"}, false, m(7));
  l7->isolate(second, {"a"});
  SkipLinear l10 = Skip(6, 6, {}, {"a"}, false, m(10));
  l10->isolate(second);
  torch::nn::Sequential model(
      Skip(4, 6, {"a"}, {}, false, m(0)), torch::nn::Tanh(),
      Skip(6, 6, {"b"}, {}, /*side=*/true, m(2)), Skip(6, 6, {}, {"a"}, false, m(3)),
      Skip(6, 6, {"c"}, {}, false, m(4)), Skip(6, 6, {}, {"c"}, false, m(5)),
      torch::nn::Tanh(), l7, torch::nn::Tanh(), torch::nn::Linear(6, 6), l10,
      torch::nn::Linear(6, 3));
  testing::InitDeterministic(*model);
  return model;
}

// The largest relative errors seen by the parity runs, printed by the last test.
struct Measured {
  std::mutex mu;
  double loss = 0;
  double grad = 0;
  int runs = 0;
};
Measured& measured() {
  static Measured* m = new Measured();
  return *m;
}

double RelativeError(const at::Tensor& actual, const at::Tensor& expected) {
  const double norm = expected.norm().item<double>();
  const double diff = (actual - expected).norm().item<double>();
  return norm > 1e-12 ? diff / norm : diff;
}

// Every rank builds MakeSkipModel() into a Pipe and trains on inputs[s] / targets[s]; each
// step's loss and then every stage gradient within 1e-5 (relative) of `ref`.
std::vector<absl::Status> RunSkipParity(int ranks, const PipeOptions& options,
                                        const std::vector<at::Tensor>& inputs,
                                        const std::vector<at::Tensor>& targets,
                                        const testing::Reference& ref, const std::string& what) {
  return testing::RunInproc(
      ranks, [&](int rank, std::shared_ptr<comm::Communicator> comm) -> absl::Status {
        std::unique_ptr<Pipe> pipe = Pipe::Create(MakeSkipModel(), comm, options);
        double loss_err = 0, grad_err = 0;
        for (size_t step = 0; step < inputs.size(); ++step) {
          const at::Tensor x = rank == 0 ? inputs[step] : at::Tensor();
          const at::Tensor y = rank == ranks - 1 ? targets[step] : at::Tensor();
          const double loss = pipe->train_step(x, y, testing::Mse).item<double>();
          const double expected = ref.losses[step];
          const double err = std::abs(loss - expected) / std::max(1e-12, std::abs(expected));
          loss_err = std::max(loss_err, err);
          if (err > 1e-5) {
            return absl::InternalError(absl::StrCat(what, " rank ", rank, " step ", step,
                                                    ": loss ", loss, " != ", expected));
          }
        }
        for (const auto& item : pipe->stage_module()->named_parameters()) {
          auto it = ref.grads.find(item.key());
          if (it == ref.grads.end()) return absl::InternalError("no reference for " + item.key());
          if (!item.value().grad().defined()) {
            return absl::InternalError(absl::StrCat(what, " rank ", rank, ": no gradient for ",
                                                    item.key()));
          }
          grad_err = std::max(grad_err, RelativeError(item.value().grad(), it->second));
        }
        {
          std::lock_guard<std::mutex> lock(measured().mu);
          measured().loss = std::max(measured().loss, loss_err);
          measured().grad = std::max(measured().grad, grad_err);
          ++measured().runs;
        }
        return testing::CheckStageGrads(*pipe, ref.grads, 1e-5, absl::StrCat(what, " rank ", rank));
      });
}

// Two steps: 10 rows (odd micro-batches with chunks 3), then 20 (a layout change, and the
// gradients accumulate).
const std::vector<at::Tensor>& Inputs() {
  static const auto* v = new std::vector<at::Tensor>{testing::Inputs(10, 1), testing::Inputs(20, 2)};
  return *v;
}
const std::vector<at::Tensor>& Targets() {
  static const auto* v =
      new std::vector<at::Tensor>{testing::Targets(10, 3), testing::Targets(20, 4)};
  return *v;
}

testing::Reference Reference(int64_t chunks) {
  testing::Reference ref = testing::RunReference([] { return MakeSkipModel(); }, Inputs(),
                                                 Targets(), chunks, testing::Mse);
  // The un-pipelined forwards popped everything they stashed.
  EXPECT_EQ(current_skip_tracker().size(), 0u);
  return ref;
}

// Trains `pipe` on Inputs() / Targets() (every rank passes both) and checks each step's loss
// and then the stage's gradients against `ref` (within 1e-5).
absl::Status TrainAndCheck(Pipe& pipe, const testing::Reference& ref, int rank) {
  for (size_t step = 0; step < Inputs().size(); ++step) {
    at::Tensor loss = pipe.train_step(Inputs()[step], Targets()[step], testing::Mse);
    absl::Status s = testing::ExpectClose(
        "loss", loss, at::scalar_tensor(ref.losses[step], at::kDouble), 1e-5);
    if (!s.ok()) return s;
  }
  return testing::CheckStageGrads(pipe, ref.grads, 1e-5, absl::StrCat("rank ", rank));
}

class SkipParityTest
    : public ::testing::TestWithParam<std::tuple<int, Schedule, CheckpointMode>> {};

TEST_P(SkipParityTest, LossAndGradientsMatchOneProcess) {
  const auto [ranks, schedule, mode] = GetParam();
  for (int64_t chunks : {1, 3}) {
    const testing::Reference ref = Reference(chunks);
    const std::string what = absl::StrCat(ranks, " ranks, ", ScheduleName(schedule), ", ",
                                          CheckpointModeName(mode), ", chunks ", chunks);
    std::vector<absl::Status> statuses = RunSkipParity(
        ranks, PipeOptions().chunks(chunks).schedule(schedule).checkpoint(mode), Inputs(),
        Targets(), ref, what);
    for (int r = 0; r < ranks; ++r) EXPECT_THAT(statuses[r], IsOk()) << what << " rank " << r;
  }
}

INSTANTIATE_TEST_SUITE_P(
    All, SkipParityTest,
    ::testing::Combine(::testing::Values(1, 2, 3, 4),
                       ::testing::Values(Schedule::kGPipe, Schedule::k1F1B),
                       ::testing::Values(CheckpointMode::kAlways, CheckpointMode::kExceptLast,
                                         CheckpointMode::kNever)),
    [](const ::testing::TestParamInfo<SkipParityTest::ParamType>& info) {
      return absl::StrCat(std::get<0>(info.param), "ranks_", ScheduleName(std::get<1>(info.param)),
                          "_", CheckpointModeName(std::get<2>(info.param)));
    });

class SkipInterleaveTest : public ::testing::TestWithParam<std::tuple<int, CheckpointMode>> {};

// 2 virtual stages per rank: a skip from virtual stage c to d goes around the ring c -> d (one
// rank hands its chunks over in memory).
TEST_P(SkipInterleaveTest, LossAndGradientsMatchOneProcess) {
  const auto [ranks, mode] = GetParam();
  for (int64_t chunks : {int64_t{ranks}, int64_t{2} * ranks}) {
    const testing::Reference ref = Reference(chunks);
    const std::string what = absl::StrCat(ranks, " ranks x 2 virtual stages, ",
                                          CheckpointModeName(mode), ", chunks ", chunks);
    std::vector<absl::Status> statuses = RunSkipParity(
        ranks,
        PipeOptions().chunks(chunks).schedule(Schedule::kInterleaved1F1B).virtual_stages(2).checkpoint(
            mode),
        Inputs(), Targets(), ref, what);
    for (int r = 0; r < ranks; ++r) EXPECT_THAT(statuses[r], IsOk()) << what << " rank " << r;
  }
}

INSTANTIATE_TEST_SUITE_P(
    All, SkipInterleaveTest,
    ::testing::Combine(::testing::Values(1, 2, 3, 4),
                       ::testing::Values(CheckpointMode::kAlways, CheckpointMode::kExceptLast,
                                         CheckpointMode::kNever)),
    [](const ::testing::TestParamInfo<SkipInterleaveTest::ParamType>& info) {
      return absl::StrCat(std::get<0>(info.param), "ranks_x2_",
                          CheckpointModeName(std::get<1>(info.param)));
    });

// What each of 4 stages (3 layers each) receives and sends: 'a' 0 -> 1, 'b' 0 -> 2 (passed
// through stage 1), 'c' inside stage 1, 'a' in "second" 2 -> 3. And layer 2, whose only path to
// the loss is 'b', gets the reference gradient (non-zero).
TEST(SkipTest, RoutesAndTheGradientThroughASkip) {
  const testing::Reference ref = Reference(2);
  ASSERT_GT(ref.grads.at("2.linear.weight").norm().item<double>(), 1e-3);
  const SkipId a{Namespace(), "a"}, b{Namespace(), "b"}, a2{Namespace("second"), "a"};
  const std::vector<std::vector<SkipId>> in = {{}, {a, b}, {b}, {a2}};
  const std::vector<std::vector<SkipId>> out = {{a, b}, {b}, {a2}, {}};
  std::vector<absl::Status> statuses = testing::RunInproc(
      4, [&](int rank, std::shared_ptr<comm::Communicator> comm) -> absl::Status {
        std::unique_ptr<Pipe> pipe =
            Pipe::Create(MakeSkipModel(), comm, PipeOptions().chunks(2).balance({3, 3, 3, 3}));
        auto stage = std::dynamic_pointer_cast<StageImpl>(pipe->module());
        if (!stage) return absl::InternalError("module() is not the Stage");
        if (!(stage->skips_in() == in[rank]) || !(stage->skips_out() == out[rank])) {
          return absl::InternalError(absl::StrCat("rank ", rank, ": unexpected skip routes"));
        }
        pipe->train_step(rank == 0 ? Inputs()[0] : at::Tensor(),
                         rank == 3 ? Targets()[0] : at::Tensor(), testing::Mse);
        if (rank == 0 && pipe->stage_module()->named_parameters()["2.linear.weight"].grad().norm()
                                 .item<double>() < 1e-3) {
          return absl::InternalError("layer 2 got no gradient through 'b'");
        }
        return absl::OkStatus();
      });
  // Gradients of one step (the reference accumulated two): compare against a one-step reference.
  const testing::Reference one = testing::RunReference(
      [] { return MakeSkipModel(); }, {Inputs()[0]}, {Targets()[0]}, 2, testing::Mse);
  std::vector<absl::Status> parity = RunSkipParity(4, PipeOptions().chunks(2).balance({3, 3, 3, 3}),
                                                   {Inputs()[0]}, {Targets()[0]}, one, "routes");
  for (int r = 0; r < 4; ++r) {
    EXPECT_THAT(statuses[r], IsOk()) << "rank " << r;
    EXPECT_THAT(parity[r], IsOk()) << "rank " << r;
  }
}

// CreateForStage: each rank holds only its layers, so the ranks exchange their declarations.
TEST(SkipTest, CreateForStageExchangesDeclarations) {
  const testing::Reference ref = Reference(3);
  std::vector<absl::Status> statuses = testing::RunInproc(
      2, [&](int rank, std::shared_ptr<comm::Communicator> comm) -> absl::Status {
        torch::nn::Sequential full = MakeSkipModel();
        torch::nn::Sequential mine;
        for (int64_t l = rank * 5; l < (rank == 0 ? 5 : 12); ++l) {
          mine->push_back(*(full->begin() + l));
        }
        std::unique_ptr<Pipe> pipe =
            Pipe::CreateForStage(mine, comm, PipeOptions().balance({5, 7}).chunks(3));
        return TrainAndCheck(*pipe, ref, rank);
      });
  for (int r = 0; r < 2; ++r) EXPECT_THAT(statuses[r], IsOk()) << "rank " << r;
}

// Ranks whose layers do not fit together (rank 1 lacks the pop of 'b'): every rank raises.
TEST(SkipTest, CreateForStageMismatchFailsOnEveryRank) {
  std::vector<absl::Status> statuses = testing::RunInproc(
      2, [&](int rank, std::shared_ptr<comm::Communicator> comm) -> absl::Status {
        torch::nn::Sequential full = MakeSkipModel();
        torch::nn::Sequential mine;
        for (int64_t l = rank * 5; l < (rank == 0 ? 5 : 12); ++l) {
          if (l == 7) {
            SkipLinear no_b = Skip(6, 6, {"a"}, {});
            no_b->isolate(Namespace("second"));
            mine->push_back(no_b);
          } else {
            mine->push_back(*(full->begin() + l));
          }
        }
        Pipe::CreateForStage(mine, comm, PipeOptions().balance({5, 7}).chunks(3));
        return absl::OkStatus();
      });
  for (int r = 0; r < 2; ++r) {
    EXPECT_THAT(std::string(statuses[r].message()),
                AllOf(HasSubstr(absl::StrCat("pipe::Pipe::CreateForStage (rank ", r,
                                             "/2): INVALID_ARGUMENT: one or more pairs of stash "
                                             "and pop do not match")),
                      HasSubstr("no layer declared 'b' as poppable but layer '2' stashes it")))
        << "rank " << r;
  }
}

TEST(SkipTest, EvalStepMatches) {
  const testing::Reference ref = Reference(3);
  std::vector<absl::Status> statuses = testing::RunInproc(
      3, [&](int rank, std::shared_ptr<comm::Communicator> comm) -> absl::Status {
        std::unique_ptr<Pipe> pipe = Pipe::Create(MakeSkipModel(), comm, PipeOptions().chunks(3));
        at::Tensor loss = pipe->eval_step(Inputs()[0], Targets()[0], testing::Mse);
        return testing::ExpectClose("eval loss", loss,
                                    at::scalar_tensor(ref.losses[0], at::kDouble), 1e-5);
      });
  for (int r = 0; r < 3; ++r) EXPECT_THAT(statuses[r], IsOk()) << "rank " << r;
}

// Deterministic mode (PipeOptions::deterministic) with skips: the loss and every gradient are
// bitwise the same at 1, 2, 3 stages and 2 ranks x 2 virtual stages.
TEST(SkipTest, DeterministicModeIsBitwiseAcrossStageCounts) {
  const int threads = at::get_num_threads();
  at::set_num_threads(1);
  struct Config {
    int ranks;
    PipeOptions options;
  };
  const PipeOptions base = PipeOptions().chunks(4).deterministic(true);
  const std::vector<Config> configs = {
      {1, base},
      {2, PipeOptions(base).schedule(Schedule::kGPipe)},
      {3, base},
      {2, PipeOptions(base).schedule(Schedule::kInterleaved1F1B).virtual_stages(2)},
  };
  const at::Tensor x = testing::Inputs(8, 5), y = testing::Targets(8, 6);
  std::map<std::string, at::Tensor> first;
  double first_loss = 0;
  for (size_t k = 0; k < configs.size(); ++k) {
    std::mutex mu;
    std::map<std::string, at::Tensor> grads;
    double loss = 0;
    std::vector<absl::Status> statuses = testing::RunInproc(
        configs[k].ranks, [&](int rank, std::shared_ptr<comm::Communicator> comm) -> absl::Status {
          std::unique_ptr<Pipe> pipe = Pipe::Create(MakeSkipModel(), comm, configs[k].options);
          const double l = pipe->train_step(x, y, testing::Mse).item<double>();
          std::lock_guard<std::mutex> lock(mu);
          loss = l;
          for (const auto& item : pipe->stage_module()->named_parameters()) {
            grads[item.key()] = item.value().grad().clone();
          }
          return absl::OkStatus();
        });
    for (int r = 0; r < configs[k].ranks; ++r) EXPECT_THAT(statuses[r], IsOk()) << k;
    if (k == 0) {
      first = grads;
      first_loss = loss;
      continue;
    }
    EXPECT_EQ(loss, first_loss) << "config " << k;
    ASSERT_EQ(grads.size(), first.size()) << "config " << k;
    for (const auto& [name, g] : grads) {
      EXPECT_TRUE(at::equal(g, first.at(name))) << "config " << k << " " << name;
    }
  }
  at::set_num_threads(threads);
}

// A wrap_stage hook (here one that only forwards to the Stage, as fsdp_stage wraps it in FSDP)
// gets the skip tensors as ordinary inputs and outputs of the stage.
TEST(SkipTest, WrapStageCarriesSkips) {
  const testing::Reference ref = Reference(3);
  std::vector<absl::Status> statuses = testing::RunInproc(
      3, [&](int rank, std::shared_ptr<comm::Communicator> comm) -> absl::Status {
        int64_t wrapped_skips = -1;
        auto wrap = [&](Stage stage) {
          wrapped_skips = static_cast<int64_t>(stage->skips_in().size());
          return WrappedStage{stage.ptr(), [stage](std::vector<at::Tensor> xs, bool list) mutable {
                                return stage->forward(std::move(xs), list);
                              }};
        };
        std::unique_ptr<Pipe> pipe =
            Pipe::Create(MakeSkipModel(), comm, PipeOptions().chunks(3).wrap_stage(wrap));
        if (rank == 1 && wrapped_skips < 1) return absl::InternalError("no skips into stage 1");
        return TrainAndCheck(*pipe, ref, rank);
      });
  for (int r = 0; r < 3; ++r) EXPECT_THAT(statuses[r], IsOk()) << "rank " << r;
}

// FSDP inside the stages (fsdp_stage, over a group of one per stage): 3 SGD steps at 2 stages
// (layer 2's parameters, reached only through skip 'b', on stage 0) give the reference's losses.
TEST(SkipTest, FsdpStageCarriesSkips) {
  constexpr int kSteps = 3;
  constexpr double kLr = 0.2;
  constexpr int64_t kChunks = 3;
  std::vector<double> expected;
  {
    torch::nn::Sequential model = MakeSkipModel();
    torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(kLr));
    const int64_t n = Inputs()[0].size(0);
    for (int step = 0; step < kSteps; ++step) {
      opt.zero_grad();
      double total = 0;
      for (int64_t i = 0; i < kChunks; ++i) {
        const int64_t offset = i * (n / kChunks) + std::min(i, n % kChunks);
        const int64_t size = n / kChunks + (i < n % kChunks ? 1 : 0);
        at::Tensor loss = testing::Mse(model->forward(Inputs()[0].narrow(0, offset, size)),
                                       Targets()[0].narrow(0, offset, size));
        total += loss.item<double>();
        (loss / static_cast<double>(kChunks)).backward();
      }
      expected.push_back(total / kChunks);
      opt.step();
    }
  }
  ASSERT_GT(std::abs(expected[2] - expected[0]), 1e-3);  // the steps change the loss
  for (CheckpointMode mode :
       {CheckpointMode::kNever, CheckpointMode::kAlways, CheckpointMode::kExceptLast}) {
    std::vector<absl::Status> statuses = testing::RunInproc(
        2, [&](int rank, std::shared_ptr<comm::Communicator> comm) -> absl::Status {
          PipeGrid grid = MakePipeGrid(comm, 2);
          std::unique_ptr<Pipe> pipe = Pipe::Create(
              MakeSkipModel(), grid.pipe,
              PipeOptions().chunks(kChunks).balance({3, 9}).checkpoint(mode).wrap_stage(
                  fsdp_stage(grid.data, fsdp::FsdpOptions().sharding_strategy(
                                            fsdp::ShardingStrategy::kFullShard))));
          torch::optim::SGD opt(pipe->parameters(), torch::optim::SGDOptions(kLr));
          for (int step = 0; step < kSteps; ++step) {
            opt.zero_grad();
            at::Tensor loss = pipe->train_step(Inputs()[0], Targets()[0], testing::Mse);
            opt.step();
            absl::Status s = testing::ExpectClose(
                absl::StrCat(CheckpointModeName(mode), " step ", step, " loss"), loss,
                at::scalar_tensor(expected[step], at::kDouble), 1e-5);
            if (!s.ok()) return s;
          }
          return absl::OkStatus();
        });
    for (int r = 0; r < 2; ++r) EXPECT_THAT(statuses[r], IsOk()) << "rank " << r;
  }
}

// The declarations' encoding (what the ranks all-gather) round-trips; garbage is kDataLoss.
TEST(SkipTest, DeclarationEncoding) {
  const std::vector<internal::LayerSkips> layers =
      internal::DeclarationsOf(MakeSkipModel(), 3);
  ASSERT_EQ(layers.size(), 7u);
  absl::StatusOr<std::vector<internal::LayerSkips>> back =
      internal::DecodeDeclarations(internal::EncodeDeclarations(layers));
  ASSERT_THAT(back.status(), IsOk());
  ASSERT_EQ(back->size(), layers.size());
  for (size_t k = 0; k < layers.size(); ++k) {
    EXPECT_EQ((*back)[k].virtual_stage, 3);
    EXPECT_EQ((*back)[k].position, layers[k].position);
    EXPECT_EQ((*back)[k].layer, layers[k].layer);
    EXPECT_TRUE((*back)[k].stash == layers[k].stash && (*back)[k].pop == layers[k].pop);
  }
  EXPECT_EQ(internal::DecodeDeclarations("1:0").status().code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(internal::DecodeDeclarations("9:x").status().code(), absl::StatusCode::kDataLoss);
  // Only canonical numbers decode (found writing //pipe/fuzz: absl::SimpleAtoi took a sign, spaces
  // and leading zeros, and the re-encoding differed), stages and positions are >= 0, and a count
  // is bounded by the bytes left before anything is kept for it.
  EXPECT_THAT(internal::DecodeDeclarations("1:01:01:x1:01:0").status(), IsOk());
  for (const std::string bad :
       {"+1:01:01:x1:01:0", " 1:01:01:x1:01:0", "01:01:01:x1:01:0", "1:+1:01:x1:01:0",
        "2:-11:01:x1:01:0", "2:001:01:x1:01:0", "99999999999999999999:x",
        "1:01:01:x19:46116860184273879041:x"}) {
    EXPECT_EQ(internal::DecodeDeclarations(bad).status().code(), absl::StatusCode::kDataLoss)
        << bad;
  }
  EXPECT_EQ(
      internal::DecodeDeclarations(std::string(internal::kMaxDeclarationBytes + 1, '0')).status().code(),
      absl::StatusCode::kDataLoss);
}

// verify_skippables and Pipe::Create (on every rank of 2) reject broken layouts with
// FairScale's messages, all problems in one error.
TEST(SkipTest, StaticErrors) {
  auto L = [](std::vector<std::string> s, std::vector<std::string> p) {
    return Skip(6, 6, std::move(s), std::move(p));
  };
  struct Case {
    std::function<torch::nn::Sequential()> make;
    std::vector<std::string> messages;
  };
  const std::vector<Case> cases = {
      {[&] { return torch::nn::Sequential(L({"x"}, {"x"}), L({}, {})); },
       {"layer '0' declared 'x' both as stashable and as poppable"}},
      {[&] { return torch::nn::Sequential(L({"x"}, {}), L({"x"}, {}), L({}, {"x"})); },
       {"layer '1' redeclared 'x' as stashable but not isolated by namespace (layer '0' stashes "
        "it)"}},
      {[&] { return torch::nn::Sequential(L({"x"}, {}), L({}, {"x"}), L({}, {"x"})); },
       {"layer '2' redeclared 'x' as poppable but not isolated by namespace"}},
      {[&] { return torch::nn::Sequential(L({}, {}), L({}, {"x"})); },
       {"layer '1' declared 'x' as poppable but it was not stashed"}},
      {[&] { return torch::nn::Sequential(L({}, {"x"}), L({}, {}), L({"x"}, {})); },
       {"layer '0' declared 'x' as poppable but it was not stashed before it (layer '2' stashes "
        "it later)",
        "no layer declared 'x' as poppable but layer '2' stashes it"}},
      {[&] { return torch::nn::Sequential(L({"x"}, {}), L({}, {})); },
       {"no layer declared 'x' as poppable but layer '0' stashes it"}},
      // Several problems at once, one in a namespace.
      {[&] {
         SkipLinear s = Skip(6, 6, {"y"}, {});
         s->isolate(Namespace("n"));
         return torch::nn::Sequential(L({"x"}, {}), s, L({"x"}, {}), L({}, {"z"}));
       },
       {"layer '2' redeclared 'x' as stashable", "layer '3' declared 'z' as poppable but it was "
        "not stashed", "no layer declared 'x' as poppable but layer '0' stashes it",
        "no layer declared 'y' (namespace 'n') as poppable but layer '1' stashes it"}},
  };
  for (const Case& c : cases) {
    try {
      verify_skippables(c.make());
      ADD_FAILURE() << "verify_skippables accepted " << c.messages[0];
    } catch (const c10::Error& e) {
      for (const std::string& m : c.messages) {
        EXPECT_THAT(e.what_without_backtrace(),
                    AllOf(HasSubstr("pipe::verify_skippables: INVALID_ARGUMENT: one or more pairs "
                                    "of stash and pop do not match: * "),
                          HasSubstr(m)));
      }
    }
    std::vector<absl::Status> statuses = testing::RunInproc(
        2, [&](int rank, std::shared_ptr<comm::Communicator> comm) -> absl::Status {
          Pipe::Create(c.make(), comm, PipeOptions().chunks(2));
          return absl::OkStatus();
        });
    for (int r = 0; r < 2; ++r) {
      for (const std::string& m : c.messages) {
        EXPECT_THAT(std::string(statuses[r].message()),
                    AllOf(HasSubstr(absl::StrCat("pipe::Pipe::Create (rank ", r,
                                                 "/2): INVALID_ARGUMENT: one or more pairs")),
                          HasSubstr(m)))
            << "rank " << r;
      }
    }
  }
  // Isolated by namespaces, the same names are fine.
  EXPECT_NO_THROW(verify_skippables(MakeSkipModel()));
  const Namespace n1("one"), n2("two");
  SkipLinear s1 = Skip(6, 6, {"x"}, {}), s2 = Skip(6, 6, {"x"}, {}), p2 = Skip(6, 6, {}, {"x"}),
             p1 = Skip(6, 6, {}, {"x"});
  s1->isolate(n1);
  s2->isolate(n2);
  p2->isolate(n2);
  p1->isolate(n1);
  EXPECT_NO_THROW(verify_skippables(torch::nn::Sequential(s1, s2, p2, p1)));
}

// A layer that breaks its declaration at run time, inside a pipe (layers 3-11 on rank 1): every
// rank raises, naming stage 1, the layer and the name.
TEST(SkipTest, RuntimeErrorsInAPipe) {
  struct Case {
    Misbehave misbehave;
    int layer;
    std::string message;
  };
  const std::vector<Case> cases = {
      {Misbehave::kStashUndeclared, 4, "layer '4': 'undeclared' has not been declared as stashable"},
      {Misbehave::kPopUndeclared, 5, "layer '5': 'undeclared' has not been declared as poppable"},
      {Misbehave::kNoStash, 4, "layer '4': 'c' must be stashed but have not"},
      {Misbehave::kNoPop, 5, "layer '5': 'c' must be popped but have not"},
      {Misbehave::kNoPop, 7, "layer '7': 'b' must be popped but have not"},
  };
  for (const Case& c : cases) {
    for (CheckpointMode mode : {CheckpointMode::kNever, CheckpointMode::kAlways}) {
      std::vector<absl::Status> statuses = testing::RunInproc(
          2, [&](int rank, std::shared_ptr<comm::Communicator> comm) -> absl::Status {
            std::unique_ptr<Pipe> pipe =
                Pipe::Create(MakeSkipModel(c.misbehave, c.layer), comm,
                             PipeOptions().chunks(2).balance({3, 9}).checkpoint(mode));
            pipe->train_step(Inputs()[0], Targets()[0], testing::Mse);
            return absl::OkStatus();
          });
      for (int r = 0; r < 2; ++r) {
        EXPECT_THAT(std::string(statuses[r].message()),
                    AllOf(HasSubstr("pipe::Pipe::train_step: "),
                          HasSubstr("pipe stage 1/2 (rank 1): forward of micro-batch 0: "),
                          HasSubstr(c.message)))
            << c.message << " rank " << r;
      }
    }
  }
}

// Without a pipe (the thread's default tracker, or a SkipTrackerScope's).
TEST(SkipTest, WithoutAPipe) {
  SkipTrackerScope scope;
  SkipLinear popper = Skip(6, 6, {}, {"x"});
  const at::Tensor x = testing::Inputs(2, 1).repeat({1, 2}).narrow(1, 0, 6);
  EXPECT_THAT(ErrorOf([&] { popper(x); }), HasSubstr("'x' has not been stashed"));
  SkipLinear bad_stash = Skip(6, 6, {"x"}, {}, false, Misbehave::kStashUndeclared);
  EXPECT_THAT(ErrorOf([&] { bad_stash(x); }),
              HasSubstr("'undeclared' has not been declared as stashable"));
  SkipLinear bad_pop = Skip(6, 6, {}, {}, false, Misbehave::kPopUndeclared);
  EXPECT_THAT(ErrorOf([&] { bad_pop(x); }),
              HasSubstr("'undeclared' has not been declared as poppable"));
  // A stash waits in the current tracker until popped; an inner scope does not see it.
  SkipLinear stasher = Skip(6, 6, {"x"}, {});
  stasher(x);
  EXPECT_EQ(scope.tracker().size(), 1u);
  {
    SkipTrackerScope inner;
    EXPECT_THAT(ErrorOf([&] { popper(x); }), HasSubstr("'x' has not been stashed"));
  }
  EXPECT_TRUE(popper(x).defined());
  EXPECT_EQ(scope.tracker().size(), 0u);
  // Bad declarations.
  EXPECT_THAT(ErrorOf([&] { popper->isolate(Namespace("n"), {"y"}); }),
              HasSubstr("'y' is declared neither stashable nor poppable"));
  EXPECT_THAT(ErrorOf([] { Namespace(""); }), HasSubstr("the name must not be empty"));
  EXPECT_THAT(ErrorOf([] { Skip(6, 6, {""}, {}); }), HasSubstr("a stash name is empty"));
}

// Printed after every test: the largest relative errors of all parity runs.
class ReportMeasuredErrors : public ::testing::Environment {
 public:
  void TearDown() override {
    std::lock_guard<std::mutex> lock(measured().mu);
    std::printf("skip parity: %d rank runs, max relative loss error %.3g, max relative gradient "
                "error %.3g\n",
                measured().runs, measured().loss, measured().grad);
  }
};
::testing::Environment* const kReport =
    ::testing::AddGlobalTestEnvironment(new ReportMeasuredErrors);

}  // namespace
}  // namespace fairscale::pipe
