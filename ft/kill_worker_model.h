// The model, data and learning rate of //ft:kill_worker, shared with //ft:kill_test's
// single-process replay: a 6-16-3 tanh MLP in f64 (initialised from a private generator: every
// group starts from the same weights whatever torch's global seed), and the batch of
// (step, group, shard) a pure function of the three.
#pragma once

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/tanh.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <utility>

namespace fairscale::ft::testing {

inline constexpr double kKillLr = 0.02;

struct KillNetImpl : torch::nn::Module {
  KillNetImpl() {
    l1 = register_module("l1", torch::nn::Linear(6, 16));
    l2 = register_module("l2", torch::nn::Linear(16, 3));
  }
  at::Tensor forward(const at::Tensor& x) { return l2(at::tanh(l1(x))); }
  torch::nn::Linear l1{nullptr}, l2{nullptr};
};
TORCH_MODULE(KillNet);

inline KillNet MakeKillNet() {
  KillNet net;
  net->to(at::kDouble);
  at::Generator gen = at::detail::createCPUGenerator(7);
  at::NoGradGuard no_grad;
  for (at::Tensor& p : net->parameters()) {
    p.copy_(at::randn(p.sizes(), gen, at::TensorOptions().dtype(at::kDouble)) * 0.5);
  }
  return net;
}

inline std::pair<at::Tensor, at::Tensor> KillBatch(int64_t step, int group, int shard) {
  at::Generator gen = at::detail::createCPUGenerator(100000 + step * 1000 + group * 10 + shard);
  const auto opts = at::TensorOptions().dtype(at::kDouble);
  at::Tensor x = at::randn({8, 6}, gen, opts);
  at::Tensor y = at::randn({8, 3}, gen, opts);
  return {x, y};
}

}  // namespace fairscale::ft::testing
