// Test support for the //fsdp tests (testonly): a small deterministic model that can be built
// plain (the single-process reference) or with its blocks wrapped in nested FSDP units, global
// batches, the reference training trajectory, and tensor comparisons that return a Status (rank
// bodies report through their Status, see comm/testing/rank_runner.h).
#pragma once

#include <ATen/ops/zeros_like.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/optimizer.h>

#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "comm/communicator.h"
#include "fsdp/fsdp_options.h"
#include "fsdp/fully_sharded_data_parallel.h"

namespace fairscale::fsdp::testing {

enum class OptimizerKind { kSgdMomentum, kAdam, kAdamW };
const char* OptimizerName(OptimizerKind kind);
std::unique_ptr<torch::optim::Optimizer> MakeOptimizer(OptimizerKind kind,
                                                       std::vector<at::Tensor> params);

// Sets every parameter of `m` to values derived from `prefix` + its name. The global RNG is no
// use here: ranks are threads of one process and would race on it.
void InitDeterministic(torch::nn::Module& m, const std::string& prefix);

// x + fc2(tanh(fc1(x)))
class BlockImpl : public torch::nn::Module {
 public:
  BlockImpl(int64_t dim, int64_t hidden);
  torch::Tensor forward(torch::Tensor x);
  torch::nn::Linear fc1{nullptr};
  torch::nn::Linear fc2{nullptr};
};
TORCH_MODULE(Block);

// Variations of Net for the edge-case tests.
struct NetConfig {
  std::set<std::string> frozen;  // full names of parameters that get requires_grad = false
  bool with_unused = false;      // adds "unused" (Linear 2 -> 2), which forward never calls
};

// fc_out(block1(block0(tanh(fc_in(x))))), 5 -> 3 features, 350 parameters. With `nested_comm`,
// block0 and block1 are each wrapped in their own FullyShardedDataParallel (same names).
class NetImpl : public torch::nn::Module {
 public:
  explicit NetImpl(std::shared_ptr<comm::Communicator> nested_comm = nullptr,
                   FsdpOptions nested_options = {}, NetConfig config = {});
  torch::Tensor forward(torch::Tensor x);

  int skip_block = -1;  // forward skips this block (unused parameters in an iteration)

