#include "model_parallel/grid.h"

#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/torch_error.h"

namespace fairscale::model_parallel {
namespace {

// `count` world ranks starting at `first`, `stride` apart.
std::vector<int64_t> Ranks(int64_t first, int64_t stride, int64_t count) {
  std::vector<int64_t> ranks;
  ranks.reserve(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) ranks.push_back(first + i * stride);
  return ranks;
}

}  // namespace

std::vector<int64_t> ParallelGrid::tensor_ranks() const {
  return Ranks(replica * pipeline * tensor + stage * tensor, 1, tensor);
}

std::vector<int64_t> ParallelGrid::pipeline_ranks() const {
  return Ranks(replica * pipeline * tensor + tensor_rank, tensor, pipeline);
}

std::vector<int64_t> ParallelGrid::data_ranks() const {
  return Ranks(stage * tensor + tensor_rank, pipeline * tensor, data);
}

std::string ParallelGrid::describe() const {
  const int64_t rank = replica * pipeline * tensor + stage * tensor + tensor_rank;
  return absl::StrCat("rank ", rank, "/", tensor * pipeline * data, ": tensor ", tensor_rank, "/",
                      tensor, " (ranks ", absl::StrJoin(tensor_ranks(), ","), "), stage ", stage,
                      "/", pipeline, " (ranks ", absl::StrJoin(pipeline_ranks(), ","),
                      "), replica ", replica, "/", data, " (ranks ",
                      absl::StrJoin(data_ranks(), ","), ")");
}

ParallelGrid MakeParallelGrid(std::shared_ptr<comm::Communicator> world, int64_t tensor,
                              int64_t pipeline) {
  if (!world) {
    base::ThrowIfError(absl::InvalidArgumentError("null world communicator"),
                       "model_parallel::MakeParallelGrid");
  }
  const int64_t size = world->size();
  const std::string where =
      absl::StrCat("model_parallel::MakeParallelGrid (rank ", world->rank(), "/", size, ")");
  if (tensor < 1 || pipeline < 1) {
    base::ThrowIfError(
        absl::InvalidArgumentError(absl::StrCat("tensor = ", tensor, " and pipeline = ", pipeline,
                                                " must both be >= 1 (world size ", size, ")")),
        where);
  }
  if (size % (tensor * pipeline) != 0) {
    base::ThrowIfError(absl::InvalidArgumentError(absl::StrCat(
                           "tensor * pipeline = ", tensor, " * ", pipeline, " = ",
                           tensor * pipeline, " does not divide the world size ", size)),
                       where);
  }
  ParallelGrid grid;
  grid.tensor = tensor;
  grid.pipeline = pipeline;
  grid.data = size / (tensor * pipeline);
  const int64_t rank = world->rank();
  grid.tensor_rank = rank % tensor;
  grid.stage = (rank / tensor) % pipeline;
  grid.replica = rank / (tensor * pipeline);
  // Color: the flat index of the other two coordinates; key: the index along this dimension
  // (Split orders a group by key, so group rank == that index).
  grid.tensor_group =
      base::ValueOrThrow(world->Split(static_cast<int>(grid.replica * pipeline + grid.stage),
                                      static_cast<int>(grid.tensor_rank)),
                         absl::StrCat(where, " tensor group"));
  grid.pipeline_group =
      base::ValueOrThrow(world->Split(static_cast<int>(grid.replica * tensor + grid.tensor_rank),
                                      static_cast<int>(grid.stage)),
                         absl::StrCat(where, " pipeline group"));
  grid.data_group =
      base::ValueOrThrow(world->Split(static_cast<int>(grid.stage * tensor + grid.tensor_rank),
                                      static_cast<int>(grid.replica)),
                         absl::StrCat(where, " data group"));
  grid.world = std::move(world);
  return grid;
}

}  // namespace fairscale::model_parallel
