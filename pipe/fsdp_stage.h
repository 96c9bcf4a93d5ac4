// FSDP inside a pipeline stage (//pipe:fsdp_stage): pipeline x fully sharded data parallel.
// On a PipeGrid (grid.h) the ranks that hold the same stage (grid.data) shard that stage's
// parameters with fsdp::FullyShardedDataParallel instead of all-reducing full gradients:
//
//   PipeGrid grid = MakePipeGrid(world, /*stages=*/2);             // 4 ranks: a 2 x 2 grid
//   auto pipe = Pipe::Create(model, grid.pipe, PipeOptions().chunks(4).wrap_stage(
//       fsdp_stage(grid.data, fsdp::FsdpOptions().sharding_strategy(kFullShard))));
//   torch::optim::Adam opt(pipe->parameters(), 1e-3);               // this rank's shards
//   pipe->train_step(my_rows_x, my_rows_y, loss_fn);                // no all_reduce_gradients:
//   opt.step();                                                     // FSDP reduced them
//
// The stage is one FSDP unit (its flat parameter is every parameter of the stage). Each
// micro-batch's forward gathers the stage's parameters (FULL_SHARD frees them after it,
// SHARD_GRAD_OP keeps them until that micro-batch's backward), each micro-batch's backward
// gathers them again if needed and reduce-scatters its gradient into the shards' .grad(), where
// the micro-batches accumulate (the average over the replicas of the sum over micro-batches:
// the same gradients as all_reduce_gradients; reduce_once_per_step below defers the reduction to
// the last micro-batch). A checkpointed micro-batch's recompute inside
// backward gathers like a forward. Collective over `data` (construction, every micro-batch):
// every replica must run the same schedule, which the pipe guarantees.
//
// Mixed precision (FsdpOptions::mixed_precision, e.g. param_dtype bf16, reduce_dtype f32): the
// stage computes in param_dtype over f32 master shards (what the optimizer steps), so the
// activations it sends to the next stage and the gradients it sends back are in param_dtype
// (half the bytes of f32); floating-point inputs of the stage are cast to param_dtype.
#pragma once

#include <memory>

#include "comm/communicator.h"
#include "fsdp/fsdp_options.h"
#include "pipe/pipe.h"

namespace fairscale::pipe {

// A PipeOptions::wrap_stage hook wrapping the stage in fsdp::FullyShardedDataParallel over
// `data` with `options` (any strategy, mixed precision, prefetch settings). The returned
// WrappedStage's module is the fsdp::FullyShardedDataParallelImpl (use
// std::dynamic_pointer_cast on Pipe::module() for its checkpoint and state-dict functions).
//
// reduce_once_per_step: the backwards of all but the step's last micro-batch run under FSDP's
// no_sync(), accumulating the stage's full (unsharded) gradient on each rank, and the last one
// reduce-scatters the sum: one reduction per step instead of one per micro-batch (1/chunks of
// the gradient traffic) for a full gradient of the stage in memory during the step. Same
// gradients either way (up to f32 summation order).
WrapStageFn fsdp_stage(std::shared_ptr<comm::Communicator> data, fsdp::FsdpOptions options = {},
                       bool reduce_once_per_step = false);

}  // namespace fairscale::pipe