 private:
  torch::nn::Linear fc_in_{nullptr};
  torch::nn::Linear fc_out_{nullptr};
  std::vector<std::function<torch::Tensor(torch::Tensor)>> blocks_;
};
TORCH_MODULE(Net);

inline constexpr int kBatchRows = 12;  // divisible by every world size 1..4
struct Batch {
  at::Tensor x;  // [12, 5]
  at::Tensor y;  // [12, 3]
};
Batch GlobalBatch(int step);
// Rows of `t` that rank `rank` of `world` trains on.
at::Tensor RankRows(const at::Tensor& t, int rank, int world);
at::Tensor Mse(const at::Tensor& output, const at::Tensor& target);

struct ReferenceStep {
  at::Tensor output;                         // of the whole global batch
  std::map<std::string, at::Tensor> grads;   // after backward
  std::map<std::string, at::Tensor> params;  // after the optimizer step
};
// Trains a plain Net on the global batches for `steps` steps.
std::vector<ReferenceStep> RunReference(OptimizerKind kind, int steps);

// This rank's shard of the flat parameter `info` describes, assembled from named tensors (zero
// padding included).
at::Tensor ShardOf(const FlatParamInfo& info, const std::map<std::string, at::Tensor>& named);

// Compares the shards (and, with `grads`, their gradients) of every unit of `model` with this
// rank's part of the named reference tensors. A missing gradient counts as zero.
absl::Status CheckShards(FullyShardedDataParallel& model,
                         const std::map<std::string, at::Tensor>& expected, bool grads,
                         const std::string& what, double rtol);

// forward<R>(args...) of a plain module holder or of a FullyShardedDataParallel (whose forward is
// a template).
template <typename R, typename M, typename... Args>
R Call(M& model, Args&&... args) {
  return model->forward(std::forward<Args>(args)...);
}
template <typename R, typename... Args>
R Call(FullyShardedDataParallel& model, Args&&... args) {
  return model->template forward<R>(std::forward<Args>(args)...);
}
template <typename M>
constexpr bool IsFsdp() {
  return std::is_same_v<std::decay_t<M>, FullyShardedDataParallel>;
}

// One training step's forward and backward on this rank's rows of GlobalBatch(step), MSE loss
// (model: a plain holder or an FSDP root).
struct MseStep {
  template <typename M>
  void operator()(M& model, int step, int rank, int world) const {
    Batch b = GlobalBatch(step);
    Mse(Call<at::Tensor>(model, RankRows(b.x, rank, world)), RankRows(b.y, rank, world))
        .backward();
  }
};

// MseStep on a testing::Net that skips block 1 on odd steps (its parameters get no gradient
// then: an unused unit).
struct MseStepSkippingBlockOnOddSteps {
  template <typename M>
  void operator()(M& model, int step, int rank, int world) const {
    NetImpl* net;
    if constexpr (IsFsdp<M>()) {
      net = dynamic_cast<NetImpl*>(model->module().get());
    } else {
      net = model.get();
    }
    net->skip_block = step % 2 == 1 ? 1 : -1;
    MseStep()(model, step, rank, world);
  }
};

// parameters() without repeats: a tensor registered twice (tied weights) is listed twice, and
// LibTorch's optimizers would step it twice.
std::vector<at::Tensor> DistinctParameters(torch::nn::Module& m);

// Generic parity harness. `make(nested_comm, options)` builds a model holder (plain when
// nested_comm is null); `step(model, step, rank, world)` runs forward and backward of one
// training step on this rank's data (model: the plain holder, or the FSDP root).
template <typename MakeFn, typename StepFn>
std::vector<ReferenceStep> RunReferenceWith(MakeFn make, StepFn step_fn, OptimizerKind kind,
                                            int steps) {
  auto net = make(nullptr, FsdpOptions());
  auto opt = MakeOptimizer(kind, DistinctParameters(*net));
  std::vector<ReferenceStep> out;
  for (int step = 0; step < steps; ++step) {
    opt->zero_grad();
    step_fn(net, step, 0, 1);
    ReferenceStep r;
    for (const auto& item : net->named_parameters()) {
      const at::Tensor& g = item.value().grad();
      r.grads[item.key()] = g.defined() ? g.clone() : at::zeros_like(item.value());
    }
    opt->step();
    for (const auto& item : net->named_parameters()) {
      r.params[item.key()] = item.value().detach().clone();
    }
    out.push_back(std::move(r));
  }
  return out;
}

template <typename MakeFn, typename StepFn>
absl::Status RunParityRank(MakeFn make, StepFn step_fn, OptimizerKind kind,
                           const std::vector<ReferenceStep>& ref, FsdpOptions options, bool nested,
                           int rank, int world, std::shared_ptr<comm::Communicator> comm,
                           double rtol = 1e-5) {
  FullyShardedDataParallel model(make(nested ? comm : nullptr, options), comm, options);
  auto opt = MakeOptimizer(kind, model->parameters());
  for (int step = 0; step < static_cast<int>(ref.size()); ++step) {
    const std::string at_step = "step " + std::to_string(step) + " rank " + std::to_string(rank) +
                                "/" + std::to_string(world);
    opt->zero_grad();
    step_fn(model, step, rank, world);
    absl::Status s = CheckShards(model, ref[step].grads, true, at_step + " grad", rtol);
    if (!s.ok()) return s;
    opt->step();
    s = CheckShards(model, ref[step].params, false, at_step + " param", rtol);
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

// Runs body(rank, world, comm) on `world` threads over fresh inproc communicators, then a
// barrier; exceptions become kInternal with their message.
std::vector<absl::Status> RunRanks(
    int world,
    std::function<absl::Status(int rank, int world, std::shared_ptr<comm::Communicator>)> body);

// OK if ||actual - expected|| <= rtol * ||expected|| (both ~0 counts as equal).
absl::Status ExpectClose(const std::string& what, const at::Tensor& actual,
                         const at::Tensor& expected, double rtol);

}  // namespace fairscale::fsdp::testing
