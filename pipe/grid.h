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
// Deterministic mode (PipeOptions::deterministic): give each replica its place in the global
// batch, and reduce with the overload that takes the pipe (a tree sum over the global
// micro-batches instead of an average in arrival order):
//
//   auto pipe = Pipe::Create(model, grid.pipe, PipeOptions().chunks(4).deterministic(true)
//                                                  .replica(grid.replica).replicas(grid.replicas));
//   pipe->train_step(my_rows_x, my_rows_y, loss_fn);    // replica d: micro-batches [4d, 4d + 4)
//   at::Tensor loss = all_reduce_gradients(*pipe, *grid.data);   // the global loss; opt.step()
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
#include "pipe/pipe.h"

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

// Deterministic mode's counterpart, after each train_step of a pipe built with
// PipeOptions().deterministic(true).replica(grid.replica).replicas(grid.replicas): sets the
// gradient of every parameter of the pipe to the canonical tree sum (deterministic/tree.h) of
// the M = replicas * chunks global micro-batches' gradients, divided by M (one
// deterministic::AllReduce per dtype over the flattened partial sums train_step kept), and
// returns the step's loss over the whole global batch (the tree mean of the M micro-batch
// losses, the loss's dtype), equal on every rank. Bitwise the same for any (replicas, stages)
// with the same global batch and M. Collective over `data` (grid.data: rank == replica).
// Raises c10::Error ("pipe::all_reduce_gradients ...") if the pipe is not in deterministic mode,
// `data` does not match its replica()/replicas(), no train_step is waiting to be reduced, or
// a communication fails. With replicas() == 1 train_step has already set the gradients: this
// only returns the loss.
// Its collectives wait up to the communicator's operation timeout.
at::Tensor all_reduce_gradients(Pipe& pipe, comm::Communicator& data);

}  // namespace fairscale::pipe
