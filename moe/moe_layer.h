// MOELayer (//moe): FairScale 0.4.13's fairscale.nn.moe.MOELayer (GShard's Algorithm 2) in
// LibTorch: a gate (moe/gate.h) routes each token to one or two of E experts, the experts live
// on the ranks of an expert-parallel communicator (E = comm.size() * local experts; expert
// r * L + l is local expert l of rank r), and two all-to-alls (autograd_comm::all_to_all) carry
// the tokens there and back. For transformer blocks that replace their MLP with experts.
//
// Contract (n = comm->size(), L = experts.size(), M = model_dim, S = tokens on this rank):
// * forward(x [..., M]): tokens = x.reshape(-1, M) (S rows); {l_aux, combine, dispatch} =
//   gate(tokens); dispatched[e, c] = sum_s dispatch[s, e, c] * tokens[s] ([E, C, M]);
//   all_to_all over comm (rank j receives every rank's slots of its experts, [n, L, C, M]);
//   local expert l is called exactly once, on the [n * C, M] rows of its slots (rank-major; empty
//   slots are zero rows), and must return [n * C, M] (a row-wise function: Linear, MLP, ...);
//   all_to_all back; out[s] = sum_{e,c} combine[s, e, c] * expert_out[e, c]; reshaped to x's
//   shape. A token whose choices were all dropped (over capacity) gets an exactly zero output row
//   and no gradient through the experts: the caller's residual connection carries it (FairScale).
// * Collective: every rank of comm calls forward (and backward) together with the same S (the
//   capacity, hence the all-to-all size, depends on S); a rank with another S gets the
//   communicator's mismatch error, not a hang. With n == 1 nothing is communicated.
// * l_aux(): the gate's load-balancing loss of the last forward on this rank (undefined before
//   the first), differentiable: add `coef * l_aux()` to the loss.
// * Parameters: the gate's are named "gate.*" and are replicated (the same on every rank of the
//   expert group: their gradients need the usual data-parallel all-reduce); the experts' are named
//   "experts.<l>.*", are this rank's own, and their gradients already hold every rank's tokens
//   (through the all-to-all's backward), so they must NOT be all-reduced or sharded across the
//   expert group. expert_parameters() / non_expert_parameters() split them. With //fsdp (which
//   shards every parameter of what it wraps): wrap the dense parts with FSDP over the data-parallel
//   group, keep MOELayer's experts out of any FSDP over the expert group, give
//   expert_parameters() to a local optimizer (or an FSDP over a group that holds the same experts,
//   i.e. ranks with the same rank in the expert group) and non_expert_parameters() to the
//   replicated / sharded side (FairScale's FSDP `no_broadcast_optim_state` plays this role there).
// * Errors (c10::Error via base::ThrowIfError, "moe::MOELayer ...: INVALID_ARGUMENT: ..."): at
//   construction, no experts, a null gate or comm, gate.num_experts() not equal to n * L (named
//   with n and L); in forward, x.size(-1) != gate.model_dim().
// * comm must outlive the backward pass of every output (autograd_comm holds it by reference);
//   the layer keeps a shared_ptr to it.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/pimpl.h>

#include <memory>
#include <vector>

#include "comm/communicator.h"
#include "moe/gate.h"

namespace fairscale::moe {

class MOELayerImpl : public torch::nn::Module {
 public:
  // gate: any GateImpl (Top1Gate / Top2Gate holders convert through the overload below);
  // experts: this rank's L experts, each taking and returning [rows, model_dim].
  MOELayerImpl(std::shared_ptr<GateImpl> gate, std::vector<torch::nn::AnyModule> experts,
               std::shared_ptr<comm::Communicator> comm);
  template <typename Gate>
  MOELayerImpl(const torch::nn::ModuleHolder<Gate>& gate,
               std::vector<torch::nn::AnyModule> experts,
               std::shared_ptr<comm::Communicator> comm)
      : MOELayerImpl(std::shared_ptr<GateImpl>(gate.ptr()), std::move(experts), std::move(comm)) {}

  at::Tensor forward(const at::Tensor& x);

  // The gate's auxiliary loss from the last forward (undefined before it).
  const at::Tensor& l_aux() const { return l_aux_; }

  // "experts.*": this rank's experts' parameters (never all-reduced or sharded across the group).
  std::vector<at::Tensor> expert_parameters() const;
  // Everything else ("gate.*"): replicated across the expert group.
  std::vector<at::Tensor> non_expert_parameters() const;

  const std::shared_ptr<GateImpl>& gate() const { return gate_; }
  const torch::nn::ModuleList& experts() const { return experts_; }
  int64_t num_local_experts() const { return static_cast<int64_t>(experts_->size()); }

 private:
  std::shared_ptr<GateImpl> gate_;
  torch::nn::ModuleList experts_;
  std::vector<torch::nn::AnyModule> expert_modules_;
  std::shared_ptr<comm::Communicator> comm_;
  at::Tensor l_aux_;
};
TORCH_MODULE(MOELayer);

}  // namespace fairscale::moe
