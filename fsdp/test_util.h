// Test support for the //fsdp tests (testonly): the shared test model (//testing:model) with its
// blocks wrapped in nested FSDP units, the single-process reference trajectory, the parity
// harness, and shard comparisons that return a Status (rank bodies report through their Status,
// see comm/testing/rank_runner.h; ranks run with comm/testing/inproc_ranks.h).
#pragma once

#include <ATen/ops/zeros_like.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "comm/communicator.h"
#include "fsdp/fsdp_options.h"
#include "fsdp/fully_sharded_data_parallel.h"
#include "testing/model.h"

namespace fairscale::fsdp::testing {

// The shared test model, data and optimizers (//testing:model), under the names these tests use.
using fairscale::testing::Batch;
using fairscale::testing::Block;
using fairscale::testing::BlockImpl;
using fairscale::testing::DistinctParameters;
using fairscale::testing::GlobalBatch;
using fairscale::testing::InitDeterministic;
using fairscale::testing::kBatchRows;
using fairscale::testing::MakeOptimizer;
using fairscale::testing::Mse;
using fairscale::testing::Net;
using fairscale::testing::NetConfig;
using fairscale::testing::NetImpl;
using fairscale::testing::OptimizerKind;
using fairscale::testing::OptimizerName;
using fairscale::testing::RankRows;

// The test Net with block0 and block1 each wrapped in its own FullyShardedDataParallel over
// `nested_comm` (same names and values as the plain Net); plain when nested_comm is null.
Net NestedNet(std::shared_ptr<comm::Communicator> nested_comm, FsdpOptions nested_options = {},
              NetConfig config = {});

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

// Trains `model` (FSDP over the test Net) with `opt` on this rank's rows of the global batches,
// one step per entry of `ref`, and checks every step's loss, gradient shards and parameter
// shards against the single-process reference (RunReference) within `rtol`.
absl::Status TrainMatchesReference(FullyShardedDataParallel& model, torch::optim::Optimizer& opt,
                                   const std::vector<ReferenceStep>& ref, int rank, int world,
                                   double rtol = 1e-5);

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

// The relative tolerances of RunParityRank: for the gradient shards and for the parameter shards
// after each step (one value converts to both). Under bf16 compute against the f32 reference
// they differ by an order of magnitude: the small per-rank gradients lose more to rounding than
// the f32 master parameters that Adam's normalized steps move.
struct ParityRtol {
  ParityRtol(double both = 1e-5) : grad(both), param(both) {}  // NOLINT(runtime/explicit)
  ParityRtol(double grad_rtol, double param_rtol) : grad(grad_rtol), param(param_rtol) {}
  double grad;
  double param;
};

template <typename MakeFn, typename StepFn>
absl::Status RunParityRank(MakeFn make, StepFn step_fn, OptimizerKind kind,
                           const std::vector<ReferenceStep>& ref, FsdpOptions options, bool nested,
                           int rank, int world, std::shared_ptr<comm::Communicator> comm,
                           ParityRtol rtol = {}) {
  FullyShardedDataParallel model(make(nested ? comm : nullptr, options), comm, options);
  auto opt = MakeOptimizer(kind, model->parameters());
  for (int step = 0; step < static_cast<int>(ref.size()); ++step) {
    const std::string at_step = "step " + std::to_string(step) + " rank " + std::to_string(rank) +
                                "/" + std::to_string(world);
    opt->zero_grad();
    step_fn(model, step, rank, world);
    absl::Status s = CheckShards(model, ref[step].grads, true, at_step + " grad", rtol.grad);
    if (!s.ok()) return s;
    opt->step();
    s = CheckShards(model, ref[step].params, false, at_step + " param", rtol.param);
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

// OK if ||actual - expected|| <= rtol * ||expected|| (both ~0 counts as equal).
absl::Status ExpectClose(const std::string& what, const at::Tensor& actual,
                         const at::Tensor& expected, double rtol);

}  // namespace fairscale::fsdp::testing
