#include "testing/model.h"

#include <ATen/ops/arange.h>
#include <ATen/ops/cos.h>
#include <ATen/ops/sin.h>
#include <ATen/ops/tanh.h>
#include <c10/core/GradMode.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <cmath>
#include <utility>

namespace fairscale::testing {

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

void InitDeterministic(torch::nn::Module& m, const std::string& prefix, double amplitude) {
  c10::NoGradGuard no_grad;
  for (const auto& item : m.named_parameters()) {
    const std::string name = prefix + item.key();
    double phase = 0;
    for (char c : name) phase = std::fmod(phase * 31 + static_cast<unsigned char>(c), 997.0);
    at::Tensor p = item.value();
    at::Tensor v = at::sin(at::arange(p.numel(), p.options()) * 0.731 + phase * 0.1) * amplitude;
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

NetImpl::NetImpl(NetConfig config) {
  fc_in_ = register_module("fc_in", torch::nn::Linear(5, 7));
  InitDeterministic(*fc_in_, "fc_in.");
  Freeze(*fc_in_, "fc_in.", config.frozen);
  if (config.with_unused) {
    auto unused = register_module("unused", torch::nn::Linear(2, 2));
    InitDeterministic(*unused, "unused.");
  }
  for (int i = 0; i < 2; ++i) {
    const std::string name = "block" + std::to_string(i);
    Block block(7, 9);
    InitDeterministic(*block, name + ".");
    Freeze(*block, name + ".", config.frozen);
    if (config.wrap_block) {
      WrappedBlock wrapped = config.wrap_block(block);
      register_module(name, std::move(wrapped.module));
      blocks_.push_back(std::move(wrapped.forward));
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

std::vector<at::Tensor> DistinctParameters(torch::nn::Module& m) {
  std::vector<at::Tensor> out;
  for (const at::Tensor& p : m.parameters()) {
    bool seen = false;
    for (const at::Tensor& q : out) seen = seen || q.is_same(p);
    if (!seen) out.push_back(p);
  }
  return out;
}

}  // namespace fairscale::testing
