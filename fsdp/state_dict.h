// Full (unsharded) state dicts of a FullyShardedDataParallel model and of its optimizer (//fsdp),
// in the layout of the unwrapped module: the original parameter names ("block0.fc1.weight") and
// shapes, loadable by plain LibTorch, and loadable back into a sharded model at any world size.
//
//   // Every rank calls (collective); with rank0_only the other ranks get an empty dict.
//   auto sd = fsdp::full_state_dict(model, /*rank0_only=*/true);
//   auto osd = fsdp::full_optim_state_dict(model, opt, /*rank0_only=*/true);
//   if (rank == 0) {
//     fsdp::save_module_state_dict(sd, "model.pt");      // torch::load(plain_net, "model.pt")
//     fsdp::save_torch_optimizer(osd, "optim.pt");       // torch::load(plain_adam, "optim.pt")
//   }
//   ...
//   fsdp::load_full_state_dict(other_model, sd, /*from_rank0=*/true);  // each rank: its shards
//   fsdp::load_full_optim_state_dict(other_model, other_opt, osd);
//
// The full state dict is built one FSDP unit at a time: each flat parameter is all-gathered
// into a temporary buffer, its original parameters are copied out into tensors the dict owns,
// and the buffer is freed before the next one, so a rank's tensor memory peaks at one flat
// parameter above its steady state plus the dict itself (nothing on ranks other than 0 with
// rank0_only), never at the whole model. Under mixed precision the values are the f32 masters.
// For checkpoints on disk at scale, see sharded_checkpoint.h (no gathering at all).
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/optim/optimizer.h>
#include <torch/ordered_dict.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "fsdp/fully_sharded_data_parallel.h"

namespace fairscale::fsdp {

// Names -> tensors, parameters first, in the unwrapped module's named_parameters() order (tied
// names each listed, sharing one tensor), then its buffers in named_buffers() order.
using StateDict = torch::OrderedDict<std::string, at::Tensor>;

// The full state dict (CPU tensors owned by the dict, detached). Collective: every rank of the
// model calls it; with `rank0_only` only rank 0 receives the tensors. Root only, outside
// forward/backward.
StateDict full_state_dict(FullyShardedDataParallel& model, bool rank0_only = false);

// Loads a full state dict into the model: each rank keeps its own shards. Every parameter and
// buffer of the model must be present with its shape and dtype and there may be no other names;
// otherwise raises c10::Error (INVALID_ARGUMENT, naming the tensor) before anything is changed.
// Without `from_rank0` every rank passes the whole dict and nothing is communicated. With it,
// only rank 0's `state` is read (the others may pass an empty dict, e.g. the result of
// full_state_dict(model, true)); collective: rank 0 checks it, the ranks agree, and each flat
// parameter is broadcast in turn (one flat parameter of temporary memory per rank).
void load_full_state_dict(FullyShardedDataParallel& model, const StateDict& state,
                          bool from_rank0 = false);

// The optimizer state of the unwrapped model. Supported optimizers: torch::optim::SGD, Adam and
// AdamW (what FSDP's users step their shards with).
struct FullOptimState {
  std::string kind;  // "sgd", "adam" or "adamw"
  struct Group {
    // Hyper-parameters: lr, weight_decay, and momentum, dampening, nesterov (sgd) or beta1,
    // beta2, eps, amsgrad (adam, adamw); booleans as 0/1.
    std::map<std::string, double> options;
    std::vector<std::string> params;  // parameter names, in the unwrapped module's order
  };
  std::vector<Group> param_groups;
  struct Param {
    int64_t step = 0;  // adam, adamw
    // "momentum_buffer" (sgd), "exp_avg", "exp_avg_sq", "max_exp_avg_sq" (amsgrad): each with
    // the parameter's shape.
    std::map<std::string, at::Tensor> tensors;
  };
  std::map<std::string, Param> state;  // by parameter name; absent before the first step
};

// Gathers `optimizer`'s state (it must step model->parameters(), in any grouping) in the
// unwrapped layout, one flat parameter at a time like full_state_dict. Collective.
FullOptimState full_optim_state_dict(FullyShardedDataParallel& model,
                                     const torch::optim::Optimizer& optimizer,
                                     bool rank0_only = false);

// Re-shards a full optimizer state for this model at its world size: each rank slices its own
// shards' state and restores the groups' hyper-parameters. The optimizer must be of the same
// kind with as many groups, grouping the parameters as saved; checked before anything changes.
// Without `from_rank0` every rank passes the whole state and nothing is communicated. With it,
// only rank 0's `state` is read (collective): rank 0 checks it and broadcasts its layout, then
// each flat parameter's state tensors one at a time (each rank keeps its slice).
void load_full_optim_state_dict(FullyShardedDataParallel& model, torch::optim::Optimizer& optimizer,
                                const FullOptimState& state, bool from_rank0 = false);

// ---- plain LibTorch files -----------------------------------------------------------------

// Writes `state` (atomically: tmp + rename) as torch::save(module, path) would for the
// unwrapped module, so torch::load(module, path) loads it.
void save_module_state_dict(const StateDict& state, const std::string& path);

// Writes `state` (atomically) as `optimizer.save()` of a plain torch::optim optimizer of
// state.kind over the unwrapped module's parameters, grouped as in state.param_groups, would:
// torch::load(optimizer, path) then continues exactly where the FSDP optimizer stopped.
void save_torch_optimizer(const FullOptimState& state, const std::string& path);

}  // namespace fairscale::fsdp
