// Test support for the //oss tests (testonly): the five elementwise LibTorch optimizers with two
// param groups (different lr and weight decay), the single-process reference trajectory on the
// global batches of //testing:model (whose model and data these tests share with fsdp's), and
// comparisons that return a Status (rank bodies report through their Status).
#pragma once

#include <torch/optim/optimizer.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "comm/communicator.h"
#include "oss/oss.h"
#include "testing/model.h"

namespace fairscale::oss::testing {

using fairscale::testing::Net;

enum class Kind { kSgd, kAdam, kAdamW, kAdagrad, kRmsprop };
inline constexpr Kind kAllKinds[] = {Kind::kSgd, Kind::kAdam, Kind::kAdamW, Kind::kAdagrad,
                                     Kind::kRmsprop};
const char* KindName(Kind kind);

// "Greedy" or "Flat" (test names and messages).
const char* ModeName(PartitionMode mode);

// Builds `kind` over the groups (momentum, centered, lr_decay... switched on so that every
// state field is exercised).
OptimizerFactory Factory(Kind kind);
// Weights: lr 0.02, weight decay 0.01; biases: lr 0.05, no weight decay.
std::vector<torch::optim::OptimizerParamGroup> TwoGroups(Net& net, Kind kind);

struct Trajectory {
  std::vector<std::map<std::string, at::Tensor>> params;  // after each step
};
// Trains a plain Net with the unsharded optimizer on the global batches, steps [first, last),
// starting from `start` params and optimizer `state` (an archive's bytes) when given; with
// `schedule`, a StepLR(3, 0.5) steps after every optimizer step.
Trajectory RunReference(Kind kind, int first, int last, bool schedule,
                        const std::map<std::string, at::Tensor>* start = nullptr,
                        const std::string* state = nullptr);

std::map<std::string, at::Tensor> Snapshot(Net& net);
void Restore(Net& net, const std::map<std::string, at::Tensor>& values);

// Mean of every gradient over the ranks (what DDP does before a plain OSS step).
absl::Status AllReduceGrads(Net& net, comm::Communicator& comm);

// OK if every parameter is within `atol` of the expected one (max abs difference).
absl::Status ExpectParams(const std::string& what, Net& net,
                          const std::map<std::string, at::Tensor>& expected, double atol);

// The optimizer's archive as bytes, and back.
std::string SaveToBytes(const torch::optim::Optimizer& opt);
void LoadFromBytes(torch::optim::Optimizer& opt, const std::string& bytes);

}  // namespace fairscale::oss::testing
