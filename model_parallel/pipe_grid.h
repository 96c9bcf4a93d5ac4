// The pipe::PipeGrid view of a model_parallel::ParallelGrid (target //model_parallel:pipe_grid,
// header-only), for code written against pipe/grid.h (e.g. its all_reduce_gradients in
// deterministic mode, which wants grid.replica / grid.replicas): the pipeline group becomes
// PipeGrid::pipe and the data group PipeGrid::data. Kept out of //model_parallel so that the
// tensor-parallel layers do not pull //pipe in; //pipe never depends on //model_parallel.
//
//   ParallelGrid grid = MakeParallelGrid(world, /*tensor=*/2, /*pipeline=*/2);
//   pipe::PipeGrid pg = ToPipeGrid(grid);
//   auto pipe = pipe::Pipe::Create(stage_layers, pg.pipe, options);   // == grid.pipeline_group
#pragma once

#include "model_parallel/grid.h"
#include "pipe/grid.h"

namespace fairscale::model_parallel {

// No communication; shares the grid's communicators.
inline pipe::PipeGrid ToPipeGrid(const ParallelGrid& grid) {
  pipe::PipeGrid view;
  view.stages = grid.pipeline;
  view.replicas = grid.data;
  view.stage = grid.stage;
  view.replica = grid.replica;
  view.pipe = grid.pipeline_group;
  view.data = grid.data_group;
  return view;
}

}  // namespace fairscale::model_parallel
