// Test support for the //adascale tests (testonly): the linear model y = x W^T + b whose data
// comes from private generators (inproc thread ranks share torch's global RNG), its optimizers,
// and the single-process simulation of N workers that every AdaScale test compares against
// (the formulas written out over per-worker autograd gradients).
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "adascale/adascale.h"

namespace fairscale::adascale::testing {

enum class Kind { kSgd, kAdam };
const char* KindName(Kind kind);  // "SGD", "Adam"

at::Tensor Randn(std::vector<int64_t> shape, uint64_t seed);

// The initial parameters: W [3, 4], b [3].
at::Tensor InitialW();
at::Tensor InitialB();

// Worker `worker`'s micro-batch `micro` of step `step`: x [5, 4], y [5, 3].
struct Batch {
  at::Tensor x, y;
};
Batch Data(int step, int worker, int micro);
// The micro-batch's own loss: mse(x W^T + b, y).
at::Tensor Loss(const at::Tensor& w, const at::Tensor& b, const Batch& batch);

// The model as plain leaf tensors.
struct Model {
  at::Tensor w, b;
  Model();
  at::Tensor loss(int step, int worker, int micro) const {
    return Loss(w, b, Data(step, worker, micro));
  }
};

// The same model as a torch::nn::Module (parameters "w" and "b"), for the wrappers
// (oss::ShardedDataParallel) that take one.
class PlainLinearImpl : public torch::nn::Module {
 public:
  PlainLinearImpl();
  at::Tensor forward(at::Tensor x);
  at::Tensor w, b;
};
TORCH_MODULE(PlainLinear);

// Param groups over `groups` (group i: lr kLr[i] of `kind`; SGD with momentum 0.9: 0.05, 0.1;
// Adam: 0.01, 0.02), and the optimizer over them (also an oss::OSS factory).
std::vector<torch::optim::OptimizerParamGroup> MakeGroups(
    Kind kind, const std::vector<std::vector<at::Tensor>>& groups);
std::unique_ptr<torch::optim::Optimizer> MakeInner(
    Kind kind, std::vector<torch::optim::OptimizerParamGroup> groups);
// {W} and {b}, or with one_group {W, b}.
std::unique_ptr<torch::optim::Optimizer> MakeOptimizer(Kind kind, Model& m, bool one_group = false);

struct StepRecord {
  at::Tensor w, b;
  std::vector<double> gains;  // per group
  double gain = 0, progress = 0;
};

// `steps` steps of `workers` workers with `accum` micro-batches each, default scale, over the
// groups of MakeOptimizer(kind, m, one_group).
std::vector<StepRecord> Simulate(Kind kind, int workers, int accum, double smoothing, int steps,
                                 bool debias = true, bool one_group = false);

// OK if the parameters, every group's gain, the overall gain and the progress are within `tol`
// of `want`; raises *max_err to the largest error seen.
absl::Status CompareStep(const std::string& what, const at::Tensor& w, const at::Tensor& b,
                         const AdaScale& ada, const StepRecord& want, double tol,
                         double* max_err);

}  // namespace fairscale::adascale::testing
