// Pipeline x data parallel (//pipe): `replicas` copies of a `stages`-stage pipeline on one
// communicator of stages * replicas ranks. Rank r is stage r % stages of replica r / stages.
// Each replica trains its own rows of the batch through its pipe::Pipe (on grid.pipe); then the
// ranks holding the same stage average their gradients over grid.data before the optimizer step:
//
//   PipeGrid grid = MakePipeGrid(world, /*stages=*/2);             // 4 ranks: a 2 x 2 grid
//   auto pipe = Pipe::Create(model, grid.pipe, options);
//   pipe->train_step(my_rows_x, my_rows_y, loss_fn);
//   all_reduce_gradients(pipe->parameters(), *grid.data, timeout);   // then opt.step()
//
// With equal rows per replica, the result equals one un-pipelined step on the whole batch.
//
// Instead of all-reducing full gradients, the stage groups can shard each stage with FSDP
// (FULL_SHARD / SHARD_GRAD_OP, ZeRO-3 / ZeRO-2 inside the stage): pass
// PipeOptions().wrap_stage(fsdp_stage(grid.data, fsdp_options)) (fsdp_stage.h, target
// //pipe:fsdp_stage) and skip all_reduce_gradients; parameters() are then this rank's shards.
//
// Errors raise c10::Error ("pipe::MakePipeGrid (rank 1/4): INVALID_ARGUMENT: ...",
// //base:torch_error).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/time/time.h"
#include "comm/communicator.h"

namespace fairscale::pipe {

struct PipeGrid {
  int64_t stages = 1;
  int64_t replicas = 1;
  int64_t stage = 0;
  int64_t replica = 0;
  // This replica's pipeline: `stages` ranks, rank == stage. Pass it to Pipe::Create.
  std::shared_ptr<comm::Communicator> pipe;
  // The ranks that hold this stage in every replica: `replicas` ranks, rank == replica.
  std::shared_ptr<comm::Communicator> data;
};

// Collective over `world` (two Splits). Raises INVALID_ARGUMENT unless stages >= 1 divides its
// size.
PipeGrid MakePipeGrid(const std::shared_ptr<comm::Communicator>& world, int64_t stages);

// Replaces the gradient of every parameter with its average over `data` (one all-reduce per
// dtype over the flattened gradients; a missing gradient counts as zeros and becomes defined).
// Collective over `data`; every rank must pass parameters of the same shapes in the same order.
// Raises the communicator's error ("pipe::all_reduce_gradients (Float, 120 elements): ...").
void all_reduce_gradients(const std::vector<at::Tensor>& parameters, comm::Communicator& data,
                          absl::Duration timeout = absl::ZeroDuration());

}  // namespace fairscale::pipe
