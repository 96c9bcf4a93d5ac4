// Built-in items of a TrainState (//train_state). Each is a Stateful (stateful.h); the kind in
// parentheses is what the marker records.
//
//   state.add("model", fsdp_item(model, &optimizer))      // (fsdp_sharded) any world size
//        .add("data", sampler_item(sampler))              // (json) the data position
//        .add("scaler", grad_scaler_item(scaler))         // (json)
//        .add("rng", rng_item())                          // (rng) per rank
//        .add("model", module_item(m)).add("optimizer", optimizer_item(adam))  // replicated
//        .add("trainer", json_item(get, set));            // (json) anything else
#pragma once

#include <functional>
#include <memory>

#include <nlohmann/json.hpp>

#include "train_state/distributed_sampler.h"
#include "train_state/stateful.h"

namespace torch::nn {
class Module;
}
namespace torch::optim {
class Optimizer;
}
namespace fairscale::amp {
class GradScaler;
}
namespace fairscale::oss {
class OSS;
}

namespace fairscale::train_state {

// User JSON (kind "json"): get() is called at the snapshot on every rank, rank 0's value is
// saved ("state.json"); at restore every rank reads it and set() receives it. get() must return
// the same value on every rank (a data position, a step counter, hyper-parameters).
std::shared_ptr<Stateful> json_item(std::function<nlohmann::json()> get,
                                    std::function<void(const nlohmann::json&)> set);

// A DistributedSampler's position (kind "sampler"; its state_dict(), the same on every rank,
// rank 0's saved). `sampler` is a handle: pass the one the data loader uses (copies share the
// position). Restores at any world size (the global sample order continues); a checkpoint of
// another dataset size, seed, shuffle or drop_last is an error naming both values.
std::shared_ptr<Stateful> sampler_item(DistributedSampler sampler);

// The loss scaler's state (kind "grad_scaler"; amp::GradScalerState as JSON, rank 0's).
std::shared_ptr<Stateful> grad_scaler_item(amp::GradScaler& scaler);

// The random number generators (kind "rng"): every rank's CPU generator and, where CUDA is
// present, every device's default generator, one file per rank ("rng_rank<r>.json"). Restored
// rank by rank at the same world size; at another world size restore throws (the ranks' streams
// have no meaningful mapping) unless `reseed_on_world_change`, which keeps the current states.
std::shared_ptr<Stateful> rng_item(bool reseed_on_world_change = false);

// The parameters and buffers of a module replicated on every rank (plain DDP-style training;
// kind "module"): rank 0 saves them ("module.pt", torch::save's archive layout, loadable with
// torch::load); every rank restores them, checking names, shapes and dtypes first.
std::shared_ptr<Stateful> module_item(std::shared_ptr<torch::nn::Module> module);

// A ZeRO-sharded optimizer (oss::OSS; kind "oss"): the snapshot consolidates the state on rank 0
// (collective, on the training thread) and serializes it there; rank 0 writes "optimizer.pt",
// the unsharded optimizer's torch::save archive (loadable by a plain torch::optim optimizer).
// Restores at any world size: every rank reads the archive and keeps its partition's part.
// With ShardedDataParallel (replicated parameters), pair it with module_item for the model.
std::shared_ptr<Stateful> oss_item(oss::OSS& optimizer);

// A plain torch::optim optimizer replicated on every rank (DDP-style training, or the replicas
// of a pipeline stage; kind "optimizer"): rank 0 saves its torch::save archive ("optimizer.pt");
// every rank loads it. Restores at any world size. Pair it with module_item for the model.
std::shared_ptr<Stateful> optimizer_item(torch::optim::Optimizer& optimizer);

// Pipeline stages (kind "stages/<inner kind>"): `inner` is this rank's item of its own stage (for
// instance fsdp_item of the stage's FullyShardedDataParallel over the communicator of the stage's
// replicas); the stage's ranks save it into "stage<s>/" of the item's directory, and `inner` sees
// the replica index and count as its rank and world size (so FSDP's rank files and manifest are
// the stage's). Every rank adds one stage_item under the same name. Restores with the same number
// of stages, at any number of replicas `inner` restores at; another number of stages is an error
// naming both.
std::shared_ptr<Stateful> stage_item(int stage, int num_stages, int replica, int replicas,
                                     std::shared_ptr<Stateful> inner);

}  // namespace fairscale::train_state
