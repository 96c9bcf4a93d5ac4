#include "oss/test_util.h"

#include <c10/core/GradMode.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/schedulers/step_lr.h>
#include <torch/optim/sgd.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <sstream>

#include "absl/strings/str_cat.h"
#include "comm/torch/tensor_buffer.h"

namespace fairscale::oss::testing {
namespace {

std::unique_ptr<torch::optim::OptimizerOptions> Options(Kind kind, double lr, double wd) {
  switch (kind) {
    case Kind::kSgd:
      return std::make_unique<torch::optim::SGDOptions>(
          torch::optim::SGDOptions(lr).momentum(0.9).weight_decay(wd));
    case Kind::kAdam:
      return std::make_unique<torch::optim::AdamOptions>(
          torch::optim::AdamOptions(lr).weight_decay(wd));
    case Kind::kAdamW:
      return std::make_unique<torch::optim::AdamWOptions>(
          torch::optim::AdamWOptions(lr).weight_decay(wd).amsgrad(true));
    case Kind::kAdagrad:
      return std::make_unique<torch::optim::AdagradOptions>(
          torch::optim::AdagradOptions(lr).weight_decay(wd).lr_decay(0.01));
    case Kind::kRmsprop:
      // RMSprop's first steps are ~lr / sqrt(1 - alpha) = 10 lr: a tenth of the others' lr
      // keeps the trajectory (and the float rounding of the data-parallel gradient mean) alike.
      return std::make_unique<torch::optim::RMSpropOptions>(
          torch::optim::RMSpropOptions(lr * 0.1).weight_decay(wd).momentum(0.5).centered(true));
  }
  return nullptr;
}

template <typename Opt, typename Options>
std::unique_ptr<torch::optim::Optimizer> Build(
    std::vector<torch::optim::OptimizerParamGroup> groups, const Options& defaults) {
  return std::make_unique<Opt>(std::move(groups), defaults);
}

}  // namespace

const char* KindName(Kind kind) {
  switch (kind) {
    case Kind::kSgd:
      return "Sgd";
    case Kind::kAdam:
      return "Adam";
    case Kind::kAdamW:
      return "AdamW";
    case Kind::kAdagrad:
      return "Adagrad";
    case Kind::kRmsprop:
      return "Rmsprop";
  }
  return "?";
}

const char* ModeName(PartitionMode mode) {
  return mode == PartitionMode::kGreedy ? "Greedy" : "Flat";
}

OptimizerFactory Factory(Kind kind) {
  return [kind](std::vector<torch::optim::OptimizerParamGroup> groups)
             -> std::unique_ptr<torch::optim::Optimizer> {
    auto defaults = Options(kind, 0.01, 0);
    switch (kind) {
      case Kind::kSgd:
        return Build<torch::optim::SGD>(
            std::move(groups), static_cast<torch::optim::SGDOptions&>(*defaults));
      case Kind::kAdam:
        return Build<torch::optim::Adam>(
            std::move(groups), static_cast<torch::optim::AdamOptions&>(*defaults));
      case Kind::kAdamW:
        return Build<torch::optim::AdamW>(
            std::move(groups), static_cast<torch::optim::AdamWOptions&>(*defaults));
      case Kind::kAdagrad:
        return Build<torch::optim::Adagrad>(
            std::move(groups), static_cast<torch::optim::AdagradOptions&>(*defaults));
      case Kind::kRmsprop:
        return Build<torch::optim::RMSprop>(
            std::move(groups), static_cast<torch::optim::RMSpropOptions&>(*defaults));
    }
    return nullptr;
  };
}

std::vector<torch::optim::OptimizerParamGroup> TwoGroups(Net& net, Kind kind) {
  std::vector<at::Tensor> weights, biases;
  for (const auto& item : net->named_parameters()) {
    (item.key().find("bias") != std::string::npos ? biases : weights).push_back(item.value());
  }
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(weights, Options(kind, 0.02, 0.01));
  groups.emplace_back(biases, Options(kind, 0.05, 0.0));
  return groups;
}

std::map<std::string, at::Tensor> Snapshot(Net& net) {
  std::map<std::string, at::Tensor> out;
  for (const auto& item : net->named_parameters()) out[item.key()] = item.value().detach().clone();
  return out;
}

void Restore(Net& net, const std::map<std::string, at::Tensor>& values) {
  c10::NoGradGuard no_grad;
  for (const auto& item : net->named_parameters()) item.value().copy_(values.at(item.key()));
}

Trajectory RunReference(Kind kind, int first, int last, bool schedule,
                        const std::map<std::string, at::Tensor>* start, const std::string* state) {
  Net net;
  if (start != nullptr) Restore(net, *start);
  auto opt = Factory(kind)(TwoGroups(net, kind));
  if (state != nullptr) LoadFromBytes(*opt, *state);
  std::unique_ptr<torch::optim::StepLR> sched;
  if (schedule) sched = std::make_unique<torch::optim::StepLR>(*opt, 3, 0.5);
  Trajectory out;
  for (int step = first; step < last; ++step) {
    opt->zero_grad();
    fairscale::testing::Batch b = fairscale::testing::GlobalBatch(step);
    fairscale::testing::Mse(net(b.x), b.y).backward();
    opt->step();
    if (sched) sched->step();
    out.params.push_back(Snapshot(net));
  }
  return out;
}

absl::Status AllReduceGrads(Net& net, comm::Communicator& comm) {
  for (const auto& item : net->named_parameters()) {
    at::Tensor g = item.value().grad();
    if (!g.defined()) continue;
    absl::StatusOr<comm::Buffer> b = comm::ToBuffer(g);
    if (!b.ok()) return b.status();
    absl::Status s = comm.AllReduce(*b, *b, comm::ReduceOp::kSum).Wait();
    if (!s.ok()) return s;
    g.div_(comm.size());
  }
  return absl::OkStatus();
}

absl::Status ExpectParams(const std::string& what, Net& net,
                          const std::map<std::string, at::Tensor>& expected, double atol) {
  for (const auto& item : net->named_parameters()) {
    const at::Tensor& e = expected.at(item.key());
    const double diff = (item.value().detach() - e).abs().max().item<double>();
    if (!(diff <= atol)) {
      return absl::InternalError(
          absl::StrCat(what, ": ", item.key(), " differs by ", diff, " (tolerance ", atol, ")"));
    }
  }
  return absl::OkStatus();
}

std::string SaveToBytes(const torch::optim::Optimizer& opt) {
  torch::serialize::OutputArchive out;
  opt.save(out);
  std::ostringstream stream;
  out.save_to(stream);
  return stream.str();
}

void LoadFromBytes(torch::optim::Optimizer& opt, const std::string& bytes) {
  std::istringstream stream(bytes);
  torch::serialize::InputArchive in;
  in.load_from(stream);
  opt.load(in);
}

}  // namespace fairscale::oss::testing
