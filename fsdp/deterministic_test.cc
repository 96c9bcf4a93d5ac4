// Deterministic mode (FsdpOptions::deterministic): the same global batch of 24 micro-batches
// gives bitwise the same losses and parameters at world sizes 1, 2, 3, 4 and 8, for every
// sharding strategy, both layouts, bf16 mixed precision (f32 reduction), clip_grad_norm_,
// gradient accumulation with no_sync, and a resume at another world size. The world-1 run is
// checked against an independent reference (the plain model trained on the whole batch, close
// within a tolerance); the default mode is shown to differ across world sizes (negative control).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/adam.h>

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "comm/communicator.h"
#include "comm/testing/inproc_ranks.h"
#include "comm/testing/rank_runner.h"
#include "deterministic/collectives.h"
#include "fsdp/fully_sharded_data_parallel.h"
#include "fsdp/internal/flat_param.h"
#include "fsdp/state_dict.h"
#include "testing/bitwise.h"
#include "testing/c10_error.h"

namespace fairscale::fsdp {
namespace {

using ::fairscale::comm::testing::ExpectAllOk;
using ::fairscale::comm::testing::RunInprocRanks;
using ::fairscale::testing::Bitwise;
using ::fairscale::testing::ExpectError;

constexpr int64_t kMicroBatches = 24;
constexpr int64_t kRows = 3;  // per micro-batch
constexpr int kSteps = 10;
constexpr int64_t kDims[] = {19, 67, 67, 7};  // odd sizes: shards end mid-vector

// Fixed values from a private generator (thread ranks share LibTorch's global one).
at::Tensor Fixed(std::vector<int64_t> shape, uint64_t seed, double scale) {
  at::Generator gen = at::detail::createCPUGenerator(seed);
  return at::randn(shape, gen, at::kFloat) * scale;
}

// Three Linear layers (each its own FSDP unit when wrapped) and a root-owned scale.
class MlpImpl : public torch::nn::Module {
 public:
  MlpImpl(std::shared_ptr<comm::Communicator> comm, const FsdpOptions& options) {
    for (int i = 0; i < 3; ++i) {
      torch::nn::Linear lin(kDims[i], kDims[i + 1]);
      {
        torch::NoGradGuard no_grad;
        lin->weight.copy_(Fixed({kDims[i + 1], kDims[i]}, 10 + i, 0.3));
        lin->bias.copy_(Fixed({kDims[i + 1]}, 20 + i, 0.1));
      }
      const std::string name = "l" + std::to_string(i);
      if (comm) {
        wrapped_.push_back(register_module(name, FullyShardedDataParallel(lin, comm, options)));
      } else {
        plain_.push_back(register_module(name, lin));
      }
    }
    scale_ = register_parameter("scale", Fixed({kDims[3]}, 30, 1.0));
  }
  at::Tensor forward(at::Tensor x) {
    for (int i = 0; i < 3; ++i) {
      x = plain_.empty() ? wrapped_[i]->forward<at::Tensor>(x) : plain_[i](x);
      if (i < 2) x = at::tanh(x);
    }
    return x * scale_;
  }

