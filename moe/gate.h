// Gates of a mixture-of-experts layer (//moe): FairScale 0.4.13's Top2Gate
// (fairscale/nn/moe/top2gate.py) and a Switch-style Top1Gate (fairseq's top1gating), as
// torch::nn::Modules. MOELayer (moe/moe_layer.h) calls one per forward; a user builds one and
// hands it to the layer. Each gate routes this rank's S tokens (x: [S, model_dim]) to E experts
// with C slots each and returns GateOutput{l_aux, combine_weights [S, E, C], dispatch_mask [S, E, C]}.
//
// Contract (what is implemented, step by step; E = num_experts, S = tokens on this rank):
//   logits = x W^T (W = wg->weight, [E, model_dim], no bias); gates = softmax(logits, dim 1),
//   computed in f32 for f16/bf16 inputs (as FairScale's dtype=torch.float), else in x's dtype.
//   Top-1 choice: e1 = argmax(gates). mask1 = one_hot(e1).
//   Top2 only, second choice: e2 = argmax(logits + noise, with e1 masked to -inf), where noise is
//     Gumbel(0, 1) = -log(-log(u)), u = at::rand({S, E}, generator) in the gates' dtype, clamped
//     to [eps, 1 - eps] (f32 eps); one draw per forward, only when the module is training and
//     options.second_expert_noise() is true
//     (FairScale always adds it; fairseq/DeepSpeed only while training, as here). Without a
//     generator in the options the default CPU generator is used; tests pass their own.
//   Capacity: Top2: C = ceil(2 * S / E * capacity_factor); Top1: C = ceil(S / E * capacity_factor);
//     at least 1. (FairScale's Top2Gate has no capacity factor and requires S % E == 0, giving
//     C = 2 * S / E: the same value at capacity_factor 1; here S need not be divisible by E.)
//   Slots: location1[s] = number of earlier tokens whose first choice is e1[s]; Top2:
//     location2[s] = (all tokens whose first choice is e2[s], before dropping) + number of earlier
//     tokens whose second choice is e2[s]. A choice whose location >= C is dropped.
//   Weights: Top2: g1 = gates[s, e1] and g2 = gates[s, e2] for the kept choices (0 if dropped),
//     renormalized by max(g1 + g2, eps) (eps of the gates' dtype), as FairScale. Top1: g1 =
//     gates[s, e1] (0 if dropped), not renormalized (Switch).
//   combine_weights[s, e, c] = g of the choice of token s that went to expert e, slot c (else 0);
//     dispatch_mask = combine_weights != 0 (bool). Both in x's dtype / bool.
//   l_aux = mean_e(me_e * ce_e) * E^2, me_e = mean_s gates[s, e], ce_e = fraction of tokens whose
//     first choice is e (before dropping). This is the normalization of fairseq, DeepSpeed and
//     Switch (1 at uniform routing); FairScale 0.4.13's top2gating returns mean(me * ce) without the
//     E^2 factor, i.e. our l_aux / E^2.
// Differentiable with respect to x and W through gates (and l_aux through me); routing decisions
// are not. Errors (c10::Error via base::ThrowIfError): x not 2-D or x.size(1) != model_dim, S == 0,
// Top2 with E < 2, non-positive capacity_factor.
#pragma once

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>
#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <optional>

namespace fairscale::moe {

// What a gate returns for S tokens, E experts of capacity C (FairScale's tuple, in its order).
struct GateOutput {
  at::Tensor l_aux;            // scalar, x's dtype
  at::Tensor combine_weights;  // [S, E, C], x's dtype
  at::Tensor dispatch_mask;    // [S, E, C], bool: combine_weights != 0
};

struct Top2GateOptions {
  Top2GateOptions(int64_t model_dim, int64_t num_experts)
      : model_dim_(model_dim), num_experts_(num_experts) {}
  TORCH_ARG(int64_t, model_dim);
  TORCH_ARG(int64_t, num_experts);
  // C = ceil(2 * S / E * capacity_factor).
  TORCH_ARG(double, capacity_factor) = 1.0;
  // Gumbel noise on the logits of the second choice, in training mode only.
  TORCH_ARG(bool, second_expert_noise) = true;
  // The generator the noise is drawn from (CPU generator for CPU tensors); nullopt: the default.
  TORCH_ARG(std::optional<at::Generator>, generator) = std::nullopt;
};

struct Top1GateOptions {
  Top1GateOptions(int64_t model_dim, int64_t num_experts)
      : model_dim_(model_dim), num_experts_(num_experts) {}
  TORCH_ARG(int64_t, model_dim);
  TORCH_ARG(int64_t, num_experts);
  // C = ceil(S / E * capacity_factor).
  TORCH_ARG(double, capacity_factor) = 1.0;
};

// The interface MOELayer calls: any gate with a linear router `wg` over model_dim.
class GateImpl : public torch::nn::Module {
 public:
  virtual GateOutput forward(const at::Tensor& x) = 0;
  virtual int64_t model_dim() const = 0;
  virtual int64_t num_experts() const = 0;
};

class Top2GateImpl : public GateImpl {
 public:
  explicit Top2GateImpl(Top2GateOptions options);
  void reset();
  GateOutput forward(const at::Tensor& x) override;
  int64_t model_dim() const override { return options.model_dim(); }
  int64_t num_experts() const override { return options.num_experts(); }

  Top2GateOptions options;
  torch::nn::Linear wg{nullptr};  // [num_experts, model_dim], no bias; FairScale's name
};
TORCH_MODULE(Top2Gate);

class Top1GateImpl : public GateImpl {
 public:
  explicit Top1GateImpl(Top1GateOptions options);
  void reset();
  GateOutput forward(const at::Tensor& x) override;
  int64_t model_dim() const override { return options.model_dim(); }
  int64_t num_experts() const override { return options.num_experts(); }

  Top1GateOptions options;
  torch::nn::Linear wg{nullptr};
};
TORCH_MODULE(Top1Gate);

}  // namespace fairscale::moe
