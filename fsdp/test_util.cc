#include "fsdp/test_util.h"

#include <ATen/ops/arange.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/cos.h>
#include <ATen/ops/sin.h>
#include <ATen/ops/tanh.h>
#include <ATen/ops/zeros.h>
#include <c10/core/GradMode.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <cmath>

#include "absl/strings/str_cat.h"
#include "base/tensor_close.h"
#include "comm/registry.h"
#include "comm/testing/rank_runner.h"

namespace fairscale::fsdp::testing {

const char* OptimizerName(OptimizerKind kind) {
  switch (kind) {
    case OptimizerKind::kSgdMomentum:
      return "SgdMomentum";
    case OptimizerKind::kAdam:
      return "Adam";
    case OptimizerKind::kAdamW:
      return "AdamW";
  }
  return "?";
}

std::unique_ptr<torch::optim::Optimizer> MakeOptimizer(OptimizerKind kind,
                                                       std::vector<at::Tensor> params) {
  switch (kind) {
    case OptimizerKind::kSgdMomentum:
      return std::make_unique<torch::optim::SGD>(params,
                                                 torch::optim::SGDOptions(0.1).momentum(0.9));
    case OptimizerKind::kAdam:
      return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(0.01));
    case OptimizerKind::kAdamW:
      return std::make_unique<torch::optim::AdamW>(
          params, torch::optim::AdamWOptions(0.01).weight_decay(0.1));
  }
  return nullptr;
}

void InitDeterministic(torch::nn::Module& m, const std::string& prefix) {
  c10::NoGradGuard no_grad;
  for (const auto& item : m.named_parameters()) {
    const std::string name = prefix + item.key();
    double phase = 0;
    for (char c : name) phase = std::fmod(phase * 31 + static_cast<unsigned char>(c), 997.0);
    at::Tensor p = item.value();
    at::Tensor v = at::sin(at::arange(p.numel(), p.options()) * 0.731 + phase * 0.1) * 0.4;
    p.copy_(v.view(p.sizes()));
  }
}

BlockImpl::BlockImpl(int64_t dim, int64_t hidden)
    : fc1(register_module("fc1", torch::nn::Linear(dim, hidden))),
      fc2(register_module("fc2", torch::nn::Linear(hidden, dim))) {}

torch::Tensor BlockImpl::forward(torch::Tensor x) { return x + fc2(at::tanh(fc1(x))); }

namespace {
void Freeze(torch::nn::Module& m, const std::string& prefix, const std::set<std::string>& names) {
  for (auto& item : m.named_parameters()) {
    if (names.count(prefix + item.key())) item.value().set_requires_grad(false);
  }
}
}  // namespace

NetImpl::NetImpl(std::shared_ptr<comm::Communicator> nested_comm, FsdpOptions nested_options,
                 NetConfig config) {
  fc_in_ = register_module("fc_in", torch::nn::Linear(5, 7));
  InitDeterministic(*fc_in_, "fc_in.");
  Freeze(*fc_in_, "fc_in.", config.frozen);
  if (config.with_unused) {
    auto unused = register_module("unused", torch::nn::Linear(2, 2));
    InitDeterministic(*unused, "unused.");
  }
  for (int i = 0; i < 2; ++i) {
    const std::string name = absl::StrCat("block", i);
    Block block(7, 9);
    InitDeterministic(*block, name + ".");
    Freeze(*block, name + ".", config.frozen);
    if (nested_comm) {
      FullyShardedDataParallel unit(block, nested_comm, nested_options);
      register_module(name, unit);
      blocks_.push_back([unit](torch::Tensor x) mutable { return unit(x); });
    } else {
      register_module(name, block);
      blocks_.push_back([block](torch::Tensor x) mutable { return block(x); });
    }
  }
  fc_out_ = register_module("fc_out", torch::nn::Linear(7, 3));
  InitDeterministic(*fc_out_, "fc_out.");
}

torch::Tensor NetImpl::forward(torch::Tensor x) {
  x = at::tanh(fc_in_(x));
  for (size_t i = 0; i < blocks_.size(); ++i) {
    if (static_cast<int>(i) != skip_block) x = blocks_[i](x);
  }
  return fc_out_(x);
}