 private:
  std::vector<FullyShardedDataParallel> wrapped_;
  std::vector<torch::nn::Linear> plain_;
  at::Tensor scale_;
};
TORCH_MODULE(Mlp);

struct Batch {
  at::Tensor x, y;  // [kMicroBatches * kRows, ...]
};
Batch GlobalBatch(int step) {
  return {Fixed({kMicroBatches * kRows, kDims[0]}, 1000 + step, 1.0),
          Fixed({kMicroBatches * kRows, kDims[3]}, 2000 + step, 1.0)};
}
at::Tensor MicroBatch(const at::Tensor& t, int64_t j) { return t.narrow(0, j * kRows, kRows); }

struct Config {
  std::string name;
  ShardingStrategy strategy = ShardingStrategy::kFullShard;
  bool flat = true;
  bool bf16 = false;
  bool clip = false;
  bool no_sync = true;
  bool offload = false;  // move_params_to_cpu on the offloaded path (the CPU test hook)
};

FsdpOptions OptionsFor(const Config& c, int world, bool deterministic) {
  FsdpOptions o;
  o.sharding_strategy(c.strategy).flatten_parameters(c.flat);
  if (IsHybrid(c.strategy)) o.hybrid_shard_group_size(world % 2 == 0 ? 2 : 1);
  if (c.bf16) o.mixed_precision(MixedPrecision().param_dtype(at::kBFloat16).reduce_dtype(at::kFloat));
  if (deterministic) o.deterministic(true).micro_batches(kMicroBatches);
  if (c.offload) o.move_params_to_cpu(true);
  return o;
}

struct Trajectory {
  std::vector<double> losses;         // the step losses
  std::map<std::string, at::Tensor> params;  // the full parameters at the end
};

// Trains steps [from, to) of one rank; `deterministic` false is the default mode (each rank's
// loss divided by its micro-batch count, the mean over ranks by FSDP).
void TrainSteps(FullyShardedDataParallel& model, torch::optim::Optimizer& opt, const Config& c,
                bool deterministic, int from, int to, int rank, int world,
                comm::Communicator& comm, std::vector<double>* losses) {
  const auto layout = deterministic::MicroBatchLayout::Make(kMicroBatches, world, rank);
  const int64_t k = layout.per_rank();
  for (int step = from; step < to; ++step) {
    const Batch b = GlobalBatch(step);
    opt.zero_grad();
    std::vector<double> mine;
    for (int64_t i = 0; i < k; ++i) {
      const int64_t j = layout.first() + i;
      auto run = [&] {
        at::Tensor out = model->forward<at::Tensor>(MicroBatch(b.x, j));
        at::Tensor loss = (out.to(at::kFloat) - MicroBatch(b.y, j)).pow(2).mean();
        mine.push_back(loss.item<double>());
        (deterministic ? loss : loss / static_cast<double>(k)).backward();
      };
      if (c.no_sync && i + 1 < k) {
        auto guard = model->no_sync();
        run();
      } else {
        run();
      }
    }
    if (c.clip) model->clip_grad_norm_(0.5);
    opt.step();
    if (losses != nullptr) losses->push_back(deterministic::Mean(comm, layout, mine, "loss"));
  }
}

std::map<std::string, at::Tensor> FullParams(FullyShardedDataParallel& model) {
  std::map<std::string, at::Tensor> out;
  for (const auto& item : full_state_dict(model)) out[item.key()] = item.value();
  return out;
}

Trajectory TrainOnWorld(const Config& c, int world, bool deterministic) {
  // Read when a unit is constructed: the offloaded path's separate buffers and copies.
  internal::SetOffloadOnCpuForTesting(c.offload);
  struct Reset {
    ~Reset() { internal::SetOffloadOnCpuForTesting(false); }
  } reset;
  Trajectory result;
  std::mutex mu;
  ExpectAllOk(RunInprocRanks(world, [&](int rank, int w, std::shared_ptr<comm::Communicator> comm)
                                        -> absl::Status {
    const FsdpOptions o = OptionsFor(c, w, deterministic);
    FullyShardedDataParallel model(Mlp(comm, o), comm, o);
    torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(1e-2));
    std::vector<double> losses;
    TrainSteps(model, opt, c, deterministic, 0, kSteps, rank, w, *comm, &losses);
    auto params = FullParams(model);
    if (rank == 0) {
      std::lock_guard<std::mutex> lock(mu);
      result.losses = losses;
      result.params = params;
    }
    return absl::OkStatus();
  }, absl::Seconds(120)), absl::StrCat(c.name, " world ", world));
  return result;
}

// The plain (unwrapped) model on the whole global batch: the mean loss over the 24 micro-batches.
Trajectory Reference(const Config& c) {
  Mlp model(nullptr, FsdpOptions());
  torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(1e-2));
  Trajectory r;
  for (int step = 0; step < kSteps; ++step) {
    const Batch b = GlobalBatch(step);
    opt.zero_grad();
    at::Tensor loss = (model(b.x) - b.y).pow(2).mean();
    r.losses.push_back(loss.item<double>());
    loss.backward();
    if (c.clip) torch::nn::utils::clip_grad_norm_(model->parameters(), 0.5);
    opt.step();
  }
  for (const auto& item : model->named_parameters()) r.params[item.key()] = item.value().detach().clone();
  return r;
}

void ExpectSameBits(const Trajectory& a, const Trajectory& b, const std::string& what) {
  ASSERT_EQ(a.losses.size(), b.losses.size()) << what;
  for (size_t s = 0; s < a.losses.size(); ++s) {
    EXPECT_EQ(a.losses[s], b.losses[s]) << what << ": loss of step " << s;
  }
  ASSERT_EQ(a.params.size(), b.params.size()) << what;
  for (const auto& [name, t] : a.params) {
    ASSERT_TRUE(b.params.count(name)) << what << ": " << name;
    EXPECT_TRUE(Bitwise(t, b.params.at(name)))
        << what << ": parameter " << name << " differs; max |diff| "
        << (t - b.params.at(name)).abs().max().item<double>();
  }
}

