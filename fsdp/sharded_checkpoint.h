// Sharded checkpoints of a FullyShardedDataParallel model and its optimizer on disk (//fsdp),
// loadable at any world size. Saving is collective and gathers nothing: each rank writes one
// file with the ranges of the original (unwrapped) parameters and of their optimizer state that
// its shards hold, and rank 0 then writes a manifest (JSON: world size, units, every parameter's
// name, shape and dtype, the optimizer's kind, groups and steps, and each file's size and
// checksum), after all files are committed; every file is written atomically (tmp, fsync,
// rename), so a directory with a manifest holds a complete checkpoint.
//
//   fsdp::save_sharded_checkpoint(model, &opt, "/ckpt/step_1000");   // at 4 ranks
//   ...
//   fsdp::load_sharded_checkpoint(model, &opt, "/ckpt/step_1000");   // at 1, 2, 3, 4, 8... ranks
//
// Loading reads the manifest and the headers of the files, then only the records that overlap
// this rank's shards, each checked against its checksum, and builds its shards and optimizer
// state. Everything is checked on every rank (and the ranks agree) before any model or optimizer
// changes: a missing, truncated or corrupt file is DATA_LOSS naming the file (and the tensor); a
// model or optimizer that does not match (names, shapes, dtypes, kind, groups) is
// INVALID_ARGUMENT naming the tensor. The model must have the same parameters (names, shapes)
// as the saved one; its wrapping (units) and world size may differ.
//
// consolidate_sharded_checkpoint (and the //fsdp:consolidate_checkpoint tool) turns a sharded
// checkpoint into a full state dict offline, without ranks.
#pragma once

#include <torch/optim/optimizer.h>

#include <string>

#include "absl/status/statusor.h"
#include "fsdp/fully_sharded_data_parallel.h"
#include "fsdp/state_dict.h"

namespace fairscale::fsdp {

// Collective. `optimizer` may be null (model only); it must step model->parameters().
void save_sharded_checkpoint(FullyShardedDataParallel& model,
                             const torch::optim::Optimizer* optimizer, const std::string& dir);

// Collective. With a non-null `optimizer`, the checkpoint must hold optimizer state of the same
// kind and grouping; the groups' hyper-parameters are restored too.
void load_sharded_checkpoint(FullyShardedDataParallel& model, torch::optim::Optimizer* optimizer,
                             const std::string& dir);

struct ConsolidatedCheckpoint {
  int world_size = 0;  // of the run that saved it
  StateDict state_dict;
  bool has_optimizer = false;
  FullOptimState optimizer;
};
// Reads every file whole (checking the manifest's per-file checksums as well) and assembles the
// full tensors. kDataLoss / kInvalidArgument naming the file and tensor.
absl::StatusOr<ConsolidatedCheckpoint> consolidate_sharded_checkpoint(const std::string& dir);

}  // namespace fairscale::fsdp