Batch GlobalBatch(int step) {
  at::Tensor i = at::arange(kBatchRows * 5, at::kFloat).view({kBatchRows, 5});
  at::Tensor j = at::arange(kBatchRows * 3, at::kFloat).view({kBatchRows, 3});
  return {at::sin(i * 0.37 + step * 0.5), at::cos(j * 0.23 - step * 0.3) * 0.5};
}

at::Tensor RankRows(const at::Tensor& t, int rank, int world) {
  const int64_t rows = t.size(0) / world;
  return t.narrow(0, rank * rows, rows);
}

at::Tensor Mse(const at::Tensor& output, const at::Tensor& target) {
  return (output - target).pow(2).mean();
}

std::vector<ReferenceStep> RunReference(OptimizerKind kind, int steps) {
  Net net;
  auto opt = MakeOptimizer(kind, DistinctParameters(*net));
  std::vector<ReferenceStep> out;
  for (int step = 0; step < steps; ++step) {
    opt->zero_grad();
    Batch b = GlobalBatch(step);
    ReferenceStep r;
    at::Tensor output = net(b.x);
    Mse(output, b.y).backward();
    r.output = output.detach();
    for (const auto& item : net->named_parameters()) {
      r.grads[item.key()] = item.value().grad().clone();
    }
    opt->step();
    for (const auto& item : net->named_parameters()) {
      r.params[item.key()] = item.value().detach().clone();
    }
    out.push_back(std::move(r));
  }
  return out;
}

at::Tensor ShardOf(const FlatParamInfo& info, const std::map<std::string, at::Tensor>& named) {
  at::Tensor flat = at::zeros({info.padded_numel});
  for (const FlatParamInfo::Entry& e : info.params) {
    auto it = named.find(e.name);
    TORCH_CHECK(it != named.end(), "no reference tensor named '", e.name, "'");
    flat.narrow(0, e.offset, e.numel).copy_(it->second.reshape({-1}));
  }
  return flat.narrow(0, info.shard_offset, info.shard_numel);
}

std::vector<at::Tensor> DistinctParameters(torch::nn::Module& m) {
  std::vector<at::Tensor> out;
  for (const at::Tensor& p : m.parameters()) {
    bool seen = false;
    for (const at::Tensor& q : out) seen = seen || q.is_same(p);
    if (!seen) out.push_back(p);
  }
  return out;
}

absl::Status CheckShards(FullyShardedDataParallel& model,
                         const std::map<std::string, at::Tensor>& expected, bool grads,
                         const std::string& what, double rtol) {
  for (FullyShardedDataParallelImpl* unit : model->fsdp_units()) {
    const auto params = unit->named_parameters(/*recurse=*/false);
    for (const FlatParamInfo& info : unit->flat_param_info()) {
      if (grads && !info.requires_grad) continue;
      const at::Tensor& shard = params[info.name];
      at::Tensor actual = grads ? shard.grad() : shard.detach();
      if (grads && !actual.defined()) actual = at::zeros_like(shard);
      absl::Status s =
          ExpectClose(absl::StrCat(what, " of unit '", unit->prefix(), "' ", info.name), actual,
                      ShardOf(info, expected), rtol);
      if (!s.ok()) return s;
    }
  }
  return absl::OkStatus();
}

std::vector<absl::Status> RunRanks(
    int world,
    std::function<absl::Status(int rank, int world, std::shared_ptr<comm::Communicator>)> body) {
  return comm::testing::RunThreads(
      world,
      [&](int rank) -> absl::Status {
        try {
          absl::StatusOr<std::shared_ptr<comm::Communicator>> comm =
              comm::CreateCommunicator("inproc", comm::testing::RankConfig(absl::Seconds(30)));
          if (!comm.ok()) return comm.status();
          absl::Status status = body(rank, world, *comm);
          // A rank that returns destroys its communicator; a peer that has not joined the
          // in-process domain yet (a body without collectives) would find it gone.
          absl::Status barrier = (*comm)->Barrier().Wait();
          return status.ok() ? barrier : status;
        } catch (const std::exception& e) {
          return absl::InternalError(e.what());
        }
      },
      absl::Seconds(50));
}

absl::Status ExpectClose(const std::string& what, const at::Tensor& actual,
                         const at::Tensor& expected, double rtol) {
  return base::ExpectTensorClose(what, actual, expected, rtol);
}

}  // namespace fairscale::fsdp::testing