class Deterministic : public ::testing::TestWithParam<Config> {
 protected:
  void SetUp() override { at::set_num_threads(1); }
};

TEST_P(Deterministic, BitwiseEqualAcrossWorldSizes) {
  const Config& c = GetParam();
  const Trajectory one = TrainOnWorld(c, 1, true);
  // World 1 against the plain model on the whole batch: right, within rounding.
  const Trajectory ref = Reference(c);
  const double tol = c.bf16 ? 3e-2 : 1e-4;
  for (size_t s = 0; s < ref.losses.size(); ++s) {
    EXPECT_NEAR(one.losses[s], ref.losses[s], tol * std::abs(ref.losses[s])) << "step " << s;
  }
  for (const auto& [name, t] : ref.params) {
    const at::Tensor got = one.params.at(name);
    EXPECT_LE((got - t).norm().item<double>(), tol * t.norm().item<double>()) << name;
  }
  for (int world : {2, 3, 4, 8}) {
    if (world == 8 && !(c.strategy == ShardingStrategy::kFullShard || IsHybrid(c.strategy))) continue;
    ExpectSameBits(one, TrainOnWorld(c, world, true), absl::StrCat(c.name, " world ", world));
  }
}

INSTANTIATE_TEST_SUITE_P(
    Strategies, Deterministic,
    ::testing::Values(
        Config{"full_shard", ShardingStrategy::kFullShard},
        Config{"full_shard_per_param", ShardingStrategy::kFullShard, false},
        Config{"shard_grad_op", ShardingStrategy::kShardGradOp},
        Config{"shard_grad_op_per_param_clip", ShardingStrategy::kShardGradOp, false, false, true},
        Config{"no_shard", ShardingStrategy::kNoShard},
        Config{"no_shard_per_param_clip", ShardingStrategy::kNoShard, false, false, true},
        Config{"hybrid_shard", ShardingStrategy::kHybridShard},
        Config{"hybrid_shard_per_param", ShardingStrategy::kHybridShard, false},
        Config{"hybrid_zero2_clip", ShardingStrategy::kHybridShardZero2, true, false, true},
        Config{"full_shard_bf16", ShardingStrategy::kFullShard, true, true},
        Config{"no_shard_bf16_clip", ShardingStrategy::kNoShard, true, true, true},
        Config{"full_shard_clip_without_no_sync", ShardingStrategy::kFullShard, true, false, true,
               false},
        Config{"shard_grad_op_bf16_offload", ShardingStrategy::kShardGradOp, true, true, false,
               true, true}),
    [](const auto& info) { return info.param.name; });

TEST(DeterministicControl, DefaultModeDiffersAcrossWorldSizes) {
  at::set_num_threads(1);
  // The same job in the default mode: right within rounding, but not bitwise reproducible.
  const Config c{"full_shard", ShardingStrategy::kFullShard};
  const Trajectory one = TrainOnWorld(c, 1, false);
  bool any_differs = false;
  for (int world : {3, 4}) {
    const Trajectory other = TrainOnWorld(c, world, false);
    for (const auto& [name, t] : one.params) {
      const at::Tensor o = other.params.at(name);
      EXPECT_LE((o - t).norm().item<double>(), 1e-4 * t.norm().item<double>()) << name;
      any_differs = any_differs || !Bitwise(o, t);
    }
  }
  EXPECT_TRUE(any_differs) << "the default mode happened to be bitwise equal: the deterministic "
                              "tests above could not fail on this data";
}

