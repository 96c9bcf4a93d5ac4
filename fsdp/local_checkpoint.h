// Per-rank checkpoints of a FullyShardedDataParallel model and its optimizer (//fsdp): each rank
// writes its own file with its LocalStateDict (shards, layout, buffers) and the state of the
// torch::optim optimizer that steps those shards, and reads it back into a freshly built,
// identically wrapped model at the same world size to resume training exactly:
//
//   fsdp::save_local_checkpoint(model, &opt, absl::StrCat(dir, "/rank", rank, ".pt"));
//   ...
//   fsdp::load_local_checkpoint(model, &opt, absl::StrCat(dir, "/rank", rank, ".pt"));
//
// The file is a torch::serialize archive, written to "<path>.tmp" and renamed over `path`, so a
// crash mid-write never leaves a truncated checkpoint under the final name.
#pragma once

#include <torch/optim/optimizer.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <string>

#include "fsdp/fully_sharded_data_parallel.h"

namespace fairscale::fsdp {

// Archive-level (de)serialization, for users who put the state into their own archive.
void write_local_state_dict(const LocalStateDict &state, torch::serialize::OutputArchive &archive);
LocalStateDict read_local_state_dict(torch::serialize::InputArchive &archive);

// `optimizer` may be null (model only). The optimizer must step model->parameters() in order.
void save_local_checkpoint(FullyShardedDataParallel &model,
                           const torch::optim::Optimizer *optimizer, const std::string &path);
// Validates the model part against `model` (see load_local_state_dict) before loading anything;
// raises c10::Error naming the file and what differs. A checkpoint saved without an optimizer
// cannot restore one.
void load_local_checkpoint(FullyShardedDataParallel &model, torch::optim::Optimizer *optimizer,
                           const std::string &path);

}  // namespace fairscale::fsdp
