// Automatic balances for pipe::Pipe (FairScale's pipe.balance): how many consecutive layers of a
// torch::nn::Sequential each of `partitions` stages gets, so that the largest stage cost is as
// small as possible. Pass the result as PipeOptions::balance (compute it on every rank from the
// same sample, or on one rank and broadcast it: the timing-based one differs between runs).
// Bad arguments raise c10::Error ("pipe::balance_by_size: INVALID_ARGUMENT: ...",
// //base:torch_error).
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/modules/container/sequential.h>

#include <cstdint>
#include <vector>

namespace fairscale::pipe {

// Cost of a layer = param_scale * (bytes of its parameters) + bytes of its outputs for one
// micro-batch of `sample` (its first ceil(rows / chunks) rows). param_scale counts the copies of
// each parameter that training keeps (FairScale's table: SGD 2-3, Adam 4-5: parameter, gradient
// and optimizer state). The layers run once on the sample, without grad.
std::vector<int64_t> balance_by_size(int64_t partitions, torch::nn::Sequential model,
                                     const at::Tensor& sample, int64_t chunks = 1,
                                     double param_scale = 2.0);

// Cost of a layer = its measured forward + backward time on `sample` (each layer on the output
// of the previous one, best of `repetitions`). Gradients it leaves in parameters are cleared.
std::vector<int64_t> balance_by_time(int64_t partitions, torch::nn::Sequential model,
                                     const at::Tensor& sample, int64_t repetitions = 3);

// The contiguous split of `costs` into `partitions` non-empty blocks minimising the largest block
// sum (deterministic on ties). INVALID_ARGUMENT if partitions < 1 or > costs.size().
std::vector<int64_t> balance_by_cost(int64_t partitions, const std::vector<double>& costs);

}  // namespace fairscale::pipe
