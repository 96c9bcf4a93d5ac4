// Test support for the //fsdp tests (testonly): a small deterministic model that can be built
// plain (the single-process reference) or with its blocks wrapped in nested FSDP units, global
// batches, the reference training trajectory, and tensor comparisons that return a Status (rank
// bodies report through their Status, see comm/testing/rank_runner.h).
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/optimizer.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
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

// fc_out(block1(block0(tanh(fc_in(x))))), 5 -> 3 features, 350 parameters. With `nested_comm`,
// block0 and block1 are each wrapped in their own FullyShardedDataParallel (same names).
class NetImpl : public torch::nn::Module {
 public:
  explicit NetImpl(std::shared_ptr<comm::Communicator> nested_comm = nullptr,
                   FsdpOptions nested_options = {});
  torch::Tensor forward(torch::Tensor x);

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
  at::Tensor output;                           // of the whole global batch
  std::map<std::string, at::Tensor> grads;     // after backward
  std::map<std::string, at::Tensor> params;    // after the optimizer step
};
// Trains a plain Net on the global batches for `steps` steps.
std::vector<ReferenceStep> RunReference(OptimizerKind kind, int steps);

// This rank's shard of the flat parameter `info` describes, assembled from named tensors (zero
// padding included).
at::Tensor ShardOf(const FlatParamInfo& info, const std::map<std::string, at::Tensor>& named);

// OK if ||actual - expected|| <= rtol * ||expected|| (both ~0 counts as equal).
absl::Status ExpectClose(const std::string& what, const at::Tensor& actual,
                         const at::Tensor& expected, double rtol);

}  // namespace fairscale::fsdp::testing
