// Test support for the //pipe tests (testonly): small deterministic models, batches, the
// single-process reference, a runner that runs a body as the ranks of an inproc job (threads),
// and tensor comparisons that return a Status (rank bodies report through their Status).
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/modules/container/sequential.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "comm/communicator.h"
#include "pipe/pipe.h"
#include "testing/model.h"

namespace fairscale::pipe::testing {

// fairscale::testing::InitDeterministic (//testing:model) with no prefix and amplitude 0.5: the
// values the pipe tests were written against (the shared Net's are 0.4).
inline void InitDeterministic(torch::nn::Module& m) {
  fairscale::testing::InitDeterministic(m, "", 0.5);
}

// Linear(4, 6), Tanh, Linear(6, 6), Tanh, Linear(6, 6), Tanh, Linear(6, 3): 7 layers.
torch::nn::Sequential MakeMlp();

// Linear(4, 6), then 5 x (Tanh, Linear(6, 6)), Tanh, Linear(6, 3): 13 layers, enough for
// 4 ranks x 2 virtual stages or 2 x 3.
torch::nn::Sequential MakeDeepMlp();

// Rows 4 -> 3 features, deterministic in `seed`.
at::Tensor Inputs(int64_t rows, int seed);
at::Tensor Targets(int64_t rows, int seed);
at::Tensor Mse(const at::Tensor& output, const at::Tensor& target);

// One un-pipelined training run on a fresh copy of the model: for each (input, target) pair
// the mean over `chunks` micro-batches (torch.tensor_split rows) of loss_fn, backward, gradients
// accumulated over the pairs.
struct Reference {
  std::vector<double> losses;                // per step
  std::map<std::string, at::Tensor> grads;   // accumulated over the steps
};
Reference RunReference(const std::function<torch::nn::Sequential()>& make_model,
                       const std::vector<at::Tensor>& inputs,
                       const std::vector<at::Tensor>& targets, int64_t chunks,
                       const LossFn& loss_fn);

// Runs `ranks` inproc ranks, each creating a Pipe over make_model() with `options` (checking
// virtual_stages()) and training on inputs[s] / targets[s] in turn (the input on rank 0, the
// target on the last rank): every step's loss within 1e-5 of ref.losses[s], then every stage
// gradient within 1e-5 of ref.grads. One Status per rank, naming `what` on a mismatch.
std::vector<absl::Status> RunParity(int ranks,
                                    const std::function<torch::nn::Sequential()>& make_model,
                                    const PipeOptions& options,
                                    const std::vector<at::Tensor>& inputs,
                                    const std::vector<at::Tensor>& targets, const Reference& ref,
                                    const std::string& what);

// Checks that every parameter of the pipe's stage has the reference gradient (same name).
absl::Status CheckStageGrads(const Pipe& pipe, const std::map<std::string, at::Tensor>& grads,
                             double rtol, const std::string& what);

// OK if ||actual - expected|| <= rtol * ||expected|| (both ~0 counts as equal).
absl::Status ExpectClose(const std::string& what, const at::Tensor& actual,
                         const at::Tensor& expected, double rtol);

// comm::testing::RunInprocRanks for bodies that do not need the world size: body(rank, comm) on
// `world` threads over fresh inproc communicators (operation timeout `timeout`), then a barrier
// (also after a failed body); exceptions become kInternal (fairscale::testing::CatchErrors).
std::vector<absl::Status> RunInproc(
    int world, const std::function<absl::Status(int rank, std::shared_ptr<comm::Communicator>)>& body,
    absl::Duration timeout = absl::Seconds(30));

}  // namespace fairscale::pipe::testing
