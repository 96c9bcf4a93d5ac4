// What fsdp's state-dict code needs to know about torch::optim's optimizers (//fsdp, internal):
// the supported kinds (SGD, Adam, AdamW), their per-parameter state as named tensors plus a step
// count, and their hyper-parameters as named numbers. The one place with optimizer-specific code.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace fairscale::fsdp::internal {

// "sgd", "adam", "adamw", or kInvalidArgument for any other optimizer.
absl::StatusOr<std::string> OptimizerKind(const torch::optim::Optimizer& optimizer);

// The key torch::optim uses for `param` in Optimizer::state().
std::string StateKey(const at::Tensor& param);

struct ParamState {
  int64_t step = 0;
  std::map<std::string, at::Tensor> tensors;  // undefined state tensors are left out
};
// `optimizer`'s state of `param`, or false when it has none yet.
bool GetParamState(const torch::optim::Optimizer& optimizer, const at::Tensor& param,
                   ParamState* out);
// The state object of `kind` holding `state` (tensors by name; absent ones stay undefined).
std::unique_ptr<torch::optim::OptimizerParamState> MakeParamState(const std::string& kind,
                                                                  const ParamState& state);
// The state tensor names `kind` may have.
const std::vector<std::string>& StateNames(const std::string& kind);

std::map<std::string, double> GetOptions(const std::string& kind,
                                         const torch::optim::OptimizerOptions& options);
// kInvalidArgument naming the option when `values` lacks one of `kind`'s.
absl::Status SetOptions(const std::string& kind, const std::map<std::string, double>& values,
                        torch::optim::OptimizerOptions& options);

// A plain optimizer of `kind` over `groups` (parameters and options), for writing files in
// torch::optim's own format.
absl::StatusOr<std::unique_ptr<torch::optim::Optimizer>> MakePlainOptimizer(
    const std::string& kind, const std::vector<std::vector<at::Tensor>>& groups,
    const std::vector<std::map<std::string, double>>& options);

}  // namespace fairscale::fsdp::internal