TEST(DeterministicResume, SavedAtFourRanksResumedAtTwoIsTheUninterruptedRun) {
  at::set_num_threads(1);
  for (const Config& c : {Config{"full_shard", ShardingStrategy::kFullShard},
                          Config{"hybrid_per_param", ShardingStrategy::kHybridShard, false}}) {
    const Trajectory uninterrupted = TrainOnWorld(c, 4, true);
    StateDict saved;
    FullOptimState saved_optim;
    std::mutex mu;
    ExpectAllOk(RunInprocRanks(4, [&](int rank, int w, std::shared_ptr<comm::Communicator> comm)
                                      -> absl::Status {
      const FsdpOptions o = OptionsFor(c, w, true);
      FullyShardedDataParallel model(Mlp(comm, o), comm, o);
      torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(1e-2));
      TrainSteps(model, opt, c, true, 0, kSteps / 2, rank, w, *comm, nullptr);
      StateDict s = full_state_dict(model);
      FullOptimState so = full_optim_state_dict(model, opt);
      if (rank == 0) {
        std::lock_guard<std::mutex> lock(mu);
        saved = s;
        saved_optim = so;
      }
      return absl::OkStatus();
    }));
    Trajectory resumed;
    ExpectAllOk(RunInprocRanks(2, [&](int rank, int w, std::shared_ptr<comm::Communicator> comm)
                                      -> absl::Status {
      const FsdpOptions o = OptionsFor(c, w, true);
      FullyShardedDataParallel model(Mlp(comm, o), comm, o);
      torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(1e-2));
      load_full_state_dict(model, saved);
      load_full_optim_state_dict(model, opt, saved_optim);
      std::vector<double> losses;
      TrainSteps(model, opt, c, true, kSteps / 2, kSteps, rank, w, *comm, &losses);
      auto params = FullParams(model);
      if (rank == 0) {
        std::lock_guard<std::mutex> lock(mu);
        resumed.losses = losses;
        resumed.params = params;
      }
      return absl::OkStatus();
    }));
    Trajectory tail = uninterrupted;
    tail.losses.erase(tail.losses.begin(), tail.losses.begin() + kSteps / 2);
    ExpectSameBits(tail, resumed, c.name + " resumed at 2 ranks");
  }
}

TEST(DeterministicBadInput, ClearErrorsBeforeWorkStarts) {
  at::set_num_threads(1);
  // A world size that does not divide the micro-batches.
  ExpectAllOk(RunInprocRanks(5, [&](int, int, std::shared_ptr<comm::Communicator> comm)
                                    -> absl::Status {
    const FsdpOptions o = FsdpOptions().deterministic(true).micro_batches(kMicroBatches);
    return ExpectError([&] { FullyShardedDataParallel m(torch::nn::Linear(3, 3), comm, o); },
                       {"24 micro-batches per step cannot be split evenly over 5 ranks",
                        "1, 2, 3, 4, 6, 8, 12, 24"});
  }));
  // Ranks mixing modes: every rank names the other's mode.
  ExpectAllOk(RunInprocRanks(2, [&](int rank, int, std::shared_ptr<comm::Communicator> comm)
                                    -> absl::Status {
    FsdpOptions o;
    if (rank == 1) o.deterministic(true).micro_batches(kMicroBatches);
    return ExpectError([&] { FullyShardedDataParallel m(torch::nn::Linear(3, 3), comm, o); },
                       {"ranks disagree on deterministic mode",
                        rank == 0 ? "rank 1 runs deterministic mode with 24 micro-batches"
                                  : "rank 0 runs the default (non-deterministic) mode"});
  }));
  // Options that cannot go together; threads not pinned.
  ExpectAllOk(RunInprocRanks(1, [&](int, int, std::shared_ptr<comm::Communicator> comm)
                                    -> absl::Status {
    absl::Status s = ExpectError(
        [&] { FullyShardedDataParallel m(torch::nn::Linear(3, 3), comm,
                                         FsdpOptions().deterministic(true)); },
        {"needs micro_batches(M)"});
    if (!s.ok()) return s;
    s = ExpectError([&] { FullyShardedDataParallel m(torch::nn::Linear(3, 3), comm,
                                                     FsdpOptions().micro_batches(4)); },
                    {"is for deterministic mode"});
    if (!s.ok()) return s;
    s = ExpectError(
        [&] {
          FullyShardedDataParallel m(
              torch::nn::Linear(3, 3), comm,
              FsdpOptions().deterministic(true).micro_batches(4).gradient_predivide_factor(2));
        },
        {"must be left unset"});
    if (!s.ok()) return s;
    at::set_num_threads(2);
    s = ExpectError([&] { FullyShardedDataParallel m(torch::nn::Linear(3, 3), comm,
                                                     FsdpOptions().deterministic(true).micro_batches(4)); },
                    {"at::set_num_threads(1)"});
    at::set_num_threads(1);
    return s;
  }));
  // no_sync() over the step's last micro-batch.
  ExpectAllOk(RunInprocRanks(2, [&](int, int, std::shared_ptr<comm::Communicator> comm)
                                    -> absl::Status {
    const FsdpOptions o =
        FsdpOptions().deterministic(true).micro_batches(2).sync_module_states(true);
    FullyShardedDataParallel m(torch::nn::Linear(3, 3), comm, o);
    auto guard = m->no_sync();
    return ExpectError([&] { m->forward<at::Tensor>(at::ones({2, 3})).sum().backward(); },
                       {"no_sync() covers it", "1 of 2 micro-batches over 2 ranks"});
  }));
}

}  // namespace
}  // namespace fairscale::fsdp
