// A 3-D parallel grid (//model_parallel): tensor x pipeline x data on one world communicator,
// with each rank's three groups named. Users of Megatron-style 3-D parallelism build it once and
// hand each group to the library that needs it: the tensor-parallel layers (layers.h) take
// grid.tensor_group, pipe::Pipe takes grid.pipeline_group, and FSDP (or a plain gradient
// all-reduce between replicas) takes grid.data_group.
//
//   ParallelGrid grid = MakeParallelGrid(world, /*tensor=*/2, /*pipeline=*/2);  // 8 ranks: 2x2x2
//   ColumnParallelLinear fc(ColumnParallelLinearOptions(512, 2048), grid.tensor_group);
//   auto pipe = pipe::Pipe::Create(stage_layers, grid.pipeline_group, pipe_options);
//   pipe::all_reduce_gradients(pipe->parameters(), *grid.data_group);  // or FSDP on data_group
//   LOG(INFO) << grid.describe();
//
// Layout (Megatron-LM's): tensor-parallel ranks are consecutive (fastest varying), then pipeline
// stages, then data replicas:
//
//   world rank = replica * (pipeline * tensor) + stage * tensor + tensor_rank
//
// so a tensor group (the most talkative) sits on neighbouring ranks, i.e. inside one node when
// tensor divides the GPUs per node. Each group's rank is this rank's index along its dimension
// (tensor_group->rank() == tensor_rank, pipeline_group->rank() == stage,
// data_group->rank() == replica), and its members are ordered by world rank.
//
// pipe::PipeGrid interop (pipe/grid.h, whose layout is the special case tensor == 1): the
// header-only target //model_parallel:pipe_grid (pipe_grid.h) converts a ParallelGrid into a
// pipe::PipeGrid {pipe = pipeline_group, data = data_group}; //model_parallel itself does not
// depend on //pipe, and //pipe never depends on //model_parallel.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.h"

namespace fairscale::model_parallel {

struct ParallelGrid {
  // Sizes: tensor * pipeline * data == world->size().
  int64_t tensor = 1;
  int64_t pipeline = 1;
  int64_t data = 1;
  // This rank's coordinates: tensor_rank in [0, tensor), stage in [0, pipeline),
  // replica in [0, data).
  int64_t tensor_rank = 0;
  int64_t stage = 0;
  int64_t replica = 0;
  std::shared_ptr<comm::Communicator> world;
  // The `tensor` ranks of this stage of this replica (consecutive world ranks);
  // rank == tensor_rank. For the tensor-parallel layers (layers.h).
  std::shared_ptr<comm::Communicator> tensor_group;
  // The `pipeline` ranks of this replica with this tensor_rank (world ranks `tensor` apart);
  // rank == stage. For pipe::Pipe::Create.
  std::shared_ptr<comm::Communicator> pipeline_group;
  // The `data` ranks with this (stage, tensor_rank) in every replica (world ranks
  // pipeline * tensor apart); rank == replica. For FSDP or the gradient all-reduce.
  std::shared_ptr<comm::Communicator> data_group;

  // The world ranks of each group, from the layout (no communication).
  std::vector<int64_t> tensor_ranks() const;
  std::vector<int64_t> pipeline_ranks() const;
  std::vector<int64_t> data_ranks() const;

  // One line for logs and error messages, e.g. for world rank 5 of a 2 x 2 x 2 grid:
  //   "rank 5/8: tensor 1/2 (ranks 4,5), stage 0/2 (ranks 5,7), replica 1/2 (ranks 1,5)"
  std::string describe() const;
};

// Builds the grid: data = world->size() / (tensor * pipeline). Collective over `world` and
// blocking: exactly three Splits, always in the order tensor, pipeline, data (also for a
// dimension of size 1, so every rank issues the same calls), each keyed by the rank's index
// along that dimension. Raises c10::Error (base/torch_error.h) "model_parallel::MakeParallelGrid
// (rank r/n): INVALID_ARGUMENT: ..." naming the sizes and the world size if `world` is null,
// tensor < 1, pipeline < 1, or tensor * pipeline does not divide the world size; and the Split's
// error if one fails. As with any Split, a rank must not destroy a group before every member
// has returned from MakeParallelGrid (the inproc backend then fails their Split with "domain
// ... is gone"): use the groups, or Barrier on `world`, before dropping the grid.
ParallelGrid MakeParallelGrid(std::shared_ptr<comm::Communicator> world, int64_t tensor,
                              int64_t pipeline);

}  // namespace fairscale::model_parallel
