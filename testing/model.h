// Test support shared by the feature packages' parity tests (testonly): a small deterministic
// model, the global batches it trains on, each rank's rows of them, the MSE loss and three
// optimizers. The fsdp, oss, amp and checkpoint tests train it once in a single process (the
// reference) and once through the feature under test, and compare. No FSDP, no communicator:
// a package wraps the blocks in what it tests through NetConfig::wrap_block (fsdp/test_util.h
// nests FSDP units that way).
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <set>
#include <string>
#include <vector>

namespace fairscale::testing {

enum class OptimizerKind { kSgdMomentum, kAdam, kAdamW };
const char* OptimizerName(OptimizerKind kind);
// SGD(0.1, momentum 0.9), Adam(0.01) or AdamW(0.01, weight decay 0.1).
std::unique_ptr<torch::optim::Optimizer> MakeOptimizer(OptimizerKind kind,
                                                       std::vector<at::Tensor> params);

// Sets every parameter of `m` to values derived from `prefix` + its name: element i of a
// parameter is amplitude * sin(0.731 i + 0.1 h), h a hash of the name in [0, 997). The global RNG
// is no use here: ranks are threads of one process and would race on it. (The Net uses 0.4; the
// pipe tests' models 0.5, the values they were written against.)
void InitDeterministic(torch::nn::Module& m, const std::string& prefix, double amplitude = 0.4);

// x + fc2(tanh(fc1(x)))
class BlockImpl : public torch::nn::Module {
 public:
  BlockImpl(int64_t dim, int64_t hidden);
  torch::Tensor forward(torch::Tensor x);
  torch::nn::Linear fc1{nullptr};
  torch::nn::Linear fc2{nullptr};
};
TORCH_MODULE(Block);

// What Net registers and calls in place of a plain block (e.g. an FSDP unit around it).
struct WrappedBlock {
  std::shared_ptr<torch::nn::Module> module;  // registered under the block's name
  std::function<torch::Tensor(torch::Tensor)> forward;
};
// Called with each block after its initialization (and freezing), in order.
using WrapBlock = std::function<WrappedBlock(Block block)>;

struct NetConfig {
  std::set<std::string> frozen;  // full names of parameters that get requires_grad = false
  bool with_unused = false;      // adds "unused" (Linear 2 -> 2), which forward never calls
  WrapBlock wrap_block;          // unset: the blocks are plain
};

// fc_out(block1(block0(tanh(fc_in(x))))), 5 -> 3 features, 350 parameters, initialized by
// InitDeterministic from their full names (so wrapping a block changes no value).
class NetImpl : public torch::nn::Module {
 public:
  explicit NetImpl(NetConfig config = {});
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

// parameters() without repeats: a tensor registered twice (tied weights) is listed twice, and
// LibTorch's optimizers would step it twice.
std::vector<at::Tensor> DistinctParameters(torch::nn::Module& m);

}  // namespace fairscale::testing
