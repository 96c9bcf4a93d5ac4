// The FSDP item of a TrainState (//train_state:fsdp_item; kind "fsdp_sharded"): a
// FullyShardedDataParallel model and its optimizer as fsdp's sharded checkpoint (one file per
// rank with the ranges of the original parameters and optimizer state its shards hold, and
// rank 0's manifest.json; fsdp/sharded_checkpoint.h), restorable at any world size and into any
// wrapping of the same module. The snapshot copies this rank's shards and optimizer state into
// host buffers (reused by the next save); the files are written by the manager, in the
// background when it is asynchronous.
#pragma once

#include <memory>

#include "fsdp/fully_sharded_data_parallel.h"
#include "train_state/stateful.h"

namespace torch::optim {
class Optimizer;
}

namespace fairscale::train_state {

// `optimizer` (may be null: the model only) must step model->parameters(); both must outlive
// the item.
std::shared_ptr<Stateful> fsdp_item(fsdp::FullyShardedDataParallel model,
                                    torch::optim::Optimizer* optimizer);

}  // namespace fairscale::train_state
